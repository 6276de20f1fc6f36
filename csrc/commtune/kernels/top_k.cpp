#include <commtune/kernels/top_k.h>

#include <commtune/shape.h>

#include <ATen/Dispatch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

namespace commtune {

TopKSample TopKSample::of(int64_t numel, int64_t k) {
  TopKSample s;
  s.size = std::min(numel, kTopKSample);
  s.stride = numel / s.size;
  s.want = std::max<int64_t>(1, (k * s.size + numel - 1) / numel);
  return s;
}

void threshold_top_k_(const at::Tensor& x, int64_t k, const at::Tensor& piece, const at::Tensor& qualifying,
                      bool clear, const at::Tensor& add) {
  const int64_t numel = x.numel();
  TORCH_CHECK(x.dim() == 1 && x.is_contiguous() && x.is_floating_point(),
              "TopK: the bucket must be a contiguous 1-D floating-point tensor, got ", x.scalar_type(), " ",
              shape_of(x));
  TORCH_CHECK(numel > 0 && numel < (int64_t{1} << 31), "TopK: the bucket must hold 1 to 2^31 - 1 entries, got ",
              std::to_string(numel));
  TORCH_CHECK(k >= 1 && k <= numel, "TopK: k must be in [1, ", std::to_string(numel), "], got ",
              std::to_string(k));
  TORCH_CHECK(piece.scalar_type() == at::kInt && piece.is_contiguous() && piece.numel() == 2 * k &&
                  piece.device() == x.device(),
              "TopK: the piece must be a contiguous int32 tensor of 2k = ", std::to_string(2 * k), " entries on ",
              x.device().str(), ", got ", piece.scalar_type(), " ", shape_of(piece), " on ", piece.device().str());
  TORCH_CHECK(qualifying.scalar_type() == at::kLong && qualifying.numel() == 1 && qualifying.device() == x.device(),
              "TopK: the count must be one int64 on ", x.device().str(), ", got ", qualifying.scalar_type(), " ",
              shape_of(qualifying), " on ", qualifying.device().str());
  if (add.defined()) check_addend(x, add, "TopK", "the bucket");
  const TopKSample sample = TopKSample::of(numel, k);
#ifdef COMMTUNE_WITH_CUDA
  if (x.is_cuda()) return threshold_top_k_cuda_(x, add, k, piece, qualifying, clear, sample);
#endif
  if (add.defined()) x.add_(add);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "threshold_top_k", [&] {
    scalar_t* in = x.mutable_data_ptr<scalar_t>();
    std::vector<uint32_t> drawn(sample.size);  // the keys, as the GPU orders them (NaN above Inf)
    for (int64_t s = 0; s < sample.size; ++s) {
      drawn[s] = quant::float_bits(std::fabs(static_cast<float>(in[s * sample.stride])));
    }
    std::nth_element(drawn.begin(), drawn.begin() + (sample.want - 1), drawn.end(), std::greater<uint32_t>());
    const float threshold = quant::float_from_bits(drawn[sample.want - 1]);
    int32_t* out = piece.mutable_data_ptr<int32_t>();
    float* values = reinterpret_cast<float*>(out);
    int32_t* indices = out + k;
    int64_t count = 0;
    float largest = 0.0f;  // Inf or NaN once an entry is
    for (int64_t i = 0; i < numel; ++i) {
      const float value = static_cast<float>(in[i]);
      largest = quant::max_magnitude(largest, value);
      if (clear && !std::isfinite(value)) in[i] = scalar_t(0);  // taken or not: the picks keep it
      if (!(std::fabs(value) >= threshold)) continue;
      if (count < k) {
        values[count] = value;
        indices[count] = static_cast<int32_t>(i);
        if (clear) in[i] = scalar_t(0);
      }
      ++count;
    }
    std::fill(values + std::min(count, k), values + k, 0.0f);
    std::fill(indices + std::min(count, k), indices + k, 0);
    if (!quant::finite_scale(largest)) values[0] = quant::float_from_bits(quant::kQuietNanBits);
    qualifying.fill_(count);
  });
}

void top_k_place_(const at::Tensor& gathered, const at::Tensor& out, int64_t ranks) {
  TORCH_CHECK(out.dim() == 1 && out.is_contiguous() && out.is_floating_point() && out.numel() > 0 &&
                  out.numel() < (int64_t{1} << 31),
              "TopK: the bucket must be a contiguous 1-D floating-point tensor of 1 to 2^31 - 1 entries, got ",
              out.scalar_type(), " ", shape_of(out));
  TORCH_CHECK(ranks >= 1, "TopK: ranks must be at least 1, got ", std::to_string(ranks));
  TORCH_CHECK(gathered.scalar_type() == at::kInt && gathered.dim() == 1 && gathered.is_contiguous() &&
                  gathered.numel() > 0 && gathered.numel() % (2 * ranks) == 0,
              "TopK: the gathered pieces must be a contiguous 1-D int32 tensor of ranks x 2k entries (",
              std::to_string(ranks), " ranks), got ", gathered.scalar_type(), " ", shape_of(gathered));
  check_same_device(out, gathered, "TopK", "the gathered pieces");
#ifdef COMMTUNE_WITH_CUDA
  if (out.is_cuda()) return top_k_place_cuda_(gathered, out, ranks);
#endif
  const int64_t numel = out.numel(), k = gathered.numel() / (2 * ranks);
  // Every piece is checked before out is written: a refused call leaves it as it was.
  std::vector<float> sum(numel, 0.0f);
  const int32_t* pieces = gathered.const_data_ptr<int32_t>();
  for (int64_t r = 0; r < ranks; ++r) {
    const float* values = reinterpret_cast<const float*>(pieces + r * 2 * k);
    const int32_t* indices = pieces + r * 2 * k + k;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t i = indices[j];
      if (j > 0 && i == 0) {  // an unused slot (a pick after slot 0 has a larger index)
        TORCH_CHECK(values[j] == 0.0f, "TopK: rank ", std::to_string(r), "'s piece has a value in unused slot ",
                    std::to_string(j), " (index 0 after slot 0); unused slots hold 0");
        continue;
      }
      TORCH_CHECK(j == 0 || ((j == 1 || indices[j - 1] != 0) && i > indices[j - 1]), "TopK: rank ",
                  std::to_string(r), "'s piece is out of order at slot ", std::to_string(j),
                  " (a piece's picks come in ascending index order, then unused slots: value 0 at index 0)");
      TORCH_CHECK(i >= 0 && i < numel, "TopK: rank ", std::to_string(r), "'s piece has index ", std::to_string(i),
                  " at slot ", std::to_string(j), ", outside the bucket's ", std::to_string(numel), " entries");
      sum[i] += values[j];
    }
  }
  const quant::Divisor divisor = quant::Divisor::of(ranks);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "top_k_place", [&] {
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    for (int64_t i = 0; i < numel; ++i) dst[i] = static_cast<scalar_t>(divisor.apply(sum[i]));
  });
}

} // namespace commtune
