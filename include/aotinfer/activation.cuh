// Gated activations: out[r, i] = act(in[r, i]) * in[r, d + i] for rows r of 2d inputs, with act
// SiLU, GELU (erf) or GELU (tanh approximation). The activation is a template parameter; the
// kernel is the same for all three.
//
// Memory-bound: each element is read once and each output written once. One thread per vector of
// kVec outputs (16 bytes where d, the row strides and the pointers allow, else one element), 128
// threads a block, blockIdx.x the row and blockIdx.y the block's slice of it: the layout that
// reached the copy bandwidth for element-wise work (benchmarks/NOTES.md).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "aotinfer/launch.cuh"
#include "aotinfer/vec.cuh"

namespace aotinfer {

struct SiLU {
  __device__ __forceinline__ static float apply(float x) { return x / (1.f + expf(-x)); }
};

struct GELU {
  __device__ __forceinline__ static float apply(float x) { return 0.5f * x * (1.f + erff(x * 0.70710678118654752f)); }
};

// 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
struct GELUTanh {
  __device__ __forceinline__ static float apply(float x) {
    return 0.5f * x * (1.f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x)));
  }
};

constexpr int kActThreads = 128;

template <typename Act, typename T, int kVec>
__global__ void __launch_bounds__(kActThreads)
    ActAndMulKernel(T* out, RowLayout out_rows, const T* in, RowLayout in_rows, int64_t d) {
  const int64_t row = blockIdx.x;
  const int64_t j = int64_t(blockIdx.y) * kActThreads + threadIdx.x;  // vector index in the row
  WaitForPriorGrids();
  const bool active = j < d / kVec;
  Vec<T, kVec> gate, up;
  if (active) {
    const T* src = in + in_rows.offset(row) + j * kVec;
    gate.load(src);
    up.load(src + d);
  }
  AllowDependentGrids();
  if (active) {
    Vec<T, kVec> y;
#pragma unroll
    for (int e = 0; e < kVec; ++e) y[e] = from_float<T>(Act::apply(to_float(gate[e])) * to_float(up[e]));
    y.store(out + out_rows.offset(row) + j * kVec);
  }
}

template <typename Act, typename T, int kVec>
cudaError_t LaunchActAndMul(T* out, RowLayout out_rows, const T* in, RowLayout in_rows, int64_t d,
                            int64_t num_rows, cudaStream_t stream, bool pdl) {
  const int64_t slices = (d / kVec + kActThreads - 1) / kActThreads;
  if (num_rows > 0x7fffffff || slices > 65535) return cudaErrorInvalidConfiguration;
  return Launch(ActAndMulKernel<Act, T, kVec>, dim3(unsigned(num_rows), unsigned(slices)), dim3(kActThreads),
                stream, pdl, out, out_rows, in, in_rows, d);
}

// out[r, :d] = Act(in[r, :d]) * in[r, d:2d] for num_rows rows (0 rows or d == 0: nothing runs).
template <typename Act, typename T>
cudaError_t ActAndMul(T* out, RowLayout out_rows, const T* in, RowLayout in_rows, int64_t d, int64_t num_rows,
                      cudaStream_t stream, bool pdl) {
  if (num_rows == 0 || d == 0) return cudaSuccess;
  constexpr int kVec = kVec16<T>;
  const bool vectorized = d % kVec == 0 && Aligned16(out) && Aligned16(in) && out_rows.rows_aligned(kVec) &&
                          in_rows.rows_aligned(kVec);
  return vectorized ? LaunchActAndMul<Act, T, kVec>(out, out_rows, in, in_rows, d, num_rows, stream, pdl)
                    : LaunchActAndMul<Act, T, 1>(out, out_rows, in, in_rows, d, num_rows, stream, pdl);
}

}  // namespace aotinfer
