// Sums across the threads that share a row (two at once, as LayerNorm needs): a row is blockDim.x threads (a multiple of 32, at
// most 1024) and a block holds blockDim.y rows.
#pragma once

namespace aotinfer {

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The sums of v.x and v.y over the row's threads, returned to all of them. Every thread of the
// block must call it (it synchronizes); shared holds 32 pairs per row of the block.
__device__ __forceinline__ float2 RowSum(float2 v, float2 (*shared)[32]) {
  v.x = WarpSum(v.x);
  v.y = WarpSum(v.y);
  if (blockDim.x == 32) return v;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[threadIdx.y][warp] = v;
  __syncthreads();
  v = lane < int(blockDim.x / 32) ? shared[threadIdx.y][lane] : make_float2(0.f, 0.f);
  v.x = WarpSum(v.x);
  v.y = WarpSum(v.y);
  __syncthreads();  // shared is free again for the next sum
  return v;
}

}  // namespace aotinfer
