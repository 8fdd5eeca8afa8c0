// What a sampling launch is given (SamplingParams: the rows, the filter and its per-row
// parameters, the random stream), and the prefetch of the next row an SM will likely take.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "aotinfer/rows.cuh"

namespace aotinfer {

enum class Filter : int { kNone = 0, kTopK = 1, kTopP = 2, kMinP = 3, kTopKFirst = 4, kJoint = 5 };

struct SamplingParams {
  const float* probs;  // or logits (from_logits)
  int64_t row_stride;
  int64_t vocab;
  int64_t batch;        // output rows
  int64_t num_dist_rows;  // rows of probs
  const void* indices;  // null, int32 or int64 [batch]: the distribution row of each output row
  bool indices_int64;
  void* out;            // int32 or int64 [batch]
  bool out_int64;
  bool* valid;          // null, or [batch]: whether a token was drawn
  Filter filter;
  bool from_logits;     // Gumbel-max over logits, no filter
  RowParam<int> top_k;
  RowParam<float> top_p;
  RowParam<float> min_p;
  const int64_t* seed_values;  // null: seed for every row; else [1] or [batch] (seed_stride 0 or 1)
  const int64_t* offset_values;
  int seed_stride, offset_stride;
  int64_t seed, offset;
  bool gather_min_p;  // min-p gathers its kept set in its first pass (rows too many for the L2)
  float* scratch;      // from logits with a filter: [rows of logits, >= vocab], for the rows the floor misses
  int64_t scratch_stride;
  int ahead;           // blocks that run at once (one an SM): an unsplit row's SM likely takes row + ahead next
};

__device__ __forceinline__ int64_t DistributionRow(const SamplingParams& p, int64_t row) {
  if (!p.indices) return row;
  return p.indices_int64 ? static_cast<const int64_t*>(p.indices)[row] : static_cast<const int32_t*>(p.indices)[row];
}


// The first kNextRowPrefetch bytes of the row this SM will likely take next (blocks start in order,
// one an SM), asked of the L2 by the top-k samplers once their one pass over their own row ends:
// the search and race that follow leave the SM's share of DRAM idle, and the next block's sample
// and pass then start in L2: the top-k samplers ran faster at large batches, on flat rows and
// peaked ones, and 128 KB gained less. The renorm and the mask, whose pass also writes the row, ran
// slower with it (docs/design/sampling.md#threshold-search).
constexpr int kNextRowPrefetch = 256 * 1024;
__device__ __forceinline__ void PrefetchNextRow(const float* next, int64_t n) {
  constexpr int kChunk = 16384;  // bytes a thread asks for
  const int64_t size = min(n * int64_t(sizeof(float)), int64_t(kNextRowPrefetch)) & ~int64_t(15);
  const int64_t at = int64_t(threadIdx.x) * kChunk;
  if (at >= size || (reinterpret_cast<uintptr_t>(next) & 15)) return;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const int chunk = int(min(int64_t(kChunk), size - at));
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(reinterpret_cast<const char*>(next) + at), "r"(chunk)
               : "memory");
#endif
}

}  // namespace aotinfer
