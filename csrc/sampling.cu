// Bindings of sampling (include/aotinfer/sampling.cuh): sample (every filter, from probabilities or
// logits), renorm (top-k / top-p renormalization), top_k_mask_logits, chain_speculative_sampling;
// and softmax (softmax.cuh).
//
// Filters come by name (FilterNamed): their codes, and which rows of logits sample in one kernel,
// are facts of the headers and this file alone.
//
// Per-row parameters come as a tensor of one value per output row, or as a scalar: a negative
// scalar (top_k_val, top_p_val, min_p_val, temperature_val) says "read the tensor", which must then
// have shape [batch]; otherwise the tensor is not read. seed and offset tensors with no elements
// say "use seed_val / offset_val"; otherwise they hold 1 or batch int64 values, read on the GPU,
// so that a CUDA graph replays with whatever they hold then.
#include "aotinfer/sampling.cuh"
#include "aotinfer/softmax.cuh"
#include "tvm_ffi_utils.h"

#include <vector>

namespace {

using Tensors = aotinfer::TensorsToPlace;

// A [rows, vocab] tensor with a contiguous last dimension; returns its row stride.
int64_t CheckRows(const TensorView& x, const char* name) {
  aotinfer::CheckDim(2, x, name);
  if (x.size(1) > 1 && x.stride(1) != 1) {
    AOTINFER_THROW(ValueError) << "Expected the last dimension of " << name << " to be contiguous, got strides "
                              << aotinfer::ShapeString(x.strides());
  }
  return x.size(0) > 1 ? x.stride(0) : x.size(1);
}

void CheckFloat32(const TensorView& x, const char* name) {
  if (x.dtype() != DLDataType{kDLFloat, 32, 1}) {
    AOTINFER_THROW(TypeError) << "Expected " << name << " to have dtype float32, got " << x.dtype();
  }
}

// The filters by the names the ops pass.
aotinfer::Filter FilterNamed(const tvm::ffi::String& name) {
  static constexpr std::pair<const char*, aotinfer::Filter> kNamed[] = {
      {"none", aotinfer::Filter::kNone},         {"top_k", aotinfer::Filter::kTopK},
      {"top_p", aotinfer::Filter::kTopP},        {"min_p", aotinfer::Filter::kMinP},
      {"top_k_first", aotinfer::Filter::kTopKFirst}, {"joint", aotinfer::Filter::kJoint}};
  for (const auto& [n, filter] : kNamed) {
    if (name == n) return filter;
  }
  AOTINFER_THROW(ValueError) << "Expected filter to be none, top_k, top_p, min_p, top_k_first or joint, got '"
                            << std::string(name) << "'";
}

bool IsInt(const TensorView& x, int bits) {
  return (x.dtype().code == kDLInt || x.dtype().code == kDLUInt) && x.dtype().bits == bits && x.dtype().lanes == 1;
}

// A per-row parameter: the tensor (dtype, shape [batch]) where `scalar` < 0 says to read it.
template <typename T>
aotinfer::RowParam<T> RowParamOf(const TensorView& values, double scalar, int64_t batch, const char* name,
                                 DLDataType dtype, const char* dtype_name, Tensors& on_gpu) {
  if (scalar >= 0) return aotinfer::RowParam<T>{nullptr, static_cast<T>(scalar)};
  if (values.dtype() != dtype) {
    AOTINFER_THROW(TypeError) << "Expected " << name << " to have dtype " << dtype_name << ", got " << values.dtype();
  }
  // FlashInfer's wording (its tests match it), the argument named first.
  if (values.ndim() == 0) {
    AOTINFER_THROW(ValueError) << name << ": Expected a 1D tensor of shape (batch_size,) or scalar for the sampling "
                              << "parameter, but got a 0-dimensional tensor.";
  }
  if (values.ndim() > 1) {
    AOTINFER_THROW(ValueError) << name << ": Expected a 1D tensor or scalar for the sampling parameter, but got a "
                              << values.ndim() << "D tensor of shape " << aotinfer::ShapeString(values.shape()) << ".";
  }
  if (values.size(0) != batch) {
    AOTINFER_THROW(ValueError) << name << ": Sampling parameter tensor batch size mismatch: expected length " << batch
                              << " (one value per row), but got length " << values.size(0) << ".";
  }
  aotinfer::CheckContiguous(values, name);
  on_gpu.push_back({&values, name});
  return aotinfer::RowParam<T>{aotinfer::data_ptr<T>(values), T(0)};
}

// A tensor of one element an output row (indices, valid): shape [batch], contiguous, on the GPU.
void CheckOneARow(const TensorView& values, int64_t batch, const char* name, Tensors& on_gpu) {
  if (values.ndim() != 1 || values.size(0) != batch) {
    AOTINFER_THROW(ValueError) << "Expected " << name << " to have shape [" << batch << "], got "
                              << aotinfer::ShapeString(values.shape());
  }
  aotinfer::CheckContiguous(values, name);
  on_gpu.push_back({&values, name});
}

// seed or offset: no elements (the scalar), or 1 or batch 64-bit integers.
const int64_t* RandomStateOf(const TensorView& values, int64_t batch, const char* name, int* stride, Tensors& on_gpu) {
  *stride = 0;
  if (values.numel() == 0) return nullptr;
  if (!IsInt(values, 64)) {
    AOTINFER_THROW(TypeError) << "Expected " << name << " to have dtype int64 or uint64, got " << values.dtype();
  }
  if (values.ndim() != 1 || (values.size(0) != 1 && values.size(0) != batch)) {
    AOTINFER_THROW(ValueError) << "Expected " << name << " to have shape [1] or [" << batch << "], got "
                              << aotinfer::ShapeString(values.shape());
  }
  *stride = values.size(0) == 1 ? 0 : int(values.stride(0));
  on_gpu.push_back({&values, name});
  return aotinfer::data_ptr<int64_t>(values);
}

template <typename Launch>
void Run(const TensorView& on, int64_t enable_pdl, const char* op, Launch&& launch) {
  if (aotinfer::IsStandIn(on)) return;
  const int device = on.device().device_id;
  aotinfer::DeviceGuard guard(device);
  cudaStream_t stream = aotinfer::get_stream(on.device());
  CHECK_LAUNCH(launch(device, stream, aotinfer::UsePdl(enable_pdl, device)), op);
}

}  // namespace

// out[i] = a token drawn from row indices[i] (i without indices) of probs (float32), or of
// softmax(logits) where from_logits, after the filter (FilterNamed). valid (bool [batch], or no
// elements: not wanted)[i] = whether a token was drawn: false where the filtered row holds no
// positive probability (NaN rows too; out[i] is 0) or indices[i] names no row of probs (out[i] is -1).
// scratch: from logits with a filter, float32 [rows of logits, >= vocab] with 16-byte aligned rows;
// else no elements. Float32 rows (16-byte aligned) that SamplesLogitsInOneKernel sample in one
// kernel, which writes a row's probabilities there where its floor does not apply; other logits (any
// filter, float16 and bfloat16 too) take the softmax kernel into scratch first.
void sample(TensorView out, TensorView valid, TensorView scratch, TensorView probs, TensorView indices, TensorView top_k,
            TensorView top_p, TensorView min_p, TensorView seed, TensorView offset, tvm::ffi::String filter_name,
            bool from_logits, int64_t top_k_val, double top_p_val, double min_p_val, int64_t seed_val,
            int64_t offset_val, int64_t enable_pdl) {
  const aotinfer::Filter filter = FilterNamed(filter_name);
  const bool logits_filter = from_logits && filter != aotinfer::Filter::kNone;
  const char* probs_name = from_logits ? "logits" : "probs";
  const int64_t row_stride = CheckRows(probs, probs_name);
  if (logits_filter) {
    aotinfer::CheckDtypeFp32Fp16(probs, probs_name);
  } else {
    CheckFloat32(probs, probs_name);
  }
  Tensors on_gpu{{&probs, probs_name}};
  aotinfer::CheckDim(1, out, "out");
  const int64_t batch = out.size(0);
  if (indices.numel() > 0) {
    if (!IsInt(indices, 32) && !IsInt(indices, 64)) {
      AOTINFER_THROW(TypeError) << "Expected indices to have dtype int32 or int64, got " << indices.dtype();
    }
    CheckOneARow(indices, batch, "indices", on_gpu);
  } else if (batch != 0 && batch != probs.size(0)) {  // (indices with no elements: batch 0)
    AOTINFER_THROW(ValueError) << "Expected out to have shape [" << probs.size(0) << "] (the rows of " << probs_name
                              << "), got " << aotinfer::ShapeString(out.shape());
  }
  int64_t scratch_stride = 0;
  if (logits_filter) {  // the kernels read 16-byte vectors of it
    scratch_stride = CheckRows(scratch, "scratch");
    CheckFloat32(scratch, "scratch");
    if (scratch.size(0) != probs.size(0) || scratch.size(1) < probs.size(1)) {
      AOTINFER_THROW(ValueError) << "Expected scratch to have shape [" << probs.size(0) << ", >= " << probs.size(1)
                                << "], got " << aotinfer::ShapeString(scratch.shape());
    }
    if (!aotinfer::RowsAligned<float>(aotinfer::data_ptr<float>(scratch), scratch_stride)) {
      AOTINFER_THROW(ValueError) << "Expected scratch rows to start 16-byte aligned";
    }
    on_gpu.push_back({&scratch, "scratch"});
  }
  aotinfer::SamplingParams p{};
  p.top_k = RowParamOf<int>(top_k, double(top_k_val), batch, "top_k", DLDataType{kDLInt, 32, 1}, "int32", on_gpu);
  p.top_p = RowParamOf<float>(top_p, top_p_val, batch, "top_p", DLDataType{kDLFloat, 32, 1}, "float32", on_gpu);
  p.min_p = RowParamOf<float>(min_p, min_p_val, batch, "min_p", DLDataType{kDLFloat, 32, 1}, "float32", on_gpu);
  p.seed_values = RandomStateOf(seed, batch, "seed", &p.seed_stride, on_gpu);
  p.offset_values = RandomStateOf(offset, batch, "offset", &p.offset_stride, on_gpu);
  aotinfer::CheckEnablePdl(enable_pdl);
  if (!IsInt(out, 32) && !IsInt(out, 64)) {
    AOTINFER_THROW(TypeError) << "Expected out to have dtype int32 or int64, got " << out.dtype();
  }
  aotinfer::CheckContiguous(out, "out");
  on_gpu.push_back({&out, "out"});
  if (valid.numel() > 0) {
    if (valid.dtype() != DLDataType{kDLBool, 8, 1}) {
      AOTINFER_THROW(TypeError) << "Expected valid to have dtype bool, got " << valid.dtype();
    }
    CheckOneARow(valid, batch, "valid", on_gpu);
  }
  aotinfer::CheckOnOneGpu(on_gpu);
  if (batch == 0) return;
  if (probs.size(1) == 0 || probs.size(1) > 0x7FFFFFFF) {
    AOTINFER_THROW(ValueError) << "Expected " << probs_name << " to have 1 to 2^31 - 1 columns, got " << probs.size(1);
  }
  const bool one_kernel = aotinfer::SamplesLogitsInOneKernel(filter, probs.size(1)) &&
                          probs.dtype() == DLDataType{kDLFloat, 32, 1} &&
                          aotinfer::RowsAligned<float>(aotinfer::data_ptr<float>(probs), row_stride);
  p.probs = aotinfer::data_ptr<float>(probs);
  p.row_stride = row_stride;
  if (logits_filter && !one_kernel) {  // softmax into scratch, then the probabilities' sampler reads it
    aotinfer::SoftmaxParams s{};
    s.temperature = aotinfer::RowParam<float>{nullptr, 1.f};
    s.in_stride = row_stride;
    s.out = aotinfer::data_ptr<float>(scratch);
    s.out_stride = scratch_stride;
    s.vocab = probs.size(1);
    s.rows = probs.size(0);
    DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP32_FP16(probs.dtype(), T, [&] {
      s.logits = aotinfer::data_ptr<T>(probs);
      Run(probs, enable_pdl, "softmax",
          [&](int device, cudaStream_t stream, bool pdl) { return aotinfer::Softmax<T>(s, device, stream, pdl); });
      return true;
    });
    p.probs = s.out;
    p.row_stride = scratch_stride;
    from_logits = false;
  }
  p.vocab = probs.size(1);
  p.batch = batch;
  p.num_dist_rows = probs.size(0);
  p.indices = indices.numel() > 0 ? static_cast<const void*>(aotinfer::data_ptr<char>(indices)) : nullptr;
  p.indices_int64 = indices.numel() > 0 && IsInt(indices, 64);
  p.out = aotinfer::data_ptr<char>(out);
  p.out_int64 = IsInt(out, 64);
  p.valid = valid.numel() > 0 ? aotinfer::data_ptr<bool>(valid) : nullptr;
  p.filter = filter;
  p.from_logits = from_logits;
  if (from_logits && one_kernel) {
    p.scratch = aotinfer::data_ptr<float>(scratch);
    p.scratch_stride = scratch_stride;
  }
  p.seed = seed_val;
  p.offset = offset_val;
  Run(probs, enable_pdl, from_logits ? "sampling_from_logits" : "sampling",
      [&](int device, cudaStream_t stream, bool pdl) { return aotinfer::Sample(p, device, stream, pdl); });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sample, sample);

// out = probs with the elements outside the top-k (filter top_k) or top-p (filter top_p) set zeroed,
// the rest divided by their sum; top-k in probs' dtype (float32, float16 or bfloat16), top-p float32.
void renorm(TensorView out, TensorView probs, TensorView top_k, TensorView top_p, tvm::ffi::String filter_name,
            int64_t top_k_val, double top_p_val, int64_t enable_pdl) {
  const aotinfer::Filter filter = FilterNamed(filter_name);
  if (filter != aotinfer::Filter::kTopK && filter != aotinfer::Filter::kTopP) {
    AOTINFER_THROW(ValueError) << "Expected filter to be top_k or top_p, got '" << std::string(filter_name) << "'";
  }
  const bool by_k = filter == aotinfer::Filter::kTopK;
  const int64_t in_stride = CheckRows(probs, "probs");
  if (by_k) {
    aotinfer::CheckDtypeFp32Fp16(probs, "probs");
  } else {
    CheckFloat32(probs, "probs");
  }
  Tensors on_gpu{{&probs, "probs"}};
  const int64_t rows = probs.size(0);
  aotinfer::RenormParams p{};
  p.filter = filter;
  if (by_k) {
    p.top_k = RowParamOf<int>(top_k, double(top_k_val), rows, "top_k", DLDataType{kDLInt, 32, 1}, "int32", on_gpu);
  } else {
    p.top_p = RowParamOf<float>(top_p, top_p_val, rows, "top_p", DLDataType{kDLFloat, 32, 1}, "float32", on_gpu);
  }
  aotinfer::CheckEnablePdl(enable_pdl);
  aotinfer::CheckSameShape(out, probs, "out", "probs");
  aotinfer::CheckSameDtype(out, probs, "out", "probs");
  const int64_t out_stride = CheckRows(out, "out");
  on_gpu.push_back({&out, "out"});
  aotinfer::CheckOnOneGpu(on_gpu);
  if (probs.numel() == 0) return;
  p.in_stride = in_stride;
  p.out_stride = out_stride;
  p.vocab = probs.size(1);
  p.rows = rows;
  DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP32_FP16(probs.dtype(), T, [&] {
    p.input = aotinfer::data_ptr<T>(probs);
    p.out = aotinfer::data_ptr<T>(out);
    Run(probs, enable_pdl, by_k ? "top_k_renorm_probs" : "top_p_renorm_probs",
        [&](int device, cudaStream_t stream, bool pdl) { return aotinfer::Renorm<T>(p, device, stream, pdl); });
    return true;
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(renorm, renorm);

// out = logits where among the top k of the row, else -inf.
void top_k_mask_logits(TensorView out, TensorView logits, TensorView top_k, int64_t top_k_val, int64_t enable_pdl) {
  const int64_t in_stride = CheckRows(logits, "logits");
  aotinfer::CheckDtypeFp32Fp16(logits, "logits");
  Tensors on_gpu{{&logits, "logits"}};
  const int64_t rows = logits.size(0);
  aotinfer::RenormParams p{};
  p.filter = aotinfer::Filter::kTopK;
  p.top_k = RowParamOf<int>(top_k, double(top_k_val), rows, "top_k", DLDataType{kDLInt, 32, 1}, "int32", on_gpu);
  aotinfer::CheckEnablePdl(enable_pdl);
  aotinfer::CheckSameShape(out, logits, "out", "logits");
  aotinfer::CheckSameDtype(out, logits, "out", "logits");
  const int64_t out_stride = CheckRows(out, "out");
  on_gpu.push_back({&out, "out"});
  aotinfer::CheckOnOneGpu(on_gpu);
  if (logits.numel() == 0) return;
  p.in_stride = in_stride;
  p.out_stride = out_stride;
  p.vocab = logits.size(1);
  p.rows = rows;
  DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP32_FP16(logits.dtype(), T, [&] {
    p.input = aotinfer::data_ptr<T>(logits);
    p.out = aotinfer::data_ptr<T>(out);
    Run(logits, enable_pdl, "top_k_mask_logits",
        [&](int device, cudaStream_t stream, bool pdl) { return aotinfer::MaskLogits<T>(p, device, stream, pdl); });
    return true;
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(top_k_mask_logits, top_k_mask_logits);

// out (float32) = softmax(logits / temperature) over each row.
void softmax(TensorView out, TensorView logits, TensorView temperature, double temperature_val, int64_t enable_pdl) {
  const int64_t in_stride = CheckRows(logits, "logits");
  aotinfer::CheckDtypeFp32Fp16(logits, "logits");
  Tensors on_gpu{{&logits, "logits"}};
  const int64_t rows = logits.size(0);
  aotinfer::SoftmaxParams p{};
  p.temperature = RowParamOf<float>(temperature, temperature_val, rows, "temperature", DLDataType{kDLFloat, 32, 1},
                                    "float32", on_gpu);
  aotinfer::CheckEnablePdl(enable_pdl);
  aotinfer::CheckDim(2, out, "out");
  if (out.size(0) != rows || out.size(1) != logits.size(1)) {
    AOTINFER_THROW(ValueError) << "Expected out to have shape " << aotinfer::ShapeString(logits.shape()) << ", got "
                              << aotinfer::ShapeString(out.shape());
  }
  CheckFloat32(out, "out");
  const int64_t out_stride = CheckRows(out, "out");
  on_gpu.push_back({&out, "out"});
  aotinfer::CheckOnOneGpu(on_gpu);
  if (logits.numel() == 0) return;
  p.in_stride = in_stride;
  p.out = aotinfer::data_ptr<float>(out);
  p.out_stride = out_stride;
  p.vocab = logits.size(1);
  p.rows = rows;
  DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP32_FP16(logits.dtype(), T, [&] {
    p.logits = aotinfer::data_ptr<T>(logits);
    Run(logits, enable_pdl, "softmax",
        [&](int device, cudaStream_t stream, bool pdl) { return aotinfer::Softmax<T>(p, device, stream, pdl); });
    return true;
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(softmax, softmax);

// out [batch, n + 1] int32 = the accepted draft tokens, the token drawn at the first rejection (or
// the bonus token), then -1; accepted and emitted (int32 [batch]) are added to
// (include/aotinfer/sampling/speculative.cuh). draft_probs float32 [batch, n, vocab], draft_token_ids
// int32 or int64 [batch, n], target_probs float32 [batch, n + 1, vocab], all contiguous.
void chain_speculative_sampling(TensorView out, TensorView accepted, TensorView emitted, TensorView draft_probs,
                                TensorView draft_token_ids, TensorView target_probs, TensorView seed, TensorView offset,
                                int64_t seed_val, int64_t offset_val, int64_t enable_pdl) {
  aotinfer::CheckDim(3, draft_probs, "draft_probs");
  aotinfer::CheckDim(3, target_probs, "target_probs");
  aotinfer::CheckDim(2, draft_token_ids, "draft_token_ids");
  CheckFloat32(draft_probs, "draft_probs");
  CheckFloat32(target_probs, "target_probs");
  const int64_t batch = draft_probs.size(0), n = draft_probs.size(1), vocab = draft_probs.size(2);
  if (target_probs.size(0) != batch || target_probs.size(1) != n + 1 || target_probs.size(2) != vocab) {
    AOTINFER_THROW(ValueError) << "Expected target_probs to have shape [" << batch << ", " << n + 1 << ", " << vocab
                              << "] (draft_probs' batch, one more position, its vocabulary), got "
                              << aotinfer::ShapeString(target_probs.shape());
  }
  if (draft_token_ids.size(0) != batch || draft_token_ids.size(1) != n) {
    AOTINFER_THROW(ValueError) << "Expected draft_token_ids to have shape [" << batch << ", " << n
                              << "] (draft_probs' first two dimensions), got "
                              << aotinfer::ShapeString(draft_token_ids.shape());
  }
  if (!IsInt(draft_token_ids, 32) && !IsInt(draft_token_ids, 64)) {
    AOTINFER_THROW(TypeError) << "Expected draft_token_ids to have dtype int32 or int64, got " << draft_token_ids.dtype();
  }
  if (vocab > 0x7FFFFFFF || n >= 0x7FFFFFFF) {
    AOTINFER_THROW(ValueError) << "Expected draft_probs to have fewer than 2^31 positions and vocabulary entries, got "
                              << aotinfer::ShapeString(draft_probs.shape());
  }
  aotinfer::CheckDim(2, out, "out");
  if (out.size(0) != batch || out.size(1) != n + 1 || !IsInt(out, 32)) {
    AOTINFER_THROW(ValueError) << "Expected out to be int32 [" << batch << ", " << n + 1 << "], got "
                              << out.dtype() << " " << aotinfer::ShapeString(out.shape());
  }
  Tensors on_gpu{{&draft_probs, "draft_probs"}, {&target_probs, "target_probs"}, {&draft_token_ids, "draft_token_ids"},
                 {&out, "out"}};
  for (auto [counter, name] : {std::pair{&accepted, "maybe_output_accepted_token_num"},
                               std::pair{&emitted, "maybe_output_emitted_draft_token_num"}}) {
    if (!IsInt(*counter, 32)) {
      AOTINFER_THROW(TypeError) << "Expected " << name << " to have dtype int32, got " << counter->dtype();
    }
    CheckOneARow(*counter, batch, name, on_gpu);
  }
  for (auto [tensor, name] : {std::pair{&draft_probs, "draft_probs"}, std::pair{&target_probs, "target_probs"},
                              std::pair{&draft_token_ids, "draft_token_ids"}, std::pair{&out, "out"}}) {
    aotinfer::CheckContiguous(*tensor, name);
  }
  aotinfer::ChainSpeculativeParams p{};
  p.seed_values = RandomStateOf(seed, batch, "seed", &p.seed_stride, on_gpu);
  p.offset_values = RandomStateOf(offset, batch, "offset", &p.offset_stride, on_gpu);
  aotinfer::CheckEnablePdl(enable_pdl);
  aotinfer::CheckOnOneGpu(on_gpu);
  if (batch == 0) return;
  if (vocab == 0) AOTINFER_THROW(ValueError) << "Expected draft_probs to have a vocabulary of at least 1 token, got 0";
  p.draft_probs = aotinfer::data_ptr<float>(draft_probs);
  p.draft_ids = aotinfer::data_ptr<char>(draft_token_ids);
  p.draft_ids_int64 = IsInt(draft_token_ids, 64);
  p.target_probs = aotinfer::data_ptr<float>(target_probs);
  p.out = aotinfer::data_ptr<int32_t>(out);
  p.accepted = aotinfer::data_ptr<int32_t>(accepted);
  p.emitted = aotinfer::data_ptr<int32_t>(emitted);
  p.n = int(n);
  p.vocab = vocab;
  p.seed = seed_val;
  p.offset = offset_val;
  Run(draft_probs, enable_pdl, "chain_speculative_sampling", [&](int, cudaStream_t stream, bool pdl) {
    return aotinfer::ChainSpeculativeSample(p, batch, stream, pdl);
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(chain_speculative_sampling, chain_speculative_sampling);
