// CUDA side of top_k_place_ (checks and the CPU loop in top_k.cpp): TopK's decompression as one
// dense write of the bucket. The bucket is cut into tiles of kTile entries, one a block; a block
// sums in shared memory the ranks' entries that fall in its tile, rank after rank, and writes the
// tile's means whole, in 16-byte stores. A piece's picks come in ascending index order, so the
// entries of one rank in one tile are one stretch of its piece, and a light pass over the
// indices finds where each stretch starts (no sort, no atomics on the bucket):
// 1. bounds_kernel: pick j starts the stretches of the tiles after its predecessor's up to its
//    own; it also asserts that the picks ascend and lie in the bucket, and that every unused slot
//    holds 0 at index 0;
// 2. place_kernel, launched dependent on it (sm_90 on): its blocks clear their sums meanwhile.
#include <commtune/kernels/dependent_launch.cuh>
#include <commtune/kernels/pack.cuh>
#include <commtune/kernels/quantize_rules.h>
#include <commtune/kernels/top_k.h>

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>

#ifndef CUDA_KERNEL_ASSERT_MSG  // torch releases before the message form
#define CUDA_KERNEL_ASSERT_MSG(cond, msg) CUDA_KERNEL_ASSERT(cond)
#endif

namespace commtune {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kThreads = 64;
constexpr int kTileShift = 12;
constexpr int64_t kTile = int64_t{1} << kTileShift;  // entries a block: 16 KB of float sums
constexpr int kRanksAhead = 8;  // ranks whose entries a block loads before it adds the first
constexpr int kSlotsAhead = 8;  // slots of a piece a lane of bounds_kernel loads at once
constexpr int kBoundsThreads = 64;

// The sum and the mean rounded as the CPU rounds them, subnormals kept: the build's
// --use_fast_math flushes them in a + b, __fadd_rn and the like (.ftz).
__device__ __forceinline__ float add_keeping_subnormals(float a, float b) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float mean_keeping_subnormals(float sum, const quant::Divisor& divisor) {
  float r;
  if (divisor.inverse != 0.0f) {
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(sum), "f"(divisor.inverse));
  } else {
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(sum), "f"(divisor.n));
  }
  return r;
}

// Rank r's piece: k values (float32 bits), then k indices.
__device__ __forceinline__ const int32_t* values_of(const int32_t* gathered, int64_t k, int r) {
  return gathered + 2 * k * r;
}
__device__ __forceinline__ const int32_t* indices_of(const int32_t* gathered, int64_t k, int r) {
  return gathered + 2 * k * r + k;
}

// The tile of an index, clamped so that a bad index (asserted in bounds_kernel) cannot write
// outside starts.
__device__ __forceinline__ int64_t tile_of(int32_t index, int64_t tiles) {
  return min(static_cast<int64_t>(max(index, 0)) >> kTileShift, tiles - 1);
}

// starts[t] = t0 for the tiles [from, to), the warp's lanes sharing the stores (one pick may
// start or end thousands of tiles: a piece with few picks).
__device__ __forceinline__ void fill_by_warp(int32_t* starts, int64_t from, int64_t to, int32_t t0, int lane) {
  for (int64_t t = from + lane; t < to; t += 32) starts[t] = t0;
}

// starts[r][t] = the first pick of rank r in tile t or after it (tiles + 1 of them a rank): pick
// j >= 1 starts the tiles after pick j - 1's up to its own; the tiles up to pick 0's start at 0,
// and those after the last pick's at the count of picks. Every entry is written once. A slot j >=
// 1 at index 0 is unused (a pick after slot 0 has a larger index); checked here: it holds 0, and
// no pick follows it. A warp takes kSlotsAhead x 32 consecutive slots, their indices loaded at
// once (a neighbour's index comes from the next lane).
__global__ void __launch_bounds__(kBoundsThreads) bounds_kernel(const int32_t* gathered, int64_t k, int64_t numel,
                                                          int64_t tiles, int32_t* starts) {
  dependent::allow_next_grid();  // the placing blocks may start and clear their sums meanwhile
  const int r = static_cast<int>(blockIdx.y), lane = threadIdx.x % 32;
  const int32_t* value = values_of(gathered, k, r);
  const int32_t* index = indices_of(gathered, k, r);
  int32_t* start = starts + (tiles + 1) * r;
  const int64_t first = ((static_cast<int64_t>(blockIdx.x) * kBoundsThreads + threadIdx.x) / 32) * 32 * kSlotsAhead;
  if (first >= k) return;  // the whole warp
  int32_t at[kSlotsAhead];
#pragma unroll
  for (int u = 0; u < kSlotsAhead; ++u) {
    const int64_t j = first + 32 * u + lane;
    at[u] = j < k ? index[j] : 0;
  }
  // the slots either side of the warp's
  const int32_t before = lane == 0 && first > 0 ? index[first - 1] : 0;
  const int64_t end = first + 32 * kSlotsAhead;
  const int32_t after = lane == 31 && end < k ? index[end] : 0;
#pragma unroll
  for (int u = 0; u < kSlotsAhead; ++u) {
    const int64_t j = first + 32 * u + lane;
    const int32_t i = at[u];
    int32_t previous = __shfl_up_sync(kFull, i, 1), next = __shfl_down_sync(kFull, i, 1);
    const int32_t row_before = __shfl_sync(kFull, at[u > 0 ? u - 1 : 0], 31);  // (u is known: unrolled)
    const int32_t row_after = __shfl_sync(kFull, at[u + 1 < kSlotsAhead ? u + 1 : u], 0);
    if (lane == 0) previous = u > 0 ? row_before : before;
    if (lane == 31) next = u + 1 < kSlotsAhead ? row_after : after;
    bool last = false;
    int64_t tile = 0;
    if (j < k) {
      if (j == 0 || i != 0) {  // a pick
        CUDA_KERNEL_ASSERT_MSG(i >= 0 && i < numel, "TopK: a piece's index lies outside the bucket");
        CUDA_KERNEL_ASSERT_MSG(j == 0 || (previous != 0 || j == 1) && i > previous,
                               "TopK: a piece's picks are out of order (picks come in ascending index order, "
                               "then unused slots: value 0 at index 0)");
        tile = tile_of(i, tiles);
        if (j > 0) {
          for (int64_t t = min(tile_of(previous, tiles), tile) + 1; t <= tile; ++t) start[t] = static_cast<int32_t>(j);
        }
        last = j == k - 1 || next == 0;
      } else {
        CUDA_KERNEL_ASSERT_MSG(__int_as_float(value[j]) == 0.0f,
                               "TopK: a piece's unused slot (index 0 after slot 0) holds a value");
      }
    }
    if (j - lane == 0) fill_by_warp(start, 0, __shfl_sync(kFull, tile, 0) + 1, 0, lane);  // up to pick 0's tile
    uint32_t ends = __ballot_sync(kFull, last);
    while (ends != 0) {  // the tiles after the last pick's
      const int holder = __ffs(ends) - 1;
      ends &= ends - 1;
      fill_by_warp(start, __shfl_sync(kFull, tile, holder) + 1, tiles + 1,
                   static_cast<int32_t>(j - lane + holder + 1), lane);
    }
  }
}

// One tile: the ranks' sums in shared memory (rank by rank, as index_add_ a rank at a time would
// add them), then the means written whole. An entry outside the tile (a bad piece, asserted by
// bounds_kernel) is skipped rather than written out of bounds.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) place_kernel(const int32_t* gathered, int64_t k, int ranks,
                                                         const int32_t* starts, int64_t tiles, scalar_t* out,
                                                         int64_t numel, quant::Divisor divisor) {
  __shared__ float4 sums4[kTile / 4];
  float* sums = reinterpret_cast<float*>(sums4);
  const int64_t t = blockIdx.x, lo = t * kTile, size = min(kTile, numel - lo);
  for (int i = threadIdx.x; i < kTile / 4; i += kThreads) sums4[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  dependent::wait_for_prior_grid();  // the starts are bounds_kernel's
  for (int r0 = 0; r0 < ranks; r0 += kRanksAhead) {
    // Every rank's first entry of this thread is loaded before any is added: one round trip.
    int32_t from[kRanksAhead], to[kRanksAhead], at[kRanksAhead];
    float value[kRanksAhead];
#pragma unroll
    for (int g = 0; g < kRanksAhead; ++g) {
      const int r = r0 + g;
      from[g] = r < ranks ? starts[(tiles + 1) * r + t] : 0;
      to[g] = r < ranks ? starts[(tiles + 1) * r + t + 1] : 0;
    }
#pragma unroll
    for (int g = 0; g < kRanksAhead; ++g) {
      const int64_t j = from[g] + threadIdx.x;
      at[g] = -1;
      if (j < to[g]) {
        at[g] = static_cast<int32_t>(indices_of(gathered, k, r0 + g)[j] - lo);
        value[g] = __int_as_float(values_of(gathered, k, r0 + g)[j]);
      }
    }
#pragma unroll
    for (int g = 0; g < kRanksAhead; ++g) {
      __syncthreads();  // the zeros, or the rank before, are in
      if (at[g] >= 0 && at[g] < size) sums[at[g]] = add_keeping_subnormals(sums[at[g]], value[g]);
      // More of this rank's entries in the tile than threads (ratios above ~1.6%).
      for (int64_t j = from[g] + threadIdx.x + kThreads; j < to[g]; j += kThreads) {
        const int64_t i = indices_of(gathered, k, r0 + g)[j] - lo;
        if (i >= 0 && i < size) sums[i] = add_keeping_subnormals(sums[i], __int_as_float(values_of(gathered, k, r0 + g)[j]));
      }
    }
  }
  __syncthreads();
  auto mean = [&](int64_t i) { return static_cast<scalar_t>(mean_keeping_subnormals(sums[i], divisor)); };
  const PackedSpan span = packed_span(out, lo, lo + size);
  for (int64_t i = lo + threadIdx.x; i < span.packs; i += kThreads) out[i] = mean(i - lo);
  for (int64_t i = span.tail + threadIdx.x; i < lo + size; i += kThreads) out[i] = mean(i - lo);
  auto* packs = reinterpret_cast<Pack<scalar_t>*>(out + span.packs);
  const int64_t first = span.packs - lo;
  for (int64_t p = threadIdx.x; p < (span.tail - span.packs) / Pack<scalar_t>::kCount; p += kThreads) {
    Pack<scalar_t> v;
#pragma unroll
    for (int e = 0; e < Pack<scalar_t>::kCount; ++e) v.v[e] = mean(first + p * Pack<scalar_t>::kCount + e);
    packs[p] = v;
  }
}

}  // namespace

void top_k_place_cuda_(const at::Tensor& gathered, const at::Tensor& out, int64_t ranks) {
  const c10::cuda::CUDAGuard guard(out.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t numel = out.numel(), k = gathered.numel() / (2 * ranks), tiles = (numel + kTile - 1) / kTile;
  TORCH_CHECK(k < (int64_t{1} << 31) && ranks <= 65535, "TopK: pieces of ", std::to_string(k), " slots from ",
              std::to_string(ranks), " ranks are more than the CUDA pass indexes (2^31 - 1 slots, 65535 ranks)");
  at::Tensor starts = at::empty({ranks * (tiles + 1)}, gathered.options());
  const int32_t* pieces = gathered.const_data_ptr<int32_t>();
  const dim3 grid(static_cast<unsigned int>((k + kSlotsAhead * kBoundsThreads - 1) / (kSlotsAhead * kBoundsThreads)),
                  static_cast<unsigned int>(ranks));
  bounds_kernel<<<grid, kBoundsThreads, 0, stream>>>(pieces, k, numel, tiles, starts.mutable_data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const quant::Divisor divisor = quant::Divisor::of(ranks);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "top_k_place", [&] {
    constexpr auto kernel = place_kernel<scalar_t>;
    dependent::launch(dependent::supported<kernel>(out.get_device()), kernel, dim3(static_cast<unsigned int>(tiles)),
                      dim3(kThreads), 0, stream, pieces, k, static_cast<int>(ranks), starts.const_data_ptr<int32_t>(),
                      tiles, out.mutable_data_ptr<scalar_t>(), numel, divisor);
  });
}

} // namespace commtune
