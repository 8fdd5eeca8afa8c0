// Gated activations: out[r, i] = act(in[r, i]) * in[r, d + i] for rows r of 2d inputs, with act
// SiLU, GELU (erf) or GELU (tanh approximation). The activation is a template parameter; the
// kernel is the same for all three.
//
// Memory-bound: each element is read once and each output written once. One thread per vector of
// kVec outputs (16 bytes where d, the row strides and the pointers allow, else one element), 128
// threads a block: the layout that reached the copy bandwidth for element-wise work. Blocks are
// numbered row by row, so that consecutive blocks read consecutive memory (benchmarks/NOTES.md).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "aotinfer/launch.cuh"
#include "aotinfer/vec.cuh"

namespace aotinfer {

struct SiLU {
  __device__ __forceinline__ static float apply(float x) { return x / (1.f + expf(-x)); }
};

// erf by Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7): one reciprocal, one
// exponential and five FMAs, where erff's 30-odd instructions made gelu_and_mul ALU-bound at HBM
// speed on the H200 (benchmarks/NOTES.md).
__device__ __forceinline__ float Erf(float x) {
  const float a = fabsf(x);
  const float t = __fdividef(1.f, 1.f + 0.3275911f * a);
  const float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
  return copysignf(1.f - poly * __expf(-a * a), x);
}

struct GELU {
  __device__ __forceinline__ static float apply(float x) { return 0.5f * x * (1.f + Erf(x * 0.70710678118654752f)); }
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
    ActAndMulKernel(T* out, RowLayout out_rows, const T* in, RowLayout in_rows, int64_t d, unsigned slices) {
  const int64_t row = blockIdx.x / slices;
  const int64_t j = int64_t(blockIdx.x % slices) * kActThreads + threadIdx.x;  // vector index in the row
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
  if (num_rows * slices > 0x7fffffff) return cudaErrorInvalidConfiguration;
  return Launch(ActAndMulKernel<Act, T, kVec>, dim3(unsigned(num_rows * slices)), dim3(kActThreads), stream, pdl,
                out, out_rows, in, in_rows, d, unsigned(slices));
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
