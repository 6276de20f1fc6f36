#pragma once
// Quantized allreduce (int8, int4 or fp8 e4m3 codes) in three passes (the Quantize hook): every
// rank encodes its bucket as `ranks` shards and sends shard s to rank s (all-to-all); each rank
// decodes, averages and re-encodes its own shard; the encoded shards are all-gathered and
// decoded into the bucket.
// A shard travels as one piece: `shard` codes (a byte each, or half a byte for int4), then one
// float scale per chunk.
#include <ATen/ATen.h>

#include <commtune/kernels/quantize_rules.h>

#include <cstdint>
#include <string>

namespace commtune {

struct QuantizeLayout {
  int64_t numel = 0;  // of the bucket
  int64_t ranks = 1;
  int64_t chunk = 1024;  // elements per scale
  quant::Codes kind = quant::Codes::int8;
  int64_t shard = 0;  // elements per shard: ceil(numel / ranks), rounded up to whole chunks
  int64_t per_shard = 0;  // chunks per shard (shard / chunk, kept: kernels would divide per thread)

  static QuantizeLayout of(int64_t numel, int64_t ranks, int64_t chunk, quant::Codes codes = quant::Codes::int8);
  COMMTUNE_HD int bits() const { return quant::bits_of(kind); }
  COMMTUNE_HD int64_t chunks_per_shard() const { return per_shard; }
  COMMTUNE_HD int64_t code_bytes() const { return shard * bits() / 8; }
  COMMTUNE_HD int64_t piece_bytes() const { return code_bytes() + 4 * chunks_per_shard(); }
  // Where chunk c of shard s keeps its codes and its scale in a packed buffer.
  COMMTUNE_HD uint8_t* codes(uint8_t* packed, int64_t s, int64_t c) const {
    return packed + s * piece_bytes() + c * chunk * bits() / 8;
  }
  COMMTUNE_HD float* scale(uint8_t* packed, int64_t s, int64_t c) const {
    return reinterpret_cast<float*>(packed + s * piece_bytes() + code_bytes()) + c;
  }
};

// Encodes src (zeros past numel) into `packed` (uint8, ranks * piece_bytes). With `error`
// defined (may be src itself), error = src - decoded. With `accumulate` (error feedback: error is
// the error buffer, src the bucket), what is encoded is error + src, as error.add_(src) would
// leave it, in the same pass on CUDA, and error = that - decoded. `draws`: a seed for stochastic
// rounding, or -1 for rounding to nearest.
void quantize_shards_(const at::Tensor& src, const at::Tensor& error, const at::Tensor& packed,
                      const QuantizeLayout& layout, int64_t draws, bool accumulate = false);
// Decodes the `ranks` pieces of one shard in `received` (ranks * piece_bytes), sums them in
// rank order, divides by `divisor` and encodes the result into `piece` (piece_bytes).
void reduce_shard_(const at::Tensor& received, const at::Tensor& piece, const QuantizeLayout& layout,
                   int64_t divisor, int64_t draws);
// Decodes the gathered pieces (ranks * piece_bytes) into out's first numel elements.
void dequantize_shards_(const at::Tensor& packed, const at::Tensor& out, const QuantizeLayout& layout);

// "int8", "int4" or "e4m3" (the names Python uses), refusing others.
quant::Codes codes_named(const std::string& name);

#ifdef COMMTUNE_WITH_CUDA
void quantize_shards_cuda_(const at::Tensor& src, const at::Tensor& error, const at::Tensor& packed,
                           const QuantizeLayout& layout, int64_t draws, bool accumulate);
void reduce_shard_cuda_(const at::Tensor& received, const at::Tensor& piece, const QuantizeLayout& layout,
                        int64_t divisor, int64_t draws);
void dequantize_shards_cuda_(const at::Tensor& packed, const at::Tensor& out, const QuantizeLayout& layout);
#endif

} // namespace commtune
