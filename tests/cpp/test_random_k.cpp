// RandomK's CPU passes (kernels/random_k.cpp) against the same steps in ATen ops at the draw's
// positions: taking (with and without clearing), an overflow reaching the first value, placing.
#include <commtune/kernels/random_k.h>

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

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
  const at::Tensor summed = at::randn({30000}).index_select(0, drawn);  // equal where a position repeats
  at::Tensor out = at::randn({30000});  // not zeros: every entry is written
  commtune::random_k_place_(summed, 11, out, 3);
  EXPECT_TRUE(at::equal(out, at::zeros({30000}).index_copy_(0, drawn, summed / 3)));
}

TEST(RandomKEdges, RefusesValuesOfAnotherDtype) {
  EXPECT_THROW(commtune::random_k_take_(at::randn({100}), 1, at::empty({10}, at::kDouble), false), c10::Error);
  EXPECT_THROW(commtune::random_k_place_(at::empty({10}), 1, at::zeros({100}), 0), c10::Error);
}

}  // namespace
