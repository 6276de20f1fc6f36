// CUDA kernels of the quantized allreduce's passes (the checks and CPU loops live in
// quantize.cpp, the arithmetic in quantize_rules.h). One block per chunk: the chunk is read once
// into shared memory as floats, its absmax reduced there, then encoded.
#include <commtune/kernels/quantize.h>
#include <commtune/kernels/quantize_rules.h>

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace commtune {
namespace {

constexpr int kThreads = 256;

// The largest |value| of the block's chunk in shared memory, seen by every thread.
__device__ float block_absmax(const float* values, int64_t n) {
  __shared__ float partial[kThreads / 32];
  float m = 0.0f;
  for (int64_t j = threadIdx.x; j < n; j += kThreads) m = fmaxf(m, fabsf(values[j]));
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = m;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) total = fmaxf(total, partial[w]);
  __syncthreads();  // partial may be reused by the next call
  return total;
}

// Encodes the chunk in shared memory into `codes`; returns its scale (every thread).
__device__ float encode_chunk(const float* values, int64_t n, uint64_t first_index, int64_t draws, int8_t* codes) {
  const float scale = quant::scale_of(block_absmax(values, n)), inverse = quant::inverse(scale);
  for (int64_t j = threadIdx.x; j < n; j += kThreads) {
    const float draw = draws < 0 ? 0.5f : quant::uniform(static_cast<uint64_t>(draws), first_index + j);
    codes[j] = quant::encode(values[j], inverse, draw);
  }
  return scale;
}

__device__ __forceinline__ int8_t* codes_of(uint8_t* packed, const QuantizeLayout& l, int64_t s, int64_t c) {
  return reinterpret_cast<int8_t*>(packed + s * l.piece_bytes() + c * l.chunk);
}
__device__ __forceinline__ float* scale_at(uint8_t* packed, const QuantizeLayout& l, int64_t s, int64_t c) {
  return reinterpret_cast<float*>(packed + s * l.piece_bytes() + l.shard) + c;
}

template <typename scalar_t>
__global__ void quantize_kernel(const scalar_t* __restrict__ src, scalar_t* error, uint8_t* __restrict__ packed,
                                QuantizeLayout l, int64_t draws) {
  extern __shared__ float values[];
  const int64_t s = blockIdx.x / l.chunks_per_shard(), c = blockIdx.x % l.chunks_per_shard();
  const int64_t first = s * l.shard + c * l.chunk;
  for (int64_t j = threadIdx.x; j < l.chunk; j += kThreads) {
    values[j] = first + j < l.numel ? static_cast<float>(src[first + j]) : 0.0f;
  }
  __syncthreads();
  int8_t* codes = codes_of(packed, l, s, c);
  const float scale = encode_chunk(values, l.chunk, first, draws, codes);
  if (threadIdx.x == 0) *scale_at(packed, l, s, c) = scale;
  if (error == nullptr) return;
  for (int64_t j = threadIdx.x; j < l.chunk && first + j < l.numel; j += kThreads) {
    error[first + j] = static_cast<scalar_t>(quant::add(values[j], -quant::decode(codes[j], scale)));
  }
}

__global__ void reduce_kernel(uint8_t* __restrict__ received, uint8_t* __restrict__ piece, QuantizeLayout l,
                              float divisor, int64_t draws) {
  extern __shared__ float values[];
  const int64_t c = blockIdx.x;
  for (int64_t j = threadIdx.x; j < l.chunk; j += kThreads) {
    float sum = 0.0f;
    for (int64_t r = 0; r < l.ranks; ++r) {
      sum = quant::add(sum, quant::decode(codes_of(received, l, r, c)[j], *scale_at(received, l, r, c)));
    }
    values[j] = quant::div(sum, divisor);
  }
  __syncthreads();
  const float scale = encode_chunk(values, l.chunk, c * l.chunk, draws, codes_of(piece, l, 0, c));
  if (threadIdx.x == 0) *scale_at(piece, l, 0, c) = scale;
}

template <typename scalar_t>
__global__ void dequantize_kernel(uint8_t* __restrict__ packed, scalar_t* __restrict__ out, QuantizeLayout l) {
  const int64_t s = blockIdx.x / l.chunks_per_shard(), c = blockIdx.x % l.chunks_per_shard();
  const int64_t first = s * l.shard + c * l.chunk;
  const int8_t* codes = codes_of(packed, l, s, c);
  const float scale = *scale_at(packed, l, s, c);
  for (int64_t j = threadIdx.x; j < l.chunk && first + j < l.numel; j += kThreads) {
    out[first + j] = static_cast<scalar_t>(quant::decode(codes[j], scale));
  }
}

size_t chunk_bytes(const QuantizeLayout& l) { return static_cast<size_t>(l.chunk) * sizeof(float); }

} // namespace

void quantize_shards_cuda_(const at::Tensor& src, const at::Tensor& error, const at::Tensor& packed,
                           const QuantizeLayout& layout, int64_t draws) {
  const c10::cuda::CUDAGuard guard(src.device());
  const int64_t blocks = layout.ranks * layout.chunks_per_shard();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "quantize_shards", [&] {
    quantize_kernel<scalar_t><<<blocks, kThreads, chunk_bytes(layout), at::cuda::getCurrentCUDAStream()>>>(
        src.const_data_ptr<scalar_t>(), error.defined() ? error.mutable_data_ptr<scalar_t>() : nullptr,
        packed.mutable_data_ptr<uint8_t>(), layout, draws);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void reduce_shard_cuda_(const at::Tensor& received, const at::Tensor& piece, const QuantizeLayout& layout,
                        int64_t divisor, int64_t draws) {
  const c10::cuda::CUDAGuard guard(received.device());
  reduce_kernel<<<layout.chunks_per_shard(), kThreads, chunk_bytes(layout), at::cuda::getCurrentCUDAStream()>>>(
      received.mutable_data_ptr<uint8_t>(), piece.mutable_data_ptr<uint8_t>(), layout, static_cast<float>(divisor),
      draws);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequantize_shards_cuda_(const at::Tensor& packed, const at::Tensor& out, const QuantizeLayout& layout) {
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t blocks = layout.ranks * layout.chunks_per_shard();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "dequantize_shards", [&] {
    dequantize_kernel<scalar_t><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        packed.mutable_data_ptr<uint8_t>(), out.mutable_data_ptr<scalar_t>(), layout);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

} // namespace commtune
