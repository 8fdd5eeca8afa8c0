// Binding of paged decode attention (include/aotinfer/decode.cuh): checks the tensors and the
// plan's tables (decode_checks.h), then launches the decode kernel over the planned work items
// and, where `max_partials` (the most items a request may have) is more than the kernel merges
// itself, the merge kernel.
#include "decode_checks.h"

namespace {

using aotinfer::DtypeKey;

template <typename T, typename KV>
cudaError_t Dispatch(const aotinfer::DecodeParams& p, int64_t head_dim, int num_items, bool merge,
                     cudaStream_t stream, bool pdl, int device) {
  switch (head_dim) {
    case 64: return aotinfer::BatchDecode<T, KV, 64>(p, num_items, merge, stream, pdl, device);
    case 128: return aotinfer::BatchDecode<T, KV, 128>(p, num_items, merge, stream, pdl, device);
    default: return aotinfer::BatchDecode<T, KV, 256>(p, num_items, merge, stream, pdl, device);
  }
}

}  // namespace

// Decode attention over the planned work items (the tensors: CheckDecode); kv_read_once: the K and
// V copies cached evict-first in L2 (the plan's choice), else normally.
void batch_decode(TensorView out, TensorView lse, TensorView partial_out, TensorView partial_lse, TensorView q,
                  TensorView k_cache, TensorView v_cache, TensorView indices, TensorView work, TensorView requests,
                  TensorView counters, TensorView sinks, int64_t captured, int64_t kv_layout, double sm_scale,
                  double logits_soft_cap, int64_t window_left, double v_scale, int64_t max_partials, int64_t kv_read_once,
                  int64_t enable_pdl) {
  // 1. Validate; 2. guard the device; 3. get the stream (and record a capture); 4. dispatch and launch.
  const aotinfer::CheckedDecode checked = aotinfer::CheckDecode(
      out, lse, partial_out, partial_lse, q, k_cache, v_cache, indices, work, requests, counters, sinks, kv_layout,
      sm_scale, logits_soft_cap, window_left, v_scale, kv_read_once, enable_pdl);
  if (aotinfer::IsStandIn(q)) return;
  const int device = q.device().device_id;
  aotinfer::DeviceGuard guard(device);
  cudaStream_t stream = aotinfer::get_stream(q.device());
  aotinfer::RecordCapture(captured, stream);  // an empty batch too: its replay would launch nothing
  if (checked.empty) return;
  const bool pdl = aotinfer::UsePdl(enable_pdl, device);
  const bool merge = max_partials > aotinfer::kFusedMergeParts;
  const aotinfer::DecodeParams& p = checked.params;
  const int64_t head_dim = checked.head_dim;
  const int num_items = checked.num_items;
  const uint32_t kv_key = checked.kv_key;
  DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP16(q.dtype(), T, [&] {
    cudaError_t status;
    if (kv_key == DtypeKey(kDLFloat8_e4m3fn, 8)) {
      status = Dispatch<T, __nv_fp8_e4m3>(p, head_dim, num_items, merge, stream, pdl, device);
    } else if (kv_key == DtypeKey(kDLFloat8_e5m2, 8)) {
      status = Dispatch<T, __nv_fp8_e5m2>(p, head_dim, num_items, merge, stream, pdl, device);
    } else {
      status = Dispatch<T, T>(p, head_dim, num_items, merge, stream, pdl, device);
    }
    CHECK_LAUNCH(status, "batch_decode");
    return true;
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(batch_decode, batch_decode);
