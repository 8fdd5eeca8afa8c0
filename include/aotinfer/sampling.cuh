// Sampling from probabilities and logits without sorting the vocabulary: top-k, top-p, min-p and
// their combinations, the top-k / top-p renormalizations and top-k masking of logits (softmax is
// in softmax.cuh; the row kernels' blocks, reads and launches in rows.cuh).
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

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>

#include "aotinfer/async_copy.cuh"
#include "aotinfer/launch.cuh"
#include "aotinfer/rows.cuh"
#include "aotinfer/vec.cuh"

namespace aotinfer {

constexpr int kSamplingWarps = kRowThreads / 32;
static_assert(kSamplingWarps == 32, "block scans give each warp's total to one lane");
constexpr int kSamplingBins = 4096;    // 12 bits of the key per histogram level
constexpr int kCandidates = 8192;      // elements of the threshold's bin sorted in shared memory
constexpr int kSortedCandidates = 2048;  // candidates sorted rather than searched by histograms
constexpr int kTopPDraws = 4;          // top-p's draws from the whole row, verified (DrawTopP)
constexpr int kWindowKeys = 2 * kCandidates;  // keys the top-p renorm's first pass may gather (TopPWindow) ...
constexpr int kOwnWindowKeys = 14;             // ... in each thread's own slots, then in a pool the block shares
constexpr int kPooledWindowKeys = kWindowKeys - kOwnWindowKeys * kRowThreads;

// ---- Philox4x32-10 --------------------------------------------------------------------------------

__device__ __forceinline__ uint4 Philox4x32(uint4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
    const uint32_t lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

// The random stream of one output row: four 32-bit words per group of four elements.
struct RowRandom {
  uint32_t seed_lo, seed_hi, row, offset_lo, offset_hi;

  __device__ __forceinline__ uint4 group(int64_t group_index) const {
    return Philox4x32(make_uint4(uint32_t(group_index), row, offset_lo, offset_hi ^ uint32_t(group_index >> 32)),
                      seed_lo, seed_hi);
  }
  __device__ __forceinline__ uint32_t word(int64_t index) const {
    const uint4 r = group(index >> 2);
    const int lane = int(index & 3);
    return lane == 0 ? r.x : lane == 1 ? r.y : lane == 2 ? r.z : r.w;
  }
};

// E ~ Exp(1) from 32 random bits: -log(1 - d), d uniform in (0, 1) on a 2^-24 grid. The race is
// decided by the small E (d near 0), where the hardware's log2 of 1 - d loses its relative
// accuracy, so d < 1/16 takes the series d + d^2/2 + ... + d^5/5 instead; both keep E within a few
// 1e-6 of its value, relatively.
__device__ __forceinline__ float Exponential(uint32_t bits) {
  const float d = (float(bits >> 8) + 0.5f) * (1.0f / 16777216.0f);
  if (d < 0.0625f) return d * (1.f + d * (0.5f + d * (1.f / 3.f + d * (0.25f + d * 0.2f))));
  return -0.69314718f * __log2f(1.f - d);
}

// A uniform in (0, 1) from 64 random bits, on a 2^-53 grid.
__device__ __forceinline__ double Uniform53(uint32_t hi, uint32_t lo) {
  const uint64_t bits = (uint64_t(hi) << 32 | lo) >> 11;
  return (double(bits) + 0.5) * (1.0 / 9007199254740992.0);
}

// The Philox group of a row's draws that are not tied to an element (elements use groups below 2^62).
constexpr int64_t kDrawGroup = int64_t(1) << 62;

// ---- keys: the bit patterns that order like the values --------------------------------------------

// Probabilities: the float's bits; only positive finite values take part (0 for the rest).
__device__ __forceinline__ uint32_t ProbKey(float p) {
  return (p > 0.f && p <= FLT_MAX) ? __float_as_uint(p) : 0u;
}
// Logits: every non-NaN float, negatives flipped so that the unsigned order is the float order (0
// for NaN, below -inf's key).
__device__ __forceinline__ uint32_t LogitKey(float x) {
  if (x != x) return 0u;
  const uint32_t bits = __float_as_uint(x);
  return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}
__device__ __forceinline__ float LogitFromKey(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? key & 0x7FFFFFFFu : ~key);
}

// The mass of a bin of probabilities as an exact integer: the mantissa (with its implicit bit) in
// units of the exponent's last place. Bins never span exponents, so one scale converts the sum.
__device__ __forceinline__ uint32_t MantissaOf(uint32_t key) {
  return (key & 0x7FFFFFu) | ((key & 0x7F800000u) ? 0x800000u : 0u);
}
// The sums are kept as two 32-bit halves (12 bits each, so a bin of 2^20 elements cannot overflow).
__device__ __forceinline__ double MassOf(uint32_t hi_sum, uint32_t lo_sum, uint32_t any_key_of_bin) {
  const int exponent = int((any_key_of_bin >> 23) & 0xFF);
  const int scale = (exponent ? exponent : 1) - 150;  // value = mantissa * 2^scale
  const double mantissa_sum = double(hi_sum) * 4096.0 + double(lo_sum);  // exact: < 2^53
  return mantissa_sum * __longlong_as_double(int64_t(scale + 1023) << 52);
}

// ---- block-wide reductions ----------------------------------------------------------------------

struct Best {  // the race's leader: the largest key, the lower index on ties
  float key;
  int index;
};
__device__ __forceinline__ Best Better(Best a, Best b) {
  return (b.key > a.key || (b.key == a.key && b.index < a.index)) ? b : a;
}

struct SamplingShared {
  uint32_t count[kSamplingBins];           // histogram: elements per bin ...
  uint32_t mass_hi[kSamplingBins];         // ... and the sums of their mantissas' top and low 12
  uint32_t mass_lo[kSamplingBins];         // bits (32-bit atomics: 64-bit ones are loops); after the scan:
  uint32_t cum_count[kSamplingBins];       // elements in this bin and above
  double cum_mass[kSamplingBins];          // mass of this bin and above
  union {
    struct {
      uint32_t cand_key[kCandidates];
      int cand_index[kCandidates];
    };
    uint32_t window_keys[kWindowKeys];     // the top-p renormalization's keys gathered beside its histogram
  };
  double scratch_d[kSamplingWarps];
  float scratch_f[kSamplingWarps];
  int scratch_i[kSamplingWarps];
  int num_candidates;
  int sorted_count;                        // num_candidates when last sorted; -1 after a gather
  int found;                               // a bin or position found by a block-wide search
  float part_value;                        // this block's share of a row-wide reduction
  unsigned long long part_sum;
  double part_double;
  Best part_best;
  // Top-p's verified draws (DrawTopP): each draw's chunk, its mass left to walk in that chunk, its
  // element and key; the row's mass; the sums of the verifying pass, by warp, then by block.
  int draw_chunk[kTopPDraws];
  double draw_left[kTopPDraws];
  int draw_index[kTopPDraws];
  uint32_t draw_key[kTopPDraws];
  double draw_row_mass;
  double verify_warp[kTopPDraws + 1][kSamplingWarps];
  double verify_part[kTopPDraws + 1];
};

// `v` combined by `op` over the block, in every thread: each warp's result goes through
// `scratch` (one slot a warp: kSamplingWarps == 32, one a lane), then the warps' results combine.
template <typename T, typename Op>
__device__ __forceinline__ T BlockReduce(T v, T* scratch, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[threadIdx.x % 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  return v;
}

__device__ __forceinline__ float BlockMax(float v, SamplingShared& sh) {
  return BlockReduce(v, sh.scratch_f, [](float a, float b) { return fmaxf(a, b); });
}

__device__ __forceinline__ float BlockSum(float v, SamplingShared& sh) {
  return BlockReduce(v, sh.scratch_f, [](float a, float b) { return a + b; });
}

__device__ __forceinline__ Best BlockBest(Best b, SamplingShared& sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    b = Better(b, Best{__shfl_xor_sync(0xffffffffu, b.key, o), __shfl_xor_sync(0xffffffffu, b.index, o)});
  }
  if (threadIdx.x % 32 == 0) {
    sh.scratch_f[threadIdx.x / 32] = b.key;
    sh.scratch_i[threadIdx.x / 32] = b.index;
  }
  __syncthreads();
  b = Best{sh.scratch_f[threadIdx.x % 32], sh.scratch_i[threadIdx.x % 32]};
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    b = Better(b, Best{__shfl_xor_sync(0xffffffffu, b.key, o), __shfl_xor_sync(0xffffffffu, b.index, o)});
  }
  __syncthreads();
  return b;
}

// Row-wide reductions: each block's result, merged in part order (the same for every split).
__device__ __forceinline__ float RowMax(float v, SamplingShared& sh) {
  v = BlockMax(v, sh);
  if (threadIdx.x == 0) sh.part_value = v;
  SyncRow();
  for (int r = 0; r < RowParts(); ++r) v = fmaxf(v, *PartShared(&sh.part_value, r));
  SyncRow();
  return v;
}
__device__ __forceinline__ float RowSum(float v, SamplingShared& sh) {
  v = BlockSum(v, sh);
  if (threadIdx.x == 0) sh.part_value = v;
  SyncRow();
  v = 0.f;
  for (int r = 0; r < RowParts(); ++r) v += *PartShared(&sh.part_value, r);
  SyncRow();
  return v;
}
// The sum of doubles over the row, in a fixed order (the same on every run), valid in every thread.
__device__ __forceinline__ double RowSumDouble(double v, SamplingShared& sh) {
  v = BlockReduce(v, sh.scratch_d, [](double a, double b) { return a + b; });
  if (threadIdx.x == 0) sh.part_double = v;
  SyncRow();
  v = 0;
  for (int r = 0; r < RowParts(); ++r) v += *PartShared(&sh.part_double, r);
  SyncRow();
  return v;
}

// The race's winner over the row (valid in every thread).
__device__ __forceinline__ Best RowBest(Best b, SamplingShared& sh) {
  b = BlockBest(b, sh);
  if (threadIdx.x == 0) sh.part_best = b;
  SyncRow();
  for (int r = 0; r < RowParts(); ++r) b = Better(b, *PartShared(&sh.part_best, r));
  SyncRow();
  return b;
}

// Exclusive prefix sum of doubles over the block in thread order (a fixed order: deterministic).
__device__ __forceinline__ double BlockExclusiveSum(double v, SamplingShared& sh) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  double incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const double other = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += other;
  }
  if (lane == 31) sh.scratch_d[warp] = incl;
  __syncthreads();
  // The warps' totals, scanned the same way by every warp (kSamplingWarps == 32 lanes).
  double warps_incl = sh.scratch_d[lane];
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const double other = __shfl_up_sync(0xffffffffu, warps_incl, o);
    if (lane >= o) warps_incl += other;
  }
  const double below = __shfl_sync(0xffffffffu, warps_incl, (warp + 31) % 32);
  const double warp_base = warp == 0 ? 0.0 : below;
  __syncthreads();
  return warp_base + incl - v;
}

// The four 32-bit words at `local` (a 16-byte aligned address in this block's shared memory) in
// block `part`'s shared memory: one 16-byte load through the cluster's shared window (the form
// measured; PartShared's generic address would make it a generic load).
__device__ __forceinline__ uint4 PartShared16(const void* local, int part) {
  uint4 v = make_uint4(0, 0, 0, 0);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t address = uint32_t(__cvta_generic_to_shared(local));
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(address), "r"(part));
  asm volatile("ld.shared::cluster.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(remote) : "memory");
#endif
  return v;
}

// ---- the threshold search -------------------------------------------------------------------------

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
// searched kernel's code by 1-2%. (Warp-aggregated adds, __match_any_sync on the bin and one
// atomic per distinct bin, were 2-7x slower on the H200, and four interleaved copies of the counts
// (lane % 4) 7-44% slower; see NOTES.)
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
// its code moved the kernels of unsplit rows, which never stage (top_k_renorm 256 x 32000 +8%;
// H100, NOTES).
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
// value ran 6.6-7.2x slower than flat rows; H100, NOTES). Exact: the sums are integers.
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
  // 4-byte generic loads (as the other threads still do), half of them remote, they took a split
  // row's scan 6.2 us against 0.9 for a whole row; staged, top_p_renorm at 64 rows is 4-7% faster
  // (H100, NOTES).
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
  // warp's instructions, and in shared memory with all the block it took ~0.2 us a step whatever
  // the size (H100, NOTES). Padded past n with key 0, index INT32_MAX (last in the order).
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

// Top-k's candidates from a sample. The elements of a row at or above the sample's r-th largest
// hold the k-th largest where fewer than r sampled elements lie above it, which r = lambda +
// 4 sqrt(lambda) + 6 (lambda = k times the sampled fraction, the expected number) makes all but
// certain (a Poisson tail < 1e-6); they number about r / (the sampled fraction), which must fit
// kCandidates. So one pass gathers them, with no histogram of the row; where the gather misses (too
// few, or too many to hold), the caller takes its histogram path instead, so the result never
// depends on the sample, only the time.
constexpr int kFloorSample = kRowThreads;  // elements sampled, one a thread (SamplePosition)
constexpr int kMaxFloorRank = 32;               // ranks the merge below takes
// Shorter rows keep the histogram path. The samplers take the floor from 16384 (vocab 32000 and
// 50000: 5-21% faster at 256-1024 rows, within 1-3% at 16-64; H100, NOTES), the top-k renorm from
// 40960 and the mask from 65536: at 1024 x 32000 the floor cost the renorm 4% and the mask 10%.
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
// pass is GatherCandidates' with one test a key instead of three: sharing its code cost the floor's
// kernels 1.5-3% and moved the others' SASS (H200, NOTES). kEvictFirst: ForEachGroup's, for the
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
    // there cost flat rows 7-9% (H100, NOTES).
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

// ---- parameters --------------------------------------------------------------------------------------

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
// and pass then start in L2. On an H100 at 256-1024 rows: top_k, top_k_top_p and joint 0-4% faster on
// flat rows, 1-8% on peaked ones; 128 KB gained a little less. The renorm and the mask, whose pass
// also writes the row, ran 1-8% slower with it (NOTES).
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

// ---- sampling ---------------------------------------------------------------------------------------

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
// the block and no merge of the row's blocks (on an H100: 3.5-5 us a row, against 6.5-7.5 us and
// 2 us for the merge). Its loops stay rolled: a warp runs it once a row, each phase of a few dozen
// instructions takes about 1 us, and unrolled it ran no faster (NOTES). Call from a whole warp;
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
// compiled into the others, the call changed their SASS, and min-p and top-p measured 2-12%
// slower in one call; NOTES.)
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

// ---- top-p alone: draws from the whole row, verified ----------------------------------------------

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
  // The row's last read (evict-first, as the samplers' one-pass reads: 1-3% faster at 64-1024 rows
  // of 128256 and 262144 on an H100; NOTES).
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

// ---- top-k first from logits --------------------------------------------------------------------

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

// The shortcuts a sampling kernel is built with: template parameters rather than flags, because
// their code costs the kernel's other paths (beside the sampled floor, top-p alone ran 5-11% slower
// on the H200; NOTES). The launcher chooses:
// - kSampledFloor: top-k gathers its candidates above a sampled floor in its first pass (the top-k
//   filters on rows of kSampledFloorMinVocab or more; see SampledFloorRank);
// - kTopPDraws: top-p alone draws from the whole row and verifies (DrawTopP);
// - kLogitsFloor: kSampledFloor's kernel reading logits, top-k first (CandidatesToProbabilities),
//   its own instance so that the probabilities' kernel keeps its registers (with the logits' code
//   in it, its spills grew from 32 to 40 bytes and top_k_top_p ran 1-4% slower at batch 64);
// - kChunkDraw: no filter, from probabilities: one draw by the row's chunk masses (DrawByChunks),
//   a pass of sums, in place of the race's random number and logarithm an element, which bound it
//   by arithmetic at large batches (H100: 1024 x 128256 316 -> 215 us, 64 x 32000 15.6 -> 14.7; a
//   lone row of 32000, split eight ways, 11.1 -> 12.4 in one call, within the rounds' spread in
//   another, so no rule keeps the race for small shares of a row; NOTES).
enum class Shortcut { kNone, kSampledFloor, kTopPDraws, kLogitsFloor, kChunkDraw };

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
        // 2. Top-p alone: one more pass gathers the threshold's bin. The kept set is the bins above
        // (mass A, known now) and the gathered elements at or above t (mass K, known after the pass).
        // The draw comes from above with probability A / (A + K), and then from the bin that one
        // uniform picks by the bins' exact masses: by a race among that bin's elements in the pass
        // (one bin rather than every kept element: top-p keeps most of a flat row), or, where the bin
        // is dense, by rejection after the pass (DrawByRejection), with no random numbers in the pass.
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

// ---- renormalization and masking -------------------------------------------------------------------

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
// than half the budget lie above. (On an H100, top_p 0.9, the window held the threshold's bin for
// 83-93% of the rows of 128256, softmax(randn) and softmax(3 randn), and 46-60% of those of 262144.)
constexpr int64_t kTopPWindowMinVocab = 64 * kFloorSample;
constexpr float kTopPWindowBudget = 12000.f;  // elements expected in the window (at most an eighth of the row)

struct KeyWindow {
  uint32_t lo, hi;  // keys [lo, hi]; empty where lo > hi
};

// Every thread of the row's blocks calls it with its SampledValue; each block computes the same
// window from the whole sample, alone. The sample's histogram takes one level-0 bin a thread, from
// the sample's largest bin down (a 4096-bin histogram and its scan cost a row 5.7 us on an H100).
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
// ballots and one atomic made the pass 10-14% slower on an H100, NOTES.) `own`: this thread's
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

// ---- launchers ------------------------------------------------------------------------------------

// Rows searched by histograms merge the level-0 histogram across the blocks of a split through
// distributed shared memory, and every block then gets all the gathered candidates and searches
// them alone. On the H200 at vocab 128256 (top-k + top-p, top-p, top-k): 2 blocks a row gave
// 46 / 65 / 35 us at batch 1 against 53 / 87 / 44 unsplit, 50 / 66 / 41 at batch 64 against
// 55 / 88 / 47; 4 blocks no better than 2. (Merging every candidate level across blocks instead
// had made the split slower than one block.)
constexpr int kSearchRowParts = 2;
// The renormalizations and the mask: the same (their shortcuts share candidates as the samplers
// do; their fallback, FindThreshold, merges every level across the blocks, slower but rare).
constexpr int kThresholdRowParts = kSearchRowParts;
// The searched rows' blocks at every batch (1: split only where the batch leaves SMs idle). 2 at
// every batch was measured at vocab 128256: 1.8-2x slower at batch 256 (the fixed costs of a
// row's search paid twice, and twice the blocks).
constexpr int kSearchMinRowParts = 1;

inline cudaError_t Sample(SamplingParams p, int device, cudaStream_t stream, bool pdl) {
  p.ahead = GetDeviceFacts(device).sms;
  const bool race_only = p.filter == Filter::kNone || p.filter == Filter::kMinP;
  const bool aligned = RowsAligned<float>(p.probs, p.row_stride);
  const int max_parts = race_only ? kMaxRowParts : kSearchRowParts, min_parts = race_only ? 1 : kSearchMinRowParts;
  // Min-p's second pass reads the L2 where the rows fit it: there a gather in the first pass costs
  // more than it saves (H200, peaked rows of 128256: batch 1-64; NOTES). Top-k's gather above a
  // sampled floor gains at every batch; only the top-k filters take the kernel with it (the others
  // ran 2-5% slower in it), and rows not 16-byte aligned take the scalar kernel, which has none.
  p.gather_min_p = p.batch * p.vocab * int64_t(sizeof(float)) > int64_t(GetDeviceFacts(device).l2_bytes);
  const bool top_k_filter = p.filter == Filter::kTopK || p.filter == Filter::kTopKFirst || p.filter == Filter::kJoint;
  constexpr auto kScalarKernel = SamplingKernel<1, Shortcut::kNone>;
  constexpr size_t kShared = sizeof(SamplingShared);
  // From logits (top-k first; the binding allows no other filter): its own floor kernel at every
  // vocabulary, which holds the path where the floor does not apply.
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
// they fit it, and at vocabularies under 65536, it cost more than the pass it saves (H100, NOTES).
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
