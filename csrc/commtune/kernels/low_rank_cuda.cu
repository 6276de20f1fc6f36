// CUDA kernels for the low-rank steps of PowerSGD (the ops and their checks live in
// low_rank.cpp). Every kernel covers all matrices of a bucket in one launch: a block or warp
// finds its matrix by binary search over the plan's prefix sums. Sums run in float (double for
// double) in a fixed order, so a run repeats bit for bit.
#include <commtune/kernels/low_rank.h>

#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace commtune {
namespace {

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

// P = M Q: one warp per row of every M_j; lanes stride over the row, then reduce.
template <typename scalar_t, int R>
__global__ void project_kernel(const scalar_t* __restrict__ src, const scalar_t* __restrict__ q,
                               scalar_t* __restrict__ p, const LowRankMatrix* __restrict__ matrices,
                               int64_t count, int64_t total_rows) {
  using acc_t = at::acc_type<scalar_t, true>;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= total_rows) return;  // whole warps leave together
  const LowRankMatrix& m = find_entry(matrices, count, row, &LowRankMatrix::row_start);
  const int64_t i = row - m.row_start;
  const int r = static_cast<int>(m.rank);
  const scalar_t* __restrict__ x = src + m.offset + i * m.cols;
  const scalar_t* __restrict__ qj = q + m.q_offset;
  acc_t acc[R];
#pragma unroll
  for (int c = 0; c < R; ++c) acc[c] = 0;
  for (int64_t k = lane; k < m.cols; k += kWarp) {
    const acc_t v = static_cast<acc_t>(x[k]);
#pragma unroll
    for (int c = 0; c < R; ++c) {
      if (c < r) acc[c] += v * static_cast<acc_t>(qj[k * r + c]);
    }
  }
#pragma unroll
  for (int c = 0; c < R; ++c) {
    if (c < r) acc[c] = warp_sum(acc[c]);
  }
  if (lane == 0) {
    for (int c = 0; c < r; ++c) p[m.p_offset + i * r + c] = static_cast<scalar_t>(acc[c]);
  }
}

// Q = M^T P, first half: each block takes kBackTileCols columns x kBackTileRows rows of one
// M_j (coalesced along the row) and writes that chunk's partial sums.
template <typename scalar_t, int R>
__global__ void project_back_kernel(const scalar_t* __restrict__ src, const scalar_t* __restrict__ p,
                                    at::acc_type<scalar_t, true>* __restrict__ scratch,
                                    const LowRankMatrix* __restrict__ matrices, int64_t count) {
  using acc_t = at::acc_type<scalar_t, true>;
  __shared__ acc_t p_rows[kBackTileRows * R];
  const LowRankMatrix& m = find_entry(matrices, count, blockIdx.x, &LowRankMatrix::back_tile_start);
  const int64_t tile = blockIdx.x - m.back_tile_start;
  const int64_t col_tiles = (m.cols + kBackTileCols - 1) / kBackTileCols;
  const int64_t chunk = tile / col_tiles;
  const int64_t row0 = chunk * kBackTileRows;
  const int rows = static_cast<int>(min(kBackTileRows, m.rows - row0));
  const int r = static_cast<int>(m.rank);
  for (int t = threadIdx.x; t < rows * r; t += blockDim.x) {
    p_rows[t] = static_cast<acc_t>(p[m.p_offset + row0 * r + t]);
  }
  __syncthreads();
  const int64_t k = (tile % col_tiles) * kBackTileCols + threadIdx.x;
  if (k >= m.cols) return;
  acc_t acc[R];
#pragma unroll
  for (int c = 0; c < R; ++c) acc[c] = 0;
  const scalar_t* __restrict__ x = src + m.offset + row0 * m.cols + k;
  for (int i = 0; i < rows; ++i) {
    const acc_t v = static_cast<acc_t>(x[i * m.cols]);
#pragma unroll
    for (int c = 0; c < R; ++c) {
      if (c < r) acc[c] += v * p_rows[i * r + c];
    }
  }
  acc_t* out = scratch + m.scratch_offset + (chunk * m.cols + k) * r;
  for (int c = 0; c < r; ++c) out[c] = acc[c];
}

// Q = M^T P, second half: each element of every Q_j sums its chunks in order.
template <typename scalar_t>
__global__ void sum_chunks_kernel(const at::acc_type<scalar_t, true>* __restrict__ scratch,
                                  scalar_t* __restrict__ q, const LowRankMatrix* __restrict__ matrices,
                                  int64_t count, int64_t q_total) {
  using acc_t = at::acc_type<scalar_t, true>;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= q_total) return;
  const LowRankMatrix& m = find_entry(matrices, count, t, &LowRankMatrix::q_start);
  const int64_t local = t - m.q_start;
  const int64_t chunks = (m.rows + kBackTileRows - 1) / kBackTileRows;
  const int64_t stride = m.cols * m.rank;
  acc_t sum = 0;
  for (int64_t c = 0; c < chunks; ++c) sum += scratch[m.scratch_offset + c * stride + local];
  q[m.q_offset + local] = static_cast<scalar_t>(sum);
}

// Sums `n` values per thread over the block; every thread gets the totals in `out`.
template <typename acc_t, int R>
__device__ void block_sum(acc_t (&v)[R], int n, acc_t* out) {
  __shared__ acc_t partial[kThreads / kWarp][R];
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
    for (int w = 0; w < kThreads / kWarp; ++w) s += partial[w][threadIdx.x];
    out[threadIdx.x] = s;
  }
  __syncthreads();
}

// One block per factor [rows, r]: column by column, remove the finished columns' components
// (twice when r > 2), then divide by (norm + epsilon). See orthogonalize.h.
template <typename scalar_t, int R>
__global__ void orthogonalize_kernel(scalar_t* __restrict__ memory, const FactorEntry* __restrict__ factors,
                                     at::acc_type<scalar_t, true> epsilon) {
  using acc_t = at::acc_type<scalar_t, true>;
  __shared__ acc_t totals[R];
  const FactorEntry& f = factors[blockIdx.x];
  scalar_t* __restrict__ a = memory + f.offset;
  const int64_t rows = f.rows;
  const int r = static_cast<int>(f.rank);
  const int passes = r > 2 ? 2 : 1;
  for (int i = 0; i < r; ++i) {
    for (int pass = 0; pass < passes && i > 0; ++pass) {
      acc_t dots[R];
#pragma unroll
      for (int j = 0; j < R; ++j) dots[j] = 0;
      for (int64_t row = threadIdx.x; row < rows; row += blockDim.x) {
        const acc_t v = static_cast<acc_t>(a[row * r + i]);
#pragma unroll
        for (int j = 0; j < R; ++j) {
          if (j < i) dots[j] += static_cast<acc_t>(a[row * r + j]) * v;
        }
      }
      block_sum(dots, i, totals);
      for (int64_t row = threadIdx.x; row < rows; row += blockDim.x) {
        acc_t v = static_cast<acc_t>(a[row * r + i]);
        for (int j = 0; j < i; ++j) v -= totals[j] * static_cast<acc_t>(a[row * r + j]);
        a[row * r + i] = static_cast<scalar_t>(v);
      }
      __syncthreads();
    }
    acc_t square[R];
    square[0] = 0;
    for (int64_t row = threadIdx.x; row < rows; row += blockDim.x) {
      const acc_t v = static_cast<acc_t>(a[row * r + i]);
      square[0] += v * v;
    }
    block_sum(square, 1, totals);
    const acc_t scale = acc_t(1) / (sqrt(totals[0]) + epsilon);
    for (int64_t row = threadIdx.x; row < rows; row += blockDim.x) {
      a[row * r + i] = static_cast<scalar_t>(static_cast<acc_t>(a[row * r + i]) * scale);
    }
    __syncthreads();
  }
}

// M_j = P_j (Q_j / divisor)^T into `out` (and subtracted from `error`), kOutTile elements per block.
template <typename scalar_t, int R>
__global__ void reconstruct_kernel(const scalar_t* __restrict__ p, const scalar_t* __restrict__ q,
                                   at::acc_type<scalar_t, true> divisor, scalar_t* __restrict__ out, scalar_t* __restrict__ error,
                                   const LowRankMatrix* __restrict__ matrices, int64_t count) {
  using acc_t = at::acc_type<scalar_t, true>;
  const LowRankMatrix& m = find_entry(matrices, count, blockIdx.x, &LowRankMatrix::out_tile_start);
  const int64_t begin = (blockIdx.x - m.out_tile_start) * kOutTile;
  const int64_t end = min(begin + kOutTile, m.rows * m.cols);
  const int r = static_cast<int>(m.rank);
  for (int64_t e = begin + threadIdx.x; e < end; e += blockDim.x) {
    const int64_t i = e / m.cols, k = e - i * m.cols;
    acc_t v = 0;
#pragma unroll
    for (int c = 0; c < R; ++c) {
      if (c < r) v += static_cast<acc_t>(p[m.p_offset + i * r + c]) * static_cast<acc_t>(q[m.q_offset + k * r + c]);
    }
    const scalar_t value = static_cast<scalar_t>(v / divisor);
    out[m.offset + e] = value;
    if (error != nullptr) error[m.offset + e] -= value;
  }
}

// Packs the rest out of the bucket (gather) or puts it back divided by `divisor` (and
// subtracts it from `error`).
template <typename scalar_t>
__global__ void move_rest_kernel(const scalar_t* __restrict__ from, scalar_t* __restrict__ to,
                                 at::acc_type<scalar_t, true> divisor, scalar_t* __restrict__ error, bool gather,
                                 const RestSegment* __restrict__ segments, int64_t count) {
  const RestSegment& s = find_entry(segments, count, blockIdx.x, &RestSegment::tile_start);
  const int64_t begin = (blockIdx.x - s.tile_start) * kOutTile;
  const int64_t end = min(begin + kOutTile, s.numel);
  const int64_t from_at = gather ? s.offset : s.rest_offset;
  const int64_t to_at = gather ? s.rest_offset : s.offset;
  for (int64_t e = begin + threadIdx.x; e < end; e += blockDim.x) {
    const scalar_t value = static_cast<scalar_t>(static_cast<at::acc_type<scalar_t, true>>(from[from_at + e]) / divisor);
    to[to_at + e] = value;
    if (error != nullptr) error[to_at + e] -= value;
  }
}

int64_t blocks_for(int64_t threads) { return (threads + kThreads - 1) / kThreads; }

// Calls f.template operator()<R>() with the smallest supported R >= rank.
template <typename F>
void with_rank(int64_t rank, F&& f) {
  TORCH_INTERNAL_ASSERT(rank >= 1 && rank <= kMaxKernelRank);
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

int64_t count_of(const at::Tensor& table) { return table.size(0); }

} // namespace

void low_rank_project_cuda_(const at::Tensor& src, const at::Tensor& q, const at::Tensor& p, const LowRankPlan& plan) {
  if (plan.total_rows() == 0) return;
  const c10::cuda::CUDAGuard guard(src.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t blocks = blocks_for(plan.total_rows() * kWarp);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "low_rank_project", [&] {
    with_rank(plan.max_rank(), [&](auto rank) {
      project_kernel<scalar_t, decltype(rank)::value><<<blocks, kThreads, 0, stream>>>(
          src.const_data_ptr<scalar_t>(), q.const_data_ptr<scalar_t>(), p.mutable_data_ptr<scalar_t>(),
          entries_of<LowRankMatrix>(plan.matrix_table()), count_of(plan.matrix_table()), plan.total_rows());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void low_rank_project_back_cuda_(const at::Tensor& src, const at::Tensor& p, const at::Tensor& q,
                                 const LowRankPlan& plan) {
  if (plan.back_tiles() == 0) return;
  const c10::cuda::CUDAGuard guard(src.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "low_rank_project_back", [&] {
    using acc_t = at::acc_type<scalar_t, true>;
    // Allocated on the current stream, so the allocator reuses it only after these kernels.
    at::Tensor scratch = at::empty({plan.scratch_numel()}, src.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    const LowRankMatrix* matrices = entries_of<LowRankMatrix>(plan.matrix_table());
    const int64_t count = count_of(plan.matrix_table());
    with_rank(plan.max_rank(), [&](auto rank) {
      project_back_kernel<scalar_t, decltype(rank)::value><<<plan.back_tiles(), kBackTileCols, 0, stream>>>(
          src.const_data_ptr<scalar_t>(), p.const_data_ptr<scalar_t>(), scratch.mutable_data_ptr<acc_t>(),
          matrices, count);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    sum_chunks_kernel<scalar_t><<<blocks_for(plan.q_numel()), kThreads, 0, stream>>>(
        scratch.const_data_ptr<acc_t>(), q.mutable_data_ptr<scalar_t>(), matrices, count, plan.q_numel());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void orthogonalize_cuda_(const at::Tensor& memory, const at::Tensor& factors, int64_t count, int64_t max_rank,
                         double epsilon) {
  if (count == 0) return;
  const c10::cuda::CUDAGuard guard(memory.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, memory.scalar_type(), "orthogonalize", [&] {
    using acc_t = at::acc_type<scalar_t, true>;
    with_rank(max_rank, [&](auto rank) {
      orthogonalize_kernel<scalar_t, decltype(rank)::value><<<count, kThreads, 0, stream>>>(
          memory.mutable_data_ptr<scalar_t>(), entries_of<FactorEntry>(factors), static_cast<acc_t>(epsilon));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void low_rank_reconstruct_cuda_(const at::Tensor& p, const at::Tensor& q, int64_t divisor, const at::Tensor& out,
                                const at::Tensor& error, const LowRankPlan& plan) {
  if (plan.out_tiles() == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "low_rank_reconstruct", [&] {
    with_rank(plan.max_rank(), [&](auto rank) {
      reconstruct_kernel<scalar_t, decltype(rank)::value><<<plan.out_tiles(), kThreads, 0, stream>>>(
          p.const_data_ptr<scalar_t>(), q.const_data_ptr<scalar_t>(),
          static_cast<at::acc_type<scalar_t, true>>(divisor), out.mutable_data_ptr<scalar_t>(),
          error.defined() ? error.mutable_data_ptr<scalar_t>() : nullptr,
          entries_of<LowRankMatrix>(plan.matrix_table()), count_of(plan.matrix_table()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void move_rest_cuda_(const at::Tensor& from, const at::Tensor& to, int64_t divisor, const at::Tensor& error,
                     bool gather, const LowRankPlan& plan) {
  if (plan.rest_tiles() == 0) return;
  const c10::cuda::CUDAGuard guard(to.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, to.scalar_type(), "move_rest", [&] {
    move_rest_kernel<scalar_t><<<plan.rest_tiles(), kThreads, 0, stream>>>(
        from.const_data_ptr<scalar_t>(), to.mutable_data_ptr<scalar_t>(),
        static_cast<at::acc_type<scalar_t, true>>(divisor), error.defined() ? error.mutable_data_ptr<scalar_t>() : nullptr, gather,
        entries_of<RestSegment>(plan.rest_table()), count_of(plan.rest_table()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

} // namespace commtune
