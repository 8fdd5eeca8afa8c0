// The top-k and top-p renormalizations of probabilities and the top-k mask of logits: the
// samplers' threshold search and top-k gather, then a pass that writes the row. The scheme:
// sampling.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "aotinfer/launch.cuh"
#include "aotinfer/rows.cuh"
#include "aotinfer/sampling/keys.cuh"
#include "aotinfer/sampling/params.cuh"
#include "aotinfer/sampling/reductions.cuh"
#include "aotinfer/sampling/sampled_floor.cuh"
#include "aotinfer/sampling/threshold_search.cuh"
#include "aotinfer/vec.cuh"

namespace aotinfer {

struct RenormParams {
  const void* input;  // probs (float32) or logits (T)
  int64_t in_stride;
  void* out;          // input's type
  int64_t out_stride;
  int64_t vocab;
  int64_t rows;
  Filter filter;      // kTopK or kTopP (renorm), kTopK (mask)
  RowParam<int> top_k;
  RowParam<float> top_p;
};

// The first and one past the last element of the row that this block's ForEachGroup visits.
template <int kVec>
__device__ __forceinline__ int2 RowSlice(int64_t n) {
  const int64_t all_groups = n / kVec;
  const int parts = RowParts(), part = RowPart();
  const int64_t end = part == parts - 1 ? n : all_groups * (part + 1) / parts * kVec;
  return make_int2(int(all_groups * part / parts * kVec), int(end));
}

// The samplers' top-k shortcut for the renormalization and the mask: a count-only level-0
// histogram, then one pass that gathers every element from the k-th largest's bin up (fewer than k
// lie above it, so all fit) and, since the filter drops every other element, writes `dropped` to
// the whole row of `out` in the same pass; the kept ones are rewritten from shared memory once the
// threshold is known (WriteKeptCandidates). On rows of floor_min_vocab or more the gathering pass
// comes first, from a sampled floor up (`sampled`: this thread's SampledValue), with no histogram:
// one read and one write where the floor holds. Needs
// 0 < k < n. `with_top`: the gathered range ends at the top bin's last key (CandidateMassFrom's
// fixed point starts there), else at the largest key. Returns false where it does not apply (fewer
// than k keyed elements, or the k-th largest's bin too full to gather); the caller's general path
// then writes the whole row again.
struct TopKGathered {
  bool ok;
  uint32_t key;  // the k-th largest key: kept from it up
  uint32_t hi;   // the gathered range's last key
};

// The level-0 histogram of a row (counts, and masses where with_mass), scanned from the top bin.
template <typename T, int kVec, typename KeyOf>
__device__ __forceinline__ void Level0Histogram(const T* row, int64_t n, SamplingShared& sh, KeyOf key_of, bool with_mass) {
  ClearBins(sh, kSamplingBins);
  __syncthreads();
  ForEachGroup<T, kVec>(row, n, [&](const float* x, int count, int64_t) {
    for (int e = 0; e < count; ++e) AddToBins(sh, key_of(x[e]), 1u, 0xFFFFFFFFu, 20, with_mass);
  });
  __syncthreads();
  ScanBinsFromTop(sh, kSamplingBins, 0, 20, with_mass);
}

template <typename T, int kVec, typename KeyOf>
__device__ TopKGathered GatherTopK(const T* row, T* out, int64_t n, SamplingShared& sh, KeyOf key_of, int k,
                                   float dropped, bool with_top, float sampled, int64_t floor_min_vocab) {
  const T dropped_t = from_float<T>(dropped);
  auto write_dropped = [&](const float*, int count, int64_t first) {
    if (count == kVec) {
      Vec<T, kVec>::from_floats([&](int) { return dropped; }).store(out + first);
    } else {
      for (int e = 0; e < count; ++e) out[first + e] = dropped_t;
    }
  };
  // Where a sample puts a floor under the k-th largest: one pass gathers from it up and writes.
  const int floor_rank = SampledFloorRank(k, n, floor_min_vocab);
  if (floor_rank > 0) {
    const uint32_t floor = SampledFloor(sampled, floor_rank, key_of, sh);
    if (GatherAtOrAbove<T, kVec, false>(row, n, sh, key_of, floor, k, write_dropped)) {
      const uint32_t top_end = CandidateTopBinEnd(sh);
      const uint32_t lo = NarrowToKthBin(sh, k, floor, top_end);
      const uint32_t hi = with_top ? top_end : 0xFFFFFFFFu;
      const uint32_t t = CandidateThreshold(sh, Need::kCount, double(k), 0u, 0.0, lo, hi, true);
      return TopKGathered{true, t == 0u ? lo : t, hi};
    }
  }
  Level0Histogram<T, kVec>(row, n, sh, key_of, false);
  const int bin_k = CrossingBin(sh, kSamplingBins, Need::kCount, double(k));
  if (bin_k < 0 || sh.cum_count[bin_k] > uint32_t(kCandidates)) {
    __syncthreads();
    return TopKGathered{false, 0u, 0u};
  }
  const int top_bin = with_top ? CrossingBin(sh, kSamplingBins, Need::kCount, 1.0) : kSamplingBins - 1;
  const uint32_t lo = uint32_t(bin_k) << 20, hi = (uint32_t(top_bin) << 20) | 0xFFFFFu;
  if (threadIdx.x == 0) {
    sh.num_candidates = 0;
    sh.sorted_count = -1;
  }
  __syncthreads();
  ForEachGroup<T, kVec>(row, n, [&](const float* x, int count, int64_t first) {
    for (int e = 0; e < count; ++e) {
      const uint32_t key = key_of(x[e]);
      if (key >= lo && key <= hi && key != 0u) AddCandidate(sh, key, int(first + e));
    }
    write_dropped(x, count, first);
  });
  __syncthreads();
  ShareCandidates(sh);
  const uint32_t t = CandidateThreshold(sh, Need::kCount, double(k), 0u, 0.0, lo, hi, true);
  return TopKGathered{true, t == 0u ? lo : t, hi};
}

// out[index] = value_of(key) for the gathered candidates at or above t that lie in this block's
// slice of the row (every block holds every candidate of the row; each rewrites only what its own
// pass wrote, so no write crosses blocks).
template <int kVec, typename T, typename ValueOf>
__device__ __forceinline__ void WriteKeptCandidates(SamplingShared& sh, T* out, int64_t n, uint32_t t, ValueOf value_of) {
  const int2 slice = RowSlice<kVec>(n);
  for (int i = threadIdx.x; i < sh.num_candidates; i += kRowThreads) {
    const uint32_t key = sh.cand_key[i];
    const int index = sh.cand_index[i];
    if (key >= t && index >= slice.x && index < slice.y) out[index] = value_of(key);
  }
}

// The top-p renormalization reads its row three times: the level-0 histogram with masses (which
// bin holds the threshold, and the exact mass above it), the gather of that bin's elements (which
// key is the threshold, and the kept mass), and the pass that writes. Where the sample predicts
// the threshold's bin, the first pass gathers a window of bins around it as well, and where the
// histogram then puts the threshold inside the window, the window's keys of that bin are the
// gather's candidates, and the second pass is saved. The candidates are the same either way (every
// key of the row in the bin), so the output does not depend on the sample, only the time.
//
// The window: the sample's own level-0 histogram with masses predicts the bin where the row's
// upper set reaches top_p of its mass; the window is that bin and the bins around it that lie
// inside the budget's elements (expected from the sample) centred on its middle, counted from the
// top; none where the predicted bin alone is expected to hold more. On flat rows a sampled bin
// stands for thousands of elements and the window is the predicted bin and its neighbours; on
// peaked ones the bins are sparse and the window spans many of them, up to the top where fewer
// than half the budget lie above. (How often it holds the threshold's bin:
// docs/design/sampling.md#renorm-and-masks.)
constexpr int64_t kTopPWindowMinVocab = 64 * kFloorSample;
constexpr float kTopPWindowBudget = 12000.f;  // elements expected in the window (at most an eighth of the row)

struct KeyWindow {
  uint32_t lo, hi;  // keys [lo, hi]; empty where lo > hi
};

// Every thread of the row's blocks calls it with its SampledValue; each block computes the same
// window from the whole sample, alone. The sample's histogram takes one level-0 bin a thread, from
// the sample's largest bin down (a 4096-bin histogram and its scan cost a row several microseconds).
__device__ KeyWindow TopPWindow(float sampled, float top_p, int64_t n, SamplingShared& sh) {
  const uint32_t key = ProbKey(sampled);
  const int top = int(__float_as_uint(BlockMax(key ? sampled : 0.f, sh)) >> 20);
  const int t = int(threadIdx.x);  // this thread's bin: top - t
  sh.count[t] = 0;
  sh.mass_hi[t] = 0;
  sh.mass_lo[t] = 0;
  __syncthreads();
  if (key != 0u && top - int(key >> 20) < kRowThreads) {  // 128 octaves below the largest: no mass to speak of
    const int b = top - int(key >> 20);
    const uint32_t mantissa = MantissaOf(key);
    AddToBin(sh, b, 1u, mantissa >> 12, mantissa & 0xFFFu, true);
  }
  __syncthreads();
  const float count = float(sh.count[t]);
  const double mass = top - t >= 0 && count > 0.f ? MassOf(sh.mass_hi[t], sh.mass_lo[t], uint32_t(top - t) << 20) : 0.0;
  const float above = float(BlockExclusiveSum(double(count), sh));  // sampled in the bins above this one
  const double mass_above = BlockExclusiveSum(mass, sh);
  if (t == kRowThreads - 1) sh.part_double = mass_above + mass;  // the sample's mass
  __syncthreads();
  const double target = double(top_p) * sh.part_double;
  int& predicted = sh.found;
  int& first = sh.scratch_i[0];
  int& last = sh.scratch_i[1];
  if (t == 0) predicted = -1;
  __syncthreads();
  if (count > 0.f && mass_above < target && mass_above + mass >= target) predicted = t;  // one thread at most
  __syncthreads();
  const int p = predicted;
  if (p < 0) return KeyWindow{1u, 0u};  // every thread: p is the block's
  if (t == p) sh.part_value = above + 0.5f * count;  // the predicted bin's middle, counted from the top
  if (t == 0) first = last = p;
  __syncthreads();
  const float per_sampled = float(n) / float(kFloorSample);  // the row's elements a sampled one stands for
  const float budget = fminf(kTopPWindowBudget, float(n) / 8.f);
  const float half = 0.5f * budget / per_sampled, middle = sh.part_value;
  // This bin spans [above, above + count] from the top; the bins inside (middle - half, middle +
  // half) are contiguous. (Bins that merely overlap it made the window too wide for the budget
  // on flat rows, and it then shrank to the predicted bin alone: in NumPy, the threshold's bin held
  // for 55% of flat rows of 128256, against 95%.)
  if (above > middle - half && above + count < middle + half) {
    atomicMin(&first, t);
    atomicMax(&last, t);
  }
  __syncthreads();
  float* const edges = sh.scratch_f;  // the window's first sampled element and one past its last, from the top
  if (t == first) edges[0] = above;
  if (t == last) edges[1] = above + count;
  __syncthreads();
  const bool fits = (edges[1] - edges[0]) * per_sampled <= budget;  // only the predicted bin alone can exceed it
  // Up to the top where the window reaches the sample's largest bin (the bins above it hold no
  // sampled element, so the sample puts them inside the window too).
  const KeyWindow window{uint32_t(top - last) << 20, first == 0 ? 0xFFFFFFFFu : (uint32_t(top - first) << 20) | 0xFFFFFu};
  __syncthreads();
  return fits ? window : KeyWindow{1u, 0u};
}

// Level0Histogram with masses over float32 probabilities, gathering the keys in `window` into
// window_keys on the way. Each thread puts its first kOwnWindowKeys keys in its own slots
// (window_keys[j * kRowThreads + thread]), counted in a register, and the rest in the pool
// after them, through one shared counter: the window's expected 12000 keys make about 12 a
// thread, so the pool takes a few hundred a block. (Slots taken by each warp's groups through
// ballots and one atomic made the pass slower: docs/design/sampling.md#renorm-and-masks.) `own`: this thread's
// keys. False where a block of the row overflowed the pool.
template <int kVec>
__device__ bool Level0HistogramGathering(const float* row, int64_t n, SamplingShared& sh, KeyWindow window, int& own) {
  ClearBins(sh, kSamplingBins);
  if (threadIdx.x == 0) sh.num_candidates = 0;  // the pool's keys
  __syncthreads();
  uint32_t* const pool = sh.window_keys + kOwnWindowKeys * kRowThreads;
  own = 0;
  // A thread that found the pool full takes no more slots: the count already says it overflowed,
  // and a crowded window (every key of a row in it) would otherwise cost an atomic on one counter
  // for each of its keys.
  bool pool_full = false;
  ForEachGroup<float, kVec>(row, n, [&](const float* x, int count, int64_t) {
    for (int e = 0; e < count; ++e) {
      const uint32_t key = ProbKey(x[e]);
      AddToBins(sh, key, 1u, 0xFFFFFFFFu, 20, true);
      if (key >= window.lo && key <= window.hi && key != 0u) {
        if (own < kOwnWindowKeys) {
          sh.window_keys[own * kRowThreads + int(threadIdx.x)] = key;
        } else if (!pool_full) {
          const int slot = atomicAdd(&sh.num_candidates, 1);
          if (slot < kPooledWindowKeys) pool[slot] = key;
          pool_full = slot >= kPooledWindowKeys;
        }
        ++own;
      }
    }
  });
  __syncthreads();
  const bool held = sh.num_candidates <= kPooledWindowKeys;
  ScanBinsFromTop(sh, kSamplingBins, 0, 20, true);
  return RowSum(held ? 0.f : 1.f, sh) == 0.f;
}

// The gathered window's keys in [lo, hi] become this block's candidates, as GatherCandidates
// would have gathered them (in another order). Each thread reads its own slots and its share of
// the pool (one slot in every kRowThreads: no bank conflicts) and keeps their keys in
// registers across the block's scan, so the keys move down in place.
__device__ void KeepWindowKeys(SamplingShared& sh, uint32_t lo, uint32_t hi, int own) {
  constexpr int kPooledPer = kPooledWindowKeys / kRowThreads;
  static_assert(kPooledPer * kRowThreads == kPooledWindowKeys, "the pool in whole rounds of the block");
  const int pooled = sh.num_candidates;
  const uint32_t* const pool = sh.window_keys + kOwnWindowKeys * kRowThreads;
  uint32_t keys[kOwnWindowKeys + kPooledPer];
#pragma unroll
  for (int j = 0; j < kOwnWindowKeys; ++j) keys[j] = j < own ? sh.window_keys[j * kRowThreads + int(threadIdx.x)] : 0u;
#pragma unroll
  for (int j = 0; j < kPooledPer; ++j) {
    const int slot = j * kRowThreads + int(threadIdx.x);
    keys[kOwnWindowKeys + j] = slot < pooled ? pool[slot] : 0u;
  }
  int kept = 0;
#pragma unroll
  for (uint32_t key : keys) kept += key >= lo && key <= hi && key != 0u;
  int at = int(BlockExclusiveSum(double(kept), sh));  // its barriers: every slot read before any written
#pragma unroll
  for (uint32_t key : keys) {
    if (key >= lo && key <= hi && key != 0u) sh.cand_key[at++] = key;
  }
  if (threadIdx.x == kRowThreads - 1) {
    sh.num_candidates = at;
    sh.sorted_count = -1;
  }
  __syncthreads();
}

// out = p / (kept mass) where the filter keeps p, else 0, in the input's type T: top-k takes
// float32, float16 and bfloat16 rows (the sums in float32 and fixed point whatever T), top-p float32
// only (the binding refuses others). kTopPWindow: top-p rows whose first pass gathers the sample's
// window (its own kernel, so that the others keep their code as it was).
template <typename T, int kVec, bool kTopPWindow = false>
__global__ void __launch_bounds__(kRowThreads) RenormKernel(RenormParams p) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  SamplingShared& sh = *reinterpret_cast<SamplingShared*>(shared_bytes);
  const int64_t r = blockIdx.x / RowParts();
  WaitForPriorGrids();
  const T* row = static_cast<const T*>(p.input) + r * p.in_stride;
  T* out = static_cast<T*>(p.out) + r * p.out_stride;
  const int64_t n = p.vocab;
  const float sampled = kTopPWindow                ? SampledValue(row, n, kTopPWindowMinVocab)
                        : p.filter == Filter::kTopK ? SampledValue(row, n, kRenormFloorMinVocab)
                                                    : 0.f;
  auto prob_key = [](float v) { return ProbKey(v); };
  Threshold t;
  if (p.filter == Filter::kTopK) {
    const int k = p.top_k.at(r);
    if (k > 0 && k < n) {
      const TopKGathered g =
          GatherTopK<T, kVec>(row, out, n, sh, prob_key, k, 0.f, true, sampled, kRenormFloorMinVocab);
      if (g.ok) {  // every kept element is a candidate: the mass is theirs
        const double kept = CandidateMassFrom(sh, g.key, g.hi, true);
        const float scale = kept > 0 ? float(1.0 / kept) : 0.f;
        WriteKeptCandidates<kVec>(sh, out, n, g.key,
                                  [&](uint32_t key) { return from_float<T>(__uint_as_float(key) * scale); });
        AllowDependentGrids();
        return;
      }
    }
    t = FindThreshold<T, kVec>(row, n, sh, prob_key, Need::kCount, k > 0 ? double(k) : INFINITY, false, 1u, true);
  } else if constexpr (std::is_same_v<T, float>) {
    // Top-p: the level-0 histogram with masses gives the threshold's bin and the exact mass above
    // it; that bin's elements, gathered (in the histogram's pass where the sample's window holds
    // the bin; shared across the row's blocks), give t.
    const float top_p = p.top_p.at(r);
    KeyWindow window{1u, 0u};
    bool windowed = false;
    int own_window_keys = 0;
    if constexpr (kTopPWindow) {
      if (top_p < 1.f) window = TopPWindow(sampled, top_p, n, sh);
    }
    if (window.lo <= window.hi) {
      windowed = Level0HistogramGathering<kVec>(row, n, sh, window, own_window_keys);
    } else {
      Level0Histogram<T, kVec>(row, n, sh, prob_key, true);
    }
    const double total = sh.cum_mass[0];
    const double target = double(top_p) * total;
    const int p_bin = top_p < 1.f ? CrossingBin(sh, kSamplingBins, Need::kMass, target) : -1;
    if (p_bin < 0) {
      t = Threshold{1u, total};
      __syncthreads();
    } else {
      const uint32_t above_count = p_bin + 1 < kSamplingBins ? sh.cum_count[p_bin + 1] : 0u;
      const double above_mass = p_bin + 1 < kSamplingBins ? sh.cum_mass[p_bin + 1] : 0.0;
      const uint32_t in_bin = sh.cum_count[p_bin] - above_count;
      __syncthreads();
      if (in_bin <= uint32_t(kCandidates)) {
        const uint32_t lo = uint32_t(p_bin) << 20, hi = lo | 0xFFFFFu;
        if (windowed && lo >= window.lo && hi <= window.hi) {
          KeepWindowKeys(sh, lo, hi, own_window_keys);
        } else {
          GatherCandidates<T, kVec>(row, n, sh, prob_key, lo, hi);
        }
        ShareCandidates(sh);
        const uint32_t tc = CandidateThreshold(sh, Need::kMass, target, above_count, above_mass, lo, hi, true);
        const uint32_t key = tc == 0u ? lo : tc;
        t = Threshold{key, above_mass + CandidateMassFrom(sh, key, hi, true)};
      } else {
        t = FindThreshold<T, kVec>(row, n, sh, prob_key, Need::kMass, double(top_p), true, 1u, true);
      }
    }
  } else {
    t = Threshold{1u, 0.0};  // not reached: the binding sends 16-bit rows to top-k only
  }
  const float scale = t.kept_mass > 0 ? float(1.0 / t.kept_mass) : 0.f;
  ForEachGroup<T, kVec>(row, n, [&](const float* x, int count, int64_t first) {
    auto renormed = [&](float v) {
      const uint32_t key = ProbKey(v);
      return (key >= t.key && key != 0u) ? v * scale : 0.f;
    };
    if (count == kVec) {
      Vec<T, kVec>::from_floats([&](int e) { return renormed(x[e]); }).store(out + first);
    } else {
      for (int e = 0; e < count; ++e) out[first + e] = from_float<T>(renormed(x[e]));
    }
  });
  AllowDependentGrids();
}

// out = x where x is among the top k logits of its row (ties at the k-th value kept), else -inf.
template <typename T, int kVec>
__global__ void __launch_bounds__(kRowThreads) MaskLogitsKernel(RenormParams p) {
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  SamplingShared& sh = *reinterpret_cast<SamplingShared*>(shared_bytes);
  const int64_t r = blockIdx.x / RowParts();
  WaitForPriorGrids();
  const T* row = static_cast<const T*>(p.input) + r * p.in_stride;
  T* out = static_cast<T*>(p.out) + r * p.out_stride;
  const int64_t n = p.vocab;
  const float sampled = SampledValue(row, n, kMaskFloorMinVocab);
  const int k = p.top_k.at(r);
  auto logit_key = [](float v) { return LogitKey(v); };
  uint32_t t_key = 0u;  // k <= 0 or k >= vocab: every logit kept as it is
  if (k > 0 && k < n) {
    const TopKGathered g =
        GatherTopK<T, kVec>(row, out, n, sh, logit_key, k, -INFINITY, false, sampled, kMaskFloorMinVocab);
    if (g.ok) {
      WriteKeptCandidates<kVec>(sh, out, n, g.key, [](uint32_t key) { return from_float<T>(LogitFromKey(key)); });
      AllowDependentGrids();
      return;
    }
    t_key = FindThreshold<T, kVec>(row, n, sh, logit_key, Need::kCount, double(k), false, 1u, false).key;
  }
  ForEachGroup<T, kVec>(row, n, [&](const float* x, int count, int64_t first) {
    if (count == kVec) {
      const auto v = Vec<T, kVec>::from_floats([&](int e) { return LogitKey(x[e]) >= t_key ? x[e] : -INFINITY; });
      v.store(out + first);
    } else {
      for (int e = 0; e < count; ++e) out[first + e] = from_float<T>(LogitKey(x[e]) >= t_key ? x[e] : -INFINITY);
    }
  });
  AllowDependentGrids();
}

}  // namespace aotinfer
