// Element-wise scale: out = in * factor, computed in float and rounded once (as torch does).
//
// Memory-bound, one read and one write per element. Each thread moves kScaleUnroll vectors of
// 16 bytes and issues all its loads before its first store, so enough bytes are in flight to keep
// HBM busy; one block per kScaleThreads * kScaleUnroll vectors, no grid-stride loop. The vector
// body starts `head` elements in, where both pointers are 16-byte aligned; block 0 does that
// scalar head and the tail that fills no whole vector. Pointers that cannot both be aligned at
// one offset take the same kernel with 1-element vectors.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "aotinfer/vec.cuh"

namespace aotinfer {

constexpr int kScaleThreads = 256;
constexpr int kScaleUnroll = 4;

template <typename T, int kVecSize>
__global__ void __launch_bounds__(kScaleThreads)
    ScaleKernel(T* out, const T* in, float factor, int64_t n, int64_t head) {
  using V = Vec<T, kVecSize>;
  const int64_t num_vecs = (n - head) / kVecSize;
  const T* in_body = in + head;
  T* out_body = out + head;
  const int64_t first = int64_t(blockIdx.x) * kScaleThreads * kScaleUnroll + threadIdx.x;

  V v[kScaleUnroll];
#pragma unroll
  for (int k = 0; k < kScaleUnroll; ++k) {
    const int64_t i = first + k * kScaleThreads;
    if (i < num_vecs) v[k].load(in_body + i * kVecSize);
  }
#pragma unroll
  for (int k = 0; k < kScaleUnroll; ++k) {
    const int64_t i = first + k * kScaleThreads;
    if (i < num_vecs) {
#pragma unroll
      for (int j = 0; j < kVecSize; ++j) v[k][j] = from_float<T>(to_float(v[k][j]) * factor);
      v[k].store(out_body + i * kVecSize);
    }
  }

  if (blockIdx.x == 0) {
    const int64_t tail = head + num_vecs * kVecSize;
    const int64_t rest = head + (n - tail);  // scalar elements: the head, then the tail
    for (int64_t r = threadIdx.x; r < rest; r += kScaleThreads) {
      const int64_t i = r < head ? r : tail + (r - head);
      out[i] = from_float<T>(to_float(in[i]) * factor);
    }
  }
}

template <typename T, int kVecSize>
cudaError_t LaunchScale(T* out, const T* in, float factor, int64_t n, int64_t head,
                        cudaStream_t stream) {
  const int64_t per_block = int64_t(kScaleThreads) * kScaleUnroll;
  const int64_t blocks = ((n - head) / kVecSize + per_block - 1) / per_block;
  if (blocks > INT_MAX) return cudaErrorInvalidConfiguration;
  ScaleKernel<T, kVecSize><<<blocks > 0 ? int(blocks) : 1, kScaleThreads, 0, stream>>>(
      out, in, factor, n, head);
  return cudaGetLastError();
}

// out[i] = in[i] * factor for i < n. out may be in itself (in place) but must not partly overlap
// it; both must be aligned to sizeof(T).
template <typename T>
cudaError_t Scale(T* out, const T* in, float factor, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  constexpr int kVecSize = kVec16<T>;
  const auto out_addr = reinterpret_cast<uintptr_t>(out);
  const auto in_addr = reinterpret_cast<uintptr_t>(in);
  // Elements before out reaches a 16-byte boundary; the vector body needs in aligned there too.
  int64_t head = int64_t((16 - out_addr % 16) % 16 / sizeof(T));
  if (head > n) head = n;
  if ((in_addr + head * sizeof(T)) % 16 == 0) {
    return LaunchScale<T, kVecSize>(out, in, factor, n, head, stream);
  }
  return LaunchScale<T, 1>(out, in, factor, n, 0, stream);
}

}  // namespace aotinfer
