// Gated activations: out[r, i] = act(in[r, i]) * in[r, d + i] for rows r of 2d inputs, with act
// SiLU, GELU (erf) or GELU (tanh approximation). The activation is a template parameter; the
// kernel is the same for all three.
//
// Memory-bound: each element is read once and each output written once. One thread per vector of
// kVec outputs (16 bytes where d, the row strides and the pointers allow, else one element), a 1-D
// grid: the layout that reaches the streaming limit at prefill sizes. Under PDL, where the next
// kernel may launch decides decode-size latency (graph replay, docs/design/activation.md#pdl-trigger): a grid that
// fits on the SMs at once in 128-thread blocks lets it launch right after the wait; a larger one
// takes 256-thread blocks and lets it launch at the end (up to a third less time a call at 256-1024
// tokens than triggering after the loads). The math must stay lean to keep up with HBM: the
// activations use the hardware's approximate exp2, reciprocal and tanh (MUFU), at most two an
// element.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "aotinfer/launch.cuh"
#include "aotinfer/vec.cuh"

namespace aotinfer {

// 2^x and 1 / x on the MUFU unit, flushing denormals (which plain exp2f / __expf would handle
// with three more instructions an element). Relative error about 2^-22 each.
__device__ __forceinline__ float Exp2Approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float RcpApprox(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// tanh on the MUFU unit: relative error about 2^-11 (FlashInfer's GELU-tanh uses it).
__device__ __forceinline__ float TanhApprox(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

constexpr float kLog2e = 1.4426950408889634f;

// x / (1 + exp(-x)); exact to a few float ulps.
struct SiLU {
  template <typename T>
  __device__ __forceinline__ static float apply(float x) {
    return x * RcpApprox(1.f + Exp2Approx(-kLog2e * x));
  }
};

// erf by Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7): one reciprocal, one
// exponential and five FMAs, where erff's 30-odd instructions made gelu_and_mul ALU-bound at HBM
// speed on the H200. GELU = 0.5 (x + |x| erf(|x| / sqrt 2)).
struct GELU {
  template <typename T>
  __device__ __forceinline__ static float apply(float x) {
    const float a = fabsf(x) * 0.70710678118654752f;
    const float t = RcpApprox(fmaf(0.3275911f, a, 1.f));
    const float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
    const float erf_a = 1.f - poly * Exp2Approx(-kLog2e * a * a);
    return 0.5f * fmaf(fabsf(x), erf_a, x);
  }
};

// 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3). 16-bit outputs take tanh.approx as
// FlashInfer does (one MUFU op an element, its error below their rounding where the output is not
// near 0); float32 outputs take the exact form x / (1 + exp(-2u)).
struct GELUTanh {
  template <typename T>
  __device__ __forceinline__ static float apply(float x) {
    const float u = x * fmaf(0.0356774081363001f, x * x, 0.79788456080286536f);
    if constexpr (sizeof(T) == 2) {
      const float h = 0.5f * x;
      return fmaf(h, TanhApprox(u), h);
    } else {
      return x * RcpApprox(1.f + Exp2Approx(-2.f * kLog2e * u));
    }
  }
};

// A thread a vector, kThreads a block, blocks numbered row by row (consecutive blocks read
// consecutive memory); the next kernel may launch right after the wait (kEarlyTrigger) or at the
// end. Rows: RowLayout, or EvenRows where both tensors' rows are evenly spaced.
template <typename Act, typename T, int kVec, int kThreads, bool kEarlyTrigger, typename Rows>
__global__ void __launch_bounds__(kThreads)
    ActAndMulKernel(T* out, Rows out_rows, const T* in, Rows in_rows, int64_t d, unsigned slices) {
  const int64_t row = blockIdx.x / slices;
  const int64_t j = int64_t(blockIdx.x % slices) * kThreads + threadIdx.x;  // vector index in the row
  WaitForPriorGrids();
  if constexpr (kEarlyTrigger) AllowDependentGrids();
  if (j < d / kVec) {
    const T* src = in + in_rows.offset(row) + j * kVec;
    Vec<T, kVec> gate, up;
    gate.load(src);
    up.load(src + d);
    // Through PTX: a plain store of the vector came out as four 4-byte stores.
    Vec<T, kVec>::from_floats([&](int e) { return Act::template apply<T>(to_float(gate[e])) * to_float(up[e]); })
        .store_unsplit(out + out_rows.offset(row) + j * kVec);
  }
  if constexpr (!kEarlyTrigger) AllowDependentGrids();
}

template <typename Act, typename T, int kVec, int kThreads, bool kEarlyTrigger, typename Rows>
cudaError_t LaunchActAndMulKernel(T* out, Rows out_rows, const T* in, Rows in_rows, int64_t d, int64_t num_rows,
                                  cudaStream_t stream, bool pdl) {
  const int64_t slices = (d / kVec + kThreads - 1) / kThreads;
  if (num_rows * slices > 0x7fffffff) return cudaErrorInvalidConfiguration;
  return Launch(ActAndMulKernel<Act, T, kVec, kThreads, kEarlyTrigger, Rows>, dim3(unsigned(num_rows * slices)),
                dim3(kThreads), stream, pdl, out, out_rows, in, in_rows, d, unsigned(slices));
}

// The block shape and trigger for num_rows rows of d / kVec vectors on `device` (see the top).
template <typename Act, typename T, int kVec, typename Rows>
cudaError_t LaunchActAndMulSized(T* out, Rows out_rows, const T* in, Rows in_rows, int64_t d, int64_t num_rows,
                                 int device, cudaStream_t stream, bool pdl) {
  constexpr int kSmallThreads = 128, kLargeThreads = 256;
  const int64_t small_blocks = num_rows * ((d / kVec + kSmallThreads - 1) / kSmallThreads);
  return small_blocks <= GetDeviceFacts(device).sms
             ? LaunchActAndMulKernel<Act, T, kVec, kSmallThreads, true>(out, out_rows, in, in_rows, d, num_rows,
                                                                        stream, pdl)
             : LaunchActAndMulKernel<Act, T, kVec, kLargeThreads, false>(out, out_rows, in, in_rows, d, num_rows,
                                                                         stream, pdl);
}

// 16-byte vectors where d, the row strides and the pointers allow, else one element a thread.
template <typename Act, typename T, typename Rows>
cudaError_t LaunchActAndMul(T* out, Rows out_rows, const T* in, Rows in_rows, int64_t d, int64_t num_rows,
                            int device, cudaStream_t stream, bool pdl) {
  constexpr int kVec = kVec16<T>;
  const bool vectorized = d % kVec == 0 && Aligned16(out) && Aligned16(in) && out_rows.rows_aligned(kVec) &&
                          in_rows.rows_aligned(kVec);
  return vectorized ? LaunchActAndMulSized<Act, T, kVec>(out, out_rows, in, in_rows, d, num_rows, device, stream, pdl)
                    : LaunchActAndMulSized<Act, T, 1>(out, out_rows, in, in_rows, d, num_rows, device, stream, pdl);
}

// out[r, :d] = Act(in[r, :d]) * in[r, d:2d] for num_rows rows (0 rows or d == 0: nothing runs).
template <typename Act, typename T>
cudaError_t ActAndMul(T* out, RowLayout out_rows, const T* in, RowLayout in_rows, int64_t d, int64_t num_rows,
                      int device, cudaStream_t stream, bool pdl) {
  if (num_rows == 0 || d == 0) return cudaSuccess;
  if (out_rows.inner == 1 && in_rows.inner == 1) {
    return LaunchActAndMul<Act>(out, EvenRows{out_rows.outer_stride}, in, EvenRows{in_rows.outer_stride}, d, num_rows,
                                device, stream, pdl);
  }
  return LaunchActAndMul<Act>(out, out_rows, in, in_rows, d, num_rows, device, stream, pdl);
}

}  // namespace aotinfer
