// CUDA side of top_k_place_ (checks and the CPU loop in top_k.cpp): TopK's decompression as one
// dense write of the bucket, by one kernel. The bucket is cut into tiles of kTile entries; a block
// (one warp) takes a run of consecutive tiles and, for each, sums the ranks' entries of the tile
// in shared memory, rank after rank, then writes the tile's means whole in 16-byte stores.
// A piece's picks come in ascending index order, so a block walks each piece forward: a rank's
// entries of a tile are the piece's next slots whose indices lie below the tile's end. While it
// adds one tile's slots and writes the tile, the next tile's slots are already loading.
// Where its walks begin and must end, a block finds by a 32-way search of each piece, so no pass
// over the pieces runs before it (the earlier version had one: a kernel of its own, ~13 us of a
// 59 us call). The piece contract (picks ascending inside the bucket, then unused slots: value 0
// at index 0) is asserted on the way: every slot a walk takes against the slot before it; every
// walk ends where the next block's begins, and the first begins at slot 0; the slots after the
// last pick (the tail) are checked by all blocks together.
#include <commtune/kernels/pack.cuh>
#include <commtune/kernels/quantize_rules.h>
#include <commtune/kernels/top_k.h>

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#ifndef CUDA_KERNEL_ASSERT_MSG  // torch releases before the message form
#define CUDA_KERNEL_ASSERT_MSG(cond, msg) CUDA_KERNEL_ASSERT(cond)
#endif

namespace commtune {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kTileShift = 12;
constexpr int64_t kTile = int64_t{1} << kTileShift;  // entries a tile: 16 KB of float sums
constexpr int kRanks = 8;         // ranks a block walks at once: their slots load together
constexpr int kSlotsPerLane = 2;  // a rank's slots a lane holds: 64 a warp (1% of a tile is 41)
constexpr int kBatch = 32 * kSlotsPerLane;
constexpr int32_t kNoPick = INT32_MAX;  // the key of an unused slot, and of slots past the piece
constexpr int64_t kWalksAtMost = int64_t{1} << 22;  // blocks x ranks: bounds the scratch (32 MB)

constexpr const char* kOutside = "TopK: a piece's index lies outside the bucket";
constexpr const char* kOutOfOrder =
    "TopK: a piece's picks are out of order (picks come in ascending index order, then unused slots: value 0 at "
    "index 0)";

// The sum and the mean rounded as the CPU rounds them, subnormals kept: the build's
// --use_fast_math flushes them in a + b, __fadd_rn and the like (.ftz).
__device__ __forceinline__ float add_keeping_subnormals(float a, float b) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float mean_keeping_subnormals(float sum, const quant::Divisor& divisor) {
  float r;
  if (divisor.inverse != 0.0f) {
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(sum), "f"(divisor.inverse));
  } else {
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(sum), "f"(divisor.n));
  }
  return r;
}

// Rank r's piece: k values (float32 bits), then k indices.
struct Piece {
  const int32_t* values;
  const int32_t* indices;
};

__device__ __forceinline__ Piece piece_of(const int32_t* gathered, int64_t k, int r) {
  const int32_t* at = gathered + 2 * k * r;
  return {at, at + k};
}

// What a walk compares: a pick's index; kNoPick for an unused slot (a slot after the first at
// index 0), a slot past the piece, or a rank past the last.
__device__ __forceinline__ int32_t key_at(const Piece& piece, int64_t k, int64_t j, bool rank) {
  if (!rank || j >= k) return kNoPick;
  const int32_t index = piece.indices[j];
  return j == 0 || index != 0 ? index : kNoPick;
}

// A rank's slots that a warp holds: slot cursor + 32 p + lane in key[p], value[p].
struct Batch {
  int32_t key[kSlotsPerLane];
  float value[kSlotsPerLane];

  __device__ __forceinline__ void load(const Piece& piece, int64_t k, int64_t cursor, bool rank, int lane) {
#pragma unroll
    for (int p = 0; p < kSlotsPerLane; ++p) {
      const int64_t j = cursor + 32 * p + lane;
      key[p] = key_at(piece, k, j, rank);
      value[p] = rank && j < k ? __int_as_float(piece.values[j]) : 0.0f;
    }
  }

  // Adds the slots whose keys lie below the tile's end (a prefix of the batch: the keys ascend,
  // asserted) to the tile's sums and returns how many. previous: the key of the slot before the
  // batch, lo - 1 at the tile's first; a slot taken must lie above the slot before it.
  __device__ __forceinline__ int take(float* sums, int32_t lo, int32_t hi, int32_t previous, int lane) const {
    int taken = 0;
#pragma unroll
    for (int p = 0; p < kSlotsPerLane; ++p) {
      int32_t before = __shfl_up_sync(kFull, key[p], 1);
      const int32_t last_row = __shfl_sync(kFull, key[p > 0 ? p - 1 : 0], 31);  // (p is known: unrolled)
      if (lane == 0) before = p > 0 ? last_row : previous;
      const bool in_tile = key[p] < hi;
      if (in_tile) {
        CUDA_KERNEL_ASSERT_MSG(key[p] >= 0, kOutside);
        CUDA_KERNEL_ASSERT_MSG(key[p] > before, kOutOfOrder);
        if (key[p] >= lo) sums[key[p] - lo] = add_keeping_subnormals(sums[key[p] - lo], value[p]);
      }
      taken += __popc(__ballot_sync(kFull, in_tile));
    }
    return taken;
  }
};

// For each rank g0 + g of a group and each bound: the first slot of the rank's piece whose key is
// at or above the bound (k if none). A 32-way search: each lane probes the last slot of its 32nd
// of the range left; every group's searches run at once. The top steps probe the same slots in
// every block, which L2 then holds.
template <int kBounds>
__device__ void first_slots_at_or_above(const int32_t* gathered, int64_t k, int ranks, int g0,
                                        const int32_t (&bound)[kBounds], int64_t (&slot)[kBounds][kRanks], int lane) {
  int64_t stride = 1;
  while (stride * 32 < k) stride *= 32;
#pragma unroll
  for (int q = 0; q < kBounds; ++q) {
#pragma unroll
    for (int g = 0; g < kRanks; ++g) slot[q][g] = 0;
  }
  for (; stride >= 1; stride /= 32) {
    int32_t key[kBounds][kRanks];
#pragma unroll
    for (int q = 0; q < kBounds; ++q) {
#pragma unroll
      for (int g = 0; g < kRanks; ++g) {
        key[q][g] = key_at(piece_of(gathered, k, g0 + g), k, slot[q][g] + (lane + 1) * stride - 1, g0 + g < ranks);
      }
    }
#pragma unroll
    for (int q = 0; q < kBounds; ++q) {
#pragma unroll
      for (int g = 0; g < kRanks; ++g) {
        const unsigned above = __ballot_sync(kFull, key[q][g] >= bound[q]);
        slot[q][g] = min(slot[q][g] + (above != 0 ? __ffs(above) - 1 : 32) * stride, k);
      }
    }
  }
}

// One block: tiles [first_tile, end_tile). walks: this block's where-the-walk-stands and
// where-it-must-end of each rank (used between tiles when ranks > kRanks, and for the last check).
template <typename scalar_t>
__global__ void __launch_bounds__(32) place_kernel(const int32_t* gathered, int64_t k, int ranks, int64_t numel,
                                                   int64_t tiles, scalar_t* out, quant::Divisor divisor,
                                                   int32_t* walks) {
  __shared__ float4 sums4[kTile / 4];
  float* sums = reinterpret_cast<float*>(sums4);
  const int lane = static_cast<int>(threadIdx.x);
  const int64_t first_tile = tiles * blockIdx.x / gridDim.x, end_tile = tiles * (blockIdx.x + 1) / gridDim.x;
  for (int i = lane; i < kTile / 4; i += 32) sums4[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  int32_t* cursor = walks + 2 * static_cast<int64_t>(ranks) * blockIdx.x;  // then the ends: cursor + ranks

  // 1. Where each walk begins (the first slot at or above the block's first entry) and must end
  // (the next block's begin); the slots from the first at or above numel on are the tail.
  const int32_t bounds[3] = {static_cast<int32_t>(first_tile << kTileShift),
                             static_cast<int32_t>(min(end_tile << kTileShift, numel)), static_cast<int32_t>(numel)};
  int64_t at[kRanks];  // where the walks of the group in hand stand
  for (int g0 = 0; g0 < ranks; g0 += kRanks) {
    int64_t slot[3][kRanks];
    first_slots_at_or_above(gathered, k, ranks, g0, bounds, slot, lane);
#pragma unroll
    for (int g = 0; g < kRanks; ++g) {
      const int r = g0 + g;
      if (r >= ranks) break;
      at[g] = slot[0][g];
      if (lane == g) {
        cursor[r] = static_cast<int32_t>(slot[0][g]);
        cursor[ranks + r] = static_cast<int32_t>(slot[1][g]);
      }
      CUDA_KERNEL_ASSERT_MSG(blockIdx.x > 0 || slot[0][g] == 0, kOutOfOrder);
      // The tail: unused slots only (a pick there lies outside the bucket, or after an unused slot).
      const Piece piece = piece_of(gathered, k, r);
      for (int64_t j = slot[2][g] + 32 * static_cast<int64_t>(blockIdx.x) + lane; j < k; j += 32 * int64_t{gridDim.x}) {
        const int32_t index = piece.indices[j];
        CUDA_KERNEL_ASSERT_MSG(j > 0 && index == 0 || index >= 0 && index < numel, kOutside);
        CUDA_KERNEL_ASSERT_MSG(j > 0 && index == 0, kOutOfOrder);
        CUDA_KERNEL_ASSERT_MSG(__int_as_float(piece.values[j]) == 0.0f,
                               "TopK: a piece's unused slot (index 0 after slot 0) holds a value");
      }
    }
  }
  if (ranks > kRanks) {  // the first group's walks, from where its search left them
    __syncwarp();
#pragma unroll
    for (int g = 0; g < kRanks; ++g) at[g] = cursor[g];
  }

  // 2. The walks, (tile, group of ranks) after (tile, group): the next pair's slots load while
  // this pair's are added and the tile is written.
  Batch batch[kRanks];
#pragma unroll
  for (int g = 0; g < kRanks; ++g) batch[g].load(piece_of(gathered, k, g), k, at[g], g < ranks, lane);
  for (int64_t t = first_tile; t < end_tile; ++t) {
    const int32_t lo = static_cast<int32_t>(t << kTileShift), hi = static_cast<int32_t>(min(lo + kTile, numel));
    for (int g0 = 0; g0 < ranks; g0 += kRanks) {
#pragma unroll
      for (int g = 0; g < kRanks; ++g) {
        __syncwarp();  // the rank before's sums are in
        int taken = batch[g].take(sums, lo, hi, lo - 1, lane);
        at[g] += taken;
        // More of this rank's slots in the tile than a batch holds (ratios above ~1.5%).
        while (taken == kBatch) {
          const int32_t previous = __shfl_sync(kFull, batch[g].key[kSlotsPerLane - 1], 31);
          batch[g].load(piece_of(gathered, k, g0 + g), k, at[g], g0 + g < ranks, lane);
          taken = batch[g].take(sums, lo, hi, previous, lane);
          at[g] += taken;
        }
      }
      const int next = g0 + kRanks < ranks ? g0 + kRanks : 0;
      if (ranks > kRanks) {  // the walks move to the next group's
#pragma unroll
        for (int g = 0; g < kRanks; ++g) {
          if (lane == g && g0 + g < ranks) cursor[g0 + g] = static_cast<int32_t>(at[g]);
        }
        __syncwarp();
#pragma unroll
        for (int g = 0; g < kRanks; ++g) at[g] = next + g < ranks ? cursor[next + g] : 0;
      }
      if (next == 0 && t + 1 == end_tile) continue;  // nothing left to load
#pragma unroll
      for (int g = 0; g < kRanks; ++g) batch[g].load(piece_of(gathered, k, next + g), k, at[g], next + g < ranks, lane);
    }
    // The tile's means, each sum cleared for the next tile as it is read.
    __syncwarp();
    auto mean = [&](int64_t i) {
      const float sum = sums[i];
      sums[i] = 0.0f;
      return static_cast<scalar_t>(mean_keeping_subnormals(sum, divisor));
    };
    const PackedSpan span = packed_span(out, lo, hi);
    for (int64_t i = lo + lane; i < span.packs; i += 32) out[i] = mean(i - lo);
    for (int64_t i = span.tail + lane; i < hi; i += 32) out[i] = mean(i - lo);
    auto* packs = reinterpret_cast<Pack<scalar_t>*>(out + span.packs);
    const int64_t first = span.packs - lo;
    for (int64_t p = lane; p < (span.tail - span.packs) / Pack<scalar_t>::kCount; p += 32) {
      Pack<scalar_t> v;
#pragma unroll
      for (int e = 0; e < Pack<scalar_t>::kCount; ++e) v.v[e] = mean(first + p * Pack<scalar_t>::kCount + e);
      packs[p] = v;
    }
  }

  // 3. Every walk ends where the next block's begins: together the walks took every slot before
  // the tail, each once.
  if (ranks > kRanks) {
    __syncwarp();
    for (int r = lane; r < ranks; r += 32) CUDA_KERNEL_ASSERT_MSG(cursor[r] == cursor[ranks + r], kOutOfOrder);
  } else {
#pragma unroll
    for (int g = 0; g < kRanks; ++g) {
      if (lane == g && g < ranks) CUDA_KERNEL_ASSERT_MSG(at[g] == cursor[ranks + g], kOutOfOrder);
    }
  }
}

}  // namespace

void top_k_place_cuda_(const at::Tensor& gathered, const at::Tensor& out, int64_t ranks) {
  const c10::cuda::CUDAGuard guard(out.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t numel = out.numel(), k = gathered.numel() / (2 * ranks), tiles = (numel + kTile - 1) / kTile;
  TORCH_CHECK(k < (int64_t{1} << 31) && ranks <= INT32_MAX, "TopK: pieces of ", std::to_string(k), " slots from ",
              std::to_string(ranks), " ranks are more than the CUDA pass indexes (2^31 - 1 slots and ranks)");
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "top_k_place", [&] {
    constexpr auto kernel = place_kernel<scalar_t>;
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 32, 0));
    // One wave of blocks, each at least a tile, and no more walks than the scratch bounds.
    const int64_t blocks = std::max<int64_t>(
        1, std::min({tiles, int64_t{std::max(per_sm, 1)} * sms, std::max<int64_t>(sms, kWalksAtMost / ranks)}));
    at::Tensor walks = at::empty({2 * ranks * blocks}, gathered.options());
    kernel<<<static_cast<unsigned int>(blocks), 32, 0, stream>>>(
        gathered.const_data_ptr<int32_t>(), k, static_cast<int>(ranks), numel, tiles, out.mutable_data_ptr<scalar_t>(),
        quant::Divisor::of(ranks), walks.mutable_data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

} // namespace commtune
