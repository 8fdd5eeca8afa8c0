// PLACEHOLDER for issue 14, replaced by the lead's csrc/decode.cu at merge: it exports
// batch_decode with the signature that modules.toml declares, refuses tensors that are not on a
// GPU (as the real binding does, so the CPU tests of the Python side run), and otherwise throws
// NotImplementedError. It holds no kernel.
#include "tvm_ffi_utils.h"

void batch_decode(TensorView out, TensorView lse, TensorView partial_out, TensorView partial_lse, TensorView q,
                  TensorView k_cache, TensorView v_cache, TensorView indices, TensorView work, TensorView requests,
                  TensorView sinks, int64_t kv_layout, double sm_scale, double logits_soft_cap, int64_t window_left,
                  double v_scale, bool merge, int64_t enable_pdl) {
  CHECK_CUDA(out);
  CHECK_CUDA(q);
  CHECK_CUDA(k_cache);
  CHECK_CUDA(v_cache);
  CHECK_CUDA(indices);
  CHECK_CUDA(work);
  CHECK_CUDA(requests);
  TVM_FFI_THROW(NotImplementedError) << "batch_decode: placeholder binding (issue 14), no kernel";
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(batch_decode, batch_decode);
