#include <commtune/kernels/cast_scale.h>

#include <gtest/gtest.h>

#include <limits>

namespace {

at::Tensor reference(const at::Tensor& src, double scale, at::ScalarType dtype) {
  return (src.to(at::kFloat) * scale).to(dtype);
}

class CastScale : public ::testing::TestWithParam<std::tuple<at::ScalarType, int64_t>> {};

TEST_P(CastScale, MatchesPlainAtenBitForBit) {
  const auto [dtype, n] = GetParam();
  at::manual_seed(n);
  at::Tensor src = at::randn({n}) * at::pow(10.0, at::randint(-6, 6, {n}).to(at::kFloat));
  if (n > 4) {
    src[0] = std::numeric_limits<float>::infinity();
    src[1] = std::numeric_limits<float>::quiet_NaN();
    src[2] = 1e6;  // overflows fp16 unless scaled first
  }
  at::Tensor out = at::full({n}, 777.0, at::TensorOptions().dtype(dtype));  // poison
  commtune::cast_scale_(src, 0.125, out);
  at::Tensor expected = reference(src, 0.125, dtype);
  EXPECT_TRUE(at::equal(at::isnan(out), at::isnan(expected)));
  at::Tensor finite = ~at::isnan(expected);
  EXPECT_TRUE(at::equal(out.masked_select(finite), expected.masked_select(finite)));
}

INSTANTIATE_TEST_SUITE_P(DtypesAndSizes, CastScale,
                         ::testing::Combine(::testing::Values(at::kHalf, at::kBFloat16),
                                            ::testing::Values<int64_t>(1, 9, 4097, 1 << 20)));

TEST(CastScaleChecks, RefusesMismatchedSizes) {
  at::Tensor out = at::empty({3}, at::kHalf);
  EXPECT_THROW(commtune::cast_scale_(at::ones({4}), 1.0, out), c10::Error);
}

TEST(CastScaleChecks, RefusesIntegerInput) {
  EXPECT_THROW(commtune::cast_scale(at::ones({4}, at::kInt), 1.0, at::kHalf), c10::Error);
}

TEST(CastScaleChecks, RefusesNonContiguousInput) {
  EXPECT_THROW(commtune::cast_scale(at::ones({4, 4}).t(), 1.0, at::kHalf), c10::Error);
}

} // namespace
