// CUDA side of threshold_top_k_ (checks and the CPU loop in top_k.cpp), two kernels:
// 1. One block finds the sample's threshold a bit at a time from the top: the want-th largest
//    key is the largest t with at least `want` keys >= t (non-negative floats order as their
//    bits), 31 block-wide counts. It also clears the select pass's tile states.
// 2. One pass over the bucket in tiles of 4096 entries. A block counts its tile's qualifying
//    entries, learns how many qualified in the tiles before it (a decoupled look-back: each tile
//    posts its own count at once and its running total when it knows it, so a block rarely
//    waits for more than its neighbour), and writes its picks that fall below k, in index order.
#include <commtune/kernels/four.cuh>
#include <commtune/kernels/quantize_rules.h>
#include <commtune/kernels/top_k.h>

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

namespace commtune {
namespace {

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ uint32_t warp_sum(uint32_t v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// ---- select pass layout ----------------------------------------------------------------
constexpr int kSelectThreads = 256;
constexpr int kGroups = 4;  // groups of four entries a thread holds
constexpr int64_t kTile = kSelectThreads * kGroups * 4;

// A tile's state, one 64-bit word so it is written and read whole: the top two bits say what the
// low 32 count. 0: nothing posted yet.
constexpr uint64_t kOwnCount = 1ull << 62;      // the tile's own qualifying entries
constexpr uint64_t kRunningTotal = 2ull << 62;  // those of every tile up to and including it
constexpr uint64_t kKindBits = 3ull << 62;

// Scratch of one call: the tiles' states, then a word holding the next tile to hand out (low
// half) and the threshold's bits (high half).
struct Scratch {
  uint64_t* states;
  int64_t tiles;
  __device__ uint32_t* next_tile() const { return reinterpret_cast<uint32_t*>(states + tiles); }
  __device__ float* threshold() const { return reinterpret_cast<float*>(states + tiles) + 1; }
};

// ---- 1. the sample's threshold ------------------------------------------------------------
constexpr int kSampleThreads = 1024;
constexpr int kKeysPerThread = static_cast<int>(kTopKSample / kSampleThreads);

template <typename scalar_t>
__global__ void __launch_bounds__(kSampleThreads) sample_threshold_kernel(const scalar_t* __restrict__ x, TopKSample sample,
                                                                          Scratch scratch) {
  __shared__ uint32_t warp_counts[2][kSampleThreads / 32];
  uint32_t keys[kKeysPerThread];
#pragma unroll
  for (int j = 0; j < kKeysPerThread; ++j) {
    const int64_t s = threadIdx.x + static_cast<int64_t>(kSampleThreads) * j;
    // past the sample: 0, never counted (every candidate tried is at least 1)
    keys[j] = s < sample.size ? quant::float_bits(fabsf(static_cast<float>(x[s * sample.stride]))) : 0u;
  }
  for (int64_t t = threadIdx.x; t <= scratch.tiles; t += kSampleThreads) scratch.states[t] = 0;
  const uint32_t want = static_cast<uint32_t>(sample.want);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  uint32_t found = 0;
  // |x| has no sign bit: bit 30 is the top one. Two count buffers, so one barrier a bit: a warp
  // writes a buffer again only after every warp has passed the barrier of the bit between.
  for (int bit = 30; bit >= 0; --bit) {
    const uint32_t candidate = found | 1u << bit;
    uint32_t mine = 0;
#pragma unroll
    for (int j = 0; j < kKeysPerThread; ++j) mine += keys[j] >= candidate;
    const uint32_t in_warp = warp_sum(mine);
    uint32_t* counts = warp_counts[bit % 2];
    if (lane == 0) counts[warp] = in_warp;
    __syncthreads();
    uint32_t total = 0;
#pragma unroll
    for (int w = 0; w < kSampleThreads / 32; ++w) total += counts[w];
    if (total >= want) found = candidate;  // the same in every thread
  }
  __syncthreads();  // the states are cleared before the threshold says the pass may start
  if (threadIdx.x == 0) *scratch.threshold() = quant::float_from_bits(found);
}

// ---- 2. the select pass --------------------------------------------------------------------
__device__ __forceinline__ uint64_t read_state(const uint64_t* state) {
  return *reinterpret_cast<const volatile uint64_t*>(state);
}

__device__ __forceinline__ void post_state(uint64_t* state, uint64_t value) {
  *reinterpret_cast<volatile uint64_t*>(state) = value;
}

// How many entries qualified in the tiles before `tile` (> 0), by warp 0 of its block. Lane l
// looks at tile - 1 - l (waiting until it has posted), the warp adds counts up to the nearest
// tile that posted a running total, and moves 32 tiles back while none has.
__device__ uint32_t qualified_before(const uint64_t* states, int64_t tile, int lane) {
  uint32_t before = 0;
  for (int64_t end = tile - 1;; end -= 32) {
    const int64_t t = end - lane;
    uint64_t s = t >= 0 ? read_state(states + t) : kRunningTotal;  // before tile 0: a total of 0
    while ((s & kKindBits) == 0) s = read_state(states + t);
    const uint32_t totals = __ballot_sync(kFull, (s & kKindBits) == kRunningTotal);
    const int stop = totals != 0 ? __ffs(totals) - 1 : 31;
    before += warp_sum(lane <= stop ? static_cast<uint32_t>(s) : 0u);
    if (totals != 0) return before;
  }
}

// The picks go to values[n], indices[n] for the n-th qualifying entry while n < k.
struct Picks {
  float* values;
  int32_t* indices;
  int64_t k;
  int64_t* qualifying;
};

// Field g (16 bits) of a packed count holds group g's count: a block's per-group counts
// (<= 1024) scan in one 64-bit word.
__device__ __forceinline__ uint32_t field(uint64_t packed, int g) { return static_cast<uint32_t>(packed >> (16 * g)) & 0xFFFFu; }

template <typename scalar_t>
__global__ void __launch_bounds__(kSelectThreads) select_kernel(scalar_t* __restrict__ x, int64_t numel, Scratch scratch,
                                                                Picks picks, bool clear, bool vector) {
  __shared__ uint64_t warp_packed[kSelectThreads / 32];
  __shared__ uint32_t tile_shared, before_shared;
  // Tiles are handed out in the order blocks start, so every tile a block waits on has started.
  if (threadIdx.x == 0) tile_shared = atomicAdd(scratch.next_tile(), 1u);
  __syncthreads();
  const int64_t tile = tile_shared;
  const float threshold = *scratch.threshold();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // Group g of this thread: entries at + 4 * (threadIdx.x + kSelectThreads * g) .. + 3, so a
  // warp's loads of one g are contiguous; index order is (g, thread, entry).
  const int64_t at = tile * kTile + 4 * threadIdx.x;
  float v[kGroups][4];
#pragma unroll
  for (int g = 0; g < kGroups; ++g) four::load(x, at + 4 * kSelectThreads * g, numel, vector, v[g]);
  uint32_t flags = 0;  // bit 4g + e: entry e of group g qualifies
  uint64_t packed = 0;
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t i = at + 4 * kSelectThreads * g + e;
      if (i < numel && fabsf(v[g][e]) >= threshold) flags |= 1u << (4 * g + e);
    }
    packed |= static_cast<uint64_t>(__popc((flags >> (4 * g)) & 15u)) << (16 * g);
  }
  // Exclusive scan of the packed counts over the block: the warp's, then the warps' before it.
  uint64_t inclusive = packed;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const uint64_t other = __shfl_up_sync(kFull, inclusive, o);
    if (lane >= o) inclusive += other;
  }
  if (lane == 31) warp_packed[warp] = inclusive;
  __syncthreads();
  uint64_t exclusive = inclusive - packed, block = 0;
#pragma unroll
  for (int w = 0; w < kSelectThreads / 32; ++w) {
    if (w < warp) exclusive += warp_packed[w];
    block += warp_packed[w];
  }
  const uint32_t own = field(block, 0) + field(block, 1) + field(block, 2) + field(block, 3);
  if (warp == 0) {
    uint32_t before = 0;
    if (tile == 0) {
      if (lane == 0) post_state(scratch.states, kRunningTotal | own);
    } else {
      if (lane == 0) post_state(scratch.states + tile, kOwnCount | own);
      before = qualified_before(scratch.states, tile, lane);
      if (lane == 0) post_state(scratch.states + tile, kRunningTotal | (before + own));
    }
    if (lane == 0) {
      before_shared = before;
      if (tile == scratch.tiles - 1) *picks.qualifying = static_cast<int64_t>(before) + own;
    }
  }
  __syncthreads();
  int64_t n = before_shared;  // the n of this thread's next pick, group by group
  if (flags == 0 || n >= picks.k) return;
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    int64_t slot = n + field(exclusive, g);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (!(flags >> (4 * g + e) & 1u) || slot >= picks.k) continue;
      const int64_t i = at + 4 * kSelectThreads * g + e;
      picks.values[slot] = v[g][e];
      picks.indices[slot] = static_cast<int32_t>(i);
      if (clear) x[i] = scalar_t(0);
      ++slot;
    }
    n += field(block, g);
  }
}

} // namespace

void threshold_top_k_cuda_(const at::Tensor& x, int64_t k, const at::Tensor& piece, const at::Tensor& qualifying,
                           bool clear, const TopKSample& sample) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t numel = x.numel();
  // unused slots send value 0 at index 0
  C10_CUDA_CHECK(cudaMemsetAsync(piece.mutable_data_ptr(), 0, piece.nbytes(), stream));
  const int64_t tiles = (numel + kTile - 1) / kTile;
  at::Tensor states = at::empty({tiles + 1}, x.options().dtype(at::kLong));
  const Scratch scratch{reinterpret_cast<uint64_t*>(states.mutable_data_ptr<int64_t>()), tiles};
  int32_t* out = piece.mutable_data_ptr<int32_t>();
  const Picks picks{reinterpret_cast<float*>(out), out + k, k, qualifying.mutable_data_ptr<int64_t>()};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "threshold_top_k", [&] {
    scalar_t* in = x.mutable_data_ptr<scalar_t>();
    sample_threshold_kernel<scalar_t><<<1, kSampleThreads, 0, stream>>>(in, sample, scratch);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    select_kernel<scalar_t><<<tiles, kSelectThreads, 0, stream>>>(in, numel, scratch, picks, clear,
                                                                  four::aligned<scalar_t>({in}));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

} // namespace commtune
