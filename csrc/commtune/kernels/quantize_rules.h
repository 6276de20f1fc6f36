#pragma once
// The arithmetic of the quantized codes, shared by the CPU loops and the CUDA kernels so both
// give the same bits. Every chunk is scaled by its absmax onto the codes' range, then rounded
// stochastically (unbiased) or to nearest; the random bits come from a counter-based hash of
// (seed, element index), one 64-bit hash per four elements, 16 bits each.
//   int8: integers in [-127, 127] (0 is exact), floor(y + u) for a uniform draw u (u = 0.5 to
//         nearest, ties away from zero).
//   int4: integers in [-7, 7], two per byte (the even element in the low half), stored plus 8.
//   e4m3: fp8 bytes in the e4m3fn layout torch calls float8_e4m3fn (|value| <= 448). The scaled
//         value's fp32 bits plus random bits below its 3 kept mantissa bits, then truncated: the
//         carry rounds up with the probability of the dropped fraction, and into the exponent
//         where the mantissa overflows. To nearest: ties to even, as torch's own conversion.
//         Integer arithmetic: no fp8 hardware needed, the same bits everywhere.
// Products and sums use round-to-nearest intrinsics on the GPU so that --use_fast_math cannot
// fuse or approximate them; where a product and a sum are fused (the reduce), it is written so,
// and the CPU fuses them too (std::fmaf). The GPU's int/float conversions run at a quarter of
// the adders' rate, so exact small integers go through a float's mantissa instead (see
// small_int_to_float).
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define COMMTUNE_HD __host__ __device__ __forceinline__
#else
#define COMMTUNE_HD inline
#endif

namespace commtune::quant {

enum class Codes : int { int8 = 0, int4 = 1, e4m3 = 2 };

COMMTUNE_HD constexpr int bits_of(Codes codes) { return codes == Codes::int4 ? 4 : 8; }

// The largest code magnitude: a chunk's absmax maps onto it.
COMMTUNE_HD float top_of(Codes codes) {
  return codes == Codes::int8 ? 127.0f : codes == Codes::int4 ? 7.0f : 448.0f;
}

COMMTUNE_HD float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

COMMTUNE_HD float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// a * b + c rounded once (the exact product is never rounded on its own).
COMMTUNE_HD float mul_add(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fmaf(a, b, c);
#endif
}

COMMTUNE_HD float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// Division by a per-kernel integer n (the ranks of a mean). When n is a power of two, a * (1/n)
// is the same correctly rounded number as a / n, and a multiply is far cheaper than the GPU's
// exact division; other n divide.
struct Divisor {
  float n = 1.0f;
  float inverse = 1.0f;  // 1/n when n is a power of two, else 0

  static Divisor of(int64_t n) {
    Divisor d;
    d.n = static_cast<float>(n);
    d.inverse = n > 0 && (n & (n - 1)) == 0 ? 1.0f / static_cast<float>(n) : 0.0f;
    return d;
  }
  COMMTUNE_HD float apply(float a) const { return inverse != 0.0f ? mul(a, inverse) : div(a, n); }
};

// a / b for non-negative a and positive b: in 32 bits when both fit (a 64-bit division is a long
// software routine on the GPU, and kernels that index chunks compute one per lane or element).
COMMTUNE_HD int64_t quotient(int64_t a, int64_t b) {
  if (a <= INT32_MAX && b <= INT32_MAX) return static_cast<uint32_t>(a) / static_cast<uint32_t>(b);
  return a / b;
}

// splitmix64's finalizer: one 64-bit word from another, well mixed.
COMMTUNE_HD uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

// Where group `group` (four elements) of the stream `seed` enters the mixer.
COMMTUNE_HD uint64_t stream_point(uint64_t seed, uint64_t group) { return seed + (group + 1) * kGolden; }

// 16 random bits for each of elements index..index+3 of the stream `seed` (index a multiple of
// 4), or kHalf16 each when seed < 0 (rounding to nearest): the four quarters of one mix, which is
// most of a draw's cost. 16 bits bound the rounding's bias by 2^-16 of a step.
constexpr uint32_t kHalf16 = 0x8000u;

// The four draws of the group entering the mixer at `point` (stream_point's value: kernels that
// encode many groups step their points by kGolden rather than recompute each).
COMMTUNE_HD void four_random_at(uint64_t point, uint32_t (&random)[4]) {
  const uint64_t z = mix(point);
  for (int k = 0; k < 4; ++k) random[k] = static_cast<uint32_t>(z >> (16 * k)) & 0xFFFFu;
}

COMMTUNE_HD void four_random(int64_t seed, uint64_t index, uint32_t (&random)[4]) {
  if (seed < 0) {
    for (int k = 0; k < 4; ++k) random[k] = kHalf16;
    return;
  }
  four_random_at(stream_point(static_cast<uint64_t>(seed), index / 4), random);
}

COMMTUNE_HD uint32_t float_bits(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  return bits;
}

COMMTUNE_HD float float_from_bits(uint32_t bits) {
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
}

// A draw in [0, 1) from 16 random bits (0x8000: one half, rounding to nearest): the float
// 1 + bits * 2^-16, its bits laid into the mantissa's top, less 1. Exact, and the GPU needs no
// int-to-float conversion (a quarter of the adders' rate).
COMMTUNE_HD float uniform_of(uint32_t bits16) { return add(float_from_bits(0x3F800000u | bits16 << 7), -1.0f); }

#if defined(__CUDACC__)
// n from the float 2^23 + n + bias, whose bits are 0x4B000000 | (n + bias).
__device__ __forceinline__ float small_int_from_magic(uint32_t magic, uint32_t bias) {
  return __fsub_rn(__uint_as_float(magic), static_cast<float>(8388608u + bias));
}
#endif

// A small integer n (|n| < 2^22, given as n + bias >= 0) as a float, exactly. On the GPU without
// the int-to-float unit: n + bias laid into the mantissa of 2^23, less 2^23 + bias.
COMMTUNE_HD float small_int_to_float(uint32_t biased, uint32_t bias) {
#if defined(__CUDA_ARCH__)
  return small_int_from_magic(0x4B000000u | biased, bias);
#else
  return static_cast<float>(static_cast<int32_t>(biased) - static_cast<int32_t>(bias));
#endif
}

// The reverse: an integral float y with |y| <= 128 as the low byte of y's two's complement. On
// the GPU y + 2^23 + 128 puts y + 128 in the mantissa's low byte; flipping its top bit is y.
COMMTUNE_HD uint8_t small_float_to_byte(float y) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint8_t>((__float_as_uint(__fadd_rn(y, 8388736.0f)) & 0xFFu) ^ 0x80u);
#else
  return static_cast<uint8_t>(static_cast<int8_t>(y));
#endif
}

// The larger of m and |x|, NaN where either is: a chunk holding a NaN gets a NaN scale, so that
// every rank sees it (fmaxf would drop it). Inf stays Inf.
COMMTUNE_HD float max_magnitude(float m, float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;  // abs in the same asm: one FMNMX.NAN with |x| (the build's abs.ftz does not fold)
  asm("{ .reg .f32 a; abs.f32 a, %2; max.NaN.f32 %0, %1, a; }" : "=f"(r) : "f"(m), "f"(x));
  return r;
#else
#if defined(__CUDA_ARCH__)
  const float a = fabsf(x);
#else
  const float a = std::fabs(x);
#endif
  return a > m || a != a ? a : m;
#endif
}

constexpr uint32_t kQuietNanBits = 0x7FC00000u;  // the NaN written where an overflow must show

// Whether a chunk's scale is finite. An Inf or NaN scale marks a chunk that held an Inf or a NaN
// (or overflowed): it goes on the wire as it is, its values decode to Inf or NaN on every rank,
// and the reduce makes the chunk's sum NaN.
COMMTUNE_HD bool finite_scale(float scale) { return scale <= 3.40282347e38f; }

// The reduced chunk's scale to store: NaN where a rank's scale of the chunk was not finite
// (its sum is not a number; the re-encoded scale may not say so, since sums of Inf and -Inf
// codes are NaN, which the absmax of finite ones does not always keep).
COMMTUNE_HD float reduced_scale(float scale, bool ranks_finite) {
  return ranks_finite ? scale : float_from_bits(kQuietNanBits);
}

// What a code keeps back of value x for error feedback: x less its level times the scale; nothing
// where the scale is not finite (the step that overflowed is the loss scaler's to skip, and an
// Inf or NaN kept here would spoil every later step).
COMMTUNE_HD float error_of(float x, float level, float scale) {
  return finite_scale(scale) ? add(x, -mul(level, scale)) : 0.0f;
}

// A chunk whose scale would be subnormal (absmax below ~top * 2^-126) gets scale 0 and codes 0:
// its values stay in the error feedback. The GPU's division flushes such a quotient to zero (the
// build's --use_fast_math); the CPU does the same, where the scale's inverse would overflow and
// encode the chunk's zeros as -top.
COMMTUNE_HD float scale_of(float absmax, Codes codes) {
  const float scale = div(absmax, top_of(codes));
#if !defined(__CUDA_ARCH__)
  if (scale < 1.17549435e-38f) return 0.0f;  // FLT_MIN; NaN stays NaN
#endif
  return scale;
}

COMMTUNE_HD float inverse(float scale) { return scale > 0.0f ? div(1.0f, scale) : 0.0f; }

// a's fp32 bits (2^-6 <= a <= 448: e4m3's normal range) rounded to e4m3's 3 mantissa bits:
// returns the kept fp32 bits (the code's value) and sets `magnitude` to e4m3's 7 bits (8..126).
// Stochastically the 20 bits below the kept ones get the 16 random bits at their top; to
// nearest, half of them plus the kept lowest bit (ties to even). fp32 exponent 127 + e becomes
// e4m3's 7 + e; 448 = 0x43E00000 never carries past 0x7E.
COMMTUNE_HD uint32_t e4m3_round_normal(uint32_t bits, uint32_t random, bool nearest, uint32_t& magnitude) {
  const uint32_t rounded = bits + (nearest ? 0x7FFFFu + ((bits >> 20) & 1u) : random << 4);
  magnitude = (rounded >> 20) - (120u << 3);
  return rounded & 0xFFF00000u;
}

// y (already scaled, |y| <= 448 up to rounding) as an e4m3fn byte: 3 mantissa bits, exponent
// bias 7, subnormals below 2^-6 in steps of 2^-9. `random`: 16 random bits (ignored to nearest).
// `level` = the byte's value (decode_e4m3's), which the rounding leaves in hand: the fp32 bits
// cut below the kept mantissa, or the subnormal steps times 2^-9.
COMMTUNE_HD uint8_t encode_e4m3(float y, uint32_t random, bool nearest, float& level) {
  const float a = fminf(fabsf(y), 448.0f);
  const uint32_t bits = float_bits(a);
  uint32_t magnitude;
  float kept;
  if (bits < 0x3C800000u) {  // a < 2^-6: the subnormal codes count steps of 2^-9
    const float steps = mul(a, 512.0f);  // exact
    const float rounded = nearest ? rintf(steps) : floorf(add(steps, uniform_of(random)));
    magnitude = static_cast<uint32_t>(rounded);
    kept = mul(rounded, 0.001953125f);  // exact
  } else {
    kept = float_from_bits(e4m3_round_normal(bits, random, nearest, magnitude));
  }
  const bool negative = magnitude != 0 && y < 0.0f;  // code 0 is +0
  level = negative ? -kept : kept;
  return static_cast<uint8_t>(magnitude | (negative ? 0x80u : 0u));
}

// An e4m3fn byte's value. Its 7 magnitude bits, put under an fp32 exponent biased by 120 more,
// are the value for exponents 1..15; for subnormals (exponent 0, m * 2^-9) the same bits read
// 2^-7 + m * 2^-10, which twice, less 2^-6, is the value. All exact, no conversion unit.
COMMTUNE_HD float decode_e4m3(uint8_t code) {
  const float v = float_from_bits((static_cast<uint32_t>(code & 0x7Fu) << 20) + (120u << 23));
  const float magnitude = (code & 0x78u) != 0 ? v : add(add(v, v), -0.015625f);
  return float_from_bits(float_bits(magnitude) | static_cast<uint32_t>(code & 0x80u) << 24);
}

// x as a code (the byte, for e4m3), given the chunk's inverse scale and 16 random bits;
// `level` = the code's value before scaling (decode's value over the scale), for the error.
COMMTUNE_HD int8_t encode(float x, float inverse_scale, uint32_t random, bool nearest, Codes codes, float& level) {
  if (codes == Codes::e4m3) return static_cast<int8_t>(encode_e4m3(mul(x, inverse_scale), random, nearest, level));
  const float y = floorf(add(mul(x, inverse_scale), uniform_of(random)));
  const float top = top_of(codes);
  level = fminf(fmaxf(y, -top), top);
  return static_cast<int8_t>(small_float_to_byte(level));
}

// A code as stored (int8: its byte; int4: its nibble, the code plus 8; e4m3: its byte) as its
// level: the value before the chunk's scale.
COMMTUNE_HD float level_of_stored(uint32_t stored, Codes codes) {
  return codes == Codes::e4m3 ? decode_e4m3(static_cast<uint8_t>(stored))
         : codes == Codes::int8 ? small_int_to_float(stored ^ 0x80u, 128u)
                                : small_int_to_float(stored, 8u);
}

COMMTUNE_HD float level_of(int8_t code, Codes codes) {
  return level_of_stored(codes == Codes::int4 ? static_cast<uint32_t>(code + 8) : static_cast<uint8_t>(code), codes);
}

// A code (int4: -7..7) times the chunk's scale.
COMMTUNE_HD float decode(int8_t code, float scale, Codes codes) { return mul(level_of(code, codes), scale); }

// How the reduce adds up the ranks' codes of a chunk, one rounding a code. e4m3 codes: sum +
// level times scale, in rank order. int8 and int4 codes: their stored values (code + bias, never
// negative) times the scale, in rank order, and at the end (finish_sum) less bias times the sum of
// the ranks' scales. The GPU reads a stored byte as the bits of a subnormal float, whose value is
// linear in them (no implicit leading one), so a code costs a byte permute and a fused
// multiply-add, with no subtraction of the bias (quant_words::SubnormalSums).
COMMTUNE_HD constexpr uint32_t bias_of(Codes codes) {
  return codes == Codes::int8 ? 128u : codes == Codes::int4 ? 8u : 0u;
}

COMMTUNE_HD float add_decoded(float sum, int8_t code, float scale, Codes codes) {
  const float term = codes == Codes::e4m3 ? level_of(code, codes)
                                          : static_cast<float>(code + static_cast<int>(bias_of(codes)));
  return mul_add(term, scale, sum);
}

// The chunk's sum from add_decoded's, given the sum of the ranks' scales in rank order.
COMMTUNE_HD float finish_sum(float sum, float scale_sum, Codes codes) {
  return codes == Codes::e4m3 ? sum : add(sum, -mul(static_cast<float>(bias_of(codes)), scale_sum));
}

// Values v[0..3] as codes and their levels, given their draws (four_random's).
COMMTUNE_HD void encode_four_drawn(const float* v, const uint32_t (&random)[4], bool nearest, float inverse_scale,
                                   Codes codes, int8_t (&q)[4], float (&level)[4]) {
  for (int k = 0; k < 4; ++k) q[k] = encode(v[k], inverse_scale, random[k], nearest, codes, level[k]);
}

// Values v[0..3], elements index..index+3 of a chunk (see four_random), as codes and their levels.
COMMTUNE_HD void encode_four(const float* v, uint64_t index, int64_t draws, float inverse_scale, Codes codes,
                             int8_t (&q)[4], float (&level)[4]) {
  uint32_t random[4];
  four_random(draws, index, random);
  encode_four_drawn(v, random, draws < 0, inverse_scale, codes, q, level);
}

// Codes j..j+3 of a chunk whose codes start at `codes` (j a multiple of 4): one 4- or 2-byte access.
COMMTUNE_HD void store_four_codes(uint8_t* codes, int64_t j, const int8_t (&q)[4], Codes kind) {
  if (bits_of(kind) == 8) {
    *reinterpret_cast<uint32_t*>(codes + j) = static_cast<uint32_t>(static_cast<uint8_t>(q[0])) |
                                              static_cast<uint32_t>(static_cast<uint8_t>(q[1])) << 8 |
                                              static_cast<uint32_t>(static_cast<uint8_t>(q[2])) << 16 |
                                              static_cast<uint32_t>(static_cast<uint8_t>(q[3])) << 24;
  } else {
    *reinterpret_cast<uint16_t*>(codes + j / 2) =
        static_cast<uint16_t>((q[0] + 8) | (q[1] + 8) << 4 | (q[2] + 8) << 8 | (q[3] + 8) << 12);
  }
}

COMMTUNE_HD void load_four_codes(const uint8_t* codes, int64_t j, Codes kind, int8_t (&q)[4]) {
  if (bits_of(kind) == 8) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(codes + j);
    for (int k = 0; k < 4; ++k) q[k] = static_cast<int8_t>(static_cast<uint8_t>(w >> (8 * k)));
  } else {
    const uint16_t w = *reinterpret_cast<const uint16_t*>(codes + j / 2);
    for (int k = 0; k < 4; ++k) q[k] = static_cast<int8_t>((w >> (4 * k)) & 15) - 8;
  }
}

} // namespace commtune::quant
