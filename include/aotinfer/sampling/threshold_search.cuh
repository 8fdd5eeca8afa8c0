// The threshold search: the smallest key a filter keeps (the k-th largest, or where the upper set
// reaches a mass), by histograms over the key's bits -- of the row in passes over it, then of the
// candidates of the threshold's bin gathered into shared memory. The scheme: sampling.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "aotinfer/rows.cuh"
#include "aotinfer/sampling/keys.cuh"
#include "aotinfer/sampling/reductions.cuh"

namespace aotinfer {

// What a filter asks: keep the upper set of the row that holds at least `k` elements (kCount) or at
// least `mass` of probability (kMass).
enum class Need { kCount, kMass };

// Histogram levels: the bits of the key each one splits on.
__device__ __forceinline__ int LevelShift(int level) { return level == 0 ? 20 : level == 1 ? 8 : 0; }

// Clear the histogram of `bins` bins.
__device__ __forceinline__ void ClearBins(SamplingShared& sh, int bins) {
  for (int b = threadIdx.x; b < bins; b += kRowThreads) {
    sh.count[b] = 0;
    sh.mass_hi[b] = 0;
    sh.mass_lo[b] = 0;
  }
}

// Adds `count` keys whose mantissas sum to (mass_hi << 12) + mass_lo to bin b.
__device__ __forceinline__ void AddToBin(SamplingShared& sh, int b, uint32_t count, uint32_t mass_hi, uint32_t mass_lo,
                                         bool with_mass) {
  atomicAdd(&sh.count[b], count);
  if (with_mass) {
    atomicAdd(&sh.mass_hi[b], mass_hi);
    atomicAdd(&sh.mass_lo[b], mass_lo);
  }
}

// Adds one key to the histogram over [lo, hi] at `shift` (bins numbered from lo >> shift). Its own
// atomics rather than AddToBin's: the mantissa computed ahead of AddToBin's test grew every
// searched kernel's code. (Warp-aggregated adds, __match_any_sync on the bin and one atomic per
// distinct bin, were several times slower, and four interleaved copies of the counts (lane % 4)
// slower too; docs/design/sampling.md#threshold-search.)
__device__ __forceinline__ void AddToBins(SamplingShared& sh, uint32_t key, uint32_t lo, uint32_t hi, int shift,
                                          bool with_mass) {
  if (key >= lo && key <= hi && key != 0u) {
    const int b = int((key >> shift) - (lo >> shift));
    atomicAdd(&sh.count[b], 1u);
    if (with_mass) {
      const uint32_t mantissa = MantissaOf(key);
      atomicAdd(&sh.mass_hi[b], mantissa >> 12);
      atomicAdd(&sh.mass_lo[b], mantissa & 0xFFFu);
    }
  }
}

// Where StageSplitBins leaves a split row's summed mass words until the scan writes cum_mass over
// them: the high words (half 0) in its first kSamplingBins 32-bit words, the low words (half 1) in
// the next.
__device__ __forceinline__ uint32_t* StagedMassWords(SamplingShared& sh, int half) {
  static_assert(sizeof(SamplingShared::cum_mass) == 2 * kSamplingBins * sizeof(uint32_t), "two words a bin");
  return reinterpret_cast<uint32_t*>(sh.cum_mass) + half * kSamplingBins;
}

// ScanBinsFromTop's staging of a split row: bins [first, first + 4) summed over the row's blocks
// in 16-byte loads, one array at a time, into the same bins' words of this block's cum_count (the
// counts) and StagedMassWords, which are free until the scan writes them. Not inlined: inlined,
// its code moved and slowed the kernels of unsplit rows, which never stage
// (docs/design/sampling.md#threshold-search).
__device__ __noinline__ void StageSplitBins(SamplingShared& sh, int first, int parts, bool with_mass) {
#pragma unroll 1
  for (int a = 0; a < (with_mass ? 3 : 1); ++a) {
    const uint32_t* const bins = a == 0 ? sh.count : a == 1 ? sh.mass_hi : sh.mass_lo;
    uint4 sum = make_uint4(0, 0, 0, 0);
#pragma unroll 1
    for (int r = 0; r < parts; ++r) {
      const uint4 v = PartShared16(bins + first, r);
      sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
    }
    uint32_t* const to = a == 0 ? sh.cum_count : StagedMassWords(sh, a - 1);
    *reinterpret_cast<uint4*>(to + first) = sum;
  }
}

// A thread's run of keys in one bin, added to the histogram at once. FindThreshold's levels after
// the first histogram one bin of more than kCandidates elements, whose keys repeat where a row
// holds many equal values: there AddToBins's atomics all hit one address (rows of one repeated
// value ran several times slower than flat rows; docs/design/sampling.md#threshold-search). Exact: the sums are integers.
struct BinRun {
  int bin = -1;
  uint32_t count = 0, mass_hi = 0, mass_lo = 0;

  __device__ __forceinline__ void Add(SamplingShared& sh, uint32_t key, uint32_t lo, uint32_t hi, int shift,
                                      bool with_mass) {
    if (key < lo || key > hi || key == 0u) return;
    const int b = int((key >> shift) - (lo >> shift));
    if (b != bin) {
      Flush(sh, with_mass);
      bin = b;
    }
    ++count;
    if (with_mass) {
      const uint32_t mantissa = MantissaOf(key);
      mass_hi += mantissa >> 12;
      mass_lo += mantissa & 0xFFFu;
    }
  }

  __device__ __forceinline__ void Flush(SamplingShared& sh, bool with_mass) {
    if (count == 0u) return;
    AddToBin(sh, bin, count, mass_hi, mass_lo, with_mass);
    count = mass_hi = mass_lo = 0u;
  }
};

// Turns the histogram of `bins` bins (lowest key of bin b: (base + b) << shift) into cumulative
// counts and masses from the top bin down. Every thread calls it.
// With merge_parts false, the block's own histogram alone (of candidates every block of the row holds).
__device__ __forceinline__ void ScanBinsFromTop(SamplingShared& sh, int bins, uint32_t base, int shift, bool with_mass,
                                                bool merge_parts = true) {
  // Thread t owns bins [bins - 4(t+1), bins - 4t): the top four are thread 0's.
  // The histograms of every block of the row, summed (integers: any order gives the same).
  constexpr int kPer = kSamplingBins / kRowThreads;
  const int parts = merge_parts ? RowParts() : 1;
  if (parts > 1) SyncRow(); else __syncthreads();
  uint32_t count = 0;
  double mass = 0;
  // A split row's thread whose four bins all exist (`first` the lowest, 16-byte aligned) sums the
  // blocks' bins into its own slots (StageSplitBins) and reads them as a whole row's. Read as
  // 4-byte generic loads (as the other threads still do), half of them remote, they made a split
  // row's scan several times a whole row's (docs/design/sampling.md#threshold-search).
  static_assert(kPer == 4, "a thread's bins in one 16-byte load");
  const int first = bins - kPer * (int(threadIdx.x) + 1);
  const bool staged = parts > 1 && bins % kPer == 0 && first >= 0;
  if (staged) StageSplitBins(sh, first, parts, with_mass);
  const uint32_t* const bin_counts = staged ? sh.cum_count : sh.count;
  const uint32_t* const bin_his = staged ? StagedMassWords(sh, 0) : sh.mass_hi;
  const uint32_t* const bin_los = staged ? StagedMassWords(sh, 1) : sh.mass_lo;
  uint32_t c[kPer];
  double m[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int b = bins - 1 - (int(threadIdx.x) * kPer + j);
    uint32_t bin_count = 0, hi = 0, lo = 0;
    if (b >= 0 && (parts == 1 || staged)) {  // plain shared-memory loads
      bin_count = bin_counts[b];
      hi = with_mass ? bin_his[b] : 0u;
      lo = with_mass ? bin_los[b] : 0u;
    } else if (b >= 0) {
      // Unrolled to the largest split, so that the remote loads are in flight together.
#pragma unroll
      for (int r = 0; r < kMaxRowParts; ++r) {
        if (r < parts) {
          bin_count += *PartShared(&sh.count[b], r);
          if (with_mass) {
            hi += *PartShared(&sh.mass_hi[b], r);
            lo += *PartShared(&sh.mass_lo[b], r);
          }
        }
      }
    }
    c[j] = bin_count;
    m[j] = (with_mass && bin_count) ? MassOf(hi, lo, (base + uint32_t(b)) << shift) : 0.0;
    count += c[j];
    mass += m[j];
  }
  const double mass_above = BlockExclusiveSum(mass, sh);
  const double count_above = BlockExclusiveSum(double(count), sh);
  uint32_t running_count = uint32_t(count_above);
  double running_mass = mass_above;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int b = bins - 1 - (int(threadIdx.x) * kPer + j);
    running_count += c[j];
    running_mass += m[j];
    if (b >= 0) {
      sh.cum_count[b] = running_count;
      sh.cum_mass[b] = running_mass;
    }
  }
  if (parts > 1) SyncRow(); else __syncthreads();  // every block has read the others' histograms before any clears its own
}

// The highest bin whose cumulative value (this bin and above) reaches `target` with at least one
// element; -1 where none does. Needs ScanBinsFromTop first.
__device__ __forceinline__ int CrossingBin(SamplingShared& sh, int bins, Need need, double target) {
  if (threadIdx.x == 0) sh.found = -1;
  __syncthreads();
  for (int b = threadIdx.x; b < bins; b += kRowThreads) {
    const bool reached = need == Need::kCount ? double(sh.cum_count[b]) >= target : sh.cum_mass[b] >= target;
    if (reached && sh.cum_count[b] > 0) atomicMax(&sh.found, b);
  }
  __syncthreads();
  const int b = sh.found;
  __syncthreads();
  return b;
}

// The highest bin whose cumulative mass (this bin and above) exceeds `mass`: the bin holding the
// point `mass` below the top of the row when the bins are laid out from the top; -1 where none
// does. Needs ScanBinsFromTop first.
__device__ __forceinline__ int BinHoldingMass(SamplingShared& sh, double mass) {
  if (threadIdx.x == 0) sh.found = -1;
  __syncthreads();
  for (int b = threadIdx.x; b < kSamplingBins; b += kRowThreads) {
    if (sh.cum_mass[b] > mass) atomicMax(&sh.found, b);
  }
  __syncthreads();
  const int b = sh.found;
  __syncthreads();
  return b;
}

// The smallest of `v` over the block.
__device__ __forceinline__ int BlockMinInt(int v, SamplingShared& sh) {
  return BlockReduce(v, sh.scratch_i, [](int a, int b) { return min(a, b); });
}

// Sorts the gathered candidates by key, largest first, ties by index (a bitonic sort over the next
// power of two, padded with key 0, which no element has).
__device__ __forceinline__ void SortCandidates(SamplingShared& sh) {
  static_assert(2 * kSortedCandidates <= kCandidates, "the sort's second buffer lies past its first");
  const int n = sh.num_candidates;
  if (sh.sorted_count == n) return;  // sorted by the search before, since the last gather
  int size = 32;
  while (size < n) size <<= 1;
  // A bitonic sort with the elements in registers: position threadIdx.x + m * kRowThreads in
  // thread threadIdx.x, m < per. Steps between positions less than 32 apart exchange by shuffles,
  // the others through shared memory, in two buffers taken in turn (one barrier a step). Only the
  // warps that hold positions work (size is a multiple of 32): at 1024 threads a step costs every
  // warp's instructions, and in shared memory with all the block a step cost the same whatever
  // the size (docs/design/sampling.md#threshold-search). Padded past n with key 0, index INT32_MAX (last in the order).
  constexpr int kPer = kSortedCandidates / kRowThreads;
  const int per = (size + kRowThreads - 1) / kRowThreads;
  const bool holds = int(threadIdx.x) < size;
  uint32_t key[kPer];
  int index[kPer];
#pragma unroll
  for (int m = 0; m < kPer; ++m) {
    const int i = int(threadIdx.x) + m * kRowThreads;
    key[m] = i < n ? sh.cand_key[i] : 0u;
    index[m] = i < n ? sh.cand_index[i] : INT32_MAX;
  }
  // Position i keeps the first in the order of itself and `other` where it is the pair's lower
  // position in a run that ascends, or the upper one in a run that descends; else the second.
  auto exchange = [&](int m, int k, int j, uint32_t other_key, int other_index) {
    const int i = int(threadIdx.x) + m * kRowThreads;
    const bool want_first = ((i & j) == 0) == ((i & k) == 0);
    const bool other_first = other_key > key[m] || (other_key == key[m] && other_index < index[m]);
    if (other_first == want_first) {
      key[m] = other_key;
      index[m] = other_index;
    }
  };
  int buffer = 0;
  for (int k = 2; k <= size; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      if (j < 32) {
        if (holds) {
#pragma unroll
          for (int m = 0; m < kPer; ++m) {
            if (m < per) {
              const uint32_t other_key = __shfl_xor_sync(0xffffffffu, key[m], j);
              const int other_index = __shfl_xor_sync(0xffffffffu, index[m], j);
              exchange(m, k, j, other_key, other_index);
            }
          }
        }
        continue;
      }
      uint32_t* const keys = sh.cand_key + buffer * kSortedCandidates;
      int* const indices = sh.cand_index + buffer * kSortedCandidates;
      buffer ^= 1;
      if (holds) {
#pragma unroll
        for (int m = 0; m < kPer; ++m) {
          if (m < per) {
            keys[threadIdx.x + m * kRowThreads] = key[m];
            indices[threadIdx.x + m * kRowThreads] = index[m];
          }
        }
      }
      __syncthreads();
      if (holds) {
#pragma unroll
        for (int m = 0; m < kPer; ++m) {
          if (m < per) {
            const int partner = (int(threadIdx.x) + m * kRowThreads) ^ j;
            exchange(m, k, j, keys[partner], indices[partner]);
          }
        }
      }
    }
  }
  __syncthreads();  // every read of the buffers done
#pragma unroll
  for (int m = 0; m < kPer; ++m) {
    const int i = int(threadIdx.x) + m * kRowThreads;
    if (i < n) {
      sh.cand_key[i] = key[m];
      sh.cand_index[i] = index[m];
    }
  }
  if (threadIdx.x == 0) sh.sorted_count = n;
  __syncthreads();
}

// CandidateThreshold (below) over candidates sorted by SortCandidates: the k-th key, or the first
// whose prefix of mass (in the sorted order: the same on every run) reaches the target.
__device__ __forceinline__ uint32_t SortedThreshold(SamplingShared& sh, Need need, double target,
                                                       uint32_t above_count, double above_mass) {
  const int n = sh.num_candidates;
  if (need == Need::kCount) {
    const double position = target - double(above_count);  // 1-based position of the k-th largest
    if (position < 1 || position > n) return 0u;
    return sh.cand_key[int(position) - 1];
  }
  // Mass: prefix sums in a fixed order (each thread a contiguous chunk), so the same on every run.
  const int chunk = (n + kRowThreads - 1) / kRowThreads;
  const int begin = min(n, int(threadIdx.x) * chunk), end = min(n, begin + chunk);
  double local = 0;
  for (int i = begin; i < end; ++i) local += __uint_as_float(sh.cand_key[i]);
  double running = above_mass + BlockExclusiveSum(local, sh);
  int first = INT32_MAX;
  for (int i = begin; i < end; ++i) {
    running += __uint_as_float(sh.cand_key[i]);
    if (running >= target) {
      first = i;
      break;
    }
  }
  first = BlockMinInt(first, sh);
  return first == INT32_MAX ? 0u : sh.cand_key[first];
}

// Over the gathered candidates (keys in [lo, hi], after `above_count` elements and `above_mass` of
// mass that lie above hi), the key at which the upper set first reaches `target`; 0 where the
// candidates do not reach it. The same radix search as over the row, on shared memory: histograms
// of the candidates over the bits below each level, so no order of the candidates matters (their
// order is the atomics', different on every run), and the blocks of a split row merge them, unless
// each holds all of the row's candidates (`local`, after ShareCandidates). Up to kSortedCandidates
// held by one block are sorted instead (fewer barriers; once per gather). Mass is only asked of
// probabilities.
__device__ __forceinline__ uint32_t CandidateThreshold(SamplingShared& sh, Need need, double target,
                                                       uint32_t above_count, double above_mass, uint32_t lo,
                                                       uint32_t hi, bool local = false) {
  local = local || RowParts() == 1;  // every candidate of the row in this block
  if (local && sh.num_candidates <= kSortedCandidates) {  // few, in one block: sorting is quicker
    SortCandidates(sh);
    return SortedThreshold(sh, need, target, above_count, above_mass);
  }
  const int n = sh.num_candidates;
  const bool with_mass = need == Need::kMass;
  // Candidates of one level-0 bin: its level would have one bin, so start below it.
  for (int level = (lo >> LevelShift(0)) == (hi >> LevelShift(0)) ? 1 : 0; level < 3; ++level) {
    const int shift = LevelShift(level);
    const uint32_t base = lo >> shift;
    const int bins = int((hi >> shift) - base) + 1;
    ClearBins(sh, bins);
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += kRowThreads) AddToBins(sh, sh.cand_key[i], lo, hi, shift, with_mass);
    __syncthreads();
    ScanBinsFromTop(sh, bins, base, shift, with_mass, !local);
    const double wanted = with_mass ? target - above_mass : target - double(above_count);
    const int b = CrossingBin(sh, bins, need, wanted);
    if (b < 0) return 0u;
    if (b + 1 < bins) {
      above_count += sh.cum_count[b + 1];
      above_mass += sh.cum_mass[b + 1];
    }
    const uint32_t bin_lo = (base + uint32_t(b)) << shift;
    lo = max(lo, bin_lo);
    hi = min(hi, bin_lo + ((1u << shift) - 1u));
    __syncthreads();
  }
  return lo;  // one key
}

// The mass of the candidates with keys >= t (probabilities, keys <= hi), exactly: mantissas as
// fixed point below hi's exponent, summed in 64-bit integers, so in any order. in_block: every
// candidate of the row is in this block (no sum over the row's blocks).
__device__ __forceinline__ double CandidateMassFrom(SamplingShared& sh, uint32_t t, uint32_t hi, bool in_block = false) {
  const int top = int((hi >> 23) & 0xFF);
  unsigned long long local = 0;
  for (int i = threadIdx.x; i < sh.num_candidates; i += kRowThreads) {
    const uint32_t key = sh.cand_key[i];
    if (key >= t) {
      const int exponent = max(int((key >> 23) & 0xFF), 1);
      const int shift = exponent - max(top, 1) + 27;  // the largest mantissa becomes < 2^51
      local += shift >= 0 ? (unsigned long long)MantissaOf(key) << shift : MantissaOf(key) >> min(-shift, 31);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) local += __shfl_xor_sync(0xffffffffu, local, o);
  if (threadIdx.x % 32 == 0) sh.scratch_d[threadIdx.x / 32] = __longlong_as_double((long long)local);
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long block = 0;
    for (int w = 0; w < kSamplingWarps; ++w) block += (unsigned long long)__double_as_longlong(sh.scratch_d[w]);
    sh.part_sum = block;
  }
  // In one block (in_block, or an unsplit row) the block's own sum: in a split row the cluster's
  // first block may not have written its own yet.
  const int parts = in_block ? 1 : RowParts();
  if (parts > 1) SyncRow(); else __syncthreads();
  unsigned long long total = parts == 1 ? sh.part_sum : 0ull;
  for (int r = 0; parts > 1 && r < parts; ++r) total += *PartShared(&sh.part_sum, r);
  if (parts > 1) SyncRow(); else __syncthreads();
  const int scale = max(top, 1) - 150 - 27;
  return double(total) * __longlong_as_double(int64_t(scale + 1023) << 52);
}

// Appends one candidate: the lanes that reach it together take their slots with one atomic.
// Past kCandidates, candidates are counted (num_candidates) but not kept.
__device__ __forceinline__ void AddCandidate(SamplingShared& sh, uint32_t key, int index) {
  const unsigned takers = __activemask();
  const int lane = int(threadIdx.x % 32), leader = __ffs(takers) - 1;
  int first = 0;
  if (lane == leader) first = atomicAdd(&sh.num_candidates, __popc(takers));
  const int slot = __shfl_sync(takers, first, leader) + __popc(takers & ((1u << lane) - 1u));
  if (slot < kCandidates) {
    sh.cand_key[slot] = key;
    sh.cand_index[slot] = index;
  }
}

// Gathers the elements with keys in [lo, hi] into the candidates (in any order: they are sorted).
template <typename T, int kVec, typename KeyOf>
__device__ __forceinline__ void GatherCandidates(const T* row, int64_t n, SamplingShared& sh, KeyOf key_of,
                                                 uint32_t lo, uint32_t hi) {
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
  });
  __syncthreads();
}

// Gives every block of a split row all the row's candidates (each block's own first, then the
// others' in part order), so that the search among them runs in each block alone (`local`), with
// no merges across blocks; the blocks find the same thresholds, the candidates' order not mattering.
// Their number must fit kCandidates.
__device__ __forceinline__ void ShareCandidates(SamplingShared& sh) {
  const int parts = RowParts();
  if (parts == 1) return;
  SyncRow();
  const int own = sh.num_candidates, me = RowPart();
  int at = own;
  for (int r = 0; r < parts; ++r) {
    if (r == me) continue;
    const int count = *PartShared(&sh.num_candidates, r);
    const uint32_t* keys = PartShared(sh.cand_key, r);
    const int* indices = PartShared(sh.cand_index, r);
    for (int i = threadIdx.x; i < count; i += kRowThreads) {
      sh.cand_key[at + i] = keys[i];
      sh.cand_index[at + i] = indices[i];
    }
    at += count;
  }
  SyncRow();  // every block has read the others' candidates
  if (threadIdx.x == 0) {
    sh.num_candidates = at;
    sh.sorted_count = -1;
  }
  __syncthreads();
}


// The exact threshold of one row over one or more histogram passes: the smallest key kept by "the
// upper set of keys >= floor reaches `target`" (target times the total mass above floor where
// `fraction`), and the mass kept (with_mass). Where the whole set does not reach it, floor.
struct Threshold {
  uint32_t key;
  double kept_mass;
};

template <typename T, int kVec, typename KeyOf>
__device__ Threshold FindThreshold(const T* row, int64_t n, SamplingShared& sh, KeyOf key_of, Need need,
                                   double target, bool fraction, uint32_t floor, bool with_mass) {
  uint32_t lo = max(floor, 1u), hi = 0xFFFFFFFFu;
  uint32_t above_count = 0;
  double above_mass = 0;
  for (int level = 0;; ++level) {
    const int shift = LevelShift(level);
    const uint32_t base = lo >> shift;
    const int bins = int((hi >> shift) - base) + 1;
    ClearBins(sh, bins);
    __syncthreads();
    // Level 0 keeps one atomic a key: on a flat row a run ends at almost every key, and BinRun
    // there slowed flat rows (docs/design/sampling.md#threshold-search).
    if (level == 0) {
      ForEachGroup<T, kVec>(row, n, [&](const float* x, int count, int64_t) {
        for (int e = 0; e < count; ++e) AddToBins(sh, key_of(x[e]), lo, hi, shift, with_mass);
      });
    } else {
      BinRun run;
      ForEachGroup<T, kVec>(row, n, [&](const float* x, int count, int64_t) {
        for (int e = 0; e < count; ++e) run.Add(sh, key_of(x[e]), lo, hi, shift, with_mass);
      });
      run.Flush(sh, with_mass);
    }
    __syncthreads();
    ScanBinsFromTop(sh, bins, base, shift, with_mass);
    if (level == 0 && fraction) target *= sh.cum_mass[0];
    const double wanted = need == Need::kCount ? target - above_count : target - above_mass;
    const int b = CrossingBin(sh, bins, need, wanted);
    if (b < 0) {  // everything in range is kept (only at level 0)
      const Threshold all{lo, above_mass + sh.cum_mass[0]};
      __syncthreads();
      return all;
    }
    if (b + 1 < bins) {
      above_count += sh.cum_count[b + 1];
      above_mass += sh.cum_mass[b + 1];
    }
    const uint32_t in_bin = sh.cum_count[b] - (b + 1 < bins ? sh.cum_count[b + 1] : 0u);
    const double bin_mass = sh.cum_mass[b] - (b + 1 < bins ? sh.cum_mass[b + 1] : 0.0);
    const uint32_t bin_lo = (base + uint32_t(b)) << shift;
    lo = max(lo, bin_lo);
    hi = min(hi, bin_lo + ((1u << shift) - 1u));
    __syncthreads();
    if (shift == 0) return Threshold{lo, above_mass + bin_mass};  // one key: all of it is kept
    if (in_bin <= uint32_t(kCandidates)) {
      GatherCandidates<T, kVec>(row, n, sh, key_of, lo, hi);
      const uint32_t t = CandidateThreshold(sh, need, target, above_count, above_mass, lo, hi);
      const uint32_t key = t == 0u ? lo : t;
      const double kept = with_mass ? above_mass + CandidateMassFrom(sh, key, hi) : 0.0;
      return Threshold{key, kept};
    }
  }
}

}  // namespace aotinfer
