// Top-k first from logits: the gathered top-k logits turned into probabilities relative to their
// largest, in place, or the whole row turned where the sampled floor does not apply. The scheme:
// sampling.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "aotinfer/rows.cuh"
#include "aotinfer/sampling/keys.cuh"
#include "aotinfer/sampling/reductions.cuh"
#include "aotinfer/vec.cuh"

namespace aotinfer {

// Top-k first needs only the top-k logits: their softmax among themselves is the top-k set's
// renormalized distribution, whatever the row's normalizer. So the floor's kernel gathers by
// LogitKey straight from the logits, and the gathered candidates (every block of the row holding
// all of them) become probabilities relative to the largest, keys ProbKey(exp(x - largest)), in
// place: exp keeps their order, and the search and race then run as on probabilities. Returns the
// floor's key turned the same way (every candidate's new key is at least it).
__device__ uint32_t CandidatesToProbabilities(SamplingShared& sh, uint32_t floor) {
  uint32_t top = 0u;
  for (int i = threadIdx.x; i < sh.num_candidates; i += kRowThreads) top = max(top, sh.cand_key[i]);
  top = BlockReduce(top, reinterpret_cast<uint32_t*>(sh.scratch_i), [](uint32_t a, uint32_t b) { return max(a, b); });
  const float largest = LogitFromKey(top);
  for (int i = threadIdx.x; i < sh.num_candidates; i += kRowThreads) {
    sh.cand_key[i] = ProbKey(expf(LogitFromKey(sh.cand_key[i]) - largest));
  }
  if (threadIdx.x == 0) sh.sorted_count = -1;
  __syncthreads();
  return ProbKey(expf(LogitFromKey(floor) - largest));
}

// Where the floor does not apply (it misses, or top-k does not decide the row): the row's
// probabilities relative to its largest logit, exp(x - largest), written to `out` (this block's
// slice) for the probabilities' path to read, every block's writes visible to the row's blocks on
// return. Samplers take unnormalized rows, so no sum is needed. False where the row holds a NaN:
// its softmax would be NaN throughout, and nothing is drawn (as from the probabilities of the
// softmax kernel).
template <int kVec>
__device__ bool LogitsToProbabilities(const float* logits, float* out, int64_t n, SamplingShared& sh) {
  float m = -INFINITY, nan = 0.f;
  ForEachGroup<float, kVec>(logits, n, [&](const float* x, int count, int64_t) {
    for (int e = 0; e < count; ++e) {
      m = fmaxf(m, x[e]);
      if (x[e] != x[e]) nan = 1.f;
    }
  });
  const float largest = RowMax(m, sh);
  if (RowMax(nan, sh) > 0.f) return false;
  ForEachGroup<float, kVec>(logits, n, [&](const float* x, int count, int64_t first) {
    if (count == kVec) {
      Vec<float, kVec>::from_floats([&](int e) { return expf(x[e] - largest); }).store(out + first);
    } else {
      for (int e = 0; e < count; ++e) out[first + e] = expf(x[e] - largest);
    }
  });
  __threadfence();
  SyncRow();
  return true;
}

}  // namespace aotinfer
