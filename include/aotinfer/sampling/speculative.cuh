// Chain speculative sampling (Leviathan et al. 2023; Chen et al. 2023), with FlashInfer's
// semantics: a request's draft tokens d_0..d_{n-1}, drawn from the draft model's rows p_i, are
// accepted in order while u_i * p_i(d_i) < q_i(d_i) (q_i: the target model's row, u_i uniform in
// (0, 1), one a draft token); the first rejected position draws from max(0, q_i - p_i), normalized,
// and where all n are accepted the bonus position draws from q_n. So every emitted token follows
// the target model's distribution. Besides the tokens, two counters per request are added to:
// the draft tokens emitted (the accepted prefix), and the draft tokens each of whose test passes
// on its own (every position tested, as FlashInfer counts it: a measure of the two models' match).
//
// One block of kRowThreads threads a request. Every thread walks the draft tokens (n scalar reads
// of each model), then the block races over the drawn position's row: token j wins with key
// max(0, q(j) - p(j)) / E_j (sampling.cuh's exponential race), which draws from the normalized
// difference with no sum over the row. A difference that is zero everywhere (rows that do not sum
// to 1) draws from q. A draft token outside the vocabulary is rejected (its probabilities read as
// 0). The random words: the draft tests' uniforms from group kDrawGroup + i, the race's from the
// groups of its elements, all under (seed, request, offset).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "aotinfer/launch.cuh"
#include "aotinfer/rows.cuh"
#include "aotinfer/sampling/philox.cuh"
#include "aotinfer/sampling/races.cuh"
#include "aotinfer/sampling/reductions.cuh"

namespace aotinfer {

struct ChainSpeculativeParams {
  const float* draft_probs;   // [batch, n, vocab]
  const void* draft_ids;      // [batch, n], int32 or int64
  bool draft_ids_int64;
  const float* target_probs;  // [batch, n + 1, vocab]
  int32_t* out;               // [batch, n + 1]: the accepted draft tokens, the drawn token, then -1
  int32_t* accepted;          // [batch]: += the draft tokens whose test passes, each on its own
  int32_t* emitted;           // [batch]: += the draft tokens emitted
  int n;
  int64_t vocab;
  const int64_t* seed_values;  // null: seed for every request; else [1] or [batch] (seed_stride 0 or 1)
  const int64_t* offset_values;
  int seed_stride, offset_stride;
  int64_t seed, offset;
};

template <int kVec>
__global__ void __launch_bounds__(kRowThreads) ChainSpeculativeKernel(ChainSpeculativeParams p) {
  __shared__ float best_keys[kSamplingWarps];
  __shared__ int best_indices[kSamplingWarps];
  const int64_t row = blockIdx.x;
  WaitForPriorGrids();
  const int64_t seed = p.seed_values ? p.seed_values[row * p.seed_stride] : p.seed;
  const int64_t offset = p.offset_values ? p.offset_values[row * p.offset_stride] : p.offset;
  const RowRandom rng{uint32_t(seed), uint32_t(uint64_t(seed) >> 32), uint32_t(row), uint32_t(offset),
                      uint32_t(uint64_t(offset) >> 32)};
  const int n = p.n;
  const int64_t vocab = p.vocab;
  int32_t* out = p.out + row * (n + 1);

  // 1. The draft tokens' tests, in every thread (n is a handful).
  int drawn_at = n;  // the first rejected position, or n: the bonus position
  int passed = 0;
  for (int i = 0; i < n; ++i) {
    const int64_t id = p.draft_ids_int64 ? static_cast<const int64_t*>(p.draft_ids)[row * n + i]
                                         : static_cast<const int32_t*>(p.draft_ids)[row * n + i];
    const bool in_vocab = id >= 0 && id < vocab;
    const float q = in_vocab ? p.target_probs[(row * (n + 1) + i) * vocab + id] : 0.f;
    const float d = in_vocab ? p.draft_probs[(row * n + i) * vocab + id] : 0.f;
    const uint4 r = rng.group(kDrawGroup + i);
    const bool pass = Uniform53(r.x, r.y) * double(d) < double(q);
    passed += pass;
    if (drawn_at == n) {
      if (!pass) drawn_at = i;
      else if (threadIdx.x == 0) out[i] = int32_t(id);
    }
  }

  // 2. The drawn position's token: the race over max(0, q - p) (q alone at the bonus position).
  const float* q_row = p.target_probs + (row * (n + 1) + drawn_at) * vocab;
  const float* p_row = drawn_at < n ? p.draft_probs + (row * n + drawn_at) * vocab : nullptr;
  Best best{-INFINITY, INT32_MAX};
  ForEachGroup<float, kVec>(q_row, vocab, [&](const float* x, int count, int64_t first) {
    float diff[kVec];
    for (int e = 0; e < count; ++e) diff[e] = p_row ? fmaxf(x[e] - p_row[first + e], 0.f) : x[e];
    Race<false>(diff, count, first, rng, 1u, 0xFFFFFFFFu, best);
  });
  best = BlockBest(best, best_keys, best_indices);
  if (best.index == INT32_MAX && p_row) {  // no positive difference: q itself
    ForEachGroup<float, kVec>(q_row, vocab, [&](const float* x, int count, int64_t first) {
      Race<false>(x, count, first, rng, 1u, 0xFFFFFFFFu, best);
    });
    best = BlockBest(best, best_keys, best_indices);
  }
  if (threadIdx.x == 0) {
    out[drawn_at] = best.index == INT32_MAX ? 0 : best.index;  // a row with no positive value: token 0
    for (int i = drawn_at + 1; i <= n; ++i) out[i] = -1;
    p.accepted[row] += passed;
    p.emitted[row] += drawn_at;
  }
  AllowDependentGrids();
}

inline cudaError_t ChainSpeculativeSample(const ChainSpeculativeParams& p, int64_t batch, cudaStream_t stream, bool pdl) {
  if (batch == 0) return cudaSuccess;
  // Both models' rows read by 16-byte vectors where every row starts 16-byte aligned.
  const bool aligned = p.vocab % 4 == 0 && (reinterpret_cast<uintptr_t>(p.draft_probs) & 15) == 0 &&
                       (reinterpret_cast<uintptr_t>(p.target_probs) & 15) == 0;
  if (aligned) return LaunchSplit(ChainSpeculativeKernel<4>, batch, 1, 0, stream, pdl, p);
  return LaunchSplit(ChainSpeculativeKernel<1>, batch, 1, 0, stream, pdl, p);
}

}  // namespace aotinfer
