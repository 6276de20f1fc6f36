#pragma once
// Numbers in error messages go through std::to_string, never an ostream: on the GPU machine
// (torch 2.11, GCC 13) streaming an integer into TORCH_CHECK's message segfaults inside
// std::ostream::_M_insert<long>, in any extension built there (a load_inline one too).
#include <ATen/ATen.h>

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

// Whether t's data starts 4-byte aligned: packed codes are read and written as whole 32-bit
// words (and floats), which a view at an odd offset would break.
inline bool word_aligned(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 4 == 0; }

} // namespace commtune
