// Binding of MLA attention (include/aotinfer/mla.cuh, mma.sync for every arch from sm80): checks
// the tensors and the plan's tables (the prefill plan's, python/aotinfer/mla.py makes them for one
// KV head), then launches the kernel on `ctas` blocks and, unless `merge_from` is -1, the merge of
// split requests from that query token on.
#include "aotinfer/mla.cuh"
#include "attention_checks.h"
#include "tvm_ffi_utils.h"

namespace {

// x: [rows, heads, dim] (16-byte rows, the last dimension contiguous) of `dtype_of`'s dtype.
void CheckRowsOf(const TensorView& x, const char* name, int64_t rows, int64_t heads, int64_t dim, const TensorView& dtype_of,
                 const char* dtype_name) {
  if (x.ndim() != 3 || x.size(0) != rows || x.size(1) != heads || x.size(2) != dim) {
    AOTINFER_THROW(ValueError) << "Expected " << name << " to have shape [" << rows << ", " << heads << ", " << dim
                              << "], got " << aotinfer::ShapeString(x.shape());
  }
  aotinfer::CheckSameDtype(x, dtype_of, name, dtype_name);
  aotinfer::CheckLastDimContiguous(x, name);
  aotinfer::CheckRows16(x, 8, name, 2);
}

// A cache of `dim`-wide tokens: [pages, page_size, dim], or [pages, dim] for pages of one token.
void CheckCache(const TensorView& x, const char* name, int64_t dim) {
  if ((x.ndim() != 3 && x.ndim() != 2) || x.size(-1) != dim) {
    AOTINFER_THROW(ValueError) << "Expected " << name << " to have shape [pages, page_size, " << dim << "] (or [pages, "
                              << dim << "] for page_size 1), got " << aotinfer::ShapeString(x.shape());
  }
  aotinfer::CheckLastDimContiguous(x, name);
  aotinfer::CheckRows16(x, 8, name, x.ndim() - 1);
}

}  // namespace

// MLA attention (absorbed) over the planned work items: q_nope [tokens, heads, 512], q_pe
// [tokens, heads, 64], ckv_cache [pages, page_size, 512] and kpe_cache [pages, page_size, 64] of
// q's dtype (float16 or bfloat16), `indices` the page ids; out [tokens, heads, 512].
void batch_mla(TensorView out, TensorView lse, TensorView partial_out, TensorView partial_lse, TensorView q_nope,
               TensorView q_pe, TensorView ckv_cache, TensorView kpe_cache, TensorView indices, TensorView work,
               TensorView requests, int64_t captured, double sm_scale, bool causal, int64_t ctas, int64_t merge_from,
               int64_t enable_pdl) {
  using aotinfer::kMlaDimCkv;
  using aotinfer::kMlaDimKpe;
  // 1. Validate; 2. guard the device; 3. get the stream (and record a capture); 4. dispatch and launch.
  aotinfer::CheckDim(3, q_nope, "q_nope");
  aotinfer::CheckDtypeFp16(q_nope, "q_nope");
  const int64_t total_q = q_nope.size(0), num_heads = q_nope.size(1);
  CheckRowsOf(q_nope, "q_nope", total_q, num_heads, kMlaDimCkv, q_nope, "q_nope");
  CheckRowsOf(q_pe, "q_pe", total_q, num_heads, kMlaDimKpe, q_nope, "q_nope");
  CheckCache(ckv_cache, "ckv_cache", kMlaDimCkv);
  CheckCache(kpe_cache, "kpe_cache", kMlaDimKpe);
  if (ckv_cache.dtype() != q_nope.dtype() || kpe_cache.dtype() != q_nope.dtype()) {
    AOTINFER_THROW(TypeError) << "Expected ckv_cache and kpe_cache of q_nope's dtype " << q_nope.dtype() << ", got "
                             << ckv_cache.dtype() << " and " << kpe_cache.dtype();
  }
  const int64_t page_size = ckv_cache.ndim() == 3 ? ckv_cache.size(1) : 1;
  if (kpe_cache.ndim() != ckv_cache.ndim() || kpe_cache.size(0) != ckv_cache.size(0) ||
      (kpe_cache.ndim() == 3 ? kpe_cache.size(1) : 1) != page_size) {
    AOTINFER_THROW(ValueError) << "Expected kpe_cache to have ckv_cache's pages and page_size, got "
                              << aotinfer::ShapeString(kpe_cache.shape()) << " and " << aotinfer::ShapeString(ckv_cache.shape());
  }
  if (page_size == 0) AOTINFER_THROW(ValueError) << "Expected a page_size of 1 or more, got ckv_cache of shape " << aotinfer::ShapeString(ckv_cache.shape());
  aotinfer::CheckIndexTable(indices, 0, "indices");
  aotinfer::CheckPagesForIndices(ckv_cache, "ckv_cache", indices);
  aotinfer::CheckIndexTable(work, 8, "work");
  aotinfer::CheckIndexTable(requests, 8, "requests");
  if (work.size(0) < 1) AOTINFER_THROW(ValueError) << "Expected work to have its count row, got no rows";
  const int64_t batch = requests.size(0);
  if (!(sm_scale > 0.0)) AOTINFER_THROW(ValueError) << "Expected sm_scale > 0, got " << sm_scale;
  if (ctas < 0 || ctas > 0x7fffffff) AOTINFER_THROW(ValueError) << "Expected ctas in [0, 2^31), got " << ctas;
  if (merge_from < -1 || merge_from > total_q) {
    AOTINFER_THROW(ValueError) << "Expected merge_from in [-1, " << total_q << "] (-1: no merge), got " << merge_from;
  }
  aotinfer::CheckEnablePdl(enable_pdl);
  const aotinfer::AttentionOutputs given =
      aotinfer::CheckAttentionOutputs(out, lse, partial_out, partial_lse, q_nope, kMlaDimCkv);
  aotinfer::CheckOnOneGpu({{q_nope, "q_nope"}, {q_pe, "q_pe"}, {ckv_cache, "ckv_cache"}, {kpe_cache, "kpe_cache"},
                           {indices, "indices"}, {work, "work"}, {requests, "requests"}, {out, "out"}});
  aotinfer::CheckOptionalDevices(TensorView(indices), false, lse, partial_out, partial_lse, given, q_nope);
  if (total_q > 0x7fffffff || num_heads > 0xffff || batch > 0x7fffffff) {
    AOTINFER_THROW(ValueError) << "Expected fewer query tokens (" << total_q << "), heads or requests";
  }

  aotinfer::MlaParams p{};
  // The caches as [pages, page_size, 1 head, dim]: a head axis of one.
  const int slot_axis = ckv_cache.ndim() == 3 ? 1 : -1;
  p.out = aotinfer::data_ptr<char>(out);
  p.out_stride_n = out.stride(0);
  p.out_stride_h = out.stride(1);
  p.lse = given.lse ? aotinfer::data_ptr<float>(lse) : nullptr;
  p.partial_out = given.partials ? aotinfer::data_ptr<float>(partial_out) : nullptr;
  p.partial_lse = given.partials ? aotinfer::data_ptr<float>(partial_lse) : nullptr;
  p.q = aotinfer::data_ptr<char>(q_nope);
  p.q_stride_n = q_nope.stride(0);
  p.q_stride_h = q_nope.stride(1);
  p.q_pe = aotinfer::data_ptr<char>(q_pe);
  p.q_pe_stride_n = q_pe.stride(0);
  p.q_pe_stride_h = q_pe.stride(1);
  p.k = aotinfer::data_ptr<char>(ckv_cache);
  p.k_stride_page = ckv_cache.stride(0);
  p.k_stride_slot = slot_axis > 0 ? ckv_cache.stride(slot_axis) : 0;
  p.kpe = aotinfer::data_ptr<char>(kpe_cache);
  p.kpe_stride_page = kpe_cache.stride(0);
  p.kpe_stride_slot = slot_axis > 0 ? kpe_cache.stride(slot_axis) : 0;
  p.indices = aotinfer::data_ptr<int32_t>(indices);
  p.last_page = uint32_t(std::clamp<int64_t>(ckv_cache.size(0) - 1, 0, INT32_MAX));
  p.batch = int(batch);
  p.num_qo_heads = int(num_heads);
  p.num_kv_heads = 1;
  p.group = int(num_heads);
  p.page_size = aotinfer::PageDivisor(uint32_t(page_size));
  p.scale_log2 = float(sm_scale * 1.4426950408889634);
  p.window_left = -1;
  p.work = aotinfer::data_ptr<int4>(work);
  p.requests = aotinfer::data_ptr<int4>(requests);
  p.group_divisor = aotinfer::PageDivisor(uint32_t(std::max<int64_t>(num_heads, 1)));
  p.v_scale = 1.f;
  p.causal = causal;

  if (aotinfer::IsStandIn(q_nope)) return;
  const int device = q_nope.device().device_id;
  aotinfer::DeviceGuard guard(device);
  cudaStream_t stream = aotinfer::get_stream(q_nope.device());
  aotinfer::RecordCapture(captured, stream);  // an empty batch too: its replay would launch nothing
  if (batch == 0 || ctas == 0 || total_q == 0 || num_heads == 0) return;
  const bool pdl = aotinfer::UsePdl(enable_pdl, device);
  DISPATCH_DLPACK_DTYPE_TO_CTYPE_FP16(q_nope.dtype(), T, [&] {
    CHECK_LAUNCH(aotinfer::BatchMla<T>(p, int(ctas), int(merge_from), int(total_q), stream, pdl, device), "batch_mla");
    return true;
  });
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(batch_mla, batch_mla);
