// What the batch prefill bindings share (csrc/prefill.cu, csrc/prefill_sm90.cu): the checks of
// their common signature and the launch parameters built from it. The plan (python/aotinfer/
// prefill.py) has written the work partition: `work` (row 0: the number of items, the heads taken
// together and the items so taken; then a row (request, row_begin, kv_begin, kv_end, chunk, -, -,
// -) an item) and `requests` rows (q_begin, q_len, kv_offset, kv_len, first_partial, num_partials,
// split_from, mask_begin).
#pragma once

#include "aotinfer/prefill.cuh"
#include "attention_checks.h"
#include "tvm_ffi_utils.h"

namespace aotinfer {

struct CheckedPrefill {
  PrefillParams params;
  int64_t head_dim, head_dim_vo, total_q;  // q's and k's head_dim, v's and out's
  int merge_from;  // the first query token the merge reads; -1: no merge
  bool paged;  // k and v are pages (4-D), else a ragged batch's rows (3-D)
  bool fp8;    // an fp8 (paged) cache
  bool empty;  // nothing to launch
};

// q ([tokens, num_qo_heads, head_dim]) against k and v: ragged, 3-D [kv_tokens, num_kv_heads,
// head_dim] (any strides of the first two dimensions) with `indices` empty; or paged, 4-D
// (kv_layout 0: [pages, page_size, kv_heads, head_dim], 1: [pages, kv_heads, page_size,
// head_dim]) with `indices` the page ids. K and V have q's dtype, or (paged) float8_e4m3fn or
// float8_e5m2; v_scale multiplies the output. V's and out's head_dim is q's, or 128 where q's is
// 192 (16-bit K and V).
inline CheckedPrefill CheckPrefill(TensorView out, TensorView lse, TensorView partial_out, TensorView partial_lse,
                                   TensorView q, TensorView k, TensorView v, TensorView indices, TensorView work,
                                   TensorView requests, TensorView sinks, int64_t kv_layout, double sm_scale,
                                   double logits_soft_cap, int64_t window_left, double v_scale, bool causal, int64_t ctas,
                                   int64_t merge_from, int64_t enable_pdl) {
  // Inputs, scalars, then outputs; devices last.
  CheckQuery(q, /*deepseek_dims=*/true);
  const int64_t total_q = q.size(0), num_qo_heads = q.size(1), head_dim = q.size(2);
  CheckKvLayout(kv_layout);
  const bool paged = k.ndim() == 4;
  if (!paged && k.ndim() != 3) {
    AOTINFER_THROW(ValueError) << "Expected k to have 3 dimensions (ragged) or 4 (paged), got " << k.ndim()
                              << " (shape " << ShapeString(k.shape()) << ")";
  }
  const int64_t head_dim_vo = v.size(-1);
  const bool same_but_head_dim = v.ndim() == k.ndim() && [&] {
    for (int i = 0; i + 1 < k.ndim(); ++i) {
      if (v.size(i) != k.size(i)) return false;
    }
    return true;
  }();
  if (!same_but_head_dim) {
    AOTINFER_THROW(ValueError) << "Expected v to have k's shape but for head_dim, got " << ShapeString(v.shape())
                              << " and " << ShapeString(k.shape());
  }
  CheckSameDtype(v, k, "v", "k");
  const uint32_t kv_key = DtypeKey(k.dtype());
  const bool fp8 = kv_key == DtypeKey(kDLFloat8_e4m3fn, 8) || kv_key == DtypeKey(kDLFloat8_e5m2, 8);
  if (fp8 && !paged) {
    AOTINFER_THROW(TypeError) << "Expected k to have q's dtype " << q.dtype() << " with ragged (3-D) KV, got "
                             << k.dtype() << " (fp8 KV is taken paged only)";
  }
  if (!fp8 && k.dtype() != q.dtype()) {
    AOTINFER_THROW(TypeError) << "Expected k to have q's dtype " << q.dtype() << (paged ? ", float8_e4m3fn or float8_e5m2" : "")
                             << ", got " << k.dtype();
  }
  const int head_axis = !paged ? 1 : kv_layout == 0 ? 2 : 1, slot_axis = kv_layout == 0 ? 1 : 2;
  const int64_t num_kv_heads = k.size(head_axis), page_size = paged ? k.size(slot_axis) : 1;
  if (k.size(-1) != head_dim) {
    AOTINFER_THROW(ValueError) << "Expected the last dimension of k to be head_dim " << head_dim << ", got shape "
                              << ShapeString(k.shape());
  }
  const bool deepseek_dims = head_dim == kDeepSeekHeadDimQk;
  if (head_dim_vo != (deepseek_dims ? kDeepSeekHeadDimVo : head_dim)) {
    AOTINFER_THROW(ValueError) << "Expected the last dimension of v (head_dim_vo) to be " << (deepseek_dims ? kDeepSeekHeadDimVo : head_dim)
                              << " with q's head_dim " << head_dim << ", got shape " << ShapeString(v.shape());
  }
  if (deepseek_dims && fp8) {
    AOTINFER_THROW(TypeError) << "Expected k of q's dtype " << q.dtype() << " with head_dim 192, got " << k.dtype()
                             << " (fp8 caches take one head_dim)";
  }
  CheckHeads(num_qo_heads, num_kv_heads);
  if (paged && page_size == 0) AOTINFER_THROW(ValueError) << "Expected a page_size of 1 or more, got k of shape " << ShapeString(k.shape());
  CheckLastDimContiguous(k, "k");
  CheckLastDimContiguous(v, "v");
  CheckRows16(k, fp8 ? 16 : 8, "k", k.ndim() - 1);
  CheckRows16(v, fp8 ? 16 : 8, "v", v.ndim() - 1);
  CheckIndexTable(indices, 0, "indices");
  if (!paged && indices.numel() != 0) {
    AOTINFER_THROW(ValueError) << "Expected no indices with a ragged (3-D) k, got " << indices.numel();
  }
  CheckPagesForIndices(k, "k", indices);
  CheckIndexTable(work, 8, "work");
  CheckIndexTable(requests, 8, "requests");
  if (work.size(0) < 1) AOTINFER_THROW(ValueError) << "Expected work to have its count row, got no rows";
  const int64_t batch = requests.size(0);
  const bool has_sinks = CheckAttentionOptions(sinks, num_qo_heads, sm_scale, logits_soft_cap, window_left);
  if (ctas < 0 || ctas > 0x7fffffff) AOTINFER_THROW(ValueError) << "Expected ctas in [0, 2^31), got " << ctas;
  if (merge_from < -1 || merge_from > total_q) {
    AOTINFER_THROW(ValueError) << "Expected merge_from in [-1, " << total_q << "] (-1: no merge), got " << merge_from;
  }
  CheckEnablePdl(enable_pdl);
  const AttentionOutputs given = CheckAttentionOutputs(out, lse, partial_out, partial_lse, q, head_dim_vo);
  CheckOnOneGpu({{q, "q"}, {k, "k"}, {v, "v"}, {work, "work"}, {requests, "requests"}, {out, "out"}});
  if (paged) CheckSameDevice(indices, q, "indices", "q");
  CheckOptionalDevices(sinks, has_sinks, lse, partial_out, partial_lse, given, q);
  if (total_q > 0x7fffffff || num_kv_heads > 0xffff || batch > 0x7fffffff) {
    AOTINFER_THROW(ValueError) << "Expected fewer query tokens (" << total_q << "), KV heads or requests";
  }

  PrefillParams p{};
  SetAttentionParams(p, out, lse, partial_out, partial_lse, given, q, k, v, head_axis, paged ? slot_axis : -1, indices,
                     sinks, has_sinks, batch, page_size, sm_scale, logits_soft_cap, window_left);
  p.work = data_ptr<int4>(work);
  p.requests = data_ptr<int4>(requests);
  p.group_divisor = PageDivisor(uint32_t(p.group));
  p.v_scale = float(v_scale);
  p.causal = causal;
  p.bf16_io = q.dtype().code == kDLBfloat;
  p.e5m2 = kv_key == DtypeKey(kDLFloat8_e5m2, 8);
  return {p, head_dim, head_dim_vo, total_q, int(merge_from), paged, fp8, batch == 0 || ctas == 0 || total_q == 0};
}

// A custom mask for the launch (python/aotinfer/prefill.py packs it, segments at the requests'
// mask_begin): uint8 bytes, 1-D, contiguous, on q's GPU; none where it has no elements. It
// replaces causal. With 16-bit caches only.
inline void SetCustomMask(CheckedPrefill& checked, TensorView custom_mask, TensorView q) {
  if (custom_mask.numel() == 0) return;
  if (checked.fp8) AOTINFER_THROW(NotImplementedError) << "custom_mask with an fp8 KV cache is not implemented";
  PrefillParams& p = checked.params;
  CheckDim(1, custom_mask, "custom_mask");
  CheckContiguous(custom_mask, "custom_mask");
  CheckDtype(custom_mask, DLDataType{kDLUInt, 8, 1}, "custom_mask", "uint8 (packed bits)");
  CheckSameDevice(custom_mask, q, "custom_mask", "q");
  p.custom_mask = data_ptr<uint8_t>(custom_mask);
  p.causal = false;
}

}  // namespace aotinfer
