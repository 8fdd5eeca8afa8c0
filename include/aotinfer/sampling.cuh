// Sampling from probabilities and logits without sorting the vocabulary: top-k, top-p, min-p and
// their combinations, the top-k / top-p renormalizations and top-k masking of logits, and chain
// speculative sampling (speculative.cuh; softmax is in softmax.cuh; the row kernels' blocks, reads
// and launches in rows.cuh).
//
// One block of kRowThreads threads per output row. Every filter keeps the elements at or above
// one threshold value t (top-k: the k-th largest; top-p: the smallest value whose upper set holds
// top_p of the mass; min-p: min_p * max; their combinations: the larger threshold), so finding t
// is a selection, done as a radix search on the floats' bit patterns, which order like the values:
//
//   1. one pass builds a histogram of the row over the top 12 bits of the key (count and mass per
//      bin; a bin never spans two exponents, so its mass is an exact integer sum of mantissas and
//      the result does not depend on the order of the atomics);
//   2. a scan of the bins from the top gives the bin(s) where the threshold lies;
//   3. a second pass gathers that bin's elements (at most kCandidates) into shared memory, where
//      the same histograms over the lower bits find t exactly, and, in the same pass, runs the
//      sampling race over the elements above the bin, which the filter keeps whatever t is.
//
// A bin with more elements than fit is narrowed by more histogram passes over the next 12 and 8
// bits (a flat distribution at vocab 256k), each one pass more.
//
// On rows of 16 K elements or more (40 K for the top-k renorm, 64 K for the mask), top-k skips
// step 1: a sample of the row puts a floor under the k-th largest, and one pass gathers every
// element above it (SampledFloorRank). Top-p alone (top_p >= 0.25) needs no threshold: it draws
// four tokens from the whole row, a pass of chunk sums, and keeps the first whose upper mass is
// below top_p of the row's, a pass of sums; the histogram path only where all four miss (DrawTopP).
// With no filter, probabilities draw one token the same way and keep it (DrawByChunks).
//
// The sampling filters take shortcuts on that scheme. Top-k that may leave part of the row out
// (alone, top_k_first or joint) gathers every element from the k-th largest's bin up (fewer than k
// lie above that bin), and decides top-k's threshold and top-p's among them: the histogram needs
// counts only (one shared atomic an element rather than three), and the race runs over the kept
// candidates, not in the pass. Top-p alone gathers its threshold's bin, and draws from the bins
// above it without a race over all of them (see the kernel). The top-k renormalization and the
// top-k mask take the same top-k gather, and write the row in the gather's pass (every element not
// gathered is dropped), the kept ones rewritten from shared memory after; the top-p
// renormalization gathers its threshold's bin as top-p alone does.
//
// One SM reads a row at a fraction of the GPU's bandwidth, so where the batch leaves SMs idle
// (sm90+), a row may be split over a thread block cluster of up to 8 blocks: each reads its slice,
// and the blocks merge their histograms and the race's winner through distributed shared memory,
// in integer sums and fixed orders, so the tokens do not depend on the split. A searched row's
// blocks then each copy all the row's candidates and search them alone. The launchers split the
// plain races up to 8 ways and the searched samplers 2 ways (see kSearchRowParts for why).
//
// Sampling is an exponential race: token i wins with key p_i / E_i, E_i ~ Exp(1) independent per
// element, which picks i with probability p_i / sum(p) over the kept set, in one pass, with no
// normalization and no prefix sum; for logits, x_i - log(E_i) (Gumbel-max). E_i comes from
// Philox4x32-10 keyed by the seed, with counter (element / 4, output row, offset): the same seed
// and offset give the same tokens, whatever the launch, and the winner is the same on every run
// (ties go to the lower index). Top-p alone draws its uniforms per row from counters no element
// uses (kDrawGroup and the two groups below it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "aotinfer/launch.cuh"
#include "aotinfer/rows.cuh"

// The parts, in the order they build on each other.
#include "aotinfer/sampling/philox.cuh"
#include "aotinfer/sampling/keys.cuh"
#include "aotinfer/sampling/reductions.cuh"
#include "aotinfer/sampling/threshold_search.cuh"
#include "aotinfer/sampling/sampled_floor.cuh"
#include "aotinfer/sampling/params.cuh"
#include "aotinfer/sampling/races.cuh"
#include "aotinfer/sampling/top_p_draw.cuh"
#include "aotinfer/sampling/top_k_from_logits.cuh"
#include "aotinfer/sampling/sampling_kernel.cuh"
#include "aotinfer/sampling/renorm_and_mask.cuh"
#include "aotinfer/sampling/speculative.cuh"

namespace aotinfer {

// Rows searched by histograms merge the level-0 histogram across the blocks of a split through
// distributed shared memory, and every block then gets all the gathered candidates and searches
// them alone. 2 blocks a row beat one at small and medium batches, and 4 were no better than 2.
// (Merging every candidate level across blocks instead had made the split slower than one block;
// docs/design/sampling.md#threshold-search.)
constexpr int kSearchRowParts = 2;
// The renormalizations and the mask: the same (their shortcuts share candidates as the samplers
// do; their fallback, FindThreshold, merges every level across the blocks, slower but rare).
constexpr int kThresholdRowParts = kSearchRowParts;
// The searched rows' blocks at every batch (1: split only where the batch leaves SMs idle). 2 at
// every batch ran slower at large batches (the fixed costs of a row's search paid twice, and
// twice the blocks).
constexpr int kSearchMinRowParts = 1;

// Rows of logits that sample in one kernel: top-k first where the sampled floor applies (float32
// rows, 16-byte aligned: the binding's part). Other logits take the softmax kernel, then the
// probabilities' sampler (docs/design/sampling.md#top-k-from-logits).
inline bool SamplesLogitsInOneKernel(Filter filter, int64_t vocab) {
  return filter == Filter::kTopKFirst && vocab >= kSampledFloorMinVocab;
}

inline cudaError_t Sample(SamplingParams p, int device, cudaStream_t stream, bool pdl) {
  p.ahead = GetDeviceFacts(device).sms;
  const bool race_only = p.filter == Filter::kNone || p.filter == Filter::kMinP;
  const bool aligned = RowsAligned<float>(p.probs, p.row_stride);
  const int max_parts = race_only ? kMaxRowParts : kSearchRowParts, min_parts = race_only ? 1 : kSearchMinRowParts;
  // Min-p's second pass reads the L2 where the rows fit it: there a gather in the first pass costs
  // more than it saves (docs/design/sampling.md#threshold-search). Top-k's gather above a sampled floor gains at every
  // batch; only the top-k filters take the kernel with it (the others ran slower in it), and rows
  // not 16-byte aligned take the scalar kernel, which has none.
  p.gather_min_p = p.batch * p.vocab * int64_t(sizeof(float)) > int64_t(GetDeviceFacts(device).l2_bytes);
  const bool top_k_filter = p.filter == Filter::kTopK || p.filter == Filter::kTopKFirst || p.filter == Filter::kJoint;
  constexpr auto kScalarKernel = SamplingKernel<1, Shortcut::kNone>;
  constexpr size_t kShared = sizeof(SamplingShared);
  // From logits (SamplesLogitsInOneKernel): its own floor kernel, which holds the path where the
  // floor does not apply.
  if (p.from_logits && top_k_filter) {
    return LaunchRows<SamplingKernel<4, Shortcut::kLogitsFloor>, kScalarKernel>(p, p.batch, aligned, kShared, device,
                                                                                stream, pdl, max_parts, min_parts);
  }
  if (top_k_filter && p.vocab >= kSampledFloorMinVocab) {
    return LaunchRows<SamplingKernel<4, Shortcut::kSampledFloor>, kScalarKernel>(p, p.batch, aligned, kShared, device,
                                                                                 stream, pdl, max_parts, min_parts);
  }
  if (p.filter == Filter::kNone && !p.from_logits) {
    return LaunchRows<SamplingKernel<4, Shortcut::kChunkDraw>, kScalarKernel>(p, p.batch, aligned, kShared, device,
                                                                              stream, pdl, max_parts, min_parts);
  }
  // Top-p alone draws and verifies where its top_p may be large enough (a tensor's may be): two
  // passes of sums, which a row split over more blocks reads faster, as a race does.
  if (p.filter == Filter::kTopP && !p.from_logits && (p.top_p.values || p.top_p.scalar >= kTopPDrawMin)) {
    return LaunchRows<SamplingKernel<4, Shortcut::kTopPDraws>, kScalarKernel>(p, p.batch, aligned, kShared, device,
                                                                              stream, pdl, kMaxRowParts, min_parts);
  }
  return LaunchRows<SamplingKernel<4, Shortcut::kNone>, kScalarKernel>(p, p.batch, aligned, kShared, device, stream, pdl,
                                                                       max_parts, min_parts);
}

// The top-p renormalization's window saves a pass where the rows miss the L2 between passes; where
// they fit it, and at vocabularies under 65536, it cost more than the pass it saves
// (docs/design/sampling.md#renorm-and-masks).
template <typename T>
cudaError_t Renorm(const RenormParams& p, int device, cudaStream_t stream, bool pdl) {
  const bool aligned = RowsAligned<T>(p.input, p.in_stride) && RowsAligned<T>(p.out, p.out_stride);
  if constexpr (std::is_same_v<T, float>) {
    if (p.filter == Filter::kTopP && p.vocab >= kTopPWindowMinVocab &&
        p.rows * p.vocab * int64_t(sizeof(float)) > int64_t(GetDeviceFacts(device).l2_bytes)) {
      return LaunchRows<RenormKernel<float, 4, true>, RenormKernel<float, 1, true>>(
          p, p.rows, aligned, sizeof(SamplingShared), device, stream, pdl, kThresholdRowParts, kSearchMinRowParts);
    }
  }
  return LaunchRows<RenormKernel<T, kVec16<T>>, RenormKernel<T, 1>>(p, p.rows, aligned, sizeof(SamplingShared), device,
                                                                     stream, pdl, kThresholdRowParts, kSearchMinRowParts);
}

template <typename T>
cudaError_t MaskLogits(const RenormParams& p, int device, cudaStream_t stream, bool pdl) {
  const bool aligned = RowsAligned<T>(p.input, p.in_stride) && RowsAligned<T>(p.out, p.out_stride);
  return LaunchRows<MaskLogitsKernel<T, kVec16<T>>, MaskLogitsKernel<T, 1>>(p, p.rows, aligned, sizeof(SamplingShared),
                                                                             device, stream, pdl, kThresholdRowParts,
                                                                             kSearchMinRowParts);
}

}  // namespace aotinfer
