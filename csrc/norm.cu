// Bindings of the row normalizations (include/aotinfer/norm.cuh): RMSNorm (and Gemma's), the fused
// residual add + RMSNorm, and LayerNorm, on 2-D or 3-D inputs normalized over the last dimension.
#include <cmath>

#include "aotinfer/norm.cuh"
#include "tvm_ffi_utils.h"

using aotinfer::NormKind;
using aotinfer::NormParams;
using aotinfer::RowLayout;

namespace {

// Rows to normalize: [rows, hidden] or [a, b, hidden], last dimension contiguous, of a dtype the
// kernels take.
RowLayout CheckRows(const TensorView& x, const char* name, int64_t* num_rows) {
  if (x.ndim() != 2 && x.ndim() != 3) {
    AOTINFER_THROW(ValueError) << "Expected " << name << " to have 2 or 3 dimensions, got " << x.ndim() << " (shape "
                              << aotinfer::ShapeString(x.shape()) << ")";
  }
  const RowLayout rows = aotinfer::RowsOf<RowLayout>(x, name, num_rows);
  aotinfer::CheckDtypeFp32Fp16(x, name);
  return rows;
}

// A weight of input: [hidden], contiguous.
void CheckWeight(const TensorView& w, const char* name, const TensorView& input) {
  if (w.ndim() != 1 || w.size(0) != input.size(-1)) {
    AOTINFER_THROW(ValueError) << "Expected " << name << " to have shape [" << input.size(-1)
                              << "] (the last dimension of input), got " << aotinfer::ShapeString(w.shape());
  }
  aotinfer::CheckContiguous(w, name);
}

// A tensor of rows beside input: of its shape and dtype, last dimension contiguous.
RowLayout CheckLikeInput(const TensorView& x, const char* name, const TensorView& input) {
  aotinfer::CheckSameShape(x, input, name, "input");
  aotinfer::CheckSameDtype(x, input, name, "input");
  int64_t num_rows = 0;
  return aotinfer::RowsOf<RowLayout>(x, name, &num_rows);
}

void CheckScalars(double eps, int64_t enable_pdl) {
  if (!(eps >= 0 && eps < INFINITY)) {
    AOTINFER_THROW(ValueError) << "Expected eps to be finite and non-negative, got " << eps;
  }
  aotinfer::CheckEnablePdl(enable_pdl);
}

// Steps 2 to 4: device guard, stream, launch.
template <NormKind kKind, typename T, typename W>
void Run(const NormParams<T, W>& params, const TensorView& input, int64_t enable_pdl, const char* op) {
  if (aotinfer::IsStandIn(input)) return;
  const int device = input.device().device_id;
  aotinfer::DeviceGuard guard(device);
  cudaStream_t stream = aotinfer::get_stream(input.device());
  CHECK_LAUNCH(aotinfer::Norm<kKind>(params, device, stream, aotinfer::UsePdl(enable_pdl, device)), op);
}

}  // namespace

// out = input / rms(input) * (weight + (gemma ? 1 : 0)), per row.
void rmsnorm(TensorView out, TensorView input, TensorView weight, double eps, bool gemma, int64_t enable_pdl) {
  int64_t rows = 0;
  const RowLayout in_layout = CheckRows(input, "input", &rows);
  CheckWeight(weight, "weight", input);
  CHECK_SAME_DTYPE(weight, input);
  CheckScalars(eps, enable_pdl);
  const RowLayout out_layout = CheckLikeInput(out, "out", input);
  aotinfer::CheckOnOneGpu({{input, "input"}, {weight, "weight"}, {out, "out"}});
  DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP32_FP16(input.dtype(), T, [&] {
    NormParams<T, T> p{aotinfer::data_ptr<T>(out), out_layout, aotinfer::data_ptr<T>(input), in_layout,
                       nullptr, {}, aotinfer::data_ptr<T>(weight), nullptr, input.size(-1), rows,
                       static_cast<float>(eps), gemma ? 1.f : 0.f};
    Run<NormKind::kRMS>(p, input, enable_pdl, gemma ? "gemma_rmsnorm" : "rmsnorm");
    return true;
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(rmsnorm, rmsnorm);

// residual += input (summed in float, stored rounded); input = rmsnorm(the float sum) *
// (weight + (gemma ? 1 : 0)), in place.
void fused_add_rmsnorm(TensorView input, TensorView residual, TensorView weight, double eps, bool gemma,
                       int64_t enable_pdl) {
  int64_t rows = 0;
  const RowLayout in_layout = CheckRows(input, "input", &rows);
  const RowLayout res_layout = CheckLikeInput(residual, "residual", input);
  CheckWeight(weight, "weight", input);
  CHECK_SAME_DTYPE(weight, input);
  CheckScalars(eps, enable_pdl);
  aotinfer::CheckOnOneGpu({{input, "input"}, {residual, "residual"}, {weight, "weight"}});
  DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP32_FP16(input.dtype(), T, [&] {
    NormParams<T, T> p{aotinfer::data_ptr<T>(input), in_layout, aotinfer::data_ptr<T>(input), in_layout,
                       aotinfer::data_ptr<T>(residual), res_layout, aotinfer::data_ptr<T>(weight), nullptr,
                       input.size(-1), rows, static_cast<float>(eps), gemma ? 1.f : 0.f};
    Run<NormKind::kFusedAddRMS>(p, input, enable_pdl, gemma ? "gemma_fused_add_rmsnorm" : "fused_add_rmsnorm");
    return true;
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(fused_add_rmsnorm, fused_add_rmsnorm);

// out = (input - mean) / sqrt(var + eps) * gemma + beta, per row; gemma (the scale, FlashInfer's
// name) and beta are both float32 or both input's dtype.
void layernorm(TensorView out, TensorView input, TensorView gemma, TensorView beta, double eps, int64_t enable_pdl) {
  int64_t rows = 0;
  const RowLayout in_layout = CheckRows(input, "input", &rows);
  CheckWeight(gemma, "gemma", input);
  CheckWeight(beta, "beta", input);
  const DLDataType f32{kDLFloat, 32, 1};
  if (gemma.dtype() != input.dtype() && gemma.dtype() != f32) {
    AOTINFER_THROW(TypeError) << "Expected gemma and beta to be float32 or input's dtype " << input.dtype()
                             << ", got " << gemma.dtype();
  }
  CHECK_SAME_DTYPE(beta, gemma);
  CheckScalars(eps, enable_pdl);
  const RowLayout out_layout = CheckLikeInput(out, "out", input);
  aotinfer::CheckOnOneGpu({{input, "input"}, {gemma, "gemma"}, {beta, "beta"}, {out, "out"}});
  DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP32_FP16(input.dtype(), T, [&] {
    auto run = [&](auto weight_type) {
      using W = decltype(weight_type);
      NormParams<T, W> p{aotinfer::data_ptr<T>(out), out_layout, aotinfer::data_ptr<T>(input), in_layout,
                         nullptr, {}, aotinfer::data_ptr<W>(gemma), aotinfer::data_ptr<W>(beta),
                         input.size(-1), rows, static_cast<float>(eps), 0.f};
      Run<NormKind::kLayer>(p, input, enable_pdl, "layernorm");
    };
    if (gemma.dtype() == f32) {
      run(float{});
    } else {
      run(T{});
    }
    return true;
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(layernorm, layernorm);
