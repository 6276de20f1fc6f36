#pragma once
// The first kernel of TopK's threshold selection (top_k_cuda.cu): the threshold, the want-th
// largest |x| of the sample (TopKSample in top_k.h), found 8 bits at a time.
#include <commtune/kernels/dependent_launch.cuh>
#include <commtune/kernels/fused_add.cuh>
#include <commtune/kernels/quantize_rules.h>
#include <commtune/kernels/top_k.h>

#include <cooperative_groups.h>

#include <cstdint>

namespace commtune::threshold_search {

constexpr unsigned kFull = 0xffffffffu;

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
// With `add` (error feedback's gradient, fused: top_k.h), the keys are those of x + add.
// It also clears `overflow`, which the streaming pass sets where it meets an Inf or a NaN.
template <typename scalar_t, int kBlocks>
__global__ void __launch_bounds__(kSampleThreads) sample_threshold_kernel(const scalar_t* __restrict__ x,
                                                                          const scalar_t* __restrict__ add,
                                                                          TopKSample sample, float* threshold,
                                                                          uint32_t* overflow) {
  using Blocks = Cluster<kBlocks>;
  constexpr int kRounds = 4, kBins = 256, kBinsPerLane = kBins / 32, kFew = 32;
  constexpr int kKeys = static_cast<int>(kTopKSample / (kBlocks * kSampleThreads));
  static_assert(kKeys * kBlocks * kSampleThreads == kTopKSample, "the sample splits evenly");
  __shared__ uint32_t histograms[kRounds][kBins];  // this block's keys (bin_at)
  __shared__ uint32_t cluster_bins[kBins];  // the round's counts over the cluster (kBlocks > 1)
  __shared__ uint32_t few[kFew];  // the leading block's: the keys matching, once they are few
  __shared__ uint32_t few_count;
  const int rank = Blocks::rank();
  if (rank == 0 && threadIdx.x == 0) *overflow = 0u;
  uint32_t keys[kKeys];
#pragma unroll
  for (int j = 0; j < kKeys; ++j) {
    const int64_t s = rank * kSampleThreads + threadIdx.x + static_cast<int64_t>(kBlocks) * kSampleThreads * j;
    if (s >= sample.size) {
      keys[j] = 0u;
      continue;
    }
    const int64_t i = s * sample.stride;
    const scalar_t v = add != nullptr ? fused_sum(x[i], add[i]) : x[i];  // add: the sum the stream will see
    keys[j] = quant::float_bits(fabsf(static_cast<float>(v)));
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

} // namespace commtune::threshold_search
