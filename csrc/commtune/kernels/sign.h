#pragma once
// 1-bit sign compression with one scale per chunk (the SignSGD hook): an element travels as
// its sign, a chunk as the mean of its absolute values, so decoding gives +-scale. One rank's
// encoded bucket is a piece: a bit per element (set: negative) in 32-bit words, then the
// float scales.
#include <ATen/ATen.h>

#include <commtune/kernels/quantize_rules.h>

#include <cstdint>

namespace commtune {

struct SignLayout {
  int64_t numel = 0;
  int64_t chunk = 1024;  // elements per scale, a multiple of 32

  static SignLayout of(int64_t numel, int64_t chunk);
  COMMTUNE_HD int64_t chunks() const { return (numel + chunk - 1) / chunk; }
  COMMTUNE_HD int64_t words() const { return chunks() * chunk / 32; }
  COMMTUNE_HD int64_t piece_bytes() const { return 4 * words() + 4 * chunks(); }
};

// Encodes src into `piece` (uint8, piece_bytes). With `error` defined (may be src itself),
// error = src - decoded. With `accumulate` (error feedback: error is the error buffer, src the
// bucket), what is encoded is error + src, as error.add_(src) would leave it, in the same pass on
// CUDA, and error = that - decoded.
void sign_encode_(const at::Tensor& src, const at::Tensor& error, const at::Tensor& piece, const SignLayout& layout,
                  bool accumulate = false);
// out = the mean over the `ranks` gathered pieces (uint8, ranks * piece_bytes) of their decoded
// values, summed in rank order.
void sign_decode_mean_(const at::Tensor& gathered, const at::Tensor& out, int64_t ranks, const SignLayout& layout);

#ifdef COMMTUNE_WITH_CUDA
void sign_encode_cuda_(const at::Tensor& src, const at::Tensor& error, const at::Tensor& piece, const SignLayout& layout,
                       bool accumulate);
void sign_decode_mean_cuda_(const at::Tensor& gathered, const at::Tensor& out, int64_t ranks, const SignLayout& layout);
#endif

} // namespace commtune
