// SignSGD's encoding on the CPU (kernels/sign.cpp) against its rule in ATen ops: a bit per
// element (set: negative), one scale a chunk (the mean |x| of its elements), error feedback
// x - (+-scale), and the decoded mean of several ranks summed in rank order.
#include <commtune/kernels/sign.h>

#include <gtest/gtest.h>

#include <tuple>
#include <vector>

namespace {

// The chunk's scales as the rule has them: the mean |x| in double, rounded once to float.
at::Tensor rule_scales(const at::Tensor& x, int64_t chunk) {
  const int64_t n = x.numel(), chunks = (n + chunk - 1) / chunk;
  at::Tensor scales = at::empty({chunks}, at::kFloat);
  for (int64_t c = 0; c < chunks; ++c) {
    scales[c] = x.slice(0, c * chunk, std::min(n, (c + 1) * chunk)).to(at::kDouble).abs().mean().to(at::kFloat);
  }
  return scales;
}

// Each element's decoded value: -scale where negative, else +scale.
at::Tensor rule_decoded(const at::Tensor& x, int64_t chunk) {
  const at::Tensor per_element = rule_scales(x, chunk).repeat_interleave(chunk).slice(0, 0, x.numel());
  return at::where(x.to(at::kFloat) < 0, -per_element, per_element);
}

at::Tensor encode(const at::Tensor& x, const at::Tensor& error, const commtune::SignLayout& layout) {
  at::Tensor piece = at::full({layout.piece_bytes()}, 0xAB, at::kByte);  // poison
  commtune::sign_encode_(x, error, piece, layout);
  return piece;
}

class SignEncoding : public ::testing::TestWithParam<std::tuple<int64_t, int64_t>> {};

TEST_P(SignEncoding, BitsScalesAndErrorFollowTheRule) {
  const auto [n, chunk] = GetParam();
  at::manual_seed(n + chunk);
  const at::Tensor x = at::randn({n}) * at::pow(10.0, at::randint(-3, 3, {n}).to(at::kFloat));
  const auto layout = commtune::SignLayout::of(n, chunk);
  at::Tensor error = at::empty({n});
  const at::Tensor piece = encode(x, error, layout);
  const at::Tensor words = piece.slice(0, 0, 4 * layout.words()).view(at::kInt);
  const at::Tensor scales = piece.slice(0, 4 * layout.words()).view(at::kFloat);
  EXPECT_TRUE(at::equal(scales, rule_scales(x, chunk)));
  // bit i of the words: element i is negative (bits past n are 0)
  const at::Tensor shifts = at::arange(32, at::kInt);
  const at::Tensor bits = words.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and(1).view(-1);
  EXPECT_TRUE(at::equal(bits.slice(0, 0, n), (x < 0).to(at::kInt)));
  EXPECT_EQ(bits.slice(0, n).sum().item<int64_t>(), 0);
  EXPECT_TRUE(at::equal(error, x - rule_decoded(x, chunk)));
}

INSTANTIATE_TEST_SUITE_P(SizesAndChunks, SignEncoding,
                         ::testing::Combine(::testing::Values<int64_t>(1, 31, 1000, 65537),
                                            ::testing::Values<int64_t>(32, 256, 1024)));

TEST(SignDecoding, TheMeanOfRanksIsSummedInRankOrder) {
  const int64_t n = 5000, chunk = 256, ranks = 3;
  const auto layout = commtune::SignLayout::of(n, chunk);
  std::vector<at::Tensor> pieces;
  at::Tensor expected = at::zeros({n});
  for (int64_t r = 0; r < ranks; ++r) {
    at::manual_seed(10 + r);
    const at::Tensor x = at::randn({n}) * (r + 1);
    pieces.push_back(encode(x, at::Tensor(), layout));
    expected = expected + rule_decoded(x, chunk);  // float sums, one rank at a time
  }
  at::Tensor out = at::full({n}, 777.0);
  commtune::sign_decode_mean_(at::cat(pieces), out, ranks, layout);
  EXPECT_TRUE(at::equal(out, expected / static_cast<float>(ranks)));
}

TEST(SignChecks, RefusesBadArguments) {
  EXPECT_THROW(commtune::SignLayout::of(100, 48), c10::Error);
  const auto layout = commtune::SignLayout::of(100, 32);
  EXPECT_THROW(commtune::sign_encode_(at::randn({100}), at::Tensor(), at::empty({3}, at::kByte), layout), c10::Error);
  EXPECT_THROW(commtune::sign_encode_(at::randn({99}), at::Tensor(), at::empty({layout.piece_bytes()}, at::kByte),
                                      layout),
               c10::Error);
  EXPECT_THROW(commtune::sign_decode_mean_(at::empty({layout.piece_bytes()}, at::kByte), at::empty({100}), 2, layout),
               c10::Error);
  EXPECT_THROW(commtune::sign_decode_mean_(at::empty({layout.piece_bytes()}, at::kByte), at::empty({100}), 0, layout),
               c10::Error);
}

// Error feedback's add in the encoding: the bucket added to the error buffer, then the sum
// encoded and its error kept, as error.add_(bucket) and encoding the buffer into itself.
TEST(SignEncodingAccumulates, AsAddThenEncode) {
  at::manual_seed(4);
  const int64_t n = 5000;
  const auto layout = commtune::SignLayout::of(n, 1024);
  const at::Tensor bucket = at::randn({n}), start = at::randn({n});
  at::Tensor fused = start.clone(), added = start + bucket;
  at::Tensor pieces[2] = {at::empty({layout.piece_bytes()}, at::kByte), at::empty({layout.piece_bytes()}, at::kByte)};
  commtune::sign_encode_(bucket, fused, pieces[0], layout, /*accumulate=*/true);
  commtune::sign_encode_(added, added, pieces[1], layout);
  EXPECT_TRUE(at::equal(pieces[0], pieces[1]));
  EXPECT_TRUE(at::equal(fused, added));
  EXPECT_THROW(commtune::sign_encode_(bucket, at::Tensor(), pieces[0], layout, true), c10::Error);
}

} // namespace
