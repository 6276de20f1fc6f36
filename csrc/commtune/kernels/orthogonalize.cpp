#include <commtune/kernels/orthogonalize.h>

#include <commtune/kernels/low_rank.h>
#include <commtune/shape.h>

namespace commtune {
namespace {

void orthogonalize_aten_(const at::Tensor& matrices, double epsilon) {
  const int64_t cols = matrices.size(2);
  const int passes = cols > 2 ? 2 : 1;
  for (int64_t i = 0; i < cols; ++i) {
    at::Tensor col = matrices.narrow(2, i, 1);
    if (i > 0) {
      at::Tensor done = matrices.narrow(2, 0, i);
      for (int pass = 0; pass < passes; ++pass) {
        at::Tensor dots = (done * col).sum(1, /*keepdim=*/true);  // [b, 1, i]
        col.sub_((done * dots).sum(2, /*keepdim=*/true));
      }
    }
    col.div_(at::linalg_vector_norm(col, 2, {1}, /*keepdim=*/true).add_(epsilon));
  }
}

} // namespace

void orthogonalize_(const at::Tensor& matrices, double epsilon) {
  TORCH_CHECK(matrices.dim() == 3 && matrices.size(2) <= matrices.size(1),
              "orthogonalize_: expects a batch of tall matrices [b, n, r] with r <= n, got shape ",
              shape_of(matrices));
  TORCH_CHECK(matrices.is_floating_point(), "orthogonalize_: expects floating point, got ",
              matrices.scalar_type());
  TORCH_CHECK(epsilon >= 0, "orthogonalize_: epsilon must be >= 0");
#ifdef COMMTUNE_WITH_CUDA
  if (matrices.is_cuda() && matrices.is_contiguous() && matrices.size(2) <= kMaxKernelRank) {
    const int64_t b = matrices.size(0), n = matrices.size(1), r = matrices.size(2);
    at::Tensor table = at::empty({b, 4}, at::kLong);
    auto* entries = reinterpret_cast<FactorEntry*>(table.data_ptr<int64_t>());
    for (int64_t i = 0; i < b; ++i) entries[i] = FactorEntry{i * n * r, n, r};
    orthogonalize_cuda_(matrices.view(-1), table.to(matrices.device()), b, r, n * r, epsilon);
    return;
  }
#endif
  orthogonalize_aten_(matrices, epsilon);
}

} // namespace commtune
