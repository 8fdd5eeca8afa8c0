// Argument checks that the attention bindings (csrc/decode.cu, csrc/prefill.cu) share: the
// dtypes, tables and 16-byte rows their kernels read. Each names the argument as the Python op does.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "tvm_ffi_utils.h"

namespace aotinfer {

// head_dim values with a kernel.
inline bool SupportedHeadDim(int64_t d) { return d == 64 || d == 128 || d == 256; }

inline void CheckDtypeFp16(const TensorView& x, const char* name) {
  const uint32_t key = DtypeKey(x.dtype());
  if (key != DtypeKey(kDLFloat, 16) && key != DtypeKey(kDLBfloat, 16)) {
    AOTINFER_THROW(TypeError) << "Expected " << name << " to have dtype float16 or bfloat16, got " << x.dtype();
  }
}

inline void CheckDtype(const TensorView& x, DLDataType dtype, const char* name, const char* what) {
  if (x.dtype() != dtype) AOTINFER_THROW(TypeError) << "Expected " << name << " to be " << what << ", got " << x.dtype();
}

// A table of int32 rows [n, width] (width 0: 1-D), contiguous.
inline void CheckIndexTable(const TensorView& x, int64_t width, const char* name) {
  CheckDtype(x, DLDataType{kDLInt, 32, 1}, name, "int32");
  if (x.ndim() != (width ? 2 : 1) || (width && x.size(1) != width)) {
    AOTINFER_THROW(ValueError) << "Expected " << name << " to have shape [n" << (width ? ", " + std::to_string(width) : "")
                              << "], got " << ShapeString(x.shape());
  }
  CheckContiguous(x, name);
}

// 16-byte rows of `elements` elements: where cp.async and vector stores can take them.
inline void CheckRows16(const TensorView& x, int64_t elements_per_16_bytes, const char* name, int outer_dims) {
  bool aligned = reinterpret_cast<uintptr_t>(data_ptr<char>(x)) % 16 == 0;
  for (int i = 0; i < outer_dims; ++i) aligned = aligned && (x.size(i) <= 1 || x.stride(i) % elements_per_16_bytes == 0);
  if (!aligned) {
    AOTINFER_THROW(ValueError) << "Expected the rows of " << name << " to start on 16-byte boundaries, got strides "
                              << ShapeString(x.strides());
  }
}

inline void CheckLastDimContiguous(const TensorView& x, const char* name) {
  if (x.size(-1) > 1 && x.stride(-1) != 1) {
    AOTINFER_THROW(ValueError) << "Expected the last dimension of " << name << " to be contiguous, got strides "
                              << ShapeString(x.strides());
  }
}

// An empty tensor (not requested) or a contiguous float32 tensor of `shape`.
inline bool CheckOptionalFloat(const TensorView& x, std::initializer_list<int64_t> shape, const char* name) {
  if (x.numel() == 0) return false;
  CheckDtype(x, DLDataType{kDLFloat, 32, 1}, name, "float32");
  bool same = size_t(x.ndim()) == shape.size();
  int i = 0;
  for (int64_t s : shape) same = same && x.size(i++) == s;
  if (!same) {
    std::string expected = "[";
    for (int64_t s : shape) expected += (expected.size() > 1 ? ", " : "") + std::to_string(s);
    AOTINFER_THROW(ValueError) << "Expected " << name << " to have shape " << expected << "] or no elements, got "
                              << ShapeString(x.shape());
  }
  CheckContiguous(x, name);
  return true;
}

}  // namespace aotinfer
