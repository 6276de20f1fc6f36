// Quantize's passes on the CPU (kernels/quantize.cpp), rounding to nearest: every element comes
// back within half a code's step of its value, the error buffer holds exactly what was lost, and
// reducing a shard that every rank sent alike gives back its codes.
#include <commtune/kernels/quantize.h>

#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

namespace {

using commtune::QuantizeLayout;
using commtune::quant::Codes;

constexpr int64_t kNearest = -1;  // draws: round to nearest

at::Tensor bucket(int64_t n) {
  at::manual_seed(n);
  return at::randn({n}) * at::pow(10.0, at::randint(-4, 4, {n}).to(at::kFloat));
}

// Each element's chunk absmax (chunks of `chunk` elements from the bucket's start: shards are
// whole chunks, so a shard's chunks are the bucket's).
at::Tensor chunk_absmax(const at::Tensor& x, int64_t chunk) {
  const int64_t n = x.numel(), chunks = (n + chunk - 1) / chunk;
  const at::Tensor padded = at::cat({x.abs(), at::zeros({chunks * chunk - n})});
  return std::get<0>(padded.view({chunks, chunk}).max(1)).repeat_interleave(chunk).slice(0, 0, n);
}

class QuantizeRoundTrip : public ::testing::TestWithParam<std::tuple<std::string, int64_t, int64_t>> {};

TEST_P(QuantizeRoundTrip, WithinHalfAStepAndTheErrorIsWhatWasLost) {
  const auto [name, n, ranks] = GetParam();
  const Codes kind = commtune::codes_named(name);
  const auto layout = QuantizeLayout::of(n, ranks, 256, kind);
  const at::Tensor x = bucket(n);
  at::Tensor error = at::empty({n});
  at::Tensor packed = at::full({ranks * layout.piece_bytes()}, 0xAB, at::kByte);  // poison
  commtune::quantize_shards_(x, error, packed, layout, kNearest);
  at::Tensor out = at::full({n}, 777.0);
  commtune::dequantize_shards_(packed, out, layout);
  EXPECT_TRUE(at::equal(error, x - out));  // exactly: the sum is a float's
  const at::Tensor scale = chunk_absmax(x, 256) / commtune::quant::top_of(kind);
  // int codes: half a step of the scale; e4m3: half of its 3-bit mantissa's step, or of the
  // subnormal step (2^-9 of the scale) near zero; a little over for the scale's own rounding
  const at::Tensor bound = kind == Codes::e4m3 ? at::maximum(x.abs() * 0.0625, scale * 0.0009765625) : scale * 0.5;
  EXPECT_TRUE((error.abs() <= bound * (1 + 1e-5) + 1e-30).all().item<bool>()) << name;
}

INSTANTIATE_TEST_SUITE_P(KindsSizesAndRanks, QuantizeRoundTrip,
                         ::testing::Combine(::testing::Values("int8", "int4", "e4m3"),
                                            ::testing::Values<int64_t>(1, 1000, 100003),
                                            ::testing::Values<int64_t>(1, 3, 8)));

TEST(QuantizeReduce, AShardEveryRankSentAlikeKeepsItsCodes) {
  for (const std::string name : {"int8", "int4", "e4m3"}) {
    const int64_t n = 20000, ranks = 2;
    const auto layout = QuantizeLayout::of(n, ranks, 256, commtune::codes_named(name));
    at::Tensor packed = at::empty({ranks * layout.piece_bytes()}, at::kByte);
    commtune::quantize_shards_(bucket(n), at::Tensor(), packed, layout, kNearest);
    for (int64_t s = 0; s < ranks; ++s) {
      const at::Tensor mine = packed.slice(0, s * layout.piece_bytes(), (s + 1) * layout.piece_bytes());
      at::Tensor reduced = at::empty({layout.piece_bytes()}, at::kByte);
      // two ranks' equal decoded values sum to twice theirs exactly; halved, they re-encode alike
      commtune::reduce_shard_(at::cat({mine, mine}), reduced, layout, 2, kNearest);
      const int64_t codes = layout.code_bytes();
      EXPECT_TRUE(at::equal(reduced.slice(0, 0, codes), mine.slice(0, 0, codes))) << name << " shard " << s;
      EXPECT_TRUE(at::allclose(reduced.slice(0, codes).view(at::kFloat), mine.slice(0, codes).view(at::kFloat), 1e-6))
          << name << " shard " << s;
    }
  }
}

TEST(QuantizeChecks, RefusesBadArguments) {
  EXPECT_THROW(QuantizeLayout::of(100, 2, 12), c10::Error);
  EXPECT_THROW(QuantizeLayout::of(100, 0, 256), c10::Error);
  EXPECT_THROW(commtune::codes_named("int2"), c10::Error);
  const auto layout = QuantizeLayout::of(100, 2, 256);
  EXPECT_THROW(commtune::quantize_shards_(at::randn({100}), at::Tensor(), at::empty({3}, at::kByte), layout, 0),
               c10::Error);
  EXPECT_THROW(commtune::dequantize_shards_(at::empty({2 * layout.piece_bytes()}, at::kByte), at::empty({99}), layout),
               c10::Error);
}

// Error feedback's add in the encoding: the bucket added to the error buffer, then the sum
// encoded and its error kept, as error.add_(bucket) and encoding the buffer into itself.
TEST(QuantizeAccumulates, AsAddThenEncode) {
  const int64_t n = 9001, ranks = 3;
  const at::Tensor x = bucket(n), start = bucket(n + 1).slice(0, 0, n).clone();
  for (const char* name : {"int8", "int4", "e4m3"}) {
    const auto layout = QuantizeLayout::of(n, ranks, 256, commtune::codes_named(name));
    at::Tensor fused = start.clone(), added = start + x;
    at::Tensor packed[2] = {at::empty({ranks * layout.piece_bytes()}, at::kByte),
                            at::empty({ranks * layout.piece_bytes()}, at::kByte)};
    commtune::quantize_shards_(x, fused, packed[0], layout, 17, /*accumulate=*/true);
    commtune::quantize_shards_(added, added, packed[1], layout, 17);
    EXPECT_TRUE(at::equal(packed[0], packed[1])) << name;
    EXPECT_TRUE(at::equal(fused, added)) << name;
  }
  const auto layout = QuantizeLayout::of(n, ranks, 256, Codes::int8);
  EXPECT_THROW(commtune::quantize_shards_(x, at::Tensor(), at::empty({ranks * layout.piece_bytes()}, at::kByte),
                                          layout, kNearest, true),
               c10::Error);
}

} // namespace
