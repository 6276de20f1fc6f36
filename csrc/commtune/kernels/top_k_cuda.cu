// CUDA side of threshold_top_k_ (checks and the CPU loop in top_k.cpp): one block finds the
// sample's threshold by a radix select, then CUB's single-pass select (a decoupled look-back
// scan, so the picks come out in index order) walks the bucket once, reading its entries as the
// flags of the positions 0..numel-1 (vector loads; a predicate on the position would load one
// entry per thread per step), and every pick past the first k is dropped where it is written.
#include <commtune/kernels/quantize_rules.h>
#include <commtune/kernels/top_k.h>

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cub/device/device_select.cuh>
#include <thrust/iterator/counting_iterator.h>

#include <cstddef>
#include <iterator>

namespace commtune {
namespace {

constexpr int kThreads = 1024;
constexpr int kKeysPerThread = static_cast<int>(kTopKSample / kThreads);
constexpr int kDigitBits = 8;
constexpr int kBins = 1 << kDigitBits;

// The `want`-th largest |x| of the sample into *threshold. Non-negative floats order as their
// bits, so the select runs on the bits, eight of them a round from the top: each round counts
// the sample's keys that share the prefix found so far, by their next digit, and keeps the digit
// where the count from the top reaches `want`.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) sample_threshold_kernel(const scalar_t* __restrict__ x, TopKSample sample,
                                                                    float* threshold) {
  __shared__ uint32_t bins[kBins];
  __shared__ uint32_t chosen_prefix, still_wanted;
  uint32_t keys[kKeysPerThread];
#pragma unroll
  for (int j = 0; j < kKeysPerThread; ++j) {
    const int64_t s = threadIdx.x + static_cast<int64_t>(kThreads) * j;
    keys[j] = s < sample.size ? quant::float_bits(fabsf(static_cast<float>(x[s * sample.stride]))) : 0u;
  }
  // Keys past the sample are 0, the smallest: with want <= size they are never the one sought.
  if (threadIdx.x == 0) {
    chosen_prefix = 0;
    still_wanted = static_cast<uint32_t>(sample.want);
  }
  uint32_t mask = 0;
  for (int shift = 32 - kDigitBits; shift >= 0; shift -= kDigitBits) {
    for (int b = threadIdx.x; b < kBins; b += kThreads) bins[b] = 0;
    __syncthreads();
    const uint32_t prefix = chosen_prefix;
#pragma unroll
    for (int j = 0; j < kKeysPerThread; ++j) {
      // Lanes with the same digit add once (shared-memory atomics on one address serialize);
      // after the first round most warps hold no key under the prefix and skip the match.
      const bool under = (keys[j] & mask) == prefix;
      if (!__any_sync(0xffffffffu, under)) continue;
      const uint32_t digit = under ? (keys[j] >> shift) & (kBins - 1) : kBins;
      const uint32_t same = __match_any_sync(0xffffffffu, digit);
      if (under && (threadIdx.x % 32) == __ffs(same) - 1) atomicAdd(&bins[digit], __popc(same));
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      // Lane l holds digits 255 - 8l down to 248 - 8l: counts from the top in lane order.
      const int lane = threadIdx.x, per_lane = kBins / 32;
      uint32_t mine = 0;
      for (int d = 0; d < per_lane; ++d) mine += bins[kBins - 1 - lane * per_lane - d];
      uint32_t above = mine;  // inclusive prefix over lanes
      for (int o = 1; o < 32; o *= 2) {
        const uint32_t other = __shfl_up_sync(0xffffffffu, above, o);
        if (lane >= o) above += other;
      }
      const uint32_t wanted = still_wanted;
      const uint32_t reached = __ballot_sync(0xffffffffu, above >= wanted);
      if (lane == __ffs(reached) - 1) {
        uint32_t count = above - mine;  // keys in higher lanes' digits
        for (int d = 0; d < per_lane; ++d) {
          const uint32_t digit = kBins - 1 - lane * per_lane - d;
          if (count + bins[digit] >= wanted) {
            chosen_prefix = prefix | digit << shift;
            still_wanted = wanted - count;
            break;
          }
          count += bins[digit];
        }
      }
    }
    __syncthreads();
    mask |= static_cast<uint32_t>(kBins - 1) << shift;
  }
  if (threadIdx.x == 0) *threshold = quant::float_from_bits(chosen_prefix);
}

// Applied to the bucket's entries, which CUB reads as the flags of the positions 0..numel-1.
template <typename scalar_t>
struct Qualifies {
  const float* threshold;
  __device__ bool operator()(const scalar_t& v) const { return fabsf(static_cast<float>(v)) >= *threshold; }
};

// Where CUB writes the n-th pick: slot n of the piece while n < k, nowhere after. A write sends
// the entry (value and index) and, with `clear`, takes it out of the error buffer.
template <typename scalar_t>
struct Slot {
  scalar_t* x;
  float* values;
  int32_t* indices;
  bool clear;
  int64_t n, k;
  __device__ Slot& operator=(int32_t i) {
    if (n < k) {
      values[n] = static_cast<float>(x[i]);
      indices[n] = i;
      if (clear) x[i] = scalar_t(0);
    }
    return *this;
  }
};

template <typename scalar_t>
struct Slots {
  using iterator_category = std::random_access_iterator_tag;
  using value_type = void;
  using difference_type = std::ptrdiff_t;
  using pointer = void;
  using reference = Slot<scalar_t>;
  Slot<scalar_t> first;
  __host__ __device__ Slot<scalar_t> operator[](difference_type n) const {
    Slot<scalar_t> s = first;
    s.n += n;
    return s;
  }
  __host__ __device__ Slot<scalar_t> operator*() const { return first; }
  __host__ __device__ Slots operator+(difference_type n) const {
    Slots s = *this;
    s.first.n += n;
    return s;
  }
  __host__ __device__ Slots& operator+=(difference_type n) {
    first.n += n;
    return *this;
  }
  __host__ __device__ Slots& operator++() { return *this += 1; }
};

} // namespace

void threshold_top_k_cuda_(const at::Tensor& x, int64_t k, const at::Tensor& piece, const at::Tensor& qualifying,
                           bool clear, const TopKSample& sample) {
  const c10::cuda::CUDAGuard guard(x.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t numel = x.numel();
  C10_CUDA_CHECK(cudaMemsetAsync(piece.mutable_data_ptr(), 0, piece.nbytes(), stream));
  at::Tensor threshold = at::empty({1}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "threshold_top_k", [&] {
    scalar_t* in = x.mutable_data_ptr<scalar_t>();
    float* t = threshold.mutable_data_ptr<float>();
    sample_threshold_kernel<scalar_t><<<1, kThreads, 0, stream>>>(in, sample, t);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    int32_t* out = piece.mutable_data_ptr<int32_t>();
    const Slots<scalar_t> slots{Slot<scalar_t>{in, reinterpret_cast<float*>(out), out + k, clear, 0, k}};
    const thrust::counting_iterator<int32_t> positions(0);
    const Qualifies<scalar_t> qualifies{t};
    int64_t* count = qualifying.mutable_data_ptr<int64_t>();
    size_t scratch_bytes = 0;
    C10_CUDA_CHECK(
        cub::DeviceSelect::FlaggedIf(nullptr, scratch_bytes, positions, in, slots, count, numel, qualifies, stream));
    at::Tensor scratch = at::empty({static_cast<int64_t>(scratch_bytes)}, x.options().dtype(at::kByte));
    C10_CUDA_CHECK(cub::DeviceSelect::FlaggedIf(scratch.mutable_data_ptr(), scratch_bytes, positions, in, slots, count,
                                                numel, qualifies, stream));
  });
}

} // namespace commtune
