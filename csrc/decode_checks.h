// What the decode binding checks (csrc/decode.cu), beside prefill_checks.h: its tensors and the
// plan's tables (python/aotinfer/decode.py writes them: `work` rows (request, kv_begin, kv_end,
// slot), `requests` rows (page_begin, kv_len, first_partial, num_partials), zeroed `counters`, a
// split request's items done, one a request and block row), and the launch parameters built from
// them.
#pragma once

#include "aotinfer/decode.cuh"
#include "attention_checks.h"
#include "tvm_ffi_utils.h"

namespace aotinfer {

struct CheckedDecode {
  DecodeParams params;
  int64_t head_dim;
  uint32_t kv_key;  // DtypeKey of the cache: q's dtype, or an fp8 one
  bool fp8;         // an fp8 cache
  int num_items;
  bool empty;  // nothing to launch
};

// q ([batch, num_qo_heads, head_dim]) against the paged k_cache / v_cache (kv_layout 0: [pages,
// page_size, kv_heads, head_dim], 1: [pages, kv_heads, page_size, head_dim]) of q's dtype,
// float8_e4m3fn or float8_e5m2, with `indices` the page ids.
inline CheckedDecode CheckDecode(TensorView out, TensorView lse, TensorView partial_out, TensorView partial_lse,
                                 TensorView q, TensorView k_cache, TensorView v_cache, TensorView indices,
                                 TensorView work, TensorView requests, TensorView counters, TensorView sinks,
                                 int64_t kv_layout, double sm_scale, double logits_soft_cap, int64_t window_left,
                                 double v_scale, int64_t kv_read_once, int64_t enable_pdl) {
  // Inputs, scalars, then outputs; devices last.
  CheckQuery(q);
  const int64_t batch = q.size(0), num_qo_heads = q.size(1), head_dim = q.size(2);
  CheckKvLayout(kv_layout);
  CheckDim(4, k_cache, "k_cache");
  CheckSameShape(v_cache, k_cache, "v_cache", "k_cache");
  CheckSameDtype(v_cache, k_cache, "v_cache", "k_cache");
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
                              << ShapeString(k_cache.shape());
  }
  CheckHeads(num_qo_heads, num_kv_heads);
  CheckLastDimContiguous(k_cache, "k_cache");
  CheckLastDimContiguous(v_cache, "v_cache");
  CheckRows16(k_cache, fp8 ? 16 : 8, "k_cache", 3);
  CheckRows16(v_cache, fp8 ? 16 : 8, "v_cache", 3);
  CheckIndexTable(indices, 0, "indices");
  CheckPagesForIndices(k_cache, "k_cache", indices);
  CheckIndexTable(work, 4, "work");
  CheckIndexTable(requests, 4, "requests");
  CheckIndexTable(counters, 0, "counters");
  if (requests.size(0) != batch) {
    AOTINFER_THROW(ValueError) << "Expected requests to have one row for each of the " << batch << " queries, got "
                              << ShapeString(requests.shape());
  }
  const bool has_sinks = CheckAttentionOptions(sinks, num_qo_heads, sm_scale, logits_soft_cap, window_left);
  CheckEnablePdl(enable_pdl);
  const AttentionOutputs given = CheckAttentionOutputs(out, lse, partial_out, partial_lse, q, q.size(2));
  CheckOnOneGpu({{q, "q"}, {k_cache, "k_cache"}, {v_cache, "v_cache"}, {indices, "indices"}, {work, "work"},
                 {requests, "requests"}, {counters, "counters"}, {out, "out"}});
  CheckOptionalDevices(sinks, has_sinks, lse, partial_out, partial_lse, given, q);
  if (work.size(0) > 0x7fffffff || num_qo_heads / num_kv_heads > 0xffff * kDecodeRows) {
    AOTINFER_THROW(ValueError) << "Expected fewer work items (" << work.size(0) << ") and query heads";
  }

  DecodeParams p{};
  SetAttentionParams(p, out, lse, partial_out, partial_lse, given, q, k_cache, v_cache, head_axis, slot_axis, indices,
                     sinks, has_sinks, batch, page_size, sm_scale, logits_soft_cap, window_left);
  p.work = data_ptr<int4>(work);
  p.requests = data_ptr<int4>(requests);
  p.head_blocks = (p.group + kDecodeRows - 1) / kDecodeRows;
  if (counters.size(0) < batch * num_kv_heads * p.head_blocks) {
    AOTINFER_THROW(ValueError) << "Expected counters to hold batch x num_kv_heads x ceil(group / 16) = "
                              << batch * num_kv_heads * p.head_blocks << " entries, got " << counters.size(0);
  }
  p.counters = data_ptr<int>(counters);
  p.v_scale = float(v_scale);
  p.kv_read_once = kv_read_once != 0;
  return {p, head_dim, kv_key, fp8, int(work.size(0)), batch == 0 || work.size(0) == 0};
}

}  // namespace aotinfer

