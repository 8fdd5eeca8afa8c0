// Writes into a paged KV cache: append_paged_kv_cache's copy of each new token's K and V heads to
// its slot (page kv_indices[kv_indptr[request] + position / page_size], entry position % page_size),
// and get_batch_indices_positions, which lists each new token's request and position.
//
// The append is a scattered copy, so it moves bytes, whatever the dtype: 16-byte accesses where
// every row start allows them, else accesses of one element. A block takes one token (or a few,
// when a token has few bytes) with all its heads; each thread loads two pieces before it looks up
// their slots, so that the loads overlap the chains of index reads. A token whose slot is not in
// the cache (an index out of range: the caller's error, which FlashInfer leaves undefined) is not
// written.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>

#include "aotinfer/ids.cuh"
#include "aotinfer/launch.cuh"

namespace aotinfer {

// K or V of the cache, strides in bytes: page, head, entry (NHD and HND differ only in these).
struct PagedSide {
  char* data = nullptr;
  int64_t stride_page = 0, stride_h = 0, stride_n = 0;
};

// New tokens' K or V [nnz, heads, head_dim], strides in bytes.
struct AppendSide {
  const char* data = nullptr;
  int64_t stride_n = 0, stride_h = 0;
};

struct AppendParams {
  PagedSide k_cache, v_cache;
  AppendSide key, value;
  Ids batch_indices, positions, kv_indices, kv_indptr;
  int64_t nnz = 0;
  int num_heads = 0;        // of K and of V
  int key_row_bytes = 0;    // a head's bytes: head_dim * element size (MLA: ckv_dim and kpe_dim)
  int value_row_bytes = 0;
  int page_size = 0;
  int64_t batch_size = 0, num_indices = 0, num_pages = 0;  // the bounds of the ids read on the GPU
};

constexpr int kAppendMaxThreads = 512;

// Units a thread moves at once: their loads are all issued before the first slot is looked up,
// so that the loads overlap the chains of index reads.
constexpr int kAppendUnits = 2;

template <typename Access>
__global__ void __launch_bounds__(kAppendMaxThreads) AppendPagedKVKernel(const AppendParams p, int tokens_per_block) {
  constexpr int kBytes = sizeof(Access);
  const int key_chunks = p.key_row_bytes / kBytes, value_chunks = p.value_row_bytes / kBytes;
  const int key_units = p.num_heads * key_chunks;
  const int units_per_token = key_units + p.num_heads * value_chunks;
  const int64_t first = int64_t(blockIdx.x) * tokens_per_block;
  const int total = int(min(int64_t(tokens_per_block), p.nnz - first)) * units_per_token;
  WaitForPriorGrids();  // the new K/V and the indices may come from the kernel before
  for (int w0 = threadIdx.x; w0 < total; w0 += kAppendUnits * blockDim.x) {
    Access x[kAppendUnits];
    int64_t n[kAppendUnits];
    int head[kAppendUnits], offset[kAppendUnits];
    bool is_value[kAppendUnits];
#pragma unroll
    for (int k = 0; k < kAppendUnits; ++k) {
      const int w = w0 + k * blockDim.x;
      if (w >= total) break;
      const int t = w / units_per_token;
      int rest = w - t * units_per_token;
      is_value[k] = rest >= key_units;
      rest -= is_value[k] ? key_units : 0;
      const int chunks = is_value[k] ? value_chunks : key_chunks;
      head[k] = rest / chunks;
      offset[k] = (rest - head[k] * chunks) * kBytes;
      n[k] = first + t;
      const AppendSide& src = is_value[k] ? p.value : p.key;
      x[k] = *reinterpret_cast<const Access*>(src.data + n[k] * src.stride_n + head[k] * src.stride_h + offset[k]);
    }
#pragma unroll
    for (int k = 0; k < kAppendUnits; ++k) {
      if (w0 + k * blockDim.x >= total) break;
      // Unsigned, so that each bound is one compare: a negative request or page is beyond its
      // bound, and a negative position's index is too.
      const uint64_t position = p.positions[n[k]], request = p.batch_indices[n[k]];
      if (request >= uint64_t(p.batch_size)) continue;
      const uint64_t index = uint64_t(p.kv_indptr[request]) + position / uint32_t(p.page_size);
      if (index >= uint64_t(p.num_indices)) continue;
      const uint64_t page = p.kv_indices[index];
      if (page >= uint64_t(p.num_pages)) continue;
      const uint64_t entry = position % uint32_t(p.page_size);
      const PagedSide& dst = is_value[k] ? p.v_cache : p.k_cache;
      *reinterpret_cast<Access*>(dst.data + page * dst.stride_page + head[k] * dst.stride_h +
                                 entry * dst.stride_n + offset[k]) = x[k];
    }
  }
}

template <typename Access>
cudaError_t LaunchAppendPagedKV(const AppendParams& p, cudaStream_t stream, bool pdl) {
  const int64_t units_per_token =
      int64_t(p.num_heads) * ((p.key_row_bytes + p.value_row_bytes) / int(sizeof(Access)));
  if (units_per_token == 0) return cudaSuccess;
  if (units_per_token > INT_MAX / 4) return cudaErrorInvalidValue;
  // Enough tokens a block for about 512 units, kAppendUnits a thread.
  const int64_t tokens_per_block = std::min<int64_t>(units_per_token >= 512 ? 1 : 512 / units_per_token, p.nnz);
  const int64_t threads_wanted = (tokens_per_block * units_per_token + kAppendUnits - 1) / kAppendUnits;
  const int threads = int(std::min<int64_t>((threads_wanted + 31) / 32 * 32, kAppendMaxThreads));
  const int64_t blocks = (p.nnz + tokens_per_block - 1) / tokens_per_block;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  return Launch(AppendPagedKVKernel<Access>, dim3(unsigned(blocks)), dim3(threads), stream, pdl, p,
                int(tokens_per_block));
}

// Copies key[i] and value[i] (every head) to the cache slot of token i (MLA: ckv and kpe, one head
// each). `element_bytes` is the dtype's size (1, 2 or 4); pointers, strides and rows must be
// multiples of it.
inline cudaError_t AppendPagedKV(const AppendParams& p, int element_bytes, cudaStream_t stream, bool pdl) {
  if (p.nnz == 0) return cudaSuccess;
  auto aligned16 = [](const void* ptr, std::initializer_list<int64_t> strides) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return false;
    for (int64_t s : strides) {
      if (s % 16 != 0) return false;
    }
    return true;
  };
  if (p.key_row_bytes % 16 == 0 && p.value_row_bytes % 16 == 0 &&
      aligned16(p.k_cache.data, {p.k_cache.stride_page, p.k_cache.stride_h, p.k_cache.stride_n}) &&
      aligned16(p.v_cache.data, {p.v_cache.stride_page, p.v_cache.stride_h, p.v_cache.stride_n}) &&
      aligned16(p.key.data, {p.key.stride_n, p.key.stride_h}) &&
      aligned16(p.value.data, {p.value.stride_n, p.value.stride_h})) {
    return LaunchAppendPagedKV<uint4>(p, stream, pdl);
  }
  switch (element_bytes) {
    case 1: return LaunchAppendPagedKV<uint8_t>(p, stream, pdl);
    case 2: return LaunchAppendPagedKV<uint16_t>(p, stream, pdl);
    case 4: return LaunchAppendPagedKV<uint32_t>(p, stream, pdl);
    default: return cudaErrorInvalidValue;
  }
}

// For each request r, the new tokens append_indptr[r] <= i < append_indptr[r + 1] (the last of
// request r's seq_lens[r] tokens): batch_indices[i] = r, positions[i] = seq_lens[r] - (end - i).
// One block a request; entries past append_indptr[batch_size] are left alone.
__global__ void BatchIndicesPositionsKernel(int32_t* batch_indices, int32_t* positions, Ids append_indptr,
                                            Ids seq_lens) {
  WaitForPriorGrids();
  const int r = blockIdx.x;
  const int64_t begin = append_indptr[r], end = append_indptr[r + 1];
  const int64_t last = seq_lens[r];
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    batch_indices[i] = r;
    positions[i] = int32_t(last - (end - i));
  }
}

inline cudaError_t BatchIndicesPositions(int32_t* batch_indices, int32_t* positions, Ids append_indptr, Ids seq_lens,
                                         int64_t batch_size, cudaStream_t stream, bool pdl) {
  if (batch_size == 0) return cudaSuccess;
  if (batch_size > INT_MAX) return cudaErrorInvalidConfiguration;
  return Launch(BatchIndicesPositionsKernel, dim3(unsigned(batch_size)), dim3(128), stream, pdl, batch_indices,
                positions, append_indptr, seq_lens);
}

}  // namespace aotinfer
