#include <commtune/kernels/quantize.h>

#include <commtune/kernels/quantize_rules.h>
#include <commtune/shape.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace commtune {
namespace {

void check_packed(const at::Tensor& t, int64_t bytes, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kByte && t.is_contiguous() && t.numel() == bytes, "Quantize: ", what,
              " must be a contiguous uint8 tensor of ", std::to_string(bytes), " bytes, got ", t.scalar_type(), " ",
              shape_of(t));
}

void check_values(const at::Tensor& t, int64_t numel, const char* what) {
  TORCH_CHECK(t.is_floating_point() && t.is_contiguous() && t.numel() >= numel, "Quantize: ", what,
              " must be a contiguous floating-point tensor of at least ", std::to_string(numel),
              " elements, got ", t.scalar_type(), " ", shape_of(t));
}

// Where chunk `c` of shard `s` keeps its codes and its scale inside a packed buffer.
int8_t* codes_of(uint8_t* packed, const QuantizeLayout& l, int64_t s, int64_t c) {
  return reinterpret_cast<int8_t*>(packed + s * l.piece_bytes() + c * l.chunk);
}
float* scale_of_chunk(uint8_t* packed, const QuantizeLayout& l, int64_t s, int64_t c) {
  return reinterpret_cast<float*>(packed + s * l.piece_bytes() + l.shard) + c;
}

// Encodes `values` (one chunk, as floats) with its absmax scale; returns the scale.
float encode_chunk(const float* values, int64_t n, uint64_t first_index, int64_t draws, int8_t* codes) {
  float absmax = 0;
  for (int64_t j = 0; j < n; ++j) absmax = std::max(absmax, std::fabs(values[j]));
  const float scale = quant::scale_of(absmax), inverse = quant::inverse(scale);
  for (int64_t j = 0; j < n; ++j) {
    const float draw = draws < 0 ? 0.5f : quant::uniform(static_cast<uint64_t>(draws), first_index + j);
    codes[j] = quant::encode(values[j], inverse, draw);
  }
  return scale;
}

} // namespace

QuantizeLayout QuantizeLayout::of(int64_t numel, int64_t ranks, int64_t chunk) {
  TORCH_CHECK(ranks >= 1 && chunk >= 4 && chunk % 4 == 0, "Quantize: chunk must be a positive multiple of 4");
  QuantizeLayout l;
  l.numel = numel;
  l.ranks = ranks;
  l.chunk = chunk;
  const int64_t per_rank = (numel + ranks - 1) / ranks;
  l.shard = std::max<int64_t>(1, (per_rank + chunk - 1) / chunk) * chunk;
  return l;
}

void quantize_shards_(const at::Tensor& src, const at::Tensor& error, const at::Tensor& packed,
                      const QuantizeLayout& layout, int64_t draws) {
  check_values(src, layout.numel, "the bucket");
  if (error.defined()) check_values(error, layout.numel, "the error buffer");
  check_packed(packed, layout.ranks * layout.piece_bytes(), "the packed buffer");
#ifdef COMMTUNE_WITH_CUDA
  if (src.is_cuda()) return quantize_shards_cuda_(src, error, packed, layout, draws);
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "quantize_shards", [&] {
    const scalar_t* in = src.const_data_ptr<scalar_t>();
    scalar_t* err = error.defined() ? error.mutable_data_ptr<scalar_t>() : nullptr;
    uint8_t* out = packed.mutable_data_ptr<uint8_t>();
    const int64_t chunks = layout.ranks * layout.chunks_per_shard();
    at::parallel_for(0, chunks, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> values(layout.chunk);
      for (int64_t g = begin; g < end; ++g) {
        const int64_t s = g / layout.chunks_per_shard(), c = g % layout.chunks_per_shard();
        const int64_t first = s * layout.shard + c * layout.chunk;
        for (int64_t j = 0; j < layout.chunk; ++j) {
          values[j] = first + j < layout.numel ? static_cast<float>(in[first + j]) : 0.0f;
        }
        int8_t* codes = codes_of(out, layout, s, c);
        const float scale = encode_chunk(values.data(), layout.chunk, first, draws, codes);
        *scale_of_chunk(out, layout, s, c) = scale;
        for (int64_t j = 0; err != nullptr && j < layout.chunk && first + j < layout.numel; ++j) {
          err[first + j] = static_cast<scalar_t>(quant::add(values[j], -quant::decode(codes[j], scale)));
        }
      }
    });
  });
}

void reduce_shard_(const at::Tensor& received, const at::Tensor& piece, const QuantizeLayout& layout,
                   int64_t divisor, int64_t draws) {
  TORCH_CHECK(divisor >= 1, "Quantize: divisor must be >= 1");
  check_packed(received, layout.ranks * layout.piece_bytes(), "the received pieces");
  check_packed(piece, layout.piece_bytes(), "the reduced piece");
  TORCH_CHECK(received.device() == piece.device(), "Quantize: received and reduced pieces must share a device");
#ifdef COMMTUNE_WITH_CUDA
  if (received.is_cuda()) return reduce_shard_cuda_(received, piece, layout, divisor, draws);
#endif
  uint8_t* in = received.mutable_data_ptr<uint8_t>();
  uint8_t* out = piece.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, layout.chunks_per_shard(), 16, [&](int64_t begin, int64_t end) {
    std::vector<float> values(layout.chunk);
    for (int64_t c = begin; c < end; ++c) {
      std::fill(values.begin(), values.end(), 0.0f);
      for (int64_t r = 0; r < layout.ranks; ++r) {
        const int8_t* codes = codes_of(in, layout, r, c);
        const float scale = *scale_of_chunk(in, layout, r, c);
        for (int64_t j = 0; j < layout.chunk; ++j) values[j] = quant::add(values[j], quant::decode(codes[j], scale));
      }
      for (int64_t j = 0; j < layout.chunk; ++j) values[j] = quant::div(values[j], static_cast<float>(divisor));
      *scale_of_chunk(out, layout, 0, c) =
          encode_chunk(values.data(), layout.chunk, c * layout.chunk, draws, codes_of(out, layout, 0, c));
    }
  });
}

void dequantize_shards_(const at::Tensor& packed, const at::Tensor& out, const QuantizeLayout& layout) {
  check_packed(packed, layout.ranks * layout.piece_bytes(), "the gathered pieces");
  check_values(out, layout.numel, "the bucket");
#ifdef COMMTUNE_WITH_CUDA
  if (out.is_cuda()) return dequantize_shards_cuda_(packed, out, layout);
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "dequantize_shards", [&] {
    uint8_t* in = packed.mutable_data_ptr<uint8_t>();
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, layout.numel, 1 << 14, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t s = i / layout.shard, c = (i % layout.shard) / layout.chunk, j = i % layout.chunk;
        dst[i] = static_cast<scalar_t>(quant::decode(codes_of(in, layout, s, c)[j], *scale_of_chunk(in, layout, s, c)));
      }
    });
  });
}

} // namespace commtune
