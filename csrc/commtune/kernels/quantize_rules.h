#pragma once
// The arithmetic of the quantized codes, shared by the CPU loops and the CUDA kernels so both
// give the same bits. Every chunk is scaled by its absmax onto the codes' range, then rounded
// down after adding a uniform draw (unbiased; a draw of 0.5 rounds to nearest, ties away from
// zero); draws come from a counter-based hash of (seed, element index), one hash per pair.
//   int8: integers in [-127, 127] (0 is exact).
//   int4: integers in [-7, 7], two per byte (the even element in the low half), stored plus 8.
//   e4m3: fp8 bytes in the e4m3fn layout torch calls float8_e4m3fn (|value| <= 448), rounded
//         within the binade of the scaled value (to nearest: ties to even, as torch's own
//         conversion); done in integer and power-of-two arithmetic, so it needs no fp8
//         hardware and gives the same bits everywhere.
// Products and sums use round-to-nearest intrinsics on the GPU so that --use_fast_math cannot
// fuse or approximate them.
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

COMMTUNE_HD int bits_of(Codes codes) { return codes == Codes::int4 ? 4 : 8; }

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

// Where pair `pair` of the stream `seed` enters the mixer. Consecutive pairs are kGolden apart,
// so a run of them costs one 64-bit multiply (point + k * kGolden).
COMMTUNE_HD uint64_t stream_point(uint64_t seed, uint64_t pair) { return seed + (pair + 1) * kGolden; }

// A draw in [0, 1) from 24 random bits.
COMMTUNE_HD float uniform_of(uint64_t bits24) { return static_cast<float>(bits24) * (1.0f / 16777216.0f); }

// The draws for elements index..index+3 of the stream `seed` (index a multiple of 4), or 0.5 each
// (rounding to nearest) when seed < 0. Elements 2m and 2m+1 share pair m's mix, the top and the
// bottom 24 of its bits: the mixing, most of a draw's cost, is paid once per two elements.
COMMTUNE_HD void four_draws(int64_t seed, uint64_t index, float (&draw)[4]) {
  if (seed < 0) {
    for (int k = 0; k < 4; ++k) draw[k] = 0.5f;
    return;
  }
  const uint64_t point = stream_point(static_cast<uint64_t>(seed), index / 2);
  const uint64_t a = mix(point), b = mix(point + kGolden);
  draw[0] = uniform_of(a >> 40);
  draw[1] = uniform_of(a & 0xFFFFFFu);
  draw[2] = uniform_of(b >> 40);
  draw[3] = uniform_of(b & 0xFFFFFFu);
}

// 2^k for k in [-126, 127], built from its bits: scaling by it is exact and costs one multiply
// (frexpf/ldexpf are calls on the GPU).
COMMTUNE_HD float pow2(int k) {
  const uint32_t bits = static_cast<uint32_t>(k + 127) << 23;
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
}

// A small integer (|n| < 2^22) as a float, exactly. On the GPU without the int-to-float unit
// (a quarter of the adders' rate on Hopper): n + 2^23 + bias laid into a float's mantissa, less
// the same constant.
COMMTUNE_HD float small_int_to_float(uint32_t biased, uint32_t bias) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(__uint_as_float(0x4B000000u | biased), static_cast<float>(8388608u + bias));
#else
  return static_cast<float>(static_cast<int32_t>(biased) - static_cast<int32_t>(bias));
#endif
}

COMMTUNE_HD float scale_of(float absmax, Codes codes) { return div(absmax, top_of(codes)); }

COMMTUNE_HD float inverse(float scale) { return scale > 0.0f ? div(1.0f, scale) : 0.0f; }

// y (already scaled, |y| <= 448 up to rounding) as an e4m3fn byte: 3 mantissa bits, exponent
// bias 7, subnormals below 2^-6 in steps of 2^-9. q counts steps of the binade of |y|.
COMMTUNE_HD uint8_t encode_e4m3(float y, float draw) {
  const float a = fminf(fabsf(y), 448.0f);
  if (!(a > 0.0f)) return 0;
  uint32_t bits;
  memcpy(&bits, &a, sizeof bits);
  // a in [2^e, 2^(e+1)) from its exponent field (an fp32 subnormal reads -127), or e4m3-subnormal.
  int e = static_cast<int>(bits >> 23) - 127;
  if (e < -6) e = -6;
  const float steps = mul(a, pow2(3 - e));  // a in steps of 2^(e-3): 8..16 (0..8 subnormal); exact
  int q = static_cast<int>(floorf(add(steps, draw)));
  if (draw == 0.5f && q % 2 == 1 && add(steps, 0.5f) == static_cast<float>(q)) q -= 1;  // a tie: to even, as torch
  if (e == 8 && q > 14) q = 14;  // 448 = 14 * 2^5 is the largest finite e4m3fn
  if (q == 16) {
    e += 1;
    q = 8;
  }
  const uint8_t magnitude = q < 8 ? static_cast<uint8_t>(q) : static_cast<uint8_t>((e + 7) << 3 | (q - 8));
  return magnitude == 0 ? 0 : static_cast<uint8_t>(magnitude | (y < 0.0f ? 0x80 : 0));
}

COMMTUNE_HD float decode_e4m3(uint8_t code) {
  const int e = (code >> 3) & 15, m = code & 7;
  // Small integers times powers of two: exact.
  const float magnitude = e == 0 ? mul(static_cast<float>(m), pow2(-9)) : mul(static_cast<float>(8 + m), pow2(e - 10));
  return code & 0x80 ? -magnitude : magnitude;
}

// x as a code (the byte, for e4m3), given the chunk's inverse scale and a draw in [0, 1).
COMMTUNE_HD int8_t encode(float x, float inverse_scale, float draw, Codes codes) {
  if (codes == Codes::e4m3) return static_cast<int8_t>(encode_e4m3(mul(x, inverse_scale), draw));
  const float y = floorf(add(mul(x, inverse_scale), draw));
  const float top = top_of(codes);
  return static_cast<int8_t>(fminf(fmaxf(y, -top), top));
}

COMMTUNE_HD float decode(int8_t code, float scale, Codes codes) {
  // int8/int4 codes (|code| <= 127) biased by 128 into a byte.
  const float value = codes == Codes::e4m3 ? decode_e4m3(static_cast<uint8_t>(code))
                                           : small_int_to_float(static_cast<uint8_t>(code) ^ 0x80u, 128u);
  return mul(value, scale);
}

// Values v[0..3], elements index..index+3 of a chunk (see four_draws), as codes.
COMMTUNE_HD void encode_four(const float* v, uint64_t index, int64_t draws, float inverse_scale, Codes codes,
                             int8_t (&q)[4]) {
  float draw[4];
  four_draws(draws, index, draw);
  for (int k = 0; k < 4; ++k) q[k] = encode(v[k], inverse_scale, draw[k], codes);
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
