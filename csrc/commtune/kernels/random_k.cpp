#include <commtune/kernels/random_k.h>

#include <commtune/shape.h>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include <cmath>

namespace commtune {
namespace {

void check_pair(const at::Tensor& bucket, const at::Tensor& values, const char* bucket_is) {
  TORCH_CHECK(bucket.dim() == 1 && bucket.is_contiguous() && bucket.is_floating_point() && bucket.numel() > 0,
              "RandomK: ", bucket_is, " must be a non-empty contiguous 1-D floating-point tensor, got ",
              bucket.scalar_type(), " ", shape_of(bucket));
  TORCH_CHECK(values.dim() == 1 && values.is_contiguous() && values.numel() > 0 &&
                  values.scalar_type() == bucket.scalar_type(),
              "RandomK: the values must be a non-empty contiguous 1-D tensor of ", bucket.scalar_type(), ", got ",
              values.scalar_type(), " ", shape_of(values));
  check_same_device(bucket, values, "RandomK", "the values");
  random_k_check_count(bucket.numel(), values.numel());
}

}  // namespace

void random_k_check_count(int64_t numel, int64_t k) {
  TORCH_CHECK(numel > 0 && k > 0, "RandomK: numel and k must be positive, got ", std::to_string(numel), " and ",
              std::to_string(k));
  TORCH_CHECK(k <= numel, "RandomK: cannot draw ", std::to_string(k), " distinct entries from a bucket of ",
              std::to_string(numel), "; pass at most as many values as the bucket has entries");
  TORCH_CHECK(k <= INT32_MAX, "RandomK: at most 2^31 - 1 values a bucket, got ", std::to_string(k),
              "; lower the ratio or the bucket size");
}

at::Tensor random_k_positions(int64_t numel, int64_t k, uint64_t seed) {
  random_k_check_count(numel, k);
  at::Tensor out = at::empty({k}, at::kLong);
  int64_t* p = out.mutable_data_ptr<int64_t>();
  for (int64_t s = 0; s < k; ++s) p[s] = random_k_position(seed, s, numel, k);
  return out;
}

void random_k_take_(const at::Tensor& x, uint64_t seed, const at::Tensor& values, bool clear, const at::Tensor& add) {
  check_pair(x, values, "the bucket");
  if (add.defined()) check_addend(x, add, "RandomK", "the bucket");
#ifdef COMMTUNE_WITH_CUDA
  if (x.is_cuda()) return random_k_take_cuda_(x, add, seed, values, clear);
#endif
  if (add.defined()) x.add_(add);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "random_k_take", [&] {
    scalar_t* in = x.mutable_data_ptr<scalar_t>();
    scalar_t* out = values.mutable_data_ptr<scalar_t>();
    using opmath_t = at::opmath_type<scalar_t>;  // double stays double: a finite double above FLT_MAX is no overflow
    const int64_t numel = x.numel(), k = values.numel();
    // The kernel's order: read the bucket for an Inf or a NaN, gather (and clear) the draws, and
    // only on an overflow go over the bucket again to zero it (error feedback keeps none).
    bool overflow = false;
    for (int64_t i = 0; i < numel && !overflow; ++i) overflow = !std::isfinite(static_cast<opmath_t>(in[i]));
    for (int64_t s = 0; s < k; ++s) {
      const int64_t at = random_k_position(seed, s, numel, k);
      out[s] = in[at];
      if (clear) in[at] = scalar_t(0);
    }
    if (overflow && clear) {
      for (int64_t i = 0; i < numel; ++i) {
        if (!std::isfinite(static_cast<opmath_t>(in[i]))) in[i] = scalar_t(0);
      }
    }
    if (overflow) out[0] = static_cast<scalar_t>(quant::float_from_bits(quant::kQuietNanBits));
  });
}

void random_k_place_(const at::Tensor& summed, uint64_t seed, const at::Tensor& out, int64_t ranks) {
  check_pair(out, summed, "the bucket");
  TORCH_CHECK(ranks >= 1, "RandomK: ranks must be at least 1, got ", std::to_string(ranks));
#ifdef COMMTUNE_WITH_CUDA
  if (out.is_cuda()) return random_k_place_cuda_(summed, seed, out, ranks);
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "random_k_place", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* in = summed.const_data_ptr<scalar_t>();
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    const int64_t numel = out.numel(), k = summed.numel();
    std::fill(dst, dst + numel, scalar_t(0));
    for (int64_t s = 0; s < k; ++s) {
      dst[random_k_position(seed, s, numel, k)] =
          static_cast<scalar_t>(static_cast<opmath_t>(in[s]) / static_cast<opmath_t>(ranks));
    }
  });
}

} // namespace commtune
