#pragma once
// What the low-rank CUDA kernels (low_rank_cuda.cu) and the Gram-Schmidt kernel
// (orthogonalize_cuda.cu) share: the plan tables' lookups, block sums, the rank dispatch.
#include <commtune/kernels/low_rank.h>

#include <ATen/ATen.h>

#include <cstdint>
#include <type_traits>

namespace commtune::low_rank_cuda {

constexpr int kWarp = 32;
constexpr int kThreads = 256;

// The entry whose `start` field is the last one <= t (entries are in increasing start order).
template <typename Entry>
__device__ __forceinline__ const Entry& find_entry(const Entry* entries, int64_t count, int64_t t,
                                                   int64_t Entry::*start) {
  int64_t lo = 0, hi = count - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (entries[mid].*start <= t) lo = mid; else hi = mid - 1;
  }
  return entries[lo];
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sums `n` values per thread over a block of THREADS threads; every thread gets the totals in `out`.
template <int THREADS, typename acc_t, int R>
__device__ void block_sum(acc_t (&v)[R], int n, acc_t* out) {
  __shared__ acc_t partial[THREADS / kWarp][R];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
#pragma unroll
  for (int j = 0; j < R; ++j) {
    if (j < n) v[j] = warp_sum(v[j]);
  }
  if (lane == 0) {
    for (int j = 0; j < n; ++j) partial[warp][j] = v[j];
  }
  __syncthreads();
  if (threadIdx.x < n) {
    acc_t s = 0;
    for (int w = 0; w < THREADS / kWarp; ++w) s += partial[w][threadIdx.x];
    out[threadIdx.x] = s;
  }
  __syncthreads();
}

// Calls f.template operator()<R>() with the smallest supported R >= rank. Rank 0 is a bucket
// whose tensors all travel uncompressed (only the rest): any R serves.
template <typename F>
void with_rank(int64_t rank, F&& f) {
  TORCH_INTERNAL_ASSERT(rank >= 0 && rank <= kMaxKernelRank);
  if (rank <= 1) f(std::integral_constant<int, 1>{});
  else if (rank <= 2) f(std::integral_constant<int, 2>{});
  else if (rank <= 4) f(std::integral_constant<int, 4>{});
  else if (rank <= 8) f(std::integral_constant<int, 8>{});
  else if (rank <= 16) f(std::integral_constant<int, 16>{});
  else f(std::integral_constant<int, 32>{});
}

template <typename Entry>
const Entry* entries_of(const at::Tensor& table) {
  return reinterpret_cast<const Entry*>(table.const_data_ptr<int64_t>());
}

inline int64_t count_of(const at::Tensor& table) { return table.size(0); }

} // namespace commtune::low_rank_cuda
