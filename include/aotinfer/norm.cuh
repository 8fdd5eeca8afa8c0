// Row normalizations over the last dimension: RMSNorm (Gemma's too, weight applied as 1 + w),
// fused residual-add + RMSNorm, and LayerNorm. Memory-bound: each row is read once and written
// once, and weights come from L2.
//
// NormKernel serves the three, a block per row (or per few short rows). A row belongs to
// blockDim.x threads (blockDim.y rows share a block when rows are short); each thread keeps kItems
// vectors of kVec elements of its row in registers between the reduction and the output. For
// large batches, rows of 128 threads with several vectors each keep many rows, and so many bytes,
// in flight on each SM while others wait at their reduction; small batches, bound by latency,
// spread a row over more threads (NormItems; docs/design/norm.md#row-shape). kPrefetchWeights loads the
// weights beside the row, before the reduction, for small batches; otherwise they come after, from
// L1 mostly, since every row of an SM reads the same ones. kItems == 0 is the fallback for rows
// too long for registers: it reads the row again for each pass.
// NormStagedKernel serves RMSNorm and LayerNorm over large batches on a short grid: blocks that
// stay resident walk the rows, weights in registers, rows staged through shared memory (see
// there). Norm() at the end chooses: the staged kernel where it applies, else NormKernel.
// LayerNorm sums the values and their squares in the same reduction. Accumulation is in float.
// The fused add normalizes input + residual as summed in float (as FlashInfer does) and rounds
// only the residual it writes back, so its output has one rounding, like the others'.
// Vectors are 16 bytes where the hidden size, the row strides and the pointers allow, else one
// element.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "aotinfer/async_copy.cuh"
#include "aotinfer/launch.cuh"
#include "aotinfer/reduce.cuh"
#include "aotinfer/vec.cuh"

namespace aotinfer {

enum class NormKind { kRMS, kFusedAddRMS, kLayer };

template <typename T, typename W>
struct NormParams {
  T* out;                  // fused add: the input, normalized in place
  RowLayout out_rows;
  const T* input;
  RowLayout input_rows;
  T* residual;             // fused add only: residual += input
  RowLayout residual_rows;
  const W* weight;         // LayerNorm: gamma
  const W* bias;           // LayerNorm: beta
  int64_t hidden;
  int64_t num_rows;
  float eps;
  float weight_offset;     // 1 for Gemma's (1 + weight), else 0
};

constexpr int kNormMaxRowsPerBlock = 4;
// Threads of a row: preferred, most for a row held in registers, and for a row that streams.
constexpr int kNormRowThreads = 128;
constexpr int kNormCachedThreads = 512;
constexpr int kNormStreamThreads = 1024;
constexpr int kNormMaxItems = 8;
constexpr int kNormLatencyRows = 512;  // batches this small are bound by latency, not bandwidth
// NormStagedKernel: vectors a thread, rows in shared memory a block (the one computed and those
// in flight), and the most rows a block walks where it is chosen (see Norm).
constexpr int kNormStagedItems = 4;
constexpr int kNormStagedStages = 3;
constexpr int kNormStagedRowsPerBlock = 8;

// Pass 1 of RMSNorm and LayerNorm for one vector: adds x - pivot and its square to sums, even
// elements to sums[0] and odd ones to sums[1], which halves the chains of dependent adds.
template <typename T, int kVec>
__device__ __forceinline__ void SumVec(const Vec<T, kVec>& x, float pivot, float2 (&sums)[2]) {
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    const float v = x.float_again(e) - pivot;
    sums[e % 2].x += v;
    sums[e % 2].y = fmaf(v, v, sums[e % 2].y);
  }
}

// What pass 2 applies to each element of a row, from the row's two sums.
struct RowNorm {
  float scale;  // 1 / rms, or 1 / std
  float mean;   // LayerNorm: mean of x - pivot
  float pivot;  // LayerNorm: the value the sums were shifted by
};

template <NormKind kKind>
__device__ __forceinline__ RowNorm FinishRow(float2 totals, float pivot, int64_t hidden, float eps) {
  const float inv_n = 1.f / float(hidden);
  if constexpr (kKind == NormKind::kLayer) {
    const float mean = totals.x * inv_n;
    return {rsqrtf(fmaxf(totals.y * inv_n - mean * mean, 0.f) + eps), mean, pivot};
  } else {
    return {rsqrtf(totals.y * inv_n + eps), 0.f, 0.f};
  }
}

// Pass 2 for one vector of x (T, or float for the fused add's sums): normalize, weight (LayerNorm:
// and shift), round to T. 16-bit LayerNorm
// normalizes in one FMA, x * scale - shift; its error, |mean| / std times float's epsilon, is far
// below the output's rounding. float32 output would show it when the mean is large against the
// spread, so there the subtractions stay exact.
template <NormKind kKind, typename T, typename S, typename W, int kVec>
__device__ __forceinline__ Vec<T, kVec> NormalizeVec(const Vec<S, kVec>& x, const Vec<W, kVec>& w,
                                                      const Vec<W, kVec>& b, const RowNorm& n,
                                                      float weight_offset) {
  constexpr bool kOneFma = kKind == NormKind::kLayer && sizeof(T) == 2;
  const float shift = (n.pivot + n.mean) * n.scale;
  return Vec<T, kVec>::from_floats([&](int e) {
    const float v = x.float_again(e);
    if constexpr (kOneFma) {
      return fmaf(fmaf(v, n.scale, -shift), to_float(w[e]), to_float(b[e]));
    } else if constexpr (kKind == NormKind::kLayer) {
      return (v - n.pivot - n.mean) * n.scale * to_float(w[e]) + to_float(b[e]);
    } else {
      return v * fmaf(to_float(w[e]), n.scale, n.scale * weight_offset);
    }
  });
}

// Calls f(slot, j) for each vector j of the row that this thread owns: with kItems > 0, slots 0 to
// kItems - 1 (unrolled), vector threadIdx.x + slot * blockDim.x; with kItems == 0 (a streamed row),
// every blockDim.x-th vector from threadIdx.x, all in slot 0.
template <int kItems, typename F>
__device__ __forceinline__ void ForEachSlot(int64_t num_vecs, F&& f) {
  if constexpr (kItems > 0) {
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
      if (j < num_vecs) f(k, j);
    }
  } else {
    for (int64_t j = threadIdx.x; j < num_vecs; j += blockDim.x) f(0, j);
  }
}

// kEvenRows: every layout has evenly spaced rows (inner == 1), so a row's offset is one multiply;
// the general offset of 3-D rows, branch and division, costs the fused add's kernel 11 registers
// even where it is never taken (docs/design/norm.md#fused-add-rmsnorm).
template <NormKind kKind, typename T, typename W, int kVec, int kItems, bool kPrefetchWeights, bool kEvenRows>
__global__ void __launch_bounds__(kItems > 0 ? kNormCachedThreads : kNormStreamThreads)
    NormKernel(const NormParams<T, W> p) {
  static_assert(kItems > 0 || !kPrefetchWeights, "a streamed row has no registers to prefetch into");
  constexpr bool kFused = kKind == NormKind::kFusedAddRMS;
  constexpr int kSlots = kItems > 0 ? kItems : 1;
  __shared__ float2 shared[kNormMaxRowsPerBlock][32];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  // A row past the end (in the last block of short rows) has no vectors, but its threads still
  // take part in the block's reduction.
  const bool active = row < p.num_rows;
  const int64_t num_vecs = active ? p.hidden / kVec : 0;
  auto offset = [&](const RowLayout& rows) -> int64_t {
    if (!active) return 0;
    return kEvenRows ? row * rows.outer_stride : rows.offset(row);
  };
  const T* in = p.input + offset(p.input_rows);
  // The fused add normalizes in place: p.out is p.input, with its layout.
  T* out = kFused ? const_cast<T*>(in) : p.out + offset(p.out_rows);
  T* res = kFused ? p.residual + offset(p.residual_rows) : nullptr;

  WaitForPriorGrids();
  // LayerNorm sums x - pivot and its square in one reduction; shifting by the row's first element
  // keeps E[x^2] - E[x]^2 from cancelling when the mean is large against the spread.
  const float pivot = kKind == NormKind::kLayer && active ? to_float(in[0]) : 0.f;

  Vec<T, kVec> x[kSlots];
  Vec<T, kVec> r[kFused ? kSlots : 1];
  Vec<float, kVec> total[kFused ? kSlots : 1];  // fused add: input + residual in float, what is normalized
  Vec<W, kVec> w[kSlots], b[kSlots];
  float2 sums[2] = {};  // (sum, sum of squares) of even and of odd elements
  auto load = [&](int slot, int64_t j) {
    x[slot].load(in + j * kVec);
    if constexpr (kFused) r[slot].load(res + j * kVec);
  };
  auto load_weights = [&](int slot, int64_t j) {
    w[slot].load(p.weight + j * kVec);
    if constexpr (kKind == NormKind::kLayer) b[slot].load(p.bias + j * kVec);
  };
  // Fused add: total = input + residual in float, and the new residual, rounded.
  auto add = [&](int slot) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) total[slot][e] = to_float(x[slot][e]) + to_float(r[slot][e]);
    return Vec<T, kVec>::from_floats([&](int e) { return total[slot][e]; });
  };

  // Pass 1: the row's sums. Rows in registers issue every load before the first store (a store
  // the compiler cannot prove apart from a later load would hold that load back) and write the
  // new residual here; a streamed row writes it in pass 2, once the old one was read again.
  auto accumulate = [&](int slot, int64_t j) {
    if constexpr (kItems == 0) load(slot, j);
    if constexpr (kFused) {
      const Vec<T, kVec> rounded = add(slot);
#pragma unroll
      for (int e = 0; e < kVec; ++e) sums[e % 2].y = fmaf(total[slot][e], total[slot][e], sums[e % 2].y);
      if constexpr (kItems > 0) rounded.store(res + j * kVec);
    } else {
      SumVec(x[slot], pivot, sums);
    }
  };
  if constexpr (kItems > 0) {
    ForEachSlot<kItems>(num_vecs, [&](int slot, int64_t j) {
      load(slot, j);
      if constexpr (kPrefetchWeights) load_weights(slot, j);
    });
  }
  ForEachSlot<kItems>(num_vecs, accumulate);
  // The next kernel may launch at the end, not after pass 1: under graph replay at decode sizes
  // that is up to 0.25 us less a call, and never more; bandwidth is the same (docs/design/norm.md#pdl-trigger;
  // norm_decode_variants.cu compares the two by building against a copy with this set to false).
  constexpr bool kTriggerAtEnd = true;
  if constexpr (!kTriggerAtEnd) AllowDependentGrids();
  const float2 totals = RowSum(make_float2(sums[0].x + sums[1].x, sums[0].y + sums[1].y), shared);
  const RowNorm norm = FinishRow<kKind>(totals, pivot, p.hidden, p.eps);

  // Pass 2: normalize, weight, store.
  ForEachSlot<kItems>(num_vecs, [&](int slot, int64_t j) {
    if constexpr (kItems == 0) {
      load(slot, j);
      if constexpr (kFused) add(slot).store(res + j * kVec);
    }
    if constexpr (!kPrefetchWeights) load_weights(slot, j);
    if constexpr (kFused) {
      NormalizeVec<kKind, T>(total[slot], w[slot], b[slot], norm, p.weight_offset).store_unsplit(out + j * kVec);
    } else {
      NormalizeVec<kKind, T>(x[slot], w[slot], b[slot], norm, p.weight_offset).store_unsplit(out + j * kVec);
    }
  });
  if constexpr (kTriggerAtEnd) AllowDependentGrids();
}

// RMSNorm and LayerNorm over many rows, with rows staged through shared memory. A grid that fills
// the GPU once walks the rows (block b takes rows b, b + gridDim.x, ...), so each thread loads its
// weights once and keeps them in registers for every row, instead of reading them from L1 for
// each row (for LayerNorm with float32 gamma and beta, four times the row's bytes, in 32-byte
// pieces a thread that L1 serves at half rate). Each thread copies its kItems vectors of the next
// kStages - 1 rows into shared memory with cp.async, so the bytes in flight cost no registers. A
// thread reads back only what it copied, save LayerNorm's pivot (the row's first element, thread
// 0's); so LayerNorm waits one row ahead: the next row has landed before the reduction's
// barrier, and every thread reads its pivot after that barrier. The launcher takes this kernel
// only where rows are evenly spaced (out_rows and input_rows with inner == 1) and blockDim.x *
// kItems vectors make a row exactly, so that nothing is predicated.
template <NormKind kKind, typename T, typename W, int kVec, int kItems, int kStages>
__global__ void __launch_bounds__(kNormCachedThreads) NormStagedKernel(const NormParams<T, W> p) {
  static_assert(kKind != NormKind::kFusedAddRMS && kVec * sizeof(T) == 16 && kStages >= 3);
  extern __shared__ uint4 staged[];  // [kStages][kItems * blockDim.x] vectors: rows as they lie in memory
  __shared__ float2 shared[1][32];
  constexpr bool kLayer = kKind == NormKind::kLayer;
  const int row_vecs = kItems * blockDim.x;
  const int64_t in_stride = p.input_rows.outer_stride, out_stride = p.out_rows.outer_stride;

  WaitForPriorGrids();
  Vec<W, kVec> w[kItems], b[kItems];
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int j = threadIdx.x + k * blockDim.x;
    w[k].load(p.weight + j * kVec);
    if constexpr (kLayer) b[k].load(p.bias + j * kVec);
  }
  // Row `row` into stage `stage`; one commit group a row, empty past the end.
  auto fetch = [&](int64_t row, int stage) {
    if (row < p.num_rows) {
      const T* in = p.input + row * in_stride + threadIdx.x * kVec;
      uint4* to = staged + stage * row_vecs + threadIdx.x;
#pragma unroll
      for (int k = 0; k < kItems; ++k) CopyAsync16(to + k * blockDim.x, in + k * blockDim.x * kVec);
    }
    CommitAsyncGroup();
  };
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) fetch(blockIdx.x + int64_t(i) * gridDim.x, i);
  if constexpr (kLayer) {
    WaitAsyncGroups<kStages - 2>();
    __syncthreads();
  }
  AllowDependentGrids();

  int stage = 0;
  for (int64_t row = blockIdx.x; row < p.num_rows; row += gridDim.x) {
    fetch(row + int64_t(kStages - 1) * gridDim.x, stage == 0 ? kStages - 1 : stage - 1);
    WaitAsyncGroups<kLayer ? kStages - 2 : kStages - 1>();
    const uint4* from = staged + stage * row_vecs;
    const float pivot = kLayer ? to_float(*reinterpret_cast<const T*>(from)) : 0.f;
    Vec<T, kVec> x[kItems];
    float2 sums[2] = {};
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      x[k].load(reinterpret_cast<const T*>(from + threadIdx.x + k * blockDim.x));
      SumVec(x[k], pivot, sums);
    }
    const float2 totals = RowSum(make_float2(sums[0].x + sums[1].x, sums[0].y + sums[1].y), shared);
    const RowNorm norm = FinishRow<kKind>(totals, pivot, p.hidden, p.eps);
    T* out = p.out + row * out_stride + threadIdx.x * kVec;
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      NormalizeVec<kKind, T>(x[k], w[k], b[k], norm, p.weight_offset).store_unsplit(out + k * blockDim.x * kVec);
    }
    stage = stage + 1 == kStages ? 0 : stage + 1;
  }
}

// The grid that NormStagedKernel<..., kItems, kStages> takes for p, or 0 where it does not apply:
// it applies where rows are evenly spaced, a row fills blockDim.x * kItems vectors exactly (at most
// kNormCachedThreads threads), and as many blocks as fit on `device` at once give none more than
// max_rows_per_block rows.
template <NormKind kKind, typename T, typename W, int kVec, int kItems, int kStages>
int64_t NormStagedGrid(const NormParams<T, W>& p, int64_t max_rows_per_block, int device) {
  const int64_t num_vecs = p.hidden / kVec;
  const int64_t threads = num_vecs / kItems;
  if (threads * kItems != num_vecs || threads % 32 != 0 || threads > kNormCachedThreads ||
      p.input_rows.inner != 1 || p.out_rows.inner != 1) {
    return 0;
  }
  const int blocks_per_sm = BlocksPerSm<NormStagedKernel<kKind, T, W, kVec, kItems, kStages>>(
      int(threads), size_t(kStages) * num_vecs * 16, device);
  const int64_t grid = std::min<int64_t>(p.num_rows, int64_t(blocks_per_sm) * GetDeviceFacts(device).sms);
  return grid > 0 && p.num_rows <= grid * max_rows_per_block ? grid : 0;
}

// Calls f(std::integral_constant<int, kItems>, std::bool_constant<kPrefetchWeights>) for the
// NormKernel instance of `items` vectors a thread (1, 2, 4, 8, or 0: streamed) and `prefetch`
// (with 1, 2 or 4 items only).
template <typename F>
cudaError_t DispatchNormItems(int items, bool prefetch, F&& f) {
  using std::bool_constant;
  using std::integral_constant;
  switch (items) {
    case 1: return prefetch ? f(integral_constant<int, 1>{}, bool_constant<true>{}) : f(integral_constant<int, 1>{}, bool_constant<false>{});
    case 2: return prefetch ? f(integral_constant<int, 2>{}, bool_constant<true>{}) : f(integral_constant<int, 2>{}, bool_constant<false>{});
    case 4: return prefetch ? f(integral_constant<int, 4>{}, bool_constant<true>{}) : f(integral_constant<int, 4>{}, bool_constant<false>{});
    case 8: return f(integral_constant<int, 8>{}, bool_constant<false>{});
    default: return f(integral_constant<int, 0>{}, bool_constant<false>{});
  }
}

// Vectors a thread of NormKernel for rows of num_vecs vectors (0: the row streams). Large batches
// are bound by bandwidth: 128 threads a row with 1, 2 or 4 vectors each, longer rows up to 512
// threads of 4 vectors, then of 8, keep many rows in flight on each SM while others wait at their
// reduction. Small batches are bound by latency: the fewest vectors a thread that keep a row
// within kNormCachedThreads threads (docs/design/norm.md#row-shape).
inline int NormItems(int64_t num_vecs, int64_t num_rows) {
  int items = 1;
  if (num_rows <= kNormLatencyRows) {
    while (items < 4 && num_vecs > int64_t(items) * kNormCachedThreads) items *= 2;
  } else {
    while (items < 4 && num_vecs > int64_t(items) * kNormRowThreads) items *= 2;
  }
  if (num_vecs > int64_t(4) * kNormCachedThreads) items = kNormMaxItems;
  if (num_vecs > int64_t(kNormMaxItems) * kNormCachedThreads) items = 0;
  return items;
}

// NormKernel over p: a block a row (a few rows for short ones), kVec elements a vector.
template <NormKind kKind, typename T, typename W, int kVec>
cudaError_t LaunchNormKernel(const NormParams<T, W>& p, cudaStream_t stream, bool pdl) {
  const int64_t num_vecs = p.hidden / kVec;
  const int items = NormItems(num_vecs, p.num_rows);
  int64_t threads = items ? (num_vecs + items - 1) / items : kNormStreamThreads;
  threads = threads < 32 ? 32 : (threads + 31) / 32 * 32;
  const int rows_per_block = threads <= 64 ? int(128 / threads) : 1;
  const dim3 block{unsigned(threads), unsigned(rows_per_block)};
  const dim3 grid{unsigned((p.num_rows + rows_per_block - 1) / rows_per_block)};
  // Weights beside the row only for small batches, bound by latency; for large ones the registers
  // they take cost more rows in flight than their later load costs (docs/design/norm.md#weights).
  const bool prefetch = p.num_rows <= kNormLatencyRows && items >= 1 && items <= 4;
  const bool even = p.input_rows.inner == 1 && p.out_rows.inner == 1 &&
                    (kKind != NormKind::kFusedAddRMS || p.residual_rows.inner == 1);
  return DispatchNormItems(items, prefetch, [&](auto kItems, auto kPrefetch) {
    // Rows of single elements (unaligned) take the general offset only: they are slow anyway.
    if (kVec > 1 && even) return Launch(NormKernel<kKind, T, W, kVec, kItems, kPrefetch, true>, grid, block, stream, pdl, p);
    return Launch(NormKernel<kKind, T, W, kVec, kItems, kPrefetch, false>, grid, block, stream, pdl, p);
  });
}

// Runs norm kKind over p.num_rows rows of p.hidden elements on `device`, the current device (0 rows:
// nothing is launched). Large batches over a short grid take the staged kernel where it applies,
// since it loses the per-row kernel's tail and, with float32 weights on 16-bit rows, their L1
// traffic, so it wins over grids twice as long there; otherwise the per-row kernel, which is
// faster over long grids (docs/design/norm.md#staged-kernel). The fused add writes its rows twice and always
// takes the per-row kernel.
template <NormKind kKind, typename T, typename W>
cudaError_t Norm(const NormParams<T, W>& p, int device, cudaStream_t stream, bool pdl) {
  if (p.num_rows == 0 || p.hidden == 0) return cudaSuccess;
  if (p.num_rows > int64_t(kNormMaxRowsPerBlock) * 0x7fffffff) return cudaErrorInvalidConfiguration;
  constexpr int kVec = kVec16<T>;
  constexpr bool kFused = kKind == NormKind::kFusedAddRMS;
  const bool vectorized = p.hidden % kVec == 0 && Aligned16(p.out) && p.out_rows.rows_aligned(kVec) &&
                          Aligned16(p.input) && p.input_rows.rows_aligned(kVec) && Aligned16(p.weight) &&
                          (!kFused || (Aligned16(p.residual) && p.residual_rows.rows_aligned(kVec))) &&
                          (kKind != NormKind::kLayer || Aligned16(p.bias));
  if (!vectorized) return LaunchNormKernel<kKind, T, W, 1>(p, stream, pdl);
  if constexpr (!kFused) {
    if (p.num_rows > kNormLatencyRows) {
      constexpr int kItems = kNormStagedItems, kStages = kNormStagedStages;
      const int64_t max_rows_per_block = kNormStagedRowsPerBlock * (sizeof(W) > sizeof(T) ? 2 : 1);
      const int64_t grid = NormStagedGrid<kKind, T, W, kVec, kItems, kStages>(p, max_rows_per_block, device);
      if (grid > 0) {
        const int64_t num_vecs = p.hidden / kVec;
        return LaunchWithSharedMemory(NormStagedKernel<kKind, T, W, kVec, kItems, kStages>, dim3(unsigned(grid)),
                                      dim3(unsigned(num_vecs / kItems)), size_t(kStages) * num_vecs * 16, stream,
                                      pdl, p);
      }
    }
  }
  return LaunchNormKernel<kKind, T, W, kVec>(p, stream, pdl);
}

}  // namespace aotinfer
