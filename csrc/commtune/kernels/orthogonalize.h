#pragma once
#include <ATen/ATen.h>

namespace commtune {

// Orthonormalizes the columns of each matrix of a batch [b, n, r] in place, by modified
// Gram-Schmidt: column i is divided by (its norm + epsilon), then removed from the columns
// after it. The spans of the leading columns are those of a QR factorization, so PowerSGD's
// P Q^T does not depend on which of the two computed them. With epsilon 0 a zero column
// becomes NaN, as in torch's PowerSGD; a small epsilon (1e-8) keeps it zero.
void orthogonalize_(const at::Tensor& matrices, double epsilon);

} // namespace commtune
