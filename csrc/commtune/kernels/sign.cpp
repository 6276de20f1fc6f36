#include <commtune/kernels/sign.h>

#include <commtune/shape.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

namespace commtune {

SignLayout SignLayout::of(int64_t numel, int64_t chunk) {
  TORCH_CHECK(chunk >= 32 && chunk % 32 == 0, "SignSGD: chunk must be a positive multiple of 32, got ",
              std::to_string(chunk));
  SignLayout l;
  l.numel = numel;
  l.chunk = chunk;
  return l;
}

void sign_encode_(const at::Tensor& src, const at::Tensor& error, const at::Tensor& piece, const SignLayout& layout,
                  bool accumulate) {
  check_values(src, layout.numel, "SignSGD", "the bucket");
  if (error.defined()) {
    check_values(error, layout.numel, "SignSGD", "the error buffer");
    check_same_device(src, error, "SignSGD", "the error buffer");
  }
  check_accumulate(src, error, accumulate, "SignSGD");
  check_packed(piece, layout.piece_bytes(), "SignSGD", "the encoded piece");
  check_same_device(src, piece, "SignSGD", "the encoded piece");
#ifdef COMMTUNE_WITH_CUDA
  if (src.is_cuda()) return sign_encode_cuda_(src, error, piece, layout, accumulate);
#endif
  if (accumulate) error.add_(src);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "sign_encode", [&] {
    const scalar_t* in = (accumulate ? error : src).const_data_ptr<scalar_t>();
    scalar_t* err = error.defined() ? error.mutable_data_ptr<scalar_t>() : nullptr;
    uint32_t* bits = reinterpret_cast<uint32_t*>(piece.mutable_data_ptr<uint8_t>());
    float* scales = reinterpret_cast<float*>(bits + layout.words());
    at::parallel_for(0, layout.chunks(), 16, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        const int64_t first = c * layout.chunk, last = std::min(first + layout.chunk, layout.numel);
        double total = 0;  // in double, so the order of the sum does not show in the float scale
        for (int64_t i = first; i < last; ++i) total += std::fabs(static_cast<double>(in[i]));
        const float scale = static_cast<float>(total / static_cast<double>(last - first));
        scales[c] = scale;
        for (int64_t w = first / 32; w < (first + layout.chunk) / 32; ++w) {
          uint32_t word = 0;
          for (int b = 0; b < 32; ++b) {
            const int64_t i = w * 32 + b;
            if (i < layout.numel && static_cast<float>(in[i]) < 0.0f) word |= 1u << b;
          }
          bits[w] = word;
        }
        for (int64_t i = first; err != nullptr && i < last; ++i) {
          const float sign = (bits[i / 32] >> (i % 32)) & 1u ? -1.0f : 1.0f;
          err[i] = static_cast<scalar_t>(quant::error_of(static_cast<float>(in[i]), sign, scale));
        }
      }
    });
  });
}

void sign_decode_mean_(const at::Tensor& gathered, const at::Tensor& out, int64_t ranks, const SignLayout& layout) {
  TORCH_CHECK(ranks >= 1, "SignSGD: ranks must be >= 1");
  check_packed(gathered, ranks * layout.piece_bytes(), "SignSGD", "the gathered pieces");
  check_values(out, layout.numel, "SignSGD", "the bucket");
  check_same_device(out, gathered, "SignSGD", "the gathered pieces");
#ifdef COMMTUNE_WITH_CUDA
  if (out.is_cuda()) return sign_decode_mean_cuda_(gathered, out, ranks, layout);
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "sign_decode_mean", [&] {
    const uint8_t* in = gathered.const_data_ptr<uint8_t>();
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, layout.numel, 1 << 14, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        float sum = 0.0f;
        for (int64_t r = 0; r < ranks; ++r) {
          const uint32_t* bits = reinterpret_cast<const uint32_t*>(in + r * layout.piece_bytes());
          const float scale = reinterpret_cast<const float*>(bits + layout.words())[i / layout.chunk];
          sum = quant::add(sum, (bits[i / 32] >> (i % 32)) & 1u ? -scale : scale);
        }
        dst[i] = static_cast<scalar_t>(quant::div(sum, static_cast<float>(ranks)));
      }
    });
  });
}

} // namespace commtune
