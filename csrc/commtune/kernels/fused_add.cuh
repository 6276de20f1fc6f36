#pragma once
// Error feedback's add fused into a compressing pass (RandomK's take, TopK's selection): the error
// buffer's entry plus the new gradient's, rounded as at::add_ rounds it (the sum in opmath, then
// once to the dtype), so the pass leaves the buffer as add_ and then the pass would.
#include <ATen/OpMathType.h>

namespace commtune {

template <typename T>
__device__ __forceinline__ T fused_sum(T error, T gradient) {
  using opmath_t = at::opmath_type<T>;
  return static_cast<T>(static_cast<opmath_t>(error) + static_cast<opmath_t>(gradient));
}

} // namespace commtune
