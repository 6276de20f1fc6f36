// Probe (standalone, no torch): how RandomK's take (read a 100 MB fp32 bucket for an Inf or a NaN,
// gather its k = numel/100 stratified draws, clear them: error feedback) should cut its work into
// blocks to get close to a read-only stream. Variants differ in the slice a block owns, the 16-byte
// loads a thread has in flight, the blocks an SM must hold (launch bounds) and whether the last
// block's ticket (which marks values[0] on an overflow) is kept; some leave out parts of take
// (the clearing, or the draws) to price them, and persistent blocks (one wave, each taking
// several slices) ask L2 for their next slice as they start one. Each variant is checked against
// the draw computed on the host before it is timed. Results: benchmarks/results/NOTES.md.
//   nvcc -O3 -arch=sm_90 -std=c++20 --expt-relaxed-constexpr -Icsrc -o /tmp/rtp benchmarks/probes/randomk_take_probe.cu && /tmp/rtp
#include <commtune/kernels/random_k_draw.h>  // header-only: the stratified draw

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e = (x);                                                               \
    if (e != cudaSuccess) {                                                            \
      printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));                 \
      exit(1);                                                                         \
    }                                                                                  \
  } while (0)

using commtune::random_k_position;

// Not inlined (as in random_k_cuda.cu): the 64-bit divisions would take registers from the stream.
__device__ __noinline__ int64_t first_draw_at_or_after(int64_t i, uint64_t seed, int64_t numel, int64_t k) {
  return commtune::random_k_first_at_or_after(i, seed, numel, k);
}
__device__ __noinline__ int64_t draw_position(uint64_t seed, int64_t s, int64_t numel, int64_t k) {
  return random_k_position(seed, s, numel, k);
}

constexpr int kThreads = 256;

__global__ void fill(float* x, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) x[i] = static_cast<float>(commtune::quant::mix(static_cast<uint64_t>(i)) >> 40) * 0x1p-24f - 0.5f;
}

__device__ __forceinline__ bool bad(float4 v) { return !(isfinite(v.x) && isfinite(v.y) && isfinite(v.z) && isfinite(v.w)); }

// What a variant does with its draws: all of take, only gather them (no clearing), or nothing
// (the scan and the ticket alone): the parts' costs.
enum class Draws { gather_and_clear, gather, none };

// One slice's part of take: the scan (G packs a thread in flight), its draws, and with an Inf or
// a NaN a second pass. Returns whether the slice held one.
template <int kSlice, int G, Draws kDraws>
__device__ __forceinline__ bool take_slice(float* x, int64_t slice, int64_t numel, uint64_t seed, float* values,
                                           int64_t k, int64_t* draws) {
  const int64_t lo = slice * kSlice, hi = min(numel, lo + kSlice);
  const float4* packs = reinterpret_cast<const float4*>(x + lo);
  const int n = static_cast<int>(hi - lo) / 4;
  bool found = false;
  for (int p = threadIdx.x; p < n; p += G * kThreads) {
    float4 v[G];
#pragma unroll
    for (int u = 0; u < G; ++u) v[u] = p + u * kThreads < n ? packs[p + u * kThreads] : make_float4(0, 0, 0, 0);
    if (kDraws != Draws::none && p == threadIdx.x && threadIdx.x < 2) draws[threadIdx.x] = first_draw_at_or_after(threadIdx.x == 0 ? lo : hi, seed, numel, k);
#pragma unroll
    for (int u = 0; u < G; ++u) found |= bad(v[u]);
  }
  if (kDraws != Draws::none) {
    __syncthreads();
    for (int64_t s = draws[0] + threadIdx.x; s < draws[1]; s += kThreads) {
      const int64_t at = draw_position(seed, s, numel, k);
      values[s] = x[at];
      if (kDraws == Draws::gather_and_clear) x[at] = 0.0f;
    }
  }
  found = __syncthreads_or(found);  // also: draws[] is free for the next slice
  if (found) {
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) if (!isfinite(x[i])) x[i] = 0.0f;
  }
  return found;
}

// Thread 0 of each block: its ticket; the last block marks values[0] if any block found an Inf or
// a NaN. kSelfReset: the ticket wraps to 0 at the last block (atomicInc) and the last block clears
// the flag, so the state stays zeroed between calls and no memset goes before each.
template <bool kSelfReset>
__device__ __forceinline__ void last_block_marks(bool found, uint32_t* state, float* values) {
  if (found) atomicOr(state, 1u);
  __threadfence();
  const uint32_t ticket = kSelfReset ? atomicInc(state + 1, gridDim.x - 1) : atomicAdd(state + 1, 1u);
  if (ticket != gridDim.x - 1) return;
  __threadfence();
  if ((kSelfReset ? atomicExch(state, 0u) : atomicOr(state, 0u)) != 0u) values[0] = __int_as_float(0x7FC00000);
}

// A block owns kSlice entries (numel % 4 == 0 and x 16-byte aligned here: the landed kernel also
// walks unaligned heads and tails), its threads read them G packs at a time.
template <int kSlice, int kMinBlocks, int G, bool kTicket, bool kSelfReset = false,
          Draws kDraws = Draws::gather_and_clear>
__global__ void __launch_bounds__(kThreads, kMinBlocks) take(float* x, int64_t numel, uint64_t seed, float* values,
                                                              int64_t k, uint32_t* state) {
  __shared__ int64_t draws[2];
  const bool found = take_slice<kSlice, G, kDraws>(x, blockIdx.x, numel, seed, values, k, draws);
  if (!kTicket || threadIdx.x != 0) {
    if (found && threadIdx.x == 0) atomicOr(state, 1u);
    return;
  }
  last_block_marks<kSelfReset>(found, state, values);
}

// Persistent blocks (a wave: kMinBlocks an SM), each taking slices blockIdx.x, + gridDim.x, ...:
// as it starts a slice, warp 0 asks L2 for its next one (1 KB a lane, bulk prefetch), so memory
// stays busy while the block gathers, clears and syncs; one ticket a block, not a slice.
template <int kSlice, int kMinBlocks, int G>
__global__ void __launch_bounds__(kThreads, kMinBlocks) take_persistent(float* x, int64_t numel, uint64_t seed,
                                                                         float* values, int64_t k, uint32_t* state) {
  __shared__ int64_t draws[2];
  const int64_t slices = (numel + kSlice - 1) / kSlice;
  bool found = false;
  for (int64_t slice = blockIdx.x; slice < slices; slice += gridDim.x) {
    const int64_t next = slice + gridDim.x;
    constexpr int kPiece = kSlice * 4 / 32;  // bytes a lane of warp 0 prefetches
    if (threadIdx.x < 32 && (next + 1) * kSlice <= numel) {
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(x + next * kSlice + threadIdx.x * (kPiece / 4)),
                   "r"(kPiece) : "memory");
    }
    found |= take_slice<kSlice, G, Draws::gather_and_clear>(x, slice, numel, seed, values, k, draws);
  }
  if (threadIdx.x == 0) last_block_marks<true>(found, state, values);
}

// A read-only stream of the bucket, one 16 KB tile a block (stream_probe.cu's fastest read).
__global__ void __launch_bounds__(kThreads, 8) read_tile(const float4* __restrict__ x, int64_t n4, float* out) {
  const int64_t at = blockIdx.x * static_cast<int64_t>(1024) + threadIdx.x;
  float4 v[4];
#pragma unroll
  for (int g = 0; g < 4; ++g) v[g] = at + 256 * g < n4 ? x[at + 256 * g] : make_float4(0, 0, 0, 0);
  bool any = false;
#pragma unroll
  for (int g = 0; g < 4; ++g) any |= bad(v[g]);
  if (any) *out = 1.0f;
}

int main() {
  const int64_t numel = 25'000'000, k = numel / 100;
  const uint64_t seed = 0x9E3779B97F4A7C15ull ^ 2026;
  float *x, *values, *out;
  uint32_t* state;
  CK(cudaMalloc(&x, numel * 4));
  CK(cudaMalloc(&out, numel * 4));
  CK(cudaMalloc(&values, k * 4));
  CK(cudaMalloc(&state, 8));
  std::vector<float> host(numel), got(k), cleared(numel);
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  auto refill = [&] {
    fill<<<(numel + 255) / 256, 256>>>(x, numel);
    CK(cudaDeviceSynchronize());
  };
  refill();
  CK(cudaMemcpy(host.data(), x, numel * 4, cudaMemcpyDeviceToHost));
  // Median over 30 samples of 10 back-to-back calls, in µs a call.
  auto time = [&](const char* name, auto&& call, double bytes) {
    for (int i = 0; i < 5; ++i) call();
    std::vector<float> ms;
    for (int r = 0; r < 30; ++r) {
      CK(cudaEventRecord(a));
      for (int i = 0; i < 10; ++i) call();
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      float t;
      CK(cudaEventElapsedTime(&t, a, b));
      ms.push_back(t / 10);
    }
    std::sort(ms.begin(), ms.end());
    const double us = 1e3 * ms[15];
    printf("%-58s %8.2f us  %7.0f GB/s\n", name, us, bytes / us / 1e3);
    return us;
  };
  const double copy_us = time("memcpy D2D 100 MB (200 MB moved)", [&] { CK(cudaMemcpyAsync(out, x, numel * 4, cudaMemcpyDeviceToDevice)); }, 8.0 * numel);
  time("read-only stream, a 16 KB tile a block", [&] { read_tile<<<(numel / 4 + 1023) / 1024, kThreads>>>((const float4*)x, numel / 4, out); }, 4.0 * numel);
  const double take_bytes = 4.0 * numel + 8.0 * k;  // compression.py's count: the bucket read, k values out, k clears
  printf("take's bar (80%% of the copy's bandwidth on %.0f bytes): %.2f us\n", take_bytes, copy_us * take_bytes / (8.0 * numel) / 0.8);
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  // checks: 2 values and clearing, 1 values only, 0 nothing (a variant that skips the draws);
  // persistent: one wave of blocks rather than one a slice.
  auto variant = [&](const char* name, auto kernel, int slice, bool memset = true, int checks = 2,
                     bool persistent = false) {
    cudaFuncAttributes attr;
    CK(cudaFuncGetAttributes(&attr, kernel));
    int resident = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kThreads, 0));
    const unsigned blocks = persistent ? static_cast<unsigned>(resident * sms)
                                       : static_cast<unsigned>((numel + slice - 1) / slice);
    CK(cudaMemset(state, 0, 8));
    auto call = [&] {
      if (memset) CK(cudaMemsetAsync(state, 0, 8));
      kernel<<<blocks, kThreads>>>(x, numel, seed, values, k, state);
    };
    refill();
    call();
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(got.data(), values, k * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(cleared.data(), x, numel * 4, cudaMemcpyDeviceToHost));
    int64_t wrong = 0, last = -1;
    for (int64_t s = 0; s < k; ++s) {
      const int64_t at = random_k_position(seed, s, numel, k);
      wrong += (checks >= 1 && got[s] != host[at]) || (checks >= 2 && cleared[at] != 0.0f) || at <= last;
      last = at;
    }
    char label[160];
    snprintf(label, sizeof label, "%s (%d regs, %d blocks/SM)%s", name, attr.numRegs, resident, wrong ? " WRONG" : "");
    const double us = time(label, call, take_bytes);
    printf("    %.1f%% of the copy's bandwidth\n", 100.0 * (take_bytes / us) / (8.0 * numel / copy_us));
  };
  variant("slice 16384, 4 in flight (the landed cut)", take<16384, 1, 4, true>, 16384);
  variant("slice 16384, 8 in flight", take<16384, 1, 8, true>, 16384);
  variant("slice 8192, 8 in flight, 4 blocks/SM", take<8192, 4, 8, true>, 8192);
  variant("slice 4096, 4 in flight", take<4096, 1, 4, true>, 4096);
  variant("slice 4096, 4 in flight, 6 blocks/SM", take<4096, 6, 4, true>, 4096);
  variant("slice 4096, 4 in flight, 8 blocks/SM", take<4096, 8, 4, true>, 4096);
  variant("slice 4096, 4 in flight, 8 blocks/SM, no ticket", take<4096, 8, 4, false>, 4096);
  variant("slice 16384, 4 in flight, no ticket", take<16384, 1, 4, false>, 16384);
  variant("slice 2048, 2 in flight, 8 blocks/SM", take<2048, 8, 2, true>, 2048);
  variant("slice 16384, 4 in flight, state reset by its last block", take<16384, 1, 4, true, true>, 16384, false);
  variant("slice 4096, 4 in flight, 6 blocks/SM, state reset by its last block", take<4096, 6, 4, true, true>, 4096, false);
  variant("slice 4096, 4 in flight, 8 blocks/SM, state reset by its last block", take<4096, 8, 4, true, true>, 4096, false);
  // The thirtieth session's additions: the parts of the landed cut, and persistent blocks.
  variant("slice 16384, 4 in flight, gather, no clearing", take<16384, 1, 4, true, true, Draws::gather>, 16384, false, 1);
  variant("slice 16384, 4 in flight, no draws (scan and ticket)", take<16384, 1, 4, true, true, Draws::none>, 16384, false, 0);
  variant("slice 16384, 4 in flight, no draws, no ticket", take<16384, 1, 4, false, false, Draws::none>, 16384, false, 0);
  variant("persistent, slice 8192, 8 in flight, next slice prefetched", take_persistent<8192, 1, 8>, 8192, false, 2, true);
  variant("persistent, slice 8192, 8 in flight, 4 blocks/SM, prefetched", take_persistent<8192, 4, 8>, 8192, false, 2, true);
  variant("persistent, slice 16384, 4 in flight, next slice prefetched", take_persistent<16384, 1, 4>, 16384, false, 2, true);
  variant("persistent, slice 4096, 4 in flight, 6 blocks/SM, prefetched", take_persistent<4096, 6, 4>, 4096, false, 2, true);
  return 0;
}
