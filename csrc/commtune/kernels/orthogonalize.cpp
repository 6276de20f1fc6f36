#include <commtune/kernels/orthogonalize.h>

#include <commtune/shape.h>

namespace commtune {

void orthogonalize_(const at::Tensor& matrices, double epsilon) {
  TORCH_CHECK(matrices.dim() == 3 && matrices.size(2) <= matrices.size(1),
              "orthogonalize_: expects a batch of tall matrices [b, n, r] with r <= n, got shape ",
              shape_of(matrices));
  TORCH_CHECK(epsilon >= 0, "orthogonalize_: epsilon must be >= 0");
  const int64_t cols = matrices.size(2);
  for (int64_t i = 0; i < cols; ++i) {
    at::Tensor col = matrices.narrow(2, i, 1);
    col.div_(at::linalg_vector_norm(col, 2, {1}, /*keepdim=*/true).add_(epsilon));
    if (i + 1 < cols) {
      at::Tensor rest = matrices.narrow(2, i + 1, cols - i - 1);
      rest.sub_((col * rest).sum(1, /*keepdim=*/true) * col);
    }
  }
}

} // namespace commtune
