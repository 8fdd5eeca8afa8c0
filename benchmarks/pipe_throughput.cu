// Throughput of the attention softmax's instructions: results a clock an SM, 8 independent chains a
// thread, 256-1024 threads a block, one block an SM (docs/design/prefill_sm90.md#what-holds-a-tile).
//
//   nvcc -O3 -arch=sm_90a -o /tmp/pipe_throughput benchmarks/pipe_throughput.cu && /tmp/pipe_throughput
#include <cstdio>
#include <cstdint>
#define N 8
__device__ __forceinline__ float ex2(float x) { float y; asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ uint32_t bf2(float a, float b) { uint32_t y; asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(y) : "f"(a), "f"(b)); return y; }
__device__ __forceinline__ uint32_t h2(float a, float b) { uint32_t y; asm volatile("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(y) : "f"(a), "f"(b)); return y; }
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b) { uint32_t y; asm volatile("prmt.b32 %0, %1, %2, 0x7632;" : "=r"(y) : "r"(a), "r"(b)); return y; }
__device__ __forceinline__ uint32_t ex2h2(uint32_t a) { uint32_t y; asm volatile("ex2.approx.f16x2 %0, %1;" : "=r"(y) : "r"(a)); return y; }
__device__ __forceinline__ float ffma(float a) { float y; asm volatile("fma.rn.f32 %0, %1, 0f3F000000, 0f3E800000;" : "=f"(y) : "f"(a)); return y; }
__device__ __forceinline__ float fmx(float a, float b) { float y; asm volatile("max.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b)); return y; }

template <int kCase>
__global__ void Bench(float* sink, long long* cycles, int iters) {
  float x[N]; uint32_t u[N];
  for (int i = 0; i < N; ++i) { x[i] = -0.01f * (threadIdx.x + i); u[i] = __float_as_uint(x[i]); }
  __syncthreads();
  long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      if (kCase == 0) x[i] = ex2(x[i]);
      if (kCase == 1) u[i] = bf2(__uint_as_float(u[i]), __uint_as_float(u[(i + 1) % N]));
      if (kCase == 2) { if (i % 2 == 0) { x[i] = ex2(x[i]); x[i + 1] = ex2(x[i + 1]); u[i] = bf2(x[i], x[i + 1]); x[i] = __uint_as_float(u[i]); } }
      if (kCase == 3) u[i] = h2(__uint_as_float(u[i]), __uint_as_float(u[(i + 1) % N]));
      if (kCase == 4) u[i] = prmt(u[i], u[(i + 1) % N]);
      if (kCase == 6) u[i] = ex2h2(u[i]);
      if (kCase == 7) x[i] = ffma(x[i]);
      if (kCase == 8) x[i] = fmx(x[i], x[(i + 3) % N]);
      if (kCase == 9) { x[i] = ex2(x[i]); x[(i+4)%N] = ffma(x[(i+4)%N]); }
      if (kCase == 10) { x[i] = ex2(x[i]); if (i % 2 == 0) u[i] = prmt(u[i], u[i+1]); }
    }
  }
  long long t1 = clock64();
  float s = 0.f;
  for (int i = 0; i < N; ++i) s += x[i] + __uint_as_float(u[i]);
  if (s == 1.2345f) sink[0] = s;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <int kCase>
void Run(const char* name, double ops_per_iter_thread, int threads) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* sink; long long* cyc; cudaMalloc(&sink, 4); cudaMalloc(&cyc, sms * sizeof(long long));
  const int iters = 4096;
  Bench<kCase><<<sms, threads>>>(sink, cyc, iters);  // the first launch warms up
  Bench<kCase><<<sms, threads>>>(sink, cyc, iters);
  cudaDeviceSynchronize();
  long long h[1024]; cudaMemcpy(h, cyc, sms * sizeof(long long), cudaMemcpyDeviceToHost);
  double c = 0; for (int i = 0; i < sms; ++i) c += h[i]; c /= sms;  // cycles a block, averaged
  printf("%-34s threads %4d: %6.1f ops/clk/SM (%.0f cycles)\n", name, threads, ops_per_iter_thread * iters * threads / c, c);
}
int main() {
  for (int t : {256, 512, 1024}) {
    Run<0>("ex2.f32", N, t);
    Run<1>("cvt.rn.bf16x2.f32 (pairs)", N, t);
    Run<2>("2 ex2 + 1 cvt.bf16x2 (ex2 count)", N, t);
    Run<3>("cvt.rn.f16x2.f32 (pairs)", N, t);
    Run<4>("prmt", N, t);
    Run<6>("ex2.f16x2 (instrs)", N, t);
    Run<7>("ffma", N, t);
    Run<8>("max.f32", N, t);
    Run<9>("ex2 + ffma (ex2 count)", N, t);
    Run<10>("ex2 + prmt/2 (ex2 count)", N, t);
  }
}
