// Top-p alone without a threshold: tokens drawn from the whole row by its chunks' cumulative mass,
// each verified against top_p in a pass of sums (DrawTopP); the same chunk draw serves the
// unfiltered sampler (DrawByChunks). The scheme: sampling.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "aotinfer/rows.cuh"
#include "aotinfer/sampling/keys.cuh"
#include "aotinfer/sampling/philox.cuh"
#include "aotinfer/sampling/reductions.cuh"
#include "aotinfer/vec.cuh"

namespace aotinfer {

// Top-p keeps an element exactly where the row's mass above its value is below top_p of the row's
// (the threshold's definition, read from the element's side). So a token drawn from the whole row
// and found kept is a draw of the kept set: the rejection method, each draw kept with probability at
// least top_p. One pass draws kTopPDraws tokens by the inverse of the row's cumulative mass over
// fixed chunks (sums only: no histogram and no random numbers an element), a second sums the mass
// above each drawn value, and the first draw found kept is the token. Where none is (probability at
// most (1 - top_p)^4), the histogram path draws with random numbers of its own, so the
// distribution stays exact. The chunks, their masses and the order they are summed in do not depend
// on how a row is split, so every block of a row draws the same tokens, as an unsplit row does. The
// verifying sums are doubles added in the split's order: a split could change a decision only where
// a drawn value's upper mass lies within rounding (~1e-16 of the row's mass) of the bound.
constexpr float kTopPDrawMin = 0.25f;  // below it all four draws miss too often (> 0.32): histograms
constexpr int kDrawChunk = 32 * 4;     // elements a chunk: a warp's 16-byte loads
constexpr int64_t kMaxDrawChunks = kCandidates;  // chunk masses held in the candidates' keys
constexpr int64_t kTopPDrawGroup = kDrawGroup - 2;  // the Philox groups of the draws' uniforms (two a group)
static_assert(kTopPDraws == 4, "two groups of four words give the four draws");

// A probability's share of the row's mass: positive finite values only (ProbKey's).
__device__ __forceinline__ float MassPart(float x) { return ProbKey(x) != 0u ? x : 0.f; }

// Group g of four elements, zeros past the row's end (rows 16-byte aligned).
__device__ __forceinline__ Vec<float, 4> LoadGroupOf4(const float* row, int64_t n, int64_t g) {
  Vec<float, 4> v;
  if (g * 4 + 4 <= n) {
    v.load(row + g * 4);
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = g * 4 + e < n ? row[g * 4 + e] : 0.f;
  }
  return v;
}
__device__ __forceinline__ float GroupMass(const Vec<float, 4>& v) {
  return (MassPart(v[0]) + MassPart(v[1])) + (MassPart(v[2]) + MassPart(v[3]));
}
// The mass of a chunk (lane l holds its group l), summed in a fixed order: in lane 0.
__device__ __forceinline__ float ChunkMass(const Vec<float, 4>& v) {
  float m = GroupMass(v);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m += __shfl_down_sync(0xffffffffu, m, o);
  return m;
}

// Sums of each of N doubles over the row, in a fixed order (the same on every run), in every thread.
template <int N>
__device__ __forceinline__ void RowSumDoubles(double (&v)[N], SamplingShared& sh) {
  static_assert(N <= kTopPDraws + 1, "one row of verify_warp a value");
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v[i] += __shfl_down_sync(0xffffffffu, v[i], o);
    if (lane == 0) sh.verify_warp[i][warp] = v[i];
  }
  __syncthreads();
  if (threadIdx.x < N) {
    double block = 0;
    for (int w = 0; w < kSamplingWarps; ++w) block += sh.verify_warp[threadIdx.x][w];
    sh.verify_part[threadIdx.x] = block;
  }
  SyncRow();
#pragma unroll
  for (int i = 0; i < N; ++i) {
    v[i] = 0;
    for (int r = 0; r < RowParts(); ++r) v[i] += *PartShared(&sh.verify_part[i], r);
  }
  SyncRow();  // every block has read the others' sums
}

// kDraws tokens drawn from the whole row by the inverse of its cumulative mass over fixed chunks
// (steps 1-3 of the scheme above): their elements in sh.draw_index, their keys in sh.draw_key, in
// every block of the row. False where the row has more than kMaxDrawChunks chunks (before any
// barrier), or no finite positive mass. Rows 16-byte aligned. Every thread of the row's blocks
// calls it.
template <int kDraws>
__device__ __forceinline__ bool DrawByChunks(const float* row, int64_t n, const RowRandom& rng, SamplingShared& sh) {
  static_assert(kDraws >= 1 && kDraws <= kTopPDraws, "the draws' slots in SamplingShared");
  const int64_t chunks = (n + kDrawChunk - 1) / kDrawChunk;
  if (chunks > kMaxDrawChunks) return false;
  const int parts = RowParts(), part = RowPart();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float* chunk_mass = reinterpret_cast<float*>(sh.cand_key);

  // 1. The chunks' masses, each chunk a warp's load; this block's share of the chunks.
  const int64_t own_begin = chunks * part / parts, own_end = chunks * (part + 1) / parts;
  const int64_t own_full_end = min(own_end, n / kDrawChunk);  // chunks wholly inside the row
  constexpr int kStep = kSamplingWarps * kRowUnroll;
  int64_t c = own_begin + warp;
  for (; c + (kRowUnroll - 1) * kSamplingWarps < own_full_end; c += kStep) {
    Vec<float, 4> v[kRowUnroll];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) v[u].load(row + ((c + u * kSamplingWarps) * 32 + lane) * 4);
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      const float m = ChunkMass(v[u]);
      if (lane == 0) chunk_mass[c + u * kSamplingWarps] = m;
    }
  }
  for (; c < own_end; c += kSamplingWarps) {
    const float m = ChunkMass(LoadGroupOf4(row, n, c * 32 + lane));
    if (lane == 0) chunk_mass[c] = m;
  }
  SyncRow();  // every block's chunks are in its shared memory, read by every block below

  // 2. The draws' chunks: thread t scans `per` consecutive chunks (in the shared memory of the
  // block that summed them); a draw lands in the last chunk with mass that starts at or below its
  // target (a uniform times the row's mass).
  auto mass_of_chunk = [&](int64_t c) {
    if (c >= chunks) return 0.f;
    int owner = 0;
    while (c >= chunks * (owner + 1) / parts) ++owner;
    return *PartShared(chunk_mass + c, owner);
  };
  const int per = int((chunks + kRowThreads - 1) / kRowThreads);
  const int64_t first = int64_t(threadIdx.x) * per;
  double own = 0;
  for (int i = 0; i < per; ++i) own += mass_of_chunk(first + i);
  const double below = BlockExclusiveSum(own, sh);
  if (threadIdx.x == kRowThreads - 1) sh.draw_row_mass = below + own;
  if (threadIdx.x < kDraws) sh.draw_chunk[threadIdx.x] = -1;
  __syncthreads();
  const double mass = sh.draw_row_mass;
  if (!(mass > 0.0 && mass <= DBL_MAX)) {  // nothing to draw, or a chunk's float sum overflowed
    SyncRow();  // every block has read the others' chunks before the histogram path reuses the memory
    return false;
  }
  const uint4 r01 = rng.group(kTopPDrawGroup), r23 = rng.group(kTopPDrawGroup + 1);  // the first kDraws used
  const double target[kTopPDraws] = {Uniform53(r01.x, r01.y) * mass, Uniform53(r01.z, r01.w) * mass,
                                     Uniform53(r23.x, r23.y) * mass, Uniform53(r23.z, r23.w) * mass};
  int hit[kDraws];
  double start[kDraws];
#pragma unroll
  for (int j = 0; j < kDraws; ++j) hit[j] = -1;
  double running = below;
  for (int i = 0; i < per; ++i) {
    const float m = mass_of_chunk(first + i);
#pragma unroll
    for (int j = 0; j < kDraws; ++j) {
      if (m > 0.f && running <= target[j]) {
        hit[j] = int(first + i);
        start[j] = running;
      }
    }
    running += m;
  }
#pragma unroll
  for (int j = 0; j < kDraws; ++j) {
    int last = hit[j];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
    if (lane == 0 && last >= 0) atomicMax(&sh.draw_chunk[j], last);
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kDraws; ++j) {
    if (hit[j] >= 0 && hit[j] == sh.draw_chunk[j]) sh.draw_left[j] = target[j] - start[j];
  }
  __syncthreads();

  // 3. Each draw's element: warp j walks draw j's chunk (its first group with mass starts at 0, so
  // some group starts at or below what is left; likewise its first element with mass).
  if (warp < kDraws) {
    const int64_t chunk = sh.draw_chunk[warp];
    const Vec<float, 4> v = LoadGroupOf4(row, n, chunk * 32 + lane);
    const float m = GroupMass(v);
    float inclusive = m;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float other = __shfl_up_sync(0xffffffffu, inclusive, o);
      if (lane >= o) inclusive += other;
    }
    const float preceding = __shfl_up_sync(0xffffffffu, inclusive, 1);
    const float exclusive = lane == 0 ? 0.f : preceding;
    const double left = sh.draw_left[warp];
    const unsigned starts = __ballot_sync(0xffffffffu, m > 0.f && double(exclusive) <= left);
    if (lane == 31 - __clz(starts)) {
      const double left_in_group = left - double(exclusive);
      float walked = 0.f, value = 0.f;
      int at = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = MassPart(v[e]);
        if (x > 0.f && double(walked) <= left_in_group) {
          at = e;
          value = x;
        }
        walked += x;
      }
      sh.draw_index[warp] = int((chunk * 32 + lane) * 4 + at);
      sh.draw_key[warp] = ProbKey(value);
    }
  }
  __syncthreads();
  return true;
}

// Top-p alone (top_p in [kTopPDrawMin, 1)), as above: true with this block's part of the draw
// (part 0 holds the token) where a draw is kept, false where the histogram path must draw. Rows
// 16-byte aligned, of at most kMaxDrawChunks chunks. Every thread of the row's blocks calls it.
__device__ bool DrawTopP(const float* row, int64_t n, float top_p, const RowRandom& rng, SamplingShared& sh,
                         Best& drawn) {
  if (!DrawByChunks<kTopPDraws>(row, n, rng, sh)) return false;

  // 4. The mass above each drawn value, and the row's, in a second pass.
  uint32_t drawn_key[kTopPDraws];
#pragma unroll
  for (int j = 0; j < kTopPDraws; ++j) drawn_key[j] = sh.draw_key[j];
  // The row's last read (evict-first, as the samplers' one-pass reads, which measured faster at
  // large batches and vocabularies; docs/design/sampling.md#top-p-draw).
  double sums[kTopPDraws + 1] = {};  // the row's mass, then the mass above each draw
  ForEachGroup<float, 4, true>(row, n, [&](const float* x, int count, int64_t) {
    for (int e = 0; e < count; ++e) {
      const uint32_t key = ProbKey(x[e]);
      if (key != 0u) {  // a branch: written as selects, ptxas no longer keeps a thread's four loads together
        const double value = x[e];
        sums[0] += value;
#pragma unroll
        for (int j = 0; j < kTopPDraws; ++j) {
          if (key > drawn_key[j]) sums[1 + j] += value;
        }
      }
    }
  });
  RowSumDoubles(sums, sh);
  const double kept_below = double(top_p) * sums[0];
  for (int j = 0; j < kTopPDraws; ++j) {
    if (sums[1 + j] < kept_below) {
      drawn = RowPart() == 0 ? Best{INFINITY, sh.draw_index[j]} : Best{-INFINITY, INT32_MAX};
      return true;
    }
  }
  return false;
}

}  // namespace aotinfer
