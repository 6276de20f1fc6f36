// CUDA kernels of the sign compression (checks and CPU loops in sign.cpp). Encoding: one warp
// per chunk of up to 1024 elements, its values in registers (one read of the bucket), or one
// block per larger chunk, where each warp turns 32 consecutive signs into a word with a ballot.
#include <commtune/kernels/four.cuh>
#include <commtune/kernels/fused_add.cuh>
#include <commtune/kernels/sign.h>

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

namespace commtune {
namespace {

constexpr int kThreads = 256;

__device__ double block_sum(double v) {
  __shared__ double partial[kThreads / 32];
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  double total = 0;
  for (int w = 0; w < kThreads / 32; ++w) total += partial[w];
  return total;
}

// With `accumulate` (error feedback's add fused in), what is encoded is error + src, and error
// becomes that minus its decoding.
template <typename scalar_t>
__global__ void sign_encode_kernel(const scalar_t* __restrict__ src, scalar_t* error, uint8_t* __restrict__ piece,
                                   SignLayout l, bool accumulate) {
  const int64_t c = blockIdx.x, first = c * l.chunk, last = min(first + l.chunk, l.numel);
  // each thread reads its own entries, and writes an entry of error only after its last read
  const auto value = [&](int64_t i) { return accumulate ? fused_sum(error[i], src[i]) : src[i]; };
  double part = 0;
  for (int64_t i = first + threadIdx.x; i < last; i += kThreads) part += fabs(static_cast<double>(value(i)));
  const float scale = static_cast<float>(block_sum(part) / static_cast<double>(last - first));
  uint32_t* bits = reinterpret_cast<uint32_t*>(piece);
  if (threadIdx.x == 0) reinterpret_cast<float*>(bits + l.words())[c] = scale;
  // Whole warps step through the chunk together, 32 elements at a time.
  for (int64_t i = first + threadIdx.x; i < first + l.chunk; i += kThreads) {
    const bool valid = i < l.numel;
    const float x = valid ? static_cast<float>(value(i)) : 0.0f;
    const uint32_t word = __ballot_sync(0xffffffffu, valid && x < 0.0f);
    if (threadIdx.x % 32 == 0) bits[i / 32] = word;
    if (error != nullptr && valid) {
      error[i] = static_cast<scalar_t>(quant::error_of(x, x < 0.0f ? -1.0f : 1.0f, scale));
    }
  }
}

using four::kMaxFours;
using four::kWarp;
using four::kWarpChunkLimit;

// A lane's i-th group is elements four::group_start(lane, i).. of the chunk, so lanes 8w..8w+7
// hold the 32 elements of the group's word w: their four sign bits each are OR-ed by shuffles.
template <typename scalar_t>
__global__ void sign_encode_warp_kernel(const scalar_t* __restrict__ src, scalar_t* error, uint8_t* __restrict__ piece,
                                        SignLayout l, bool vector, bool accumulate) {
  const int64_t c = four::warp_index();
  if (c >= l.chunks()) return;  // the whole warp: chunks are whole warps
  const int lane = threadIdx.x % kWarp;
  const int64_t first = c * l.chunk, count = min(l.chunk, l.numel - first);
  float v[kMaxFours][4];
  double part = 0;
#pragma unroll
  for (int i = 0; i < kMaxFours; ++i) {
    const int64_t j = four::group_start(lane, i);
    if (j < l.chunk) {
      four::load_sum(src, accumulate ? error : nullptr, first + j, l.numel, vector, v[i]);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) v[i][k] = 0.0f;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) part += fabs(static_cast<double>(v[i][k]));
  }
  for (int o = 16; o > 0; o /= 2) part += __shfl_xor_sync(0xffffffffu, part, o);
  const float scale = static_cast<float>(part / static_cast<double>(count));
  uint32_t* bits = reinterpret_cast<uint32_t*>(piece);
  if (lane == 0) reinterpret_cast<float*>(bits + l.words())[c] = scale;
#pragma unroll
  for (int i = 0; i < kMaxFours; ++i) {
    const int64_t j = four::group_start(lane, i);
    uint32_t word = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) word |= (v[i][k] < 0.0f ? 1u : 0u) << (4 * (lane % 8) + k);
    word |= __shfl_xor_sync(0xffffffffu, word, 1);
    word |= __shfl_xor_sync(0xffffffffu, word, 2);
    word |= __shfl_xor_sync(0xffffffffu, word, 4);
    if (j >= l.chunk) continue;
    if (lane % 8 == 0) bits[(first + j) / 32] = word;
    if (error != nullptr) {
      float rest[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) rest[k] = quant::error_of(v[i][k], v[i][k] < 0.0f ? -1.0f : 1.0f, scale);
      four::store(error, first + j, l.numel, vector, rest);
    }
  }
}

constexpr int kStride = kWarp + 1;  // a row per lane, padded: neither pass meets a bank conflict

// Stores a warp's 1024 results, staged as row l = lane l's word, so that each lane stores four
// consecutive ones at a time: the stores to `out` are whole lines.
template <typename scalar_t>
__device__ __forceinline__ void store_staged(const float* staged, int lane, int64_t warp_first, int64_t numel,
                                             scalar_t* __restrict__ out, bool vector) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t e = four::group_start(lane, i);  // of the warp's 1024: row e / 32, four from column e % 32
    float four_values[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) four_values[k] = staged[(e / 32) * kStride + e % 32 + k];
    if (warp_first + e < numel) four::store(out, warp_first + e, numel, vector, four_values);
  }
}

// Rank r's word `word` of signs and the scale of its chunk `chunk` from the gathered pieces
// (zeros where `here` is false).
__device__ __forceinline__ void load_rank(const uint8_t* __restrict__ gathered, int64_t r, int64_t piece_bytes,
                                          int64_t scales_at, int64_t word, int64_t chunk, bool here, uint32_t& bits,
                                          float& scale) {
  const uint8_t* piece = gathered + r * piece_bytes;
  bits = here ? __ldg(reinterpret_cast<const uint32_t*>(piece) + word) : 0u;
  scale = here ? __ldg(reinterpret_cast<const float*>(piece + scales_at) + chunk) : 0.0f;
}

// One thread per word of signs: lane l of a warp decodes word l of every rank, its 32 elements,
// in registers (one coalesced load of each rank's words, a broadcast load of its scale), then
// the warp stores its 1024 sums through store_staged. Ranks' loads are issued kRanksInFlight at
// a time, before any is used. The piece's size and where its scales start come from the host
// (SignLayout computes them with 64-bit divisions).
constexpr int kRanksInFlight = 4;

template <typename scalar_t>
__global__ void sign_decode_mean_kernel(const uint8_t* __restrict__ gathered, scalar_t* __restrict__ out,
                                        int64_t ranks, quant::Divisor divisor, int64_t numel, int64_t chunk_elements,
                                        int64_t piece_bytes, int64_t scales_at, bool vector) {
  __shared__ float staged[kThreads / kWarp][kWarp * kStride];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t word = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const bool mine = word * 32 < numel;
  const int64_t chunk = mine ? quant::quotient(word * 32, chunk_elements) : 0;
  float sum[32] = {};
  for (int64_t r0 = 0; r0 < ranks; r0 += kRanksInFlight) {
    uint32_t bits[kRanksInFlight];
    float scale[kRanksInFlight];
#pragma unroll
    for (int b = 0; b < kRanksInFlight; ++b) {
      load_rank(gathered, r0 + b, piece_bytes, scales_at, word, chunk, mine && r0 + b < ranks, bits[b], scale[b]);
    }
#pragma unroll
    for (int b = 0; b < kRanksInFlight; ++b) {
      if (r0 + b >= ranks) break;  // exactly `ranks` terms, as the CPU adds them
      const uint32_t magnitude = quant::float_bits(scale[b]);
#pragma unroll
      for (int k = 0; k < 32; ++k) {  // a set bit flips the scale's sign: -scale, as the CPU's
        const float decoded = quant::float_from_bits(magnitude ^ ((bits[b] << (31 - k)) & 0x80000000u));
        sum[k] = quant::add(sum[k], decoded);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < 32; ++k) staged[warp][lane * kStride + k] = divisor.apply(sum[k]);
  __syncwarp();
  store_staged(staged[warp], lane, (word - lane) * 32, numel, out, vector);
}

// ---- decoding by table: chunks of whole multiples of 1024 elements, up to 8 ranks ----------
// A warp's 1024 elements then share one scale per rank, so an element's sum depends only on its
// ranks' sign bits: the warp first adds up every pattern of signs, in rank order as the CPU does
// (the same bits), into a table in shared memory, and each element is one lookup (about a third
// of the instructions of adding the ranks per element). Lane l holds word l of every rank (all
// loads in flight at once); an 8 x 8 bit transpose turns byte j of the ranks' words into the
// patterns of elements 8j..8j+7.
constexpr int kTableRanks = 8;

// The 8 x 8 bit matrix whose row r is byte r of x (column c: bit c), transposed.
__device__ __forceinline__ uint64_t transpose8(uint64_t x) {
  uint64_t t = (x ^ (x >> 7)) & 0x00AA00AA00AA00AAull;
  x ^= t ^ (t << 7);
  t = (x ^ (x >> 14)) & 0x0000CCCC0000CCCCull;
  x ^= t ^ (t << 14);
  t = (x ^ (x >> 28)) & 0x00000000F0F0F0F0ull;
  return x ^ t ^ (t << 28);
}

template <typename scalar_t>
__global__ void sign_decode_table_kernel(const uint8_t* __restrict__ gathered, scalar_t* __restrict__ out, int ranks,
                                         quant::Divisor divisor, int64_t numel, int64_t chunk_elements,
                                         int64_t piece_bytes, int64_t scales_at, bool vector) {
  __shared__ float staged[kThreads / kWarp][kWarp * kStride];
  __shared__ float table[kThreads / kWarp][1 << kTableRanks];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t word = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t warp_first = (word - lane) * 32;
  if (warp_first >= numel) return;  // the whole warp
  // A piece holds whole chunks of words, so every word of a warp that starts before numel exists.
  const int64_t chunk = quant::quotient(warp_first, chunk_elements);
  uint32_t bits[kTableRanks];
  float scale[kTableRanks];
#pragma unroll
  for (int b = 0; b < kTableRanks; ++b) {
    load_rank(gathered, b, piece_bytes, scales_at, word, chunk, b < ranks, bits[b], scale[b]);
  }
  float* patterns = table[warp];
#pragma unroll
  for (int m = 0; m < (1 << kTableRanks) / kWarp; ++m) {
    const uint32_t pattern = lane + kWarp * m;  // bit b: rank b's sign (set: negative)
    float sum = 0.0f;
#pragma unroll
    for (int b = 0; b < kTableRanks; ++b) {
      if (b >= ranks) break;  // exactly `ranks` terms
      sum = quant::add(sum, quant::float_from_bits(quant::float_bits(scale[b]) ^ ((pattern >> b) & 1u) << 31));
    }
    patterns[pattern] = divisor.apply(sum);
  }
  __syncwarp();
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    // byte j of ranks 0..3 and 4..7 (the selector's other two bytes are never read)
    const uint32_t pick = j | (j + 4) << 4;
    const uint32_t low = __byte_perm(__byte_perm(bits[0], bits[1], pick), __byte_perm(bits[2], bits[3], pick), 0x5410);
    const uint32_t high = __byte_perm(__byte_perm(bits[4], bits[5], pick), __byte_perm(bits[6], bits[7], pick), 0x5410);
    const uint64_t signs = transpose8(static_cast<uint64_t>(high) << 32 | low);  // byte c: element 8j + c
#pragma unroll
    for (int c = 0; c < 8; ++c) staged[warp][lane * kStride + 8 * j + c] = patterns[(signs >> (8 * c)) & 0xFFu];
  }
  __syncwarp();
  store_staged(staged[warp], lane, warp_first, numel, out, vector);
}

} // namespace

void sign_encode_cuda_(const at::Tensor& src, const at::Tensor& error, const at::Tensor& piece, const SignLayout& layout,
                       bool accumulate) {
  if (layout.chunks() == 0) return;
  const c10::cuda::CUDAGuard guard(src.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "sign_encode", [&] {
    const scalar_t* in = src.const_data_ptr<scalar_t>();
    scalar_t* err = error.defined() ? error.mutable_data_ptr<scalar_t>() : nullptr;
    const auto stream = at::cuda::getCurrentCUDAStream();
    if (layout.chunk <= kWarpChunkLimit) {
      const int64_t blocks = four::warp_blocks(layout.chunks(), kThreads);
      sign_encode_warp_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(in, err, piece.mutable_data_ptr<uint8_t>(),
                                                                         layout, four::aligned<scalar_t>({in, err}),
                                                                         accumulate);
    } else {
      sign_encode_kernel<scalar_t><<<layout.chunks(), kThreads, 0, stream>>>(in, err, piece.mutable_data_ptr<uint8_t>(),
                                                                             layout, accumulate);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void sign_decode_mean_cuda_(const at::Tensor& gathered, const at::Tensor& out, int64_t ranks, const SignLayout& layout) {
  if (layout.numel == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "sign_decode_mean", [&] {
    const int64_t threads = (layout.numel + 31) / 32;  // one per word
    const int64_t blocks = (threads + kThreads - 1) / kThreads;
    const auto stream = at::cuda::getCurrentCUDAStream();
    const uint8_t* in = gathered.const_data_ptr<uint8_t>();
    scalar_t* dst = out.mutable_data_ptr<scalar_t>();
    const bool vector = four::aligned<scalar_t>({dst});
    if (layout.chunk % (kWarp * 32) == 0 && ranks <= kTableRanks) {
      sign_decode_table_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
          in, dst, static_cast<int>(ranks), quant::Divisor::of(ranks), layout.numel, layout.chunk,
          layout.piece_bytes(), 4 * layout.words(), vector);
    } else {
      sign_decode_mean_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(in, dst, ranks, quant::Divisor::of(ranks),
                                                                         layout.numel, layout.chunk,
                                                                         layout.piece_bytes(), 4 * layout.words(), vector);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

} // namespace commtune
