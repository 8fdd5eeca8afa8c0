// Drawing a token from a kept set: the exponential race (token i wins with key p_i / E_i, E_i ~
// Exp(1); for logits x_i - log(E_i)), over the row in its passes or over gathered candidates;
// top-k's race among its candidates; rejection draws; min-p's draw. The scheme: sampling.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "aotinfer/rows.cuh"
#include "aotinfer/sampling/keys.cuh"
#include "aotinfer/sampling/philox.cuh"
#include "aotinfer/sampling/reductions.cuh"
#include "aotinfer/sampling/sampled_floor.cuh"
#include "aotinfer/sampling/threshold_search.cuh"

namespace aotinfer {

// A race bin is dense where it holds at least 1/kDenseBin of the row: top-p alone then draws its
// element by rejection (DrawByRejection) rather than by a race over the bin in the row's pass.
constexpr int kDenseBin = 64;
constexpr int kDenseRounds = 16;  // rounds of rejection before the race over the bin instead
constexpr int kMinPRounds = 4;    // min-p's rounds of rejection before its race instead
constexpr float kMinPAccepts = 2.f;  // accepted proposals a round (estimated) for min-p to try rejection

// One element of the row with key in [lo, hi], with probability proportional to its value, by
// rejection from uniform positions: in a round, every thread proposes a position of the row and
// accepts it with probability value / top (top: at least every such value) where such an element
// lies there; the first accepting thread wins, a draw of the accepted distribution. False where
// `rounds` rounds accept nothing (a round accepts with probability 1 - (1 - a)^1024, a = the mass
// in [lo, hi] / (n * top)). The random words come from groups after kDrawGroup's, so the draw is
// the same on every run and in every block that makes it. Every thread of the block calls it.
__device__ bool DrawByRejection(const float* row, int64_t n, uint32_t lo, uint32_t hi, float top, const RowRandom& rng,
                                SamplingShared& sh, int rounds, Best& drawn) {
  for (int round = 0; round < rounds; ++round) {
    const uint4 r = rng.group(kDrawGroup + 1 + int64_t(round) * kRowThreads + threadIdx.x);
    const int64_t at = min(int64_t(Uniform53(r.x, r.y) * double(n)), n - 1);
    const float x = row[at];
    const uint32_t key = ProbKey(x);
    const bool accepted = key >= lo && key <= hi && Uniform53(r.z, r.w) * double(top) < double(x);
    const int first = BlockMinInt(accepted ? int(threadIdx.x) : INT32_MAX, sh);
    if (first != INT32_MAX) {
      if (int(threadIdx.x) == first) sh.found = int(at);
      __syncthreads();
      drawn = Best{INFINITY, sh.found};
      __syncthreads();
      return true;
    }
  }
  return false;
}

// The race over the row's elements with keys in [lo, hi], by one block over the whole row.
__device__ Best RaceOverRow(const float* row, int64_t n, uint32_t lo, uint32_t hi, const RowRandom& rng,
                            SamplingShared& sh) {
  Best best{-INFINITY, INT32_MAX};
  for (int64_t i = threadIdx.x; i < n; i += kRowThreads) {
    const uint32_t key = ProbKey(row[i]);
    if (key >= lo && key <= hi) best = Better(best, Best{__fdividef(row[i], Exponential(rng.word(i))), int(i)});
  }
  return BlockBest(best, sh);
}

// The race over one group of elements: those with keys in [lo_key, hi_key] take part (key 0: never).
template <bool kLogits>
__device__ __forceinline__ void Race(const float* x, int count, int64_t first, const RowRandom& rng, uint32_t lo_key,
                                     uint32_t hi_key, Best& best) {
  auto kept = [&](float v) {
    const uint32_t key = kLogits ? LogitKey(v) : ProbKey(v);
    return key >= lo_key && key <= hi_key && key != 0u;
  };
  auto race_key = [&](float v, uint32_t bits) {
    const float e = Exponential(bits);
    return kLogits ? v - __logf(e) : __fdividef(v, e);
  };
  bool any = false;
  for (int e = 0; e < count; ++e) any |= kept(x[e]);
  if (!any) return;  // no random numbers for groups the filter drops
  if (count == 4 && (first & 3) == 0) {
    const uint4 r = rng.group(first >> 2);
    const uint32_t words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (kept(x[e])) best = Better(best, Best{race_key(x[e], words[e]), int(first + e)});
    }
  } else {
    for (int e = 0; e < count; ++e) {
      if (kept(x[e])) best = Better(best, Best{race_key(x[e], rng.word(first + e)), int(first + e)});
    }
  }
}

// The race among the gathered candidates at or above key t (this thread's share of them): the same
// keys and random words as Race gives those elements in a pass, so the same winner.
__device__ __forceinline__ Best RaceOverCandidates(const SamplingShared& sh, uint32_t t, const RowRandom& rng,
                                                   Best best) {
  for (int i = threadIdx.x; i < min(sh.num_candidates, kCandidates); i += kRowThreads) {
    const uint32_t key = sh.cand_key[i];
    if (key >= t) {
      const int index = sh.cand_index[i];
      best = Better(best, Best{__fdividef(__uint_as_float(key), Exponential(rng.word(index))), index});
    }
  }
  return best;
}

// CandidateMassFrom's fixed point, for one warp: a probability's mass below the exponent `top`
// (of the largest key summed), and a sum of them back to a double. CandidateMassFrom keeps its own
// copy of these lines: called from there they changed the SASS of every sampling kernel, and so
// only the sampled floor's kernel changes with the warp's path.
__device__ __forceinline__ unsigned long long FixedPointMass(uint32_t key, int top) {
  const int exponent = max(int((key >> 23) & 0xFF), 1);
  const int shift = exponent - max(top, 1) + 27;  // the largest mantissa becomes < 2^51
  return shift >= 0 ? (unsigned long long)MantissaOf(key) << shift : MantissaOf(key) >> min(-shift, 31);
}
__device__ __forceinline__ double FixedPointToMass(unsigned long long total, int top) {
  const int scale = max(top, 1) - 150 - 27;
  return double(total) * __longlong_as_double(int64_t(scale + 1023) << 52);
}

// TopKRace (below) where the candidates are few (at most kWarpCandidates, two a lane): one warp
// sorts them (key descending, index ascending: a bitonic sort over its lanes), takes the k-th key,
// top-p's threshold from the prefix masses in that order, and runs the race, with no barrier of
// the block and no merge of the row's blocks, in about half the time of the block's search and
// merge. Its loops stay rolled: a warp runs it once a row, each phase a few dozen instructions, and
// unrolled it ran no faster (docs/design/sampling.md#threshold-search). Call from a whole warp;
// every lane returns the winner.
constexpr int kWarpCandidates = 64;

__device__ __noinline__ Best TopKRaceInWarp(const SamplingShared& sh, int k, float top_p, bool joint, double row_mass,
                                            uint32_t range_hi, const RowRandom& rng) {
  const int lane = int(threadIdx.x % 32), n = sh.num_candidates;
  // Position e = 2 lane + j of the 64, padded with key 0 (never kept) past n.
  uint32_t key[2];
  int index[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int e = 2 * lane + j;
    key[j] = e < n ? sh.cand_key[e] : 0u;
    index[j] = e < n ? sh.cand_index[e] : INT32_MAX;
  }
  auto precedes = [](uint32_t ka, int ia, uint32_t kb, int ib) { return ka > kb || (ka == kb && ia < ib); };
#pragma unroll 1
  for (int size = 2; size <= 2 * 32; size <<= 1) {
#pragma unroll 1
    for (int stride = size / 2; stride > 1; stride >>= 1) {  // across lanes: position e ^ stride is lane ^ stride / 2's
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int e = 2 * lane + j;
        const uint32_t other_key = __shfl_xor_sync(0xffffffffu, key[j], stride / 2);
        const int other_index = __shfl_xor_sync(0xffffffffu, index[j], stride / 2);
        const bool lower = (e & stride) == 0, up = (e & size) == 0;
        // The lower position of a run sorted in the order keeps the element that precedes.
        if (precedes(other_key, other_index, key[j], index[j]) == (lower == up)) key[j] = other_key, index[j] = other_index;
      }
    }
    const bool up = ((2 * lane) & size) == 0;  // stride 1: the lane's own pair
    if (precedes(key[1], index[1], key[0], index[0]) == up) {
      const uint32_t kt = key[0];
      const int it = index[0];
      key[0] = key[1], index[0] = index[1], key[1] = kt, index[1] = it;
    }
  }
  // The k-th largest (the candidates hold every element from it up; 0 keeps them all).
  const uint32_t kth = __shfl_sync(0xffffffffu, (k - 1) % 2 ? key[1] : key[0], ((k - 1) / 2) % 32);
  uint32_t t = max(1u, k <= n ? kth : 0u);
  if (top_p < 1.f) {
    const int top = int((range_hi >> 23) & 0xFF);
    double target = double(top_p) * row_mass;
    if (!joint) {  // top_k_first: top_p of the top-k set's mass
      unsigned long long kept = (key[0] >= t ? FixedPointMass(key[0], top) : 0ull) + (key[1] >= t ? FixedPointMass(key[1], top) : 0ull);
#pragma unroll 1
      for (int o = 16; o > 0; o >>= 1) kept += __shfl_xor_sync(0xffffffffu, kept, o);
      target = double(top_p) * FixedPointToMass(kept, top);
    }
    // Prefix masses in the sorted order: the first position that reaches the target.
    const double v0 = __uint_as_float(key[0]), v1 = __uint_as_float(key[1]);
    double before = v0 + v1;
#pragma unroll 1
    for (int o = 1; o < 32; o <<= 1) {
      const double up = __shfl_up_sync(0xffffffffu, before, o);
      if (lane >= o) before += up;
    }
    before -= v0 + v1;  // the mass of positions before this lane's
    const int first = before + v0 >= target ? 2 * lane : before + v0 + v1 >= target ? 2 * lane + 1 : INT32_MAX;
    const unsigned reached = __ballot_sync(0xffffffffu, first != INT32_MAX);
    if (reached) {
      const int at = __shfl_sync(0xffffffffu, first, __ffs(reached) - 1);
      t = max(t, __shfl_sync(0xffffffffu, at % 2 ? key[1] : key[0], at / 2));
    }
  }
  Best best{-INFINITY, INT32_MAX};
#pragma unroll 1
  for (int j = 0; j < 2; ++j) {
    const uint32_t kj = j ? key[1] : key[0];
    const int ij = j ? index[1] : index[0];
    if (kj >= t) best = Better(best, Best{__fdividef(__uint_as_float(kj), Exponential(rng.word(ij))), ij});
  }
#pragma unroll 1
  for (int o = 16; o > 0; o >>= 1) {
    best = Better(best, Best{__shfl_xor_sync(0xffffffffu, best.key, o), __shfl_xor_sync(0xffffffffu, best.index, o)});
  }
  return best;
}

// Top-k (and top-p: top_p < 1, over the top-k set, or the row's mass `row_mass` where joint) among
// gathered candidates that hold every element from the k-th largest up (keys in [range_lo,
// range_hi]; range_hi ends the top bin where top-p sums masses): the thresholds, then the race.
// Every block holds every candidate. kInWarp and at most kWarpCandidates of them: warp 0 of every
// block draws the token (the same one), `decided`; else part 0 races, the others return no winner.
// (kInWarp only in the kernel of the sampled floor, the top-k filters' at large vocabularies:
// compiled into the others, the call changed their SASS, and min-p and top-p measured slower;
// docs/design/sampling.md#threshold-search.)
template <bool kInWarp>
__device__ __forceinline__ Best TopKRace(SamplingShared& sh, int k, float top_p, bool joint, double row_mass,
                                         uint32_t range_lo, uint32_t range_hi, const RowRandom& rng, bool& decided) {
  if constexpr (kInWarp) {
    if (sh.num_candidates <= kWarpCandidates) {
      decided = true;
      return threadIdx.x < 32 ? TopKRaceInWarp(sh, k, top_p, joint, row_mass, range_hi, rng) : Best{-INFINITY, INT32_MAX};
    }
  }
  const uint32_t t_k = CandidateThreshold(sh, Need::kCount, double(k), 0u, 0.0, range_lo, range_hi, true);
  uint32_t t = max(1u, t_k);
  if (top_p < 1.f) {
    const double target = double(top_p) * (joint ? row_mass : CandidateMassFrom(sh, t_k, range_hi, true));
    t = max(t, CandidateThreshold(sh, Need::kMass, target, 0u, 0.0, range_lo, range_hi, true));
  }
  const Best none{-INFINITY, INT32_MAX};
  return RowPart() == 0 ? RaceOverCandidates(sh, t, rng, none) : none;
}

// Min-p: kept are the values >= t = min_p * (the row's largest), found by a pass over the row.
// A sample of 1024 elements spread over the row (the same in every block of a split row) is read
// beside that pass. Then:
// - where the sample's own acceptance (its kept values over the largest, summed: the expected
//   accepted proposals of a round) reaches kMinPAccepts, the draw is by rejection (proposals
//   accepted with probability value / largest, made alike in every block): no second pass over a
//   large kept set;
// - else, or where kMinPRounds rounds accept nothing, the race over the kept set: over elements
//   gathered in the first pass where `gather` (large batches, where a second pass reads memory
//   rather than L2) and the sample says few lie above its floor (min_p times its largest, at most
//   t) and they fit kCandidates, else in a second pass. Both races are one race, so one token.
// Which draw is made depends only on the row's values and the random stream, never on the split,
// the batch or timing. Returns this block's part of the draw.
template <int kVec>
__device__ Best MinPDraw(const float* row, int64_t n, float min_p, bool gather, const RowRandom& rng,
                         SamplingShared& sh) {
  const float sample = row[SamplePosition(n)];
  uint32_t floor_key = 0xFFFFFFFFu;
  if (gather) {
    floor_key = max(1u, ProbKey(min_p * BlockMax(sample, sh)));
    const int64_t sampled_above = __syncthreads_count(ProbKey(sample) >= floor_key);
    gather = sampled_above * n <= int64_t(kCandidates / 2) * kRowThreads;  // the count it predicts
  }
  if (threadIdx.x == 0) {
    sh.num_candidates = 0;
    sh.sorted_count = -1;
  }
  __syncthreads();
  float m = 0.f;
  if (gather) {
    ForEachGroup<float, kVec>(row, n, [&](const float* x, int count, int64_t first) {
      for (int e = 0; e < count; ++e) {
        m = fmaxf(m, x[e]);
        const uint32_t key = ProbKey(x[e]);
        if (key >= floor_key) AddCandidate(sh, key, int(first + e));
      }
    });
  } else {
    ForEachGroup<float, kVec>(row, n, [&](const float* x, int count, int64_t) {
      for (int e = 0; e < count; ++e) m = fmaxf(m, x[e]);
    });
  }
  __syncthreads();
  const float largest = RowMax(m, sh);
  const float t = min_p * largest;
  const uint32_t t_key = max(1u, ProbKey(t));
  // Keys order like values, so floor <= t gives floor_key <= t_key, but for t infinite (an
  // infinite probability: every finite one kept, as the pass would keep them).
  const bool t_finite = t <= FLT_MAX;
  Best best{-INFINITY, INT32_MAX};
  if (t_finite && largest > 0.f && largest <= FLT_MAX) {
    const float accepts = BlockSum(ProbKey(sample) >= t_key ? sample / largest : 0.f, sh);
    Best drawn;
    if (accepts >= kMinPAccepts && DrawByRejection(row, n, t_key, 0xFFFFFFFFu, largest, rng, sh, kMinPRounds, drawn)) {
      return RowPart() == 0 ? drawn : best;
    }
  }
  if (gather) {
    const float gathered = RowSum(threadIdx.x == 0 ? float(sh.num_candidates) : 0.f, sh);  // exact below 2^24
    if (t_finite && gathered <= float(kCandidates)) return RaceOverCandidates(sh, t_key, rng, best);
  }
  ForEachGroup<float, kVec>(row, n, [&](const float* x, int count, int64_t first) {
    Race<false>(x, count, first, rng, t_key, 0xFFFFFFFFu, best);
  });
  return best;
}

}  // namespace aotinfer
