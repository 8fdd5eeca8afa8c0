// Element-wise scale: out = in * factor, computed in float and rounded once (as torch does).
//
// Memory-bound, one read and one write per element. One 16-byte vector per thread in blocks of
// 128 and a grid that covers the tensor once: on the H200 this matches cudaMemcpy's bandwidth,
// where more vectors per thread or a grid-stride loop lost 4-10% (docs/design/scale.md#access-pattern). The
// vector body starts `head` elements in, where both pointers are 16-byte aligned; block 0 does
// that scalar head and the tail that fills no whole vector. Pointers that cannot both be aligned
// at one offset take the same kernel with 1-element vectors. Launched through Launch() with PDL
// where asked, like the other kernels (see ScaleKernel for where it triggers).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "aotinfer/launch.cuh"
#include "aotinfer/vec.cuh"

namespace aotinfer {

constexpr int kScaleThreads = 128;

template <typename T, int kVecSize>
__global__ void __launch_bounds__(kScaleThreads)
    ScaleKernel(T* out, const T* in, float factor, int64_t n, int64_t head) {
  const int64_t num_vecs = (n - head) / kVecSize;
  const int64_t i = int64_t(blockIdx.x) * kScaleThreads + threadIdx.x;  // vector index
  // Waits for the grids before it, but never calls AllowDependentGrids(): in this kernel of many
  // small blocks the instruction, wherever it sits and with PDL or without, cost a fifth of the
  // bandwidth (0.80 of a copy against 1.00; docs/design/scale.md#pdl). The next kernel launches as
  // this one's blocks exit.
  WaitForPriorGrids();
  if (i < num_vecs) {
    Vec<T, kVecSize> v;
    v.load(in + head + i * kVecSize);
#pragma unroll
    for (int j = 0; j < kVecSize; ++j) v[j] = from_float<T>(to_float(v[j]) * factor);
    v.store(out + head + i * kVecSize);
  }

  if (blockIdx.x == 0) {
    const int64_t tail = head + num_vecs * kVecSize;
    const int64_t rest = head + (n - tail);  // scalar elements: the head, then the tail
    for (int64_t r = threadIdx.x; r < rest; r += kScaleThreads) {
      const int64_t e = r < head ? r : tail + (r - head);
      out[e] = from_float<T>(to_float(in[e]) * factor);
    }
  }
}

template <typename T, int kVecSize>
cudaError_t LaunchScale(T* out, const T* in, float factor, int64_t n, int64_t head, cudaStream_t stream, bool pdl) {
  const int64_t blocks = ((n - head) / kVecSize + kScaleThreads - 1) / kScaleThreads;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  return Launch(ScaleKernel<T, kVecSize>, dim3(blocks > 0 ? unsigned(blocks) : 1u), dim3(kScaleThreads), stream, pdl,
                out, in, factor, n, head);
}

// out[i] = in[i] * factor for i < n. out may be in itself (in place) but must not partly overlap
// it; both must be aligned to sizeof(T).
template <typename T>
cudaError_t Scale(T* out, const T* in, float factor, int64_t n, cudaStream_t stream, bool pdl) {
  if (n == 0) return cudaSuccess;
  const auto out_addr = reinterpret_cast<uintptr_t>(out);
  const auto in_addr = reinterpret_cast<uintptr_t>(in);
  // Elements before out reaches a 16-byte boundary; the vector body needs in aligned there too.
  int64_t head = int64_t((16 - out_addr % 16) % 16 / sizeof(T));
  if (head > n) head = n;
  if ((in_addr + head * sizeof(T)) % 16 == 0) {
    return LaunchScale<T, kVec16<T>>(out, in, factor, n, head, stream, pdl);
  }
  return LaunchScale<T, 1>(out, in, factor, n, 0, stream, pdl);
}

}  // namespace aotinfer
