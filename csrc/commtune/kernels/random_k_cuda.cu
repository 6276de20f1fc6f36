// CUDA side of RandomK's passes (checks and CPU loops in random_k.cpp). Both passes cut the bucket
// into slices of kSlice entries, one a block, and a block handles the draws that fall in its
// slice (random_k_first_at_or_after): no access leaves the slice, so the bucket is read or written
// once, in order, whatever k is. Taking is one kernel: a block reads its slice in 16-byte loads
// for an Inf or a NaN (with error feedback's add fused in, it reads the bucket too and writes the
// sums back), then gathers its draws (clearing them with error feedback), and the last block to
// finish marks values[0] if any block found one. Placing is one kernel: a block zeroes
// its slice in 16-byte stores, then writes its draws' means.
#include <commtune/kernels/fused_add.cuh>
#include <commtune/kernels/pack.cuh>
#include <commtune/kernels/random_k.h>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

namespace commtune {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kSlice = 16384;  // entries a block: 64 KB of fp32, 16 packs a thread

// This block's entries, [lo, hi).
struct Slice {
  int64_t lo, hi;
};

__device__ __forceinline__ Slice block_slice(int64_t numel) {
  const int64_t lo = blockIdx.x * kSlice;
  return {lo, min(numel, lo + kSlice)};
}

// Threads 0 and 1 write the first draws at or after lo and hi (the block's draws are [draws[0],
// draws[1])), to be read after a __syncthreads: the block's other work goes on meanwhile.
__device__ __forceinline__ void find_draws(Slice slice, uint64_t seed, int64_t numel, int64_t k, int64_t* draws) {
  if (threadIdx.x < 2) draws[threadIdx.x] = random_k_first_at_or_after(threadIdx.x == 0 ? slice.lo : slice.hi, seed, numel, k);
}

template <typename T>
__device__ __forceinline__ bool overflows(T v) {
  using opmath_t = at::opmath_type<T>;  // double stays double: a finite double above FLT_MAX is no overflow
  return !isfinite(static_cast<opmath_t>(v));
}

// Whether x[lo, hi) holds an Inf or a NaN (this thread's share); with `clear`, zeroes them.
template <typename T>
__device__ bool scan_slice(T* x, int64_t lo, int64_t hi, bool clear) {
  bool found = false;
  auto check = [&](T& v) {
    if (!overflows(v)) return;
    found = true;
    if (clear) v = T(0);
  };
  const PackedSpan span = packed_span(x, lo, hi);
  for (int64_t i = lo + threadIdx.x; i < span.packs; i += kThreads) check(x[i]);
  for (int64_t i = span.tail + threadIdx.x; i < hi; i += kThreads) check(x[i]);
  auto* packs = reinterpret_cast<Pack<T>*>(x + span.packs);
  const int64_t n = (span.tail - span.packs) / Pack<T>::kCount;
  int64_t p = threadIdx.x;
  for (; p + 3 * kThreads < n; p += 4 * kThreads) {  // four 16-byte loads in flight a thread
    Pack<T> v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = packs[p + u * kThreads];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      bool here = false;
#pragma unroll
      for (int e = 0; e < Pack<T>::kCount; ++e) here |= overflows(v[u].v[e]);
      if (!here) continue;  // the common case: nothing written
      found = true;
      if (clear) {
        for (int e = 0; e < Pack<T>::kCount; ++e) check(packs[p + u * kThreads].v[e]);
      }
    }
  }
  for (; p < n; p += kThreads) {
    for (int e = 0; e < Pack<T>::kCount; ++e) check(packs[p].v[e]);
  }
  return found;
}

// Error feedback fused with its add (x the error buffer, add the new gradient): x[lo, hi) += add,
// one pass that reads both and writes x in full; returns whether a sum is an Inf or a NaN (this
// thread's share). An overflow stays in x: the gather sends it, and its block clears it after.
template <typename T>
__device__ bool add_slice(T* x, const T* add, int64_t lo, int64_t hi) {
  bool found = false;
  auto sum = [&](T& v, T a) {
    v = fused_sum(v, a);
    found |= overflows(v);
  };
  const PackedSpan span = packed_span(x, lo, hi);  // add shares x's alignment (checked on the host)
  for (int64_t i = lo + threadIdx.x; i < span.packs; i += kThreads) sum(x[i], add[i]);
  for (int64_t i = span.tail + threadIdx.x; i < hi; i += kThreads) sum(x[i], add[i]);
  auto* packs = reinterpret_cast<Pack<T>*>(x + span.packs);
  const auto* adds = reinterpret_cast<const Pack<T>*>(add + span.packs);
  const int64_t n = (span.tail - span.packs) / Pack<T>::kCount;
  int64_t p = threadIdx.x;
  for (; p + 3 * kThreads < n; p += 4 * kThreads) {  // four 16-byte loads of each in flight a thread
    Pack<T> v[4], a[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = packs[p + u * kThreads];
#pragma unroll
    for (int u = 0; u < 4; ++u) a[u] = adds[p + u * kThreads];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
#pragma unroll
      for (int e = 0; e < Pack<T>::kCount; ++e) sum(v[u].v[e], a[u].v[e]);
      packs[p + u * kThreads] = v[u];
    }
  }
  for (; p < n; p += kThreads) {
    Pack<T> v = packs[p];
    const Pack<T> a = adds[p];
#pragma unroll
    for (int e = 0; e < Pack<T>::kCount; ++e) sum(v.v[e], a.v[e]);
    packs[p] = v;
  }
  return found;
}

// The slice is read first (with `add`, summed and written), its loads issued at once (a gather
// first would hold them back a DRAM round trip a block); the gather after it finds the slice in
// L2. The scan writes nothing, so an Inf or a NaN to clear (rare: a loss scaler's overflow) takes
// a second pass in its block only.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) take_kernel(scalar_t* x, const scalar_t* add, int64_t numel, uint64_t seed,
                                                         scalar_t* values, int64_t k, bool clear, uint32_t* state) {
  __shared__ int64_t draws[2];
  const Slice slice = block_slice(numel);
  find_draws(slice, seed, numel, k, draws);
  bool found = add != nullptr ? add_slice(x, add, slice.lo, slice.hi) : scan_slice(x, slice.lo, slice.hi, false);
  __syncthreads();
  for (int64_t s = draws[0] + threadIdx.x; s < draws[1]; s += kThreads) {
    const int64_t at = random_k_position(seed, s, numel, k);
    const scalar_t v = x[at];
    values[s] = v;  // an Inf or a NaN here was seen by the scan
    if (clear) x[at] = scalar_t(0);
  }
  found = __syncthreads_or(found);
  if (found && clear) scan_slice(x, slice.lo, slice.hi, true);  // error feedback keeps no Inf or NaN
  // state[0]: whether any block found an overflow; state[1]: blocks done (both zeroed before launch).
  if (threadIdx.x != 0) return;
  if (found) atomicOr(state, 1u);
  __threadfence();  // this block's values and flag before its ticket
  if (atomicAdd(state + 1, 1u) != gridDim.x - 1) return;
  __threadfence();
  if (atomicOr(state, 0u) != 0u) values[0] = static_cast<scalar_t>(quant::float_from_bits(quant::kQuietNanBits));
}

// a / b rounded as the CPU rounds it: the build's --use_fast_math would approximate a float
// division (a double one stays exact).
__device__ __forceinline__ float exact_div(float a, float b) { return quant::div(a, b); }
__device__ __forceinline__ double exact_div(double a, double b) { return a / b; }

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) place_kernel(const scalar_t* summed, int64_t k, uint64_t seed,
                                                          scalar_t* out, int64_t numel, int64_t ranks) {
  using opmath_t = at::opmath_type<scalar_t>;
  __shared__ int64_t draws[2];
  const Slice slice = block_slice(numel);
  find_draws(slice, seed, numel, k, draws);
  const PackedSpan span = packed_span(out, slice.lo, slice.hi);
  for (int64_t i = slice.lo + threadIdx.x; i < span.packs; i += kThreads) out[i] = scalar_t(0);
  for (int64_t i = span.tail + threadIdx.x; i < slice.hi; i += kThreads) out[i] = scalar_t(0);
  auto* packs = reinterpret_cast<Pack<scalar_t>*>(out + span.packs);
  Pack<scalar_t> zeros;
#pragma unroll
  for (int e = 0; e < Pack<scalar_t>::kCount; ++e) zeros.v[e] = scalar_t(0);
  for (int64_t p = threadIdx.x; p < (span.tail - span.packs) / Pack<scalar_t>::kCount; p += kThreads) packs[p] = zeros;
  __syncthreads();  // the draws found, and the zeros before the means that overwrite some of them
  for (int64_t s = draws[0] + threadIdx.x; s < draws[1]; s += kThreads) {
    out[random_k_position(seed, s, numel, k)] =
        static_cast<scalar_t>(exact_div(static_cast<opmath_t>(summed[s]), static_cast<opmath_t>(ranks)));
  }
}

unsigned int blocks_for(int64_t numel) { return static_cast<unsigned int>((numel + kSlice - 1) / kSlice); }

}  // namespace

void random_k_take_cuda_(const at::Tensor& x, const at::Tensor& add, uint64_t seed, const at::Tensor& values,
                         bool clear) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t numel = x.numel(), k = values.numel();
  // The fused add reads add's packs where x's lie: with another offset from 16 bytes, add first.
  const bool fused = add.defined() && (reinterpret_cast<uintptr_t>(x.const_data_ptr()) -
                                       reinterpret_cast<uintptr_t>(add.const_data_ptr())) % 16 == 0;
  if (add.defined() && !fused) x.add_(add);
  at::Tensor state = at::empty({2}, x.options().dtype(at::kInt));
  C10_CUDA_CHECK(cudaMemsetAsync(state.mutable_data_ptr(), 0, state.nbytes(), stream));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "random_k_take", [&] {
    take_kernel<scalar_t><<<blocks_for(numel), kThreads, 0, stream>>>(
        x.mutable_data_ptr<scalar_t>(), fused ? add.const_data_ptr<scalar_t>() : nullptr, numel, seed,
        values.mutable_data_ptr<scalar_t>(), k, clear, reinterpret_cast<uint32_t*>(state.mutable_data_ptr<int32_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void random_k_place_cuda_(const at::Tensor& summed, uint64_t seed, const at::Tensor& out, int64_t ranks) {
  const c10::cuda::CUDAGuard guard(out.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t numel = out.numel(), k = summed.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "random_k_place", [&] {
    place_kernel<scalar_t><<<blocks_for(numel), kThreads, 0, stream>>>(
        summed.const_data_ptr<scalar_t>(), k, seed, out.mutable_data_ptr<scalar_t>(), numel, ranks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

} // namespace commtune
