#pragma once
// What the quantize and dequantize passes (quantize_cuda.cu) and the reduce
// (quantize_reduce_cuda.cu) share: the absmax of a block's or a warp's chunk, and the encode of
// its values into codes, four at a time from shared memory (chunks of more than 1024) or a lane's
// at a time from registers (one warp a chunk).
#include <commtune/kernels/four.cuh>
#include <commtune/kernels/quantize.h>
#include <commtune/kernels/quantize_rules.h>
#include <commtune/kernels/quantize_words.cuh>

#include <cstdint>
#include <type_traits>

namespace commtune::quant_cuda {

constexpr int kThreads = 256;

// The largest |value| of the block's chunk in shared memory, seen by every thread.
__device__ inline float block_absmax(const float* values, int64_t n) {
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

// Calls f with the kind of codes as a compile-time constant.
template <typename F>
void with_codes(quant::Codes kind, F&& f) {
  switch (kind) {
    case quant::Codes::int8: return f(std::integral_constant<quant::Codes, quant::Codes::int8>{});
    case quant::Codes::int4: return f(std::integral_constant<quant::Codes, quant::Codes::int4>{});
    case quant::Codes::e4m3: return f(std::integral_constant<quant::Codes, quant::Codes::e4m3>{});
  }
}

inline size_t chunk_bytes(const QuantizeLayout& l) { return static_cast<size_t>(l.chunk) * sizeof(float); }

} // namespace commtune::quant_cuda
