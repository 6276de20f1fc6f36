#pragma once
// The arithmetic of 8- and 4-bit quantization, shared by the CPU loops and the CUDA kernels so both
// give the same bits: per-chunk absmax scaling to codes in [-127, 127] (0 is exact), rounding
// down after adding a uniform draw (unbiased; a draw of 0.5 rounds to nearest), draws from a
// counter-based hash of (seed, element index). 4-bit codes are in [-7, 7], two per byte (the
// even element in the low half), stored plus 8. Products and sums use round-to-nearest
// intrinsics on the GPU so that --use_fast_math cannot fuse or approximate them.
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define COMMTUNE_HD __host__ __device__ __forceinline__
#else
#define COMMTUNE_HD inline
#endif

namespace commtune::quant {

COMMTUNE_HD int levels(int bits) { return bits == 8 ? 127 : 7; }

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

// splitmix64's finalizer: one 64-bit word from another, well mixed.
COMMTUNE_HD uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A draw in [0, 1) with 24 random bits for element `index` of the stream `seed`.
COMMTUNE_HD float uniform(uint64_t seed, uint64_t index) {
  return static_cast<float>(mix(seed + (index + 1) * 0x9E3779B97F4A7C15ull) >> 40) * (1.0f / 16777216.0f);
}

COMMTUNE_HD float scale_of(float absmax, int bits) { return div(absmax, static_cast<float>(levels(bits))); }

COMMTUNE_HD float inverse(float scale) { return scale > 0.0f ? div(1.0f, scale) : 0.0f; }

COMMTUNE_HD int8_t encode(float x, float inverse_scale, float draw, int bits) {
  const float y = floorf(add(mul(x, inverse_scale), draw));
  const float top = static_cast<float>(levels(bits));
  return static_cast<int8_t>(fminf(fmaxf(y, -top), top));
}

COMMTUNE_HD float decode(int8_t code, float scale) { return mul(static_cast<float>(code), scale); }

// Codes j..j+3 of a chunk whose codes start at `codes` (j a multiple of 4): one 4- or 2-byte access.
COMMTUNE_HD void store_four_codes(uint8_t* codes, int64_t j, const int8_t (&q)[4], int bits) {
  if (bits == 8) {
    *reinterpret_cast<uint32_t*>(codes + j) = static_cast<uint32_t>(static_cast<uint8_t>(q[0])) |
                                              static_cast<uint32_t>(static_cast<uint8_t>(q[1])) << 8 |
                                              static_cast<uint32_t>(static_cast<uint8_t>(q[2])) << 16 |
                                              static_cast<uint32_t>(static_cast<uint8_t>(q[3])) << 24;
  } else {
    *reinterpret_cast<uint16_t*>(codes + j / 2) =
        static_cast<uint16_t>((q[0] + 8) | (q[1] + 8) << 4 | (q[2] + 8) << 8 | (q[3] + 8) << 12);
  }
}

COMMTUNE_HD void load_four_codes(const uint8_t* codes, int64_t j, int bits, int8_t (&q)[4]) {
  if (bits == 8) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(codes + j);
    for (int k = 0; k < 4; ++k) q[k] = static_cast<int8_t>(static_cast<uint8_t>(w >> (8 * k)));
  } else {
    const uint16_t w = *reinterpret_cast<const uint16_t*>(codes + j / 2);
    for (int k = 0; k < 4; ++k) q[k] = static_cast<int8_t>((w >> (4 * k)) & 15) - 8;
  }
}

} // namespace commtune::quant
