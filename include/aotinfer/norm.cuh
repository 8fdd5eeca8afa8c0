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

// When a thread loads its weights. kWithRow: beside its rows, before the reduction, so their
// latency hides behind the rows' (costs registers while the rows are in flight). kAfterSum: after
// the reduction, every slot's at once, then the outputs. kPerSlot: one slot at a time beside its
// outputs, the only choice for a streamed row.
enum class WeightLoad { kWithRow, kAfterSum, kPerSlot };

// kRows consecutive rows per thread share each weight load and one reduction.
template <NormKind kKind, typename T, typename W, int kVec, int kItems, int kRows, WeightLoad kWeights>
__global__ void __launch_bounds__(kItems > 0 ? kNormCachedThreads : kNormStreamThreads)
    NormKernel(const NormParams<T, W> p) {
  static_assert(kItems > 0 || (kRows == 1 && kWeights == WeightLoad::kPerSlot), "a streamed row holds nothing");
  __shared__ float2 shared[kNormMaxRowsPerBlock * kRows][32];
  constexpr bool kFused = kKind == NormKind::kFusedAddRMS, kLayer = kKind == NormKind::kLayer;
  const int64_t first_row = (int64_t(blockIdx.x) * blockDim.y + threadIdx.y) * kRows;
  const int64_t num_vecs = p.hidden / kVec;
  bool active[kRows];
  const T* in[kRows];
  T* out[kRows];
  T* res[kRows];  // fused add only
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int64_t row = first_row + i;
    active[i] = row < p.num_rows;
    in[i] = p.input + (active[i] ? p.input_rows.offset(row) : 0);
    out[i] = p.out + (active[i] ? p.out_rows.offset(row) : 0);
    res[i] = kFused ? p.residual + (active[i] ? p.residual_rows.offset(row) : 0) : nullptr;
  }

  WaitForPriorGrids();
  // LayerNorm sums x - pivot and its square in one reduction; shifting by the row's first element
  // keeps E[x^2] - E[x]^2 from cancelling when the mean is large against the spread.
  float pivot[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) pivot[i] = kLayer && active[i] && p.hidden > 0 ? to_float(in[i][0]) : 0.f;

  constexpr int kSlots = kItems > 0 ? kItems : 1;
  Vec<T, kVec> x[kRows][kSlots];
  Vec<T, kVec> r[kFused ? kRows : 1][kSlots];
  Vec<W, kVec> w[kSlots];
  Vec<W, kVec> b[kSlots];
  // Slot k of a register-held row is vector threadIdx.x + k * blockDim.x of the row. Each phase
  // runs over every slot before the next begins, so the compiler issues a phase's loads together.
  // Rows are consecutive, so the first is active when any is.
  auto for_each_slot = [&](auto&& f) {
#pragma unroll
    for (int k = 0; k < kSlots; ++k) {
      const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
      if (active[0] && j < num_vecs) f(k, j);
    }
  };
  auto load_row = [&](int i, int slot, int64_t j) {
    x[i][slot].load(in[i] + j * kVec);
    if constexpr (kFused) r[i][slot].load(res[i] + j * kVec);
  };
  auto load_weights = [&](int slot, int64_t j) {
    w[slot].load(p.weight + j * kVec);
    if constexpr (kLayer) b[slot].load(p.bias + j * kVec);
  };

  // Pass 1: sum (the fused add also writes the new residual). Every load of the rows is issued
  // before the first store: a store the compiler cannot prove apart from a later load would
  // otherwise hold that load back, one vector at a time.
  float2 sums[kRows];  // LayerNorm: sum and sum of squares of x - pivot; RMSNorm: .y only
#pragma unroll
  for (int i = 0; i < kRows; ++i) sums[i] = make_float2(0.f, 0.f);
  auto accumulate = [&](int i, int slot, int64_t j) {
    if constexpr (kFused) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float v = to_float(x[i][slot][e]) + to_float(r[i][slot][e]);
        x[i][slot][e] = from_float<T>(v);
        sums[i].y += v * v;
      }
      x[i][slot].store(res[i] + j * kVec);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float v = to_float(x[i][slot][e]) - pivot[i];
        sums[i].x += v;
        sums[i].y += v * v;
      }
    }
  };
  if constexpr (kItems > 0) {
    for_each_slot([&](int k, int64_t j) {
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        if (active[i]) load_row(i, k, j);
      }
      if constexpr (kWeights == WeightLoad::kWithRow) load_weights(k, j);
    });
    for_each_slot([&](int k, int64_t j) {
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        if (active[i]) accumulate(i, k, j);
      }
    });
  } else if (active[0]) {
    for (int64_t j = threadIdx.x; j < num_vecs; j += blockDim.x) {
      load_row(0, 0, j);
      accumulate(0, 0, j);
    }
  }
  AllowDependentGrids();
  RowSums(sums, shared);
  const float n = float(p.hidden);
  float mean[kRows], scale[kRows];  // LayerNorm: mean of x - pivot; x - mean is (x - pivot) - mean
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    mean[i] = kLayer ? sums[i].x / n : 0.f;
    scale[i] = rsqrtf(fmaxf(sums[i].y / n - mean[i] * mean[i], 0.f) + p.eps);
  }

  // Pass 2: normalize, weight, store.
  auto emit = [&](int i, int slot, int64_t j) {
    Vec<T, kVec> y;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float v = to_float(x[i][slot][e]);
      if constexpr (kLayer) {
        y[e] = from_float<T>((v - pivot[i] - mean[i]) * scale[i] * to_float(w[slot][e]) + to_float(b[slot][e]));
      } else {
        y[e] = from_float<T>(v * scale[i] * (to_float(w[slot][e]) + p.weight_offset));
      }
    }
    y.store(out[i] + j * kVec);
  };
  if constexpr (kItems > 0) {
    if constexpr (kWeights == WeightLoad::kAfterSum) for_each_slot(load_weights);
    for_each_slot([&](int k, int64_t j) {
      if constexpr (kWeights == WeightLoad::kPerSlot) load_weights(k, j);
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        if (active[i]) emit(i, k, j);
      }
    });
  } else if (active[0]) {
    for (int64_t j = threadIdx.x; j < num_vecs; j += blockDim.x) {
      x[0][0].load((kFused ? res[0] : in[0]) + j * kVec);  // the fused add normalizes the new residual
      load_weights(0, j);
      emit(0, 0, j);
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
  const bool with_row = p.num_rows <= kNormLatencyRows && items <= 4;
  constexpr auto kWithRow = WeightLoad::kWithRow, kPerSlot = WeightLoad::kPerSlot;
  switch (items * 2 + with_row) {
    case 2: return Launch(NormKernel<kKind, T, W, kVec, 1, 1, kPerSlot>, grid, block, stream, pdl, p);
    case 3: return Launch(NormKernel<kKind, T, W, kVec, 1, 1, kWithRow>, grid, block, stream, pdl, p);
    case 4: return Launch(NormKernel<kKind, T, W, kVec, 2, 1, kPerSlot>, grid, block, stream, pdl, p);
    case 5: return Launch(NormKernel<kKind, T, W, kVec, 2, 1, kWithRow>, grid, block, stream, pdl, p);
    case 8: return Launch(NormKernel<kKind, T, W, kVec, 4, 1, kPerSlot>, grid, block, stream, pdl, p);
    case 9: return Launch(NormKernel<kKind, T, W, kVec, 4, 1, kWithRow>, grid, block, stream, pdl, p);
    case 16: return Launch(NormKernel<kKind, T, W, kVec, 8, 1, kPerSlot>, grid, block, stream, pdl, p);
    default: return Launch(NormKernel<kKind, T, W, kVec, 0, 1, kPerSlot>, grid, block, stream, pdl, p);
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
