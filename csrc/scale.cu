// Binding of the scale kernel (include/aotinfer/scale.cuh): out = input * factor.
#include "aotinfer/scale.cuh"
#include "tvm_ffi_utils.h"

void scale(TensorView out, TensorView input, double factor) {
  CHECK_SAME_DTYPE(out, input);
  CHECK_SHAPE(out, input);
  CHECK_INPUT(input);
  CHECK_INPUT(out);
  CHECK_DEVICE(out, input);
  const int64_t n = input.numel();
  if (n == 0) return;
  DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP32_FP16(input.dtype(), T, [&] {
    const T* in = aotinfer::data_ptr<T>(input);
    T* dst = aotinfer::data_ptr<T>(out);
    // In place is fine (each element is read before it is written); a partial overlap is not.
    if (dst != in && dst < in + n && in < dst + n) {
      TVM_FFI_THROW(ValueError) << "Expected out to be input itself or not to overlap it";
    }
    aotinfer::DeviceGuard guard(input.device().device_id);
    cudaStream_t stream = aotinfer::get_stream(input.device());
    CHECK_LAUNCH(aotinfer::Scale<T>(dst, in, static_cast<float>(factor), n, stream), "scale");
    return true;
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(scale, scale);
