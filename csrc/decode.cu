// Binding of paged decode attention (include/aotinfer/decode.cuh). The plan (python/aotinfer/
// decode.py) has written the work partition: `work` rows (request, kv_begin, kv_end, slot),
// `requests` rows (page_begin, kv_len, first_partial, num_partials) and zeroed `counters` (a split
// request's items done, one a request and block row); this binding checks the tensors, then
// launches the decode kernel and, where `max_partials` (the most items a request may have) is
// more than the kernel merges itself, the merge kernel.
#include "aotinfer/decode.cuh"
#include "attention_checks.h"
#include "tvm_ffi_utils.h"

namespace {

using aotinfer::CheckAttentionOptions;
using aotinfer::CheckAttentionOutputs;
using aotinfer::CheckHeads;
using aotinfer::CheckIndexTable;
using aotinfer::CheckKvLayout;
using aotinfer::CheckLastDimContiguous;
using aotinfer::CheckOptionalDevices;
using aotinfer::CheckQuery;
using aotinfer::CheckRows16;
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

// Decode attention of q against the paged k_cache / v_cache (kv_layout 0: [pages, page_size,
// kv_heads, head_dim], 1: [pages, kv_heads, page_size, head_dim]) over the planned work items;
// kv_read_once: the K and V copies cached evict-first in L2 (the plan's choice), else normally.
void batch_decode(TensorView out, TensorView lse, TensorView partial_out, TensorView partial_lse, TensorView q,
                  TensorView k_cache, TensorView v_cache, TensorView indices, TensorView work, TensorView requests,
                  TensorView counters, TensorView sinks, int64_t kv_layout, double sm_scale, double logits_soft_cap, int64_t window_left,
                  double v_scale, int64_t max_partials, int64_t kv_read_once, int64_t enable_pdl) {
  // 1. Validate: inputs, scalars, then outputs; devices last.
  CheckQuery(q);
  const int64_t batch = q.size(0), num_qo_heads = q.size(1), head_dim = q.size(2);
  CheckKvLayout(kv_layout);
  aotinfer::CheckDim(4, k_cache, "k_cache");
  aotinfer::CheckSameShape(v_cache, k_cache, "v_cache", "k_cache");
  aotinfer::CheckSameDtype(v_cache, k_cache, "v_cache", "k_cache");
  const uint32_t kv_key = DtypeKey(k_cache.dtype());
  const bool fp8 = kv_key == DtypeKey(kDLFloat8_e4m3fn, 8) || kv_key == DtypeKey(kDLFloat8_e5m2, 8);
  if (!fp8 && k_cache.dtype() != q.dtype()) {
    AOTINFER_THROW(TypeError) << "Expected k_cache to have q's dtype " << q.dtype()
                             << ", float8_e4m3fn or float8_e5m2, got " << k_cache.dtype();
  }
  const int head_axis = kv_layout == 0 ? 2 : 1, slot_axis = kv_layout == 0 ? 1 : 2;
  const int64_t num_kv_heads = k_cache.size(head_axis), page_size = k_cache.size(slot_axis);
  if (k_cache.size(3) != head_dim) {
    AOTINFER_THROW(ValueError) << "Expected the last dimension of k_cache to be head_dim " << head_dim << ", got shape "
                              << aotinfer::ShapeString(k_cache.shape());
  }
  CheckHeads(num_qo_heads, num_kv_heads);
  CheckLastDimContiguous(k_cache, "k_cache");
  CheckLastDimContiguous(v_cache, "v_cache");
  CheckRows16(k_cache, fp8 ? 16 : 8, "k_cache", 3);
  CheckRows16(v_cache, fp8 ? 16 : 8, "v_cache", 3);
  CheckIndexTable(indices, 0, "indices");
  CheckIndexTable(work, 4, "work");
  CheckIndexTable(requests, 4, "requests");
  CheckIndexTable(counters, 0, "counters");
  if (requests.size(0) != batch) {
    AOTINFER_THROW(ValueError) << "Expected requests to have one row for each of the " << batch << " queries, got "
                              << aotinfer::ShapeString(requests.shape());
  }
  const bool has_sinks = CheckAttentionOptions(sinks, num_qo_heads, sm_scale, logits_soft_cap, window_left);
  aotinfer::CheckEnablePdl(enable_pdl);
  const aotinfer::AttentionOutputs given = CheckAttentionOutputs(out, lse, partial_out, partial_lse, q);
  const TensorView* on_gpu[] = {&q, &k_cache, &v_cache, &indices, &work, &requests, &counters, &out};
  const char* names[] = {"q", "k_cache", "v_cache", "indices", "work", "requests", "counters", "out"};
  for (int i = 0; i < 8; ++i) {
    aotinfer::CheckCuda(*on_gpu[i], names[i]);
    aotinfer::CheckSameDevice(*on_gpu[i], q, names[i], "q");
  }
  CheckOptionalDevices(sinks, has_sinks, lse, partial_out, partial_lse, given, q);
  if (work.size(0) > 0x7fffffff || num_qo_heads / num_kv_heads > 0xffff * aotinfer::kDecodeRows) {
    AOTINFER_THROW(ValueError) << "Expected fewer work items (" << work.size(0) << ") and query heads";
  }

  aotinfer::DecodeParams p{};
  aotinfer::SetAttentionParams(p, out, lse, partial_out, partial_lse, given, q, k_cache, v_cache,
                               head_axis, slot_axis, indices, sinks, has_sinks, batch, page_size, sm_scale,
                               logits_soft_cap, window_left);
  p.work = aotinfer::data_ptr<int4>(work);
  p.requests = aotinfer::data_ptr<int4>(requests);
  p.head_blocks = (p.group + aotinfer::kDecodeRows - 1) / aotinfer::kDecodeRows;
  if (counters.size(0) < batch * num_kv_heads * p.head_blocks) {
    AOTINFER_THROW(ValueError) << "Expected counters to hold batch x num_kv_heads x ceil(group / 16) = "
                              << batch * num_kv_heads * p.head_blocks << " entries, got " << counters.size(0);
  }
  p.counters = aotinfer::data_ptr<int>(counters);
  p.v_scale = float(v_scale);
  p.kv_read_once = kv_read_once != 0;
  if (batch == 0 || work.size(0) == 0) return;

  // 2. Guard the device; 3. get the stream; 4. dispatch and launch.
  const int device = q.device().device_id;
  aotinfer::DeviceGuard guard(device);
  cudaStream_t stream = aotinfer::get_stream(q.device());
  const bool pdl = aotinfer::UsePdl(enable_pdl, device);
  const int num_items = int(work.size(0));
  const bool merge = max_partials > aotinfer::kFusedMergeParts;
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
