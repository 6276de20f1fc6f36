#pragma once
// The arithmetic of 8-bit quantization, shared by the CPU loops and the CUDA kernels so both
// give the same bits: per-chunk absmax scaling to codes in [-127, 127] (0 is exact), rounding
// down after adding a uniform draw (unbiased; a draw of 0.5 rounds to nearest), draws from a
// counter-based hash of (seed, element index). Products and sums use round-to-nearest
// intrinsics on the GPU so that --use_fast_math cannot fuse or approximate them.
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define COMMTUNE_HD __host__ __device__ __forceinline__
#else
#define COMMTUNE_HD inline
#endif

namespace commtune::quant {

constexpr int kLevels = 127;

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

COMMTUNE_HD float scale_of(float absmax) { return div(absmax, static_cast<float>(kLevels)); }

COMMTUNE_HD float inverse(float scale) { return scale > 0.0f ? div(1.0f, scale) : 0.0f; }

COMMTUNE_HD int8_t encode(float x, float inverse_scale, float draw) {
  const float y = floorf(add(mul(x, inverse_scale), draw));
  return static_cast<int8_t>(fminf(fmaxf(y, -static_cast<float>(kLevels)), static_cast<float>(kLevels)));
}

COMMTUNE_HD float decode(int8_t code, float scale) { return mul(static_cast<float>(code), scale); }

} // namespace commtune::quant
