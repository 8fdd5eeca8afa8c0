// Ids: an int32 or int64 index tensor (positions, indptr, page indices) read through one pointer,
// so that kernels take either dtype without an instantiation for each.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace aotinfer {

struct Ids {
  const void* data = nullptr;
  bool is64 = false;
  __device__ __forceinline__ int64_t operator[](int64_t i) const {
    return is64 ? static_cast<const int64_t*>(data)[i] : int64_t(static_cast<const int32_t*>(data)[i]);
  }
};

}  // namespace aotinfer
