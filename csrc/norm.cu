// Bindings of the row normalizations (include/aotinfer/norm.cuh): RMSNorm (and Gemma's), the fused
// residual add + RMSNorm, and LayerNorm, on 2-D or 3-D inputs normalized over the last dimension.
#include "aotinfer/norm.cuh"
#include "tvm_ffi_utils.h"

using aotinfer::NormKind;
using aotinfer::NormParams;
using aotinfer::RowLayout;

namespace {

// input: [rows, hidden] or [a, b, hidden] on the GPU; each weight: [hidden], contiguous, beside it.
void CheckInputAndWeight(const TensorView& input, const TensorView& weight, const char* weight_name) {
  CHECK_CUDA(input);
  if (input.ndim() != 2 && input.ndim() != 3) {
    TVM_FFI_THROW(ValueError) << "Expected input to have 2 or 3 dimensions, got " << input.ndim() << " (shape "
                              << aotinfer::ShapeString(input.shape()) << ")";
  }
  if (weight.device().device_type != kDLCUDA) {
    TVM_FFI_THROW(ValueError) << "Expected " << weight_name << " to be a CUDA tensor, got a tensor on "
                              << aotinfer::DeviceString(weight.device());
  }
  CHECK_DEVICE(weight, input);
  if (weight.ndim() != 1 || weight.size(0) != input.size(-1)) {
    TVM_FFI_THROW(ValueError) << "Expected " << weight_name << " to have shape [" << input.size(-1)
                              << "] (the last dimension of input), got " << aotinfer::ShapeString(weight.shape());
  }
  CHECK_CONTIGUOUS(weight);
}

void CheckOutput(const TensorView& out, const TensorView& input) {
  CHECK_CUDA(out);
  CHECK_DEVICE(out, input);
  CHECK_SHAPE(out, input);
  CHECK_SAME_DTYPE(out, input);
}

template <NormKind kKind, typename T, typename W>
void Run(const NormParams<T, W>& params, const TensorView& input, int64_t enable_pdl, const char* op) {
  aotinfer::DeviceGuard guard(input.device().device_id);
  cudaStream_t stream = aotinfer::get_stream(input.device());
  const bool pdl = aotinfer::UsePdl(enable_pdl, input.device().device_id);
  CHECK_LAUNCH(aotinfer::Norm<kKind>(params, stream, pdl), op);
}

}  // namespace

// out = input / rms(input) * (weight + (gemma ? 1 : 0)), per row.
void rmsnorm(TensorView out, TensorView input, TensorView weight, double eps, bool gemma, int64_t enable_pdl) {
  CheckInputAndWeight(input, weight, "weight");
  CHECK_SAME_DTYPE(weight, input);
  CheckOutput(out, input);
  int64_t rows = 0, out_rows = 0;
  const RowLayout in_layout = aotinfer::RowsOf<RowLayout>(input, "input", &rows);
  const RowLayout out_layout = aotinfer::RowsOf<RowLayout>(out, "out", &out_rows);
  DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP32_FP16(input.dtype(), T, [&] {
    NormParams<T, T> p{aotinfer::data_ptr<T>(out), out_layout, aotinfer::data_ptr<T>(input), in_layout,
                       nullptr, {}, aotinfer::data_ptr<T>(weight), nullptr, input.size(-1), rows,
                       static_cast<float>(eps), gemma ? 1.f : 0.f};
    Run<NormKind::kRMS>(p, input, enable_pdl, gemma ? "gemma_rmsnorm" : "rmsnorm");
    return true;
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(rmsnorm, rmsnorm);

// residual += input; input = rmsnorm(residual) * (weight + (gemma ? 1 : 0)), in place.
void fused_add_rmsnorm(TensorView input, TensorView residual, TensorView weight, double eps, bool gemma,
                       int64_t enable_pdl) {
  CheckInputAndWeight(input, weight, "weight");
  CHECK_SAME_DTYPE(weight, input);
  CHECK_CUDA(residual);
  CHECK_DEVICE(residual, input);
  CHECK_SHAPE(residual, input);
  CHECK_SAME_DTYPE(residual, input);
  int64_t rows = 0, residual_rows = 0;
  const RowLayout in_layout = aotinfer::RowsOf<RowLayout>(input, "input", &rows);
  const RowLayout res_layout = aotinfer::RowsOf<RowLayout>(residual, "residual", &residual_rows);
  DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP32_FP16(input.dtype(), T, [&] {
    NormParams<T, T> p{aotinfer::data_ptr<T>(input), in_layout, aotinfer::data_ptr<T>(input), in_layout,
                       aotinfer::data_ptr<T>(residual), res_layout, aotinfer::data_ptr<T>(weight), nullptr,
                       input.size(-1), rows, static_cast<float>(eps), gemma ? 1.f : 0.f};
    Run<NormKind::kFusedAddRMS>(p, input, enable_pdl, gemma ? "gemma_fused_add_rmsnorm" : "fused_add_rmsnorm");
    return true;
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(fused_add_rmsnorm, fused_add_rmsnorm);

// out = (input - mean) / sqrt(var + eps) * gamma + beta, per row; gamma and beta are float32 or
// input's dtype.
void layernorm(TensorView out, TensorView input, TensorView gamma, TensorView beta, double eps, int64_t enable_pdl) {
  CheckInputAndWeight(input, gamma, "gemma");
  CheckInputAndWeight(input, beta, "beta");
  CHECK_SAME_DTYPE(beta, gamma);
  CheckOutput(out, input);
  const DLDataType f32{kDLFloat, 32, 1};
  if (gamma.dtype() != input.dtype() && gamma.dtype() != f32) {
    TVM_FFI_THROW(TypeError) << "Expected gemma and beta to be float32 or input's dtype " << input.dtype() << ", got "
                             << gamma.dtype();
  }
  int64_t rows = 0, out_rows = 0;
  const RowLayout in_layout = aotinfer::RowsOf<RowLayout>(input, "input", &rows);
  const RowLayout out_layout = aotinfer::RowsOf<RowLayout>(out, "out", &out_rows);
  DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP32_FP16(input.dtype(), T, [&] {
    auto run = [&](auto weight_type) {
      using W = decltype(weight_type);
      NormParams<T, W> p{aotinfer::data_ptr<T>(out), out_layout, aotinfer::data_ptr<T>(input), in_layout,
                         nullptr, {}, aotinfer::data_ptr<W>(gamma), aotinfer::data_ptr<W>(beta),
                         input.size(-1), rows, static_cast<float>(eps), 0.f};
      Run<NormKind::kLayer>(p, input, enable_pdl, "layernorm");
    };
    if (gamma.dtype() == f32) {
      run(float{});
    } else {
      run(T{});
    }
    return true;
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(layernorm, layernorm);
