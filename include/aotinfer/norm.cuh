// Row normalizations over the last dimension: RMSNorm (Gemma's too, weight applied as 1 + w),
// fused residual-add + RMSNorm, and LayerNorm. Memory-bound: each row is read once and written
// once, and weights come from L2.
//
// NormKernel serves the three, a block per row (or per few short rows). A row belongs to
// blockDim.x threads, 128 where the row is long enough (blockDim.y rows share a block when rows
// are short); each thread keeps kItems vectors of kVec elements of its row in registers between
// the reduction and the output. Small blocks with several vectors per thread keep many rows, and
// so many bytes, in flight on each SM while others wait at their reduction (benchmarks/NOTES.md).
// kPrefetchWeights loads the weights beside the row, before the reduction, for small batches where
// latency counts; otherwise they come after, from L1 mostly, since every row of an SM reads the
// same ones. kItems == 0 is the fallback for rows too long for registers: it reads the row again
// for each pass.
// NormStagedKernel serves RMSNorm and LayerNorm over large batches on a short grid: blocks that
// stay resident walk the rows, weights in registers, rows staged through shared memory (see
// there; Norm() at the end chooses).
// LayerNorm sums the values and their squares in the same reduction. Accumulation is in float.
// Vectors are 16 bytes where the hidden size, the row strides and the pointers allow, else one
// element.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

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

// Pass 2 for one vector: normalize, weight (LayerNorm: and shift), round. 16-bit LayerNorm
// normalizes in one FMA, x * scale - shift; its error, |mean| / std times float's epsilon, is far
// below the output's rounding. float32 output would show it when the mean is large against the
// spread, so there the subtractions stay exact.
template <NormKind kKind, typename T, typename W, int kVec>
__device__ __forceinline__ Vec<T, kVec> NormalizeVec(const Vec<T, kVec>& x, const Vec<W, kVec>& w,
                                                      const Vec<W, kVec>& b, const RowNorm& n,
                                                      float weight_offset) {
  constexpr bool kOneFma = kKind == NormKind::kLayer && sizeof(T) == 2;
  const float shift = (n.pivot + n.mean) * n.scale;
  Vec<T, kVec> y;
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    const float v = x.float_again(e);
    if constexpr (kOneFma) {
      y[e] = from_float<T>(fmaf(fmaf(v, n.scale, -shift), to_float(w[e]), to_float(b[e])));
    } else if constexpr (kKind == NormKind::kLayer) {
      y[e] = from_float<T>((v - n.pivot - n.mean) * n.scale * to_float(w[e]) + to_float(b[e]));
    } else {
      y[e] = from_float<T>(v * n.scale * (to_float(w[e]) + weight_offset));
    }
  }
  return y;
}

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
  float2 sums[2] = {};  // (sum, sum of squares) of even and of odd elements
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
        sums[e % 2].y = fmaf(v, v, sums[e % 2].y);
      }
      x[slot].store(res + j * kVec);
    } else {
      SumVec(x[slot], pivot, sums);
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
  const float2 totals = RowSum(make_float2(sums[0].x + sums[1].x, sums[0].y + sums[1].y), shared);
  const RowNorm norm = FinishRow<kKind>(totals, pivot, p.hidden, p.eps);

  // Pass 2: normalize, weight, store.
  auto emit = [&](int slot, int64_t j) {
    if constexpr (!kPrefetchWeights) {
      w[slot].load(p.weight + j * kVec);
      if constexpr (kKind == NormKind::kLayer) b[slot].load(p.bias + j * kVec);
    }
    NormalizeVec<kKind>(x[slot], w[slot], b[slot], norm, p.weight_offset).store_unsplit(out + j * kVec);
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
      NormalizeVec<kKind>(x[k], w[k], b[k], norm, p.weight_offset).store_unsplit(out + k * blockDim.x * kVec);
    }
    stage = stage + 1 == kStages ? 0 : stage + 1;
  }
}

// Launches NormStagedKernel with kItems vectors a thread and kStages stages, as many blocks as fit
// on the GPU at once, if it suits p (*launched says whether it did): the row fits the block
// exactly, rows are evenly spaced, and the grid gives no block more than max_rows_per_block rows.
template <NormKind kKind, typename T, typename W, int kVec, int kItems, int kStages>
cudaError_t LaunchNormStaged(const NormParams<T, W>& p, int64_t max_rows_per_block, cudaStream_t stream, bool pdl,
                             bool* launched) {
  *launched = false;
  const int64_t num_vecs = p.hidden / kVec;
  const int64_t threads = num_vecs / kItems;
  if (threads * kItems != num_vecs || threads % 32 != 0 || threads > kNormCachedThreads ||
      p.input_rows.inner != 1 || p.out_rows.inner != 1) {
    return cudaSuccess;
  }
  const auto kernel = NormStagedKernel<kKind, T, W, kVec, kItems, kStages>;
  const size_t smem = size_t(kStages) * num_vecs * 16;
  int device = 0, sms = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess) status = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (status != cudaSuccess) return status;
  // Blocks an SM, asked once per device and block size (with the shared memory limit raised where
  // needed): the answer never changes, so races are benign. 0: not asked yet.
  static int known_blocks_per_sm[64][kNormCachedThreads / 32 + 1] = {};
  int* known = device >= 0 && device < 64 ? &known_blocks_per_sm[device][threads / 32] : nullptr;
  int blocks_per_sm = known ? *known : 0;
  if (blocks_per_sm == 0) {
    if (smem + sizeof(float2) * 32 > 48 * 1024) {  // past the default, with the static part
      status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    }
    if (status == cudaSuccess) {
      status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, int(threads), smem);
    }
    if (status != cudaSuccess) return status;
    if (known) *known = blocks_per_sm;
  }
  const int64_t grid = std::min<int64_t>(p.num_rows, int64_t(blocks_per_sm) * sms);
  if (grid == 0 || p.num_rows > grid * max_rows_per_block) return cudaSuccess;
  *launched = true;
  return LaunchWithSharedMemory(kernel, dim3(unsigned(grid)), dim3(unsigned(threads)), smem, stream, pdl, p);
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
  // Large batches over a short grid: the staged kernel, which loses the per-row kernel's tail and, with
  // float32 weights on 16-bit rows, their L1 traffic, so it wins over grids twice as long there.
  // Over a long grid the per-row kernel is faster (benchmarks/NOTES.md).
  if constexpr (kKind != NormKind::kFusedAddRMS) {
    if (vectorized && p.num_rows > kNormLatencyRows) {
      const int64_t rows_per_block = kNormStagedRowsPerBlock * (sizeof(W) > sizeof(T) ? 2 : 1);
      bool launched = false;
      const cudaError_t status = LaunchNormStaged<kKind, T, W, kVec, kNormStagedItems, kNormStagedStages>(
          p, rows_per_block, stream, pdl, &launched);
      if (status != cudaSuccess || launched) return status;
    }
  }
  return vectorized ? LaunchNormVec<kKind, T, W, kVec>(p, stream, pdl) : LaunchNormVec<kKind, T, W, 1>(p, stream, pdl);
}

}  // namespace aotinfer
