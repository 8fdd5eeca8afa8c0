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
  // RoPE inside the kernel (pos_encoding_mode "ROPE_LLAMA"; kernels instantiated for it): dim pair
  // j of a head turns by position * rope_rcp_scale * 2^(rope_log2_rcp_theta * 2j / head_dim).
  float rope_rcp_scale;
  float rope_log2_rcp_theta;     // log2(1 / rope_theta)
};

// RoPE inside attention, as FlashInfer's pos_encoding_mode "ROPE_LLAMA" defines it: dims j and
// j + D/2 of a query or key head turn together by its position times frequency j (above), in
// float32, the result rounded once to T where it lands in shared memory. Queries sit at kv_len -
// q_len + i, keys at their index in the request.
//
// The threads turn the rows they copied into shared memory, once their copies have landed and
// before the barrier that publishes them. Chunk column c of a row (D / 8 columns) holds dims
// that pair with column c ^ D / 16, which lane ^ D / 16 copied (the copies take a row's columns on
// consecutive lanes, D / 8 <= 32 of them); after a __syncwarp the two lanes share the work, each
// turning 4 of the 8 dim pairs of both chunks, so each cos and sin is made once. The lanes' rows
// (`chunk(i, column)` the address of a row's chunk) are at positions pos0 + i * stride: the cos and
// sin of the first come from __sincosf of position times frequency (FlashInfer's form), the others
// by turning those by the stride's angle (docs/design/rope.md#inside-attention). Every lane of the
// warp calls it alike.
template <typename T, int D, int kRows, typename Chunk>
__device__ __forceinline__ void RopeRowsInPlace(const AttentionParams& p, int column, Chunk chunk, int pos0, int stride) {
  static_assert(D % 16 == 0 && D / 8 <= 32, "a row's chunks on the lanes of one warp");
  constexpr int kHalfColumns = D / 16;
  const int side = (column & kHalfColumns) != 0;  // this lane's 4 pairs: 4 side .. 4 side + 3 of the chunks
  const int lo_column = column & ~kHalfColumns;
  float cosine[4], sine[4], step_cos[4], step_sin[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int j = lo_column * 8 + side * 4 + e;
    const float freq = p.rope_rcp_scale * exp2f(p.rope_log2_rcp_theta * (float(2 * j) / float(D)));
    __sincosf(float(pos0) * freq, &sine[e], &cosine[e]);
    if (kRows > 1) __sincosf(float(stride) * freq, &step_sin[e], &step_cos[e]);
  }
  __syncwarp();  // the partner lane's copies, landed for it, are seen here
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    uint2* const lo_at = reinterpret_cast<uint2*>(chunk(i, lo_column) + 8 * side);
    uint2* const hi_at = reinterpret_cast<uint2*>(chunk(i, lo_column | kHalfColumns) + 8 * side);
    const uint2 lo_raw = *lo_at, hi_raw = *hi_at;
    const T* x = reinterpret_cast<const T*>(&lo_raw);
    const T* y = reinterpret_cast<const T*>(&hi_raw);
    float lo[4], hi[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float a = to_float(x[e]), b = to_float(y[e]);
      lo[e] = a * cosine[e] - b * sine[e];
      hi[e] = b * cosine[e] + a * sine[e];
    }
    *lo_at = make_uint2(PackPair<T>(lo[0], lo[1]), PackPair<T>(lo[2], lo[3]));
    *hi_at = make_uint2(PackPair<T>(hi[0], hi[1]), PackPair<T>(hi[2], hi[3]));
    if (i + 1 < kRows) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float c = cosine[e];
        cosine[e] = c * step_cos[e] - sine[e] * step_sin[e];
        sine[e] = sine[e] * step_cos[e] + c * step_sin[e];
      }
    }
  }
}

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
