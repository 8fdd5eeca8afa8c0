// Launching row-wise kernels: the row layout of 2-D/3-D tensors with strided rows, programmatic
// dependent launch (PDL) on sm90+, and the choice of vector width.
//
// PDL lets a kernel start while the previous kernel in the stream finishes: the launch carries
// cudaLaunchAttributeProgrammaticStreamSerialization, and the kernel calls WaitForPriorGrids()
// before it reads what earlier kernels wrote and AllowDependentGrids() once the next kernel may
// start its own preamble. Below sm90 both are no-ops and the attribute is never set.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
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

inline bool Aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Whether PDL is used for a launch on `device`: enable_pdl is 1 (on), 0 (off) or -1 (where the
// device supports it). Never on below sm90.
inline bool UsePdl(int64_t enable_pdl, int device) {
  if (enable_pdl == 0) return false;
  static int major[64] = {};  // 0: not asked yet; the answer never changes, so races are benign
  if (device < 0 || device >= 64) return false;
  if (major[device] == 0) {
    int value = 0;
    if (cudaDeviceGetAttribute(&value, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
    major[device] = value;
  }
  return major[device] >= 9;
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
