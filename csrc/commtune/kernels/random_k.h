#pragma once
// Random-k sparsification's passes (the RandomK hook). Draw j (0 <= j < k) of a step is position
// floor(mix(stream_point(seed, j)) * numel / 2^64): uniform over the bucket, with replacement,
// the same on every rank, on the CPU and on the GPU, and computed where it is used (no host
// draw, no copy to the device).
#include <ATen/ATen.h>

#include <commtune/kernels/quantize_rules.h>

#include <cstdint>

namespace commtune {

COMMTUNE_HD int64_t random_k_position(uint64_t seed, int64_t j, int64_t numel) {
  const uint64_t z = quant::mix(quant::stream_point(seed, static_cast<uint64_t>(j)));
#ifdef __CUDA_ARCH__
  return static_cast<int64_t>(__umul64hi(z, static_cast<uint64_t>(numel)));
#else
  return static_cast<int64_t>((static_cast<unsigned __int128>(z) * static_cast<uint64_t>(numel)) >> 64);
#endif
}

// The k positions a draw takes, as a CPU int64 tensor (tests and the binding's check of them).
at::Tensor random_k_positions(int64_t numel, int64_t k, uint64_t seed);

// values (x's dtype, k = values.numel() entries) = x at the k drawn positions. An Inf or a NaN
// anywhere in x makes values[0] NaN, so that every rank's sum shows the overflow (a loss scaler
// then skips the step). With `clear` (error feedback: x is the error buffer), the drawn
// positions of x become 0 (sent in full), and so does every Inf and NaN of x.
void random_k_take_(const at::Tensor& x, uint64_t seed, const at::Tensor& values, bool clear);

// out = 0, except at the drawn positions: summed / ranks there (summed: k values; a position
// drawn twice gets the same value from both draws).
void random_k_place_(const at::Tensor& summed, uint64_t seed, const at::Tensor& out, int64_t ranks);

#ifdef COMMTUNE_WITH_CUDA
void random_k_take_cuda_(const at::Tensor& x, uint64_t seed, const at::Tensor& values, bool clear);
void random_k_place_cuda_(const at::Tensor& summed, uint64_t seed, const at::Tensor& out, int64_t ranks);
#endif

} // namespace commtune
