// CUDA kernels of the quantized allreduce's passes (the checks and CPU loops live in
// quantize.cpp, the arithmetic in quantize_rules.h). Chunks of up to 1024 elements (the default)
// take one warp each: a lane keeps its up to 32 values in registers, the absmax is a warp
// shuffle, and a lane has up to eight 16-byte loads in flight, which is what keeps HBM busy.
// Larger chunks take one block each, staged in shared memory. The kinds of codes are template
// arguments, so the per-element rules compile without branches.
#include <commtune/kernels/quantize.h>
#include <commtune/kernels/four.cuh>
#include <commtune/kernels/quantize_rules.h>
#include <commtune/kernels/quantize_words.cuh>

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace commtune {
namespace {

constexpr int kThreads = 256;

// The largest |value| of the block's chunk in shared memory, seen by every thread.
__device__ float block_absmax(const float* values, int64_t n) {
  __shared__ float partial[kThreads / 32];
  float m = 0.0f;
  for (int64_t j = threadIdx.x; j < n; j += kThreads) m = quant::max_magnitude(m, values[j]);
  for (int o = 16; o > 0; o /= 2) m = quant::max_magnitude(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = m;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) total = quant::max_magnitude(total, partial[w]);
  __syncthreads();  // partial may be reused by the next call
  return total;
}

// Encodes four values of the chunk held in shared memory into one store of codes.
__device__ __forceinline__ void encode_store_four(const float* values, int64_t j, uint64_t first_index,
                                                  int64_t draws, float inverse, quant::Codes kind, uint8_t* codes,
                                                  float (&level)[4]) {
  int8_t q[4];
  quant::encode_four(values + j, first_index + j, draws, inverse, kind, q, level);
  quant::store_four_codes(codes, j, q, kind);
}

// error[at..at+3] = what the codes lose of values[0..3] (before numel), from the codes' levels
// (the CPU loop decodes the stored codes instead; the two agree bit for bit).
template <typename scalar_t>
__device__ __forceinline__ void store_error_four(scalar_t* error, int64_t at, int64_t numel, bool vector,
                                                 const float* values, const float (&level)[4], float scale) {
  float rest[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) rest[k] = quant::error_of(values[k], level[k], scale);
  four::store(error, at, numel, vector, rest);
}

// ---- one block per chunk (chunk > 1024) -----------------------------------------------------
// Chunks are whole multiples of 8 elements, so a chunk's codes start 4-byte aligned (8 bits)
// or 2-byte aligned (int4): four codes are one access.
template <typename scalar_t>
__global__ void quantize_kernel(const scalar_t* __restrict__ src, scalar_t* error, uint8_t* __restrict__ packed,
                                QuantizeLayout l, int64_t draws, bool vector) {
  extern __shared__ float values[];
  const int64_t s = blockIdx.x / l.chunks_per_shard(), c = blockIdx.x % l.chunks_per_shard();
  const int64_t first = s * l.shard + c * l.chunk;
  for (int64_t j = 4 * threadIdx.x; j < l.chunk; j += 4 * kThreads) four::load(src, first + j, l.numel, vector, values + j);
  __syncthreads();
  uint8_t* codes = l.codes(packed, s, c);
  const float scale = quant::scale_of(block_absmax(values, l.chunk), l.kind), inverse = quant::inverse(scale);
  for (int64_t j = 4 * threadIdx.x; j < l.chunk; j += 4 * kThreads) {
    float level[4];
    encode_store_four(values, j, first, draws, inverse, l.kind, codes, level);
    if (error != nullptr) store_error_four(error, first + j, l.numel, vector, values + j, level, scale);
  }
  if (threadIdx.x == 0) *l.scale(packed, s, c) = scale;
}

__global__ void reduce_kernel(uint8_t* __restrict__ received, uint8_t* __restrict__ piece, QuantizeLayout l,
                              quant::Divisor divisor, int64_t draws) {
  extern __shared__ float values[];
  const int64_t c = blockIdx.x;
  for (int64_t j = 4 * threadIdx.x; j < l.chunk; j += 4 * kThreads) {
    float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f}, scale_sum = 0.0f;
#pragma unroll 8  // the ranks' loads are independent: let them be in flight together
    for (int64_t r = 0; r < l.ranks; ++r) {
      int8_t q[4];
      quant::load_four_codes(l.codes(received, r, c), j, l.kind, q);
      const float scale = *l.scale(received, r, c);
#pragma unroll
      for (int k = 0; k < 4; ++k) sum[k] = quant::add_decoded(sum[k], q[k], scale, l.kind);
      scale_sum = quant::add(scale_sum, scale);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) values[j + k] = divisor.apply(quant::finish_sum(sum[k], scale_sum, l.kind));
  }
  __syncthreads();
  const float scale = quant::scale_of(block_absmax(values, l.chunk), l.kind), inverse = quant::inverse(scale);
  for (int64_t j = 4 * threadIdx.x; j < l.chunk; j += 4 * kThreads) {
    float level[4];
    encode_store_four(values, j, c * l.chunk, draws, inverse, l.kind, l.codes(piece, 0, c), level);
  }
  if (threadIdx.x == 0) {
    bool finite = true;
    for (int64_t r = 0; r < l.ranks; ++r) finite = finite && quant::finite_scale(*l.scale(received, r, c));
    *l.scale(piece, 0, c) = quant::reduced_scale(scale, finite);
  }
}

template <typename scalar_t>
__global__ void dequantize_kernel(uint8_t* __restrict__ packed, scalar_t* __restrict__ out, QuantizeLayout l,
                                  bool vector) {
  const int64_t s = blockIdx.x / l.chunks_per_shard(), c = blockIdx.x % l.chunks_per_shard();
  const int64_t first = s * l.shard + c * l.chunk;
  const uint8_t* codes = l.codes(packed, s, c);
  const float scale = *l.scale(packed, s, c);
  for (int64_t j = 4 * threadIdx.x; j < l.chunk && first + j < l.numel; j += 4 * kThreads) {
    int8_t q[4];
    quant::load_four_codes(codes, j, l.kind, q);
    float values[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) values[k] = quant::decode(q[k], scale, l.kind);
    four::store(out, first + j, l.numel, vector, values);
  }
}

// ---- one warp per chunk (chunk <= 1024) ----------------------------------------------------

using four::kMaxFours;
using four::kWarp;
using four::kWarpChunkLimit;

__device__ __forceinline__ float warp_absmax(float m) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = quant::max_magnitude(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// The chunk this warp owns (flat over shards), or -1 past the last.
__device__ __forceinline__ int64_t warp_chunk(int64_t chunks) {
  const int64_t g = four::warp_index();
  return g < chunks ? g : -1;
}

// The shard of flat chunk g.
__device__ __forceinline__ int64_t shard_of(int64_t g, const QuantizeLayout& l) {
  return quant::quotient(g, l.chunks_per_shard());
}

// The lane's groups as four::group_start places them (a Map for encode_lane).
struct FloatGroups {
  __device__ static int64_t start(int lane, int i) { return four::group_start(lane, i); }
  __host__ __device__ static constexpr int64_t offset(int i) { return 4 * kWarp * i; }
};

// Encodes the lane's values (its groups as Map places them: Map::start(lane, i), which is
// Map::offset(i) past the lane's first) into the chunk's codes and, with `error` defined, writes
// there what the codes lose (elements first_index.. of it). Each group's error is written as soon
// as it is encoded: codes kept for a second pass would hold 32 more registers and cost a third of
// the warps an SM can keep in flight. kFull: the chunk is 1024 elements, every group in it.
// kDrawn: draws >= 0 (stochastic rounding) is known at compile time, which spares the kernel a
// second copy of the loop for rounding to nearest.
template <quant::Codes kKind, typename Map, bool kFull = false, bool kDrawn = false, typename scalar_t>
__device__ __forceinline__ void encode_lane(const float (&v)[kMaxFours][4], int lane, const QuantizeLayout& l,
                                            uint64_t first_index, int64_t draws, float scale, uint8_t* codes,
                                            scalar_t* error, bool vector) {
  const float inverse = quant::inverse(scale);
  // The chunk's group g enters the mixer at its first group's point plus g * kGolden (the point
  // four_random computes from the element's index): from the lane's first group, the others'
  // are constants apart, one 64-bit add a group.
  const int64_t lane_start = Map::start(lane, 0);
  const uint64_t lane_point = quant::stream_point(static_cast<uint64_t>(draws), (first_index + lane_start) / 4);
#pragma unroll
  for (int i = 0; i < kMaxFours; ++i) {
    const int64_t j = Map::start(lane, i);
    if (!kFull && j >= l.chunk) continue;
    const uint64_t point = lane_point + static_cast<uint64_t>(Map::offset(i) / 4) * quant::kGolden;
    float level[4];
    if constexpr (kKind == quant::Codes::e4m3) {
      uint32_t random[4] = {quant::kHalf16, quant::kHalf16, quant::kHalf16, quant::kHalf16};
      const bool nearest = !kDrawn && draws < 0;
      if (!nearest) quant::four_random_at(point, random);
      if (!quant_words::store_normal_e4m3(v[i], inverse, random, nearest, codes, j, level)) {
        int8_t q[4];
        quant::encode_four_drawn(v[i], random, nearest, inverse, kKind, q, level);
        quant_words::store_e4m3_four(codes, j, q);
      }
    } else {
      using quant_words::kNearestDraw;
      uint32_t draw[4] = {kNearestDraw, kNearestDraw, kNearestDraw, kNearestDraw};
      if (kDrawn || draws >= 0) quant_words::magic_draws(point, draw);
      quant_words::store_int_four<kKind>(v[i], inverse, draw, codes, j, level);
    }
    if (error != nullptr) {
      store_error_four(error, static_cast<int64_t>(first_index) + j, l.numel, vector, v[i], level, scale);
    }
  }
}

template <typename scalar_t, quant::Codes kKind>
__global__ void quantize_warp_kernel(const scalar_t* __restrict__ src, scalar_t* error, uint8_t* __restrict__ packed,
                                     QuantizeLayout l, int64_t draws, bool vector) {
  const int64_t g = warp_chunk(l.ranks * l.chunks_per_shard());
  if (g < 0) return;  // the whole warp: chunks are whole warps
  const int lane = threadIdx.x % kWarp;
  const int64_t s = shard_of(g, l), c = g - s * l.chunks_per_shard();
  const int64_t first = s * l.shard + c * l.chunk;
  // Every group's load is issued before any value is used: an early exit past the chunk's end
  // would make each load wait for the one before it.
  float v[kMaxFours][4];
#pragma unroll
  for (int i = 0; i < kMaxFours; ++i) {
    const int64_t j = FloatGroups::start(lane, i);
    if (j < l.chunk) {
      four::load(src, first + j, l.numel, vector, v[i]);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) v[i][k] = 0.0f;
    }
  }
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < kMaxFours; ++i) {
#pragma unroll
    for (int k = 0; k < 4; ++k) m = quant::max_magnitude(m, v[i][k]);
  }
  const float scale = quant::scale_of(warp_absmax(m), kKind);
  encode_lane<kKind, FloatGroups>(v, lane, l, first, draws, scale, l.codes(packed, s, c), error, vector);
  if (lane == 0) *l.scale(packed, s, c) = scale;
}

using quant_words::CodeWords;

// kRanks ranks' words of the warp's chunk and their stored scales, as loaded by load_ranks.
template <quant::Codes kKind, int kRanks>
struct RankWords {
  uint32_t word[kRanks][CodeWords<kKind>::kPerLane];
  float stored[kRanks];
};

// Loads kRanks ranks' codes of the warp's chunk: `codes` is the lane's first word of the first
// of them, `scale_at` that rank's scale of the chunk, and each next rank's are `step` bytes on;
// `has[t]`: the lane's word t is in the chunk. Every load is issued before the first is used (no
// branch between them): that is what keeps enough bytes in flight.
template <quant::Codes kKind, int kRanks>
__device__ __forceinline__ void load_ranks(const uint8_t* codes, const uint8_t* scale_at, int64_t step,
                                           const bool (&has)[CodeWords<kKind>::kPerLane], RankWords<kKind, kRanks>& in) {
  using Words = CodeWords<kKind>;
#pragma unroll
  for (int b = 0; b < kRanks; ++b) {
    in.stored[b] = __ldg(reinterpret_cast<const float*>(scale_at + b * step));
    const uint32_t* words = reinterpret_cast<const uint32_t*>(codes + b * step);
#pragma unroll
    for (int t = 0; t < Words::kPerLane; ++t) in.word[b][t] = has[t] ? __ldg(words + kWarp * t) : Words::kZero;
  }
}

// Adds the loaded ranks' codes, in rank order, to the lane's sums. int8 and int4 codes are
// added as quant_words::SubnormalSums says (their unit `unit`; `bias_sum` gathers the bias times
// the scales, quant::finish_sum's share), e4m3 codes by level (`magic`: quant_words::kMagicBits;
// `largest` gathers the bits of its scales, sign cleared, for the finiteness check that int8 and
// int4 make before the sums).
template <quant::Codes kKind, int kRanks>
__device__ __forceinline__ void sum_ranks(const RankWords<kKind, kRanks>& in, uint32_t magic,
                                          const quant_words::SubnormalSums& unit, float& bias_sum, uint32_t& largest,
                                          float (&v)[kMaxFours][4]) {
  using Words = CodeWords<kKind>;
  constexpr bool kSubnormal = quant_words::kSubnormalSums<kKind>;
  constexpr int kCodes = 32 / quant::bits_of(kKind);
#pragma unroll
  for (int b = 0; b < kRanks; ++b) {
    const float stored = in.stored[b];
    const float scale = kSubnormal ? unit.scale_up(stored) : quant_words::word_scale<kKind>(stored);
    if (!kSubnormal) largest = max(largest, __float_as_uint(stored) & 0x7FFFFFFFu);
    if (kSubnormal) {  // the bias times the scale, in the sums' unit
      bias_sum = quant_words::fma_subnormal(__uint_as_float(quant::bias_of(kKind)), scale, bias_sum);
    }
    const quant_words::Int4InPlace in_place = quant_words::Int4InPlace::of(scale);  // int4's only
#pragma unroll
    for (int t = 0; t < Words::kPerLane; ++t) {
#pragma unroll
      for (int k = 0; k < kCodes; ++k) {
        float& sum = v[t * Words::kGroups + k / 4][k % 4];
        if constexpr (kKind == quant::Codes::int4) {
          sum = in_place.add(in.word[b][t], k, sum);
        } else if constexpr (kSubnormal) {
          sum = quant_words::fma_subnormal(quant_words::stored_in_word<kKind>(in.word[b][t], k), scale, sum);
        } else {
          const float level = quant_words::level_in_word<kKind>(in.word[b][t], k, magic);
          sum = quant::mul_add(level, scale, sum);  // quant::add_decoded's sum
        }
      }
    }
  }
}

// The bits of the largest of the chunk's scales over the ranks (sign cleared), in every lane.
__device__ __forceinline__ uint32_t largest_scale_bits(const uint8_t* scale_at, int64_t step, int ranks, int lane) {
  uint32_t largest = 0;
#pragma unroll 1
  for (int r = lane; r < ranks; r += kWarp) {
    largest = max(largest, __float_as_uint(__ldg(reinterpret_cast<const float*>(scale_at + r * step))) & 0x7FFFFFFFu);
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_max_sync(0xffffffffu, largest);
#else
  for (int o = 16; o > 0; o /= 2) largest = max(largest, __shfl_xor_sync(0xffffffffu, largest, o));
  return largest;
#endif
}

// Two ranks' words in flight at a time, 7 blocks of 4 warps an SM (up to 72 registers, the bound
// below: 28 warps an SM, where blocks of 8 warps and 80 registers fit 24; on an H200 3-7% faster
// on a bucket-sized shard, within 1% on one shard). Four ranks (117 registers) measured 13%
// slower, 64 registers (32 warps) 2-8% slower (benchmarks/results/NOTES.md).
constexpr int kRanksInFlight = 2;
constexpr int kReduceThreads = 128;
// The common case (chunks of 1024, stochastic rounding, a power-of-two mean) has kernels of its
// own, without the rounding-to-nearest and division paths: the kernel's size matters. On an H100
// (reduce_variants_ab_session21.json, every variant in one run) e4m3's one-shard pass took 10.2
// us against 10.85 with the general kernel, int8's the same 10.05 either way. int4's keeps four
// ranks in flight (80 registers, 6 blocks of 4 warps an SM): its bucket-sized shard took 49.5 us
// against 51.0 with eight in flight and 54.8 with two, its one-shard pass 9.3 us with four or
// eight. Eight in flight with the first ranks' loads issued ahead of the largest scale (below)
// spent 10.3 us on one shard; int8 with four, 10.3-11.1 (reduce_in_flight_session20.json has
// the sweep before).
template <quant::Codes kKind>
constexpr int kCommonRanksInFlight = kKind == quant::Codes::int4 ? 4 : kRanksInFlight;
template <quant::Codes kKind>
constexpr int kCommonMinBlocks = kKind == quant::Codes::int4 ? 6 : 7;

// kFull: chunks of 1024 (the default), every word of a lane's in the chunk, which spares the
// bounds' predicates. kCommon: draws >= 0 and a power-of-two divisor (the launcher checks).
template <quant::Codes kKind, bool kFull, int kInFlight = kRanksInFlight, int kMinBlocks = 7, bool kCommon = false>
__global__ void __launch_bounds__(kReduceThreads, kMinBlocks)
    reduce_warp_kernel(const uint8_t* __restrict__ received, uint8_t* __restrict__ piece, QuantizeLayout l,
                       quant::Divisor divisor, int64_t draws, uint32_t magic) {
  using Words = CodeWords<kKind>;
  constexpr bool kSubnormal = quant_words::kSubnormalSums<kKind>;
  const int64_t c = warp_chunk(l.chunks_per_shard());
  if (c < 0) return;
  const int lane = threadIdx.x % kWarp;
  // Rank r's codes and scale of chunk c are r pieces on from rank 0's: pointers step, no
  // 64-bit products a rank.
  uint8_t* first = const_cast<uint8_t*>(received);
  const uint8_t* codes = l.codes(first, 0, c) + Words::byte_of(lane, 0);
  const uint8_t* scale_at = reinterpret_cast<const uint8_t*>(l.scale(first, 0, c));
  const int64_t step = l.piece_bytes();
  const int chunk_bytes = static_cast<int>(l.chunk * l.bits() / 8);
  bool has[Words::kPerLane];
#pragma unroll
  for (int t = 0; t < Words::kPerLane; ++t) has[t] = kFull || Words::byte_of(lane, t) < chunk_bytes;
  const int ranks = static_cast<int>(l.ranks);
  // int8 and int4 need the largest scale before the sums (their unit), and request the first
  // ranks' words before it is found, so that its loads and theirs share one round trip (int4's
  // bucket-sized shard 51.0 -> 49.3 us on an H100, eight ranks in flight). e4m3 gathers it from
  // the scales load_ranks loads anyway: a warp reduction of them ahead of the loads made its
  // reduce of a bucket-sized shard 15% slower on an H200 (80.0% of copy bandwidth, 94.4% without).
  constexpr bool kHoist = kSubnormal;
  RankWords<kKind, kInFlight> words;
  if (kHoist && ranks >= kInFlight) load_ranks<kKind, kInFlight>(codes, scale_at, step, has, words);
  uint32_t largest = kSubnormal ? largest_scale_bits(scale_at, step, ranks, lane) : 0u;
  quant_words::SubnormalSums unit{};
  if (kSubnormal) unit = quant_words::SubnormalSums::of(largest);
  float v[kMaxFours][4] = {};
  float bias_sum = 0.0f;
  int r = 0;
  for (; r + kInFlight <= ranks; r += kInFlight) {
    if (!kHoist || r > 0) load_ranks<kKind, kInFlight>(codes, scale_at, step, has, words);
    sum_ranks<kKind, kInFlight>(words, magic, unit, bias_sum, largest, v);
    codes += kInFlight * step;
    scale_at += kInFlight * step;
  }
  for (; r < ranks; ++r, codes += step, scale_at += step) {
    RankWords<kKind, 1> one;
    load_ranks<kKind, 1>(codes, scale_at, step, has, one);
    sum_ranks<kKind, 1>(one, magic, unit, bias_sum, largest, v);
  }
  // quant::finish_sum, then the divisor: for a power of two one fused step (the product by its
  // inverse is exact, so rounding the difference once and then scaling is the same number)
  const bool fused = kSubnormal && (kCommon || divisor.inverse != 0.0f);
  const float less = fused ? -quant::mul(bias_sum, divisor.inverse) : 0.0f;
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < kMaxFours; ++i) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (fused) {
        v[i][k] = quant::mul_add(v[i][k], divisor.inverse, less);
      } else if (kCommon) {  // e4m3: a power of two's inverse, exact
        v[i][k] = quant::mul(v[i][k], divisor.inverse);
      } else {
        v[i][k] = divisor.apply(kSubnormal ? quant::add(v[i][k], -bias_sum) : v[i][k]);
      }
      m = quant::max_magnitude(m, v[i][k]);  // groups past the chunk hold zeros
    }
  }
  const float scale = quant::scale_of(warp_absmax(m), kKind);
  encode_lane<kKind, Words, kFull, kCommon>(v, lane, l, c * l.chunk, draws, scale, l.codes(piece, 0, c),
                                            static_cast<float*>(nullptr), false);
  if (lane == 0) {
    *l.scale(piece, 0, c) = quant::reduced_scale(kSubnormal ? unit.scale_down(scale) : scale,
                                                  quant::finite_scale(__uint_as_float(largest)));
  }
}

template <typename scalar_t, quant::Codes kKind>
__global__ void dequantize_warp_kernel(const uint8_t* __restrict__ packed, scalar_t* __restrict__ out,
                                       QuantizeLayout l, bool vector) {
  const int64_t g = warp_chunk(l.ranks * l.chunks_per_shard());
  if (g < 0) return;
  const int lane = threadIdx.x % kWarp;
  const int64_t s = shard_of(g, l), c = g - s * l.chunks_per_shard();
  const int64_t first = s * l.shard + c * l.chunk;
  const uint8_t* codes = l.codes(const_cast<uint8_t*>(packed), s, c);
  const float scale = *l.scale(const_cast<uint8_t*>(packed), s, c);
  // All the lane's codes are loaded before any is decoded (loads behind an early exit would wait
  // for each other).
  int8_t q[kMaxFours][4];
#pragma unroll
  for (int i = 0; i < kMaxFours; ++i) {
    const int64_t j = FloatGroups::start(lane, i);
    if (j < l.chunk && first + j < l.numel) quant::load_four_codes(codes, j, kKind, q[i]);
  }
#pragma unroll
  for (int i = 0; i < kMaxFours; ++i) {
    const int64_t j = FloatGroups::start(lane, i);
    if (j >= l.chunk || first + j >= l.numel) break;
    float values[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) values[k] = quant::decode(q[i][k], scale, kKind);
    four::store(out, first + j, l.numel, vector, values);
  }
}

// Calls f with the kind of codes as a compile-time constant.
template <typename F>
void with_codes(quant::Codes kind, F&& f) {
  switch (kind) {
    case quant::Codes::int8: return f(std::integral_constant<quant::Codes, quant::Codes::int8>{});
    case quant::Codes::int4: return f(std::integral_constant<quant::Codes, quant::Codes::int4>{});
    case quant::Codes::e4m3: return f(std::integral_constant<quant::Codes, quant::Codes::e4m3>{});
  }
}

int64_t warp_blocks(int64_t chunks) { return four::warp_blocks(chunks, kThreads); }

size_t chunk_bytes(const QuantizeLayout& l) { return static_cast<size_t>(l.chunk) * sizeof(float); }

} // namespace

void quantize_shards_cuda_(const at::Tensor& src, const at::Tensor& error, const at::Tensor& packed,
                           const QuantizeLayout& layout, int64_t draws) {
  const c10::cuda::CUDAGuard guard(src.device());
  const int64_t blocks = layout.ranks * layout.chunks_per_shard();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "quantize_shards", [&] {
    const scalar_t* in = src.const_data_ptr<scalar_t>();
    scalar_t* err = error.defined() ? error.mutable_data_ptr<scalar_t>() : nullptr;
    const bool vector = four::aligned<scalar_t>({in, err});
    const auto stream = at::cuda::getCurrentCUDAStream();
    if (layout.chunk <= kWarpChunkLimit) {
      with_codes(layout.kind, [&](auto kind) {
        quantize_warp_kernel<scalar_t, decltype(kind)::value><<<warp_blocks(blocks), kThreads, 0, stream>>>(
            in, err, packed.mutable_data_ptr<uint8_t>(), layout, draws, vector);
      });
    } else {
      quantize_kernel<scalar_t><<<blocks, kThreads, chunk_bytes(layout), stream>>>(
          in, err, packed.mutable_data_ptr<uint8_t>(), layout, draws, vector);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void reduce_shard_cuda_(const at::Tensor& received, const at::Tensor& piece, const QuantizeLayout& layout,
                        int64_t divisor, int64_t draws) {
  const c10::cuda::CUDAGuard guard(received.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const quant::Divisor by = quant::Divisor::of(divisor);
  if (layout.chunk <= kWarpChunkLimit) {
    with_codes(layout.kind, [&](auto kind) {
      constexpr quant::Codes kKind = decltype(kind)::value;
      auto* kernel =
          layout.chunk == kWarpChunkLimit ? reduce_warp_kernel<kKind, true> : reduce_warp_kernel<kKind, false>;
      constexpr int kInFlight = kCommonRanksInFlight<kKind>;
      if (layout.chunk == kWarpChunkLimit && draws >= 0 && by.inverse != 0.0f && layout.ranks >= kInFlight) {
        kernel = reduce_warp_kernel<kKind, true, kInFlight, kCommonMinBlocks<kKind>, true>;
      }
      kernel<<<four::warp_blocks(layout.chunks_per_shard(), kReduceThreads), kReduceThreads, 0, stream>>>(
          received.const_data_ptr<uint8_t>(), piece.mutable_data_ptr<uint8_t>(), layout, by, draws,
          quant_words::kMagicBits);
    });
  } else {
    reduce_kernel<<<layout.chunks_per_shard(), kThreads, chunk_bytes(layout), stream>>>(
        received.mutable_data_ptr<uint8_t>(), piece.mutable_data_ptr<uint8_t>(), layout, by, draws);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequantize_shards_cuda_(const at::Tensor& packed, const at::Tensor& out, const QuantizeLayout& layout) {
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t blocks = layout.ranks * layout.chunks_per_shard();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "dequantize_shards", [&] {
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    const bool vector = four::aligned<scalar_t>({dst});
    const auto stream = at::cuda::getCurrentCUDAStream();
    if (layout.chunk <= kWarpChunkLimit) {
      with_codes(layout.kind, [&](auto kind) {
        dequantize_warp_kernel<scalar_t, decltype(kind)::value><<<warp_blocks(blocks), kThreads, 0, stream>>>(
            packed.const_data_ptr<uint8_t>(), dst, layout, vector);
      });
    } else {
      dequantize_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(packed.mutable_data_ptr<uint8_t>(), dst, layout,
                                                                   vector);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

} // namespace commtune
