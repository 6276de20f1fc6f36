// The per-element rules of the quantized codes (quantize_rules.h), which the CPU loops and the
// CUDA kernels share: the levels the encoder hands back for the error must be the decoded codes,
// and the reduce's product and sum must be rounded once.
#include <commtune/kernels/quantize_rules.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace {

using commtune::quant::Codes;
namespace quant = commtune::quant;

uint32_t bits_of(float x) { return quant::float_bits(x); }

// Values across every e4m3 binade and its subnormals, both signs, and past 448 (clamped).
std::vector<float> scaled_values() {
  std::vector<float> values = {0.0f, -0.0f, 448.0f, -448.0f, 500.0f, 0.015625f, 0.001953125f, 0.0009765625f};
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> exponent(-12.0f, 9.2f);
  std::bernoulli_distribution negative(0.5);
  for (int i = 0; i < 200000; ++i) {
    const float v = std::exp2(exponent(gen));
    values.push_back(negative(gen) ? -v : v);
  }
  return values;
}

TEST(QuantizeRules, TheE4m3EncodersLevelIsItsCodesValue) {
  std::mt19937 gen(11);
  for (const float y : scaled_values()) {
    for (const bool nearest : {true, false}) {
      float level = NAN;
      const uint8_t code = quant::encode_e4m3(y, gen() & 0xFFFFu, nearest, level);
      ASSERT_EQ(bits_of(level), bits_of(quant::decode_e4m3(code))) << "y " << y << " code " << int(code);
    }
  }
}

TEST(QuantizeRules, TheIntegerEncodersLevelIsItsCodesValue) {
  std::mt19937 gen(13);
  for (const Codes codes : {Codes::int8, Codes::int4}) {
    for (const float y : scaled_values()) {
      const float x = y / 448.0f * quant::top_of(codes) * 1.01f;  // a few past the top, clamped
      for (const bool nearest : {true, false}) {
        float level = NAN;
        const int8_t code = quant::encode(x, 1.0f, gen() & 0xFFFFu, nearest, codes, level);
        ASSERT_EQ(bits_of(level), bits_of(quant::level_of(code, codes))) << "x " << x;
        ASSERT_LE(std::fabs(level), quant::top_of(codes));
      }
    }
  }
}

TEST(QuantizeRules, TheReducesProductAndSumAreRoundedOnce) {
  // (1 + 2^-23)(1 - 2^-23) - 1 is -2^-46: a rounded product (1.0f) would leave 0
  const float a = 1.0f + 0x1p-23f, b = 1.0f - 0x1p-23f;
  EXPECT_EQ(quant::add(quant::mul(a, b), -1.0f), 0.0f);
  EXPECT_EQ(quant::mul_add(a, b, -1.0f), -0x1p-46f);
  // a code times a scale plus a running sum: the exact result rounded once (double holds it)
  std::mt19937 gen(17);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (int i = 0; i < 100000; ++i) {
    const float code = std::round(unit(gen) * 127.0f), scale = std::fabs(unit(gen)) * 0.01f, sum = unit(gen);
    const float once = static_cast<float>(static_cast<double>(code) * scale + sum);
    ASSERT_EQ(bits_of(quant::mul_add(code, scale, sum)), bits_of(once));
  }
}

// A chunk's absmax keeps a NaN wherever it comes (std::max and fmaxf drop it), and Inf.
TEST(QuantizeRules, TheAbsmaxKeepsNanAndInf) {
  const float nan = std::nanf(""), inf = INFINITY;
  for (int at = 0; at < 4; ++at) {
    float m = 0.0f, with_inf = 0.0f;
    for (int j = 0; j < 4; ++j) {
      m = quant::max_magnitude(m, j == at ? nan : -2.0f * j);
      with_inf = quant::max_magnitude(with_inf, j == at ? -inf : 3.0f);
    }
    EXPECT_TRUE(std::isnan(m)) << at;
    EXPECT_EQ(with_inf, inf) << at;
  }
  EXPECT_EQ(quant::max_magnitude(quant::max_magnitude(0.0f, -5.0f), 2.0f), 5.0f);
}

// The error feedback keeps nothing of a chunk whose scale is not finite, and x - level * scale
// of the others.
TEST(QuantizeRules, NoErrorIsKeptOfANonFiniteChunk) {
  EXPECT_EQ(quant::error_of(1.5f, 1.0f, std::nanf("")), 0.0f);
  EXPECT_EQ(quant::error_of(INFINITY, 0.0f, INFINITY), 0.0f);
  EXPECT_EQ(quant::error_of(1.5f, 1.0f, 1.25f), 0.25f);
  EXPECT_TRUE(std::isnan(quant::reduced_scale(2.0f, false)));
  EXPECT_EQ(quant::reduced_scale(2.0f, true), 2.0f);
}

} // namespace
