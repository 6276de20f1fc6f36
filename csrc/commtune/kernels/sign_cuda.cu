// CUDA kernels of the sign compression (checks and CPU loops in sign.cpp). Encoding: one block
// per chunk; each warp turns 32 consecutive signs into a word with one ballot.
#include <commtune/kernels/sign.h>

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace commtune {
namespace {

constexpr int kThreads = 256;

__device__ double block_sum(double v) {
  __shared__ double partial[kThreads / 32];
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  double total = 0;
  for (int w = 0; w < kThreads / 32; ++w) total += partial[w];
  return total;
}

template <typename scalar_t>
__global__ void sign_encode_kernel(const scalar_t* __restrict__ src, scalar_t* error, uint8_t* __restrict__ piece,
                                   SignLayout l) {
  const int64_t c = blockIdx.x, first = c * l.chunk, last = min(first + l.chunk, l.numel);
  double part = 0;
  for (int64_t i = first + threadIdx.x; i < last; i += kThreads) part += fabs(static_cast<double>(src[i]));
  const float scale = static_cast<float>(block_sum(part) / static_cast<double>(last - first));
  uint32_t* bits = reinterpret_cast<uint32_t*>(piece);
  if (threadIdx.x == 0) reinterpret_cast<float*>(bits + l.words())[c] = scale;
  // Whole warps step through the chunk together, 32 elements at a time.
  for (int64_t i = first + threadIdx.x; i < first + l.chunk; i += kThreads) {
    const bool valid = i < l.numel;
    const float x = valid ? static_cast<float>(src[i]) : 0.0f;
    const uint32_t word = __ballot_sync(0xffffffffu, valid && x < 0.0f);
    if (threadIdx.x % 32 == 0) bits[i / 32] = word;
    if (error != nullptr && valid) {
      error[i] = static_cast<scalar_t>(quant::add(x, -(x < 0.0f ? -scale : scale)));
    }
  }
}

// Four consecutive elements per thread: they share a word and a chunk (chunks are whole words),
// so each rank costs the thread one word and one scale. The piece's size and where its scales
// start come in from the host (SignLayout computes them with 64-bit divisions).
template <typename scalar_t>
__global__ void sign_decode_mean_kernel(const uint8_t* __restrict__ gathered, scalar_t* __restrict__ out,
                                        int64_t ranks, quant::Divisor divisor, int64_t numel, int64_t chunk_elements,
                                        int64_t piece_bytes, int64_t scales_at) {
  const int64_t first = 4 * (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x);
  if (first >= numel) return;
  const int64_t chunk = quant::quotient(first, chunk_elements), word = first / 32;
  const int shift = static_cast<int>(first % 32);
  float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 8  // the ranks' loads are independent: let them be in flight together
  for (int64_t r = 0; r < ranks; ++r) {
    const uint8_t* piece = gathered + r * piece_bytes;
    const uint32_t w = reinterpret_cast<const uint32_t*>(piece)[word] >> shift;
    const float scale = reinterpret_cast<const float*>(piece + scales_at)[chunk];
#pragma unroll
    for (int k = 0; k < 4; ++k) sum[k] = quant::add(sum[k], (w >> k) & 1u ? -scale : scale);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (first + k < numel) out[first + k] = static_cast<scalar_t>(divisor.apply(sum[k]));
  }
}

} // namespace

void sign_encode_cuda_(const at::Tensor& src, const at::Tensor& error, const at::Tensor& piece, const SignLayout& layout) {
  if (layout.chunks() == 0) return;
  const c10::cuda::CUDAGuard guard(src.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "sign_encode", [&] {
    sign_encode_kernel<scalar_t><<<layout.chunks(), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        src.const_data_ptr<scalar_t>(), error.defined() ? error.mutable_data_ptr<scalar_t>() : nullptr,
        piece.mutable_data_ptr<uint8_t>(), layout);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void sign_decode_mean_cuda_(const at::Tensor& gathered, const at::Tensor& out, int64_t ranks, const SignLayout& layout) {
  if (layout.numel == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "sign_decode_mean", [&] {
    const int64_t threads = (layout.numel + 3) / 4;
    sign_decode_mean_kernel<scalar_t>
        <<<(threads + kThreads - 1) / kThreads, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
            gathered.const_data_ptr<uint8_t>(), out.mutable_data_ptr<scalar_t>(), ranks, quant::Divisor::of(ranks),
            layout.numel, layout.chunk, layout.piece_bytes(), 4 * layout.words());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

} // namespace commtune
