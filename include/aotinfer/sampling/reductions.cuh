// The sampling kernels' shared memory (SamplingShared: histogram, candidates, scratch) and the
// reductions through it: over a block, and over a row whose blocks (a cluster, on sm90+) meet in
// distributed shared memory, every one in a fixed order so that the tokens do not depend on the
// split. The scheme: sampling.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "aotinfer/rows.cuh"

namespace aotinfer {

// The sizes SamplingShared is laid out by.
constexpr int kSamplingWarps = kRowThreads / 32;
static_assert(kSamplingWarps == 32, "block scans give each warp's total to one lane");
constexpr int kSamplingBins = 4096;    // 12 bits of the key per histogram level
constexpr int kCandidates = 8192;      // elements of the threshold's bin sorted in shared memory
constexpr int kSortedCandidates = 2048;  // candidates sorted rather than searched by histograms
constexpr int kTopPDraws = 4;          // top-p's draws from the whole row, verified (DrawTopP)
constexpr int kWindowKeys = 2 * kCandidates;  // keys the top-p renorm's first pass may gather (TopPWindow) ...
constexpr int kOwnWindowKeys = 14;             // ... in each thread's own slots, then in a pool the block shares
constexpr int kPooledWindowKeys = kWindowKeys - kOwnWindowKeys * kRowThreads;

struct Best {  // the race's leader: the largest key, the lower index on ties
  float key;
  int index;
};
__device__ __forceinline__ Best Better(Best a, Best b) {
  return (b.key > a.key || (b.key == a.key && b.index < a.index)) ? b : a;
}

struct SamplingShared {
  uint32_t count[kSamplingBins];           // histogram: elements per bin ...
  uint32_t mass_hi[kSamplingBins];         // ... and the sums of their mantissas' top and low 12
  uint32_t mass_lo[kSamplingBins];         // bits (32-bit atomics: 64-bit ones are loops); after the scan:
  uint32_t cum_count[kSamplingBins];       // elements in this bin and above
  double cum_mass[kSamplingBins];          // mass of this bin and above
  union {
    struct {
      uint32_t cand_key[kCandidates];
      int cand_index[kCandidates];
    };
    uint32_t window_keys[kWindowKeys];     // the top-p renormalization's keys gathered beside its histogram
  };
  double scratch_d[kSamplingWarps];
  float scratch_f[kSamplingWarps];
  int scratch_i[kSamplingWarps];
  int num_candidates;
  int sorted_count;                        // num_candidates when last sorted; -1 after a gather
  int found;                               // a bin or position found by a block-wide search
  float part_value;                        // this block's share of a row-wide reduction
  unsigned long long part_sum;
  double part_double;
  Best part_best;
  // Top-p's verified draws (DrawTopP): each draw's chunk, its mass left to walk in that chunk, its
  // element and key; the row's mass; the sums of the verifying pass, by warp, then by block.
  int draw_chunk[kTopPDraws];
  double draw_left[kTopPDraws];
  int draw_index[kTopPDraws];
  uint32_t draw_key[kTopPDraws];
  double draw_row_mass;
  double verify_warp[kTopPDraws + 1][kSamplingWarps];
  double verify_part[kTopPDraws + 1];
};

// `v` combined by `op` over the block, in every thread: each warp's result goes through
// `scratch` (one slot a warp: kSamplingWarps == 32, one a lane), then the warps' results combine.
template <typename T, typename Op>
__device__ __forceinline__ T BlockReduce(T v, T* scratch, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[threadIdx.x % 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  return v;
}

__device__ __forceinline__ float BlockMax(float v, SamplingShared& sh) {
  return BlockReduce(v, sh.scratch_f, [](float a, float b) { return fmaxf(a, b); });
}

__device__ __forceinline__ float BlockSum(float v, SamplingShared& sh) {
  return BlockReduce(v, sh.scratch_f, [](float a, float b) { return a + b; });
}

// The block's best (the race's winner), in every thread; through one key and one index a warp.
__device__ __forceinline__ Best BlockBest(Best b, float* keys, int* indices) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    b = Better(b, Best{__shfl_xor_sync(0xffffffffu, b.key, o), __shfl_xor_sync(0xffffffffu, b.index, o)});
  }
  if (threadIdx.x % 32 == 0) {
    keys[threadIdx.x / 32] = b.key;
    indices[threadIdx.x / 32] = b.index;
  }
  __syncthreads();
  b = Best{keys[threadIdx.x % 32], indices[threadIdx.x % 32]};
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    b = Better(b, Best{__shfl_xor_sync(0xffffffffu, b.key, o), __shfl_xor_sync(0xffffffffu, b.index, o)});
  }
  __syncthreads();
  return b;
}

__device__ __forceinline__ Best BlockBest(Best b, SamplingShared& sh) { return BlockBest(b, sh.scratch_f, sh.scratch_i); }

// Row-wide reductions: each block's result, merged in part order (the same for every split).
__device__ __forceinline__ float RowMax(float v, SamplingShared& sh) {
  v = BlockMax(v, sh);
  if (threadIdx.x == 0) sh.part_value = v;
  SyncRow();
  for (int r = 0; r < RowParts(); ++r) v = fmaxf(v, *PartShared(&sh.part_value, r));
  SyncRow();
  return v;
}
__device__ __forceinline__ float RowSum(float v, SamplingShared& sh) {
  v = BlockSum(v, sh);
  if (threadIdx.x == 0) sh.part_value = v;
  SyncRow();
  v = 0.f;
  for (int r = 0; r < RowParts(); ++r) v += *PartShared(&sh.part_value, r);
  SyncRow();
  return v;
}
// The sum of doubles over the row, in a fixed order (the same on every run), valid in every thread.
__device__ __forceinline__ double RowSumDouble(double v, SamplingShared& sh) {
  v = BlockReduce(v, sh.scratch_d, [](double a, double b) { return a + b; });
  if (threadIdx.x == 0) sh.part_double = v;
  SyncRow();
  v = 0;
  for (int r = 0; r < RowParts(); ++r) v += *PartShared(&sh.part_double, r);
  SyncRow();
  return v;
}

// The race's winner over the row (valid in every thread).
__device__ __forceinline__ Best RowBest(Best b, SamplingShared& sh) {
  b = BlockBest(b, sh);
  if (threadIdx.x == 0) sh.part_best = b;
  SyncRow();
  for (int r = 0; r < RowParts(); ++r) b = Better(b, *PartShared(&sh.part_best, r));
  SyncRow();
  return b;
}

// Exclusive prefix sum of doubles over the block in thread order (a fixed order: deterministic).
__device__ __forceinline__ double BlockExclusiveSum(double v, SamplingShared& sh) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  double incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const double other = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += other;
  }
  if (lane == 31) sh.scratch_d[warp] = incl;
  __syncthreads();
  // The warps' totals, scanned the same way by every warp (kSamplingWarps == 32 lanes).
  double warps_incl = sh.scratch_d[lane];
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const double other = __shfl_up_sync(0xffffffffu, warps_incl, o);
    if (lane >= o) warps_incl += other;
  }
  const double below = __shfl_sync(0xffffffffu, warps_incl, (warp + 31) % 32);
  const double warp_base = warp == 0 ? 0.0 : below;
  __syncthreads();
  return warp_base + incl - v;
}

// The four 32-bit words at `local` (a 16-byte aligned address in this block's shared memory) in
// block `part`'s shared memory: one 16-byte load through the cluster's shared window (the form
// measured; PartShared's generic address would make it a generic load).
__device__ __forceinline__ uint4 PartShared16(const void* local, int part) {
  uint4 v = make_uint4(0, 0, 0, 0);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t address = uint32_t(__cvta_generic_to_shared(local));
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(address), "r"(part));
  asm volatile("ld.shared::cluster.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(remote) : "memory");
#endif
  return v;
}

}  // namespace aotinfer
