// Probe (standalone, no torch): how fast can a 100 MB fp32 bucket be streamed on one GPU while
// the entries with |x| >= t are written out, in index order, to per-tile slots? The question
// behind TopK's threshold selection (csrc/commtune/kernels/top_k_cuda.cu); the answers and the
// eleventh session's runs are in benchmarks/results/NOTES.md and topk_stream_probe_session11.txt.
//   nvcc -O3 -arch=sm_90 -std=c++17 -Icsrc -o /tmp/stream_probe benchmarks/probes/stream_probe.cu && /tmp/stream_probe
#include <commtune/kernels/quantize_rules.h>  // header-only: the counter hash the fill uses

#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
constexpr unsigned kFull = 0xffffffffu;

// x[i]: a normal draw (Box-Muller) from entry i's hash.
__global__ void fill_normal(float* x, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  uint64_t h = commtune::quant::mix(i + commtune::quant::kGolden);
  float u1 = ((h >> 40) + 1) * (1.0f / 16777217.0f), u2 = ((h & 0xFFFFFF)) * (1.0f / 16777216.0f);
  x[i] = sqrtf(-2.f * logf(u1)) * cospif(2.f * u2);
}

template <int U>
__global__ void read_sum(const float4* __restrict__ x, int64_t n4, float* out) {
  float acc = 0;
  int64_t stride = (int64_t)gridDim.x * blockDim.x;
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  for (; i + (U - 1) * stride < n4; i += U * stride) {
    float4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = x[i + u * stride];
#pragma unroll
    for (int u = 0; u < U; ++u) acc += v[u].x + v[u].y + v[u].z + v[u].w;
  }
  for (; i < n4; i += stride) { float4 a = x[i]; acc += a.x + a.y + a.z + a.w; }
  if (acc == 1234.5f) *out = acc;
}

// Non-persistent read: one tile of 4096 floats a block, as the eleventh session's streaming pass read
__global__ void __launch_bounds__(256, 8) read_tile(const float4* __restrict__ x, int64_t n4, float* out) {
  int64_t at = blockIdx.x * (int64_t)1024 + threadIdx.x;
  float4 v[4];
#pragma unroll
  for (int g = 0; g < 4; ++g) v[g] = at + 256 * g < n4 ? x[at + 256 * g] : make_float4(0, 0, 0, 0);
  float acc = 0;
#pragma unroll
  for (int g = 0; g < 4; ++g) acc += v[g].x + v[g].y + v[g].z + v[g].w;
  if (acc == 1234.5f) *out = acc;
}


__device__ __forceinline__ void store_keep(int2* p, int2 v) {
  asm volatile("{\n .reg .b64 pol;\n createpolicy.fractional.L2::evict_last.b64 pol, 1.0;\n st.global.L2::cache_hint.v2.s32 [%0], {%1, %2}, pol;\n}" :: "l"(p), "r"(v.x), "r"(v.y) : "memory");
}
// Warp tiles with one packed scan a tile: lane's count of group g in byte g (<= 4 a lane, <= 128 a warp).
// kMode 0: no candidate stores; 1: plain stores; 3: stores with an L2 evict-last hint. The
// candidates go to slots[0..capacity) (a tile's, or a shared-memory stage); returns the count.
template <int G, int kMode = 1>
__device__ __forceinline__ uint32_t warp_tile(int64_t numel, int2* slots, uint32_t* counts,
    float threshold, int capacity, int64_t tile, const float (&v)[G][4]) {
  const int lane = threadIdx.x % 32;
  const int64_t at = tile * (128 * G) + 4 * lane;
  uint32_t flags = 0; uint64_t packed = 0;
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int e = 0; e < 4; ++e) if (fabsf(v[g][e]) >= threshold && at + 128 * g + e < numel) flags |= 1u << (4 * g + e);
    packed |= (uint64_t)__popc((flags >> (4 * g)) & 15u) << (8 * g);
  }
  const bool any = __any_sync(kFull, flags != 0);
  uint64_t inc = packed, total = 0;
  if (any) {
#pragma unroll
    for (int o = 1; o < 32; o *= 2) { uint64_t other = __shfl_up_sync(kFull, inc, o); if (lane >= o) inc += other; }
    total = __shfl_sync(kFull, inc, 31);
  }
  uint32_t before = 0;
  const uint64_t exc = inc - packed;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    uint32_t slot = before + (uint32_t)(exc >> (8 * g) & 0xFF);
#pragma unroll
    for (int e = 0; e < 4; ++e) if (kMode && flags >> (4 * g + e) & 1u) { if (slot < (uint32_t)capacity) { const int2 c = make_int2(__float_as_int(v[g][e]), (int)(at + 128 * g + e)); if (kMode == 3) store_keep(slots + slot, c); else slots[slot] = c; } ++slot; }
    before += (uint32_t)(total >> (8 * g) & 0xFF);
  }
  if (lane == 0) counts[tile] = before;
  return before;
}
// A warp tile's entries, read once (evict-first loads).
template <int G>
__device__ __forceinline__ void load_tile(const float* __restrict__ x, int64_t numel, int64_t tile, float (&v)[G][4]) {
  const int64_t at = tile * (128 * G) + 4 * (threadIdx.x % 32);
#pragma unroll
  for (int g = 0; g < G; ++g) {
    int64_t a = at + 128 * g;
    if (a + 3 < numel) { float4 f = __ldcs(reinterpret_cast<const float4*>(x + a)); v[g][0]=f.x; v[g][1]=f.y; v[g][2]=f.z; v[g][3]=f.w; }
    else for (int e = 0; e < 4; ++e) v[g][e] = a + e < numel ? x[a + e] : 0.f;
  }
}
template <int G, int kMode = 1>
__global__ void __launch_bounds__(256) gather_warp2(const float* __restrict__ x, int64_t numel, int2* slots, uint32_t* counts, const float* thr, int capacity) {
  const int64_t tile = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32;
  if (tile * 128 * G >= numel) return;
  float v[G][4];
  load_tile<G>(x, numel, tile, v);
  warp_tile<G, kMode>(numel, slots + tile * capacity, counts, *thr, capacity, tile, v);
}
// Candidates staged in shared memory, then written by the warp in coalesced rows.
template <int G, bool kPad = false>
__global__ void __launch_bounds__(256) gather_staged(const float* __restrict__ x, int64_t numel, int2* slots_all, uint32_t* counts, const float* thr, int capacity) {
  __shared__ int2 stage[8][128];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t tile = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32;
  if (tile * 128 * G >= numel) return;
  float v[G][4];
  load_tile<G>(x, numel, tile, v);
  const uint32_t before = warp_tile<G>(numel, stage[warp], counts, *thr, 128, tile, v);
  __syncwarp();
  int2* slots = slots_all + tile * capacity;
  uint32_t n = min(before, (uint32_t)min(capacity, 128));
  if (kPad) { for (uint32_t j = n + lane; j < ((n + 3) & ~3u); j += 32) stage[warp][j] = make_int2(0, 0); __syncwarp(); n = (n + 3) & ~3u; }
  for (uint32_t j = lane; j < n; j += 32) slots[j] = stage[warp][j];
}

int main() {
  const int64_t n = 25000000; float* x; CK(cudaMalloc(&x, n * 4)); float* y; CK(cudaMalloc(&y, n * 4));
  fill_normal<<<(n + 255) / 256, 256>>>(x, n); CK(cudaDeviceSynchronize());
  float *thr, *out; CK(cudaMalloc(&thr, 8)); CK(cudaMalloc(&out, 8));
  int2* slots; CK(cudaMalloc(&slots, 64 << 20)); uint32_t* counts; CK(cudaMalloc(&counts, (2 << 20) * 4));
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  auto time = [&](const char* name, auto f, double bytes) {
    for (int i = 0; i < 5; ++i) f();
    std::vector<float> ms;
    for (int r = 0; r < 30; ++r) { cudaEventRecord(a); for (int i = 0; i < 10; ++i) f(); cudaEventRecord(b); cudaEventSynchronize(b); float m; cudaEventElapsedTime(&m, a, b); ms.push_back(m * 100); }
    CK(cudaGetLastError());
    std::sort(ms.begin(), ms.end());
    printf("%-48s median %7.2f us  min %7.2f us  %6.0f GB/s\n", name, ms[15], ms[0], bytes / (ms[15] * 1e3));
  };
  time("memcpy D2D 100MB (200MB traffic)", [&] { cudaMemcpyAsync(y, x, n * 4, cudaMemcpyDeviceToDevice); }, 2.0 * n * 4);
  for (int occ : {4, 8, 16}) {
    char nm[64]; snprintf(nm, 64, "read_sum<4> grid %d x SMs", occ);
    time(nm, [&] { read_sum<4><<<sms * occ, 256>>>((const float4*)x, n / 4, out); }, 4.0 * n);
  }
  time("read_sum<8> grid 8 x SMs", [&] { read_sum<8><<<sms * 8, 256>>>((const float4*)x, n / 4, out); }, 4.0 * n);
  time("read_tile (one 16KB tile a block)", [&] { read_tile<<<(n / 4 + 1023) / 1024, 256>>>((const float4*)x, n / 4, out); }, 4.0 * n);
  // no candidates, 1% (the threshold at ratio 0.01 of a normal bucket) and 2% of the entries
  for (float t : {1e30f, 2.5758f, 2.3263f}) {
    CK(cudaMemcpy(thr, &t, 4, cudaMemcpyHostToDevice));
    const double r = t > 1e20f ? 0.0 : t > 2.4f ? 0.01 : 0.02;
    char nm[96];
    auto cap_of = [&](int tilesz) { int e = (int)(tilesz * r); return (2 * e + 32 + 31) / 32 * 32; };
    const int grid4 = (n / 512 * 32 + 255) / 256 + 1;
    snprintf(nm, 96, "warp2 (512/warp) t=%.3f", t);
    time(nm, [&] { gather_warp2<4><<<grid4, 256>>>(x, n, slots, counts, thr, cap_of(512)); }, 4.0 * n);
    snprintf(nm, 96, "warp2, no candidate stores t=%.3f", t);
    time(nm, [&] { gather_warp2<4, 0><<<grid4, 256>>>(x, n, slots, counts, thr, cap_of(512)); }, 4.0 * n);
    snprintf(nm, 96, "warp2, stores evict_last t=%.3f", t);
    time(nm, [&] { gather_warp2<4, 3><<<grid4, 256>>>(x, n, slots, counts, thr, cap_of(512)); }, 4.0 * n);
    snprintf(nm, 96, "staged in shared memory t=%.3f", t);
    time(nm, [&] { gather_staged<4><<<grid4, 256>>>(x, n, slots, counts, thr, cap_of(512)); }, 4.0 * n);
    snprintf(nm, 96, "staged, padded to whole sectors t=%.3f", t);
    time(nm, [&] { gather_staged<4, true><<<grid4, 256>>>(x, n, slots, counts, thr, cap_of(512)); }, 4.0 * n);
  }
  return 0;
}
