// CUDA side of RandomK's passes (checks and CPU loops in random_k.cpp). Taking is three kernels:
// the gather of the k drawn values (all reads before any clearing: a position may be drawn
// twice), a read of the whole bucket for an Inf or a NaN (which, with clearing, also zeroes
// them; with none it writes nothing), and the clearing of the drawn positions, whose first
// thread also marks values[0] when the read found an overflow. Placing is a fill with zeros and
// a scatter of the mean.
#include <commtune/kernels/random_k.h>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>

namespace commtune {
namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t n, int64_t most) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, most)));
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) gather_kernel(const scalar_t* x, int64_t numel, uint64_t seed,
                                                           scalar_t* values, int64_t k, uint32_t* overflow) {
  const int64_t first = blockIdx.x * int64_t{kThreads} + threadIdx.x;
  if (first == 0) *overflow = 0u;  // the scan after this kernel sets it
  for (int64_t j = first; j < k; j += int64_t{gridDim.x} * kThreads) {
    values[j] = x[random_k_position(seed, j, numel)];
  }
}

// Sets *overflow when x holds an Inf or a NaN; with `clear`, zeroes them.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) scan_kernel(scalar_t* x, int64_t numel, bool clear, uint32_t* overflow) {
  using opmath_t = at::opmath_type<scalar_t>;  // double stays double: a finite double above FLT_MAX is no overflow
  bool found = false;
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x;
  for (; i + 3 * stride < numel; i += 4 * stride) {  // four loads in flight a thread
    scalar_t v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = x[i + u * stride];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (isfinite(static_cast<opmath_t>(v[u]))) continue;
      found = true;
      if (clear) x[i + u * stride] = scalar_t(0);
    }
  }
  for (; i < numel; i += stride) {
    if (isfinite(static_cast<opmath_t>(x[i]))) continue;
    found = true;
    if (clear) x[i] = scalar_t(0);
  }
  if (found) *overflow = 1u;  // the same value from every thread that stores
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) clear_kernel(scalar_t* x, int64_t numel, uint64_t seed, scalar_t* values,
                                                          int64_t k, bool clear, const uint32_t* overflow) {
  const int64_t first = blockIdx.x * int64_t{kThreads} + threadIdx.x;
  if (first == 0 && *overflow != 0u) values[0] = static_cast<scalar_t>(quant::float_from_bits(quant::kQuietNanBits));
  if (!clear) return;
  for (int64_t j = first; j < k; j += int64_t{gridDim.x} * kThreads) x[random_k_position(seed, j, numel)] = scalar_t(0);
}

// a / b rounded as the CPU rounds it: the build's --use_fast_math would approximate a float
// division (a double one stays exact).
__device__ __forceinline__ float exact_div(float a, float b) { return quant::div(a, b); }
__device__ __forceinline__ double exact_div(double a, double b) { return a / b; }

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) place_kernel(const scalar_t* summed, int64_t k, uint64_t seed,
                                                          scalar_t* out, int64_t numel, int64_t ranks) {
  using opmath_t = at::opmath_type<scalar_t>;
  for (int64_t j = blockIdx.x * int64_t{kThreads} + threadIdx.x; j < k; j += int64_t{gridDim.x} * kThreads) {
    out[random_k_position(seed, j, numel)] =
        static_cast<scalar_t>(exact_div(static_cast<opmath_t>(summed[j]), static_cast<opmath_t>(ranks)));
  }
}

}  // namespace

void random_k_take_cuda_(const at::Tensor& x, uint64_t seed, const at::Tensor& values, bool clear) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t numel = x.numel(), k = values.numel();
  at::Tensor flag = at::empty({1}, x.options().dtype(at::kInt));
  auto* overflow = reinterpret_cast<uint32_t*>(flag.mutable_data_ptr<int32_t>());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "random_k_take", [&] {
    scalar_t* in = x.mutable_data_ptr<scalar_t>();
    scalar_t* out = values.mutable_data_ptr<scalar_t>();
    gather_kernel<scalar_t><<<blocks_for(k, 8 * sms), kThreads, 0, stream>>>(in, numel, seed, out, k, overflow);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    scan_kernel<scalar_t><<<blocks_for(numel, 8 * sms), kThreads, 0, stream>>>(in, numel, clear, overflow);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    clear_kernel<scalar_t><<<blocks_for(k, 8 * sms), kThreads, 0, stream>>>(in, numel, seed, out, k, clear, overflow);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void random_k_place_cuda_(const at::Tensor& summed, uint64_t seed, const at::Tensor& out, int64_t ranks) {
  const c10::cuda::CUDAGuard guard(out.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t numel = out.numel(), k = summed.numel();
  out.zero_();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "random_k_place", [&] {
    place_kernel<scalar_t><<<blocks_for(k, 8 * sms), kThreads, 0, stream>>>(
        summed.const_data_ptr<scalar_t>(), k, seed, out.mutable_data_ptr<scalar_t>(), numel, ranks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

} // namespace commtune
