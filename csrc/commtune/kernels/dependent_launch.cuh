#pragma once
// Programmatic dependent launch (compute capability 9.0 on): a kernel launched `dependent` may
// start while the kernel before it on the stream still runs, once that kernel's blocks have
// called allow_next_grid(). It does what needs nothing from that kernel (loads of data the
// kernel does not write, stores it does not read) and then calls wait_for_prior_grid(), which
// returns when the earlier kernel has finished and its writes are visible. This hides the launch
// gap (1-2 us on an H200) and lets loads be in flight while a one-block kernel runs.
// Where the device or the kernel's build cannot do it, launches are plain and both calls do
// nothing: a kernel run from sm_80 code on a newer GPU would not wait, so supported() asks.
// launch_cluster() launches thread block clusters (sm_90 on), for kernels whose blocks share
// shared memory.
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>

namespace commtune::dependent {

__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A value asked of the driver once per device (kept + 1, so that 0 means not yet asked).
class PerDevice {
 public:
  template <typename Ask>
  int get(int device, Ask ask) {
    if (device < 0 || device >= kDevices) return ask();
    int kept = values_[device].load(std::memory_order_relaxed);
    if (kept == 0) {
      kept = ask() + 1;
      values_[device].store(kept, std::memory_order_relaxed);
    }
    return kept - 1;
  }

 private:
  static constexpr int kDevices = 64;
  std::array<std::atomic<int>, kDevices> values_{};
};

// Whether kKernel, on `device`, runs code built for sm_90 or later (so its waits are compiled in).
template <auto kKernel>
bool supported(int device) {
  static PerDevice known;
  return known.get(device, [] {
    cudaFuncAttributes attributes{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(kKernel)));
    return attributes.ptxVersion >= 90 && attributes.binaryVersion >= 90 ? 1 : 0;
  }) == 1;
}

// How many blocks of kKernel (kThreads threads, `shared` bytes of dynamic shared memory, the
// same every call) the device runs at once; the first ask also lets kKernel have that much
// shared memory (above 48 KB it must be asked for).
template <auto kKernel, int kThreads>
int blocks_at_once(int device, int sms, int shared) {
  static PerDevice known;
  return known.get(device, [&] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kThreads, shared));
    return per_sm * sms;
  });
}

// kernel<<<grid, block, shared, stream>>>(args...) with the given launch attributes.
template <typename... Params, typename... Args>
void launch_with(cudaLaunchAttribute* attributes, int count, void (*kernel)(Params...), dim3 grid, dim3 block,
                 int shared, cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = count;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args...));
}

// kernel<<<grid, block, shared, stream>>>(args...), dependent on the kernel before it when asked.
template <typename... Params, typename... Args>
void launch(bool dependent, void (*kernel)(Params...), dim3 grid, dim3 block, int shared, cudaStream_t stream,
            Args... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  launch_with(&attribute, dependent ? 1 : 0, kernel, grid, block, shared, stream, args...);
}

// The same in clusters of `cluster` blocks (sm_90 on; at most 8 is portable), after all work
// queued before it.
template <typename... Params, typename... Args>
void launch_cluster(int cluster, void (*kernel)(Params...), dim3 grid, dim3 block, int shared, cudaStream_t stream,
                    Args... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  launch_with(&attribute, 1, kernel, grid, block, shared, stream, args...);
}

} // namespace commtune::dependent
