#pragma once
// Random-k sparsification's passes (the RandomK hook). The draw is stratified: the bucket is cut
// into k strata, stratum s holding entries floor(s·numel/k) to floor((s+1)·numel/k) − 1, and draw
// s is one entry of stratum s, picked by a hash of (seed, s). Each entry is sent with chance
// about k/numel, none twice, the positions come in index order, and a kernel can read and write
// each stratum where it lies (no scattered accesses over the whole bucket). The draw is the same
// on every rank, on the CPU and on the GPU, and is computed where it is used (no host draw, no
// copy to the device).
#include <ATen/ATen.h>

#include <commtune/kernels/quantize_rules.h>

#include <cstdint>

namespace commtune {

// First entry of stratum s (0 <= s <= k; s = k gives numel). k <= INT32_MAX keeps s·(numel % k)
// below 2^62.
COMMTUNE_HD int64_t random_k_stratum_start(int64_t s, int64_t numel, int64_t k) {
  return s * (numel / k) + quant::quotient(s * (numel % k), k);
}

// Draw s's position: an entry of stratum s, each with the same chance (k <= numel: no stratum is
// empty).
COMMTUNE_HD int64_t random_k_position(uint64_t seed, int64_t s, int64_t numel, int64_t k) {
  const int64_t start = random_k_stratum_start(s, numel, k);
  const uint64_t length = static_cast<uint64_t>(random_k_stratum_start(s + 1, numel, k) - start);
  const uint64_t z = quant::mix(quant::stream_point(seed, static_cast<uint64_t>(s)));
#ifdef __CUDA_ARCH__
  return start + static_cast<int64_t>(__umul64hi(z, length));
#else
  return start + static_cast<int64_t>((static_cast<unsigned __int128>(z) * length) >> 64);
#endif
}

// The first draw whose position is at or after entry i (k when none is): positions rise with s,
// so the draws in entries [lo, hi) are the s from first(lo) to first(hi) - 1. A kernel block that
// owns a slice of the bucket finds its draws with two of these (a guess and a step or two).
COMMTUNE_HD int64_t random_k_first_at_or_after(int64_t i, uint64_t seed, int64_t numel, int64_t k) {
  if (i >= numel) return k;
  // The stratum holding i: about i·k/numel (a double is within a stratum or two of it).
  int64_t s = static_cast<int64_t>(static_cast<double>(i) * static_cast<double>(k) / static_cast<double>(numel));
  if (s > k - 1) s = k - 1;  // i >= 0, so s >= 0
  while (s > 0 && random_k_stratum_start(s, numel, k) > i) --s;
  while (s + 1 < k && random_k_stratum_start(s + 1, numel, k) <= i) ++s;
  return random_k_position(seed, s, numel, k) >= i ? s : s + 1;
}

// Refuses a draw of k from numel that the strata cannot hold (k > numel) or index (k > INT32_MAX).
void random_k_check_count(int64_t numel, int64_t k);

// The k positions a draw takes, as a CPU int64 tensor (tests and the binding's check of them).
at::Tensor random_k_positions(int64_t numel, int64_t k, uint64_t seed);

// values (x's dtype, k = values.numel() entries) = x at the k drawn positions. An Inf or a NaN
// anywhere in x makes values[0] NaN, so that every rank's sum shows the overflow (a loss scaler
// then skips the step). With `clear` (error feedback: x is the error buffer), the drawn
// positions of x become 0 (sent in full), and so does every Inf and NaN of x.
void random_k_take_(const at::Tensor& x, uint64_t seed, const at::Tensor& values, bool clear);

// out = 0, except at the drawn positions: summed / ranks there (summed: k values).
void random_k_place_(const at::Tensor& summed, uint64_t seed, const at::Tensor& out, int64_t ranks);

#ifdef COMMTUNE_WITH_CUDA
void random_k_take_cuda_(const at::Tensor& x, uint64_t seed, const at::Tensor& values, bool clear);
void random_k_place_cuda_(const at::Tensor& summed, uint64_t seed, const at::Tensor& out, int64_t ranks);
#endif

} // namespace commtune
