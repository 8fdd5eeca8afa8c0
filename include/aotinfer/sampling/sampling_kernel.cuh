// SamplingKernel: one token an output row, for every filter, from probabilities or logits. The
// scheme: sampling.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "aotinfer/launch.cuh"
#include "aotinfer/rows.cuh"
#include "aotinfer/sampling/keys.cuh"
#include "aotinfer/sampling/params.cuh"
#include "aotinfer/sampling/philox.cuh"
#include "aotinfer/sampling/races.cuh"
#include "aotinfer/sampling/reductions.cuh"
#include "aotinfer/sampling/sampled_floor.cuh"
#include "aotinfer/sampling/threshold_search.cuh"
#include "aotinfer/sampling/top_k_from_logits.cuh"
#include "aotinfer/sampling/top_p_draw.cuh"

namespace aotinfer {

// The shortcuts a sampling kernel is built with: template parameters rather than flags, because
// their code costs the kernel's other paths (beside the sampled floor, top-p alone ran slower;
// docs/design/sampling.md#top-p-draw). The launcher chooses:
// - kSampledFloor: top-k gathers its candidates above a sampled floor in its first pass (the top-k
//   filters on rows of kSampledFloorMinVocab or more; see SampledFloorRank);
// - kTopPDraws: top-p alone draws from the whole row and verifies (DrawTopP);
// - kLogitsFloor: kSampledFloor's kernel reading logits, top-k first (CandidatesToProbabilities),
//   its own instance so that the probabilities' kernel keeps its registers (with the logits' code
//   in it, it spilled more and top_k_top_p ran slower; docs/design/sampling.md#top-k-from-logits);
// - kChunkDraw: no filter, from probabilities: one draw by the row's chunk masses (DrawByChunks),
//   a pass of sums, in place of the race's random number and logarithm an element, which bound it
//   by arithmetic at large batches (a lone row split eight ways measured within the rounds'
//   spread, so no rule keeps the race for small shares of a row; docs/design/sampling.md#top-p-draw).
enum class Shortcut { kNone, kSampledFloor, kTopPDraws, kLogitsFloor, kChunkDraw };

// Two of SamplingKernel's draws, as functions of their own. (The kernel's other phases stay in its
// body: pulled out the same way, they changed the kernels' SASS, and two of them spilled more.)

// No filter, from probabilities: the race over every element, or in kChunkDraw's kernel one draw
// by the row's chunk masses (DrawByChunks), where the row allows it.
template <int kVec, Shortcut kShortcut>
__device__ __forceinline__ void SampleUnfiltered(const float* row, int64_t n, const RowRandom& rng, SamplingShared& sh,
                                                 Best& best, bool& decided) {
  if constexpr (kShortcut == Shortcut::kChunkDraw) {
    decided = DrawByChunks<1>(row, n, rng, sh);
    if (decided) {
      best = RowPart() == 0 ? Best{INFINITY, sh.draw_index[0]} : Best{-INFINITY, INT32_MAX};
      if (RowParts() > 1) SyncRow();  // the row's other blocks have read this one's chunk masses: it may leave
    }
  }
  if (!decided) {  // no finite positive mass (the race draws nothing from it either), or too many chunks
    ForEachGroup<float, kVec, true>(row, n, [&](const float* x, int count, int64_t first) {
      Race<false>(x, count, first, rng, 1u, 0xFFFFFFFFu, best);
    });
  }
}

// Top-p alone after the level-0 histogram, its threshold's bin p_bin holding at most kCandidates:
// one more pass gathers that bin. The kept set is the bins above (mass A, known now) and the
// gathered elements at or above t (mass K, known after the pass). The draw comes from above with
// probability A / (A + K), and then from the bin that one uniform picks by the bins' exact masses:
// by a race among that bin's elements in the pass (one bin rather than every kept element: top-p
// keeps most of a flat row), or, where the bin is dense, by rejection after the pass
// (DrawByRejection), with no random numbers in the pass.
template <int kVec>
__device__ __forceinline__ void DrawFromTopPBin(const float* row, int64_t n, float top_p, int p_bin,
                                                const RowRandom& rng, SamplingShared& sh, Best& best) {
  const uint32_t range_lo = uint32_t(p_bin) << 20, range_hi = range_lo | 0xFFFFFu;
  const uint32_t above_count = p_bin + 1 < kSamplingBins ? sh.cum_count[p_bin + 1] : 0u;
  const double above_mass = p_bin + 1 < kSamplingBins ? sh.cum_mass[p_bin + 1] : 0.0;
  const double p_target = double(top_p) * sh.cum_mass[0];
  const uint4 draw = rng.group(kDrawGroup);
  const int race_bin = above_mass > 0 ? BinHoldingMass(sh, Uniform53(draw.x, draw.y) * above_mass) : -1;
  // A dense bin's element is drawn after the pass, by rejection, where needed: its race here
  // would draw random numbers for a large part of the row.
  const uint32_t race_bin_count =
      race_bin >= 0 ? sh.cum_count[race_bin] - (race_bin + 1 < kSamplingBins ? sh.cum_count[race_bin + 1] : 0u) : 0u;
  const bool dense = int64_t(race_bin_count) * kDenseBin >= n;
  const uint32_t race_lo = race_bin >= 0 ? uint32_t(race_bin) << 20 : 0xFFFFFFFFu;
  const uint32_t race_hi = race_bin >= 0 ? race_lo | 0xFFFFFu : 0u;
  const uint32_t pass_race_lo = dense ? 0xFFFFFFFFu : race_lo, pass_race_hi = dense ? 0u : race_hi;
  __syncthreads();
  if (threadIdx.x == 0) {
    sh.num_candidates = 0;
    sh.sorted_count = -1;
  }
  __syncthreads();
  ForEachGroup<float, kVec>(row, n, [&](const float* x, int count, int64_t first) {
    for (int e = 0; e < count; ++e) {
      const uint32_t key = ProbKey(x[e]);
      if (key >= range_lo && key <= range_hi && key != 0u) {  // AddCandidate was 6% slower here
        const int slot = atomicAdd(&sh.num_candidates, 1);
        sh.cand_key[slot] = key;
        sh.cand_index[slot] = int(first + e);
      }
    }
    Race<false>(x, count, first, rng, pass_race_lo, pass_race_hi, best);
  });
  __syncthreads();
  ShareCandidates(sh);
  const uint32_t t =
      max(1u, CandidateThreshold(sh, Need::kMass, p_target, above_count, above_mass, range_lo, range_hi, true));
  const bool from_above =
      Uniform53(draw.z, draw.w) * (above_mass + CandidateMassFrom(sh, t, range_hi, true)) < above_mass;
  if (from_above && dense && RowPart() == 0) {
    // Each proposal lands in the bin with probability >= 1/kDenseBin and is kept with
    // probability >= 0.889 (a level-0 bin's values are within 1/8 of its largest), so a round
    // accepts nothing with probability < 1e-6.
    if (!DrawByRejection(row, n, race_lo, race_hi, __uint_as_float(race_hi), rng, sh, kDenseRounds, best)) {
      best = RaceOverRow(row, n, race_lo, race_hi, rng, sh);
    }
  } else if (!from_above) {
    // Every block holds every candidate: part 0 runs the race.
    best = Best{-INFINITY, INT32_MAX};
    if (RowPart() == 0) best = RaceOverCandidates(sh, t, rng, best);
  }
}

template <int kVec, Shortcut kShortcut>
__global__ void __launch_bounds__(kRowThreads) SamplingKernel(SamplingParams p) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  SamplingShared& sh = *reinterpret_cast<SamplingShared*>(shared_bytes);
  const int64_t out_row = blockIdx.x / RowParts();
  WaitForPriorGrids();
  const int64_t dist_row = DistributionRow(p, out_row);
  if (dist_row < 0 || dist_row >= p.num_dist_rows) {  // an index out of range: no distribution to read
    if (threadIdx.x == 0) {
      if (p.out_int64) static_cast<int64_t*>(p.out)[out_row] = -1;
      else static_cast<int32_t*>(p.out)[out_row] = -1;
      if (p.valid) p.valid[out_row] = false;
    }
    return;
  }
  const float* row = p.probs + dist_row * p.row_stride;
  const int64_t n = p.vocab;
  const int64_t seed = p.seed_values ? p.seed_values[out_row * p.seed_stride] : p.seed;
  const int64_t offset = p.offset_values ? p.offset_values[out_row * p.offset_stride] : p.offset;
  const RowRandom rng{uint32_t(seed), uint32_t(uint64_t(seed) >> 32), uint32_t(out_row), uint32_t(offset),
                      uint32_t(uint64_t(offset) >> 32)};
  auto prob_key = [](float v) { return ProbKey(v); };
  Best best{-INFINITY, INT32_MAX};
  bool decided = false;  // every block of the row knows the token (part 0 holds it): no race to merge
  const Filter filter = p.filter;

  if (kShortcut != Shortcut::kLogitsFloor && p.from_logits) {  // Gumbel-max over the logits, no filter
    ForEachGroup<float, kVec, true>(row, n, [&](const float* x, int count, int64_t first) {
      Race<true>(x, count, first, rng, 1u, 0xFFFFFFFFu, best);
    });
  } else if (filter == Filter::kNone) {
    SampleUnfiltered<kVec, kShortcut>(row, n, rng, sh, best, decided);
  } else if (filter == Filter::kMinP) {
    best = MinPDraw<kVec>(row, n, p.min_p.at(out_row), p.gather_min_p, rng, sh);
  } else {
    const bool use_k = filter != Filter::kTopP;
    const bool use_p = filter != Filter::kTopK;
    // The floor's sample is loaded ahead of k and top_p (SampledValue).
    constexpr bool kFloor = kShortcut == Shortcut::kSampledFloor || kShortcut == Shortcut::kLogitsFloor;
    const float sampled = kFloor ? SampledValue(row, n, kSampledFloorMinVocab) : 0.f;
    const int k = use_k ? p.top_k.at(out_row) : 0;
    const float top_p = use_p ? p.top_p.at(out_row) : 1.f;
    const bool p_active = use_p && top_p < 1.f;
    const bool joint = filter == Filter::kJoint;
    // Where top-k may leave part of the row out, the kept set is decided among the elements of the
    // bins down to the k-th largest's bin (fewer than k lie above it), gathered: top-p's threshold
    // lies among them too (top_k_first: within the top-k set; joint: where the top-k set holds
    // top_p of the row's mass, else top-k's threshold binds). So the histogram needs counts only,
    // no masses (two of its three atomics), and joint the row's mass, summed in registers.
    const bool k_decides = use_k && k > 0 && int64_t(k) < n;
    const bool with_mass = use_p && !k_decides;
    const bool row_mass_needed = k_decides && joint && p_active;
    // Logits with top-k first (kLogitsFloor's kernel): the floor and the gather by LogitKey, then
    // CandidatesToProbabilities; where the floor does not apply, LogitsToProbabilities and the
    // probabilities' path below.
    constexpr bool from_logits = kShortcut == Shortcut::kLogitsFloor;
    auto logit_key = [](float v) { return LogitKey(v); };
    // Where the launcher chose it and a sample puts a floor under the k-th largest, one pass
    // gathers every element from the floor up, and the search and race run among them; where that
    // misses, the histogram's passes below.
    const int floor_rank =
        kFloor && k_decides ? SampledFloorRank(k, n, kSampledFloorMinVocab) : 0;
    bool raced = false;
    if (floor_rank > 0) {
      uint32_t floor = from_logits ? SampledFloor(sampled, floor_rank, logit_key, sh)
                                   : SampledFloor(sampled, floor_rank, prob_key, sh);
      double row_mass = 0;  // this thread's elements, in a fixed order
      auto sum_mass = [&](const float* x, int count, int64_t) {
        for (int e = 0; e < count; ++e) row_mass += ProbKey(x[e]) != 0u ? x[e] : 0.f;
      };
      float nan = 0.f;  // from logits: a NaN in the row
      auto find_nan = [&](const float* x, int count, int64_t) {
        for (int e = 0; e < count; ++e) nan = x[e] != x[e] ? 1.f : nan;
      };
      const bool gathered =
          from_logits ? GatherAtOrAbove<float, kVec, true>(row, n, sh, logit_key, floor, k, find_nan)
          : row_mass_needed ? GatherAtOrAbove<float, kVec, true>(row, n, sh, prob_key, floor, k, sum_mass)
                            : GatherAtOrAbove<float, kVec, true>(row, n, sh, prob_key, floor, k, [](const float*, int, int64_t) {});
      if (RowParts() == 1 && out_row + p.ahead < p.batch) {
        const int64_t next = DistributionRow(p, out_row + p.ahead);
        if (next >= 0 && next < p.num_dist_rows) PrefetchNextRow(p.probs + next * p.row_stride, n);
      }
      if (from_logits && RowMax(nan, sh) > 0.f) {
        raced = decided = true;  // nothing drawn: best stays empty in every block
      } else if (gathered) {
        if (from_logits) floor = CandidatesToProbabilities(sh, floor);
        if (row_mass_needed) row_mass = RowSumDouble(row_mass, sh);
        const uint32_t top_end = CandidateTopBinEnd(sh);
        const uint32_t range_lo = NarrowToKthBin(sh, k, floor, top_end);
        best = TopKRace<true>(sh, k, p_active ? top_p : 1.f, joint, row_mass, range_lo, p_active ? top_end : 0xFFFFFFFFu, rng,
                              decided);
        raced = true;
      }
    }
    if (from_logits && !raced) {
      // Draws from one row (indices) may write its probabilities at once: the same values.
      float* probs = p.scratch + dist_row * p.scratch_stride;
      if (LogitsToProbabilities<kVec>(row, probs, n, sh)) {
        row = probs;
      } else {
        raced = decided = true;  // a NaN: nothing drawn
      }
    }
    if constexpr (kShortcut == Shortcut::kTopPDraws) {
      if (filter == Filter::kTopP && p_active && top_p >= kTopPDrawMin) {
        raced = decided = DrawTopP(row, n, top_p, rng, sh, best);
      }
    }
    if (!raced) {
      // 1. The level-0 histogram: count (and mass) per bin of the top 12 bits.
      ClearBins(sh, kSamplingBins);
      __syncthreads();
      double row_mass = 0;  // this thread's elements, in a fixed order
      if (row_mass_needed) {  // two loops: the sum's test costs the histogram's loop where not needed
        ForEachGroup<float, kVec>(row, n, [&](const float* x, int count, int64_t) {
          for (int e = 0; e < count; ++e) {
            const uint32_t key = ProbKey(x[e]);
            AddToBins(sh, key, 1u, 0xFFFFFFFFu, 20, false);
            if (key != 0u) row_mass += x[e];
          }
        });
      } else {
        ForEachGroup<float, kVec>(row, n, [&](const float* x, int count, int64_t) {
          for (int e = 0; e < count; ++e) AddToBins(sh, ProbKey(x[e]), 1u, 0xFFFFFFFFu, 20, with_mass);
        });
      }
      __syncthreads();
      ScanBinsFromTop(sh, kSamplingBins, 0, 20, with_mass);
      if (row_mass_needed) row_mass = RowSumDouble(row_mass, sh);
      const uint32_t total_count = sh.cum_count[0];
      const bool k_active = use_k && k > 0 && uint32_t(k) < total_count;
      const bool k_then_p = filter == Filter::kTopKFirst && k_active && p_active;
      const int bin_k = k_active ? CrossingBin(sh, kSamplingBins, Need::kCount, double(k)) : -1;
      const int p_bin = with_mass && p_active ? CrossingBin(sh, kSamplingBins, Need::kMass, double(top_p) * sh.cum_mass[0]) : -1;
      const uint32_t p_bin_count =
          p_bin >= 0 ? sh.cum_count[p_bin] - (p_bin + 1 < kSamplingBins ? sh.cum_count[p_bin + 1] : 0u) : 0u;
      if (k_decides && bin_k >= 0 && sh.cum_count[bin_k] <= uint32_t(kCandidates)) {
        // 2. One more pass gathers every element from bin_k up: the thresholds, then the race, among them.
        // Masses are summed in fixed point below the top bin's exponent: found where top-p asks them.
        const int top_bin = p_active ? CrossingBin(sh, kSamplingBins, Need::kCount, 1.0) : kSamplingBins - 1;
        const uint32_t range_lo = uint32_t(bin_k) << 20, range_hi = (uint32_t(top_bin) << 20) | 0xFFFFFu;
        __syncthreads();
        GatherCandidates<float, kVec>(row, n, sh, prob_key, range_lo, range_hi);
        ShareCandidates(sh);
        best = TopKRace<kFloor>(sh, k, p_active ? top_p : 1.f, joint, row_mass, range_lo, range_hi, rng, decided);
      } else if (p_bin >= 0 && p_bin_count <= uint32_t(kCandidates)) {
        DrawFromTopPBin<kVec>(row, n, top_p, p_bin, rng, sh, best);
      } else {
        // The general path (no filter left, or a threshold's bin too full to gather): exact
        // thresholds over more passes, then the race.
        __syncthreads();
        uint32_t t = 1u;
        if (k_active) {
          const Threshold tk = FindThreshold<float, kVec>(row, n, sh, prob_key, Need::kCount, double(k), false, 1u, k_then_p);
          t = tk.key;
          if (p_active) {
            const Threshold tp = k_then_p
                ? FindThreshold<float, kVec>(row, n, sh, prob_key, Need::kMass, double(top_p) * tk.kept_mass, false, tk.key, true)
                : FindThreshold<float, kVec>(row, n, sh, prob_key, Need::kMass, double(top_p), true, 1u, true);
            t = max(t, tp.key);
          }
        } else if (p_active) {
          t = FindThreshold<float, kVec>(row, n, sh, prob_key, Need::kMass, double(top_p), true, 1u, true).key;
        }
        ForEachGroup<float, kVec>(row, n, [&](const float* x, int count, int64_t first) {
          Race<false>(x, count, first, rng, t, 0xFFFFFFFFu, best);
        });
      }
    }
  }
  if (!decided) best = RowBest(best, sh);
  if (threadIdx.x == 0 && RowPart() == 0) {
    // Nothing to sample (no kept positive probability; logits all -inf, whose race keys tie at -inf,
    // or NaN): token 0.
    const bool drawn = best.index != INT32_MAX && best.key > -INFINITY;
    const int64_t token = drawn ? best.index : 0;
    if (p.out_int64) {
      static_cast<int64_t*>(p.out)[out_row] = token;
    } else {
      static_cast<int32_t*>(p.out)[out_row] = int32_t(token);
    }
    if (p.valid) p.valid[out_row] = drawn;
  }
  AllowDependentGrids();
}

}  // namespace aotinfer
