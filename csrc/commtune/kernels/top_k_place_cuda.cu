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
constexpr int kSlotsALane = 8;  // consecutive slots of a piece a lane of bounds_kernel takes
static_assert(kSlotsALane % 4 == 0, "bounds_kernel loads a lane's slots 4 at a time");
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
// outside starts. 32 bits: a bucket has fewer than 2^31 entries.
__device__ __forceinline__ int32_t tile_of(int32_t index, int32_t last_tile) {
  return min(max(index, 0) >> kTileShift, last_tile);
}

// bounds_kernel's time went to the instructions its warps issue more than to its 8 MB (~120 a slot
// once, ~10 now on the common path): what is rare (fills of more than one tile, pieces' ends,
// unused slots among picks, failures) is out of line.

// starts[t] = t0 for the tiles [from, to), the warp's lanes sharing the stores (one pick may
// start or end thousands of tiles: a piece with few picks).
__device__ __noinline__ void fill_by_warp(int32_t* starts, int32_t from, int32_t to, int32_t t0, int lane) {
#pragma unroll 1
  for (int32_t t = from + lane; t < to; t += 32) starts[t] = t0;
}

// starts[t] = j for the tiles [from, to] (a pick after a tile without picks of its rank).
__device__ __noinline__ void fill_by_lane(int32_t* starts, int32_t from, int32_t to, int32_t j) {
#pragma unroll 1
  for (int32_t t = from; t <= to; ++t) starts[t] = j;
}

__device__ __noinline__ void fail(const char* what) {
  CUDA_KERNEL_ASSERT_MSG(false, what);
}

// A lane's slots [first, first + kSlotsALane) of a piece, their indices, and those of the slots
// either side (0 where there is none).
struct LaneSlots {
  int64_t first;
  int32_t at[kSlotsALane];
  int32_t before, after;
};

// What a lane's slots showed: a failed check of each kind, and the tiles of pick 0 and of the
// piece's last pick where the lane holds them (-1 where not).
struct Findings {
  bool outside = false, out_of_order = false, holds_a_value = false;
  int32_t head = -1, tail = -1, picks = 0;  // picks: the piece's count of picks, where tail is found
};

// The common case: every slot of the lane is a pick after a pick, and a pick follows the last.
// (start[tile] = j for each pick j that starts a tile: the first of its rank in that tile.)
__device__ __forceinline__ Findings picks_among_picks(const LaneSlots& s, int32_t numel, int32_t last_tile,
                                                      int32_t* start) {
  Findings found;
  int32_t previous = s.before, previous_tile = tile_of(s.before, last_tile);
#pragma unroll
  for (int u = 0; u < kSlotsALane; ++u) {
    const int32_t i = s.at[u], j = static_cast<int32_t>(s.first) + u, tile = tile_of(i, last_tile);
    found.outside |= static_cast<uint32_t>(i) >= static_cast<uint32_t>(numel);  // (negative: above 2^31)
    found.out_of_order |= i <= previous;
    if (tile > previous_tile) {
      start[tile] = j;
      if (tile > previous_tile + 1) fill_by_lane(start, previous_tile + 1, tile - 1, j);
    }
    previous = i;
    previous_tile = tile;
  }
  return found;
}

// Any other lane: slot by slot, the piece contract in full (as top_k.cpp's CPU loop checks it).
__device__ __noinline__ Findings any_slots(LaneSlots s, int64_t k, int32_t numel, int32_t last_tile,
                                           const int32_t* value, int32_t* start) {
  Findings found;
#pragma unroll 1
  for (int u = 0; u < kSlotsALane && s.first + u < k; ++u) {
    const int64_t j = s.first + u;
    const int32_t i = s.at[u], previous = u > 0 ? s.at[u - 1] : s.before;
    const int32_t next = u + 1 < kSlotsALane ? s.at[u + 1] : s.after;
    if (j > 0 && i == 0) {  // an unused slot
      found.holds_a_value |= __int_as_float(value[j]) != 0.0f;
      continue;
    }
    found.outside |= i < 0 || i >= numel;
    found.out_of_order |= j > 0 && ((previous == 0 && j > 1) || i <= previous);
    const int32_t tile = tile_of(i, last_tile);
    if (j == 0) {
      found.head = tile;
    } else {
      const int32_t from = min(tile_of(previous, last_tile), tile) + 1;
      if (from <= tile) fill_by_lane(start, from, tile, static_cast<int32_t>(j));
    }
    if (j == k - 1 || next == 0) {
      found.tail = tile;
      found.picks = static_cast<int32_t>(j + 1);
    }
  }
  return found;
}

// starts[r][t] = the first pick of rank r in tile t or after it (tiles + 1 of them a rank): pick
// j >= 1 starts the tiles after pick j - 1's up to its own; the tiles up to pick 0's start at 0,
// and those after the last pick's at the count of picks. Every entry is written once. A slot j >=
// 1 at index 0 is unused (a pick after slot 0 has a larger index); checked here: it holds 0, and
// no pick follows it. A lane takes kSlotsALane consecutive slots (16 bytes a load where kVector:
// k % 4 == 0 and the pieces on a 16-byte boundary); the neighbours of its first and last slots
// come from the lanes either side. A lane of picks only, or of unused slots only, takes a short
// path; the checks fold into three flags a lane, asserted once.
template <bool kVector>
__global__ void __launch_bounds__(kBoundsThreads, 32) bounds_kernel(const int32_t* gathered, int64_t k, int32_t numel,
                                                          int32_t tiles, int32_t* starts) {
  dependent::allow_next_grid();  // the placing blocks may start and clear their sums meanwhile
  const int r = static_cast<int>(blockIdx.y), lane = threadIdx.x % 32;
  const int32_t* value = values_of(gathered, k, r);
  const int32_t* index = indices_of(gathered, k, r);
  int32_t* start = starts + static_cast<int64_t>(tiles + 1) * r;
  const int64_t warp_first = (static_cast<int64_t>(blockIdx.x) * kBoundsThreads + threadIdx.x - lane) * kSlotsALane;
  if (warp_first >= k) return;  // the whole warp
  LaneSlots s;
  s.first = warp_first + static_cast<int64_t>(lane) * kSlotsALane;
#pragma unroll
  for (int q = 0; q < kSlotsALane / 4; ++q) {
    const int64_t j = s.first + 4 * q;
    if (kVector) {  // 4 slots all in the piece or all past it (k and j are multiples of 4)
      const int4 v = j < k ? *reinterpret_cast<const int4*>(index + j) : make_int4(0, 0, 0, 0);
      s.at[4 * q] = v.x, s.at[4 * q + 1] = v.y, s.at[4 * q + 2] = v.z, s.at[4 * q + 3] = v.w;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) s.at[4 * q + e] = j + e < k ? index[j + e] : 0;
    }
  }
  s.before = __shfl_up_sync(kFull, s.at[kSlotsALane - 1], 1);
  s.after = __shfl_down_sync(kFull, s.at[0], 1);
  if (lane == 0) s.before = s.first > 0 ? index[s.first - 1] : 0;
  if (lane == 31) s.after = s.first + kSlotsALane < k ? index[s.first + kSlotsALane] : 0;
  const int32_t last_tile = tiles - 1;
  bool picks_only = s.first > 0 && s.first + kSlotsALane < k && s.before != 0 && s.after != 0;
  bool unused_only = s.first > 0 && s.first + kSlotsALane <= k;
#pragma unroll
  for (int u = 0; u < kSlotsALane; ++u) {
    picks_only &= s.at[u] != 0;
    unused_only &= s.at[u] == 0;
  }
  Findings found;
  if (picks_only) {
    found = picks_among_picks(s, numel, last_tile, start);
  } else if (unused_only) {
#pragma unroll
    for (int u = 0; u < kSlotsALane; ++u) found.holds_a_value |= __int_as_float(value[s.first + u]) != 0.0f;
  } else if (s.first < k) {
    found = any_slots(s, k, numel, last_tile, value, start);
  }
  if (found.outside) fail("TopK: a piece's index lies outside the bucket");
  if (found.out_of_order) {
    fail("TopK: a piece's picks are out of order (picks come in ascending index order, then unused slots: value 0 "
         "at index 0)");
  }
  if (found.holds_a_value) fail("TopK: a piece's unused slot (index 0 after slot 0) holds a value");
  // The tiles up to pick 0's start at 0; those after the last pick's at the count of picks.
  uint32_t ends = __ballot_sync(kFull, found.head >= 0 || found.tail >= 0);
  while (ends != 0) {
    const int holder = __ffs(ends) - 1;
    ends &= ends - 1;
    const int32_t head = __shfl_sync(kFull, found.head, holder), tail = __shfl_sync(kFull, found.tail, holder);
    const int32_t picks = __shfl_sync(kFull, found.picks, holder);
    if (head >= 0) fill_by_warp(start, 0, head + 1, 0, lane);
    if (tail >= 0) fill_by_warp(start, tail + 1, tiles + 1, picks, lane);
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
  const dim3 grid(static_cast<unsigned int>((k + kSlotsALane * kBoundsThreads - 1) / (kSlotsALane * kBoundsThreads)),
                  static_cast<unsigned int>(ranks));
  const bool vector = k % 4 == 0 && reinterpret_cast<uintptr_t>(pieces) % 16 == 0;
  (vector ? bounds_kernel<true> : bounds_kernel<false>)<<<grid, kBoundsThreads, 0, stream>>>(
      pieces, k, static_cast<int32_t>(numel), static_cast<int32_t>(tiles), starts.mutable_data_ptr<int32_t>());
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
