// CUDA side of threshold_top_k_ (checks and the CPU loop in top_k.cpp), three kernels:
// 1. The sample's threshold, the want-th largest key (non-negative floats order as their bits),
//    found 8 bits at a time from the top by a cluster of blocks that gather the sample themselves
//    (top_k_search.cuh).
// 2. The bucket streams through once in tiles of 4096 entries, with no block waiting on another:
//    one wave of blocks, each with a run of whole tiles and two of them in flight into shared
//    memory, finds the qualifying entries in index order and keeps them in shared memory; they go
//    to the block's slots in a scratch buffer in whole runs (room for twice the expected number).
// 3. A block for each run adds up the counts of the runs before it and copies the run's entries
//    to their places among the first k (and clears them from the bucket). A run with more
//    qualifying entries than slots is read again from the bucket.
// From sm_90 on, each kernel is launched while the one before runs (dependent_launch.cuh): no
// gaps between them, and the streaming pass's blocks load their first tiles while the threshold
// is found (~9 us), instead of leaving the memory idle until it is found.
#include <commtune/kernels/dependent_launch.cuh>
#include <commtune/kernels/four.cuh>
#include <commtune/kernels/top_k.h>
#include <commtune/kernels/top_k_search.cuh>

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>

namespace commtune {
namespace {

constexpr unsigned kFull = 0xffffffffu;

constexpr int kThreads = 256;
constexpr int kGroups = 4;  // groups of four entries a thread of the streaming pass holds
constexpr int64_t kTile = kThreads * kGroups * 4;
// One call's scratch: each streaming block's slots for the entries it finds (value bits,
// index), their count and the threshold.
struct Scratch {
  int2* slots;  // blocks x capacity
  uint32_t* counts;  // blocks
  float* threshold;
  int64_t tiles;
  int blocks;  // of the streaming pass, each with a run of whole tiles
  int capacity;
};

// ---- 2. the streaming pass -----------------------------------------------------------------
// Field g (16 bits) of a packed count holds group g's count: a block's per-group counts
// (<= 1024) scan in one 64-bit word. Within a warp (<= 128 a group) 8-bit fields of one 32-bit
// word do, widened for the block by two byte permutes.
__device__ __forceinline__ uint32_t field(uint64_t packed, int g) {
  return static_cast<uint32_t>(packed >> (16 * g)) & 0xFFFFu;
}

__device__ __forceinline__ uint64_t widen(uint32_t bytes) {
  return static_cast<uint64_t>(__byte_perm(bytes, 0u, 0x4342u)) << 32 | __byte_perm(bytes, 0u, 0x4140u);
}

// One wave of blocks, each streaming its own run of whole tiles, so that the entries a block
// finds, in the order it finds them, are in index order after those of the blocks before it.
// kStages tiles are in flight into shared memory: the first kStages are requested before the
// threshold is known, so they load while the search runs (25 MB on an H200); each tile processed
// frees its stage for the one kStages ahead. Two stages of 16 KB and 6 blocks an SM: 0.4-0.9 us a
// call faster than three stages and 4 blocks, or four and 3 (H200, topk_timeline.py).
template <typename scalar_t>
constexpr int kStages = sizeof(scalar_t) <= 4 ? 2 : 1;
constexpr int kStreamingBlocksPerSm = 6;
// The entries found collect in shared memory, kBuffered of them, and go to the block's slots in
// global memory as whole runs when the buffer is full and at the end. Written as they were found,
// a few for each tile, they cost ~4 us of the 100 MB stream (sectors written in part; the
// eleventh session's probe).
constexpr int kBuffered = 512;

template <typename scalar_t>
constexpr int stage_bytes() {
  return static_cast<int>(kTile * sizeof(scalar_t));
}

template <typename scalar_t>
constexpr int streaming_shared_bytes() {
  return kStages<scalar_t> * stage_bytes<scalar_t>() + kBuffered * static_cast<int>(sizeof(int2));
}

// The first tile of streaming block `block`'s run (block = blocks: the end of the last run).
__device__ __forceinline__ int first_tile_of(const Scratch& scratch, int block) {
  return static_cast<int>(scratch.tiles * block / scratch.blocks);
}

__device__ __forceinline__ void commit_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Returns when at most kPending of this thread's committed groups of copies are unfinished.
template <int kPending>
__device__ __forceinline__ void wait_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
#endif
}

// Requests tile `tile` into `stage` (zeros past numel): 16-byte asynchronous copies where the
// whole tile exists and x is 16-byte aligned (`aligned16`; tiles start 8 KB or more apart, so
// then every piece is), else plain loads and stores.
template <typename scalar_t>
__device__ __forceinline__ void copy_tile(const scalar_t* __restrict__ x, int64_t numel, int tile, bool aligned16,
                                          scalar_t* stage) {
  const int64_t first = static_cast<int64_t>(tile) * kTile;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (aligned16 && first + kTile <= numel) {
    const char* from = reinterpret_cast<const char*>(x + first);
    const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(stage));
    constexpr int kPieces = stage_bytes<scalar_t>() / 16;
    static_assert(kPieces % kThreads == 0, "a tile is whole 16-byte pieces for every thread");
#pragma unroll
    for (int i = 0; i < kPieces / kThreads; ++i) {
      const int p = threadIdx.x + kThreads * i;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to + 16 * p), "l"(from + 16 * p) : "memory");
    }
    return;
  }
#endif
  for (int j = threadIdx.x; j < kTile; j += kThreads) stage[j] = first + j < numel ? x[first + j] : scalar_t(0);
}

// slots[written + j] = buffered[j] for j < held, those below the capacity.
__device__ __forceinline__ void write_buffered(const int2* buffered, uint32_t held, int2* slots, uint32_t written,
                                               int capacity) {
  for (uint32_t j = threadIdx.x; j < held && written + j < static_cast<uint32_t>(capacity); j += kThreads) {
    slots[written + j] = buffered[j];
  }
}

// What the streaming pass does before the threshold is known: the picks' slots zeroed (unused
// ones send value 0 at index 0).
struct Zeroes {
  int32_t* piece;
  int64_t words;
};

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads, kStreamingBlocksPerSm)
    streaming_kernel(const scalar_t* __restrict__ x, int64_t numel, Scratch scratch, bool aligned16, Zeroes zeroes) {
  extern __shared__ __align__(16) unsigned char stage_memory[];
  __shared__ uint64_t warp_packed[kThreads / 32];
  constexpr int kDepth = kStages<scalar_t>;
  const auto stage = [&](int s) { return reinterpret_cast<scalar_t*>(stage_memory + s * stage_bytes<scalar_t>()); };
  int2* buffered = reinterpret_cast<int2*>(stage_memory + kDepth * stage_bytes<scalar_t>());
  const int first = first_tile_of(scratch, blockIdx.x), end = first_tile_of(scratch, blockIdx.x + 1);
#pragma unroll
  for (int s = 0; s < kDepth; ++s) {
    if (first + s < end) copy_tile(x, numel, first + s, aligned16, stage(s));
    commit_copies();  // empty groups too: the count of groups stays kDepth ahead
  }
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; w < zeroes.words;
       w += static_cast<int64_t>(gridDim.x) * kThreads) {
    zeroes.piece[w] = 0;
  }
  dependent::allow_next_grid();
  dependent::wait_for_prior_grid();  // the threshold
  const float threshold = *scratch.threshold;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int2* slots = scratch.slots + static_cast<int64_t>(blockIdx.x) * scratch.capacity;
  uint32_t held = 0, written = 0;  // entries in the buffer; entries found before them
  int s = 0;
  for (int tile = first; tile < end; ++tile) {
    wait_copies<kDepth - 1>();  // this tile's group (kDepth - 1 later ones may still load)
    __syncthreads();
    const scalar_t* values = stage(s);
    // Group g of this thread: entries 4 * threadIdx.x + 4 * kThreads * g .. + 3 of the tile, so
    // a warp's reads of one g are contiguous; index order within the tile is (g, thread, entry).
    // Indices fit in 32 bits.
    uint32_t flags = 0;  // bit 4g + e: entry e of group g qualifies
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const four::Four<scalar_t> v =
          *reinterpret_cast<const four::Four<scalar_t>*>(values + 4 * threadIdx.x + 4 * kThreads * g);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (fabsf(static_cast<float>(v.v[e])) >= threshold) flags |= 1u << (4 * g + e);
      }
    }
    const int64_t in_tile = numel - static_cast<int64_t>(tile) * kTile;
    if (in_tile < kTile) {  // the last tile: its zeros past numel qualify when the threshold is 0
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (4 * threadIdx.x + 4 * kThreads * g + e >= in_tile) flags &= ~(1u << (4 * g + e));
        }
      }
    }
    uint32_t packed = 0;  // byte g: group g's count
#pragma unroll
    for (int g = 0; g < kGroups; ++g) packed |= __popc((flags >> (4 * g)) & 15u) << (8 * g);
    // Exclusive scan of the packed counts over the block: the warp's, then the warps' before it.
    uint32_t inclusive = packed;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const uint32_t other = __shfl_up_sync(kFull, inclusive, o);
      if (lane >= o) inclusive += other;
    }
    if (lane == 31) warp_packed[warp] = widen(inclusive);
    __syncthreads();
    uint64_t exclusive = widen(inclusive - packed), block = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) {
      if (w < warp) exclusive += warp_packed[w];
      block += warp_packed[w];
    }
    const uint32_t count = field(block, 0) + field(block, 1) + field(block, 2) + field(block, 3);
    if (held + count > kBuffered) {  // the same for every thread: the buffer goes out first
      write_buffered(buffered, held, slots, written, scratch.capacity);
      written += held;
      held = 0;
      __syncthreads();
    }
    // A tile with more entries than the buffer holds writes them to the slots directly.
    const bool direct = count > kBuffered;
    if (flags != 0) {
      // field g: where this thread's entries of group g go, after the tile's earlier groups
      // (index order is group, thread, entry); fields stay below 2^16, so no carries
      const uint64_t starts = exclusive + (block << 16) + (block << 32) + (block << 48);
      for (uint32_t left = flags; left != 0; left &= left - 1) {  // the qualifying entries only
        const int b = __ffs(left) - 1, g = b / 4;
        const uint32_t slot = field(starts, g) + __popc(flags & (0xFu << (4 * g)) & ((1u << b) - 1));
        // read again from shared memory rather than kept through the scan: fewer registers
        const int j = 4 * threadIdx.x + 4 * kThreads * g + b % 4;
        const int2 entry = make_int2(__float_as_int(static_cast<float>(values[j])), tile * static_cast<int>(kTile) + j);
        if (!direct) {
          buffered[held + slot] = entry;
        } else if (written + slot < static_cast<uint32_t>(scratch.capacity)) {
          slots[written + slot] = entry;
        }
      }
    }
    if (direct) {
      written += count;
    } else {
      held += count;
    }
    __syncthreads();  // the stage and warp_packed are free again
    const int next = tile + kDepth;
    if (next < end) copy_tile(x, numel, next, aligned16, stage(s));
    commit_copies();
    s = s + 1 == kDepth ? 0 : s + 1;
  }
  write_buffered(buffered, held, slots, written, scratch.capacity);
  if (threadIdx.x == 0) scratch.counts[blockIdx.x] = written + held;
}

// ---- 3. the placing pass -------------------------------------------------------------------
struct Picks {
  float* values;
  int32_t* indices;
  int64_t k;
  int64_t* qualifying;
};

// Sends entry i (value v) as the n-th pick, if n < k.
template <typename scalar_t>
__device__ __forceinline__ void take(scalar_t* x, const Picks& picks, int64_t n, int32_t i, float v, bool clear) {
  if (n >= picks.k) return;
  picks.values[n] = v;
  picks.indices[n] = i;
  if (clear) x[i] = scalar_t(0);
}

// Block-wide exclusive sum of `mine` (kThreads threads); `total` receives the block's sum.
// `totals` is kThreads / 32 words of shared memory, free on entry, in use until the next call.
__device__ __forceinline__ uint32_t block_exclusive_sum(uint32_t mine, uint32_t* totals, uint32_t& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  uint32_t inclusive = mine;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const uint32_t other = __shfl_up_sync(kFull, inclusive, o);
    if (lane >= o) inclusive += other;
  }
  __syncthreads();  // the previous call's totals are read
  if (lane == 31) totals[warp] = inclusive;
  __syncthreads();
  uint32_t before = inclusive - mine;
  total = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) {
    if (w < warp) before += totals[w];
    total += totals[w];
  }
  return before;
}

// One block for each streaming block's run: the counts of the runs before it say where its
// entries go among the picks. A run with more entries than its slots hold, where they matter
// (the picks are not complete before the slots' last), is read again from the bucket.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) place_kernel(scalar_t* x, int64_t numel, Scratch scratch, Picks picks,
                                                         bool clear) {
  __shared__ uint32_t totals[kThreads / 32];
  dependent::wait_for_prior_grid();  // the streaming pass's counts and slots
  const int run = blockIdx.x;
  uint32_t mine = 0;  // entries found in this thread's share of the runs before this one
  for (int r = threadIdx.x; r < run; r += kThreads) mine += scratch.counts[r];
  uint32_t runs_before = 0;
  block_exclusive_sum(mine, totals, runs_before);
  const int64_t before = runs_before;
  const uint32_t count = scratch.counts[run];
  if (run == gridDim.x - 1 && threadIdx.x == 0) *picks.qualifying = before + count;
  if (before >= picks.k) return;
  if (count <= static_cast<uint32_t>(scratch.capacity) || before + scratch.capacity >= picks.k) {
    const int2* slots = scratch.slots + static_cast<int64_t>(run) * scratch.capacity;
    const auto taken = static_cast<uint32_t>(std::min<int64_t>(count, picks.k - before));
    for (uint32_t j = threadIdx.x; j < taken; j += kThreads) {
      const int2 s = slots[j];
      take(x, picks, before + j, s.y, __int_as_float(s.x), clear);
    }
    return;
  }
  // Read the run again, 4 entries a thread a step (index order: thread, then entry).
  const float threshold = *scratch.threshold;
  const int64_t to = std::min<int64_t>(numel, static_cast<int64_t>(first_tile_of(scratch, run + 1)) * kTile);
  int64_t next = before;
  for (int64_t at = static_cast<int64_t>(first_tile_of(scratch, run)) * kTile; at < to && next < picks.k;
       at += 4 * kThreads) {
    const int64_t i = at + 4 * threadIdx.x;
    float v[4];
    uint32_t flags = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      v[e] = i + e < to ? static_cast<float>(x[i + e]) : 0.0f;
      if (i + e < to && fabsf(v[e]) >= threshold) flags |= 1u << e;
    }
    uint32_t step = 0;
    int64_t n = next + block_exclusive_sum(__popc(flags), totals, step);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (flags >> e & 1u) take(x, picks, n++, static_cast<int32_t>(i + e), v[e], clear);
    }
    next += step;
  }
}

// Slots a streaming block keeps for its run's entries: twice the expected number and a buffer's
// worth, at most the run's entries or k (entries past the k-th of a run are never taken). Runs
// with more (and picks still to take) are read again: correct, slower.
int slots_per_run(const TopKSample& sample, int64_t run_entries, int64_t k) {
  const int64_t expected = (run_entries * sample.want + sample.size - 1) / sample.size;
  return static_cast<int>(std::min({2 * expected + kBuffered, run_entries, k}));
}

} // namespace

void threshold_top_k_cuda_(const at::Tensor& x, int64_t k, const at::Tensor& piece, const at::Tensor& qualifying,
                           bool clear, const TopKSample& sample) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t numel = x.numel();
  const int64_t tiles = (numel + kTile - 1) / kTile;
  int32_t* out = piece.mutable_data_ptr<int32_t>();
  const Picks picks{reinterpret_cast<float*>(out), out + k, k, qualifying.mutable_data_ptr<int64_t>()};
  const int device = x.get_device();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "threshold_top_k", [&] {
    scalar_t* in = x.mutable_data_ptr<scalar_t>();
    constexpr auto kStreaming = streaming_kernel<scalar_t>;
    const int shared = streaming_shared_bytes<scalar_t>();
    const int wave = dependent::blocks_at_once<kStreaming, kThreads>(device, sms, shared);
    const bool overlap = dependent::supported<kStreaming>(device);  // else plain launches
    using threshold_search::kSampleThreads, threshold_search::kSearchBlocks, threshold_search::sample_threshold_kernel;
    // Fewer blocks than a wave by the search's SMs: they are busy while the streaming blocks
    // start, and a block started after the search ends would finish its run last.
    const int search_sms = overlap ? kSearchBlocks : 1;
    const int streaming =
        static_cast<int>(std::min<int64_t>(tiles, std::max(wave - search_sms * (wave / sms), 1)));
    const int64_t run_entries = (tiles + streaming - 1) / streaming * kTile;
    const int capacity = slots_per_run(sample, run_entries, k);
    at::Tensor memory = at::empty({2 * streaming * int64_t{capacity} + streaming + 1}, x.options().dtype(at::kInt));
    int32_t* base = memory.mutable_data_ptr<int32_t>();
    int32_t* counts = base + 2 * streaming * int64_t{capacity};
    const Scratch scratch{reinterpret_cast<int2*>(base), reinterpret_cast<uint32_t*>(counts),
                          reinterpret_cast<float*>(counts + streaming), tiles, streaming, capacity};
    const bool aligned16 = reinterpret_cast<uintptr_t>(in) % 16 == 0;
    const auto* bucket = static_cast<const scalar_t*>(in);
    if (overlap) {
      dependent::launch_cluster(kSearchBlocks, sample_threshold_kernel<scalar_t, kSearchBlocks>, kSearchBlocks,
                                kSampleThreads, 0, stream, bucket, sample, scratch.threshold);
    } else {
      dependent::launch(false, sample_threshold_kernel<scalar_t, 1>, 1, kSampleThreads, 0, stream, bucket, sample,
                        scratch.threshold);
    }
    dependent::launch(overlap, kStreaming, streaming, kThreads, shared, stream, bucket, numel, scratch, aligned16,
                      Zeroes{out, 2 * k});
    dependent::launch(overlap, place_kernel<scalar_t>, streaming, kThreads, 0, stream, in, numel, scratch, picks,
                      clear);
  });
}

} // namespace commtune
