// Row normalizations over the last dimension: RMSNorm (Gemma's too, weight applied as 1 + w),
// fused residual-add + RMSNorm, and LayerNorm. Memory-bound: each row is read once and written
// once, and weights come from L2.
//
// One kernel serves the three. A row belongs to blockDim.x threads, 128 where the row is long
// enough (blockDim.y rows share a block when rows are short); each thread keeps kItems vectors of
// kVec elements of its row in registers between the reduction and the output. Small blocks with
// several vectors per thread keep many rows, and so many bytes, in flight on each SM while
// others wait at their reduction (benchmarks/NOTES.md). kPrefetchWeights loads the weights beside
// the row, before the reduction, for small batches where latency counts; otherwise they come
// after, from L1 mostly, since every row of an SM reads the same ones. LayerNorm sums the values
// and their squares in the same reduction. kItems == 0 is the fallback for rows
// too long for registers: it reads the row again for each pass. Accumulation is in float.
// Vectors are 16 bytes where the hidden size, the row strides and the pointers allow, else one
// element.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

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

template <NormKind kKind, typename T, typename W, int kVec, int kItems, bool kPrefetchWeights>
__global__ void __launch_bounds__(kItems > 0 ? kNormCachedThreads : kNormStreamThreads)
    NormKernel(const NormParams<T, W> p) {
  static_assert(kItems > 0 || !kPrefetchWeights, "a streamed row has no registers to prefetch into");
  __shared__ float2 shared[kNormMaxRowsPerBlock][32];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool active = row < p.num_rows;
  const int64_t num_vecs = p.hidden / kVec;
  const T* in = p.input + (active ? p.input_rows.offset(row) : 0);
  T* out = p.out + (active ? p.out_rows.offset(row) : 0);
  T* res = kKind == NormKind::kFusedAddRMS ? p.residual + (active ? p.residual_rows.offset(row) : 0) : nullptr;
  // The values normalized: the input, or for the fused add the new residual (read back in the
  // streaming path).
  const T* source = kKind == NormKind::kFusedAddRMS ? res : in;

  WaitForPriorGrids();
  // LayerNorm sums x - pivot and its square in one reduction; shifting by the row's first element
  // keeps E[x^2] - E[x]^2 from cancelling when the mean is large against the spread.
  const float pivot = kKind == NormKind::kLayer && active && p.hidden > 0 ? to_float(in[0]) : 0.f;

  // Pass 1: load, then sum (the fused add also writes the new residual). Every load of the row is
  // issued before the first store: a store the compiler cannot prove apart from a later load
  // would otherwise hold that load back, one vector at a time.
  constexpr int kSlots = kItems > 0 ? kItems : 1;
  Vec<T, kVec> x[kSlots];
  Vec<T, kVec> r[kKind == NormKind::kFusedAddRMS ? kSlots : 1];
  Vec<W, kVec> w[kSlots];
  Vec<W, kVec> b[kSlots];
  float sum = 0.f, sum_sq = 0.f;
  auto load = [&](int slot, int64_t j) {
    x[slot].load(in + j * kVec);
    if constexpr (kKind == NormKind::kFusedAddRMS) r[slot].load(res + j * kVec);
  };
  auto accumulate = [&](int slot, int64_t j) {
    if constexpr (kKind == NormKind::kFusedAddRMS) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float v = to_float(x[slot][e]) + to_float(r[slot][e]);
        x[slot][e] = from_float<T>(v);
        sum_sq += v * v;
      }
      x[slot].store(res + j * kVec);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float v = to_float(x[slot][e]) - pivot;
        sum += v;
        sum_sq += v * v;
      }
    }
  };
  if constexpr (kItems > 0) {
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
      if (active && j < num_vecs) {
        load(k, j);
        if constexpr (kPrefetchWeights) {
          w[k].load(p.weight + j * kVec);
          if constexpr (kKind == NormKind::kLayer) b[k].load(p.bias + j * kVec);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
      if (active && j < num_vecs) accumulate(k, j);
    }
  } else if (active) {
    for (int64_t j = threadIdx.x; j < num_vecs; j += blockDim.x) {
      load(0, j);
      accumulate(0, j);
    }
  }
  AllowDependentGrids();
  const float2 totals = RowSum(make_float2(sum, sum_sq), shared);
  const float inv_n = 1.f / float(p.hidden);
  float mean = 0.f, scale;  // LayerNorm: mean of x - pivot; x - mean is (x - pivot) - mean
  if constexpr (kKind == NormKind::kLayer) {
    mean = totals.x * inv_n;
    scale = rsqrtf(fmaxf(totals.y * inv_n - mean * mean, 0.f) + p.eps);
  } else {
    scale = rsqrtf(totals.y * inv_n + p.eps);
  }
  // 16-bit LayerNorm normalizes in one FMA, x * scale - shift; its error, |mean| / std times
  // float's epsilon, is far below the output's rounding. float32 output would show it when the
  // mean is large against the spread, so there the subtractions stay exact.
  constexpr bool kOneFma = kKind == NormKind::kLayer && sizeof(T) == 2;
  const float shift = (pivot + mean) * scale;

  // Pass 2: normalize, weight, store.
  auto emit = [&](int slot, int64_t j) {
    if constexpr (!kPrefetchWeights) {
      w[slot].load(p.weight + j * kVec);
      if constexpr (kKind == NormKind::kLayer) b[slot].load(p.bias + j * kVec);
    }
    Vec<T, kVec> y;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float v = x[slot].float_again(e);
      if constexpr (kOneFma) {
        y[e] = from_float<T>(fmaf(fmaf(v, scale, -shift), to_float(w[slot][e]), to_float(b[slot][e])));
      } else if constexpr (kKind == NormKind::kLayer) {
        y[e] = from_float<T>((v - pivot - mean) * scale * to_float(w[slot][e]) + to_float(b[slot][e]));
      } else {
        y[e] = from_float<T>(v * scale * (to_float(w[slot][e]) + p.weight_offset));
      }
    }
    y.store_unsplit(out + j * kVec);
  };
  if constexpr (kItems > 0) {
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
      if (active && j < num_vecs) emit(k, j);
    }
  } else if (active) {
    for (int64_t j = threadIdx.x; j < num_vecs; j += blockDim.x) {
      x[0].load(source + j * kVec);
      emit(0, j);
    }
  }
}

template <NormKind kKind, typename T, typename W, int kVec>
cudaError_t LaunchNormVec(const NormParams<T, W>& p, cudaStream_t stream, bool pdl) {
  const int64_t num_vecs = p.hidden / kVec;
  // 128 threads a row with 1, 2 or 4 vectors each; longer rows take up to 512 threads of 4 vectors,
  // then of 8; longer still stream.
  int items = 1;
  while (items < 4 && num_vecs > int64_t(items) * kNormRowThreads) items *= 2;
  if (num_vecs > int64_t(4) * kNormCachedThreads) items = kNormMaxItems;
  if (num_vecs > int64_t(kNormMaxItems) * kNormCachedThreads) items = 0;
  int64_t threads = items ? (num_vecs + items - 1) / items : kNormStreamThreads;
  threads = threads < 32 ? 32 : (threads + 31) / 32 * 32;
  const int rows_per_block = threads <= 64 ? int(128 / threads) : 1;
  const dim3 block{unsigned(threads), unsigned(rows_per_block)};
  const dim3 grid{unsigned((p.num_rows + rows_per_block - 1) / rows_per_block)};
  // Weights beside the row only for small batches, bound by latency; for large ones the registers
  // they take cost more rows in flight than their later load costs (benchmarks/NOTES.md).
  const bool prefetch = p.num_rows <= kNormLatencyRows && items <= 4;
  switch (items * 2 + prefetch) {
    case 2: return Launch(NormKernel<kKind, T, W, kVec, 1, false>, grid, block, stream, pdl, p);
    case 3: return Launch(NormKernel<kKind, T, W, kVec, 1, true>, grid, block, stream, pdl, p);
    case 4: return Launch(NormKernel<kKind, T, W, kVec, 2, false>, grid, block, stream, pdl, p);
    case 5: return Launch(NormKernel<kKind, T, W, kVec, 2, true>, grid, block, stream, pdl, p);
    case 8: return Launch(NormKernel<kKind, T, W, kVec, 4, false>, grid, block, stream, pdl, p);
    case 9: return Launch(NormKernel<kKind, T, W, kVec, 4, true>, grid, block, stream, pdl, p);
    case 16: return Launch(NormKernel<kKind, T, W, kVec, 8, false>, grid, block, stream, pdl, p);
    case 17: return Launch(NormKernel<kKind, T, W, kVec, 8, true>, grid, block, stream, pdl, p);
    default: return Launch(NormKernel<kKind, T, W, kVec, 0, false>, grid, block, stream, pdl, p);
  }
}

// Runs norm kKind over p.num_rows rows of p.hidden elements (0 rows: nothing is launched).
template <NormKind kKind, typename T, typename W>
cudaError_t Norm(const NormParams<T, W>& p, cudaStream_t stream, bool pdl) {
  if (p.num_rows == 0 || p.hidden == 0) return cudaSuccess;
  constexpr int kVec = kVec16<T>;
  const bool fused = kKind == NormKind::kFusedAddRMS, layer = kKind == NormKind::kLayer;
  const bool vectorized = p.hidden % kVec == 0 && Aligned16(p.out) && p.out_rows.rows_aligned(kVec) &&
                          Aligned16(p.input) && p.input_rows.rows_aligned(kVec) && Aligned16(p.weight) &&
                          (!fused || (Aligned16(p.residual) && p.residual_rows.rows_aligned(kVec))) &&
                          (!layer || Aligned16(p.bias));
  if (p.num_rows > int64_t(kNormMaxRowsPerBlock) * 0x7fffffff) return cudaErrorInvalidConfiguration;
  return vectorized ? LaunchNormVec<kKind, T, W, kVec>(p, stream, pdl) : LaunchNormVec<kKind, T, W, 1>(p, stream, pdl);
}

}  // namespace aotinfer
