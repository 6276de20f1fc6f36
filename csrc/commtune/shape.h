#pragma once
// Shapes for error messages, formatted here: streaming IntArrayRef into TORCH_CHECK
// crashed the process under torch 2.11 + CUDA 13 on the GPU machine.
#include <ATen/ATen.h>

#include <string>

namespace commtune {

inline std::string shape_of(const at::Tensor& t) {
  std::string out = "[";
  for (int64_t d = 0; d < t.dim(); ++d) {
    out += (d ? ", " : "") + std::to_string(t.size(d));
  }
  return out + "]";
}

} // namespace commtune
