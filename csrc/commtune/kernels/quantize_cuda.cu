// CUDA kernels of the quantized allreduce's quantize and dequantize passes (the checks and CPU
// loops live in quantize.cpp, the arithmetic in quantize_rules.h; the reduce's kernels are in
// quantize_reduce_cuda.cu). Chunks of up to 1024 elements (the default) take one warp each: a
// lane keeps its up to 32 values in registers, the absmax is a warp shuffle, and a lane has up to
// eight 16-byte loads in flight, which is what keeps HBM busy. Larger chunks take one block each,
// staged in shared memory. The kinds of codes are template arguments, so the per-element rules
// compile without branches.
#include <commtune/kernels/quantize_cuda.cuh>

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

namespace commtune {
namespace {

using namespace quant_cuda;  // what the reduce's file shares

// ---- one block per chunk (chunk > 1024) -----------------------------------------------------
// Chunks are whole multiples of 8 elements, so a chunk's codes start 4-byte aligned (8 bits)
// or 2-byte aligned (int4): four codes are one access.
template <typename scalar_t>
__global__ void quantize_kernel(const scalar_t* __restrict__ src, scalar_t* error, uint8_t* __restrict__ packed,
                                QuantizeLayout l, int64_t draws, bool vector, bool accumulate) {
  extern __shared__ float values[];
  const int64_t s = blockIdx.x / l.chunks_per_shard(), c = blockIdx.x % l.chunks_per_shard();
  const int64_t first = s * l.shard + c * l.chunk;
  // accumulate: error + src is encoded (error feedback's add fused in), error read before it is written
  for (int64_t j = 4 * threadIdx.x; j < l.chunk; j += 4 * kThreads) {
    four::load_sum(src, accumulate ? error : nullptr, first + j, l.numel, vector, values + j);
  }
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

// The shard of flat chunk g.
__device__ __forceinline__ int64_t shard_of(int64_t g, const QuantizeLayout& l) {
  return quant::quotient(g, l.chunks_per_shard());
}

// The lane's groups as four::group_start places them (a Map for encode_lane).
struct FloatGroups {
  __device__ static int64_t start(int lane, int i) { return four::group_start(lane, i); }
  __host__ __device__ static constexpr int64_t offset(int i) { return 4 * kWarp * i; }
};

template <typename scalar_t, quant::Codes kKind>
__global__ void quantize_warp_kernel(const scalar_t* __restrict__ src, scalar_t* error, uint8_t* __restrict__ packed,
                                     QuantizeLayout l, int64_t draws, bool vector, bool accumulate) {
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
      four::load_sum(src, accumulate ? error : nullptr, first + j, l.numel, vector, v[i]);
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

int64_t warp_blocks(int64_t chunks) { return four::warp_blocks(chunks, kThreads); }

} // namespace

void quantize_shards_cuda_(const at::Tensor& src, const at::Tensor& error, const at::Tensor& packed,
                           const QuantizeLayout& layout, int64_t draws, bool accumulate) {
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
            in, err, packed.mutable_data_ptr<uint8_t>(), layout, draws, vector, accumulate);
      });
    } else {
      quantize_kernel<scalar_t><<<blocks, kThreads, chunk_bytes(layout), stream>>>(
          in, err, packed.mutable_data_ptr<uint8_t>(), layout, draws, vector, accumulate);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
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
