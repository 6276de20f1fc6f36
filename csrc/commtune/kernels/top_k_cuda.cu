// CUDA side of threshold_top_k_ (checks and the CPU loop in top_k.cpp), three kernels:
// 1. The sample's threshold, the want-th largest key (non-negative floats order as their bits),
//    found 8 bits at a time from the top by a cluster of blocks that gather the sample themselves
//    (top_k_search.cuh).
// 2. The bucket streams through once in warp tiles of 512 entries, with no warp waiting on
//    another: one wave of blocks, each warp with its own run of whole warp tiles and two of them
//    in flight into its share of shared memory, finds the qualifying entries in index order and
//    keeps them in shared memory; they go to the run's slots in a scratch buffer in whole runs
//    (room for twice the expected number).
//    With `clear`, it also zeroes in the bucket each entry it keeps a slot for (fp32, fp16, bf16:
//    a slot's float holds their value exactly), just after reading it. With `add` (error
//    feedback's add fused in), it streams x + add instead and writes the sums back whole, the
//    entries it keeps as 0.
// 3. A block for each streaming block, a warp for each run, adds up the counts of the runs before
//    it and copies the run's entries to their places among the first k; an entry that the
//    streaming pass cleared and that falls past the k-th gets its value back. A run with more
//    qualifying entries than slots is read again from the bucket after its last slot's entry.
// 4. With `clear`, when the bucket holds an Inf or a NaN, their entries become 0 (a kernel of its
//    own, after every read of the bucket; with none, each block reads one flag and ends).
// From sm_90 on, each kernel is launched while the one before runs (dependent_launch.cuh): no
// gaps between them, and the streaming pass's warps load their first tiles while the threshold
// is found (~12 us on an H100), and ask L2 for the two after them, instead of leaving the memory
// idle until it is found.
#include <commtune/kernels/dependent_launch.cuh>
#include <commtune/kernels/four.cuh>
#include <commtune/kernels/fused_add.cuh>
#include <commtune/kernels/top_k.h>
#include <commtune/kernels/top_k_search.cuh>

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace commtune {
namespace {

constexpr unsigned kFull = 0xffffffffu;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kGroups = 4;  // groups of four entries a lane of the streaming pass holds
constexpr int64_t kWarpTile = 32 * kGroups * 4;
// One call's scratch: each run's slots for the entries it finds (value bits, index), their
// count, the threshold and whether the bucket holds an Inf or a NaN (top_k.h). (The streaming
// blocks' counts, the sums of their runs', follow the runs' counts; the kernels take them as a
// parameter of their own.)
struct Scratch {
  int2* slots;  // runs x capacity
  uint32_t* counts;  // runs
  float* threshold;
  uint32_t* overflow;  // cleared by the search, set by the streaming pass
  int64_t tiles;  // warp tiles
  int runs;  // of the streaming pass: kWarps a block, each with a run of whole warp tiles
  int capacity;
};

// ---- 2. the streaming pass -----------------------------------------------------------------
// The sum of `mine` over the calling warp's lanes up to and including this one.
__device__ __forceinline__ uint32_t warp_inclusive_sum(uint32_t mine) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const uint32_t other = __shfl_up_sync(kFull, mine, o);
    if (lane >= o) mine += other;
  }
  return mine;
}

// Field g (16 bits) of a packed count holds group g's count: a warp's per-group counts (<= 128)
// scan as 8-bit fields of one 32-bit word, widened by two byte permutes to add up past 255.
__device__ __forceinline__ uint32_t field(uint64_t packed, int g) {
  return static_cast<uint32_t>(packed >> (16 * g)) & 0xFFFFu;
}

__device__ __forceinline__ uint64_t widen(uint32_t bytes) {
  return static_cast<uint64_t>(__byte_perm(bytes, 0u, 0x4342u)) << 32 | __byte_perm(bytes, 0u, 0x4140u);
}

// One wave of blocks; each warp streams its own run of whole warp tiles, so that the entries a
// warp finds, in the order it finds them, are in index order after those of the runs before it.
// Warps, not blocks, own the tiles: no block barrier a tile (the block-wide tiles of 4096 this
// replaced streamed 1.6 us slower after the threshold on an H100, and a call took 0.8 us more:
// topk_warp_runs_ab_session22.json). kStages warp tiles are in flight into the warp's shared
// memory: the first kStages are requested before the threshold is known, so they load while the
// search runs (25 MB on an H200); each tile processed frees its stage for the one kStages ahead.
// Two stages and 6 blocks an SM: faster than three and 4 blocks (the same file).
template <typename scalar_t>
constexpr int kStages = sizeof(scalar_t) <= 4 ? 2 : 1;
constexpr int kStreamingBlocksPerSm = 6;
// Warp tiles past its stages that a warp asks L2 for before the threshold is known: the stages
// alone (25 MB on an H100) are in ~1.5 us before the search ends, and the memory then waits. Two
// more tiles a warp keep it busy (a call ~3 us faster on an H100; three, 1.3 us slower than two:
// topk_l2_ab_session23.json).
constexpr int kPrefetched = 2;
// The entries a warp finds collect in shared memory, kBuffered of them, and go to the run's
// slots in global memory as whole runs when the buffer is full and at the end. Written as they
// were found, a few for each tile, they cost ~4 us of the 100 MB stream (sectors written in
// part; the eleventh session's probe).
constexpr int kBuffered = 64;

// Whether the streaming pass clears the entries it keeps (a slot's float restores them exactly).
// Cleared by the placing pass, after the whole stream, each 4-byte store went to memory for its
// sector (~13 us of the call's 62 on an H100 at k = 1%, topk_clear_probe_h100_session26.txt);
// cleared in the stream, the call took 47.4 us against 49.7 on an H200, 38.5 without clearing
// (take_and_topk_clear_ab_h200_session30.txt).
template <typename scalar_t>
constexpr bool kClearsInStream = sizeof(scalar_t) <= 4;

template <typename scalar_t>
constexpr int stage_bytes() {
  return static_cast<int>(kWarpTile * sizeof(scalar_t));
}

// A warp's shared memory: its stages, then its buffer.
template <typename scalar_t>
constexpr int warp_shared_bytes() {
  return kStages<scalar_t> * stage_bytes<scalar_t>() + kBuffered * static_cast<int>(sizeof(int2));
}

template <typename scalar_t>
constexpr int streaming_shared_bytes() {
  return kWarps * warp_shared_bytes<scalar_t>();
}

// The first warp tile of run `run` (run = runs: the end of the last run).
__device__ __forceinline__ int64_t first_tile_of(const Scratch& scratch, int run) {
  return scratch.tiles * run / scratch.runs;
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

// The calling warp requests warp tile `tile` into `stage` (zeros past numel): 16-byte
// asynchronous copies where the whole tile exists and x is 16-byte aligned (`aligned16`; tiles
// start 1 KB or more apart, so then every piece is), else plain loads and stores. The copies
// mark their lines in L2 first to go: each is read once, and the lines the passes write (the
// slots, the picks, the counts) should then stay in L2; unmarked, the stream wrote 6.8 MB back to
// memory as it read (Nsight Compute). A call 1.3-2.7 us faster on an H100
// (topk_l2_ab_session23.json).
template <typename scalar_t>
__device__ __forceinline__ void copy_tile(const scalar_t* __restrict__ x, int64_t numel, int64_t tile, bool aligned16,
                                          scalar_t* stage) {
  const int64_t first = tile * kWarpTile;
  const int lane = threadIdx.x % 32;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (aligned16 && first + kWarpTile <= numel) {
    const char* from = reinterpret_cast<const char*>(x + first);
    const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(stage));
    constexpr int kPieces = stage_bytes<scalar_t>() / 16;
    static_assert(kPieces % 32 == 0, "a warp tile is whole 16-byte pieces for every lane");
    uint64_t evict_first;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(evict_first));
#pragma unroll
    for (int i = 0; i < kPieces / 32; ++i) {
      const int p = lane + 32 * i;
      asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(to + 16 * p),
                   "l"(from + 16 * p), "l"(evict_first)
                   : "memory");
    }
    return;
  }
#endif
  for (int j = lane; j < kWarpTile; j += 32) stage[j] = first + j < numel ? x[first + j] : scalar_t(0);
}

// Asks L2 for warp tile `tile` (one bulk prefetch) if `wanted`, the tile is before `end`, whole and
// 16-byte aligned. sm_90 on; elsewhere nothing.
template <typename scalar_t>
__device__ __forceinline__ void prefetch_tile(const scalar_t* x, int64_t numel, int64_t tile, int64_t end,
                                              bool aligned16, bool wanted) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (wanted && aligned16 && tile < end && (tile + 1) * kWarpTile <= numel) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(x + tile * kWarpTile), "r"(stage_bytes<scalar_t>())
                 : "memory");
  }
#endif
}

// slots[written + j] = buffered[j] for j < held, those below the capacity (the calling warp).
__device__ __forceinline__ void write_buffered(const int2* buffered, uint32_t held, int2* slots, uint32_t written,
                                               int capacity) {
  for (uint32_t j = threadIdx.x % 32; j < held && written + j < static_cast<uint32_t>(capacity); j += 32) {
    slots[written + j] = buffered[j];
  }
}

// What the streaming pass does before the threshold is known: the picks' slots zeroed (unused
// ones send value 0 at index 0).
struct Zeroes {
  int32_t* piece;
  int64_t words;
};

// With error feedback's add fused in (kAdds: x the error buffer, add the new gradient, both
// aligned to a Four), each lane loads add's entries of its groups as the tile's copy lands, sums
// them into its share of the stage, and writes its sums back to x whole (0 for the entries it
// keeps, with `clear`): the bucket is written in full, so clearing needs no store of its own. More
// registers: 4 blocks an SM. On an H100 the call took 122.5 us; asking L2 for add's tiles ahead
// (as for x's first ones) made it 144.5, and staging add's tiles by cp.async beside x's (3 blocks
// an SM) 126.2 (topk_fused_variants_h100_session31.txt).
template <typename scalar_t>
__device__ __forceinline__ void load_addend(const scalar_t* __restrict__ add, int64_t numel, int64_t tile,
                                            four::Four<scalar_t> (&addend)[kGroups]) {
  const int64_t base = tile * kWarpTile + 4 * (threadIdx.x % 32);
  const bool whole = (tile + 1) * kWarpTile <= numel;
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    const int64_t at = base + 128 * g;
    if (whole) {
      addend[g] = *reinterpret_cast<const four::Four<scalar_t>*>(add + at);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) addend[g].v[e] = at + e < numel ? add[at + e] : scalar_t(0);
    }
  }
}

template <typename scalar_t>
__device__ __forceinline__ void store_sums(scalar_t* __restrict__ x, int64_t numel, int64_t tile, const scalar_t* values,
                                           uint32_t zeroed) {
  const int lane = threadIdx.x % 32;
  const bool whole = (tile + 1) * kWarpTile <= numel;
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    four::Four<scalar_t> v = *reinterpret_cast<const four::Four<scalar_t>*>(values + 4 * lane + 128 * g);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (zeroed >> (4 * g + e) & 1u) v.v[e] = scalar_t(0);
    }
    const int64_t at = tile * kWarpTile + 4 * lane + 128 * g;
    if (whole) {
      *reinterpret_cast<four::Four<scalar_t>*>(x + at) = v;
    } else {
      for (int e = 0; e < 4 && at + e < numel; ++e) x[at + e] = v.v[e];
    }
  }
}

constexpr int kFusedBlocksPerSm = 4;

template <typename scalar_t, bool kAdds>
__global__ void __launch_bounds__(kThreads, kAdds ? kFusedBlocksPerSm : kStreamingBlocksPerSm)
    streaming_kernel(scalar_t* __restrict__ x, const scalar_t* __restrict__ add, int64_t numel, Scratch scratch,
                     bool aligned16, Zeroes zeroes, uint32_t* block_counts, bool clear) {
  extern __shared__ __align__(16) unsigned char shared_memory[];
  __shared__ uint32_t warp_counts[kWarps];
  constexpr int kDepth = kStages<scalar_t>;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  unsigned char* mine = shared_memory + warp * warp_shared_bytes<scalar_t>();
  const auto stage = [&](int s) { return reinterpret_cast<scalar_t*>(mine + s * stage_bytes<scalar_t>()); };
  int2* buffered = reinterpret_cast<int2*>(mine + kDepth * stage_bytes<scalar_t>());
  const int run = blockIdx.x * kWarps + warp;
  const int64_t first = first_tile_of(scratch, run), end = first_tile_of(scratch, run + 1);
#pragma unroll
  for (int s = 0; s < kDepth; ++s) {
    if (first + s < end) copy_tile(x, numel, first + s, aligned16, stage(s));
    commit_copies();  // empty groups too: the count of groups stays kDepth ahead
  }
  prefetch_tile(x, numel, first + kDepth + lane, end, aligned16, lane < kPrefetched);
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; w < zeroes.words;
       w += static_cast<int64_t>(gridDim.x) * kThreads) {
    zeroes.piece[w] = 0;
  }
  dependent::allow_next_grid();
  dependent::wait_for_prior_grid();  // the threshold
  const float threshold = *scratch.threshold;
  int2* slots = scratch.slots + static_cast<int64_t>(run) * scratch.capacity;
  uint32_t held = 0, written = 0;  // entries in the buffer; entries found before them
  float largest = 0.0f;  // of the lane's entries: Inf or NaN once one is
  int s = 0;
  for (int64_t tile = first; tile < end; ++tile) {
    four::Four<scalar_t> addend[kGroups];
    if constexpr (kAdds) {
      load_addend(add, numel, tile, addend);  // before the wait: in flight with the copies
    }
    wait_copies<kDepth - 1>();  // this lane's copies of this tile (kDepth - 1 later ones may still load)
    __syncwarp();  // and every lane's
    scalar_t* values = stage(s);
    if constexpr (kAdds) {  // the lane's own entries of the stage become the sums
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        auto& v = *reinterpret_cast<four::Four<scalar_t>*>(values + 4 * lane + 128 * g);
#pragma unroll
        for (int e = 0; e < 4; ++e) v.v[e] = fused_sum(v.v[e], addend[g].v[e]);  // zeros past numel stay 0
      }
    }
    // Group g of this lane: entries 4 * lane + 128 * g .. + 3 of the tile, so the warp's reads of
    // one g are contiguous; index order within the tile is (g, lane, entry). Indices fit in 32
    // bits.
    uint32_t flags = 0;  // bit 4g + e: entry e of group g qualifies
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const four::Four<scalar_t> v = *reinterpret_cast<const four::Four<scalar_t>*>(values + 4 * lane + 128 * g);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float value = static_cast<float>(v.v[e]);
        if (fabsf(value) >= threshold) flags |= 1u << (4 * g + e);
        largest = quant::max_magnitude(largest, value);  // zeros past numel change nothing
      }
    }
    const int64_t in_tile = numel - tile * kWarpTile;
    if (in_tile < kWarpTile) {  // the last tile: its zeros past numel qualify when the threshold is 0
#pragma unroll
      for (int g = 0; g < kGroups; ++g) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (4 * lane + 128 * g + e >= in_tile) flags &= ~(1u << (4 * g + e));
        }
      }
    }
    uint32_t packed = 0;  // byte g: group g's count
    uint32_t kept_bits = 0;  // bit 4g + e: this lane's entry got a slot (kAdds: zeroed in the store)
#pragma unroll
    for (int g = 0; g < kGroups; ++g) packed |= __popc((flags >> (4 * g)) & 15u) << (8 * g);
    const uint32_t inclusive = warp_inclusive_sum(packed);  // of the packed counts
    const uint64_t total = widen(__shfl_sync(kFull, inclusive, 31));
    const uint32_t count = field(total, 0) + field(total, 1) + field(total, 2) + field(total, 3);
    if (count != 0) {  // the same for every lane
      if (held + count > kBuffered) {  // the buffer goes out first
        write_buffered(buffered, held, slots, written, scratch.capacity);
        written += held;
        held = 0;
        __syncwarp();
      }
      // A tile with more entries than the buffer holds writes them to the slots directly.
      const bool direct = count > kBuffered;
      // field g: where this lane's entries of group g go, after the tile's earlier groups (index
      // order is group, lane, entry); fields stay below 2^16, so no carries
      const uint64_t starts = widen(inclusive - packed) + (total << 16) + (total << 32) + (total << 48);
      for (uint32_t left = flags; left != 0; left &= left - 1) {  // the qualifying entries only
        const int b = __ffs(left) - 1, g = b / 4;
        const uint32_t slot = field(starts, g) + __popc(flags & (0xFu << (4 * g)) & ((1u << b) - 1));
        // read again from shared memory rather than kept through the scan: fewer registers
        const int j = 4 * lane + 128 * g + b % 4;
        const int2 entry =
            make_int2(__float_as_int(static_cast<float>(values[j])), static_cast<int>(tile * kWarpTile) + j);
        const uint32_t at = (direct ? 0u : held) + slot;  // among the entries not yet written
        const bool kept = written + at < static_cast<uint32_t>(scratch.capacity);  // it gets a slot
        if (!direct) {
          buffered[at] = entry;
        } else if (kept) {
          slots[written + at] = entry;
        }
        if (kept) kept_bits |= 1u << b;
        if (!kAdds && kClearsInStream<scalar_t> && clear && kept) x[entry.y] = scalar_t(0);
      }
      if (direct) {
        written += count;
      } else {
        held += count;
      }
    }
    if constexpr (kAdds) store_sums(x, numel, tile, values, kClearsInStream<scalar_t> && clear ? kept_bits : 0u);
    __syncwarp();  // the stage is free, the buffer's new entries visible to the warp
    const int64_t next = tile + kDepth;
    if (next < end) copy_tile(x, numel, next, aligned16, stage(s));
    commit_copies();
    s = s + 1 == kDepth ? 0 : s + 1;
  }
  write_buffered(buffered, held, slots, written, scratch.capacity);
  if (__any_sync(kFull, !quant::finite_scale(largest)) && lane == 0) *scratch.overflow = 1u;
  if (lane == 0) {
    scratch.counts[run] = written + held;
    warp_counts[warp] = written + held;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t sum = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += warp_counts[w];
    block_counts[blockIdx.x] = sum;
  }
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
  const uint32_t inclusive = warp_inclusive_sum(mine);
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

// Slots of its run a lane of the placing pass loads before it knows where the run's entries go
// (lane, lane + 32, ...): at a ratio of 1% a run has ~40 entries.
constexpr int kEarlySlots = 2;

// Run `run`'s entries to their places among the picks, `before` entries ahead of them (the
// calling warp; `slots`: the run's, `early`: the lane's first of them, already loaded). Entries
// past the k-th that the streaming pass cleared get their value back. A run with more entries
// than its slots hold, where they matter (the picks are not complete at the slots' last), is read
// again from the bucket after its last slot's entry (the slots' entries may be cleared there).
template <typename scalar_t>
__device__ __forceinline__ void place_run(scalar_t* x, int64_t numel, const Scratch& scratch, const Picks& picks,
                                          bool clear, int run, int64_t before, uint32_t count, const int2* slots,
                                          const int2 (&early)[kEarlySlots]) {
  const int lane = threadIdx.x % 32;
  if (run == scratch.runs - 1 && lane == 0) *picks.qualifying = before + count;
  const bool cleared = kClearsInStream<scalar_t> && clear;  // the slots' entries, by the streaming pass
  const auto slotted = std::min<uint32_t>(count, static_cast<uint32_t>(scratch.capacity));
  // Slot j's entry is pick before + j: taken below k, else (if cleared) restored.
  const auto place = [&](uint32_t j, int2 s) {
    const float v = __int_as_float(s.x);
    if (before + j < picks.k) {
      take(x, picks, before + j, s.y, v, clear && !cleared);
    } else if (cleared) {
      x[s.y] = static_cast<scalar_t>(v);
    }
  };
  if (!cleared && before >= picks.k) return;
#pragma unroll
  for (int i = 0; i < kEarlySlots; ++i) {
    const uint32_t j = lane + 32 * i;
    if (j < slotted) place(j, early[i]);
  }
  for (uint32_t j = lane + 32 * kEarlySlots; j < slotted; j += 32) place(j, slots[j]);
  if (count == slotted || before + slotted >= picks.k) return;
  // Read the rest of the run again, 4 entries a lane a step (index order: lane, then entry).
  const float threshold = *scratch.threshold;
  const int64_t to = std::min<int64_t>(numel, first_tile_of(scratch, run + 1) * kWarpTile);
  int64_t next = before + slotted;
  const int64_t from = slotted == 0 ? first_tile_of(scratch, run) * kWarpTile : int64_t{slots[slotted - 1].y} + 1;
  for (int64_t at = from; at < to && next < picks.k; at += 128) {
    const int64_t i = at + 4 * lane;
    float v[4];
    uint32_t flags = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      v[e] = i + e < to ? static_cast<float>(x[i + e]) : 0.0f;
      if (i + e < to && fabsf(v[e]) >= threshold) flags |= 1u << e;
    }
    const uint32_t found = __popc(flags);
    const uint32_t inclusive = warp_inclusive_sum(found);
    int64_t n = next + inclusive - found;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (flags >> e & 1u) take(x, picks, n++, static_cast<int32_t>(i + e), v[e], clear);
    }
    next += __shfl_sync(kFull, inclusive, 31);
  }
}

// One block for each streaming block, one warp for each of its runs: the counts of the blocks
// and runs before it say where the run's entries go among the picks. Every load a warp needs
// goes out before any sum: one round trip to L2 rather than three (the counts of the blocks
// before, then of the runs before, then the slots; a call 0.7 us faster on an H100,
// topk_l2_ab_session23.json).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) place_kernel(scalar_t* x, int64_t numel, Scratch scratch,
                                                         const uint32_t* block_counts, Picks picks, bool clear) {
  __shared__ uint32_t totals[kThreads / 32];
  dependent::wait_for_prior_grid();  // the streaming pass's counts and slots
  const int block = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int run = block * kWarps + warp;
  uint32_t mine = 0;  // entries found in this thread's share of the blocks before this one
  for (int r = threadIdx.x; r < block; r += kThreads) mine += block_counts[r];
  const uint32_t lane_run = lane < kWarps ? scratch.counts[block * kWarps + lane] : 0u;  // the block's runs
  const bool overflow = *scratch.overflow != 0u;
  const int2* slots = scratch.slots + static_cast<int64_t>(run) * scratch.capacity;
  int2 early[kEarlySlots];  // read before the count is known: slots past it are never taken
#pragma unroll
  for (int i = 0; i < kEarlySlots; ++i) {
    const int j = lane + 32 * i;
    early[i] = j < scratch.capacity ? slots[j] : make_int2(0, 0);
  }
  uint32_t blocks_before = 0;
  block_exclusive_sum(mine, totals, blocks_before);
  int64_t before = blocks_before;
  for (int w = 0; w < warp; ++w) before += __shfl_sync(kFull, lane_run, w);
  place_run(x, numel, scratch, picks, clear, run, before, __shfl_sync(kFull, lane_run, warp), slots, early);
  if (overflow && before == 0) {  // the first pick carries the overflow (top_k.h), after its value
    __syncwarp();
    if (lane == 0) picks.values[0] = quant::float_from_bits(quant::kQuietNanBits);
  }
}

// ---- 4. the overflow's clearing -------------------------------------------------------------
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) clear_overflow_kernel(scalar_t* x, int64_t numel, const uint32_t* overflow) {
  dependent::wait_for_prior_grid();  // the placing pass's reads of the bucket, and the flag
  if (*overflow == 0u) return;
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < numel; i += int64_t{gridDim.x} * kThreads) {
    if (!isfinite(static_cast<float>(x[i]))) x[i] = scalar_t(0);
  }
}

// Slots a run keeps for its entries: twice the expected number and a buffer's worth, at most
// the run's entries or k (entries past the k-th of a run are never taken). Runs with more (and
// picks still to take) are read again: correct, slower.
int slots_per_run(const TopKSample& sample, int64_t run_entries, int64_t k) {
  const int64_t expected = (run_entries * sample.want + sample.size - 1) / sample.size;
  return static_cast<int>(std::min({2 * expected + kBuffered, run_entries, k}));
}

} // namespace

void threshold_top_k_cuda_(const at::Tensor& x, const at::Tensor& add, int64_t k, const at::Tensor& piece,
                           const at::Tensor& qualifying, bool clear, const TopKSample& sample) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t numel = x.numel();
  const int64_t tiles = (numel + kWarpTile - 1) / kWarpTile;
  int32_t* out = piece.mutable_data_ptr<int32_t>();
  const Picks picks{reinterpret_cast<float*>(out), out + k, k, qualifying.mutable_data_ptr<int64_t>()};
  const int device = x.get_device();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // The fused add (error feedback) reads add and writes x in Four accesses: both aligned to a Four
  // and to 16 bytes (so x's tiles are copied 16 bytes at a time), else x += add goes first, as a
  // pass of its own.
  const auto vector_bytes = static_cast<uintptr_t>(std::max<int64_t>(16, 4 * x.element_size()));
  const bool fused = add.defined() && reinterpret_cast<uintptr_t>(x.const_data_ptr()) % vector_bytes == 0 &&
                     reinterpret_cast<uintptr_t>(add.const_data_ptr()) % vector_bytes == 0;
  if (add.defined() && !fused) x.add_(add);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "threshold_top_k", [&] {
    scalar_t* in = x.mutable_data_ptr<scalar_t>();
    const scalar_t* addend = fused ? add.const_data_ptr<scalar_t>() : nullptr;
    const auto launch_all = [&](auto adds) {
      constexpr auto kStreaming = streaming_kernel<scalar_t, decltype(adds)::value>;
      const int shared = streaming_shared_bytes<scalar_t>();
      const int wave = dependent::blocks_at_once<kStreaming, kThreads>(device, sms, shared);
      const bool overlap = dependent::supported<kStreaming>(device);  // else plain launches
      using threshold_search::kSampleThreads, threshold_search::kSearchBlocks, threshold_search::sample_threshold_kernel;
      // Fewer blocks than a wave by the search's SMs: they are busy while the streaming blocks
      // start, and a block started after the search ends would finish its runs last.
      const int search_sms = overlap ? kSearchBlocks : 1;
      const int streaming = static_cast<int>(
          std::min<int64_t>((tiles + kWarps - 1) / kWarps, std::max(wave - search_sms * (wave / sms), 1)));
      const int runs = streaming * kWarps;
      const int64_t run_entries = (tiles + runs - 1) / runs * kWarpTile;
      const int capacity = slots_per_run(sample, run_entries, k);
      at::Tensor memory =
          at::empty({2 * runs * int64_t{capacity} + runs + streaming + 2}, x.options().dtype(at::kInt));
      int32_t* base = memory.mutable_data_ptr<int32_t>();
      auto* counts = reinterpret_cast<uint32_t*>(base + 2 * runs * int64_t{capacity});
      uint32_t* block_counts = counts + runs;
      const Scratch scratch{reinterpret_cast<int2*>(base), counts, reinterpret_cast<float*>(block_counts + streaming),
                            block_counts + streaming + 1, tiles, runs, capacity};
      const bool aligned16 = reinterpret_cast<uintptr_t>(in) % 16 == 0;
      const auto* bucket = static_cast<const scalar_t*>(in);
      if (overlap) {
        dependent::launch_cluster(kSearchBlocks, sample_threshold_kernel<scalar_t, kSearchBlocks>, kSearchBlocks,
                                  kSampleThreads, 0, stream, bucket, addend, sample, scratch.threshold,
                                  scratch.overflow);
      } else {
        dependent::launch(false, sample_threshold_kernel<scalar_t, 1>, 1, kSampleThreads, 0, stream, bucket, addend,
                          sample, scratch.threshold, scratch.overflow);
      }
      dependent::launch(overlap, kStreaming, streaming, kThreads, shared, stream, in, addend, numel, scratch, aligned16,
                        Zeroes{out, 2 * k}, block_counts, clear);
      dependent::launch(overlap, place_kernel<scalar_t>, streaming, kThreads, 0, stream, in, numel, scratch,
                        static_cast<const uint32_t*>(block_counts), picks, clear);
      if (clear) {
        dependent::launch(overlap, clear_overflow_kernel<scalar_t>, 2 * sms, kThreads, 0, stream, in, numel,
                          static_cast<const uint32_t*>(scratch.overflow));
      }
    };
    if (fused) {
      launch_all(std::true_type{});
    } else {
      launch_all(std::false_type{});
    }
  });
}

} // namespace commtune
