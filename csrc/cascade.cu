// Bindings of attention-state merging (include/aotinfer/cascade.cuh): merge_state (two states),
// merge_state_in_place (into the first, where a mask allows) and merge_states (N states).
// Values v are [seq, heads, head_dim] (merge_states: [seq, states, heads, head_dim]) of float16,
// bfloat16 or float32 with head_dim contiguous, LSEs s float32 [seq, heads] (base 2); other
// strides are free.
#include "aotinfer/cascade.cuh"
#include "tvm_ffi_utils.h"

#include <functional>

namespace {

void CheckLse(const TensorView& s, const TensorView& v, const char* name) {
  if (s.dtype() != DLDataType{kDLFloat, 32, 1}) {
    AOTINFER_THROW(TypeError) << "Expected " << name << " to be float32, got " << s.dtype();
  }
  bool same = s.ndim() == v.ndim() - 1;
  for (int i = 0; same && i < s.ndim(); ++i) same = s.size(i) == v.size(i);
  if (!same) {
    AOTINFER_THROW(ValueError) << "Expected " << name << " to have the shape of its values without head_dim, "
                              << aotinfer::ShapeString(v.shape()) << ", got " << aotinfer::ShapeString(s.shape());
  }
}

void CheckValues(const TensorView& v, int ndim, const char* name) {
  aotinfer::CheckDim(ndim, v, name);
  aotinfer::CheckDtypeFp32Fp16(v, name);
  if (v.size(-1) > 1 && v.stride(-1) != 1) {
    AOTINFER_THROW(ValueError) << "Expected the last dimension of " << name << " to be contiguous, got strides "
                              << aotinfer::ShapeString(v.strides());
  }
}

// The states of v [seq, (states,) heads, head_dim] and s [seq, (states,) heads].
template <typename T>
aotinfer::StateSet<T> States(const TensorView& v, const TensorView& s) {
  const bool several = v.ndim() == 4;
  aotinfer::StateSet<T> set{};
  set.v = aotinfer::data_ptr<T>(v);
  set.s = aotinfer::data_ptr<float>(s);
  set.v_stride_n = v.stride(0);
  set.v_stride_state = several ? v.stride(1) : 0;
  set.v_stride_h = v.stride(several ? 2 : 1);
  set.s_stride_n = s.stride(0);
  set.s_stride_state = several ? s.stride(1) : 0;
  set.s_stride_h = s.stride(several ? 2 : 1);
  set.count = several ? int(v.size(1)) : 1;
  return set;
}

template <typename T>
aotinfer::MergeParams<T> Params(const TensorView& v_out, const TensorView& s_out, const TensorView& v,
                                const TensorView& s) {
  aotinfer::MergeParams<T> p{};
  p.v_out = aotinfer::data_ptr<T>(v_out);
  p.s_out = aotinfer::data_ptr<float>(s_out);
  p.v_out_stride_n = v_out.stride(0);
  p.v_out_stride_h = v_out.stride(1);
  p.s_out_stride_n = s_out.stride(0);
  p.s_out_stride_h = s_out.stride(1);
  p.sets[0] = States<T>(v, s);
  p.num_sets = 1;
  p.seq_len = v_out.size(0);
  p.num_heads = int(v_out.size(1));
  p.head_dim = int(v_out.size(2));
  return p;
}

void Run(const TensorView& on, int64_t enable_pdl, const char* op, const std::function<cudaError_t(cudaStream_t, bool)>& launch) {
  if (aotinfer::IsStandIn(on)) return;
  const int device = on.device().device_id;
  aotinfer::DeviceGuard guard(device);
  cudaStream_t stream = aotinfer::get_stream(on.device());
  CHECK_LAUNCH(launch(stream, aotinfer::UsePdl(enable_pdl, device)), op);
}

}  // namespace

// (v_merged, s_merged) = merge of (v_a, s_a) and (v_b, s_b).
void merge_state(TensorView v_merged, TensorView s_merged, TensorView v_a, TensorView s_a, TensorView v_b,
                 TensorView s_b, int64_t enable_pdl) {
  CheckValues(v_a, 3, "v_a");
  CheckLse(s_a, v_a, "s_a");
  CheckValues(v_b, 3, "v_b");
  aotinfer::CheckSameShape(v_b, v_a, "v_b", "v_a");
  aotinfer::CheckSameDtype(v_b, v_a, "v_b", "v_a");
  CheckLse(s_b, v_b, "s_b");
  aotinfer::CheckEnablePdl(enable_pdl);
  CheckValues(v_merged, 3, "v_merged");
  aotinfer::CheckSameShape(v_merged, v_a, "v_merged", "v_a");
  aotinfer::CheckSameDtype(v_merged, v_a, "v_merged", "v_a");
  CheckLse(s_merged, v_merged, "s_merged");
  aotinfer::CheckOnOneGpu({{v_a, "v_a"}, {s_a, "s_a"}, {v_b, "v_b"}, {s_b, "s_b"}, {v_merged, "v_merged"},
                          {s_merged, "s_merged"}});
  Run(v_a, enable_pdl, "merge_state", [&](cudaStream_t stream, bool pdl) {
    cudaError_t status = cudaSuccess;
    DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP32_FP16(v_a.dtype(), T, [&] {
      auto p = Params<T>(v_merged, s_merged, v_a, s_a);
      p.sets[1] = States<T>(v_b, s_b);
      p.num_sets = 2;
      status = aotinfer::MergeStates(p, stream, pdl);
      return true;
    });
    return status;
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(merge_state, merge_state);

// (v, s) = merge of (v, s) and (v_other, s_other), in place, for the tokens where mask is true
// (every token when mask has no elements).
void merge_state_in_place(TensorView v, TensorView s, TensorView v_other, TensorView s_other, TensorView mask,
                          int64_t enable_pdl) {
  CheckValues(v, 3, "v");
  CheckLse(s, v, "s");
  CheckValues(v_other, 3, "v_other");
  aotinfer::CheckSameShape(v_other, v, "v_other", "v");
  aotinfer::CheckSameDtype(v_other, v, "v_other", "v");
  CheckLse(s_other, v_other, "s_other");
  const bool masked = mask.numel() > 0;  // no elements: no mask
  if (masked) {
    if (mask.dtype() != DLDataType{kDLBool, 8, 1}) {
      AOTINFER_THROW(TypeError) << "Expected mask to be bool, got " << mask.dtype();
    }
    if (mask.ndim() != 1 || mask.size(0) != v.size(0)) {
      AOTINFER_THROW(ValueError) << "Expected mask to have shape [" << v.size(0) << "], got "
                                << aotinfer::ShapeString(mask.shape());
    }
    aotinfer::CheckContiguous(mask, "mask");
  }
  aotinfer::CheckEnablePdl(enable_pdl);
  aotinfer::CheckOnOneGpu({{v, "v"}, {s, "s"}, {v_other, "v_other"}, {s_other, "s_other"}});
  if (masked) aotinfer::CheckOnOneGpu({{v, "v"}, {mask, "mask"}});
  Run(v, enable_pdl, "merge_state_in_place", [&](cudaStream_t stream, bool pdl) {
    cudaError_t status = cudaSuccess;
    DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP32_FP16(v.dtype(), T, [&] {
      auto p = Params<T>(v, s, v, s);
      p.sets[1] = States<T>(v_other, s_other);
      p.num_sets = 2;
      p.mask = masked ? aotinfer::data_ptr<bool>(mask) : nullptr;
      status = aotinfer::MergeStates(p, stream, pdl);
      return true;
    });
    return status;
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(merge_state_in_place, merge_state_in_place);

// (v_merged, s_merged) = merge of the states of v [seq, states, heads, head_dim], s [seq, states, heads].
void merge_states(TensorView v_merged, TensorView s_merged, TensorView v, TensorView s, int64_t enable_pdl) {
  CheckValues(v, 4, "v");
  CheckLse(s, v, "s");
  aotinfer::CheckEnablePdl(enable_pdl);
  CheckValues(v_merged, 3, "v_merged");
  aotinfer::CheckSameDtype(v_merged, v, "v_merged", "v");
  if (v_merged.size(0) != v.size(0) || v_merged.size(1) != v.size(2) || v_merged.size(2) != v.size(3)) {
    AOTINFER_THROW(ValueError) << "Expected v_merged to have shape [" << v.size(0) << ", " << v.size(2) << ", "
                              << v.size(3) << "], got " << aotinfer::ShapeString(v_merged.shape());
  }
  CheckLse(s_merged, v_merged, "s_merged");
  aotinfer::CheckOnOneGpu({{v, "v"}, {s, "s"}, {v_merged, "v_merged"}, {s_merged, "s_merged"}});
  Run(v, enable_pdl, "merge_states", [&](cudaStream_t stream, bool pdl) {
    cudaError_t status = cudaSuccess;
    DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP32_FP16(v.dtype(), T, [&] {
      auto p = Params<T>(v_merged, s_merged, v, s);
      status = aotinfer::MergeStates(p, stream, pdl);
      return true;
    });
    return status;
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(merge_states, merge_states);
