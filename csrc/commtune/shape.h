#pragma once
// Tensors described in error messages, and the argument checks of the compression passes.
// Numbers in error messages go through std::to_string, never an ostream: on the GPU machine
// (torch 2.11, GCC 13) streaming an integer into TORCH_CHECK's message segfaults inside
// std::ostream::_M_insert<long>, in any extension built there (a load_inline one too).
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <cstdint>
#include <string>

namespace commtune {

inline std::string shape_of(const at::Tensor& t) {
  std::string out = "[";
  for (int64_t d = 0; d < t.dim(); ++d) {
    out += (d ? ", " : "") + std::to_string(t.size(d));
  }
  return out + "]";
}

// The checks the compression passes (Quantize, SignSGD; `scheme` names them) make of their
// arguments. A packed buffer is a contiguous uint8 tensor of exactly `bytes` bytes that starts
// 4-byte aligned: its codes or signs are read and written as whole 32-bit words (and floats),
// which a view at an odd offset would break.
inline void check_packed(const at::Tensor& t, int64_t bytes, const char* scheme, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kByte && t.is_contiguous() && t.numel() == bytes, scheme, ": ", what,
              " must be a contiguous uint8 tensor of ", std::to_string(bytes), " bytes, got ", t.scalar_type(), " ",
              shape_of(t));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 4 == 0, scheme, ": ", what,
              " must start 4-byte aligned (packed data moves as whole words): a tensor of its own, or a view at a "
              "multiple of 4 bytes");
}

// Values to encode or decode into: a contiguous floating-point tensor of at least `numel` elements.
inline void check_values(const at::Tensor& t, int64_t numel, const char* scheme, const char* what) {
  TORCH_CHECK(t.is_floating_point() && t.is_contiguous() && t.numel() >= numel, scheme, ": ", what,
              " must be a contiguous floating-point tensor of at least ", std::to_string(numel), " elements, got ",
              t.scalar_type(), " ", shape_of(t));
}

// A buffer a pass reads or writes beside `on`: on the same device (the CPU loop cannot read a
// GPU's memory, nor a kernel the host's).
inline void check_same_device(const at::Tensor& on, const at::Tensor& t, const char* scheme, const char* what) {
  TORCH_CHECK(t.device() == on.device(), scheme, ": ", what, " must be on ", on.device().str(), " with the rest, got ",
              t.device().str());
}

// A tensor a pass adds to `to` before it reads it (error feedback's add of the gradient to the
// error buffer, fused into the pass; `to_name` says which `to` is): to's dtype, length and device,
// and not a part of it.
inline void check_addend(const at::Tensor& to, const at::Tensor& add, const char* scheme, const char* to_name) {
  TORCH_CHECK(add.dim() == 1 && add.is_contiguous() && add.scalar_type() == to.scalar_type() &&
                  add.numel() == to.numel(),
              scheme, ": the tensor added to ", to_name, " must be a contiguous 1-D ", to.scalar_type(), " tensor of ",
              std::to_string(to.numel()), " entries, got ", add.scalar_type(), " ", shape_of(add));
  check_same_device(to, add, scheme, "the tensor added");
  TORCH_CHECK(at::get_overlap_status(to, add) != at::MemOverlapStatus::Partial, scheme, ": the tensor added to ",
              to_name, " overlaps it in part; pass a separate tensor (or the same one)");
}

// An encoding told to add the bucket (`src`) to the error buffer first (`accumulate`): it needs
// that buffer, and the bucket must be a tensor check_addend accepts for it.
inline void check_accumulate(const at::Tensor& src, const at::Tensor& error, bool accumulate, const char* scheme) {
  if (!accumulate) return;
  TORCH_CHECK(error.defined(), scheme, ": adding the bucket to the error buffer needs an error buffer");
  check_addend(error, src, scheme, "the error buffer");
}

} // namespace commtune
