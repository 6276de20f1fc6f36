// TopK's threshold selection on the CPU (kernels/top_k.cpp) against its rule written in ATen
// ops: the threshold is the want-th largest |x| of the sample, and the first k entries (by index)
// at or above it are taken; unused slots send 0 at index 0.
#include <commtune/kernels/top_k.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

struct Taken {
  at::Tensor values;   // float32, k
  at::Tensor indices;  // int32, k
  int64_t qualifying = 0;
};

Taken rule(const at::Tensor& x, int64_t k) {
  const auto sample = commtune::TopKSample::of(x.numel(), k);
  const at::Tensor drawn = x.slice(0, 0, sample.size * sample.stride, sample.stride).to(at::kFloat).abs();
  const float threshold = std::get<0>(drawn.topk(sample.want))[sample.want - 1].item<float>();
  const at::Tensor qualifying = (x.to(at::kFloat).abs() >= threshold).nonzero().view(-1);
  const at::Tensor taken = qualifying.slice(0, 0, k);
  Taken t{at::zeros({k}, at::kFloat), at::zeros({k}, at::kInt), qualifying.numel()};
  t.values.slice(0, 0, taken.numel()).copy_(x.index_select(0, taken).to(at::kFloat));
  t.indices.slice(0, 0, taken.numel()).copy_(taken.to(at::kInt));
  return t;
}

Taken pick(const at::Tensor& x, int64_t k, bool clear) {
  at::Tensor piece = at::full({2 * k}, -1, at::kInt);  // not zeros: the call must clear unused slots
  at::Tensor count = at::full({1}, -1, at::kLong);
  commtune::threshold_top_k_(x, k, piece, count, clear);
  return {piece.slice(0, 0, k).view(at::kFloat), piece.slice(0, k), count.item<int64_t>()};
}

// A bucket with many magnitudes, ties among its zeros, and the stride's entries not special.
at::Tensor bucket(int64_t n, at::ScalarType dtype) {
  at::manual_seed(n);
  at::Tensor x = at::randn({n});
  x.slice(0, 0, n, 7).mul_(1e-3);
  x.slice(0, 0, n, 11).zero_();
  return x.to(dtype);
}

class ThresholdTopK : public ::testing::TestWithParam<std::tuple<at::ScalarType, std::tuple<int64_t, int64_t>, bool>> {};

TEST_P(ThresholdTopK, FollowsTheRule) {
  const auto [dtype, size, clear] = GetParam();
  const auto [n, k] = size;
  const at::Tensor x = bucket(n, dtype);
  const Taken expected = rule(x, k);
  at::Tensor on = x.clone();
  const Taken got = pick(on, k, clear);
  EXPECT_EQ(got.qualifying, expected.qualifying);
  EXPECT_TRUE(at::equal(got.indices, expected.indices));
  EXPECT_TRUE(at::equal(got.values, expected.values));
  at::Tensor cleared = x.clone();
  if (clear) cleared.index_fill_(0, expected.indices.slice(0, 0, std::min(expected.qualifying, k)).to(at::kLong), 0);
  EXPECT_TRUE(at::equal(on, cleared));  // cleared where taken, untouched elsewhere
}

INSTANTIATE_TEST_SUITE_P(
    DtypesSizesAndClear, ThresholdTopK,
    ::testing::Combine(::testing::Values(at::kFloat, at::kDouble, at::kHalf, at::kBFloat16),
                       ::testing::Values(std::make_tuple<int64_t, int64_t>(1000, 10),
                                         std::make_tuple<int64_t, int64_t>(16384, 164),
                                         std::make_tuple<int64_t, int64_t>(100003, 1000),
                                         std::make_tuple<int64_t, int64_t>(50, 50)),
                       ::testing::Bool()));

TEST(ThresholdTopKEdges, ClearingAlsoZeroesEveryInfAndNaN) {
  // Ties at 1000 fill the k picks before the Inf; the NaN never qualifies. Neither is taken, and
  // an error buffer must keep neither: clearing zeroes them with the picks.
  at::Tensor x = bucket(100000, at::kFloat);
  x.slice(0, 20000, 22000).fill_(1000.0);
  x[50000] = std::numeric_limits<float>::infinity();
  x[60000] = std::numeric_limits<float>::quiet_NaN();
  const Taken expected = rule(x, 1000);
  at::Tensor on = x.clone();
  const Taken got = pick(on, 1000, true);
  EXPECT_TRUE(at::equal(got.indices, expected.indices));
  EXPECT_TRUE(std::isnan(got.values[0].item<float>()));  // the overflow reaches every rank
  at::Tensor cleared = x.clone().index_fill_(0, expected.indices.to(at::kLong), 0);
  cleared[50000] = 0;
  cleared[60000] = 0;
  EXPECT_TRUE(at::equal(on, cleared));
}

TEST(ThresholdTopKEdges, AllZerosQualifyAndTheFirstKAreTaken) {
  const Taken got = pick(at::zeros({1000}), 10, false);
  EXPECT_EQ(got.qualifying, 1000);
  EXPECT_TRUE(at::equal(got.indices, at::arange(10, at::kInt)));
  EXPECT_TRUE(at::equal(got.values, at::zeros({10})));
}

TEST(ThresholdTopKEdges, FewerQualifyThanKAndTheRestSendNothing) {
  // The sample (every other entry) holds all the large entries: half of k qualify.
  at::manual_seed(3);
  at::Tensor x = at::randn({32768}) * 1e-6;
  x.slice(0, 0, 32768, 2).copy_(at::randn({16384}) * 10);
  const Taken expected = rule(x, 1000);
  const Taken got = pick(x, 1000, false);
  ASSERT_EQ(expected.qualifying, 500);
  EXPECT_EQ(got.qualifying, 500);
  EXPECT_TRUE(at::equal(got.indices, expected.indices));
  EXPECT_TRUE(at::equal(got.values, expected.values));
  EXPECT_TRUE(at::equal(got.values.slice(0, 500), at::zeros({500})));
  EXPECT_TRUE(at::equal(got.indices.slice(0, 500), at::zeros({500}, at::kInt)));
}

TEST(ThresholdTopKEdges, WithinTheSampleTheExactTopKIsTaken) {
  at::manual_seed(1);
  const at::Tensor x = at::randn({5000});  // every entry is sampled; no ties
  const Taken got = pick(x, 50, false);
  const at::Tensor exact = std::get<0>(std::get<1>(x.abs().topk(50)).sort());
  EXPECT_EQ(got.qualifying, 50);
  EXPECT_TRUE(at::equal(got.indices.to(at::kLong), exact));
  EXPECT_TRUE(at::equal(got.values, x.index_select(0, exact)));
}

TEST(ThresholdTopKChecks, RefusesBadArguments) {
  const at::Tensor x = at::randn({100});
  const at::Tensor count = at::empty({1}, at::kLong);
  EXPECT_THROW(commtune::threshold_top_k_(x, 101, at::empty({202}, at::kInt), count, false), c10::Error);
  EXPECT_THROW(commtune::threshold_top_k_(x, 0, at::empty({0}, at::kInt), count, false), c10::Error);
  EXPECT_THROW(commtune::threshold_top_k_(x, 11, at::empty({20}, at::kInt), count, false), c10::Error);
  EXPECT_THROW(commtune::threshold_top_k_(x.view({10, 10}), 10, at::empty({20}, at::kInt), count, false),
               c10::Error);
  EXPECT_THROW(commtune::threshold_top_k_(x.to(at::kInt), 10, at::empty({20}, at::kInt), count, false), c10::Error);
  EXPECT_THROW(commtune::threshold_top_k_(x, 10, at::empty({20}, at::kInt), at::empty({1}, at::kInt), false),
               c10::Error);
}

// Error feedback's add in the selection (x the error buffer, the addend the bucket): the same
// picks and buffer as x.add_(addend) and then the selection.
TEST(ThresholdTopKEdges, WithAnAddendPicksFromTheSum) {
  at::manual_seed(3);
  const at::Tensor x = at::randn({30000}), addend = at::randn({30000});
  const int64_t k = 300;
  at::Tensor fused = x.clone(), added = x + addend;
  at::Tensor pieces[2] = {at::empty({2 * k}, at::kInt), at::empty({2 * k}, at::kInt)};
  at::Tensor counts[2] = {at::empty({1}, at::kLong), at::empty({1}, at::kLong)};
  commtune::threshold_top_k_(fused, k, pieces[0], counts[0], true, addend);
  commtune::threshold_top_k_(added, k, pieces[1], counts[1], true);
  EXPECT_TRUE(at::equal(pieces[0], pieces[1]));
  EXPECT_TRUE(at::equal(counts[0], counts[1]));
  EXPECT_TRUE(at::equal(fused, added));
}

// TopK's decompression (top_k_place_) of pieces the selection wrote, three ranks whose buckets
// differ (one with few entries qualifying: a piece with unused slots), against the steps in ATen
// ops: a float32 zero bucket, index_add_ of each rank's picks in rank order, / 3, then the dtype.
TEST(TopKPlace, IsTheMeanOfTheRanksPicks) {
  constexpr int64_t n = 20000, k = 200, ranks = 3;
  std::vector<at::Tensor> pieces;
  at::Tensor total = at::zeros({n});
  for (int64_t r = 0; r < ranks; ++r) {
    at::Tensor x = bucket(n + r, at::kFloat).slice(0, 0, n).contiguous();
    // 205 entries far above the rest, all in the sample (its first 16384 entries): the 164th
    // largest of them is the threshold, so 164 qualify, and 36 slots stay unused
    if (r == 2) x.slice(0, 0, 16384, 80).mul_(1e4);
    at::Tensor piece = at::empty({2 * k}, at::kInt);
    commtune::threshold_top_k_(x, k, piece, at::empty({1}, at::kLong), false);
    const Taken expected = rule(x, k);
    const int64_t taken = std::min(expected.qualifying, k);
    if (r == 2) EXPECT_LT(taken, k);
    total.index_add_(0, expected.indices.slice(0, 0, taken).to(at::kLong), expected.values.slice(0, 0, taken));
    pieces.push_back(piece);
  }
  for (const auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16}) {
    at::Tensor out = at::full({n}, 7.0, dtype);
    commtune::top_k_place_(at::cat(pieces), out, ranks);
    EXPECT_TRUE(at::equal(out, total.div(ranks).to(dtype))) << dtype;
  }
}

TEST(TopKPlace, RefusesAPieceOutOfOrderAndLeavesTheBucket) {
  at::Tensor piece = at::zeros({8}, at::kInt);  // k = 4: picks at 5 and 9, then a value at 2
  piece.slice(0, 0, 3).view(at::kFloat).fill_(1.0f);
  piece[4] = 5;
  piece[5] = 9;
  piece[6] = 2;
  at::Tensor out = at::full({10}, 7.0f);
  EXPECT_THROW(commtune::top_k_place_(piece, out, 1), c10::Error);
  EXPECT_TRUE(at::equal(out, at::full({10}, 7.0f)));
  piece[2] = 0;  // value 0 at index 0: an unused slot
  piece[6] = 0;
  commtune::top_k_place_(piece, out, 1);
  EXPECT_EQ(out.nonzero().numel(), 2);
  EXPECT_THROW(commtune::top_k_place_(piece, out, 0), c10::Error);
  EXPECT_THROW(commtune::top_k_place_(piece.slice(0, 0, 6), out, 2), c10::Error);
}

} // namespace
