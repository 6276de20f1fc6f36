// CUDA Gram-Schmidt for PowerSGD's factors (orthogonalize_cuda_ in low_rank.h; the checks and
// the CPU loop live in low_rank.cpp and orthogonalize.cpp): one block per factor, every factor
// of a bucket in one launch.
#include <commtune/kernels/low_rank.h>
#include <commtune/kernels/low_rank_cuda.cuh>

#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

namespace commtune {
namespace {

using namespace low_rank_cuda;

// Gram-Schmidt on one factor a [rows, r] (shared or global memory) by a block of THREADS:
// column by column, remove the finished columns' components (twice when r > 2), then divide
// by (norm + epsilon). Every intermediate is rounded to scalar_t, as torch's loop does.
template <typename scalar_t, int R, int THREADS>
__device__ void gram_schmidt(scalar_t* __restrict__ a, int64_t rows, int r, at::acc_type<scalar_t, true> epsilon) {
  using acc_t = at::acc_type<scalar_t, true>;
  __shared__ acc_t totals[R];
  const int passes = r > 2 ? 2 : 1;
  for (int i = 0; i < r; ++i) {
    for (int pass = 0; pass < passes && i > 0; ++pass) {
      acc_t dots[R];
#pragma unroll
      for (int j = 0; j < R; ++j) dots[j] = 0;
      for (int64_t row = threadIdx.x; row < rows; row += THREADS) {
        const acc_t v = static_cast<acc_t>(a[row * r + i]);
#pragma unroll
        for (int j = 0; j < R; ++j) {
          if (j < i) dots[j] += static_cast<acc_t>(a[row * r + j]) * v;
        }
      }
      block_sum<THREADS>(dots, i, totals);
      for (int64_t row = threadIdx.x; row < rows; row += THREADS) {
        acc_t v = static_cast<acc_t>(a[row * r + i]);
        for (int j = 0; j < i; ++j) v -= totals[j] * static_cast<acc_t>(a[row * r + j]);
        a[row * r + i] = static_cast<scalar_t>(v);
      }
      __syncthreads();
    }
    acc_t square[1] = {0};
    for (int64_t row = threadIdx.x; row < rows; row += THREADS) {
      const acc_t v = static_cast<acc_t>(a[row * r + i]);
      square[0] += v * v;
    }
    block_sum<THREADS>(square, 1, totals);
    const acc_t scale = acc_t(1) / (sqrt(totals[0]) + epsilon);
    for (int64_t row = threadIdx.x; row < rows; row += THREADS) {
      a[row * r + i] = static_cast<scalar_t>(static_cast<acc_t>(a[row * r + i]) * scale);
    }
    __syncthreads();
  }
}

// One block per factor. A factor of at most `staged_numel` elements is worked on in shared
// memory (loaded and stored once, coalesced); a larger one in place in global memory.
template <typename scalar_t, int R, int THREADS>
__global__ void __launch_bounds__(THREADS) orthogonalize_kernel(scalar_t* __restrict__ memory,
                                                                const FactorEntry* __restrict__ factors,
                                                                at::acc_type<scalar_t, true> epsilon,
                                                                int64_t staged_numel) {
  extern __shared__ __align__(16) unsigned char staging[];
  const FactorEntry& f = factors[blockIdx.x];
  scalar_t* __restrict__ global = memory + f.offset;
  const int64_t numel = f.rows * f.rank;
  if (numel > staged_numel) {
    gram_schmidt<scalar_t, R, THREADS>(global, f.rows, static_cast<int>(f.rank), epsilon);
    return;
  }
  scalar_t* a = reinterpret_cast<scalar_t*>(staging);
  for (int64_t e = threadIdx.x; e < numel; e += THREADS) a[e] = global[e];
  __syncthreads();
  gram_schmidt<scalar_t, R, THREADS>(a, f.rows, static_cast<int>(f.rank), epsilon);
  for (int64_t e = threadIdx.x; e < numel; e += THREADS) global[e] = a[e];
}

// Lets `kernel` take `bytes` of dynamic shared memory on the current device. A block that uses
// more than 48 KB, its static shared memory counted in, must opt in: the check is against the
// dynamic bytes alone, so it opts in for any size (once per kernel, device and larger size,
// since the driver call is slow on some machines).
void allow_dynamic_shared(const void* kernel, size_t bytes) {
  if (bytes == 0) return;
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, size_t> allowed;
  const std::pair<const void*, int> key{kernel, static_cast<int>(c10::cuda::current_device())};
  std::lock_guard<std::mutex> lock(mutex);
  size_t& done = allowed[key];
  if (bytes <= done) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  done = bytes;
}

} // namespace

void orthogonalize_cuda_(const at::Tensor& memory, const at::Tensor& factors, int64_t count, int64_t max_rank,
                         int64_t max_factor_numel, double epsilon) {
  if (count == 0) return;
  const c10::cuda::CUDAGuard guard(memory.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // Shared memory for staging, up to what a block may opt in to (less room for the sums).
  const int64_t optin = static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, memory.scalar_type(), "orthogonalize", [&] {
    using acc_t = at::acc_type<scalar_t, true>;
    const int64_t room = std::max<int64_t>(0, optin - 16 * 1024) / static_cast<int64_t>(sizeof(scalar_t));
    const int64_t staged = std::min(max_factor_numel, room);
    const size_t bytes = static_cast<size_t>(staged) * sizeof(scalar_t);
    with_rank(max_rank, [&](auto rank) {
      constexpr int R = decltype(rank)::value;
      constexpr int threads = R <= 8 ? 1024 : 256;  // the sums' registers bound the block above rank 8
      auto kernel = orthogonalize_kernel<scalar_t, R, threads>;
      allow_dynamic_shared(reinterpret_cast<const void*>(kernel), bytes);
      kernel<<<count, threads, bytes, stream>>>(memory.mutable_data_ptr<scalar_t>(), entries_of<FactorEntry>(factors),
                                                static_cast<acc_t>(epsilon), staged);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

} // namespace commtune
