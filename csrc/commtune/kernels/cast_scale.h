#pragma once
#include <ATen/ATen.h>

namespace commtune {

// out = (src * scale) rounded to out's dtype, in one pass over the bytes (out is written through its data).
// Scaling before the cast keeps fp16 from overflowing on large gradients.
// src and out: same device, same number of elements, contiguous, floating point.
void cast_scale_(const at::Tensor& src, double scale, const at::Tensor& out);

// Allocating form of cast_scale_.
at::Tensor cast_scale(const at::Tensor& src, double scale, at::ScalarType dtype);

#ifdef COMMTUNE_WITH_CUDA
void cast_scale_cuda_(const at::Tensor& src, float scale, const at::Tensor& out);
#endif

} // namespace commtune
