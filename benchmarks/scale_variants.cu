// Design experiment for include/aotinfer/scale.cuh: which access pattern reaches the copy
// bandwidth, and (issue 13) where the PDL trigger goes. Each variant computes out = in * factor over n elements; all are checked against a
// host reference, then timed (cuda_timer.cuh: CUDA events, median of 50 after 10 warm-ups) beside
// cudaMemcpyAsync device-to-device of the same bytes. Results: docs/design/scale.md.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I include benchmarks/scale_variants.cu
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "aotinfer/scale.cuh"
#include "cuda_timer.cuh"

using namespace aotinfer;

enum Hint { kPlain, kStreaming, kNoAllocate };

template <Hint kHint>
__device__ __forceinline__ uint4 load16(const uint4* p) {
  if constexpr (kHint == kStreaming) return __ldcs(p);
  if constexpr (kHint == kNoAllocate) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
  }
  return *p;
}
template <Hint kHint>
__device__ __forceinline__ void store16(uint4* p, uint4 v) {
  if constexpr (kHint == kPlain) *p = v; else __stcs(p, v);
}

template <typename T>
__device__ __forceinline__ uint4 scale16(uint4 raw, float f) {
  Vec<T, kVec16<T>> v;
  *reinterpret_cast<uint4*>(v.elems) = raw;
#pragma unroll
  for (int j = 0; j < kVec16<T>; ++j) v[j] = from_float<T>(to_float(v[j]) * f);
  return *reinterpret_cast<uint4*>(v.elems);
}

// One-shot grid: block b owns kThreads * kUnroll consecutive vectors. Index is int64 or int32.
template <typename T, int kThreads, int kUnroll, Hint kHint, typename Index>
__global__ void __launch_bounds__(kThreads) OneShot(uint4* out, const uint4* in, float f, Index nv) {
  const Index first = Index(blockIdx.x) * kThreads * kUnroll + threadIdx.x;
  uint4 v[kUnroll];
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const Index i = first + k * kThreads;
    if (i < nv) v[k] = load16<kHint>(in + i);
  }
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const Index i = first + k * kThreads;
    if (i < nv) store16<kHint>(out + i, scale16<T>(v[k], f));
  }
}

// Grid-stride: a fixed grid walks the vectors, kUnroll vectors per thread per step.
template <typename T, int kThreads, int kUnroll, Hint kHint>
__global__ void __launch_bounds__(kThreads) GridStride(uint4* out, const uint4* in, float f, int64_t nv) {
  const int64_t step = int64_t(gridDim.x) * kThreads * kUnroll;
  for (int64_t base = int64_t(blockIdx.x) * kThreads * kUnroll + threadIdx.x; base < nv; base += step) {
    uint4 v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t i = base + int64_t(k) * kThreads;
      if (i < nv) v[k] = load16<kHint>(in + i);
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t i = base + int64_t(k) * kThreads;
      if (i < nv) store16<kHint>(out + i, scale16<T>(v[k], f));
    }
  }
}

// PDL placement (issue 13): 128 x 1 vector, launched with the PDL attribute, waiting for the
// grids before it at the top and letting the next launch after the load (kTrigger 1), at the end
// (2), or never (0, which leaves it to the block's exit).
template <typename T, int kTrigger>
__global__ void __launch_bounds__(128) Pdl(uint4* out, const uint4* in, float f, int32_t nv) {
  const int32_t i = int32_t(blockIdx.x) * 128 + threadIdx.x;
  WaitForPriorGrids();
  uint4 v;
  if (i < nv) v = in[i];
  if (kTrigger == 1) AllowDependentGrids();
  if (i < nv) out[i] = scale16<T>(v, f);
  if (kTrigger == 2) AllowDependentGrids();
}

template <typename T>
void run(const char* dtype, size_t bytes, int sms, bool pdl_only) {
  const size_t n = bytes / sizeof(T), nv = bytes / 16;
  std::vector<T> h(n);
  srand(1);
  for (size_t i = 0; i < n; ++i) h[i] = T(float(rand()) / RAND_MAX * 4.f - 2.f);
  T *in, *out;
  CHECK(cudaMalloc(&in, bytes));
  CHECK(cudaMalloc(&out, bytes));
  CHECK(cudaMemcpy(in, h.data(), bytes, cudaMemcpyHostToDevice));
  const float f = 1.37f;
  const float copy_ms = median_ms([&] { CHECK(cudaMemcpyAsync(out, in, bytes, cudaMemcpyDeviceToDevice)); });
  const double copy_bw = 2.0 * bytes / copy_ms / 1e6;
  std::printf("%-9s %5zu MiB  cudaMemcpy D2D %7.1f us %6.0f GB/s\n", dtype, bytes >> 20, copy_ms * 1e3, copy_bw);
  std::vector<T> got(n);
  auto report = [&](const char* name, auto launch) {
    CHECK(cudaMemset(out, 0xff, bytes));
    launch();
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(got.data(), out, bytes, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i += 4093) {
      const float want = float(T(float(h[i]) * f));
      if (float(got[i]) != want) { std::printf("  %-34s WRONG at %zu\n", name, i); return; }
    }
    const float ms = median_ms(launch);
    const double bw = 2.0 * bytes / ms / 1e6;
    std::printf("  %-34s %7.1f us %6.0f GB/s  %.3f of memcpy\n", name, ms * 1e3, bw, bw / copy_bw);
  };
  auto u_out = reinterpret_cast<uint4*>(out);
  auto u_in = reinterpret_cast<const uint4*>(in);
#define ONESHOT(THREADS, UNROLL, HINT, INDEX)                                                     \
  report("oneshot " #THREADS "x" #UNROLL " " #HINT " " #INDEX, [&] {                              \
    const size_t per = size_t(THREADS) * UNROLL;                                                  \
    OneShot<T, THREADS, UNROLL, HINT, INDEX><<<(nv + per - 1) / per, THREADS>>>(u_out, u_in, f, INDEX(nv)); \
  })
  report("shipped aotinfer::Scale, PDL", [&] { CHECK(Scale<T>(out, in, f, int64_t(n), nullptr, true)); });
  report("shipped aotinfer::Scale, no PDL", [&] { CHECK(Scale<T>(out, in, f, int64_t(n), nullptr, false)); });
  const unsigned blocks = unsigned((nv + 127) / 128);
  report("PDL, trigger after the load", [&] { CHECK(Launch(Pdl<T, 1>, dim3(blocks), dim3(128), nullptr, true, u_out, u_in, f, int32_t(nv))); });
  report("PDL, trigger at the end", [&] { CHECK(Launch(Pdl<T, 2>, dim3(blocks), dim3(128), nullptr, true, u_out, u_in, f, int32_t(nv))); });
  report("PDL, no trigger", [&] { CHECK(Launch(Pdl<T, 0>, dim3(blocks), dim3(128), nullptr, true, u_out, u_in, f, int32_t(nv))); });
  report("no PDL, trigger at the end", [&] { CHECK(Launch(Pdl<T, 2>, dim3(blocks), dim3(128), nullptr, false, u_out, u_in, f, int32_t(nv))); });
  if (pdl_only) {
    CHECK(cudaFree(in));
    CHECK(cudaFree(out));
    return;
  }
  ONESHOT(256, 4, kPlain, int64_t);
  ONESHOT(256, 4, kPlain, int32_t);
  ONESHOT(128, 1, kPlain, int32_t);
  ONESHOT(128, 2, kPlain, int32_t);
  ONESHOT(128, 4, kPlain, int32_t);
  ONESHOT(256, 2, kPlain, int32_t);
  ONESHOT(512, 2, kPlain, int32_t);
  ONESHOT(256, 8, kPlain, int32_t);
  ONESHOT(256, 4, kStreaming, int32_t);
  ONESHOT(256, 4, kNoAllocate, int32_t);
  ONESHOT(128, 2, kStreaming, int32_t);
  ONESHOT(128, 2, kNoAllocate, int32_t);
  for (int per_sm : {4, 8, 16}) {
    char name[64];
    std::snprintf(name, sizeof(name), "gridstride 256x4 plain %d/SM", per_sm);
    report(name, [&] { GridStride<T, 256, 4, kPlain><<<sms * per_sm, 256>>>(u_out, u_in, f, int64_t(nv)); });
    std::snprintf(name, sizeof(name), "gridstride 256x2 nc %d/SM", per_sm);
    report(name, [&] { GridStride<T, 256, 2, kNoAllocate><<<sms * per_sm, 256>>>(u_out, u_in, f, int64_t(nv)); });
  }
  CHECK(cudaFree(in));
  CHECK(cudaFree(out));
}

// With the argument "pdl", only the shipped kernel and the PDL placements.
int main(int argc, char** argv) {
  const bool pdl_only = argc > 1 && std::string(argv[1]) == "pdl";
  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (size_t mib : {256, 1024}) {
    run<half>("float16", mib << 20, sms, pdl_only);
    run<float>("float32", mib << 20, sms, pdl_only);
  }
}
