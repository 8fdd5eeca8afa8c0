// Top-k's candidates without a histogram of the row: a sample of the row puts a floor under the
// k-th largest, and one pass gathers every element from it up (rows of kSampledFloorMinVocab and
// more; the caller falls back to the threshold search where the gather misses). The scheme:
// sampling.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "aotinfer/rows.cuh"
#include "aotinfer/sampling/reductions.cuh"
#include "aotinfer/sampling/threshold_search.cuh"
#include "aotinfer/vec.cuh"

namespace aotinfer {

// Top-k's candidates from a sample. The elements of a row at or above the sample's r-th largest
// hold the k-th largest where fewer than r sampled elements lie above it, which r = lambda +
// 4 sqrt(lambda) + 6 (lambda = k times the sampled fraction, the expected number) makes all but
// certain (a Poisson tail < 1e-6); they number about r / (the sampled fraction), which must fit
// kCandidates. So one pass gathers them, with no histogram of the row; where the gather misses (too
// few, or too many to hold), the caller takes its histogram path instead, so the result never
// depends on the sample, only the time.
constexpr int kFloorSample = kRowThreads;  // elements sampled, one a thread (SamplePosition)
constexpr int kMaxFloorRank = 32;               // ranks the merge below takes
// Shorter rows keep the histogram path. The samplers take the floor from 16384 (at vocab 32000
// and 50000 it gained at large batches and cost nothing measurable at small ones), the top-k renorm
// from 40960 and the mask from 65536 (at vocab 32000 it cost both): docs/design/sampling.md#threshold-search.
constexpr int64_t kSampledFloorMinVocab = 16 * kFloorSample;
constexpr int64_t kRenormFloorMinVocab = 40 * kFloorSample;
constexpr int64_t kMaskFloorMinVocab = 64 * kFloorSample;

// The sample's rank r for top-k of a row of n, or 0 where the sampled floor does not apply (rows
// shorter than min_vocab among them).
__device__ __forceinline__ int SampledFloorRank(int k, int64_t n, int64_t min_vocab) {
  if (n < min_vocab) return 0;
  const float lambda = float(k) * kFloorSample / float(n);
  const float rank = ceilf(lambda + 4.f * sqrtf(lambda) + 6.f);
  const bool fits = (rank + 4.f * sqrtf(rank)) * float(n) <= float(kCandidates) * kFloorSample;
  return rank <= kMaxFloorRank && fits ? int(rank) : 0;
}

// This thread's position in the sample: runs of kSampleRun adjacent elements (32 bytes of float32,
// one DRAM sector), spread evenly over the row, so that a row's sample reads kFloorSample /
// kSampleRun sectors, not kFloorSample. Rows too short for that many runs are sampled an element
// at a time.
constexpr int kSampleRun = 8;
__device__ __forceinline__ int64_t SamplePosition(int64_t n) {
  const int64_t spacing = n / (kFloorSample / kSampleRun) / kSampleRun * kSampleRun;
  if (spacing == 0) return int64_t(threadIdx.x) * n / kFloorSample;
  return int64_t(threadIdx.x / kSampleRun) * spacing + threadIdx.x % kSampleRun;
}

// This thread's element of the sample (0 where the row is shorter than min_vocab: no floor). Kernels
// load it first, before the filter's parameters: the floor then waits for one round trip, not two.
template <typename T>
__device__ __forceinline__ float SampledValue(const T* row, int64_t n, int64_t min_vocab) {
  return n >= min_vocab ? to_float(row[SamplePosition(n)]) : 0.f;
}

// The r-th largest key of the sample (at least 1: key 0 is never kept), in every thread, from each
// thread's SampledValue: each warp sorts its 32 keys (a bitonic sort over the lanes), then one
// warp merges the 32 sorted lists r steps deep.
template <typename KeyOf>
__device__ uint32_t SampledFloor(float sampled, int rank, KeyOf key_of, SamplingShared& sh) {
  const int lane = int(threadIdx.x % 32), warp = int(threadIdx.x / 32);
  uint32_t key = key_of(sampled);
#pragma unroll
  for (int size = 2; size <= 32; size <<= 1) {
#pragma unroll
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      const uint32_t other = __shfl_xor_sync(0xffffffffu, key, stride);
      const bool descending = (lane & size) == 0, lower = (lane & stride) == 0;
      key = lower == descending ? max(key, other) : min(key, other);
    }
  }
  uint32_t* const lists = sh.count;  // [warp][32], largest first (the histogram is not in use)
  lists[warp * 32 + lane] = key;
  __syncthreads();
  if (warp == 0) {
    int head = 0;
    uint32_t top = 0u;
    for (int step = 0; step < rank; ++step) {
      const uint32_t mine = head < 32 ? lists[lane * 32 + head] : 0u;
      top = __reduce_max_sync(0xffffffffu, mine);
      if (lane == __ffs(__ballot_sync(0xffffffffu, mine == top)) - 1) ++head;
    }
    if (lane == 0) sh.found = int(max(top, 1u));
  }
  __syncthreads();
  const uint32_t floor = uint32_t(sh.found);
  __syncthreads();
  return floor;
}

// One pass gathering the row's elements with keys >= floor as candidates, `also(x, count, first)`
// run on each group as well. Where the row holds from k to kCandidates of them, they are shared
// among the row's blocks and it returns true; else false (the candidates then mean nothing). The
// pass is GatherCandidates' with one test a key instead of three: sharing its code slowed the floor's
// kernels and moved the others' SASS (docs/design/sampling.md#threshold-search). kEvictFirst: ForEachGroup's, for the
// samplers, whose last read of the row this is.
template <typename T, int kVec, bool kEvictFirst, typename KeyOf, typename Also>
__device__ bool GatherAtOrAbove(const T* row, int64_t n, SamplingShared& sh, KeyOf key_of, uint32_t floor, int k,
                                Also&& also) {
  if (threadIdx.x == 0) {
    sh.num_candidates = 0;
    sh.sorted_count = -1;
  }
  __syncthreads();
  ForEachGroup<T, kVec, kEvictFirst>(row, n, [&](const float* x, int count, int64_t first) {
    for (int e = 0; e < count; ++e) {
      const uint32_t key = key_of(x[e]);
      if (key >= floor) AddCandidate(sh, key, int(first + e));
    }
    also(x, count, first);
  });
  __syncthreads();
  const float gathered = RowSum(threadIdx.x == 0 ? float(sh.num_candidates) : 0.f, sh);  // exact below 2^24
  if (gathered < float(k) || gathered > float(kCandidates)) return false;
  ShareCandidates(sh);
  return true;
}

// Narrows candidates gathered from a sampled floor (every element of the row at or above floor,
// at least k of them, held by every block of the row) to those from the k-th largest's level-0 bin
// up, the set the histogram path gathers: far fewer to sort. `top_end` ends the largest
// candidate's bin. Returns that bin's first key (at least floor); above kSamplingBins candidates,
// which the histogram's arrays it compacts through cannot hold, keeps them all and returns floor.
__device__ uint32_t NarrowToKthBin(SamplingShared& sh, int k, uint32_t floor, uint32_t top_end) {
  const int n = sh.num_candidates;
  if (n > kSamplingBins) return floor;
  const uint32_t base = floor >> 20;
  const int bins = int((top_end >> 20) - base) + 1;
  ClearBins(sh, bins);
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += kRowThreads) AddToBins(sh, sh.cand_key[i], floor, top_end, 20, false);
  ScanBinsFromTop(sh, bins, base, 20, false, false);
  const int b = CrossingBin(sh, bins, Need::kCount, double(k));
  if (b < 0) return floor;
  const uint32_t lo = max(floor, (base + uint32_t(b)) << 20);
  if (threadIdx.x == 0) sh.found = 0;
  __syncthreads();
  const int lane = int(threadIdx.x % 32);
  for (int first = 0; first < n; first += kRowThreads) {  // warp-uniform trips
    const int i = first + int(threadIdx.x);
    const uint32_t key = i < n ? sh.cand_key[i] : 0u;
    const unsigned keep = __ballot_sync(0xffffffffu, i < n && key >= lo);
    int slot = 0;
    if (lane == 0 && keep) slot = atomicAdd(&sh.found, __popc(keep));
    slot = __shfl_sync(0xffffffffu, slot, 0) + __popc(keep & ((1u << lane) - 1u));
    if (keep >> lane & 1u) {
      sh.mass_hi[slot] = key;
      sh.mass_lo[slot] = uint32_t(sh.cand_index[i]);
    }
  }
  __syncthreads();
  const int kept = sh.found;
  for (int i = threadIdx.x; i < kept; i += kRowThreads) {
    sh.cand_key[i] = sh.mass_hi[i];
    sh.cand_index[i] = int(sh.mass_lo[i]);
  }
  if (threadIdx.x == 0) {
    sh.num_candidates = kept;
    sh.sorted_count = -1;
  }
  __syncthreads();
  return lo;
}

// The largest candidate key's level-0 bin, its last key: where CandidateMassFrom's fixed point
// starts (every block holding every candidate).
__device__ __forceinline__ uint32_t CandidateTopBinEnd(SamplingShared& sh) {
  uint32_t top = 0u;
  for (int i = threadIdx.x; i < sh.num_candidates; i += kRowThreads) top = max(top, sh.cand_key[i]);
  return BlockReduce(top, reinterpret_cast<uint32_t*>(sh.scratch_i), [](uint32_t a, uint32_t b) { return max(a, b); }) |
         0xFFFFFu;
}

}  // namespace aotinfer
