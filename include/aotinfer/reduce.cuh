// Sums across the threads that share a row: a row is blockDim.x threads (a multiple of 32, at most
// 1024) and a block holds blockDim.y rows. Pairs are summed, as LayerNorm needs (sum and sum of
// squares), for kRows rows at once per thread.
#pragma once

namespace aotinfer {

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Replaces each v[i] with its sum over the row's threads, in all of them. Every thread of the
// block must call it (it synchronizes); shared holds 32 pairs for each of blockDim.y * kRows rows.
template <int kRows>
__device__ __forceinline__ void RowSums(float2 (&v)[kRows], float2 (*shared)[32]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i) v[i] = make_float2(WarpSum(v[i].x), WarpSum(v[i].y));
  if (blockDim.x == 32) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float2(*mine)[32] = shared + threadIdx.y * kRows;
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) mine[i][warp] = v[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const float2 partial = lane < int(blockDim.x / 32) ? mine[i][lane] : make_float2(0.f, 0.f);
    v[i] = make_float2(WarpSum(partial.x), WarpSum(partial.y));
  }
  __syncthreads();  // shared is free again for the next sum
}

}  // namespace aotinfer
