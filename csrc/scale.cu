// Binding of the scale kernel (include/aotinfer/scale.cuh): out = input * factor.
#include "aotinfer/scale.cuh"
#include "tvm_ffi_utils.h"

void scale(TensorView out, TensorView input, double factor, int64_t enable_pdl) {
  // 1. Validate: the input, the scalars, the output (which the op may have allocated), devices.
  CHECK_CONTIGUOUS(input);
  CHECK_DTYPE_FP32_FP16(input);
  aotinfer::CheckEnablePdl(enable_pdl);
  CHECK_SHAPE(out, input);
  CHECK_SAME_DTYPE(out, input);
  CHECK_CONTIGUOUS(out);
  const int64_t n = input.numel();
  const char* in = static_cast<const char*>(input.data_ptr()) + input.byte_offset();
  const char* dst = static_cast<const char*>(out.data_ptr()) + out.byte_offset();
  const int64_t bytes = n * input.dtype().bits / 8;
  // In place is fine (each element is read before it is written); a partial overlap is not.
  if (dst != in && dst < in + bytes && in < dst + bytes) {
    AOTINFER_THROW(ValueError) << "Expected out to be input itself or not to overlap it";
  }
  aotinfer::CheckOnOneGpu({{input, "input"}, {out, "out"}});
  if (n == 0 || aotinfer::IsStandIn(input)) return;
  // 2. Guard the device; 3. get the stream; 4. dispatch and launch.
  const int device = input.device().device_id;
  aotinfer::DeviceGuard guard(device);
  cudaStream_t stream = aotinfer::get_stream(input.device());
  const bool pdl = aotinfer::UsePdl(enable_pdl, device);
  DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP32_FP16(input.dtype(), T, [&] {
    CHECK_LAUNCH(aotinfer::Scale<T>(aotinfer::data_ptr<T>(out), aotinfer::data_ptr<T>(input),
                                    static_cast<float>(factor), n, stream, pdl),
                 "scale");
    return true;
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(scale, scale);
