// Kernels over the rows of a batch (the samplers, the renormalizations, softmax): one block of
// kRowThreads threads a row, or, on sm90+ where the batch leaves SMs idle, a thread block cluster
// of up to kMaxRowParts blocks that share the row, each reading its slice and meeting the others
// through distributed shared memory. What those kernels share: the blocks of a row, reading a row
// in 16-byte groups, per-row parameters, and the launch of a grid of rows in clusters.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "aotinfer/async_copy.cuh"
#include "aotinfer/launch.cuh"
#include "aotinfer/vec.cuh"

namespace aotinfer {

constexpr int kRowThreads = 1024;  // a row kernel's block
constexpr int kRowUnroll = 4;      // 16-byte loads in flight per thread
constexpr int kMaxRowParts = 8;    // blocks a row is split over at most (the portable cluster size)

// ---- the blocks of a row ----------------------------------------------------------------------------

// The blocks that share a row: the thread block cluster on sm90+ (one block where launched without
// one), one block below.
__device__ __forceinline__ int RowParts() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return int(cooperative_groups::this_cluster().num_blocks());
#else
  return 1;
#endif
}
__device__ __forceinline__ int RowPart() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return int(cooperative_groups::this_cluster().block_rank());
#else
  return 0;
#endif
}
// A barrier over every thread of the row's blocks (their shared memory writes visible to all).
__device__ __forceinline__ void SyncRow() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (RowParts() == 1) {
    __syncthreads();  // cheaper than the cluster barrier of a row that is not split
  } else {
    cooperative_groups::this_cluster().sync();
  }
#else
  __syncthreads();
#endif
}
// `ptr` in the shared memory of block `part` of the row.
template <typename T>
__device__ __forceinline__ T* PartShared(T* ptr, int part) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().map_shared_rank(ptr, part);
#else
  return ptr;
#endif
}

// ---- per-row parameters --------------------------------------------------------------------------

// A per-row parameter: the tensor's element for the output row when given, else the scalar.
template <typename T>
struct RowParam {
  const T* values;  // null: the scalar for every row
  T scalar;
  __device__ __forceinline__ T at(int64_t row) const { return values ? values[row] : scalar; }
};

// ---- reading a row --------------------------------------------------------------------------------

// f(values, count, first_index) for consecutive groups of kVec elements (count < kVec only at the
// row's end), kRowUnroll 16-byte loads in flight per thread. kVec == 1 where the row is not
// 16-byte aligned. kEvictFirst caches the row's lines evict-first in L2: for a kernel's last read
// of its rows, so that they displace one another rather than what the L2 held (lines that later
// kernels may read, or dirty ones that would be written back while this kernel reads). Only the
// samplers' last reads take it (their one-pass reads, top-p's verifying pass): they gained 3-8% at
// 64-1024 rows of 128256 and 262144 (H100, docs/design/sampling.md#rows-blocks-and-clusters); passes that a
// later pass reads again from L2
// (the histogram's, the renorms') lost by it.
template <typename T, int kVec, bool kEvictFirst = false, typename F>
__device__ __forceinline__ void ForEachGroup(const T* row, int64_t n, F&& f) {
  const uint64_t policy = kEvictFirst ? L2EvictFirstPolicy() : 0;
  auto load = [policy](Vec<T, kVec>& v, const T* at) {
    if constexpr (kEvictFirst) v.load(at, policy);
    else v.load(at);
  };
  const int64_t all_groups = n / kVec;
  const int parts = RowParts(), part = RowPart();  // this block's slice of the row
  const int64_t groups = all_groups * (part + 1) / parts;
  int64_t g = all_groups * part / parts + threadIdx.x;
  constexpr int kStep = kRowThreads * kRowUnroll;
  for (; g + (kRowUnroll - 1) * kRowThreads < groups; g += kStep) {
    Vec<T, kVec> v[kRowUnroll];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) load(v[u], row + (g + u * kRowThreads) * kVec);
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      float x[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) x[e] = to_float(v[u][e]);
      f(x, kVec, (g + u * kRowThreads) * kVec);
    }
  }
  for (; g < groups; g += kRowThreads) {
    Vec<T, kVec> v;
    load(v, row + g * kVec);
    float x[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) x[e] = to_float(v[e]);
    f(x, kVec, g * kVec);
  }
  const int64_t tail = all_groups * kVec + threadIdx.x;  // the last n % kVec elements, one per thread
  if (kVec > 1 && part == parts - 1 && tail < n) {
    float x[kVec];
    x[0] = to_float(row[tail]);
    f(x, 1, tail);
  }
}

// ---- launchers ------------------------------------------------------------------------------------

// How many clusters of `parts` blocks of kKernel (`threads` threads, shared_bytes each; both fixed
// per kernel) run at once on `device`: 0 where none can (asked once per kernel, device and size).
// The GPCs need not divide into clusters: on the H200, of blocks that take a whole SM, 15 clusters of
// 8 run at once, 30 of 4 and 66 of 2.
template <auto kKernel>
int ActiveClusters(int parts, size_t shared_bytes, int device, int threads = kRowThreads) {
  if (parts == 1) return GetDeviceFacts(device).sms;
  if (GetDeviceFacts(device).major < 9 || parts > kMaxRowParts || device < 0 || device >= kMaxDevices) return 0;
  static std::atomic<int> known[kMaxDevices][kMaxRowParts + 1] = {};  // clusters + 1; 0: not asked yet
  std::atomic<int>& slot = known[device][parts];
  int value = slot.load(std::memory_order_acquire);
  if (value == 0) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(unsigned(parts));
    config.blockDim = dim3(unsigned(threads));
    config.dynamicSmemBytes = shared_bytes;
    cudaLaunchAttribute attribute;
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = unsigned(parts);
    attribute.val.clusterDim.y = attribute.val.clusterDim.z = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kKernel, &config) != cudaSuccess) clusters = 0;
    cudaGetLastError();  // "does not fit" is an answer, not an error of a later launch
    value = clusters + 1;
    slot.store(value, std::memory_order_release);  // a second thread asking meanwhile gets the same answer
  }
  return value - 1;
}

// The blocks to split each of `rows` rows over: a power of two up to kMaxRowParts that keeps the
// grid within one wave of one block per SM (sm90+; 1 below): the clusters of that many blocks that
// run at once must take every row (else the last rows wait for a second wave: top-p alone at
// 128256 x 16 took 48 us in 16 clusters of 8, 15 at once, and 32 us at batch 8).
template <auto kKernel>
int RowPartsFor(int64_t rows, int max_parts, size_t shared_bytes, int device, int min_parts = 1) {
  const DeviceFacts& facts = GetDeviceFacts(device);
  if (facts.major < 9) return 1;
  int parts = std::min(min_parts, max_parts);
  while (parts < max_parts && rows * parts * 2 <= facts.sms) parts *= 2;
  while (parts > 1 && ActiveClusters<kKernel>(parts, shared_bytes, device) < rows) parts /= 2;
  return parts;
}

// kernel<<<rows * parts, kRowThreads, shared_bytes, stream>>>(p) in clusters of `parts`
// blocks, with the PDL attribute when `pdl`.
template <typename Params>
cudaError_t LaunchSplit(void (*kernel)(Params), int64_t rows, int parts, size_t shared_bytes, cudaStream_t stream,
                        bool pdl, const Params& p, int threads = kRowThreads) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(rows * parts));
  config.blockDim = dim3(unsigned(threads));
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attributes[2];
  int count = 0;
  if (parts > 1) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count].val.clusterDim.x = unsigned(parts);
    attributes[count].val.clusterDim.y = attributes[count].val.clusterDim.z = 1;
    ++count;
  }
  if (pdl) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  config.attrs = attributes;
  config.numAttrs = count;
  return cudaLaunchKernelEx(&config, kernel, p);
}

// Launches kernel<kVec> (16-byte vectors) where every row starts 16-byte aligned, else kernel<1>,
// each row over RowPartsFor blocks.
template <auto kVectorKernel, auto kScalarKernel, typename Params>
cudaError_t LaunchRows(const Params& p, int64_t rows, bool aligned, size_t shared_bytes, int device,
                       cudaStream_t stream, bool pdl, int max_parts = kMaxRowParts, int min_parts = 1) {
  if (rows == 0) return cudaSuccess;
  if (rows > 0x7FFFFFFF / kMaxRowParts) return cudaErrorInvalidConfiguration;
  if (aligned) {
    if (BlocksPerSm<kVectorKernel>(kRowThreads, shared_bytes, device) == 0) return cudaErrorInvalidConfiguration;
    return LaunchSplit(kVectorKernel, rows, RowPartsFor<kVectorKernel>(rows, max_parts, shared_bytes, device, min_parts), shared_bytes,
                       stream, pdl, p);
  }
  if (BlocksPerSm<kScalarKernel>(kRowThreads, shared_bytes, device) == 0) return cudaErrorInvalidConfiguration;
  return LaunchSplit(kScalarKernel, rows, RowPartsFor<kScalarKernel>(rows, max_parts, shared_bytes, device, min_parts), shared_bytes, stream,
                     pdl, p);
}

// Whether every row of a tensor of T starting at `base` with `stride` elements between rows starts
// 16-byte aligned.
template <typename T>
bool RowsAligned(const void* base, int64_t stride) {
  return Aligned16(base) && stride % kVec16<T> == 0;
}

}  // namespace aotinfer
