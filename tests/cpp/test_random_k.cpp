// RandomK's CPU passes (kernels/random_k.cpp) against the same steps in ATen ops at the draw's
// positions: the strata, taking (with and without clearing), an overflow reaching the first
// value, placing.
#include <commtune/kernels/random_k.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace {

at::Tensor positions(int64_t numel, int64_t k, uint64_t seed) { return commtune::random_k_positions(numel, k, seed); }

class RandomKTake : public ::testing::TestWithParam<std::tuple<at::ScalarType, bool>> {};

TEST_P(RandomKTake, GathersTheDrawnValuesAndClearsThem) {
  const auto [dtype, clear] = GetParam();
  at::manual_seed(1);
  const at::Tensor x = at::randn({20000}).to(dtype);
  const at::Tensor drawn = positions(20000, 700, 42);
  at::Tensor on = x.clone();
  at::Tensor values = at::full({700}, -7.0, dtype);  // not zeros: every value is written
  commtune::random_k_take_(on, 42, values, clear);
  EXPECT_TRUE(at::equal(values, x.index_select(0, drawn)));
  EXPECT_TRUE(at::equal(on, clear ? x.clone().index_fill_(0, drawn, 0) : x));
}

INSTANTIATE_TEST_SUITE_P(DtypesAndClear, RandomKTake,
                         ::testing::Combine(::testing::Values(at::kFloat, at::kDouble, at::kHalf, at::kBFloat16),
                                            ::testing::Bool()));

TEST(RandomKEdges, DrawsStayInTheBucketAndRepeatWithTheSeed) {
  const at::Tensor a = positions(1000003, 5000, 7);
  EXPECT_GE(a.min().item<int64_t>(), 0);
  EXPECT_LT(a.max().item<int64_t>(), 1000003);
  EXPECT_TRUE(at::equal(a, positions(1000003, 5000, 7)));
  EXPECT_LT(a.eq(positions(1000003, 5000, 8)).to(at::kFloat).mean().item<float>(), 0.01f);
}

TEST(RandomKEdges, EachDrawLiesInItsStratum) {
  for (const auto& [numel, k] : std::vector<std::pair<int64_t, int64_t>>{{100000, 3000}, {70001, 3}, {500, 500}, {7, 1}}) {
    const at::Tensor p = positions(numel, k, 9);
    for (int64_t s = 0; s < k; ++s) {
      EXPECT_GE(p[s].item<int64_t>(), s * numel / k);
      EXPECT_LT(p[s].item<int64_t>(), (s + 1) * numel / k);
    }
  }
}

TEST(RandomKEdges, FirstDrawAtOrAfterAnEntryMatchesTheDraws) {
  // What each CUDA block uses to find the draws in its slice, against a search of the positions.
  for (const auto& [numel, k] : std::vector<std::pair<int64_t, int64_t>>{{100000, 3000}, {70001, 3}, {500, 500}}) {
    const at::Tensor p = positions(numel, k, 13);
    auto check = [&](int64_t i) {
      const int64_t expected = at::searchsorted(p, at::scalar_tensor(i, at::kLong)).item<int64_t>();
      EXPECT_EQ(commtune::random_k_first_at_or_after(i, 13, numel, k), expected) << numel << " " << k << " " << i;
    };
    for (int64_t s = 0; s < k; ++s) {  // either side of each draw, where the answer changes
      const int64_t at = p[s].item<int64_t>();
      for (int64_t i = std::max<int64_t>(0, at - 1); i <= at + 1; ++i) check(i);
    }
    for (int64_t i = 0; i <= numel; i += 1009) check(i);
    check(numel);
  }
}

TEST(RandomKEdges, AnOverflowTheDrawMissesReachesTheFirstValueAndLeavesTheBuffer) {
  at::manual_seed(2);
  const at::Tensor drawn = positions(50000, 10, 3);
  int64_t missed = 0;
  while (drawn.eq(missed).any().item<bool>()) ++missed;
  at::Tensor x = at::randn({50000});
  x[missed] = std::numeric_limits<float>::infinity();
  at::Tensor on = x.clone();
  at::Tensor values = at::empty({10});
  commtune::random_k_take_(on, 3, values, true);
  EXPECT_TRUE(std::isnan(values[0].item<float>()));
  EXPECT_TRUE(at::equal(values.slice(0, 1), x.index_select(0, drawn).slice(0, 1)));
  at::Tensor expected = x.clone().index_fill_(0, drawn, 0);
  expected[missed] = 0;
  EXPECT_TRUE(at::equal(on, expected));
}

TEST(RandomKEdges, PlacesTheMeanAtTheDrawnPositionsAndZerosElsewhere) {
  at::manual_seed(4);
  const at::Tensor drawn = positions(30000, 3000, 11);
  const at::Tensor summed = at::randn({3000});
  at::Tensor out = at::randn({30000});  // not zeros: every entry is written
  commtune::random_k_place_(summed, 11, out, 3);
  EXPECT_TRUE(at::equal(out, at::zeros({30000}).index_copy_(0, drawn, summed / 3)));
}

TEST(RandomKEdges, RefusesValuesOfAnotherDtypeAndMoreValuesThanEntries) {
  EXPECT_THROW(commtune::random_k_take_(at::randn({100}), 1, at::empty({10}, at::kDouble), false), c10::Error);
  EXPECT_THROW(commtune::random_k_take_(at::randn({100}), 1, at::empty({101}), false), c10::Error);
  EXPECT_THROW(commtune::random_k_place_(at::empty({10}), 1, at::zeros({100}), 0), c10::Error);
}

// Error feedback's add in the take (x the error buffer, the addend the bucket): the same as
// x.add_(addend) and then the take.
TEST_P(RandomKTake, WithAnAddendTakesFromTheSum) {
  const auto [dtype, clear] = GetParam();
  at::manual_seed(2);
  const at::Tensor x = at::randn({20000}).to(dtype), addend = at::randn({20000}).to(dtype);
  const at::Tensor drawn = positions(20000, 700, 42);
  at::Tensor on = x.clone();
  at::Tensor values = at::full({700}, -7.0, dtype);
  commtune::random_k_take_(on, 42, values, clear, addend);
  const at::Tensor sum = x + addend;
  EXPECT_TRUE(at::equal(values, sum.index_select(0, drawn)));
  EXPECT_TRUE(at::equal(on, clear ? sum.clone().index_fill_(0, drawn, 0) : sum));
}

TEST(RandomKEdges, RefusesAnAddendOfAnotherDtypeOrLengthOrOverlappingInPart) {
  const at::Tensor values = at::empty({10});
  EXPECT_THROW(commtune::random_k_take_(at::randn({100}), 1, values, true, at::randn({100}, at::kDouble)), c10::Error);
  EXPECT_THROW(commtune::random_k_take_(at::randn({100}), 1, values, true, at::randn({99})), c10::Error);
  const at::Tensor both = at::randn({150});
  EXPECT_THROW(commtune::random_k_take_(both.slice(0, 0, 100), 1, values, true, both.slice(0, 50, 150)), c10::Error);
}

}  // namespace
