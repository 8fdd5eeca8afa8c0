// The streaming limit of the bandwidth benchmarks: a kernel that reads kReads streams and writes
// kWrites streams of the same length, as an op of that read:write proportion does (a gated
// activation reads 2 units and writes 1; the fused add + RMSNorm reads 2 and writes 2), and does
// nothing else: each written 16-byte vector is the XOR of the vectors read at its index. With no
// stream written (an op that only reads, as decode attention does), each warp writes the XOR of
// what it read, one 16-byte vector (writes[0][warp]), so that the loads cannot be dropped and
// what was read can be checked: 1/32 to 1/128 of the bytes read. Built
// at benchmark start, not shipped (benchmarks/_bandwidth.py compiles it with nvcc and calls it
// through ctypes); benchmarks/activation_variants.cu includes it too.
//   nvcc -O3 -shared -Xcompiler -fPIC -gencode=arch=compute_90a,code=sm_90a benchmarks/streaming.cu -o streaming.so
//
// Each configuration moves the same bytes in another shape (threads a block, vectors a thread);
// the benchmark times them all and keeps the fastest, the limit for that case. `read_once` caches
// what is read under an L2 evict-first policy (as the decode kernel reads its K and V): the lines
// read displace one another, not what the L2 held before the launch.
#include <cuda_runtime.h>

#include <cstdint>

namespace streaming {

constexpr int kMaxStreams = 2;

struct Streams {
  const uint4* reads[kMaxStreams];
  uint4* writes[kMaxStreams];
};

// *p, or with read_once *p cached in L2 under `policy`.
__device__ __forceinline__ uint4 Load(const uint4* p, bool read_once, uint64_t policy) {
  if (!read_once) return *p;
  uint4 v;
  asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(policy));
  return v;
}

// Vector i of every read stream, XORed, goes to vector i of every write stream: kItems vectors a
// thread, kThreads apart, every load issued before the first store.
template <int kReads, int kWrites, int kThreads, int kItems, bool kReadOnce>
__global__ void __launch_bounds__(kThreads) StreamKernel(Streams s, int64_t num_vecs) {
  uint64_t policy = 0;
  if (kReadOnce) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  const int64_t first = int64_t(blockIdx.x) * kThreads * kItems + threadIdx.x;
  uint4 v[kItems];
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int64_t i = first + int64_t(k) * kThreads;
    v[k] = make_uint4(0, 0, 0, 0);
    if (i < num_vecs) {
#pragma unroll
      for (int r = 0; r < kReads; ++r) {
        const uint4 x = Load(&s.reads[r][i], kReadOnce, policy);
        v[k].x ^= x.x, v[k].y ^= x.y, v[k].z ^= x.z, v[k].w ^= x.w;
      }
    }
  }
  if constexpr (kWrites == 0) {  // the warp's XOR of everything it read, by its lane 0
    uint4 x = v[0];
#pragma unroll
    for (int k = 1; k < kItems; ++k) x.x ^= v[k].x, x.y ^= v[k].y, x.z ^= v[k].z, x.w ^= v[k].w;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      x.x ^= __shfl_xor_sync(0xffffffffu, x.x, o);
      x.y ^= __shfl_xor_sync(0xffffffffu, x.y, o);
      x.z ^= __shfl_xor_sync(0xffffffffu, x.z, o);
      x.w ^= __shfl_xor_sync(0xffffffffu, x.w, o);
    }
    if (threadIdx.x % 32 == 0) s.writes[0][(int64_t(blockIdx.x) * kThreads + threadIdx.x) / 32] = x;
  } else {
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t i = first + int64_t(k) * kThreads;
      if (i < num_vecs) {
#pragma unroll
        for (int w = 0; w < kWrites; ++w) s.writes[w][i] = v[k];
      }
    }
  }
}

template <int kReads, int kWrites, int kThreads, int kItems, bool kReadOnce>
cudaError_t LaunchStream(const Streams& s, int64_t num_vecs, cudaStream_t stream) {
  const int64_t blocks = (num_vecs + kThreads * kItems - 1) / (kThreads * kItems);
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  StreamKernel<kReads, kWrites, kThreads, kItems, kReadOnce><<<unsigned(blocks), kThreads, 0, stream>>>(s, num_vecs);
  return cudaGetLastError();
}

// (threads a block, vectors a thread) of each configuration.
constexpr int kConfigs[][2] = {{128, 1}, {256, 1}, {512, 1}, {128, 2}, {256, 2}, {128, 4}};
constexpr int kNumConfigs = sizeof(kConfigs) / sizeof(kConfigs[0]);

template <int kReads, int kWrites, bool kReadOnce = false>
cudaError_t LaunchConfig(int config, const Streams& s, int64_t num_vecs, cudaStream_t stream) {
  switch (config) {
    case 0: return LaunchStream<kReads, kWrites, 128, 1, kReadOnce>(s, num_vecs, stream);
    case 1: return LaunchStream<kReads, kWrites, 256, 1, kReadOnce>(s, num_vecs, stream);
    case 2: return LaunchStream<kReads, kWrites, 512, 1, kReadOnce>(s, num_vecs, stream);
    case 3: return LaunchStream<kReads, kWrites, 128, 2, kReadOnce>(s, num_vecs, stream);
    case 4: return LaunchStream<kReads, kWrites, 256, 2, kReadOnce>(s, num_vecs, stream);
    case 5: return LaunchStream<kReads, kWrites, 128, 4, kReadOnce>(s, num_vecs, stream);
    default: return cudaErrorInvalidValue;
  }
}

// reads[0..num_reads) and writes[0..num_writes) each of num_vecs 16-byte vectors (16-byte aligned).
// num_writes 0: one read stream, and writes[0] holds streaming_warps(num_vecs, config) vectors.
inline cudaError_t Stream(const void* const* reads, int num_reads, void* const* writes, int num_writes,
                          int64_t num_vecs, int config, bool read_once, cudaStream_t stream) {
  if (num_reads < 1 || num_reads > kMaxStreams || num_writes < 0 || num_writes > kMaxStreams ||
      (num_writes == 0 && num_reads != 1) || (read_once && num_writes != 0)) {
    return cudaErrorInvalidValue;
  }
  Streams s{};
  for (int r = 0; r < num_reads; ++r) s.reads[r] = static_cast<const uint4*>(reads[r]);
  for (int w = 0; w < (num_writes > 0 ? num_writes : 1); ++w) s.writes[w] = static_cast<uint4*>(writes[w]);
  if (num_vecs == 0) return cudaSuccess;
  switch (num_reads * 10 + num_writes) {
    case 10: return read_once ? LaunchConfig<1, 0, true>(config, s, num_vecs, stream)
                              : LaunchConfig<1, 0>(config, s, num_vecs, stream);
    case 11: return LaunchConfig<1, 1>(config, s, num_vecs, stream);
    case 12: return LaunchConfig<1, 2>(config, s, num_vecs, stream);
    case 21: return LaunchConfig<2, 1>(config, s, num_vecs, stream);
    case 22: return LaunchConfig<2, 2>(config, s, num_vecs, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace streaming

extern "C" {
int streaming_num_configs() { return streaming::kNumConfigs; }
// Warps a read-only launch of configuration `config` over num_vecs vectors runs: the vectors its
// writes[0] must hold.
int64_t streaming_warps(int64_t num_vecs, int config) {
  if (config < 0 || config >= streaming::kNumConfigs) return -1;
  const int threads = streaming::kConfigs[config][0], items = streaming::kConfigs[config][1];
  return (num_vecs + threads * items - 1) / (threads * items) * (threads / 32);
}
// What the configuration is, for the log: threads a block and vectors a thread.
int streaming_config(int config, int* threads, int* items) {
  if (config < 0 || config >= streaming::kNumConfigs) return -1;
  *threads = streaming::kConfigs[config][0];
  *items = streaming::kConfigs[config][1];
  return 0;
}
// cudaError_t as an int; 0 is success.
int streaming_run(const void* const* reads, int num_reads, void* const* writes, int num_writes, int64_t num_vecs,
                  int config, void* stream) {
  return int(streaming::Stream(reads, num_reads, writes, num_writes, num_vecs, config, false,
                               static_cast<cudaStream_t>(stream)));
}
// As streaming_run with one read stream and no write stream, the reads cached evict-first in L2.
int streaming_run_read_once(const void* read, void* writes, int64_t num_vecs, int config, void* stream) {
  return int(streaming::Stream(&read, 1, &writes, 0, num_vecs, config, true, static_cast<cudaStream_t>(stream)));
}
}
