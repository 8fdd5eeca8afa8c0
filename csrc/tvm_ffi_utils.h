// What every binding in csrc/ uses: argument checks that reach Python as ValueError/TypeError
// naming the argument, dtype dispatch to C++ types, the caller's stream, and a device guard.
//
// A binding does four things in order: validate, guard the device, get the stream, dispatch and
// launch (see csrc/scale.cu). Validation names each argument as the Python op does. It checks
// shapes, dtypes, layouts and scalars first, the inputs before the outputs (which the op may have
// allocated beside a faulty input), and devices last (CheckOnOneGpu), so that a CPU tensor of the
// wrong shape is reported for its shape and tests without a GPU reach every check. One error
// class a fault: TypeError for a wrong dtype; ValueError for a wrong shape, a layout that is not
// contiguous, overlapping tensors, a bad value, a tensor off the GPU or on another device. The
// stream is never a Python argument: tvm-ffi sets it, per call, to torch's current stream on the
// tensors' device.
//
// A tracer (torch.compile, export, make_fx) has tensors with a shape and no data. Their fake
// implementation calls the binding on stand-ins (IsStandIn) so that the same checks give the same
// errors while tracing; a binding returns right after its checks when its tensors are stand-ins.
//
// Errors are thrown with AOTINFER_THROW, never TVM_FFI_THROW: the latter collects a native
// backtrace under a process-wide lock of libtvm_ffi, and a process that forks while another
// thread holds it leaves its child hanging at its first error. A message that names the argument
// needs no backtrace.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/extra/cuda/device_guard.h>
#include <tvm/ffi/function.h>

#include "aotinfer/ids.cuh"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

using tvm::ffi::TensorView;

namespace aotinfer {

namespace detail {
// `AOTINFER_THROW(ValueError) << "..."`: the error is thrown when the statement ends.
class ErrorStream {
 public:
  explicit ErrorStream(const char* kind) : kind_(kind) {}
  std::ostringstream& stream() { return message_; }
  [[noreturn]] ~ErrorStream() noexcept(false) { throw tvm::ffi::Error(kind_, message_.str(), std::string()); }

 private:
  const char* kind_;
  std::ostringstream message_;
};
}  // namespace detail

#define AOTINFER_THROW(ErrorKind) ::aotinfer::detail::ErrorStream(#ErrorKind).stream()

inline std::string DeviceString(DLDevice device) {
  switch (device.device_type) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return "cuda:" + std::to_string(device.device_id);
    case kDLCUDAHost: return "cuda pinned host memory";
    case kDLCUDAManaged: return "cuda managed memory";
    default: return "device type " + std::to_string(device.device_type);
  }
}

inline std::string ShapeString(tvm::ffi::ShapeView shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

inline bool SameShape(tvm::ffi::ShapeView a, tvm::ffi::ShapeView b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

// The caller's stream on `device` (torch's current stream when called from Python).
inline cudaStream_t get_stream(DLDevice device) {
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(device.device_type, device.device_id));
}

// Makes `tensor`'s device current for the scope, so a launch for cuda:1 runs on device 1.
using DeviceGuard = tvm::ffi::CUDADeviceGuard;

// The first byte of a tensor's data.
template <typename T>
T* data_ptr(const TensorView& tensor) {
  return reinterpret_cast<T*>(static_cast<char*>(tensor.data_ptr()) + tensor.byte_offset());
}

// Stand-ins for a tracer's tensors (python/aotinfer/_kernels.py, _stand_in) have their data at
// 2**60 and above: beyond any device's address space, so no real tensor is taken for one. Each
// storage of a traced call gets its own stretch there, so overlap checks see the tracer's aliasing.
inline bool IsStandIn(const TensorView& tensor) {
  return reinterpret_cast<uintptr_t>(tensor.data_ptr()) >= (uintptr_t{1} << 60);
}

// "input" from the text of an expression like "input.dtype()", for error messages.
inline std::string ArgumentName(std::string expression) {
  const std::string accessor = ".dtype()";
  if (expression.size() > accessor.size() &&
      expression.compare(expression.size() - accessor.size(), accessor.size(), accessor) == 0) {
    expression.resize(expression.size() - accessor.size());
  }
  return expression;
}

// The rows of `tensor` over its last dimension, which must be contiguous: 1-D is one row, 2-D and
// 3-D keep their leading strides (rows may be slices of wider tensors), more dimensions must be
// contiguous. `name` is the argument's name for errors.
template <typename Layout>
Layout RowsOf(const TensorView& tensor, const char* name, int64_t* num_rows) {
  const int ndim = tensor.ndim();
  if (ndim == 0) AOTINFER_THROW(ValueError) << "Expected " << name << " to have at least one dimension";
  if (tensor.size(-1) > 1 && tensor.stride(-1) != 1) {
    AOTINFER_THROW(ValueError) << "Expected the last dimension of " << name << " to be contiguous, got stride "
                              << tensor.stride(-1);
  }
  Layout rows;
  if (ndim == 1) {
    *num_rows = 1;
  } else if (ndim == 2) {
    *num_rows = tensor.size(0);
    rows.outer_stride = tensor.stride(0);
  } else if (ndim == 3) {
    *num_rows = tensor.size(0) * tensor.size(1);
    if (tensor.size(1) == 1) {
      rows.outer_stride = tensor.stride(0);
    } else if (tensor.size(0) == 1 || tensor.stride(0) == tensor.size(1) * tensor.stride(1)) {
      rows.outer_stride = tensor.stride(1);  // evenly spaced rows: kernels index them without a division
    } else {
      rows.inner = std::max<int64_t>(tensor.size(1), 1);
      rows.outer_stride = tensor.stride(0);
      rows.inner_stride = tensor.stride(1);
    }
  } else {
    if (!tensor.IsContiguous()) {
      AOTINFER_THROW(ValueError) << "Expected " << name << " with " << ndim << " dimensions to be contiguous, got strides "
                                << ShapeString(tensor.strides());
    }
    *num_rows = 1;
    for (int i = 0; i + 1 < ndim; ++i) *num_rows *= tensor.size(i);
    rows.outer_stride = tensor.size(-1);
  }
  return rows;
}

constexpr uint32_t DtypeKey(uint8_t code, uint8_t bits) { return (uint32_t(code) << 8) | bits; }
inline uint32_t DtypeKey(DLDataType dtype) {
  return dtype.lanes == 1 ? DtypeKey(dtype.code, dtype.bits) : 0;
}

}  // namespace aotinfer

// Argument checks. Each function names the argument `name`; each CHECK_ macro calls it with the
// argument's own name, the text of the expression.
namespace aotinfer {

inline void CheckCuda(const TensorView& x, const char* name) {
  if (x.device().device_type != kDLCUDA) {
    AOTINFER_THROW(ValueError) << "Expected " << name << " to be a CUDA tensor, got a tensor on "
                              << DeviceString(x.device());
  }
}

inline void CheckContiguous(const TensorView& x, const char* name) {
  if (!x.IsContiguous()) {
    AOTINFER_THROW(ValueError) << "Expected " << name << " to be contiguous, got shape " << ShapeString(x.shape())
                              << " with strides " << ShapeString(x.strides());
  }
}

inline void CheckDim(int64_t ndim, const TensorView& x, const char* name) {
  if (x.ndim() != ndim) {
    AOTINFER_THROW(ValueError) << "Expected " << name << " to have " << ndim << " dimensions, got " << x.ndim()
                              << " (shape " << ShapeString(x.shape()) << ")";
  }
}

inline void CheckSameShape(const TensorView& a, const TensorView& b, const char* name_a, const char* name_b) {
  if (!SameShape(a.shape(), b.shape())) {
    AOTINFER_THROW(ValueError) << "Expected " << name_a << " and " << name_b << " to have the same shape, got "
                              << ShapeString(a.shape()) << " and " << ShapeString(b.shape());
  }
}

inline void CheckSameDevice(const TensorView& a, const TensorView& b, const char* name_a, const char* name_b) {
  if (a.device().device_type != b.device().device_type || a.device().device_id != b.device().device_id) {
    AOTINFER_THROW(ValueError) << "Expected " << name_a << " and " << name_b << " on the same device, got "
                              << DeviceString(a.device()) << " and " << DeviceString(b.device());
  }
}

inline void CheckSameDtype(const TensorView& a, const TensorView& b, const char* name_a, const char* name_b) {
  if (a.dtype() != b.dtype()) {
    AOTINFER_THROW(TypeError) << "Expected " << name_a << " and " << name_b << " to have the same dtype, got "
                             << a.dtype() << " and " << b.dtype();
  }
}

// The dtypes of DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP32_FP16, checked ahead of the dispatch so that an
// input's dtype is reported before any fault of an output.
inline void CheckDtypeFp32Fp16(const TensorView& x, const char* name) {
  switch (DtypeKey(x.dtype())) {
    case DtypeKey(kDLFloat, 32):
    case DtypeKey(kDLFloat, 16):
    case DtypeKey(kDLBfloat, 16):
      return;
    default:
      AOTINFER_THROW(TypeError) << "Expected " << name << " to have dtype float32, float16 or bfloat16, got "
                               << x.dtype();
  }
}

// enable_pdl: -1 (where the device supports it), 0 (off) or 1 (on).
inline void CheckEnablePdl(int64_t enable_pdl) {
  if (enable_pdl < -1 || enable_pdl > 1) {
    AOTINFER_THROW(ValueError) << "Expected enable_pdl to be -1 (where supported), 0 or 1, got " << enable_pdl;
  }
}

// A table a plan reads or writes on the host (python/aotinfer's plans; pinned or not): `ndim`
// dimensions, contiguous, of dtype `code`/`bits`.
inline void CheckHostTable(const TensorView& x, const char* name, DLDataTypeCode code, int bits, int ndim) {
  if (x.device().device_type != kDLCPU && x.device().device_type != kDLCUDAHost) {
    AOTINFER_THROW(ValueError) << "Expected " << name << " on the host, got a tensor on " << DeviceString(x.device());
  }
  CheckDim(ndim, x, name);
  CheckContiguous(x, name);
  if (x.dtype().code != code || x.dtype().bits != bits || x.dtype().lanes != 1) {
    AOTINFER_THROW(TypeError) << "Expected " << name << " to have dtype " << (code == kDLUInt ? "uint" : "int") << bits
                             << ", got " << x.dtype();
  }
}

// A paged plan's `seq_lens` (int64 [batch] on the host) where given, replacing the lengths of
// last_page_len (decode.cu's and prefill.cu's plans).
inline const int64_t* CheckSeqLens(const TensorView& seq_lens, int64_t batch) {
  CheckHostTable(seq_lens, "seq_lens", kDLInt, 64, 1);
  if (seq_lens.size(0) != batch) {
    AOTINFER_THROW(ValueError) << "Expected seq_lens to hold " << batch
                              << " lengths, each at most its pages times page_size, got " << seq_lens.size(0);
  }
  return data_ptr<const int64_t>(seq_lens);
}

// The keys of a paged plan's request b of `pages` pages: seq_lens[b] where seq_lens is given (at
// most its pages times page_size), else from last_page_len[b] (in 0..page_size, 0 without pages).
// The errors name the entry; `last_name`, last_page_len.
inline int64_t PagedKvLen(int64_t b, int64_t pages, int64_t page_size, const int32_t* last, const int64_t* seq_lens,
                          int64_t batch, const char* last_name) {
  if (seq_lens != nullptr) {
    if (seq_lens[b] < 0 || seq_lens[b] > pages * page_size) {
      AOTINFER_THROW(ValueError) << "Expected seq_lens to hold " << batch
                                << " lengths, each at most its pages times page_size, got seq_lens[" << b
                                << "] = " << seq_lens[b] << " for " << pages << " pages of " << page_size;
    }
    return seq_lens[b];
  }
  if (last[b] < 0 || last[b] > page_size || (pages == 0 && last[b] != 0)) {
    AOTINFER_THROW(ValueError) << "Expected " << last_name << " in 0..page_size (" << page_size
                              << "), and 0 for requests without pages, got " << last_name << "[" << b << "] = "
                              << last[b] << " for " << pages << " pages";
  }
  return (pages > 0 ? pages - 1 : 0) * page_size + last[b];
}

// An index tensor (positions, indptr, page indices): int32 or int64, one lane.
inline bool IsIndex(const TensorView& x) {
  const DLDataType dtype = x.dtype();
  return dtype.code == kDLInt && (dtype.bits == 32 || dtype.bits == 64) && dtype.lanes == 1;
}

// A 1-D int32/int64 tensor of `length` elements (any length where length < 0), contiguous, as the
// kernels' Ids. `length_says` names where the length comes from ("batch_size + 1" where any goes).
inline Ids CheckIds(const TensorView& x, const char* name, int64_t length, const char* length_says) {
  if (x.ndim() != 1 || (length >= 0 && x.size(0) != length)) {
    AOTINFER_THROW(ValueError) << "Expected " << name << " to have shape ["
                              << (length >= 0 ? std::to_string(length) : std::string(length_says)) << "] ("
                              << (length >= 0 ? length_says : "one dimension") << "), got "
                              << ShapeString(x.shape());
  }
  if (!IsIndex(x)) AOTINFER_THROW(TypeError) << "Expected " << name << " to have dtype int32 or int64, got " << x.dtype();
  CheckContiguous(x, name);
  return Ids{static_cast<const char*>(x.data_ptr()) + x.byte_offset(), x.dtype().bits == 64};
}

// The last check: every tensor on a CUDA device, each on the first one's. Tensors are named in
// the order given, inputs first. The one check of "all on one GPU": a fixed list of tensors, or a
// list a binding built from the optional tensors it was given.
using TensorsToPlace = std::vector<std::pair<const TensorView*, const char*>>;

inline void CheckOnOneGpu(const TensorsToPlace& tensors) {
  for (const auto& [tensor, name] : tensors) CheckCuda(*tensor, name);
  const auto& [first, first_name] = tensors.front();
  for (const auto& [tensor, name] : tensors) CheckSameDevice(*tensor, *first, name, first_name);
}

inline void CheckOnOneGpu(std::initializer_list<std::pair<const TensorView&, const char*>> tensors) {
  TensorsToPlace placed;
  placed.reserve(tensors.size());
  for (const auto& [tensor, name] : tensors) placed.push_back({&tensor, name});
  CheckOnOneGpu(placed);
}

}  // namespace aotinfer

#define CHECK_CUDA(x) ::aotinfer::CheckCuda(x, #x)
#define CHECK_CONTIGUOUS(x) ::aotinfer::CheckContiguous(x, #x)
#define CHECK_DIM(d, x) ::aotinfer::CheckDim(d, x, #x)
#define CHECK_SHAPE(a, b) ::aotinfer::CheckSameShape(a, b, #a, #b)
#define CHECK_DEVICE(a, b) ::aotinfer::CheckSameDevice(a, b, #a, #b)
#define CHECK_SAME_DTYPE(a, b) ::aotinfer::CheckSameDtype(a, b, #a, #b)
#define CHECK_DTYPE_FP32_FP16(x) ::aotinfer::CheckDtypeFp32Fp16(x, #x)

// Turns a launcher's cudaError_t into an exception that names the op.
#define CHECK_LAUNCH(status, op)                                                     \
  do {                                                                               \
    cudaError_t aotinfer_status_ = (status);                                         \
    if (aotinfer_status_ != cudaSuccess) {                                           \
      AOTINFER_THROW(RuntimeError) << op << ": CUDA error "                           \
                                  << cudaGetErrorName(aotinfer_status_) << ": "      \
                                  << cudaGetErrorString(aotinfer_status_);           \
    }                                                                                \
  } while (0)

// Dtype dispatch: DISPATCH_...(x.dtype(), c_type, [&] { ...use c_type...; return true; }) runs the
// lambda with c_type bound to the C++ type of the dtype, or throws TypeError naming the argument
// and the dtypes it accepts.
#define AOTINFER_DTYPE_CASE(code, bits, c_type_, c_type, ...) \
  case ::aotinfer::DtypeKey(code, bits): {                     \
    using c_type = c_type_;                                    \
    return __VA_ARGS__();                                      \
  }

#define AOTINFER_DISPATCH(dlpack_dtype, accepted, CASES)                                      \
  [&]() -> bool {                                                                             \
    switch (::aotinfer::DtypeKey(dlpack_dtype)) {                                             \
      CASES                                                                                   \
      default:                                                                                \
        AOTINFER_THROW(TypeError) << "Expected " << ::aotinfer::ArgumentName(#dlpack_dtype)     \
                                 << " to have dtype " accepted ", got " << (dlpack_dtype);    \
    }                                                                                         \
    return false;                                                                             \
  }()

#define AOTINFER_CASES_FP16(c_type, ...)                              \
  AOTINFER_DTYPE_CASE(kDLFloat, 16, half, c_type, __VA_ARGS__)        \
  AOTINFER_DTYPE_CASE(kDLBfloat, 16, nv_bfloat16, c_type, __VA_ARGS__)

#define AOTINFER_CASES_FP8(c_type, ...)                                            \
  AOTINFER_DTYPE_CASE(kDLFloat8_e4m3fn, 8, __nv_fp8_e4m3, c_type, __VA_ARGS__)     \
  AOTINFER_DTYPE_CASE(kDLFloat8_e5m2, 8, __nv_fp8_e5m2, c_type, __VA_ARGS__)

// float16 and bfloat16.
#define DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP16(dlpack_dtype, c_type, ...) \
  AOTINFER_DISPATCH(dlpack_dtype, "float16 or bfloat16", AOTINFER_CASES_FP16(c_type, __VA_ARGS__))

// float32, float16 and bfloat16.
#define DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP32_FP16(dlpack_dtype, c_type, ...)           \
  AOTINFER_DISPATCH(dlpack_dtype, "float32, float16 or bfloat16",                       \
                    AOTINFER_DTYPE_CASE(kDLFloat, 32, float, c_type, __VA_ARGS__)     \
                        AOTINFER_CASES_FP16(c_type, __VA_ARGS__))

// float8_e4m3fn and float8_e5m2.
#define DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP8(dlpack_dtype, c_type, ...) \
  AOTINFER_DISPATCH(dlpack_dtype, "float8_e4m3fn or float8_e5m2", AOTINFER_CASES_FP8(c_type, __VA_ARGS__))
