// Row normalizations over the last dimension: RMSNorm (Gemma's too, weight applied as 1 + w),
// fused residual-add + RMSNorm, and LayerNorm. Memory-bound: each row is read once and written
// once, and weights come from L2.
//
// One kernel serves the three. A row belongs to blockDim.x threads (blockDim.y rows share a
// block when rows are short); each thread keeps kItems vectors of kVec elements of its row in
// registers between the reduction and the output, loading the weights beside them so that their
// latency overlaps. kItems == 0 is the fallback for rows too long for registers: it reads the row
// again for each pass. Accumulation is in float. Vectors are 16 bytes where the hidden size, the
// row strides and the pointers allow, else one element.
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
// Threads of a row that holds its values in registers, and of one that streams.
constexpr int kNormCachedThreads = 512;
constexpr int kNormStreamThreads = 1024;

template <NormKind kKind, typename T, typename W, int kVec, int kItems>
__global__ void __launch_bounds__(kItems > 0 ? kNormCachedThreads : kNormStreamThreads)
    NormKernel(const NormParams<T, W> p) {
  __shared__ float shared[kNormMaxRowsPerBlock][32];
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

  // Pass 1: load (the fused add also writes the residual) and sum.
  constexpr int kSlots = kItems > 0 ? kItems : 1;
  Vec<T, kVec> x[kSlots];
  Vec<W, kVec> w[kSlots];
  Vec<W, kVec> b[kSlots];
  float sum = 0.f;
  auto load = [&](int slot, int64_t j) {
    x[slot].load(in + j * kVec);
    if constexpr (kKind == NormKind::kFusedAddRMS) {
      Vec<T, kVec> r;
      r.load(res + j * kVec);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float v = to_float(x[slot][e]) + to_float(r[e]);
        x[slot][e] = from_float<T>(v);
        sum += v * v;
      }
      x[slot].store(res + j * kVec);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float v = to_float(x[slot][e]);
        sum += kKind == NormKind::kLayer ? v : v * v;
      }
    }
  };
  if constexpr (kItems > 0) {
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
      if (active && j < num_vecs) {
        load(k, j);
        w[k].load(p.weight + j * kVec);
        if constexpr (kKind == NormKind::kLayer) b[k].load(p.bias + j * kVec);
      }
    }
  } else if (active) {
    for (int64_t j = threadIdx.x; j < num_vecs; j += blockDim.x) load(0, j);
  }
  AllowDependentGrids();
  const float total = RowSum(sum, shared);

  // LayerNorm: the variance around the mean, from the registers (or a second read).
  float mean = 0.f, scale;
  if constexpr (kKind == NormKind::kLayer) {
    mean = total / float(p.hidden);
    float squares = 0.f;
    auto add_squares = [&](const Vec<T, kVec>& v) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float d = to_float(v[e]) - mean;
        squares += d * d;
      }
    };
    if constexpr (kItems > 0) {
#pragma unroll
      for (int k = 0; k < kItems; ++k) {
        if (active && threadIdx.x + int64_t(k) * blockDim.x < num_vecs) add_squares(x[k]);
      }
    } else if (active) {
      for (int64_t j = threadIdx.x; j < num_vecs; j += blockDim.x) {
        x[0].load(in + j * kVec);
        add_squares(x[0]);
      }
    }
    scale = rsqrtf(RowSum(squares, shared) / float(p.hidden) + p.eps);
  } else {
    scale = rsqrtf(total / float(p.hidden) + p.eps);
  }

  // Pass 2: normalize, weight, store.
  auto emit = [&](int slot, int64_t j) {
    Vec<T, kVec> y;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float v = to_float(x[slot][e]);
      if constexpr (kKind == NormKind::kLayer) {
        y[e] = from_float<T>((v - mean) * scale * to_float(w[slot][e]) + to_float(b[slot][e]));
      } else {
        y[e] = from_float<T>(v * scale * (to_float(w[slot][e]) + p.weight_offset));
      }
    }
    y.store(out + j * kVec);
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
      w[0].load(p.weight + j * kVec);
      if constexpr (kKind == NormKind::kLayer) b[0].load(p.bias + j * kVec);
      emit(0, j);
    }
  }
}

template <NormKind kKind, typename T, typename W, int kVec>
cudaError_t LaunchNormVec(const NormParams<T, W>& p, cudaStream_t stream, bool pdl) {
  const int64_t num_vecs = p.hidden / kVec;
  // Up to 512 threads hold a row in registers, 1, 2 or 4 vectors each; longer rows stream.
  const int items = num_vecs <= kNormCachedThreads           ? 1
                    : num_vecs <= 2 * kNormCachedThreads     ? 2
                    : num_vecs <= 4 * kNormCachedThreads     ? 4
                                                             : 0;
  int64_t threads = items ? (num_vecs + items - 1) / items : kNormStreamThreads;
  threads = threads < 32 ? 32 : (threads + 31) / 32 * 32;
  const int rows_per_block = threads <= 64 ? int(128 / threads) : 1;
  const dim3 block{unsigned(threads), unsigned(rows_per_block)};
  const dim3 grid{unsigned((p.num_rows + rows_per_block - 1) / rows_per_block)};
  switch (items) {
    case 1: return Launch(NormKernel<kKind, T, W, kVec, 1>, grid, block, stream, pdl, p);
    case 2: return Launch(NormKernel<kKind, T, W, kVec, 2>, grid, block, stream, pdl, p);
    case 4: return Launch(NormKernel<kKind, T, W, kVec, 4>, grid, block, stream, pdl, p);
    default: return Launch(NormKernel<kKind, T, W, kVec, 0>, grid, block, stream, pdl, p);
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
