// Bindings of attention-state merging (include/aotinfer/cascade.cuh): merge_state (two states),
// merge_state_in_place (into the first, where a mask allows) and merge_states (N states).
// Values v are [seq, heads, head_dim] (merge_states: [seq, states, heads, head_dim]) of float16,
// bfloat16 or float32, LSEs s float32 [seq, heads] (base 2); all contiguous.
#include "aotinfer/cascade.cuh"
#include "tvm_ffi_utils.h"

#include <functional>

namespace {

void CheckLse(const TensorView& s, const TensorView& v, const char* name) {
  if (s.dtype() != DLDataType{kDLFloat, 32, 1}) {
    TVM_FFI_THROW(TypeError) << "Expected " << name << " to be float32, got " << s.dtype();
  }
  bool same = s.ndim() == v.ndim() - 1;
  for (int i = 0; same && i < s.ndim(); ++i) same = s.size(i) == v.size(i);
  if (!same) {
    TVM_FFI_THROW(ValueError) << "Expected " << name << " to have the shape of its values without head_dim, "
                              << aotinfer::ShapeString(v.shape()) << ", got " << aotinfer::ShapeString(s.shape());
  }
  aotinfer::CheckContiguous(s, name);
}

void CheckValues(const TensorView& v, int ndim, const char* name) {
  aotinfer::CheckDim(ndim, v, name);
  aotinfer::CheckDtypeFp32Fp16(v, name);
  aotinfer::CheckContiguous(v, name);
}

void CheckOnDevice(std::initializer_list<std::pair<const TensorView*, const char*>> tensors) {
  const TensorView& first = *tensors.begin()->first;
  for (auto [t, name] : tensors) {
    aotinfer::CheckCuda(*t, name);
    aotinfer::CheckSameDevice(*t, first, name, tensors.begin()->second);
  }
}

template <typename T>
aotinfer::MergeParams<T> Params(const TensorView& v_out, const TensorView& s_out, const TensorView& v,
                                const TensorView& s, int64_t num_heads, int64_t head_dim, int num_states) {
  aotinfer::MergeParams<T> p{};
  p.v_out = aotinfer::data_ptr<T>(v_out);
  p.s_out = aotinfer::data_ptr<float>(s_out);
  p.v = aotinfer::data_ptr<T>(v);
  p.s = aotinfer::data_ptr<float>(s);
  p.v_stride_n = v.stride(0);
  p.s_stride_n = s.stride(0);
  p.v_stride_state = num_heads * head_dim;
  p.s_stride_state = num_heads;
  p.seq_len = v.size(0);
  p.num_heads = int(num_heads);
  p.head_dim = int(head_dim);
  p.num_states = num_states;
  return p;
}

// Two separate tensors as states 0 and 1: state 1 lies (second - first) elements past state 0.
template <typename T>
void SecondStateAt(aotinfer::MergeParams<T>* p, const TensorView& v_b, const TensorView& s_b) {
  p->v_stride_state = aotinfer::data_ptr<T>(v_b) - p->v;
  p->s_stride_state = aotinfer::data_ptr<float>(s_b) - p->s;
}

void Run(const TensorView& on, int64_t enable_pdl, const char* op, const std::function<cudaError_t(cudaStream_t, bool)>& launch) {
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
  CheckOnDevice({{&v_a, "v_a"}, {&s_a, "s_a"}, {&v_b, "v_b"}, {&s_b, "s_b"}, {&v_merged, "v_merged"},
                 {&s_merged, "s_merged"}});
  Run(v_a, enable_pdl, "merge_state", [&](cudaStream_t stream, bool pdl) {
    cudaError_t status = cudaSuccess;
    DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP32_FP16(v_a.dtype(), T, [&] {
      auto p = Params<T>(v_merged, s_merged, v_a, s_a, v_a.size(1), v_a.size(2), 2);
      SecondStateAt(&p, v_b, s_b);
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
      TVM_FFI_THROW(TypeError) << "Expected mask to be bool, got " << mask.dtype();
    }
    if (mask.ndim() != 1 || mask.size(0) != v.size(0)) {
      TVM_FFI_THROW(ValueError) << "Expected mask to have shape [" << v.size(0) << "], got "
                                << aotinfer::ShapeString(mask.shape());
    }
    aotinfer::CheckContiguous(mask, "mask");
  }
  aotinfer::CheckEnablePdl(enable_pdl);
  CheckOnDevice({{&v, "v"}, {&s, "s"}, {&v_other, "v_other"}, {&s_other, "s_other"}});
  if (masked) CheckOnDevice({{&v, "v"}, {&mask, "mask"}});
  Run(v, enable_pdl, "merge_state_in_place", [&](cudaStream_t stream, bool pdl) {
    cudaError_t status = cudaSuccess;
    DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP32_FP16(v.dtype(), T, [&] {
      auto p = Params<T>(v, s, v, s, v.size(1), v.size(2), 2);
      SecondStateAt(&p, v_other, s_other);
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
    TVM_FFI_THROW(ValueError) << "Expected v_merged to have shape [" << v.size(0) << ", " << v.size(2) << ", "
                              << v.size(3) << "], got " << aotinfer::ShapeString(v_merged.shape());
  }
  CheckLse(s_merged, v_merged, "s_merged");
  CheckOnDevice({{&v, "v"}, {&s, "s"}, {&v_merged, "v_merged"}, {&s_merged, "s_merged"}});
  Run(v, enable_pdl, "merge_states", [&](cudaStream_t stream, bool pdl) {
    cudaError_t status = cudaSuccess;
    DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP32_FP16(v.dtype(), T, [&] {
      auto p = Params<T>(v_merged, s_merged, v, s, v.size(2), v.size(3), int(v.size(1)));
      p.v_stride_state = v.stride(1);
      p.s_stride_state = s.stride(1);
      status = aotinfer::MergeStates(p, stream, pdl);
      return true;
    });
    return status;
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(merge_states, merge_states);
