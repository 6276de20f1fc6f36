#pragma once
// Random-k sparsification's passes (the RandomK hook), on the stratified draw of random_k_draw.h.
// Each entry is sent with chance about k/numel, none twice, the positions come in index order,
// and a kernel can read and write each stratum where it lies (no scattered accesses over the
// whole bucket). The draw is the same on every rank, on the CPU and on the GPU, and is computed
// where it is used (no host draw, no copy to the device).
#include <ATen/ATen.h>

#include <commtune/kernels/random_k_draw.h>

#include <cstdint>

namespace commtune {

// Refuses a draw of k from numel that the strata cannot hold (k > numel) or index (k > INT32_MAX).
void random_k_check_count(int64_t numel, int64_t k);

// The k positions a draw takes, as a CPU int64 tensor (tests and the binding's check of them).
at::Tensor random_k_positions(int64_t numel, int64_t k, uint64_t seed);

// values (x's dtype, k = values.numel() entries) = x at the k drawn positions. An Inf or a NaN
// anywhere in x makes values[0] NaN, so that every rank's sum shows the overflow (a loss scaler
// then skips the step). With `clear` (error feedback: x is the error buffer), the drawn
// positions of x become 0 (sent in full), and so does every Inf and NaN of x. With `add` (x's
// dtype, numel and device), x += add first, as at::add_ would, in the same pass on CUDA: error
// feedback's add of the new gradient, without a pass of its own over the bucket.
void random_k_take_(const at::Tensor& x, uint64_t seed, const at::Tensor& values, bool clear,
                    const at::Tensor& add = {});

// out = 0, except at the drawn positions: summed / ranks there (summed: k values).
void random_k_place_(const at::Tensor& summed, uint64_t seed, const at::Tensor& out, int64_t ranks);

#ifdef COMMTUNE_WITH_CUDA
void random_k_take_cuda_(const at::Tensor& x, const at::Tensor& add, uint64_t seed, const at::Tensor& values,
                         bool clear);
void random_k_place_cuda_(const at::Tensor& summed, uint64_t seed, const at::Tensor& out, int64_t ranks);
#endif

} // namespace commtune
