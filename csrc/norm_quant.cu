// Bindings of the FP8-output row norms written in CuTeDSL (cutedsl/norm_quant.py): RMSNorm, residual
// add + RMSNorm and LayerNorm of 2-D [rows, hidden] inputs, scaled by 1 / scale, clamped to the FP8
// format's finite range and rounded to out's dtype. The build compiled every variant of the kernel
// file for this module's arch into norm_quant_kernels.cc (cmake/cutedsl.py); these bindings check
// the arguments, pick the variant and launch it (include/aotinfer/cutedsl.h).
#include <cmath>
#include <limits>

#include "aotinfer/cutedsl.h"
#include "norm_quant_kernels.h"
#include "tvm_ffi_utils.h"

namespace nq = aotinfer::cutedsl::norm_quant;

namespace {

aotinfer::cutedsl::KernelTable<nq::kNumVariants> kernels(nq::kKernels);

constexpr DLDataType kFloat32{kDLFloat, 32, 1};

// The dtype names of the variant axes.
std::string_view DtypeName(DLDataType dtype) {
  switch (aotinfer::DtypeKey(dtype)) {
    case aotinfer::DtypeKey(kDLFloat, 16): return "float16";
    case aotinfer::DtypeKey(kDLBfloat, 16): return "bfloat16";
    case aotinfer::DtypeKey(kDLFloat8_e4m3fn, 8): return "float8_e4m3fn";
    case aotinfer::DtypeKey(kDLFloat8_e5m2, 8): return "float8_e5m2";
    default: return "";
  }
}

void CheckDtype(const TensorView& x, DLDataType dtype, const char* name, const char* what) {
  if (x.dtype() != dtype) {
    AOTINFER_THROW(TypeError) << "Expected " << name << " to have dtype " << what << ", got " << x.dtype();
  }
}

// The DSL kernels' view of x, checked: [rows, hidden] with the last dimension contiguous (rows may
// be slices of wider tensors). (Not attention_checks.h's CheckRows16, a check of 16-byte rows.)
aotinfer::cutedsl::Rows CheckedRows(const TensorView& x, const char* name) {
  if (x.ndim() != 2) {
    AOTINFER_THROW(ValueError) << "Expected " << name << " to have 2 dimensions [rows, hidden], got " << x.ndim()
                              << " (shape " << aotinfer::ShapeString(x.shape()) << ")";
  }
  if (x.size(1) > 1 && x.stride(1) != 1) {
    AOTINFER_THROW(ValueError) << "Expected the last dimension of " << name << " to be contiguous, got strides "
                              << aotinfer::ShapeString(x.strides());
  }
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (x.size(0) > kMax || x.size(1) > kMax) {
    AOTINFER_THROW(ValueError) << "Expected " << name << " to have fewer than 2^31 rows and columns, got shape "
                              << aotinfer::ShapeString(x.shape());
  }
  return {static_cast<char*>(x.data_ptr()) + x.byte_offset(), int32_t(x.size(0)), int32_t(x.size(1)),
          x.size(0) > 1 ? x.stride(0) : x.size(1)};
}

void CheckInput(const TensorView& input) {
  switch (aotinfer::DtypeKey(input.dtype())) {
    case aotinfer::DtypeKey(kDLFloat, 16):
    case aotinfer::DtypeKey(kDLBfloat, 16):
      return;
    default:
      AOTINFER_THROW(TypeError) << "Expected input to have dtype float16 or bfloat16, got " << input.dtype();
  }
}

// A [hidden] vector beside input, contiguous, of `dtype`.
aotinfer::cutedsl::Vector CheckVector(const TensorView& w, const char* name, const TensorView& input, DLDataType dtype,
                                      const char* what) {
  if (w.ndim() != 1 || w.size(0) != input.size(-1)) {
    AOTINFER_THROW(ValueError) << "Expected " << name << " to have shape [" << input.size(-1)
                              << "] (the last dimension of input), got " << aotinfer::ShapeString(w.shape());
  }
  CheckDtype(w, dtype, name, what);
  aotinfer::CheckContiguous(w, name);
  return {static_cast<char*>(w.data_ptr()) + w.byte_offset(), int32_t(w.size(0))};
}

// scale: a float32 tensor of one element (shape [] or [1], as FlashInfer takes it), read on the GPU,
// or no elements (scale_value is the scale).
aotinfer::cutedsl::ScalarTensor CheckScale(const TensorView& scale, double scale_value, bool* on_device) {
  *on_device = scale.numel() != 0;
  if (!*on_device) {
    if (!(std::isfinite(scale_value) && scale_value != 0)) {
      AOTINFER_THROW(ValueError) << "Expected scale to be finite and nonzero, got " << scale_value;
    }
    return {nullptr};
  }
  CheckDtype(scale, kFloat32, "scale", "float32");
  if (scale.ndim() > 1 || scale.numel() != 1) {
    AOTINFER_THROW(ValueError) << "Expected scale to be a float or a float32 tensor of one element (shape [] or [1]), "
                              << "got shape "
                              << aotinfer::ShapeString(scale.shape());
  }
  return {static_cast<char*>(scale.data_ptr()) + scale.byte_offset()};
}

void CheckScalars(double eps, int64_t enable_pdl) {
  if (!(eps >= 0 && eps < INFINITY)) {
    AOTINFER_THROW(ValueError) << "Expected eps to be finite and non-negative, got " << eps;
  }
  aotinfer::CheckEnablePdl(enable_pdl);
}

// out: input's shape, an FP8 dtype, last dimension contiguous.
aotinfer::cutedsl::Rows CheckOut(const TensorView& out, const TensorView& input) {
  aotinfer::CheckSameShape(out, input, "out", "input");
  if (DtypeName(out.dtype()).rfind("float8", 0) != 0) {
    AOTINFER_THROW(TypeError) << "Expected out to have dtype float8_e4m3fn or float8_e5m2, got " << out.dtype();
  }
  return CheckedRows(out, "out");
}

bool Aligned(const void* ptr, int bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// Elements per access: 8 where the rows, their strides and every pointer allow 8-element accesses
// (16 bytes of input), else 1.
int VectorWidth(const nq::Params& p, int weight_bytes) {
  constexpr int kVec = nq::kVec[0];
  auto rows_ok = [&](const aotinfer::cutedsl::Rows& r, int element_bytes) {
    return Aligned(r.data, kVec * element_bytes) && (r.rows <= 1 || r.row_stride % kVec == 0);
  };
  const bool ok = p.input.hidden % kVec == 0 && rows_ok(p.input, 2) && rows_ok(p.residual, 2) && rows_ok(p.out, 1) &&
                  Aligned(p.weight.data, kVec * weight_bytes) && Aligned(p.bias.data, kVec * weight_bytes);
  return ok ? kVec : nq::kVec[1];
}

// Steps 2 to 4: device guard, stream, launch of the variant (kind, input's dtype, out's dtype).
void Run(std::string_view kind, nq::Params& p, const TensorView& input, const TensorView& out, int weight_bytes,
         int64_t enable_pdl, const char* op) {
  if (p.input.rows == 0 || p.input.hidden == 0 || aotinfer::IsStandIn(input)) return;
  const int device = input.device().device_id;
  const int hidden = p.input.hidden;
  const int vec = VectorWidth(p, weight_bytes);
  const int accesses = (hidden + vec - 1) / vec;
  const int warps = (accesses + nq::kVecsPerThread * 32 - 1) / (nq::kVecsPerThread * 32);
  const int threads = std::min(std::max(warps, 1) * 32, nq::kMaxThreads);
  // The row waits between the passes in registers where one group of accesses covers it, else in
  // shared memory; a grid that fits on the SMs at once reads the weights beside the row and lets
  // the next kernel launch right after its wait (cutedsl/norm_quant.py; docs/design/norm_quant.md#staging).
  const aotinfer::DeviceFacts& facts = aotinfer::GetDeviceFacts(device);
  const bool in_registers = accesses <= nq::kMaxThreads * nq::kVecsPerThread;
  const bool one_wave = p.input.rows <= facts.sms;
  p.trigger_early = one_wave;
  const std::string_view staging = !in_registers ? "shared" : one_wave ? "registers_weights_first" : "registers";
  const size_t shared_bytes = size_t(nq::kWarpSlots + (in_registers ? 0 : hidden)) * sizeof(float);
  const int max_shared = facts.max_shared_per_block;
  if (shared_bytes > size_t(max_shared)) {
    AOTINFER_THROW(ValueError) << "Expected input's last dimension to be at most "
                              << max_shared / int(sizeof(float)) - nq::kWarpSlots << " on this GPU (" << op
                              << " stages a row of more than " << nq::kMaxThreads * nq::kVecsPerThread * vec
                              << " elements in shared memory), got " << hidden;
  }
  const int index =
      (((aotinfer::cutedsl::AxisPosition(nq::kKind, kind) * std::size(nq::kInput) +
         aotinfer::cutedsl::AxisPosition(nq::kInput, DtypeName(input.dtype()))) *
            std::size(nq::kOut) +
        aotinfer::cutedsl::AxisPosition(nq::kOut, DtypeName(out.dtype()))) *
           std::size(nq::kVec) +
       aotinfer::cutedsl::AxisPosition(nq::kVec, vec)) *
          std::size(nq::kStaging) +
      aotinfer::cutedsl::AxisPosition(nq::kStaging, staging);

  aotinfer::DeviceGuard guard(device);
  cudaStream_t stream = aotinfer::get_stream(input.device());
  CHECK_LAUNCH(kernels.Launch(index, dim3(p.input.rows), dim3(threads), shared_bytes, stream,
                              aotinfer::UsePdl(enable_pdl, device), p.args, device),
               op);
}

static_assert(aotinfer::cutedsl::AxisPosition(nq::kKind, std::string_view("rmsnorm")) >= 0 &&
                  aotinfer::cutedsl::AxisPosition(nq::kKind, std::string_view("fused_add_rmsnorm")) >= 0 &&
                  aotinfer::cutedsl::AxisPosition(nq::kKind, std::string_view("layernorm")) >= 0,
              "cutedsl/norm_quant.py compiles every kind these bindings launch");
static_assert(std::size(nq::kVec) == 2 && nq::kVec[1] == 1, "an 8-element variant and the 1-element fallback");
static_assert(aotinfer::cutedsl::AxisPosition(nq::kStaging, std::string_view("registers")) >= 0 &&
                  aotinfer::cutedsl::AxisPosition(nq::kStaging, std::string_view("registers_weights_first")) >= 0 &&
                  aotinfer::cutedsl::AxisPosition(nq::kStaging, std::string_view("shared")) >= 0,
              "every staging the launcher picks");

}  // namespace

// out = fp8(clamp(input / rms(input) * weight / scale)), per row.
void rmsnorm_quant(TensorView out, TensorView input, TensorView weight, TensorView scale, double scale_value,
                   double eps, int64_t enable_pdl) {
  CheckInput(input);
  nq::Params p{};
  p.input = CheckedRows(input, "input");
  p.residual = p.input;  // not read
  p.weight = CheckVector(weight, "weight", input, input.dtype(), "input's");
  p.bias = p.weight;  // not read
  bool on_device = false;
  p.scale = CheckScale(scale, scale_value, &on_device);
  CheckScalars(eps, enable_pdl);
  p.out = CheckOut(out, input);
  if (on_device) {
    aotinfer::CheckOnOneGpu({{input, "input"}, {weight, "weight"}, {scale, "scale"}, {out, "out"}});
  } else {
    aotinfer::CheckOnOneGpu({{input, "input"}, {weight, "weight"}, {out, "out"}});
  }
  p.scale_value = float(scale_value);
  p.scale_on_device = on_device;
  p.eps = float(eps);
  Run("rmsnorm", p, input, out, 2, enable_pdl, "rmsnorm_quant");
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(rmsnorm_quant, rmsnorm_quant);

// residual += input (summed in float32, stored rounded); out = fp8(clamp(rmsnorm of the float32 sum
// * weight / scale)).
void fused_add_rmsnorm_quant(TensorView out, TensorView input, TensorView residual, TensorView weight, TensorView scale,
                             double scale_value, double eps, int64_t enable_pdl) {
  CheckInput(input);
  nq::Params p{};
  p.input = CheckedRows(input, "input");
  aotinfer::CheckSameShape(residual, input, "residual", "input");
  aotinfer::CheckSameDtype(residual, input, "residual", "input");
  p.residual = CheckedRows(residual, "residual");
  p.weight = CheckVector(weight, "weight", input, input.dtype(), "input's");
  p.bias = p.weight;  // not read
  bool on_device = false;
  p.scale = CheckScale(scale, scale_value, &on_device);
  CheckScalars(eps, enable_pdl);
  p.out = CheckOut(out, input);
  if (on_device) {
    aotinfer::CheckOnOneGpu(
        {{input, "input"}, {residual, "residual"}, {weight, "weight"}, {scale, "scale"}, {out, "out"}});
  } else {
    aotinfer::CheckOnOneGpu({{input, "input"}, {residual, "residual"}, {weight, "weight"}, {out, "out"}});
  }
  p.scale_value = float(scale_value);
  p.scale_on_device = on_device;
  p.eps = float(eps);
  Run("fused_add_rmsnorm", p, input, out, 2, enable_pdl, "fused_add_rmsnorm_quant");
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(fused_add_rmsnorm_quant, fused_add_rmsnorm_quant);

// out = fp8(clamp(((input - mean) / sqrt(var + eps) * gemma + beta) / scale)), per row; gemma and
// beta float32.
void layernorm_quant(TensorView out, TensorView input, TensorView gemma, TensorView beta, TensorView scale,
                     double scale_value, double eps, int64_t enable_pdl) {
  CheckInput(input);
  nq::Params p{};
  p.input = CheckedRows(input, "input");
  p.residual = p.input;  // not read
  p.weight = CheckVector(gemma, "gemma", input, kFloat32, "float32");
  p.bias = CheckVector(beta, "beta", input, kFloat32, "float32");
  bool on_device = false;
  p.scale = CheckScale(scale, scale_value, &on_device);
  CheckScalars(eps, enable_pdl);
  p.out = CheckOut(out, input);
  if (on_device) {
    aotinfer::CheckOnOneGpu(
        {{input, "input"}, {gemma, "gemma"}, {beta, "beta"}, {scale, "scale"}, {out, "out"}});
  } else {
    aotinfer::CheckOnOneGpu({{input, "input"}, {gemma, "gemma"}, {beta, "beta"}, {out, "out"}});
  }
  p.scale_value = float(scale_value);
  p.scale_on_device = on_device;
  p.eps = float(eps);
  Run("layernorm", p, input, out, 4, enable_pdl, "layernorm_quant");
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(layernorm_quant, layernorm_quant);
