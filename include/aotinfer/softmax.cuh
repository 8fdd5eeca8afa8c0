// Softmax over rows of logits, in float32: out = exp(x / temperature) / the row's sum. A row that a
// cluster holds on chip is read once (SoftmaxResidentKernel); a longer row, or one not 16-byte
// aligned, twice (SoftmaxKernel).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "aotinfer/async_copy.cuh"
#include "aotinfer/launch.cuh"
#include "aotinfer/rows.cuh"
#include "aotinfer/vec.cuh"

namespace aotinfer {

struct SoftmaxParams {
  const void* logits;  // T [rows, vocab]
  int64_t in_stride;
  float* out;          // float32 [rows, vocab]
  int64_t out_stride;
  int64_t vocab;
  int64_t rows;
  RowParam<float> temperature;
};

// Running (max, sum of exp2(y - max)) pairs, merged.
__device__ __forceinline__ float2 MergeMaxSum(float2 a, float2 b) {
  const float m = fmaxf(a.x, b.x);
  if (m == -INFINITY) return make_float2(m, 0.f);
  return make_float2(m, a.y * exp2f(a.x - m) + b.y * exp2f(b.x - m));
}

// out = exp(x / temperature) / sum over the row, in float32: one pass for the running max and sum,
// one that writes.
template <typename T, int kVec>
__global__ void __launch_bounds__(kRowThreads) SoftmaxKernel(SoftmaxParams p) {
  constexpr int kWarps = kRowThreads / 32;
  static_assert(kWarps == 32, "each lane merges one warp's partial");
  __shared__ float2 partial[kWarps];
  const int64_t r = blockIdx.x / RowParts();
  WaitForPriorGrids();
  const T* row = static_cast<const T*>(p.logits) + r * p.in_stride;
  float* out = p.out + r * p.out_stride;
  const int64_t n = p.vocab;
  const float scale = 1.4426950408889634f / p.temperature.at(r);  // log2(e) / temperature
  float2 acc = make_float2(-INFINITY, 0.f);
  ForEachGroup<T, kVec>(row, n, [&](const float* x, int count, int64_t) {
    float m = -INFINITY;
    for (int e = 0; e < count; ++e) m = fmaxf(m, x[e] * scale);
    if (m == -INFINITY) return;
    float s = 0.f;
    for (int e = 0; e < count; ++e) s += exp2f(x[e] * scale - m);
    acc = MergeMaxSum(acc, make_float2(m, s));
  });
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    acc = MergeMaxSum(acc, make_float2(__shfl_xor_sync(0xffffffffu, acc.x, o), __shfl_xor_sync(0xffffffffu, acc.y, o)));
  }
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = acc;
  __syncthreads();
  acc = partial[threadIdx.x % 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    acc = MergeMaxSum(acc, make_float2(__shfl_xor_sync(0xffffffffu, acc.x, o), __shfl_xor_sync(0xffffffffu, acc.y, o)));
  }
  __shared__ float2 part_acc;  // merged over the row's blocks in part order
  if (threadIdx.x == 0) part_acc = acc;
  SyncRow();
  acc = make_float2(-INFINITY, 0.f);
  for (int part = 0; part < RowParts(); ++part) acc = MergeMaxSum(acc, *PartShared(&part_acc, part));
  SyncRow();
  const float m = acc.x;
  const float inv_sum = acc.y > 0.f ? 1.f / acc.y : 0.f;  // a row of -inf: zeros
  ForEachGroup<T, kVec>(row, n, [&](const float* x, int count, int64_t first) {
    float y[kVec];
    for (int e = 0; e < count; ++e) y[e] = m == -INFINITY ? 0.f : exp2f(x[e] * scale - m) * inv_sum;
    if (count == kVec && kVec >= 4) {
#pragma unroll
      for (int e = 0; e < kVec; e += 4) {
        Vec<float, 4> v;
        v[0] = y[e], v[1] = y[e + 1], v[2] = y[e + 2], v[3] = y[e + 3];
        v.store(out + first + e);
      }
    } else {
      for (int e = 0; e < count; ++e) out[first + e] = y[e];
    }
  });
  AllowDependentGrids();
}

// The softmax of a row held on chip: the row is split over a cluster of RowParts() blocks of
// kThreads threads, each holding kLoads 16-byte vectors of its block's slice in registers and
// kSharedLoads more in shared memory (its own slots, copied with cp.async beside the loads), so it
// is read once (the kernel above reads it twice) and written from there. Rows of up to
// RowParts() * kThreads * (kLoads + kSharedLoads) * kVec elements.
template <typename T, int kVec, int kLoads, int kThreads, int kSharedLoads = 0>
__global__ void __launch_bounds__(kThreads, kThreads <= 512 ? 2 : 1) SoftmaxResidentKernel(SoftmaxParams p) {
  constexpr int kWarps = kThreads / 32;
  constexpr int kGroups = kLoads + kSharedLoads;  // 16-byte vectors a thread
  extern __shared__ __align__(16) unsigned char shared_groups[];  // kSharedLoads * kThreads vectors
  __shared__ float2 partial[kWarps];
  __shared__ float2 part_acc;
  const int64_t r = blockIdx.x / RowParts();
  WaitForPriorGrids();
  const T* row = static_cast<const T*>(p.logits) + r * p.in_stride;
  float* out = p.out + r * p.out_stride;
  const int64_t n = p.vocab;
  const float scale = 1.4426950408889634f / p.temperature.at(r);  // log2(e) / temperature
  // This block's groups of kVec: an even share of the row's, so that the blocks the launcher adds
  // where the batch leaves SMs idle take part of the row (a share is at most kThreads * kGroups:
  // the launcher gives a row at least the blocks that hold it). This thread's u-th is
  // first + u * kThreads. In 32 bits: a held row has at most kMaxRowParts * kThreads * kGroups
  // groups, and with 64-bit divisions 32000 x 1024 took 11% longer on the H200.
  const int64_t all_groups = n / kVec;
  const uint32_t row_groups = uint32_t(all_groups), parts = RowParts(), part = RowPart();
  const int64_t groups = row_groups * (part + 1) / parts;
  const int64_t first = row_groups * part / parts + threadIdx.x;
  // Groups kLoads.. of a thread wait in shared memory (this thread's own slots: no barrier).
  Vec<T, kVec>* staged = reinterpret_cast<Vec<T, kVec>*>(shared_groups) + threadIdx.x;
#pragma unroll
  for (int u = kLoads; u < kGroups; ++u) {
    if (first + u * kThreads < groups) CopyAsync16(staged + (u - kLoads) * kThreads, row + (first + u * kThreads) * kVec);
  }
  if constexpr (kSharedLoads > 0) CommitAsyncGroup();
  Vec<T, kVec> v[kLoads];
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
    if (first + u * kThreads < groups) v[u].load(row + (first + u * kThreads) * kVec);
  }
  auto group = [&](int u) { return u < kLoads ? v[u] : staged[(u - kLoads) * kThreads]; };
  const int64_t tail = all_groups * kVec + threadIdx.x;  // the last n % kVec elements, one per thread
  const bool has_tail = kVec > 1 && RowPart() == RowParts() - 1 && tail < n;
  const float tail_y = has_tail ? to_float(row[tail]) * scale : -INFINITY;
  float m = tail_y;
  if constexpr (kSharedLoads > 0) WaitAsyncGroups<0>();
#pragma unroll
  for (int u = 0; u < kGroups; ++u) {
    if (first + u * kThreads < groups) {
      const Vec<T, kVec> x = group(u);
#pragma unroll
      for (int e = 0; e < kVec; ++e) m = fmaxf(m, to_float(x[e]) * scale);
    }
  }
  float s = 0.f;
  if (m != -INFINITY) {
    s = has_tail ? exp2f(tail_y - m) : 0.f;
#pragma unroll
    for (int u = 0; u < kGroups; ++u) {
      if (first + u * kThreads < groups) {
        const Vec<T, kVec> x = group(u);
#pragma unroll
        for (int e = 0; e < kVec; ++e) s += exp2f(to_float(x[e]) * scale - m);
      }
    }
  }
  float2 acc = make_float2(m, s);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    acc = MergeMaxSum(acc, make_float2(__shfl_xor_sync(0xffffffffu, acc.x, o), __shfl_xor_sync(0xffffffffu, acc.y, o)));
  }
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = acc;
  __syncthreads();
  acc = threadIdx.x % 32 < kWarps ? partial[threadIdx.x % 32] : make_float2(-INFINITY, 0.f);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    acc = MergeMaxSum(acc, make_float2(__shfl_xor_sync(0xffffffffu, acc.x, o), __shfl_xor_sync(0xffffffffu, acc.y, o)));
  }
  if (threadIdx.x == 0) part_acc = acc;
  SyncRow();
  acc = make_float2(-INFINITY, 0.f);
  for (int part = 0; part < RowParts(); ++part) acc = MergeMaxSum(acc, *PartShared(&part_acc, part));
  // The other blocks may leave once every block has read their part_acc: arrive now, wait at the
  // end, so that the writes do not wait for the slowest reader.
  const bool split = RowParts() > 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (split) asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
  const float row_max = acc.x;
  const float inv_sum = acc.y > 0.f ? 1.f / acc.y : 0.f;  // a row of -inf: zeros
  auto y_of = [&](float x) { return row_max == -INFINITY ? 0.f : exp2f(x * scale - row_max) * inv_sum; };
#pragma unroll
  for (int u = 0; u < kGroups; ++u) {
    const int64_t g = first + u * kThreads;
    if (g < groups) {
      const Vec<T, kVec> x = group(u);
#pragma unroll
      for (int e = 0; e < kVec; e += 4) {
        Vec<float, 4> w;
#pragma unroll
        for (int j = 0; j < 4; ++j) w[j] = y_of(to_float(x[e + j]));
        w.store(out + g * kVec + e);
      }
    }
  }
  if (has_tail) out[tail] = row_max == -INFINITY ? 0.f : exp2f(tail_y - row_max) * inv_sum;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (split) asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
  AllowDependentGrids();
}

// SoftmaxResidentKernel<kLoads, kSharedLoads> where the row fits a cluster: the blocks it needs, or
// more (up to kMaxRowParts) where the batch leaves SMs idle. False where it does not apply.
template <auto kKernel, int kVec, int kLoads, int kThreads, int kSharedLoads = 0>
bool LaunchResidentSoftmax(const SoftmaxParams& p, int device, cudaStream_t stream, bool pdl, cudaError_t* status) {
  constexpr int64_t kPerBlock = int64_t(kThreads) * (kLoads + kSharedLoads) * kVec;
  constexpr size_t kShared = size_t(kSharedLoads) * kThreads * 16;
  int parts = int((p.vocab + kPerBlock - 1) / kPerBlock);
  if (parts > kMaxRowParts || p.rows > 0x7FFFFFFF / kMaxRowParts) return false;
  parts = std::max(parts, 1);
  const int sms = GetDeviceFacts(device).sms;
  if (p.rows * parts * 2 <= sms) parts = int(std::min<int64_t>(kMaxRowParts, std::max<int64_t>(parts, sms / p.rows)));
  if (BlocksPerSm<kKernel>(kThreads, kShared, device) == 0) return false;
  while (parts > 1 && ActiveClusters<kKernel>(parts, kShared, device, kThreads) == 0) {
    if (int64_t(parts - 1) * kPerBlock < p.vocab) return false;  // fewer blocks cannot hold the row
    --parts;
  }
  *status = LaunchSplit(kKernel, p.rows, parts, kShared, stream, pdl, p, kThreads);
  return true;
}

template <typename T>
cudaError_t Softmax(const SoftmaxParams& p, int device, cudaStream_t stream, bool pdl) {
  const bool aligned = RowsAligned<T>(p.logits, p.in_stride) && RowsAligned<float>(p.out, p.out_stride) &&
                       p.out_stride % kVec16<T> == 0;
  if (p.rows == 0) return cudaSuccess;
  if (aligned) {
    // The row read once where a cluster holds it. Blocks of 1024 threads (128 KB of float32 in
    // registers each) where the grid fills the SMs four times over (on the H200 at vocab 128256:
    // 2.67-2.83 passes at batch 256-1024 against 2.99-3.02 for 512), else blocks of 512, two to an SM
    // (3.02 against 3.30 at batch 64), up to 8 * 512 * 32 elements.
    constexpr int kVec = kVec16<T>;
    constexpr int64_t kBig = 1024 * 8 * kVec;
    const bool many = p.rows * ((p.vocab + kBig - 1) / kBig) >= 4 * int64_t(GetDeviceFacts(device).sms);
    cudaError_t status = cudaSuccess;
    if constexpr (std::is_same_v<T, float>) {
      // Where another 128 KB of shared memory a block takes a row over fewer blocks, and those
      // blocks still fill the SMs (7/8 of them): clusters of 4 fit 120 of the H200's 132 SMs at
      // once, of 2 all of them (vocab 128256: 2.31 passes against 2.71 at batch 1024, 2.68 against
      // 2.98 at 64; at batch 32 its 64 blocks took 4.7 against 3.2). 16-bit logits gained at some
      // sizes and lost at others.
      const int64_t shared_parts = (p.vocab + 2 * kBig - 1) / (2 * kBig);
      const bool fewer_blocks = (p.vocab + kBig - 1) / kBig > shared_parts;
      if (fewer_blocks && p.rows * shared_parts * 8 >= 7 * int64_t(GetDeviceFacts(device).sms) &&
          LaunchResidentSoftmax<SoftmaxResidentKernel<T, kVec, 8, 1024, 8>, kVec, 8, 1024, 8>(p, device, stream, pdl,
                                                                                              &status)) {
        return status;
      }
    }
    if ((many && LaunchResidentSoftmax<SoftmaxResidentKernel<T, kVec, 8, 1024>, kVec, 8, 1024>(p, device, stream, pdl, &status)) ||
        LaunchResidentSoftmax<SoftmaxResidentKernel<T, kVec, 8, 512>, kVec, 8, 512>(p, device, stream, pdl, &status) ||
        LaunchResidentSoftmax<SoftmaxResidentKernel<T, kVec, 8, 1024>, kVec, 8, 1024>(p, device, stream, pdl, &status)) {
      return status;
    }
  }
  return LaunchRows<SoftmaxKernel<T, kVec16<T>>, SoftmaxKernel<T, 1>>(p, p.rows, aligned, 0, device, stream, pdl);
}

}  // namespace aotinfer
