// Merging attention states: an output computed over part of the keys, v, with the log-sum-exp
// (base 2) of its logits, s. States over disjoint parts merge exactly:
//   s = log2(sum_i 2^s_i),   v = sum_i 2^(s_i - s) v_i
// which is how split decode and prefix/suffix (cascade) attention put their pieces together.
// Memory-bound: a warp a (token, head), each lane some 16-byte vectors of head_dim, in float,
// rounded once. Any strides but head_dim's.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "aotinfer/launch.cuh"
#include "aotinfer/vec.cuh"

namespace aotinfer {

constexpr int kMergeThreads = 128;

// States of one tensor pair: state i of token n, head h is v[n * v_stride_n + i * v_stride_state +
// h * v_stride_h + d] (d contiguous) and s[n * s_stride_n + i * s_stride_state + h * s_stride_h].
template <typename T>
struct StateSet {
  const T* v;
  const float* s;
  int64_t v_stride_n, v_stride_state, v_stride_h;
  int64_t s_stride_n, s_stride_state, s_stride_h;
  int count;
};

// The merge of every state of sets[0 .. num_sets) (merge_state: two sets of one state; merge_states:
// one set of many), for each token where mask allows.
template <typename T>
struct MergeParams {
  T* v_out;             // [seq, heads, head_dim], head_dim contiguous
  float* s_out;         // [seq, heads]
  int64_t v_out_stride_n, v_out_stride_h, s_out_stride_n, s_out_stride_h;
  StateSet<T> sets[2];
  int num_sets;
  const bool* mask;     // [seq] or null: merge only where true (in place: elsewhere nothing changes)
  int64_t seq_len;
  int num_heads, head_dim;
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
  auto lse = [&](const StateSet<T>& set, int i) {
    return set.s[n * set.s_stride_n + i * set.s_stride_state + h * set.s_stride_h];
  };
  float m = -INFINITY;
  for (int k = 0; k < p.num_sets; ++k) {
    for (int i = 0; i < p.sets[k].count; ++i) m = fmaxf(m, lse(p.sets[k], i));
  }
  const float base = m == -INFINITY ? 0.f : m;
  float total = 0.f;
  for (int k = 0; k < p.num_sets; ++k) {
    for (int i = 0; i < p.sets[k].count; ++i) total += exp2f(lse(p.sets[k], i) - base);
  }
  const float inv = total > 0.f ? 1.f / total : 0.f;
  T* out = p.v_out + n * p.v_out_stride_n + h * p.v_out_stride_h;
  for (int j = lane; j < vecs; j += 32) {
    float acc[kVec] = {};
    for (int k = 0; k < p.num_sets; ++k) {
      const StateSet<T>& set = p.sets[k];
      for (int i = 0; i < set.count; ++i) {
        const float w = exp2f(lse(set, i) - base);
        Vec<T, kVec> x;
        x.load(set.v + n * set.v_stride_n + i * set.v_stride_state + h * set.v_stride_h + j * kVec);
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] += w * to_float(x[e]);
      }
    }
    Vec<T, kVec> y;
#pragma unroll
    for (int e = 0; e < kVec; ++e) y[e] = from_float<T>(acc[e] * inv);
    y.store(out + j * kVec);  // in place: only what this lane read
  }
  __syncwarp();  // in place: every lane has read s before it is overwritten
  if (lane == 0) p.s_out[n * p.s_out_stride_n + h * p.s_out_stride_h] = total > 0.f ? base + log2f(total) : -INFINITY;
}

// Merges the states of p.seq_len tokens (nothing to do for 0 tokens).
template <typename T>
cudaError_t MergeStates(const MergeParams<T>& p, cudaStream_t stream, bool pdl) {
  if (p.seq_len == 0 || p.num_heads == 0 || p.head_dim == 0) return cudaSuccess;
  constexpr int kVec = kVec16<T>;
  bool vectorized = p.head_dim % kVec == 0 && Aligned16(p.v_out) && p.v_out_stride_n % kVec == 0 &&
                    p.v_out_stride_h % kVec == 0;
  for (int k = 0; k < p.num_sets; ++k) {
    const StateSet<T>& set = p.sets[k];
    vectorized = vectorized && Aligned16(set.v) && set.v_stride_n % kVec == 0 && set.v_stride_state % kVec == 0 &&
                 set.v_stride_h % kVec == 0;
  }
  const int64_t blocks = (p.seq_len * p.num_heads + kMergeThreads / 32 - 1) / (kMergeThreads / 32);
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  return vectorized ? Launch(MergeStatesKernel<T, kVec>, dim3(unsigned(blocks)), dim3(kMergeThreads), stream, pdl, p)
                    : Launch(MergeStatesKernel<T, 1>, dim3(unsigned(blocks)), dim3(kMergeThreads), stream, pdl, p);
}

}  // namespace aotinfer
