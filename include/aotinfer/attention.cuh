// What decode and prefill attention share: base-2 softmax helpers, the page-index divisor, the
// widening of fp8 KV to half, and the merge of a split sequence's partial results.
//
// Softmax runs in base 2: logits are scaled by sm_scale * log2(e) (or soft-capped, cap * tanh(x /
// cap), then scaled by log2(e)), and an LSE is log2 of the sum of exp2 of them. A sequence whose
// keys were split over several work items has one partial output and LSE per item (in float32);
// MergePartialsKernel combines them, adding a sink (per query head, natural-log domain) once.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "aotinfer/launch.cuh"
#include "aotinfer/mma.cuh"
#include "aotinfer/reduce.cuh"
#include "aotinfer/vec.cuh"

namespace aotinfer {

constexpr float kLog2e = 1.4426950408889634f;

// n / d for 0 <= n < 2^31 and a divisor d fixed at launch: a multiply-high, an add and a shift
// instead of the 20-odd instructions of a division (a token's page, for every chunk copied).
struct PageDivisor {
  uint32_t divisor = 1, multiplier = 1, shift = 0;
  PageDivisor() = default;
  explicit PageDivisor(uint32_t d) : divisor(d) {
    while ((1u << shift) < d) ++shift;  // ceil(log2(d))
    multiplier = uint32_t((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d) / d + 1);
  }
  __device__ __forceinline__ uint32_t Divide(uint32_t n) const { return (__umulhi(n, multiplier) + n) >> shift; }
};

__device__ __forceinline__ float Exp2(float x) {  // ex2.approx: exp2(-inf) = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Where a row's running max is -inf (nothing seen yet), exp2(x - max) must still be 0, not NaN.
__device__ __forceinline__ float SafeBase(float running_max) { return running_max == -INFINITY ? 0.f : running_max; }

// A row's running max moved to take in `tile_max` (this thread's, reduced here over the quad of
// lanes that hold the row, as mma.sync and wgmma fragments spread it) and its running sum rescaled
// to it; returns alpha, the factor that rescales what was accumulated under the old max.
__device__ __forceinline__ float MoveRowMax(float tile_max, float& row_max, float& row_sum) {
  tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
  tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
  const float new_max = fmaxf(row_max, tile_max);
  const float alpha = Exp2(row_max - SafeBase(new_max));
  row_max = new_max;
  row_sum *= alpha;
  return alpha;
}

// fp8 KV caches land in shared memory as stored and are widened to half, which holds every fp8
// value exactly (one conversion instruction a pair; two fp8 to bfloat16 take four), in registers
// between ldmatrix and the tensor cores; the tensor cores then run in half, and a bfloat16 q is
// converted once, clamped to half's range (+-65504).
// Two fp8 elements (the low byte first) as two halves in one register, the first in the low half.
template <typename KV>
__device__ __forceinline__ uint32_t WidenPairToHalf(uint16_t pair) {
  constexpr __nv_fp8_interpretation_t kFormat = std::is_same_v<KV, __nv_fp8_e4m3> ? __NV_E4M3 : __NV_E5M2;
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(pair, kFormat);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

// A 16-byte chunk of 8 bfloat16 as 8 halves, clamped to half's finite range (the fp8 path's q).
__device__ __forceinline__ uint4 BfloatToHalf8(uint4 raw) {
  const nv_bfloat16* x = reinterpret_cast<const nv_bfloat16*>(&raw);
  uint4 r;
  uint32_t* w = reinterpret_cast<uint32_t*>(&r);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = PackPair<half>(fminf(fmaxf(__bfloat162float(x[2 * i]), -65504.f), 65504.f),
                          fminf(fmaxf(__bfloat162float(x[2 * i + 1]), -65504.f), 65504.f));
  }
  return r;
}

// The tensors and options of one attention launch that decode and prefill share; each op's params
// add its work tables. Every pointer is on the same GPU, strides are in elements.
struct AttentionParams {
  void* out;                     // [rows, num_qo_heads, head_dim] of T; rows: requests (decode), query tokens (prefill)
  int64_t out_stride_n, out_stride_h;
  float* lse;                    // [rows, num_qo_heads], base 2; null: not written
  float* partial_out;            // [slots, num_qo_heads, head_dim]
  float* partial_lse;            // [slots, num_qo_heads]
  const void* q;                 // [rows, num_qo_heads, head_dim] of T
  int64_t q_stride_n, q_stride_h;
  const void* k;                 // KV element (page, slot, head, d); ragged: (token, -, head, d)
  const void* v;
  int64_t k_stride_page, k_stride_slot, k_stride_head;
  int64_t v_stride_page, v_stride_slot, v_stride_head;
  const int32_t* indices;        // page ids; null: ragged
  uint32_t last_page;            // the cache's last page id (paged; see PageInCache)
  const float* sinks;            // [num_qo_heads] or null
  int batch;
  int num_qo_heads, num_kv_heads;
  int group;                     // num_qo_heads / num_kv_heads
  PageDivisor page_size;
  float scale_log2;              // sm_scale * log2(e)
  float soft_cap;                // 0: off
  int window_left;               // < 0: off
};

// A page id as prefill reads it: an id outside the cache (the caller's error, which FlashInfer
// leaves undefined) reads the last page instead of memory beyond the cache; a negative id, cast,
// is beyond it too. (Decode tests the id instead: DecodeKvLoader::publish.)
__device__ __forceinline__ int PageInCache(int32_t page, uint32_t last_page) {
  return int(min(uint32_t(page), last_page));
}

// Rows (a decode request, a prefill query token) whose keys were split: a Partials functor says
// where row n's partials are, (first, count) = partials(n); its partial i of head h is
// partial_out[((first + i) * num_qo_heads + h) * D ...], with LSE partial_lse[(first + i) *
// num_qo_heads + h]. Rows with count <= 1 were written whole and are left alone.

// Partials listed row by row: (-, -, first, count) in an int4 table.
struct RowTablePartials {
  const int4* rows;
  int merged_elsewhere;  // requests of at most this many partials are merged by another kernel
  __device__ __forceinline__ int2 operator()(int row) const {
    const int4 info = rows[row];
    return make_int2(info.z, info.w > merged_elsewhere ? info.w : 0);
  }
};

constexpr int kMergePartialsThreads = 128;
constexpr int kMergeBatch = 8;  // partials a warp has in flight

// out = sum_i 2^lse_i partial_i / (sum_i 2^lse_i + e^sink). A block a (row, query head), grid
// (rows, heads): each warp folds every fourth partial into a running max, sum and weighted output
// (D / 32 dims a lane), with kMergeBatch partials' loads in flight at once, then the four warps'
// states are merged through shared memory.
template <typename T, int D, typename Partials>
__global__ void __launch_bounds__(kMergePartialsThreads) MergePartialsKernel(const AttentionParams p,
                                                                             const Partials partials, int first_row) {
  constexpr int kWarps = kMergePartialsThreads / 32, kDims = D / 32;
  __shared__ __align__(16) float warp_out[kWarps][D];
  __shared__ float warp_max[kWarps], warp_sum[kWarps];
  const int row = first_row + int(blockIdx.x), head = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int2 where = partials(row);  // plan's table: read while the kernel before finishes (PDL)
  const int first = where.x, count = where.y;
  if (count <= 1) return;  // written by its only item
  WaitForPriorGrids();
  const int64_t heads = p.num_qo_heads;
  const float* lse = p.partial_lse + int64_t(first) * heads + head;  // partial i at lse[i * heads]
  const float* x = p.partial_out + (int64_t(first) * heads + head) * D + lane * kDims;
  float m = -INFINITY, sum = 0.f, acc[kDims] = {};
  for (int i0 = warp; i0 < count; i0 += kWarps * kMergeBatch) {
    float l[kMergeBatch], y[kMergeBatch][kDims];
#pragma unroll
    for (int j = 0; j < kMergeBatch; ++j) {
      const int i = i0 + j * kWarps;
      l[j] = i < count ? lse[i * heads] : -INFINITY;
#pragma unroll
      for (int d = 0; d < kDims; d += 2) {
        const float2 v = i < count ? *reinterpret_cast<const float2*>(x + i * heads * D + d) : make_float2(0.f, 0.f);
        y[j][d] = v.x;
        y[j][d + 1] = v.y;
      }
    }
    float batch_max = m;
#pragma unroll
    for (int j = 0; j < kMergeBatch; ++j) batch_max = fmaxf(batch_max, l[j]);
    const float base = SafeBase(batch_max), alpha = Exp2(m - base);
    sum *= alpha;
#pragma unroll
    for (int d = 0; d < kDims; ++d) acc[d] *= alpha;
#pragma unroll
    for (int j = 0; j < kMergeBatch; ++j) {
      const float weight = Exp2(l[j] - base);
      sum += weight;
#pragma unroll
      for (int d = 0; d < kDims; ++d) acc[d] += weight * y[j][d];
    }
    m = batch_max;
  }
  if (lane == 0) {
    warp_max[warp] = m;
    warp_sum[warp] = sum;
  }
#pragma unroll
  for (int d = 0; d < kDims; d += 2) *reinterpret_cast<float2*>(&warp_out[warp][lane * kDims + d]) = make_float2(acc[d], acc[d + 1]);
  __syncthreads();

  const float sink = p.sinks != nullptr ? p.sinks[head] * kLog2e : -INFINITY;
  float top = sink;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) top = fmaxf(top, warp_max[w]);
  const float base = SafeBase(top);
  float weight[kWarps], total = Exp2(sink - base);
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    weight[w] = Exp2(warp_max[w] - base);
    total += weight[w] * warp_sum[w];
  }
  const float inv = total > 0.f ? 1.f / total : 0.f;
  T* out = static_cast<T*>(p.out) + row * p.out_stride_n + head * p.out_stride_h;
  for (int d = threadIdx.x; d < D; d += kMergePartialsThreads) {
    float y = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) y += weight[w] * warp_out[w][d];
    out[d] = from_float<T>(y * inv);
  }
  if (p.lse != nullptr && threadIdx.x == 0) p.lse[int64_t(row) * heads + head] = total > 0.f ? base + __log2f(total) : -INFINITY;
}

// The merge of rows first_row .. first_row + num_rows - 1.
template <typename T, int D, typename Partials>
cudaError_t MergePartials(const AttentionParams& p, int num_rows, const Partials& partials, cudaStream_t stream,
                          bool pdl, int first_row = 0) {
  if (num_rows == 0 || p.num_qo_heads == 0) return cudaSuccess;
  const dim3 grid(unsigned(num_rows), unsigned(p.num_qo_heads));
  return Launch(MergePartialsKernel<T, D, Partials>, grid, dim3(kMergePartialsThreads), stream, pdl, p, partials,
                first_row);
}

}  // namespace aotinfer
