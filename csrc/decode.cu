// Binding of paged decode attention (include/aotinfer/decode.cuh): checks the tensors and the
// plan's tables (decode_checks.h), then launches the decode kernel over the planned work items
// and, where `max_partials` (the most items a request may have) is more than the kernel merges
// itself, the merge kernel. Beside it, plan_decode: the plan's tables, written on the host.
#include "aotinfer/decode_plan.h"
#include "decode_checks.h"

namespace {

using aotinfer::DtypeKey;

template <typename T, typename KV>
cudaError_t Dispatch(const aotinfer::DecodeParams& p, int64_t head_dim, int num_items, bool merge, bool rope,
                     cudaStream_t stream, bool pdl, int device) {
  switch (head_dim) {
    case 64: return aotinfer::BatchDecode<T, KV, 64>(p, num_items, merge, rope, stream, pdl, device);
    case 128: return aotinfer::BatchDecode<T, KV, 128>(p, num_items, merge, rope, stream, pdl, device);
    default: return aotinfer::BatchDecode<T, KV, 256>(p, num_items, merge, rope, stream, pdl, device);
  }
}

}  // namespace

// Decode attention over the planned work items (the tensors: CheckDecode); kv_read_once: the K and
// V copies cached evict-first in L2 (the plan's choice), else normally; pos_encoding_mode 1: RoPE
// inside the kernel (SetRope).
void batch_decode(TensorView out, TensorView lse, TensorView partial_out, TensorView partial_lse, TensorView q,
                  TensorView k_cache, TensorView v_cache, TensorView indices, TensorView work, TensorView requests,
                  TensorView counters, TensorView sinks, int64_t captured, int64_t kv_layout, double sm_scale,
                  double logits_soft_cap, int64_t window_left, int64_t pos_encoding_mode, double rope_scale,
                  double rope_theta, double v_scale, int64_t max_partials, int64_t kv_read_once, int64_t enable_pdl) {
  // 1. Validate; 2. guard the device; 3. get the stream (and record a capture); 4. dispatch and launch.
  aotinfer::CheckedDecode checked = aotinfer::CheckDecode(
      out, lse, partial_out, partial_lse, q, k_cache, v_cache, indices, work, requests, counters, sinks, kv_layout,
      sm_scale, logits_soft_cap, window_left, v_scale, kv_read_once, enable_pdl);
  const bool rope = aotinfer::SetRope(checked.params, pos_encoding_mode, rope_scale, rope_theta, checked.fp8,
                                      checked.head_dim, checked.head_dim);
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
      status = Dispatch<T, __nv_fp8_e4m3>(p, head_dim, num_items, merge, rope, stream, pdl, device);
    } else if (kv_key == DtypeKey(kDLFloat8_e5m2, 8)) {
      status = Dispatch<T, __nv_fp8_e5m2>(p, head_dim, num_items, merge, rope, stream, pdl, device);
    } else {
      status = Dispatch<T, T>(p, head_dim, num_items, merge, rope, stream, pdl, device);
    }
    CHECK_LAUNCH(status, "batch_decode");
    return true;
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(batch_decode, batch_decode);

// ---- the plan's tables (host) --------------------------------------------------------------------

namespace {

constexpr int64_t kTableAlign = 16;  // each table starts at a 16-byte boundary of the workspace

int64_t Aligned(int64_t bytes) { return (bytes + kTableAlign - 1) / kTableAlign * kTableAlign; }

}  // namespace

// The decode plan of one step on the host (python/aotinfer/decode.py, partition_work): checks the
// page table (int32 `indptr` [batch + 1], `last_page_len` [batch], or int64 `seq_lens` [batch]
// where has_seq_lens), splits the attended positions as the policy says (decode_plan.h), and
// writes the `requests`, `work` (capacity rows where capacity >= 0, idle ones last) and zeroed
// `counters` tables into the host bytes `tables`, each at a 16-byte boundary. `facts` (int64
// [8]) receives: bytes written, items, partial slots, chunk, the most items of a request, the
// positions attended in all, and the byte offsets of `work` and `counters`.
void plan_decode(TensorView tables, TensorView facts, TensorView indptr, TensorView last_page_len, TensorView seq_lens,
                 bool has_seq_lens, int64_t num_indices, int64_t page_size, int64_t counters_per_request, int64_t fill,
                 int64_t fill_short, int64_t short_request, int64_t min_chunk, int64_t chunk_unit, int64_t window_left,
                 bool disable_split_kv, int64_t fixed_chunk, int64_t capacity) {
  aotinfer::CheckHostTable(last_page_len, "last_page_len", kDLInt, 32, 1);
  const int64_t batch = last_page_len.size(0);
  aotinfer::CheckHostTable(indptr, "indptr", kDLInt, 32, 1);
  if (indptr.size(0) != batch + 1) {
    AOTINFER_THROW(ValueError) << "Expected indptr to have batch_size + 1 = " << batch + 1 << " elements, got "
                              << indptr.size(0);
  }
  aotinfer::CheckHostTable(tables, "tables", kDLUInt, 8, 1);
  aotinfer::CheckHostTable(facts, "facts", kDLInt, 64, 1);
  if (facts.size(0) != 8) AOTINFER_THROW(ValueError) << "Expected facts to hold 8 values, got " << facts.size(0);
  if (page_size < 1 || chunk_unit < 1 || fill < 1 || fill_short < 1 || fixed_chunk < 0) {
    AOTINFER_THROW(ValueError) << "Expected page_size, chunk_unit and the fills to be at least 1 and fixed_chunk "
                                  "at least 0";
  }
  const int32_t* pages_at = aotinfer::data_ptr<const int32_t>(indptr);
  const int32_t* last = aotinfer::data_ptr<const int32_t>(last_page_len);
  if (batch && (pages_at[0] < 0 || pages_at[batch] > num_indices)) {
    AOTINFER_THROW(ValueError) << "Expected indptr to be non-decreasing from 0 or more, up to len(indices) = "
                              << num_indices << ", got indptr[0] = " << pages_at[0] << " and indptr[" << batch
                              << "] = " << pages_at[batch];
  }
  const int64_t* lengths = has_seq_lens ? aotinfer::CheckSeqLens(seq_lens, batch) : nullptr;

  // The positions each request attends, its pages checked.
  std::vector<aotinfer::Attended> attended(batch);
  int64_t attended_in_all = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t pages = int64_t(pages_at[b + 1]) - pages_at[b];
    if (pages < 0) {
      AOTINFER_THROW(ValueError) << "Expected indptr to be non-decreasing from 0 or more, up to len(indices) = "
                                << num_indices << ", got indptr[" << b + 1 << "] = " << pages_at[b + 1]
                                << " after indptr[" << b << "] = " << pages_at[b];
    }
    const int64_t kv_len = aotinfer::PagedKvLen(b, pages, page_size, last, lengths, batch, "last_page_len");
    const int64_t lo = window_left >= 0 ? std::max<int64_t>(kv_len - 1 - window_left, 0) : 0;
    attended[b] = {lo, kv_len};
    attended_in_all += kv_len - lo;
  }

  // The partition, then the tables.
  const aotinfer::DecodeSplitPolicy policy{fill,       fill_short,       short_request, min_chunk,
                                           chunk_unit, disable_split_kv, fixed_chunk};
  const aotinfer::DecodePartition p = aotinfer::PartitionDecode(attended, aotinfer::ChooseChunk(attended, policy));
  const int64_t num_items = static_cast<int64_t>(p.items.size());
  if (capacity >= 0 && num_items > capacity) {
    AOTINFER_THROW(ValueError) << "this plan needs " << num_items << " work items, more than the " << capacity
                              << " a CUDA graph's fixed grid holds for batch size " << batch
                              << ": use a larger fixed_split_size (or none) or disable_split_kv=True";
  }
  const int64_t rows = capacity >= 0 ? capacity : num_items;
  const int64_t work_offset = Aligned(16 * batch), counters_offset = work_offset + Aligned(16 * rows);
  const int64_t need = counters_offset + Aligned(4 * batch * counters_per_request);
  if (need > tables.size(0)) {
    AOTINFER_THROW(ValueError) << "The int workspace holds " << tables.size(0)
                              << " bytes of work tables, this plan needs " << need
                              << ": give reset_workspace_buffer a larger int_workspace_buffer";
  }
  char* base = aotinfer::data_ptr<char>(tables);
  int32_t* requests = reinterpret_cast<int32_t*>(base);
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t row[4] = {pages_at[b], int32_t(attended[b].hi), p.first_partial[b], p.num_partials[b]};
    std::copy(row, row + 4, requests + 4 * b);
  }
  aotinfer::WorkItem* work = reinterpret_cast<aotinfer::WorkItem*>(base + work_offset);
  std::copy(p.items.begin(), p.items.end(), work);
  std::fill(work + num_items, work + rows, aotinfer::WorkItem{-1, 0, 0, -1});
  std::fill(base + counters_offset, base + need, char{0});

  int64_t* out = aotinfer::data_ptr<int64_t>(facts);
  const int64_t values[8] = {need, num_items, p.num_slots, p.chunk, p.max_partials, attended_in_all,
                             work_offset, counters_offset};
  std::copy(values, values + 8, out);
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(plan_decode, plan_decode);
