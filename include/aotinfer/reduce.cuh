// Sums across the threads that share a row: a row is blockDim.x threads (a multiple of 32, at
// most 1024) and a block holds blockDim.y rows.
#pragma once

namespace aotinfer {

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The sum of v over the row's threads, returned to all of them. Every thread of the block must
// call it (it synchronizes); shared holds 32 floats per row of the block.
__device__ __forceinline__ float RowSum(float v, float (*shared)[32]) {
  v = WarpSum(v);
  if (blockDim.x == 32) return v;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[threadIdx.y][warp] = v;
  __syncthreads();
  v = lane < int(blockDim.x / 32) ? shared[threadIdx.y][lane] : 0.f;
  v = WarpSum(v);
  __syncthreads();  // shared is free again for the next sum
  return v;
}

}  // namespace aotinfer
