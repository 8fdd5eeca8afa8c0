// Binding of batch prefill attention (include/aotinfer/prefill.cuh, mma.sync for every arch from
// sm80): checks the tensors and the plan's tables (prefill_checks.h), then launches the prefill
// kernel on num_kv_heads x `ctas` blocks and, unless `merge_from` is -1, the merge of split
// requests from that query token on.
#include "prefill_checks.h"

namespace {

template <typename T>
cudaError_t Dispatch(const aotinfer::PrefillParams& p, int64_t head_dim, bool fp8, int ctas, int merge_from, int q_tokens,
                     cudaStream_t stream, bool pdl, int device) {
  switch (head_dim) {
    case 64: return aotinfer::BatchPrefill<T, 64>(p, fp8, ctas, merge_from, q_tokens, stream, pdl, device);
    case 128: return aotinfer::BatchPrefill<T, 128>(p, fp8, ctas, merge_from, q_tokens, stream, pdl, device);
    default: return aotinfer::BatchPrefill<T, 256>(p, fp8, ctas, merge_from, q_tokens, stream, pdl, device);
  }
}

}  // namespace

// Prefill attention over the planned work items (the tensors: CheckPrefill).
void batch_prefill(TensorView out, TensorView lse, TensorView partial_out, TensorView partial_lse, TensorView q,
                   TensorView k, TensorView v, TensorView indices, TensorView work, TensorView requests,
                   TensorView sinks, int64_t captured, int64_t kv_layout, double sm_scale, double logits_soft_cap, int64_t window_left,
                   double v_scale, bool causal, int64_t ctas, int64_t merge_from, int64_t enable_pdl) {
  // 1. Validate; 2. guard the device; 3. get the stream (and record a capture); 4. dispatch and launch.
  const aotinfer::CheckedPrefill checked = aotinfer::CheckPrefill(
      out, lse, partial_out, partial_lse, q, k, v, indices, work, requests, sinks, kv_layout, sm_scale,
      logits_soft_cap, window_left, v_scale, causal, ctas, merge_from, enable_pdl);
  if (aotinfer::IsStandIn(q)) return;
  const int device = q.device().device_id;
  aotinfer::DeviceGuard guard(device);
  cudaStream_t stream = aotinfer::get_stream(q.device());
  aotinfer::RecordCapture(captured, stream);  // an empty batch too: its replay would launch nothing
  if (checked.empty) return;
  const bool pdl = aotinfer::UsePdl(enable_pdl, device);
  DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP16(q.dtype(), T, [&] {
    CHECK_LAUNCH(Dispatch<T>(checked.params, checked.head_dim, checked.fp8, int(ctas), checked.merge_from,
                             int(checked.total_q), stream, pdl, device),
                 "batch_prefill");
    return true;
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(batch_prefill, batch_prefill);
