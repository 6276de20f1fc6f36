#pragma once
// RandomK's stratified draw, header only (no torch: the CPU loops, the CUDA kernels and the
// standalone probes share it). The bucket is cut into k strata, stratum s holding entries
// floor(s·numel/k) to floor((s+1)·numel/k) − 1, and draw s is one entry of stratum s, picked by
// a hash of (seed, s).
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

} // namespace commtune
