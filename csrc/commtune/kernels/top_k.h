#pragma once
// Top-k by an estimated threshold (TopK's selection="threshold"): one pass over the bucket
// instead of an exact selection. The threshold t is the `want`-th largest |x| among a sample of
// m = min(numel, kTopKSample) entries s * stride (stride = numel / m), want = ceil(k * m / numel);
// the entries with |x| >= t qualify, and the first k of them in index order are taken. How many
// qualify is random (for a ratio of 1%, about k +- 8%); more than k: the rest stay in the error
// buffer for a later step; fewer: the unused slots send nothing. Both give the same picks on the
// CPU and the GPU. The sample's keys are |x| as bits (non-negative floats order as their bits),
// so a NaN ranks above Inf there; but a NaN entry never qualifies (NaN >= t is false), and an Inf
// may come after the first k. So a bucket holding an Inf or a NaN anywhere sends NaN
// (quant::kQuietNanBits) as its first pick's value instead: every rank's sum shows the overflow,
// and a loss scaler skips the step, as with the other compressing hooks.
#include <ATen/ATen.h>

#include <commtune/kernels/quantize_rules.h>

#include <cstdint>

namespace commtune {

constexpr int64_t kTopKSample = 16384;

// Writes the taken entries to `piece` (int32, 2k: k values as float32 bits, then k indices);
// the slots past the number taken get value 0 at index 0, which adds nothing. With `clear`, the
// taken entries of x become 0 (they are sent in full), and so does every Inf and NaN entry, so
// that an error buffer keeps nothing of an overflow (on CUDA a pass of its own, which in a
// bucket with none ends as it starts: no second read of the bucket). `qualifying` (int64, one
// element, on x's device) receives how many entries qualified: the count error is that minus k.
// With `add` (x's dtype, numel and device), x += add first, as at::add_ would; on CUDA in the same
// pass (error feedback's add of the new gradient, x being the error buffer).
void threshold_top_k_(const at::Tensor& x, int64_t k, const at::Tensor& piece, const at::Tensor& qualifying,
                      bool clear, const at::Tensor& add = {});

// TopK's decompression: out = the mean of the ranks' pieces, the ranks' all-gathered pieces
// (gathered: int32, ranks x 2k, each laid out as threshold_top_k_ writes one) summed in float32,
// in rank order, divided by `ranks` and rounded once to out's dtype; 0 where no rank sent an
// entry. A piece's entries are its picks, indices strictly ascending and in [0, out.numel()),
// then unused slots, value 0 at index 0 (a slot after the first at index 0 is unused: a pick
// there would not ascend), as both selections write them: the exact one sorts its picks by index.
// A piece that breaks this is refused (CPU: a c10::Error, out left as it was; CUDA: a device-side
// assertion, which the next synchronizing call raises). On CUDA a dense write of out and one
// read of the pieces.
void top_k_place_(const at::Tensor& gathered, const at::Tensor& out, int64_t ranks);

// The sample's size and rank for a bucket of numel entries and k to take.
struct TopKSample {
  int64_t size = 0;
  int64_t stride = 1;  // between sampled entries
  int64_t want = 0;
  static TopKSample of(int64_t numel, int64_t k);
};

#ifdef COMMTUNE_WITH_CUDA
void threshold_top_k_cuda_(const at::Tensor& x, const at::Tensor& add, int64_t k, const at::Tensor& piece,
                           const at::Tensor& qualifying, bool clear, const TopKSample& sample);
void top_k_place_cuda_(const at::Tensor& gathered, const at::Tensor& out, int64_t ranks);
#endif

} // namespace commtune
