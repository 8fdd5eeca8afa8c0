// Bindings of the gated activations (include/aotinfer/activation.cuh): input [..., 2d] ->
// out [..., d] = act(input[..., :d]) * input[..., d:].
#include "aotinfer/activation.cuh"
#include "tvm_ffi_utils.h"

using aotinfer::RowLayout;

namespace {

template <typename Act>
void ActAndMul(TensorView out, TensorView input, int64_t enable_pdl, const char* op) {
  if (input.ndim() == 0 || input.size(-1) % 2 != 0) {
    AOTINFER_THROW(ValueError) << "Expected the last dimension of input to be even (gate and up halves), got shape "
                              << aotinfer::ShapeString(input.shape());
  }
  int64_t rows = 0, out_rows = 0;
  const RowLayout in_layout = aotinfer::RowsOf<RowLayout>(input, "input", &rows);
  CHECK_DTYPE_FP32_FP16(input);
  aotinfer::CheckEnablePdl(enable_pdl);
  bool shape_ok = out.ndim() == input.ndim() && out.size(-1) * 2 == input.size(-1);
  for (int i = 0; shape_ok && i + 1 < input.ndim(); ++i) shape_ok = out.size(i) == input.size(i);
  if (!shape_ok) {
    AOTINFER_THROW(ValueError) << "Expected out to have shape " << aotinfer::ShapeString(input.shape())
                              << " with the last dimension halved, got " << aotinfer::ShapeString(out.shape());
  }
  CHECK_SAME_DTYPE(out, input);
  const RowLayout out_layout = aotinfer::RowsOf<RowLayout>(out, "out", &out_rows);
  aotinfer::CheckOnOneGpu({{input, "input"}, {out, "out"}});
  if (aotinfer::IsStandIn(out)) return;

  const int device = input.device().device_id;
  aotinfer::DeviceGuard guard(device);
  cudaStream_t stream = aotinfer::get_stream(input.device());
  const bool pdl = aotinfer::UsePdl(enable_pdl, device);
  DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP32_FP16(input.dtype(), T, [&] {
    CHECK_LAUNCH(aotinfer::ActAndMul<Act>(aotinfer::data_ptr<T>(out), out_layout, aotinfer::data_ptr<T>(input),
                                          in_layout, out.size(-1), rows, device, stream, pdl),
                 op);
    return true;
  });
}

}  // namespace

void silu_and_mul(TensorView out, TensorView input, int64_t enable_pdl) {
  ActAndMul<aotinfer::SiLU>(out, input, enable_pdl, "silu_and_mul");
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(silu_and_mul, silu_and_mul);

void gelu_and_mul(TensorView out, TensorView input, int64_t enable_pdl) {
  ActAndMul<aotinfer::GELU>(out, input, enable_pdl, "gelu_and_mul");
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(gelu_and_mul, gelu_and_mul);

void gelu_tanh_and_mul(TensorView out, TensorView input, int64_t enable_pdl) {
  ActAndMul<aotinfer::GELUTanh>(out, input, enable_pdl, "gelu_tanh_and_mul");
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(gelu_tanh_and_mul, gelu_tanh_and_mul);
