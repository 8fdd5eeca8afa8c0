// Bindings of the paged KV-cache writes (include/aotinfer/page.cuh): append_paged_kv_cache, its
// MLA form and get_batch_indices_positions. Outputs first.
#include <tuple>

#include "aotinfer/page.cuh"
#include "tvm_ffi_utils.h"

namespace {

// The dtypes a cache holds: 16-bit floats, float32 and FP8 (the append copies bytes).
void CheckCacheDtype(const TensorView& x, const char* name) {
  switch (aotinfer::DtypeKey(x.dtype())) {
    case aotinfer::DtypeKey(kDLFloat, 16):
    case aotinfer::DtypeKey(kDLBfloat, 16):
    case aotinfer::DtypeKey(kDLFloat, 32):
    case aotinfer::DtypeKey(kDLFloat8_e4m3fn, 8):
    case aotinfer::DtypeKey(kDLFloat8_e5m2, 8):
      return;
    default:
      AOTINFER_THROW(TypeError) << "Expected " << name
                               << " to have dtype float16, bfloat16, float32, float8_e4m3fn or float8_e5m2, got "
                               << x.dtype();
  }
}

void CheckLastContiguous(const TensorView& x, const char* name) {
  if (x.size(-1) > 1 && x.stride(-1) != 1) {
    AOTINFER_THROW(ValueError) << "Expected the last dimension of " << name << " to be contiguous, got stride "
                              << x.stride(-1);
  }
}

// K or V of the cache: [pages, page_size, heads, head_dim] (NHD) or [pages, heads, page_size,
// head_dim] (HND), of append_key's dtype, heads and head_dim.
aotinfer::PagedSide CheckCacheSide(const TensorView& x, const char* name, const TensorView& key, bool hnd,
                                   int64_t page_size) {
  const int64_t heads = key.size(1), head_dim = key.size(2);
  const int heads_dim = hnd ? 1 : 2, entry_dim = hnd ? 2 : 1;
  if (x.ndim() != 4 || x.size(heads_dim) != heads || x.size(3) != head_dim ||
      (page_size >= 0 && x.size(entry_dim) != page_size)) {
    AOTINFER_THROW(ValueError) << "Expected " << name << " to have shape [pages, "
                              << (hnd ? std::to_string(heads) + ", page_size" : "page_size, " + std::to_string(heads))
                              << ", " << head_dim << "] (" << (hnd ? "HND" : "NHD")
                              << "; append_key's heads and head_dim"
                              << (page_size >= 0 ? ", k_cache's page_size " + std::to_string(page_size) : "")
                              << "), got " << aotinfer::ShapeString(x.shape());
  }
  aotinfer::CheckSameDtype(x, key, name, "append_key");
  CheckLastContiguous(x, name);
  const int64_t bytes = key.dtype().bits / 8;
  return {aotinfer::data_ptr<char>(x), x.stride(0) * bytes, x.stride(heads_dim) * bytes, x.stride(entry_dim) * bytes};
}

}  // namespace

// k_cache/v_cache[slot of token i] = append_key/append_value[i], every head; the slot of token i
// is entry positions[i] % page_size of page kv_indices[kv_indptr[batch_indices[i]] + positions[i] /
// page_size]. kv_layout: 0 NHD, 1 HND. kv_last_page_len is checked for its shape only, as the slots
// follow from the positions.
void append_paged_kv_cache(TensorView k_cache, TensorView v_cache, TensorView append_key, TensorView append_value,
                           TensorView batch_indices, TensorView positions, TensorView kv_indices,
                           TensorView kv_indptr, TensorView kv_last_page_len, int64_t kv_layout,
                           int64_t enable_pdl) {
  // 1. Validate: the new K/V, the indices, the scalars, the cache, devices.
  aotinfer::CheckDim(3, append_key, "append_key");
  CheckLastContiguous(append_key, "append_key");
  CheckCacheDtype(append_key, "append_key");
  aotinfer::CheckSameShape(append_value, append_key, "append_value", "append_key");
  aotinfer::CheckSameDtype(append_value, append_key, "append_value", "append_key");
  CheckLastContiguous(append_value, "append_value");
  const int64_t nnz = append_key.size(0);
  aotinfer::AppendParams p;
  p.batch_indices = aotinfer::CheckIds(batch_indices, "batch_indices", nnz, "append_key's tokens");
  p.positions = aotinfer::CheckIds(positions, "positions", nnz, "append_key's tokens");
  p.kv_indices = aotinfer::CheckIds(kv_indices, "kv_indices", -1, "kv_indptr[-1]");
  p.kv_indptr = aotinfer::CheckIds(kv_indptr, "kv_indptr", -1, "batch_size + 1");
  const int64_t batch_size = kv_indptr.size(0) - 1;
  if (batch_size < 0) AOTINFER_THROW(ValueError) << "Expected kv_indptr to have at least 1 element, got none";
  aotinfer::CheckIds(kv_last_page_len, "kv_last_page_len", batch_size, "batch_size, from kv_indptr");
  if (kv_layout != 0 && kv_layout != 1) {
    AOTINFER_THROW(ValueError) << "Expected kv_layout to be 0 (NHD) or 1 (HND), got " << kv_layout;
  }
  aotinfer::CheckEnablePdl(enable_pdl);
  const bool hnd = kv_layout == 1;
  p.k_cache = CheckCacheSide(k_cache, "k_cache", append_key, hnd, -1);
  const int64_t page_size = k_cache.size(hnd ? 2 : 1);
  p.v_cache = CheckCacheSide(v_cache, "v_cache", append_key, hnd, page_size);
  aotinfer::CheckOnOneGpu({{append_key, "append_key"}, {append_value, "append_value"},
                           {batch_indices, "batch_indices"}, {positions, "positions"}, {kv_indices, "kv_indices"},
                           {kv_indptr, "kv_indptr"}, {kv_last_page_len, "kv_last_page_len"}, {k_cache, "k_cache"},
                           {v_cache, "v_cache"}});
  if (nnz == 0 || append_key.size(1) == 0 || append_key.size(2) == 0) return;
  if (page_size < 1) AOTINFER_THROW(ValueError) << "Expected k_cache to have a page_size of at least 1, got 0";
  const int64_t bytes = append_key.dtype().bits / 8;
  if (append_key.size(1) > INT_MAX / 64 || append_key.size(2) * bytes > INT_MAX / 64 || page_size > INT_MAX) {
    AOTINFER_THROW(ValueError) << "Expected fewer heads, head_dim and page_size, got append_key "
                              << aotinfer::ShapeString(append_key.shape()) << " and page_size " << page_size;
  }
  p.key = {aotinfer::data_ptr<const char>(append_key), append_key.stride(0) * bytes, append_key.stride(1) * bytes};
  p.value = {aotinfer::data_ptr<const char>(append_value), append_value.stride(0) * bytes,
             append_value.stride(1) * bytes};
  p.nnz = nnz;
  p.num_heads = int(append_key.size(1));
  p.key_row_bytes = p.value_row_bytes = int(append_key.size(2) * bytes);
  p.page_size = int(page_size);
  p.batch_size = batch_size;
  p.num_indices = kv_indices.size(0);
  p.num_pages = std::min(k_cache.size(0), v_cache.size(0));
  if (aotinfer::IsStandIn(append_key)) return;

  // 2. Guard the device; 3. get the stream; 4. launch.
  const int device = append_key.device().device_id;
  aotinfer::DeviceGuard guard(device);
  cudaStream_t stream = aotinfer::get_stream(append_key.device());
  CHECK_LAUNCH(aotinfer::AppendPagedKV(p, int(bytes), stream, aotinfer::UsePdl(enable_pdl, device)),
               "append_paged_kv_cache");
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(append_paged_kv_cache, append_paged_kv_cache);

// For request r's new tokens append_indptr[r] <= i < append_indptr[r + 1]: batch_indices[i] = r
// and positions[i] = seq_lens[r] - (append_indptr[r + 1] - i). Other entries are left as they are.
void get_batch_indices_positions(TensorView batch_indices, TensorView positions, TensorView append_indptr,
                                 TensorView seq_lens, int64_t enable_pdl) {
  const aotinfer::Ids indptr = aotinfer::CheckIds(append_indptr, "append_indptr", -1, "batch_size + 1");
  const int64_t batch_size = append_indptr.size(0) - 1;
  if (batch_size < 0) AOTINFER_THROW(ValueError) << "Expected append_indptr to have at least 1 element, got none";
  const aotinfer::Ids lens = aotinfer::CheckIds(seq_lens, "seq_lens", batch_size, "batch_size, from append_indptr");
  aotinfer::CheckEnablePdl(enable_pdl);
  for (const auto& [x, name] : {std::pair<const TensorView&, const char*>{batch_indices, "batch_indices"},
                                {positions, "positions"}}) {
    aotinfer::CheckDim(1, x, name);
    aotinfer::CheckContiguous(x, name);
    if (aotinfer::DtypeKey(x.dtype()) != aotinfer::DtypeKey(kDLInt, 32)) {
      AOTINFER_THROW(TypeError) << "Expected " << name << " to have dtype int32, got " << x.dtype();
    }
  }
  aotinfer::CheckSameShape(positions, batch_indices, "positions", "batch_indices");
  aotinfer::CheckOnOneGpu({{append_indptr, "append_indptr"}, {seq_lens, "seq_lens"},
                           {batch_indices, "batch_indices"}, {positions, "positions"}});
  if (batch_size == 0 || aotinfer::IsStandIn(append_indptr)) return;
  const int device = append_indptr.device().device_id;
  aotinfer::DeviceGuard guard(device);
  cudaStream_t stream = aotinfer::get_stream(append_indptr.device());
  CHECK_LAUNCH(aotinfer::BatchIndicesPositions(aotinfer::data_ptr<int32_t>(batch_indices),
                                               aotinfer::data_ptr<int32_t>(positions), indptr, lens, batch_size,
                                               stream, aotinfer::UsePdl(enable_pdl, device)),
               "get_batch_indices_positions");
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(get_batch_indices_positions, get_batch_indices_positions);

// MLA's cache: ckv_cache[slot of token i] = append_ckv[i], kpe_cache[slot] = append_kpe[i]; the
// caches are [pages, page_size, ckv_dim] and [pages, page_size, kpe_dim], slots as for
// append_paged_kv_cache.
void append_paged_mla_kv_cache(TensorView ckv_cache, TensorView kpe_cache, TensorView append_ckv,
                               TensorView append_kpe, TensorView batch_indices, TensorView positions,
                               TensorView kv_indices, TensorView kv_indptr, TensorView kv_last_page_len,
                               int64_t enable_pdl) {
  // 1. Validate: the new rows, the indices, the scalars, the caches, devices.
  aotinfer::CheckDim(2, append_ckv, "append_ckv");
  CheckLastContiguous(append_ckv, "append_ckv");
  CheckCacheDtype(append_ckv, "append_ckv");
  aotinfer::CheckDim(2, append_kpe, "append_kpe");
  CheckLastContiguous(append_kpe, "append_kpe");
  aotinfer::CheckSameDtype(append_kpe, append_ckv, "append_kpe", "append_ckv");
  const int64_t nnz = append_ckv.size(0);
  if (append_kpe.size(0) != nnz) {
    AOTINFER_THROW(ValueError) << "Expected append_kpe to have " << nnz << " rows (append_ckv's), got shape "
                              << aotinfer::ShapeString(append_kpe.shape());
  }
  aotinfer::AppendParams p;
  p.batch_indices = aotinfer::CheckIds(batch_indices, "batch_indices", nnz, "append_ckv's tokens");
  p.positions = aotinfer::CheckIds(positions, "positions", nnz, "append_ckv's tokens");
  p.kv_indices = aotinfer::CheckIds(kv_indices, "kv_indices", -1, "kv_indptr[-1]");
  p.kv_indptr = aotinfer::CheckIds(kv_indptr, "kv_indptr", -1, "batch_size + 1");
  const int64_t batch_size = kv_indptr.size(0) - 1;
  if (batch_size < 0) AOTINFER_THROW(ValueError) << "Expected kv_indptr to have at least 1 element, got none";
  aotinfer::CheckIds(kv_last_page_len, "kv_last_page_len", batch_size, "batch_size, from kv_indptr");
  aotinfer::CheckEnablePdl(enable_pdl);
  int64_t page_size = -1;
  const int64_t bytes = append_ckv.dtype().bits / 8;
  for (const auto& [cache, name, rows] : {std::tuple<const TensorView&, const char*, const TensorView&>{
                                              ckv_cache, "ckv_cache", append_ckv},
                                          {kpe_cache, "kpe_cache", append_kpe}}) {
    if (cache.ndim() != 3 || cache.size(2) != rows.size(1) || (page_size >= 0 && cache.size(1) != page_size)) {
      AOTINFER_THROW(ValueError) << "Expected " << name << " to have shape [pages, page_size, " << rows.size(1)
                                << "]" << (page_size >= 0 ? " (ckv_cache's page_size " + std::to_string(page_size) + ")" : "")
                                << ", got " << aotinfer::ShapeString(cache.shape());
    }
    aotinfer::CheckSameDtype(cache, append_ckv, name, "append_ckv");
    CheckLastContiguous(cache, name);
    page_size = cache.size(1);
  }
  aotinfer::CheckOnOneGpu({{append_ckv, "append_ckv"}, {append_kpe, "append_kpe"}, {batch_indices, "batch_indices"},
                           {positions, "positions"}, {kv_indices, "kv_indices"}, {kv_indptr, "kv_indptr"},
                           {kv_last_page_len, "kv_last_page_len"}, {ckv_cache, "ckv_cache"},
                           {kpe_cache, "kpe_cache"}});
  if (nnz == 0) return;
  if (page_size < 1) AOTINFER_THROW(ValueError) << "Expected ckv_cache to have a page_size of at least 1, got 0";
  if ((append_ckv.size(1) + append_kpe.size(1)) * bytes > INT_MAX / 64 || page_size > INT_MAX) {
    AOTINFER_THROW(ValueError) << "Expected smaller rows and pages, got append_ckv "
                              << aotinfer::ShapeString(append_ckv.shape()) << " and page_size " << page_size;
  }
  p.k_cache = {aotinfer::data_ptr<char>(ckv_cache), ckv_cache.stride(0) * bytes, 0, ckv_cache.stride(1) * bytes};
  p.v_cache = {aotinfer::data_ptr<char>(kpe_cache), kpe_cache.stride(0) * bytes, 0, kpe_cache.stride(1) * bytes};
  p.key = {aotinfer::data_ptr<const char>(append_ckv), append_ckv.stride(0) * bytes, 0};
  p.value = {aotinfer::data_ptr<const char>(append_kpe), append_kpe.stride(0) * bytes, 0};
  p.nnz = nnz;
  p.num_heads = 1;
  p.key_row_bytes = int(append_ckv.size(1) * bytes);
  p.value_row_bytes = int(append_kpe.size(1) * bytes);
  p.page_size = int(page_size);
  p.batch_size = batch_size;
  p.num_indices = kv_indices.size(0);
  p.num_pages = std::min(ckv_cache.size(0), kpe_cache.size(0));
  if (aotinfer::IsStandIn(append_ckv)) return;

  // 2. Guard the device; 3. get the stream; 4. launch.
  const int device = append_ckv.device().device_id;
  aotinfer::DeviceGuard guard(device);
  cudaStream_t stream = aotinfer::get_stream(append_ckv.device());
  CHECK_LAUNCH(aotinfer::AppendPagedKV(p, int(bytes), stream, aotinfer::UsePdl(enable_pdl, device)),
               "append_paged_mla_kv_cache");
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(append_paged_mla_kv_cache, append_paged_mla_kv_cache);
