// CUDA kernels for the low-rank steps of PowerSGD (the ops and their checks live in
// low_rank.cpp; the factors' Gram-Schmidt in orthogonalize_cuda.cu). Every kernel covers all
// matrices of a bucket in one launch: a block or warp finds its matrix by binary search over the
// plan's prefix sums. Sums run in float (double for double) in a fixed order, so a run repeats
// bit for bit.
#include <commtune/kernels/low_rank.h>
#include <commtune/kernels/low_rank_cuda.cuh>

#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace commtune {
namespace {

using namespace low_rank_cuda;

// Division rounded as ATen's (--use_fast_math would otherwise approximate it for float).
__device__ __forceinline__ float exact_div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double exact_div(double a, double b) { return a / b; }

// The elements [begin, end) of a segment that block `tile` of the rest's tiles covers.
struct RestTile {
  const RestSegment* segment;
  int64_t begin, end;
};

__device__ __forceinline__ RestTile rest_tile(const RestSegment* segments, int64_t count, int64_t tile) {
  const RestSegment& s = find_entry(segments, count, tile, &RestSegment::tile_start);
  const int64_t begin = (tile - s.tile_start) * kOutTile;
  return RestTile{&s, begin, min(begin + kOutTile, s.numel)};
}

// The first pass. Blocks below `row_groups`: P = M Q for a group of G rows of one M_j, the
// block's threads striding along the rows (each value of Q a thread loads serves all G rows),
// then summed over the block in a fixed order. With `addend`, src += addend on the way.
// Blocks above: the rest, packed (with the same addition).
template <typename scalar_t, int R>
__global__ void __launch_bounds__(kThreads) compress_kernel(
    scalar_t* __restrict__ src, const scalar_t* __restrict__ addend, const scalar_t* __restrict__ q,
    scalar_t* __restrict__ p, scalar_t* __restrict__ rest, const LowRankMatrix* __restrict__ matrices, int64_t count,
    int64_t row_groups, const RestSegment* __restrict__ segments, int64_t segment_count) {
  using acc_t = at::acc_type<scalar_t, true>;
  if (blockIdx.x >= row_groups) {
    const RestTile t = rest_tile(segments, segment_count, blockIdx.x - row_groups);
    for (int64_t e = t.begin + threadIdx.x; e < t.end; e += blockDim.x) {
      const int64_t at = t.segment->offset + e;
      scalar_t x = src[at];
      if (addend != nullptr) {
        x = static_cast<scalar_t>(static_cast<acc_t>(x) + static_cast<acc_t>(addend[at]));
        src[at] = x;
      }
      rest[t.segment->rest_offset + e] = x;
    }
    return;
  }
  constexpr int G = static_cast<int>(rows_per_group(R));
  const LowRankMatrix& m = find_entry(matrices, count, static_cast<int64_t>(blockIdx.x), &LowRankMatrix::group_start);
  const int64_t row0 = (blockIdx.x - m.group_start) * G;
  const int rows = static_cast<int>(min(static_cast<int64_t>(G), m.rows - row0));
  const int r = static_cast<int>(m.rank);
  scalar_t* __restrict__ x = src + m.offset + row0 * m.cols;
  const scalar_t* __restrict__ y = addend == nullptr ? nullptr : addend + m.offset + row0 * m.cols;
  const scalar_t* __restrict__ qj = q + m.q_offset;
  acc_t acc[G * R];
#pragma unroll
  for (int j = 0; j < G * R; ++j) acc[j] = 0;
  for (int64_t k = threadIdx.x; k < m.cols; k += kThreads) {
    acc_t qk[R];
#pragma unroll
    for (int c = 0; c < R; ++c) qk[c] = c < r ? static_cast<acc_t>(qj[k * r + c]) : acc_t(0);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g < rows) {
        scalar_t v = x[g * m.cols + k];
        if (y != nullptr) {
          v = static_cast<scalar_t>(static_cast<acc_t>(v) + static_cast<acc_t>(y[g * m.cols + k]));
          x[g * m.cols + k] = v;
        }
#pragma unroll
        for (int c = 0; c < R; ++c) acc[g * R + c] += static_cast<acc_t>(v) * qk[c];
      }
    }
  }
  __shared__ acc_t totals[G * R];
  block_sum<kThreads>(acc, G * R, totals);
  for (int j = threadIdx.x; j < rows * r; j += kThreads) {
    const int g = j / r, c = j % r;
    p[m.p_offset + (row0 + g) * r + c] = static_cast<scalar_t>(totals[g * R + c]);
  }
}

// Where a tile of kBackTileRows rows x kBackTileCols columns of some M_j lies (Q = M^T P and P Q^T).
struct BackTile {
  const LowRankMatrix* m;
  int64_t chunk, row0, col;  // col: this thread's column
  int rows;
};

__device__ __forceinline__ BackTile back_tile(const LowRankMatrix* matrices, int64_t count, int64_t block) {
  const LowRankMatrix& m = find_entry(matrices, count, block, &LowRankMatrix::back_tile_start);
  const int64_t tile = block - m.back_tile_start;
  const int64_t col_tiles = (m.cols + kBackTileCols - 1) / kBackTileCols;
  const int64_t chunk = tile / col_tiles;
  const int64_t row0 = chunk * kBackTileRows;
  return BackTile{&m, chunk, row0, (tile % col_tiles) * kBackTileCols + threadIdx.x,
                  static_cast<int>(min(kBackTileRows, m.rows - row0))};
}

// Copies the tile's rows of P_j to shared memory (in acc_t).
template <typename scalar_t, int R>
__device__ __forceinline__ void load_p_rows(const scalar_t* __restrict__ p, const BackTile& t,
                                            at::acc_type<scalar_t, true>* p_rows) {
  const int r = static_cast<int>(t.m->rank);
  for (int i = threadIdx.x; i < t.rows * r; i += blockDim.x) {
    p_rows[i] = static_cast<at::acc_type<scalar_t, true>>(p[t.m->p_offset + t.row0 * r + i]);
  }
  __syncthreads();
}

// Q = M^T P, first half: each block takes one tile (coalesced along the rows) and writes that
// chunk's partial sums.
template <typename scalar_t, int R>
__global__ void project_back_kernel(const scalar_t* __restrict__ src, const scalar_t* __restrict__ p,
                                    at::acc_type<scalar_t, true>* __restrict__ scratch,
                                    const LowRankMatrix* __restrict__ matrices, int64_t count) {
  using acc_t = at::acc_type<scalar_t, true>;
  __shared__ acc_t p_rows[kBackTileRows * R];
  const BackTile t = back_tile(matrices, count, blockIdx.x);
  load_p_rows<scalar_t, R>(p, t, p_rows);
  const LowRankMatrix& m = *t.m;
  if (t.col >= m.cols) return;
  const int r = static_cast<int>(m.rank);
  acc_t acc[R];
#pragma unroll
  for (int c = 0; c < R; ++c) acc[c] = 0;
  const scalar_t* __restrict__ x = src + m.offset + t.row0 * m.cols + t.col;
#pragma unroll 8
  for (int i = 0; i < t.rows; ++i) {
    const acc_t v = static_cast<acc_t>(x[i * m.cols]);
#pragma unroll
    for (int c = 0; c < R; ++c) {
      if (c < r) acc[c] += v * p_rows[i * r + c];
    }
  }
  acc_t* out = scratch + m.scratch_offset + (t.chunk * m.cols + t.col) * r;
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

// error[at] -= value, an Inf or a NaN result kept as 0: error feedback keeps nothing of an
// overflow (the output carries it), without a pass of its own over the buffer.
template <typename scalar_t>
__device__ __forceinline__ void take_from_error(scalar_t* __restrict__ error, int64_t at, scalar_t value) {
  const scalar_t left = error[at] - value;
  error[at] = isfinite(static_cast<at::acc_type<scalar_t, true>>(left)) ? left : scalar_t(0);
}

// The last pass. Blocks below `tile_blocks`: one tile of M_j = P_j (Q_j / divisor)^T, each
// thread one column (its row of Q in registers, the tile's rows of P in shared memory), written
// to `out` and subtracted from `error`; with `norms`, the squared residual and input summed.
// Blocks above: the rest / divisor back into `out` (and subtracted from `error`).
template <typename scalar_t, int R>
__global__ void decompress_kernel(const scalar_t* __restrict__ p, const scalar_t* __restrict__ q,
                                  const scalar_t* __restrict__ rest, at::acc_type<scalar_t, true> divisor,
                                  scalar_t* __restrict__ out, scalar_t* __restrict__ error, double* __restrict__ norms,
                                  const LowRankMatrix* __restrict__ matrices, int64_t count, int64_t tile_blocks,
                                  const RestSegment* __restrict__ segments, int64_t segment_count) {
  using acc_t = at::acc_type<scalar_t, true>;
  if (blockIdx.x >= tile_blocks) {
    const RestTile t = rest_tile(segments, segment_count, blockIdx.x - tile_blocks);
    for (int64_t e = t.begin + threadIdx.x; e < t.end; e += blockDim.x) {
      const int64_t at = t.segment->offset + e;
      const scalar_t value = static_cast<scalar_t>(exact_div(static_cast<acc_t>(rest[t.segment->rest_offset + e]), divisor));
      out[at] = value;
      if (error != nullptr) take_from_error(error, at, value);
    }
    return;
  }
  __shared__ acc_t p_rows[kBackTileRows * R];
  const BackTile t = back_tile(matrices, count, blockIdx.x);
  load_p_rows<scalar_t, R>(p, t, p_rows);
  const LowRankMatrix& m = *t.m;
  const int r = static_cast<int>(m.rank);
  double sums[2] = {0, 0};
  if (t.col < m.cols) {
    acc_t qk[R];  // as torch: Q divided by the world size and rounded first, then the product
#pragma unroll
    for (int c = 0; c < R; ++c) {
      qk[c] = c < r ? static_cast<acc_t>(static_cast<scalar_t>(
                          exact_div(static_cast<acc_t>(q[m.q_offset + t.col * r + c]), divisor)))
                    : acc_t(0);
    }
    const int64_t base = m.offset + t.row0 * m.cols + t.col;
#pragma unroll 8
    for (int i = 0; i < t.rows; ++i) {
      acc_t v = 0;
#pragma unroll
      for (int c = 0; c < R; ++c) {
        if (c < r) v += p_rows[i * r + c] * qk[c];
      }
      const scalar_t value = static_cast<scalar_t>(v);
      const int64_t at = base + i * m.cols;
      if (norms != nullptr) {
        const double before = static_cast<double>(error != nullptr ? error[at] : out[at]);
        const double residual = before - static_cast<double>(value);
        sums[0] += residual * residual;
        sums[1] += before * before;
      }
      out[at] = value;
      if (error != nullptr) take_from_error(error, at, value);
    }
  }
  if (norms != nullptr) {  // the same for every thread of the block
    __shared__ double totals[2];
    block_sum<kBackTileCols>(sums, 2, totals);
    if (threadIdx.x == 0) {
      atomicAdd(norms, totals[0]);
      atomicAdd(norms + 1, totals[1]);
    }
  }
}

int64_t blocks_for(int64_t threads) { return (threads + kThreads - 1) / kThreads; }

} // namespace

void low_rank_compress_cuda_(const at::Tensor& src, const at::Tensor& addend, const at::Tensor& q, const at::Tensor& p,
                             const at::Tensor& rest, const LowRankPlan& plan) {
  if (plan.row_groups() + plan.rest_tiles() == 0) return;
  const c10::cuda::CUDAGuard guard(src.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "low_rank_compress", [&] {
    with_rank(plan.max_rank(), [&](auto rank) {
      compress_kernel<scalar_t, decltype(rank)::value><<<plan.row_groups() + plan.rest_tiles(), kThreads, 0, stream>>>(
          src.mutable_data_ptr<scalar_t>(), addend.defined() ? addend.const_data_ptr<scalar_t>() : nullptr,
          q.const_data_ptr<scalar_t>(), p.mutable_data_ptr<scalar_t>(), rest.mutable_data_ptr<scalar_t>(),
          entries_of<LowRankMatrix>(plan.matrix_table()), count_of(plan.matrix_table()), plan.row_groups(),
          entries_of<RestSegment>(plan.rest_table()), count_of(plan.rest_table()));
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

void low_rank_decompress_cuda_(const at::Tensor& p, const at::Tensor& q, const at::Tensor& rest, int64_t divisor,
                               const at::Tensor& out, const at::Tensor& error, const at::Tensor& norms,
                               const LowRankPlan& plan) {
  if (plan.back_tiles() + plan.rest_tiles() == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "low_rank_decompress", [&] {
    with_rank(plan.max_rank(), [&](auto rank) {
      decompress_kernel<scalar_t, decltype(rank)::value><<<plan.back_tiles() + plan.rest_tiles(), kBackTileCols, 0,
                                                           stream>>>(
          p.const_data_ptr<scalar_t>(), q.const_data_ptr<scalar_t>(), rest.const_data_ptr<scalar_t>(),
          static_cast<at::acc_type<scalar_t, true>>(divisor), out.mutable_data_ptr<scalar_t>(),
          error.defined() ? error.mutable_data_ptr<scalar_t>() : nullptr,
          norms.defined() ? norms.mutable_data_ptr<double>() : nullptr, entries_of<LowRankMatrix>(plan.matrix_table()),
          count_of(plan.matrix_table()), plan.back_tiles(), entries_of<RestSegment>(plan.rest_table()),
          count_of(plan.rest_table()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

} // namespace commtune
