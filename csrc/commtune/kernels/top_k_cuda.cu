// CUDA side of threshold_top_k_ (checks and the CPU loop in top_k.cpp), three kernels:
// 1. The sample's threshold, the want-th largest key (non-negative floats order as their bits),
//    found 8 bits at a time from the top by a cluster of blocks that gather the sample themselves.
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
#include <commtune/kernels/quantize_rules.h>
#include <commtune/kernels/top_k.h>

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <cooperative_groups.h>
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

// ---- 1. the sample's threshold ------------------------------------------------------------
constexpr int kSampleThreads = 1024;
// From sm_90 on, the search runs on a cluster of kSearchBlocks blocks (one SM each) that share
// their counts through distributed shared memory (one block took ~11 us on an H200, after a
// kernel of its own had gathered the sample). Otherwise (older GPUs or builds) one block does it
// all.
constexpr int kSearchBlocks = 8;  // the portable cluster size

// The shared-memory operations of a cluster of kBlocks blocks; a lone block's are its own.
template <int kBlocks>
struct Cluster {
  __device__ static int rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (kBlocks > 1) return static_cast<int>(cooperative_groups::this_cluster().block_rank());
#endif
    return 0;  // clusters need sm_90: the host launches kBlocks > 1 only on sm_90 code
  }
  // A barrier of all the cluster's threads that also orders their shared memory.
  __device__ static void sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (kBlocks > 1) {
      cooperative_groups::this_cluster().sync();
      return;
    }
#endif
    __syncthreads();
  }
  // Block r's copy of the shared variable at p.
  template <typename T>
  __device__ static T* of(T* p, int r) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (kBlocks > 1) return cooperative_groups::this_cluster().map_shared_rank(p, r);
#endif
    return p;
  }
};

// Histogram bin d of a round sits at (d % 8) * 32 + d / 8: lane l's eight bins, 8l..8l+7, are
// then one a bank (stored in order, every warp's reads of them conflicted 8 ways).
__device__ __forceinline__ int bin_at(uint32_t digit) {
  return static_cast<int>((digit & 7u) * 32 + (digit >> 3));
}

// The sample's threshold, the want-th largest key (|x| as bits: non-negative floats order as
// their bits), 8 bits at a time from the top: each round counts the keys that match the digits
// found so far by their next digit and takes the largest digit d with at least `want` of them at
// or above it. The key sought has digit d, and is the (want - those above d)-th largest of the
// keys that do. Each round has its own histogram (zeroed once), so one barrier a round. Once 32
// keys or fewer match (normal values at a ratio of 1%: expected after two rounds), they go to
// the leading block, where one warp ranks them. The blocks gather their share of the sample
// themselves (keys past the sample are 0, which cannot move the want-th largest: want <= the
// sample's size, and no key is below 0), and every block finds the same digits from the
// cluster's sums.
template <typename scalar_t, int kBlocks>
__global__ void __launch_bounds__(kSampleThreads) sample_threshold_kernel(const scalar_t* __restrict__ x,
                                                                          TopKSample sample, float* threshold) {
  using Blocks = Cluster<kBlocks>;
  constexpr int kRounds = 4, kBins = 256, kBinsPerLane = kBins / 32, kFew = 32;
  constexpr int kKeys = static_cast<int>(kTopKSample / (kBlocks * kSampleThreads));
  static_assert(kKeys * kBlocks * kSampleThreads == kTopKSample, "the sample splits evenly");
  __shared__ uint32_t histograms[kRounds][kBins];  // this block's keys (bin_at)
  __shared__ uint32_t cluster_bins[kBins];  // the round's counts over the cluster (kBlocks > 1)
  __shared__ uint32_t few[kFew];  // the leading block's: the keys matching, once they are few
  __shared__ uint32_t few_count;
  const int rank = Blocks::rank();
  uint32_t keys[kKeys];
#pragma unroll
  for (int j = 0; j < kKeys; ++j) {
    const int64_t s = rank * kSampleThreads + threadIdx.x + static_cast<int64_t>(kBlocks) * kSampleThreads * j;
    keys[j] = s < sample.size ? quant::float_bits(fabsf(static_cast<float>(x[s * sample.stride]))) : 0u;
  }
  for (int i = threadIdx.x; i < kRounds * kBins; i += kSampleThreads) histograms[i / kBins][i % kBins] = 0;
  if (threadIdx.x == 0) few_count = 0;  // appended to after a cluster barrier
  const int lane = threadIdx.x % 32;
  uint32_t want = static_cast<uint32_t>(sample.want), prefix = 0;
  __syncthreads();
  // Only now do the streaming pass's blocks start (and then wait for the threshold): their first
  // tiles, requested at once, would queue ahead of the keys' loads (a call 0.9 us slower).
  dependent::allow_next_grid();
#pragma unroll
  for (int round = 0; round < kRounds; ++round) {
    const int shift = 8 * (kRounds - 1 - round);
    uint32_t* bins = histograms[round];
#pragma unroll
    for (int j = 0; j < kKeys; ++j) {
      const uint32_t digit = keys[j] >> shift & 0xFFu;
      if (round == 0) {
        // Most keys share their top digit (the exponent's): lanes with the same digit add once,
        // as one shared atomic, rather than queue on one address.
        const uint32_t peers = __match_any_sync(kFull, digit);
        if (lane == __ffs(peers) - 1) atomicAdd(&bins[bin_at(digit)], static_cast<uint32_t>(__popc(peers)));
      } else if ((keys[j] >> (shift + 8)) == prefix) {  // later digits spread: few lanes meet
        atomicAdd(&bins[bin_at(digit)], 1u);
      }
    }
    if constexpr (kBlocks > 1) {
      // Every block's counts of this round are in and are not written again: each block sums
      // them for itself (cluster_bins is rewritten only after the next round's barrier).
      Blocks::sync();
      if (threadIdx.x < kBins) {
        uint32_t sum = 0;
#pragma unroll
        for (int r = 0; r < kBlocks; ++r) sum += Blocks::of(bins, r)[threadIdx.x];
        cluster_bins[threadIdx.x] = sum;
      }
      bins = cluster_bins;
    }
    __syncthreads();
    // Every warp finds the digit (no broadcast, no further barrier): lane l holds bins
    // 8l..8l+7; `from` counts the keys in its bins and those above.
    uint32_t mine[kBinsPerLane], lane_total = 0;
#pragma unroll
    for (int b = 0; b < kBinsPerLane; ++b) lane_total += mine[b] = bins[32 * b + lane];
    uint32_t from = lane_total;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const uint32_t other = __shfl_down_sync(kFull, from, o);
      if (lane + o < 32) from += other;
    }
    const uint32_t enough = __ballot_sync(kFull, from >= want);
    // the highest lane with enough keys at or above its bins (none: the digit is 0)
    const int holder = enough != 0 ? 31 - __clz(enough) : 0;
    uint32_t digit = 0, above = from - lane_total, matching = 0;  // keys in the bins above; in d's
    if (lane == holder && enough != 0) {
      for (int b = kBinsPerLane - 1; b >= 0; --b) {
        if (above + mine[b] >= want) {
          digit = kBinsPerLane * lane + b;
          matching = mine[b];
          break;
        }
        above += mine[b];
      }
    }
    digit = __shfl_sync(kFull, digit, holder);
    above = __shfl_sync(kFull, above, holder);
    matching = __shfl_sync(kFull, matching, holder);
    if (enough != 0) want -= above;
    prefix = prefix << 8 | digit;
    if (round + 1 < kRounds && matching != 0 && matching <= kFew) {  // the same in every block
      uint32_t* list = Blocks::of(few, 0);
      uint32_t* count = Blocks::of(&few_count, 0);
#pragma unroll
      for (int j = 0; j < kKeys; ++j) {
        if ((keys[j] >> shift) == prefix) list[atomicAdd(count, 1u)] = keys[j];
      }
      Blocks::sync();
      if (rank == 0 && threadIdx.x < 32) {  // the want-th largest of the `matching` listed keys
        const bool listed = static_cast<uint32_t>(lane) < matching;
        const uint32_t key = listed ? few[lane] : 0u;
        uint32_t greater = 0, at_least = 0;
        for (int l = 0; l < kFew; ++l) {
          const uint32_t other = __shfl_sync(kFull, key, l);
          if (static_cast<uint32_t>(l) < matching) {
            greater += other > key;
            at_least += other >= key;
          }
        }
        const uint32_t sought = __ballot_sync(kFull, listed && greater < want && want <= at_least);
        const uint32_t found = __shfl_sync(kFull, key, __ffs(sought) - 1);
        if (lane == 0) *threshold = quant::float_from_bits(found);
      }
      return;
    }
  }
  Blocks::sync();  // the other blocks' reads of this block's counts are done
  if (rank == 0 && threadIdx.x == 0) *threshold = quant::float_from_bits(prefix);
}

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
