// Launching row-wise kernels: the row layout of 2-D/3-D tensors with strided rows, programmatic
// dependent launch (PDL) on sm90+, and what launchers ask of a device (read once per device).
//
// PDL lets a kernel start while the previous kernel in the stream finishes: the launch carries
// cudaLaunchAttributeProgrammaticStreamSerialization, and the kernel calls WaitForPriorGrids()
// before it reads what earlier kernels wrote and AllowDependentGrids() once the next kernel may
// start its own preamble. Below sm90 both are no-ops and the attribute is never set.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <utility>

namespace aotinfer {

__device__ __forceinline__ void WaitForPriorGrids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void AllowDependentGrids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Rows of a tensor viewed as [outer, inner, hidden] with the hidden dimension contiguous:
// a 2-D [rows, hidden] tensor has inner = 1; a 3-D one [a, b, hidden] has inner = b. Strides are
// in elements, so a slice of a wider tensor is read in place.
struct RowLayout {
  int64_t inner = 1;
  int64_t outer_stride = 0;
  int64_t inner_stride = 0;

  __device__ __forceinline__ int64_t offset(int64_t row) const {
    if (inner == 1) return row * outer_stride;  // 2-D: no 64-bit division
    return (row / inner) * outer_stride + (row % inner) * inner_stride;
  }
  // Whether every row starts `vec`-element aligned, given that the base pointer is.
  bool rows_aligned(int vec) const { return outer_stride % vec == 0 && inner_stride % vec == 0; }
};

// Evenly spaced rows (a RowLayout with inner == 1, what RowsOf gives 2-D tensors and 3-D ones
// with evenly spaced rows): a row's offset is one multiply, and a kernel that takes this instead of
// a RowLayout carries no 64-bit division and a third of its parameter bytes.
struct EvenRows {
  int64_t stride = 0;
  __device__ __forceinline__ int64_t offset(int64_t row) const { return row * stride; }
  bool rows_aligned(int vec) const { return stride % vec == 0; }
};

inline bool Aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// What launchers ask of a device, read once per device (the answers never change while the process
// runs): its compute capability, multiprocessor count, the shared memory a block may opt in to and
// its L2's size.
struct DeviceFacts {
  int major = 0;  // 0: the device could not be asked
  int minor = 0;
  int sms = 0;
  int max_shared_per_block = 0;  // bytes, with cudaFuncAttributeMaxDynamicSharedMemorySize raised
  int l2_bytes = 0;
};

constexpr int kMaxDevices = 64;

// The facts of `device`, read on first use, thread-safe; all zero for a device that does not exist.
inline const DeviceFacts& GetDeviceFacts(int device) {
  static DeviceFacts facts[kMaxDevices];
  static std::once_flag read[kMaxDevices];
  static const DeviceFacts kNone{};
  if (device < 0 || device >= kMaxDevices) return kNone;
  std::call_once(read[device], [device] {
    DeviceFacts f;
    if (cudaDeviceGetAttribute(&f.major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&f.minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&f.sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&f.max_shared_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
            cudaSuccess ||
        cudaDeviceGetAttribute(&f.l2_bytes, cudaDevAttrL2CacheSize, device) != cudaSuccess) {
      f = DeviceFacts{};
      cudaGetLastError();  // the failed query is not an error of a later launch
    }
    facts[device] = f;
  });
  return facts[device];
}

// Blocks of kKernel with `threads` threads that fit on one SM of `device`, the current device, at
// once, with shared_bytes of dynamic shared memory; 0 where they do not fit or the runtime cannot
// say. Where shared_bytes is past the kernel's limit (48 KB less its static shared memory, by
// default), the limit is raised to it first, never lowered, so that every size asked before still
// launches. Asked once per (kernel, block size, device), so shared_bytes must follow from the
// block size; thread-safe.
template <auto kKernel>
int BlocksPerSm(int threads, size_t shared_bytes, int device) {
  static std::atomic<int> known[kMaxDevices][1024 / 32 + 1] = {};  // by block size in warps: blocks + 1; 0: not asked yet
  static std::mutex asking;
  if (device < 0 || device >= kMaxDevices || threads <= 0 || threads > 1024) return 0;
  std::atomic<int>& slot = known[device][(threads + 31) / 32];
  int value = slot.load(std::memory_order_acquire);
  if (value == 0) {
    std::lock_guard<std::mutex> lock(asking);
    int blocks = 0;
    cudaFuncAttributes attributes;
    cudaError_t status = cudaFuncGetAttributes(&attributes, kKernel);
    if (status == cudaSuccess && shared_bytes > size_t(attributes.maxDynamicSharedSizeBytes)) {
      status = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes));
    }
    if (status == cudaSuccess) {
      status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kKernel, threads, shared_bytes);
    }
    if (status != cudaSuccess) {
      blocks = 0;
      cudaGetLastError();  // "does not fit" is an answer, not an error of a later launch
    }
    value = blocks + 1;
    slot.store(value, std::memory_order_release);
  }
  return value - 1;
}

// Whether PDL is used for a launch on `device`: enable_pdl is 1 (on), 0 (off) or -1 (where the
// device supports it). Never on below sm90.
inline bool UsePdl(int64_t enable_pdl, int device) {
  return enable_pdl != 0 && GetDeviceFacts(device).major >= 9;
}

// kernel<<<grid, block, shared_bytes, stream>>>(args...), with the PDL attribute when `pdl`.
template <typename... KernelArgs, typename... Args>
cudaError_t LaunchWithSharedMemory(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t shared_bytes,
                                   cudaStream_t stream, bool pdl, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// kernel<<<grid, block, 0, stream>>>(args...), with the PDL attribute when `pdl`.
template <typename... KernelArgs, typename... Args>
cudaError_t Launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, cudaStream_t stream, bool pdl,
                   Args&&... args) {
  return LaunchWithSharedMemory(kernel, grid, block, 0, stream, pdl, std::forward<Args>(args)...);
}

}  // namespace aotinfer
