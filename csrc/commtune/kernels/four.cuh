#pragma once
// Four consecutive elements as one access: the vector loads and stores the compression kernels
// use where a lane owns groups of four values (the quantize files, sign_cuda.cu), and the layout
// they share for chunks of up to 1024 elements: one warp per chunk, up to 8 groups a lane.
#include <commtune/kernels/fused_add.cuh>

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

// The same of src + add (error feedback's add fused into an encoding pass: add is the error
// buffer, src the bucket), each sum rounded to scalar_t as at::add_ rounds it; add null: load.
template <typename scalar_t>
__device__ __forceinline__ void load_sum(const scalar_t* __restrict__ src, const scalar_t* add, int64_t at,
                                         int64_t numel, bool vector, float* values) {
  if (add == nullptr) return load(src, at, numel, vector, values);
  if (vector && at + 3 < numel) {
    const Four<scalar_t> x = *reinterpret_cast<const Four<scalar_t>*>(src + at);
    const Four<scalar_t> a = *reinterpret_cast<const Four<scalar_t>*>(add + at);
#pragma unroll
    for (int k = 0; k < 4; ++k) values[k] = static_cast<float>(fused_sum(a.v[k], x.v[k]));
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) values[k] = at + k < numel ? static_cast<float>(fused_sum(add[at + k], src[at + k])) : 0.0f;
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

constexpr int kWarp = 32;
constexpr int kMaxFours = 8;  // groups of four values a lane holds: 32 values, chunks up to 1024
constexpr int64_t kWarpChunkLimit = kWarp * kMaxFours * 4;

// Lane `lane`'s i-th group of four starts at element 4 * (lane + 32 i) of its warp's chunk: a
// warp's accesses of one i are contiguous.
__device__ __forceinline__ int64_t group_start(int lane, int i) { return 4 * (lane + kWarp * i); }

// This warp's index over the grid (the chunk it owns).
__device__ __forceinline__ int64_t warp_index() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
}

// Blocks of `threads` threads for one warp per chunk.
inline int64_t warp_blocks(int64_t chunks, int threads) { return (chunks * kWarp + threads - 1) / threads; }

// Whether every access of four elements from these pointers can be one vector access.
template <typename scalar_t>
inline bool aligned(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers) {
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % (4 * sizeof(scalar_t)) != 0) return false;
  }
  return true;
}

} // namespace commtune::four
