#pragma once
// Four consecutive elements as one access: the vector loads and stores the compression kernels
// use where a lane owns groups of four values (quantize_cuda.cu, sign_cuda.cu).
#include <cstdint>
#include <initializer_list>

namespace commtune::four {

template <typename T>
struct alignas(sizeof(T) * 4) Four {
  T v[4];
};

// values[0..3] = src[at..at+3] (zeros past numel), one vector load where all four exist.
template <typename scalar_t>
__device__ __forceinline__ void load(const scalar_t* __restrict__ src, int64_t at, int64_t numel, bool vector,
                                     float* values) {
  if (vector && at + 3 < numel) {
    const Four<scalar_t> x = *reinterpret_cast<const Four<scalar_t>*>(src + at);
#pragma unroll
    for (int k = 0; k < 4; ++k) values[k] = static_cast<float>(x.v[k]);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) values[k] = at + k < numel ? static_cast<float>(src[at + k]) : 0.0f;
  }
}

// dst[at..at+3] = values[0..3], the ones before numel.
template <typename scalar_t>
__device__ __forceinline__ void store(scalar_t* __restrict__ dst, int64_t at, int64_t numel, bool vector,
                                      const float* values) {
  if (vector && at + 3 < numel) {
    Four<scalar_t> x;
#pragma unroll
    for (int k = 0; k < 4; ++k) x.v[k] = static_cast<scalar_t>(values[k]);
    *reinterpret_cast<Four<scalar_t>*>(dst + at) = x;
  } else {
    for (int k = 0; k < 4 && at + k < numel; ++k) dst[at + k] = static_cast<scalar_t>(values[k]);
  }
}

// Whether every access of four elements from these pointers can be one vector access.
template <typename scalar_t>
inline bool aligned(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers) {
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % (4 * sizeof(scalar_t)) != 0) return false;
  }
  return true;
}

} // namespace commtune::four
