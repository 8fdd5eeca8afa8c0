// Binding of batch prefill attention (include/aotinfer/prefill.cuh, mma.sync for every arch from
// sm80): checks the tensors and the plan's tables (prefill_checks.h), then launches the prefill
// kernel on num_kv_heads x `ctas` blocks and, unless `merge_from` is -1, the merge of split
// requests from that query token on. Beside it, prefill_lengths and plan_prefill: the plan's
// tables, written on the host.
#include "aotinfer/prefill_plan.h"
#include "prefill_checks.h"

namespace {

template <typename T>
cudaError_t Dispatch(const aotinfer::PrefillParams& p, int64_t head_dim, bool fp8, bool rope, int ctas, int merge_from,
                     int q_tokens, cudaStream_t stream, bool pdl, int device) {
  switch (head_dim) {
    case 64: return aotinfer::BatchPrefill<T, 64>(p, fp8, rope, ctas, merge_from, q_tokens, stream, pdl, device);
    case 128: return aotinfer::BatchPrefill<T, 128>(p, fp8, rope, ctas, merge_from, q_tokens, stream, pdl, device);
    case aotinfer::kDeepSeekHeadDimQk:
      return aotinfer::BatchPrefill<T, aotinfer::kDeepSeekHeadDimQk, aotinfer::kDeepSeekHeadDimVo>(
          p, fp8, rope, ctas, merge_from, q_tokens, stream, pdl, device);
    default: return aotinfer::BatchPrefill<T, 256>(p, fp8, rope, ctas, merge_from, q_tokens, stream, pdl, device);
  }
}

}  // namespace

// Prefill attention over the planned work items (the tensors: CheckPrefill; the mask, packed bits
// or none: SetCustomMask; pos_encoding_mode 1: RoPE inside the kernel, SetRope).
void batch_prefill(TensorView out, TensorView lse, TensorView partial_out, TensorView partial_lse, TensorView q,
                   TensorView k, TensorView v, TensorView indices, TensorView work, TensorView requests,
                   TensorView sinks, TensorView custom_mask, int64_t captured, int64_t kv_layout, double sm_scale,
                   double logits_soft_cap, int64_t window_left, int64_t pos_encoding_mode, double rope_scale,
                   double rope_theta, double v_scale, bool causal, int64_t ctas, int64_t merge_from, int64_t enable_pdl) {
  // 1. Validate; 2. guard the device; 3. get the stream (and record a capture); 4. dispatch and launch.
  aotinfer::CheckedPrefill checked = aotinfer::CheckPrefill(
      out, lse, partial_out, partial_lse, q, k, v, indices, work, requests, sinks, kv_layout, sm_scale,
      logits_soft_cap, window_left, v_scale, causal, ctas, merge_from, enable_pdl);
  aotinfer::SetCustomMask(checked, custom_mask, q);
  const bool rope = aotinfer::SetRope(checked.params, pos_encoding_mode, rope_scale, rope_theta, checked.fp8,
                                      checked.head_dim, checked.head_dim_vo);
  if (aotinfer::IsStandIn(q)) return;
  const int device = q.device().device_id;
  aotinfer::DeviceGuard guard(device);
  cudaStream_t stream = aotinfer::get_stream(q.device());
  aotinfer::RecordCapture(captured, stream);  // an empty batch too: its replay would launch nothing
  if (checked.empty) return;
  const bool pdl = aotinfer::UsePdl(enable_pdl, device);
  DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP16(q.dtype(), T, [&] {
    CHECK_LAUNCH(Dispatch<T>(checked.params, checked.head_dim, checked.fp8, rope, int(ctas), checked.merge_from,
                             int(checked.total_q), stream, pdl, device),
                 "batch_prefill");
    return true;
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(batch_prefill, batch_prefill);

// ---- the plan's tables (host) --------------------------------------------------------------------

namespace {

// An int32 indptr on the host: batch + 1 entries from 0, never decreasing, ending at most at `end`
// (none where end < 0). Names the first bad entry.
const int32_t* CheckIndptr(const TensorView& indptr, const char* name, int64_t batch, int64_t end, const char* end_says) {
  aotinfer::CheckHostTable(indptr, name, kDLInt, 32, 1);
  if (indptr.size(0) != batch + 1) {
    AOTINFER_THROW(ValueError) << "Expected " << name << " to have batch_size + 1 = " << batch + 1 << " elements, got "
                              << indptr.size(0);
  }
  const int32_t* at = aotinfer::data_ptr<const int32_t>(indptr);
  if (at[0] != 0) AOTINFER_THROW(ValueError) << "Expected " << name << " to start at 0, got " << name << "[0] = " << at[0];
  for (int64_t b = 0; b < batch; ++b) {
    if (at[b + 1] < at[b]) {
      AOTINFER_THROW(ValueError) << "Expected " << name << " never to decrease, got " << name << "[" << b + 1
                                << "] = " << at[b + 1] << " after " << name << "[" << b << "] = " << at[b];
    }
  }
  if (end >= 0 && at[batch] > end) {
    AOTINFER_THROW(ValueError) << "Expected " << name << "[-1] (" << at[batch] << ") to be at most " << end_says
                              << " = " << end;
  }
  return at;
}

}  // namespace

// The requests' lengths a prefill plan starts from, on the host, checked (python/aotinfer/prefill.py,
// _request_lengths): from int32 `qo_indptr` and `kv_indptr` [batch + 1] (key rows of a ragged
// cache where page_size is 0; else page-table entries, with int32 `last_page_len` [batch] or int64
// `seq_lens` [batch] where has_seq_lens), writes int64 `lengths` [4, batch]: q_begin, q_len,
// kv_offset (the first key row or page-table entry), kv_len. `kv_indptr_name` names kv_indptr
// in the errors.
void prefill_lengths(TensorView lengths, TensorView qo_indptr, TensorView kv_indptr, TensorView last_page_len,
                     TensorView seq_lens, bool has_seq_lens, int64_t page_size, int64_t num_indices,
                     tvm::ffi::String kv_indptr_name) {
  aotinfer::CheckHostTable(lengths, "lengths", kDLInt, 64, 2);
  const int64_t batch = lengths.size(1);
  if (lengths.size(0) != 4) AOTINFER_THROW(ValueError) << "Expected lengths [4, batch], got " << lengths.size(0) << " rows";
  const int32_t* qo = CheckIndptr(qo_indptr, "qo_indptr", batch, -1, "");
  const bool paged = page_size > 0;
  const int32_t* kv = CheckIndptr(kv_indptr, kv_indptr_name.c_str(), batch, paged ? num_indices : -1, "len(paged_kv_indices)");
  constexpr const char* kLastName = "paged_kv_last_page_len";  // only the paged wrapper's plan has it
  const int32_t* last = nullptr;
  const int64_t* given = nullptr;
  if (paged && has_seq_lens) {
    given = aotinfer::CheckSeqLens(seq_lens, batch);
  } else if (paged) {
    aotinfer::CheckHostTable(last_page_len, kLastName, kDLInt, 32, 1);
    if (last_page_len.size(0) != batch) {
      AOTINFER_THROW(ValueError) << "Expected " << kLastName << " to have batch_size = " << batch << " elements, got "
                                << last_page_len.size(0);
    }
    last = aotinfer::data_ptr<const int32_t>(last_page_len);
  }
  int64_t* out = aotinfer::data_ptr<int64_t>(lengths);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t span = int64_t(kv[b + 1]) - kv[b];  // keys (ragged) or pages
    const int64_t kv_len = paged ? aotinfer::PagedKvLen(b, span, page_size, last, given, batch, kLastName) : span;
    out[b] = qo[b];
    out[batch + b] = int64_t(qo[b + 1]) - qo[b];
    out[2 * batch + b] = kv[b];
    out[3 * batch + b] = kv_len;
  }
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(prefill_lengths, prefill_lengths);

// The prefill plan's items on the host (python/aotinfer/prefill.py, partition_prefill): from the
// int64 [batch] `q_begin`, `q_len`, `kv_offset` and `kv_len`, and the plan's choices (the chunk;
// `split_from` of a lone request), writes the count row and the items of `work` (int32
// [1 + items, 8], at least as many rows as items), `requests` (int32 [batch, 8]) and `spans`
// (int64 [items, 3]: each item's request and the keys its rows attend), in the items' order
// (prefill_plan.h). `facts` (int64 [4]) receives: items, partial slots, the first query token to
// merge (-1: none), the halved items.
void plan_prefill(TensorView work, TensorView requests, TensorView spans, TensorView facts, TensorView q_begin,
                  TensorView q_len, TensorView kv_offset, TensorView kv_len, int64_t split_from, int64_t group,
                  int64_t rows_per_tile, int64_t chunk, bool causal, int64_t window_left) {
  aotinfer::CheckHostTable(q_len, "q_len", kDLInt, 64, 1);
  const int64_t batch = q_len.size(0);
  const std::pair<const TensorView*, const char*> columns[] = {{&q_begin, "q_begin"}, {&kv_offset, "kv_offset"},
                                                               {&kv_len, "kv_len"}};
  for (const auto& [column, name] : columns) {
    aotinfer::CheckHostTable(*column, name, kDLInt, 64, 1);
    if (column->size(0) != batch) {
      AOTINFER_THROW(ValueError) << "Expected " << name << " to have q_len's " << batch << " elements, got "
                                << column->size(0);
    }
  }
  aotinfer::CheckHostTable(work, "work", kDLInt, 32, 2);
  aotinfer::CheckHostTable(requests, "requests", kDLInt, 32, 2);
  aotinfer::CheckHostTable(spans, "spans", kDLInt, 64, 2);
  aotinfer::CheckHostTable(facts, "facts", kDLInt, 64, 1);
  if (requests.size(0) != batch || requests.size(1) != 8 || work.size(1) != 8 || spans.size(1) != 3 ||
      facts.size(0) != 4) {
    AOTINFER_THROW(ValueError) << "Expected requests [" << batch << ", 8], work [rows, 8], spans [rows, 3] and "
                                  "facts [4]";
  }
  if (group < 1 || rows_per_tile < 1 || chunk < 0 || (split_from != 0 && (batch != 1 || chunk == 0))) {
    AOTINFER_THROW(ValueError) << "Expected group and rows_per_tile of at least 1, chunk of at least 0, and a "
                                  "split_from for a lone split request only";
  }
  const int64_t* q_begin_at = aotinfer::data_ptr<const int64_t>(q_begin);
  const int64_t* q_len_at = aotinfer::data_ptr<const int64_t>(q_len);
  const int64_t* kv_offset_at = aotinfer::data_ptr<const int64_t>(kv_offset);
  const int64_t* kv_len_at = aotinfer::data_ptr<const int64_t>(kv_len);
  std::vector<aotinfer::PrefillRequest> batch_requests(batch);
  for (int64_t b = 0; b < batch; ++b) {
    batch_requests[b] = {q_begin_at[b], q_len_at[b], kv_offset_at[b], kv_len_at[b], b == 0 ? split_from : 0};
  }
  const aotinfer::PrefillItemsPolicy policy{group, rows_per_tile, chunk, causal, window_left};
  thread_local aotinfer::PrefillItems p;  // its buffers kept from plan to plan
  aotinfer::BuildPrefillItems(batch_requests, policy, p);
  const int64_t num_items = static_cast<int64_t>(p.items.size());
  if (work.size(0) < 1 + num_items || spans.size(0) < num_items) {
    AOTINFER_THROW(ValueError) << "Expected work to hold 1 + " << num_items << " rows and spans " << num_items
                              << ", got " << work.size(0) << " and " << spans.size(0);
  }
  int32_t* request_rows = aotinfer::data_ptr<int32_t>(requests);
  for (int64_t b = 0; b < batch; ++b) {
    const aotinfer::PrefillRequest& r = batch_requests[b];
    const int64_t row[8] = {r.q_begin, r.q_len, r.kv_offset, r.kv_len, p.first_partial[b], p.num_partials[b],
                            r.split_from, 0};
    std::copy(row, row + 8, request_rows + 8 * b);
  }
  int32_t* work_rows = aotinfer::data_ptr<int32_t>(work);
  int64_t* span_rows = aotinfer::data_ptr<int64_t>(spans);
  std::fill(work_rows, work_rows + 8, 0);
  work_rows[0] = int32_t(num_items);
  for (int64_t i = 0; i < num_items; ++i) {
    const aotinfer::PlannedItem& item = p[i];
    const int64_t row[8] = {item.request, item.row_begin, item.kv_begin, item.kv_end, item.chunk, 0, 0, 0};
    std::copy(row, row + 8, work_rows + 8 * (1 + i));
    const int64_t span[3] = {item.request, item.lo, item.hi};
    std::copy(span, span + 3, span_rows + 3 * i);
  }
  int64_t* out = aotinfer::data_ptr<int64_t>(facts);
  const int64_t values[4] = {num_items, p.num_slots, p.merge_from, p.halves};
  std::copy(values, values + 4, out);
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(plan_prefill, plan_prefill);
