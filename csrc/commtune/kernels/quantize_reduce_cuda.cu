// CUDA kernels of the quantized allreduce's reduce pass (reduce_shard_: the checks and CPU loop
// live in quantize.cpp): every rank's codes of this rank's shard decoded and summed, the mean
// encoded again. One warp a chunk of up to 1024 (a lane's words of every rank, two or four
// ranks' loads in flight), else one block a chunk staged in shared memory.
#include <commtune/kernels/quantize_cuda.cuh>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

namespace commtune {
namespace {

using namespace quant_cuda;  // what the quantize pass's file shares

// ---- one block per chunk (chunk > 1024) -----------------------------------------------------
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

// ---- one warp per chunk (chunk <= 1024) ----------------------------------------------------

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
constexpr int kReduceMinBlocks = 7;
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
constexpr int kCommonMinBlocks = kKind == quant::Codes::int4 ? 6 : kReduceMinBlocks;

// kFull: chunks of 1024 (the default), every word of a lane's in the chunk, which spares the
// bounds' predicates. kCommon: draws >= 0 and a power-of-two divisor (the launcher checks).
template <quant::Codes kKind, bool kFull, int kInFlight = kRanksInFlight, int kMinBlocks = kReduceMinBlocks,
          bool kCommon = false>
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

} // namespace

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

} // namespace commtune
