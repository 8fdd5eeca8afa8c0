// Launching kernels written in CuTeDSL and compiled when the wheel was built (cmake/cutedsl.py):
// each is a cubin (plus PTX for an arch built "+PTX") embedded in the module's shared object,
// loaded on first use with cudaLibraryLoadData and launched with cudaLaunchKernelExC. Nothing of
// the DSL runs here: the argument structs below are the layout of the DSL's tensor descriptors,
// which the build checked against each compiled kernel's parameter list.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string_view>

#include "aotinfer/cutedsl_image.h"
#include "aotinfer/launch.cuh"

namespace aotinfer::cutedsl {

// A tensor (rows, hidden):(row_stride, 1): pointer, dynamic shape, dynamic stride.
struct Rows {
  void* data;
  int32_t rows;
  int32_t hidden;
  int64_t row_stride;
};

// A tensor (size):(1).
struct Vector {
  void* data;
  int32_t size;
};

// A tensor of static shape (1):(1): only its pointer.
struct ScalarTensor {
  void* data;
};

// The position of `value` in `axis`, -1 if absent; constexpr, so that a binding names variant
// values that the build must have compiled.
template <typename T, size_t N>
constexpr int AxisPosition(const T (&axis)[N], T value) {
  for (size_t i = 0; i < N; ++i) {
    if (axis[i] == value) return int(i);
  }
  return -1;
}

// Loads and launches the kernels of one table, each on first use; thread-safe. kCount is the
// table's length.
template <int kCount>
class KernelTable {
 public:
  explicit KernelTable(const KernelImage* images) : images_(images) {}

  // images_[index]<<<grid, block, shared_bytes, stream>>>(args), with the PDL attribute when
  // `pdl`; raises the kernel's dynamic shared memory limit on `device` first where needed.
  cudaError_t Launch(int index, dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream, bool pdl,
                     void** args, int device) {
    cudaKernel_t kernel = nullptr;
    cudaError_t status = Get(index, &kernel);
    if (status != cudaSuccess) return status;
    if (shared_bytes > kDefaultSharedLimit) {
      status = RaiseSharedLimit(index, kernel, shared_bytes, device);
      if (status != cudaSuccess) return status;
    }
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
    return cudaLaunchKernelExC(&config, reinterpret_cast<const void*>(kernel), args);
  }

 private:
  static constexpr size_t kDefaultSharedLimit = 48 * 1024;

  // The loaded kernel `index`: the cubin, else (another arch of the same family, a newer GPU)
  // the PTX, which the driver compiles. A library is loaded once per process and serves every
  // device.
  cudaError_t Get(int index, cudaKernel_t* kernel) {
    cudaKernel_t loaded = kernels_[index].load(std::memory_order_acquire);
    if (loaded == nullptr) {
      std::lock_guard<std::mutex> lock(loading_);
      loaded = kernels_[index].load(std::memory_order_relaxed);
      if (loaded == nullptr) {
        const KernelImage& image = images_[index];
        cudaLibrary_t library = nullptr;
        cudaError_t status = cudaLibraryLoadData(&library, image.cubin, nullptr, nullptr, 0, nullptr, nullptr, 0);
        if (status != cudaSuccess && image.ptx != nullptr) {
          cudaGetLastError();
          status = cudaLibraryLoadData(&library, image.ptx, nullptr, nullptr, 0, nullptr, nullptr, 0);
        }
        if (status == cudaSuccess) status = cudaLibraryGetKernel(&loaded, library, image.name);
        if (status != cudaSuccess) {
          cudaGetLastError();  // reported through the return value, not to a later launch
          return status;
        }
        kernels_[index].store(loaded, std::memory_order_release);
      }
    }
    *kernel = loaded;
    return cudaSuccess;
  }

  // Raises (never lowers) the kernel's dynamic shared memory limit on `device` to shared_bytes.
  cudaError_t RaiseSharedLimit(int index, cudaKernel_t kernel, size_t shared_bytes, int device) {
    if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
    std::atomic<size_t>& limit = shared_limits_[index][device];
    if (limit.load(std::memory_order_acquire) >= shared_bytes) return cudaSuccess;
    std::lock_guard<std::mutex> lock(loading_);
    if (limit.load(std::memory_order_relaxed) >= shared_bytes) return cudaSuccess;
    cudaError_t status = cudaKernelSetAttributeForDevice(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                         int(shared_bytes), device);
    if (status != cudaSuccess) {
      cudaGetLastError();
      return status;
    }
    limit.store(shared_bytes, std::memory_order_release);
    return cudaSuccess;
  }

  const KernelImage* images_;
  std::mutex loading_;
  std::atomic<cudaKernel_t> kernels_[kCount] = {};
  std::atomic<size_t> shared_limits_[kCount][kMaxDevices] = {};
};

}  // namespace aotinfer::cutedsl
