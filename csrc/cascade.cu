// PLACEHOLDER for issue 14, replaced by the lead's csrc/cascade.cu at merge: it exports the merge
// functions with the signatures that modules.toml declares, refuses tensors that are not on a GPU
// (as the real bindings do, so the CPU tests of the Python side run), and otherwise throws
// NotImplementedError. It holds no kernel.
#include "tvm_ffi_utils.h"

void merge_state(TensorView v_merged, TensorView s_merged, TensorView v_a, TensorView s_a, TensorView v_b,
                 TensorView s_b, int64_t enable_pdl) {
  CHECK_CUDA(v_merged);
  CHECK_CUDA(v_a);
  CHECK_CUDA(s_a);
  CHECK_CUDA(v_b);
  CHECK_CUDA(s_b);
  TVM_FFI_THROW(NotImplementedError) << "merge_state: placeholder binding (issue 14), no kernel";
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(merge_state, merge_state);

void merge_state_in_place(TensorView v, TensorView s, TensorView v_other, TensorView s_other, TensorView mask,
                          int64_t enable_pdl) {
  CHECK_CUDA(v);
  CHECK_CUDA(s);
  CHECK_CUDA(v_other);
  CHECK_CUDA(s_other);
  TVM_FFI_THROW(NotImplementedError) << "merge_state_in_place: placeholder binding (issue 14), no kernel";
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(merge_state_in_place, merge_state_in_place);

void merge_states(TensorView v_merged, TensorView s_merged, TensorView v, TensorView s, int64_t enable_pdl) {
  CHECK_CUDA(v_merged);
  CHECK_CUDA(v);
  CHECK_CUDA(s);
  TVM_FFI_THROW(NotImplementedError) << "merge_states: placeholder binding (issue 14), no kernel";
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(merge_states, merge_states);
