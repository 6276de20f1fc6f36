#include <commtune/kernels/cast_scale.h>

#include <commtune/shape.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

namespace commtune {
namespace {

void cast_scale_cpu_(const at::Tensor& src, float scale, const at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "cast_scale_src", [&] {
    using src_t = scalar_t;
    const src_t* in = src.const_data_ptr<src_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "cast_scale_out", [&] {
      scalar_t* dst = out.mutable_data_ptr<scalar_t>();
      at::parallel_for(0, src.numel(), at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          dst[i] = static_cast<scalar_t>(static_cast<float>(in[i]) * scale);
        }
      });
    });
  });
}

} // namespace

void cast_scale_(const at::Tensor& src, double scale, const at::Tensor& out) {
  TORCH_CHECK(src.is_floating_point() && out.is_floating_point(),
              "cast_scale_: src and out must be floating point, got ", src.scalar_type(), " and ",
              out.scalar_type());
  TORCH_CHECK(src.numel() == out.numel(), "cast_scale_: src has ", std::to_string(src.numel()),
              " elements (shape ", shape_of(src), ") but out has ", std::to_string(out.numel()),
              " (shape ", shape_of(out), ")");
  check_same_device(src, out, "cast_scale_", "out");
  TORCH_CHECK(src.is_contiguous() && out.is_contiguous(), "cast_scale_: src and out must be contiguous");
  if (src.is_cuda()) {
#ifdef COMMTUNE_WITH_CUDA
    cast_scale_cuda_(src, static_cast<float>(scale), out);
    return;
#else
    TORCH_CHECK(false, "cast_scale_: commtune was built without CUDA; rebuild with COMMTUNE_CUDA=1");
#endif
  }
  TORCH_CHECK(src.is_cpu(), "cast_scale_: unsupported device ", src.device().str());
  cast_scale_cpu_(src, static_cast<float>(scale), out);
}

at::Tensor cast_scale(const at::Tensor& src, double scale, at::ScalarType dtype) {
  at::Tensor out = at::empty(src.sizes(), src.options().dtype(dtype));
  cast_scale_(src, scale, out);
  return out;
}

} // namespace commtune
