// Merging attention states: an output computed over part of the keys, v, with the log-sum-exp
// (base 2) of its logits, s. States over disjoint parts merge exactly:
//   s = log2(sum_i 2^s_i),   v = sum_i 2^(s_i - s) v_i
// which is how split decode and prefix/suffix (cascade) attention put their pieces together.
// Memory-bound: a warp a (token, head), each lane some 16-byte vectors of head_dim, in float,
// rounded once.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "aotinfer/launch.cuh"
#include "aotinfer/vec.cuh"

namespace aotinfer {

constexpr int kMergeThreads = 128;

// State i of token n, head h: v[n * v_stride_n + i * v_stride_state + h * head_dim + d] and
// s[n * s_stride_n + i * s_stride_state + h], for num_states states. merge_state's two tensors are
// two states whose offset from the first is the distance between the tensors.
template <typename T>
struct MergeParams {
  T* v_out;             // [seq, heads, head_dim], contiguous
  float* s_out;         // [seq, heads]
  const T* v;
  const float* s;
  int64_t v_stride_n, v_stride_state, s_stride_n, s_stride_state;
  const bool* mask;     // [seq] or null: merge only where true (in place: elsewhere nothing changes)
  int64_t seq_len;
  int num_heads, head_dim, num_states;
};

template <typename T, int kVec>
__global__ void __launch_bounds__(kMergeThreads) MergeStatesKernel(const MergeParams<T> p) {
  const int vecs = p.head_dim / kVec;
  const int64_t pair = int64_t(blockIdx.x) * (kMergeThreads / 32) + threadIdx.x / 32;  // (token, head)
  const int lane = threadIdx.x % 32;
  WaitForPriorGrids();
  if (pair >= p.seq_len * p.num_heads) return;
  const int64_t n = pair / p.num_heads;
  const int h = int(pair % p.num_heads);
  if (p.mask != nullptr && !p.mask[n]) return;
  float m = -INFINITY;
  for (int i = 0; i < p.num_states; ++i) m = fmaxf(m, p.s[n * p.s_stride_n + i * p.s_stride_state + h]);
  const float base = m == -INFINITY ? 0.f : m;
  float total = 0.f;
  for (int i = 0; i < p.num_states; ++i) total += exp2f(p.s[n * p.s_stride_n + i * p.s_stride_state + h] - base);
  const float inv = total > 0.f ? 1.f / total : 0.f;
  for (int j = lane; j < vecs; j += 32) {
    float acc[kVec] = {};
    for (int i = 0; i < p.num_states; ++i) {
      const float w = exp2f(p.s[n * p.s_stride_n + i * p.s_stride_state + h] - base);
      Vec<T, kVec> x;
      x.load(p.v + n * p.v_stride_n + i * p.v_stride_state + int64_t(h) * p.head_dim + j * kVec);
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[e] += w * to_float(x[e]);
    }
    Vec<T, kVec> y;
#pragma unroll
    for (int e = 0; e < kVec; ++e) y[e] = from_float<T>(acc[e] * inv);
    y.store(p.v_out + (n * p.num_heads + h) * p.head_dim + j * kVec);  // in place: only what this lane read
  }
  __syncwarp();  // in place: every lane has read s before it is overwritten
  if (lane == 0) p.s_out[n * p.num_heads + h] = total > 0.f ? base + log2f(total) : -INFINITY;
}

// Merges p.num_states states of p.seq_len tokens (nothing to do for 0 tokens).
template <typename T>
cudaError_t MergeStates(const MergeParams<T>& p, cudaStream_t stream, bool pdl) {
  if (p.seq_len == 0 || p.num_heads == 0 || p.head_dim == 0) return cudaSuccess;
  constexpr int kVec = kVec16<T>;
  const bool vectorized = p.head_dim % kVec == 0 && Aligned16(p.v) && Aligned16(p.v_out) &&
                          p.v_stride_n % kVec == 0 && p.v_stride_state % kVec == 0;
  const int64_t blocks = (p.seq_len * p.num_heads + kMergeThreads / 32 - 1) / (kMergeThreads / 32);
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  return vectorized ? Launch(MergeStatesKernel<T, kVec>, dim3(unsigned(blocks)), dim3(kMergeThreads), stream, pdl, p)
                    : Launch(MergeStatesKernel<T, 1>, dim3(unsigned(blocks)), dim3(kMergeThreads), stream, pdl, p);
}

}  // namespace aotinfer
