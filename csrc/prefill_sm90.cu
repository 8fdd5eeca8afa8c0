// Binding of the Hopper batch prefill (include/aotinfer/prefill_sm90.cuh, wgmma, sm90a only): the
// signature and checks of batch_prefill (prefill_checks.h), for 16-bit K and V and head_dim 64,
// 128, 256 or 192 (v's 128); the launch on num_kv_heads x `ctas` blocks (one an SM) and, unless `merge_from` is
// -1, the merge of split requests from that query token on.
#include "aotinfer/prefill_sm90.cuh"
#include "prefill_checks.h"

// Prefill attention over the planned work items (the tensors: CheckPrefill).
void batch_prefill_sm90(TensorView out, TensorView lse, TensorView partial_out, TensorView partial_lse, TensorView q,
                        TensorView k, TensorView v, TensorView indices, TensorView work, TensorView requests,
                        TensorView sinks, int64_t captured, int64_t kv_layout, double sm_scale, double logits_soft_cap,
                        int64_t window_left, double v_scale, bool causal, int64_t ctas, int64_t merge_from,
                        int64_t enable_pdl) {
  // 1. Validate; 2. guard the device; 3. get the stream (and record a capture); 4. dispatch and launch.
  const aotinfer::CheckedPrefill checked = aotinfer::CheckPrefill(
      out, lse, partial_out, partial_lse, q, k, v, indices, work, requests, sinks, kv_layout, sm_scale,
      logits_soft_cap, window_left, v_scale, causal, ctas, merge_from, enable_pdl);
  if (checked.fp8) {
    AOTINFER_THROW(TypeError) << "Expected k of q's dtype " << q.dtype() << " for this backend, got " << k.dtype()
                             << " (fp8 caches: the fa2 backend)";
  }
  if (checked.head_dim != 64 && checked.head_dim != 128 && checked.head_dim != 256 &&
      checked.head_dim != aotinfer::kDeepSeekHeadDimQk) {
    AOTINFER_THROW(ValueError) << "Expected head_dim 64, 128, 256 or 192 for this backend, got " << checked.head_dim;
  }
  if (aotinfer::IsStandIn(q)) return;
  const int device = q.device().device_id;
  aotinfer::DeviceGuard guard(device);
  cudaStream_t stream = aotinfer::get_stream(q.device());
  aotinfer::RecordCapture(captured, stream);  // an empty batch too: its replay would launch nothing
  if (checked.empty) return;
  const bool pdl = aotinfer::UsePdl(enable_pdl, device);
  if (!aotinfer::HasSm90aFeatures()) {
    AOTINFER_THROW(RuntimeError) << "batch_prefill_sm90: this build has no sm_90a code (its arch list named 9.0, not 9.0a): "
                                 << "rebuild with AOTINFER_CUDA_ARCH_LIST=9.0a, or plan with backend='fa2'";
  }
  DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP16(q.dtype(), T, [&] {
    const auto launch = checked.head_dim == 64    ? aotinfer::BatchPrefillSm90<T, 64>
                        : checked.head_dim == 128 ? aotinfer::BatchPrefillSm90<T, 128>
                        : checked.head_dim == 256 ? aotinfer::BatchPrefillSm90<T, 256>
                                                  : aotinfer::BatchPrefillSm90<T, aotinfer::kDeepSeekHeadDimQk, aotinfer::kDeepSeekHeadDimVo>;
    CHECK_LAUNCH(launch(checked.params, checked.paged, int(checked.total_q), k.size(0), int(ctas), checked.merge_from,
                        stream, pdl, device),
                 "batch_prefill_sm90");
    return true;
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(batch_prefill_sm90, batch_prefill_sm90);
