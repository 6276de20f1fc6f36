#pragma once
#include <ATen/ATen.h>

namespace commtune {

// Orthonormalizes the columns of each matrix of a batch [b, n, r] in place, column by column:
// column i loses its components along the finished columns before it, then is divided by
// (its norm + epsilon). For r <= 2 that is one pass, exactly torch's PowerSGD Gram-Schmidt;
// for r > 2 the removal runs twice ("twice is enough"), which keeps the columns orthonormal
// to rounding as torch's QR does there. With epsilon 0 a zero column becomes NaN, as in
// torch's Gram-Schmidt; a small epsilon (1e-8) keeps it zero. CUDA batches run as one launch.
void orthogonalize_(const at::Tensor& matrices, double epsilon);

} // namespace commtune
