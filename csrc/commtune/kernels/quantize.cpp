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

// Encodes `values` (one chunk, as floats) with its absmax scale into `codes`; returns the scale.
float encode_chunk(const float* values, int64_t n, uint64_t first_index, int64_t draws, quant::Codes kind,
                   uint8_t* codes) {
  float absmax = 0;
  for (int64_t j = 0; j < n; ++j) absmax = quant::max_magnitude(absmax, values[j]);
  const float scale = quant::scale_of(absmax, kind), inverse = quant::inverse(scale);
  for (int64_t j = 0; j < n; j += 4) {
    int8_t q[4];
    float level[4];  // unused: the CPU's error decodes the stored codes, a check on the CUDA levels
    quant::encode_four(values + j, first_index + j, draws, inverse, kind, q, level);
    quant::store_four_codes(codes, j, q, kind);
  }
  return scale;
}

// values[0..n) += each code of one rank's chunk times its scale, one rounding each (std::fmaf).
// Built twice on x86-64, picked at load time: with the FMA instruction where the CPU has it (the
// library's fmaf is a call, several times slower) and without; both give the same bits.
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target_clones("fma", "default")))
#endif
void add_decoded_chunk(float* values, const uint8_t* codes, int64_t n, float scale, quant::Codes kind) {
  for (int64_t j = 0; j < n; j += 4) {
    int8_t q[4];
    quant::load_four_codes(codes, j, kind, q);
    for (int k = 0; k < 4; ++k) values[j + k] = quant::add_decoded(values[j + k], q[k], scale, kind);
  }
}

} // namespace

quant::Codes codes_named(const std::string& name) {
  if (name == "int8") return quant::Codes::int8;
  if (name == "int4") return quant::Codes::int4;
  TORCH_CHECK(name == "e4m3", "Quantize: codes must be \"int8\", \"int4\" or \"e4m3\", got \"", name, "\"");
  return quant::Codes::e4m3;
}

QuantizeLayout QuantizeLayout::of(int64_t numel, int64_t ranks, int64_t chunk, quant::Codes codes) {
  TORCH_CHECK(ranks >= 1, "Quantize: ranks must be >= 1, got ", std::to_string(ranks));
  TORCH_CHECK(chunk >= 8 && chunk % 8 == 0, "Quantize: chunk must be a positive multiple of 8, got ",
              std::to_string(chunk));
  QuantizeLayout l;
  l.numel = numel;
  l.ranks = ranks;
  l.chunk = chunk;
  l.kind = codes;
  const int64_t per_rank = (numel + ranks - 1) / ranks;
  l.per_shard = std::max<int64_t>(1, (per_rank + chunk - 1) / chunk);
  l.shard = l.per_shard * chunk;
  return l;
}

void quantize_shards_(const at::Tensor& src, const at::Tensor& error, const at::Tensor& packed,
                      const QuantizeLayout& layout, int64_t draws, bool accumulate) {
  check_values(src, layout.numel, "Quantize", "the bucket");
  if (error.defined()) {
    check_values(error, layout.numel, "Quantize", "the error buffer");
    check_same_device(src, error, "Quantize", "the error buffer");
  }
  check_accumulate(src, error, accumulate, "Quantize");
  check_packed(packed, layout.ranks * layout.piece_bytes(), "Quantize", "the packed buffer");
  check_same_device(src, packed, "Quantize", "the packed buffer");
#ifdef COMMTUNE_WITH_CUDA
  if (src.is_cuda()) return quantize_shards_cuda_(src, error, packed, layout, draws, accumulate);
#endif
  if (accumulate) error.add_(src);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "quantize_shards", [&] {
    const scalar_t* in = (accumulate ? error : src).const_data_ptr<scalar_t>();
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
        uint8_t* codes = layout.codes(out, s, c);
        const float scale = encode_chunk(values.data(), layout.chunk, first, draws, layout.kind, codes);
        *layout.scale(out, s, c) = scale;
        for (int64_t j = 0; err != nullptr && j < layout.chunk && first + j < layout.numel; j += 4) {
          int8_t q[4];
          quant::load_four_codes(codes, j, layout.kind, q);
          for (int k = 0; k < 4 && first + j + k < layout.numel; ++k) {
            err[first + j + k] = static_cast<scalar_t>(quant::error_of(values[j + k], quant::level_of(q[k], layout.kind), scale));
          }
        }
      }
    });
  });
}

void reduce_shard_(const at::Tensor& received, const at::Tensor& piece, const QuantizeLayout& layout,
                   int64_t divisor, int64_t draws) {
  TORCH_CHECK(divisor >= 1, "Quantize: divisor must be >= 1");
  check_packed(received, layout.ranks * layout.piece_bytes(), "Quantize", "the received pieces");
  check_packed(piece, layout.piece_bytes(), "Quantize", "the reduced piece");
  check_same_device(received, piece, "Quantize", "the reduced piece");
#ifdef COMMTUNE_WITH_CUDA
  if (received.is_cuda()) return reduce_shard_cuda_(received, piece, layout, divisor, draws);
#endif
  uint8_t* in = received.mutable_data_ptr<uint8_t>();
  uint8_t* out = piece.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, layout.chunks_per_shard(), 16, [&](int64_t begin, int64_t end) {
    std::vector<float> values(layout.chunk);
    for (int64_t c = begin; c < end; ++c) {
      std::fill(values.begin(), values.end(), 0.0f);
      float scale_sum = 0.0f;
      bool finite = true;
      for (int64_t r = 0; r < layout.ranks; ++r) {
        const float scale = *layout.scale(in, r, c);
        add_decoded_chunk(values.data(), layout.codes(in, r, c), layout.chunk, scale, layout.kind);
        scale_sum = quant::add(scale_sum, scale);
        finite = finite && quant::finite_scale(scale);
      }
      for (int64_t j = 0; j < layout.chunk; ++j) {
        values[j] = quant::div(quant::finish_sum(values[j], scale_sum, layout.kind), static_cast<float>(divisor));
      }
      const float scale =
          encode_chunk(values.data(), layout.chunk, c * layout.chunk, draws, layout.kind, layout.codes(out, 0, c));
      *layout.scale(out, 0, c) = quant::reduced_scale(scale, finite);
    }
  });
}

void dequantize_shards_(const at::Tensor& packed, const at::Tensor& out, const QuantizeLayout& layout) {
  check_packed(packed, layout.ranks * layout.piece_bytes(), "Quantize", "the gathered pieces");
  check_values(out, layout.numel, "Quantize", "the bucket");
  check_same_device(out, packed, "Quantize", "the gathered pieces");
#ifdef COMMTUNE_WITH_CUDA
  if (out.is_cuda()) return dequantize_shards_cuda_(packed, out, layout);
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "dequantize_shards", [&] {
    uint8_t* in = packed.mutable_data_ptr<uint8_t>();
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    const int64_t chunks = layout.ranks * layout.chunks_per_shard();
    at::parallel_for(0, chunks, 16, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t s = g / layout.chunks_per_shard(), c = g % layout.chunks_per_shard();
        const int64_t first = s * layout.shard + c * layout.chunk;
        const float scale = *layout.scale(in, s, c);
        for (int64_t j = 0; j < layout.chunk && first + j < layout.numel; j += 4) {
          int8_t q[4];
          quant::load_four_codes(layout.codes(in, s, c), j, layout.kind, q);
          for (int k = 0; k < 4 && first + j + k < layout.numel; ++k) {
            dst[first + j + k] = static_cast<scalar_t>(quant::decode(q[k], scale, layout.kind));
          }
        }
      }
    });
  });
}

} // namespace commtune
