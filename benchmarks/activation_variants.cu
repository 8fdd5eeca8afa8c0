// Design experiment for include/aotinfer/activation.cuh (issue 13): which gated-activation kernel
// moves bytes fastest at prefill sizes and finishes soonest at decode sizes. Variants differ in
// the activation's math (exact: expf, IEEE division, tanhf; fast: __expf and __fdividef, GELU-tanh
// as x * sigmoid(2u)), threads a block, vectors a thread, where the PDL trigger sits (after the
// loads, or at the end) and cache hints (ld.global.nc.L1::no_allocate, st.global.cs). "shipped" is
// aotinfer::ActAndMul as it is; "FI" is FlashInfer's act_and_mul_kernel (include/flashinfer/
// activation.cuh at fb28d72: a block a row, min(d / vec, 1024) threads, a loop, the trigger at
// the end; fast math as its JIT builds it); "stream" is benchmarks/streaming.cu's read-2-write-1
// kernel at its best configuration. Every variant is checked against a host reference on sampled
// rows, then timed with CUDA events (L2 flushed before each call, median of 30) beside
// cudaMemcpyAsync of the same bytes; decode sizes as graph replays of 20 PDL launches.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I include -I benchmarks benchmarks/activation_variants.cu
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "aotinfer/activation.cuh"
#include "cuda_timer.cuh"
#include "streaming.cu"

using namespace aotinfer;
using bf16 = __nv_bfloat16;

struct SiLUFast {
  __device__ __forceinline__ static float apply(float x) { return __fdividef(x, 1.f + __expf(-x)); }
};
// 0.5 x (1 + tanh(u)) = x * sigmoid(2u)
struct GELUTanhFast {
  __device__ __forceinline__ static float apply(float x) {
    const float u = 0.79788456080286536f * (x + 0.044715f * x * x * x);
    return __fdividef(x, 1.f + __expf(-2.f * u));
  }
};
// FlashInfer's, under -use_fast_math: __expf, a fast division, tanh.approx.
struct FISiLU {
  __device__ __forceinline__ static float apply(float x) { return __fdividef(x, 1.0f + __expf(-x)); }
};
struct FIGELUTanh {
  __device__ __forceinline__ static float apply(float x) {
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    return x * (0.5f * (1.0f + t));
  }
};

__device__ __forceinline__ uint4 LoadNoAllocate(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ void StoreStreaming(void* p, uint4 v) {
  asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// A block takes kThreads * kItems vectors of a row (blocks numbered row by row); a thread, kItems
// of them kThreads apart. Rows contiguous: in [rows, 2d], out [rows, d].
template <typename Act, int kThreads, int kItems, bool kLateTrigger, bool kHints>
__global__ void __launch_bounds__(kThreads) SliceKernel(bf16* out, const bf16* in, int64_t d, unsigned slices) {
  constexpr int V = 8;
  const int64_t row = blockIdx.x / slices;
  const int64_t first = int64_t(blockIdx.x % slices) * kThreads * kItems + threadIdx.x;
  const int64_t nv = d / V;
  const bf16* src = in + row * 2 * d;
  bf16* dst = out + row * d;
  WaitForPriorGrids();
  Vec<bf16, V> gate[kItems], up[kItems];
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int64_t j = first + k * kThreads;
    if (j < nv) {
      if constexpr (kHints) {
        *reinterpret_cast<uint4*>(gate[k].elems) = LoadNoAllocate(src + j * V);
        *reinterpret_cast<uint4*>(up[k].elems) = LoadNoAllocate(src + d + j * V);
      } else {
        gate[k].load(src + j * V);
        up[k].load(src + d + j * V);
      }
    }
  }
  if constexpr (!kLateTrigger) AllowDependentGrids();
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int64_t j = first + k * kThreads;
    if (j < nv) {
      Vec<bf16, V> y;
#pragma unroll
      for (int e = 0; e < V; ++e) y[e] = from_float<bf16>(Act::apply(to_float(gate[k][e])) * to_float(up[k][e]));
      if constexpr (kHints) {
        StoreStreaming(dst + j * V, *reinterpret_cast<uint4*>(y.elems));
      } else {
        y.store(dst + j * V);
      }
    }
  }
  if constexpr (kLateTrigger) AllowDependentGrids();
}

template <typename Act, int kThreads, int kItems, bool kLate, bool kHints>
cudaError_t LaunchSlices(bf16* out, const bf16* in, int64_t d, int64_t rows, cudaStream_t stream) {
  const int64_t slices = (d / 8 + kThreads * kItems - 1) / (kThreads * kItems);
  return Launch(SliceKernel<Act, kThreads, kItems, kLate, kHints>, dim3(unsigned(rows * slices)), dim3(kThreads),
                stream, true, out, in, d, unsigned(slices));
}

// FlashInfer's act_and_mul_kernel (bf16, 16-byte vectors), restated with Vec.
template <typename Act>
__global__ void FIKernel(bf16* __restrict__ out, const bf16* __restrict__ input, const int d) {
  constexpr uint32_t vec_size = 8;
  const int64_t token_idx = blockIdx.x;
  const int64_t offset = token_idx * 2 * d;
  WaitForPriorGrids();
#pragma unroll 1
  for (uint32_t idx = threadIdx.x; idx < d / vec_size; idx += blockDim.x) {
    Vec<bf16, 8> x, y, o;
    x.load(input + offset + idx * vec_size);
    y.load(input + offset + d + idx * vec_size);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = from_float<bf16>(Act::apply(to_float(x[i])) * to_float(y[i]));
    o.store(out + token_idx * d + idx * vec_size);
  }
  AllowDependentGrids();
}

template <typename Act>
cudaError_t LaunchFI(bf16* out, const bf16* in, int64_t d, int64_t rows, cudaStream_t stream) {
  const unsigned threads = std::min<unsigned>(unsigned(d / 8), 1024u);
  return Launch(FIKernel<Act>, dim3(unsigned(rows)), dim3(threads), stream, true, out, in, int(d));
}

using LaunchFn = std::function<cudaError_t(bf16*, const bf16*, int64_t, int64_t, cudaStream_t)>;
struct Variant {
  std::string name;
  LaunchFn launch;
};

// Variants for one activation: Exact is the shipped math, Fast the candidate, FI FlashInfer's.
template <typename Exact, typename Fast, typename FI>
std::vector<Variant> Variants() {
  return {
      {"shipped", [](bf16* o, const bf16* i, int64_t d, int64_t r, cudaStream_t s) {
         return ActAndMul<Exact, bf16>(o, {1, d, 0}, i, {1, 2 * d, 0}, d, r, s, true);
       }},
      {"exact 128x1 late", LaunchSlices<Exact, 128, 1, true, false>},
      {"fast 128x1", LaunchSlices<Fast, 128, 1, false, false>},
      {"fast 128x1 late", LaunchSlices<Fast, 128, 1, true, false>},
      {"fast 256x1 late", LaunchSlices<Fast, 256, 1, true, false>},
      {"fast 512x1 late", LaunchSlices<Fast, 512, 1, true, false>},
      {"fast 512x1", LaunchSlices<Fast, 512, 1, false, false>},
      {"fast 128x2 late", LaunchSlices<Fast, 128, 2, true, false>},
      {"fast 256x2 late", LaunchSlices<Fast, 256, 2, true, false>},
      {"fast 128x4 late", LaunchSlices<Fast, 128, 4, true, false>},
      {"fast 128x1 late hints", LaunchSlices<Fast, 128, 1, true, true>},
      {"fast 512x1 late hints", LaunchSlices<Fast, 512, 1, true, true>},
      {"FI", LaunchFI<FI>},
  };
}

float Bf(bf16 v) { return __bfloat162float(v); }

// Uniform in [-4, 4) from a hash of the index: random-looking data, made on the GPU.
__global__ void Fill(bf16* x, size_t n, unsigned seed) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  unsigned h = unsigned(i) * 2654435761u ^ unsigned(i >> 32) * 40503u ^ seed * 2246822519u;
  h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
  x[i] = __float2bfloat16(float(h >> 8) * (8.f / 16777216.f) - 4.f);
}

template <typename Ref>
void Bench(const char* act, Ref ref, const std::vector<Variant>& variants, char* flush, size_t flush_bytes) {
  auto flush_l2 = [&] { CHECK(cudaMemsetAsync(flush, 0, flush_bytes)); };
  std::printf("\n== %s: bandwidth, ratio to cudaMemcpy of the same bytes (two passes)\n", act);
  std::printf("%-24s", "variant");
  const int64_t shapes[][2] = {{4096, 4096}, {4096, 8192}, {16384, 4096}, {16384, 8192}};
  for (auto& s : shapes) std::printf(" %11lldx%-5lld", (long long)s[0], (long long)s[1]);
  std::printf("\n");
  std::vector<std::vector<double>> ratio(variants.size() + 1, std::vector<double>(8, 0));
  std::vector<std::string> wrong(variants.size());
  for (int pass = 0; pass < 2; ++pass) {
    for (int si = 0; si < 4; ++si) {
      const int64_t rows = shapes[si][0], d = shapes[si][1];
      const size_t n_in = size_t(rows) * 2 * d, n_out = size_t(rows) * d;
      bf16 *in, *out;
      CHECK(cudaMalloc(&in, n_in * 2));
      CHECK(cudaMalloc(&out, n_out * 2));
      Fill<<<unsigned((n_in + 255) / 256), 256>>>(in, n_in, 11 + si);
      CHECK(cudaGetLastError());
      const size_t bytes = (n_in + n_out) * 2;
      char* scratch;
      CHECK(cudaMalloc(&scratch, bytes));
      const float copy_ms = median_ms([&] { CHECK(cudaMemcpyAsync(scratch + bytes / 2, scratch, bytes / 2, cudaMemcpyDeviceToDevice)); },
                                      5, 30, flush_l2);
      for (size_t vi = 0; vi < variants.size(); ++vi) {
        if (pass == 0) {
          CHECK(cudaMemset(out, 0xff, n_out * 2));
          CHECK(variants[vi].launch(out, in, d, rows, nullptr));
          std::vector<bf16> h(2 * d), got(d);
          for (int64_t r = 0; r < rows; r += r % 2 ? 97 : 1) {  // pairs of rows, 97 apart, and the last
            const int64_t row = std::min(r, rows - 1);
            CHECK(cudaMemcpy(h.data(), in + row * 2 * d, 2 * d * 2, cudaMemcpyDeviceToHost));
            CHECK(cudaMemcpy(got.data(), out + row * d, d * 2, cudaMemcpyDeviceToHost));
            for (int64_t i = 0; i < d; ++i) {
              const double want = ref(Bf(h[i])) * Bf(h[d + i]), err = std::fabs(Bf(got[i]) - want);
              if (!(err <= 2e-2 * (1 + std::fabs(want)))) wrong[vi] = " WRONG";
            }
          }
        }
        const float ms = median_ms([&] { CHECK(variants[vi].launch(out, in, d, rows, nullptr)); }, 5, 30, flush_l2);
        ratio[vi][pass * 4 + si] = copy_ms / ms;
      }
      // The streaming limit: read 2 units, write 1, the best configuration.
      double best = 0;
      for (int c = 0; c < streaming::kNumConfigs; ++c) {
        const void* reads[2] = {in, in + n_out};
        void* writes[1] = {out};
        const float ms = median_ms([&] { CHECK(cudaError_t(streaming_run(reads, 2, writes, 1, int64_t(n_out) * 2 / 16, c, nullptr))); },
                                   5, 30, flush_l2);
        best = std::max(best, double(copy_ms / ms));
      }
      ratio[variants.size()][pass * 4 + si] = best;
      CHECK(cudaFree(in));
      CHECK(cudaFree(out));
      CHECK(cudaFree(scratch));
    }
  }
  for (size_t vi = 0; vi <= variants.size(); ++vi) {
    std::printf("%-24s", vi < variants.size() ? variants[vi].name.c_str() : "stream (best config)");
    for (int si = 0; si < 4; ++si) std::printf("   %.3f/%.3f    ", ratio[vi][si], ratio[vi][4 + si]);
    std::printf("%s\n", vi < variants.size() ? wrong[vi].c_str() : "");
  }

  std::printf("-- %s: graph replay of 20 launches (PDL), d = 4096, us per launch (two passes)\n", act);
  std::printf("%-24s %13s %13s %13s %13s\n", "variant", "1", "8", "32", "128");
  std::vector<std::vector<double>> lat(variants.size(), std::vector<double>(8, 0));
  for (int pass = 0; pass < 2; ++pass) {
    for (int ti = 0; ti < 4; ++ti) {
      const int64_t tokens = (int64_t[]){1, 8, 32, 128}[ti], d = 4096;
      bf16 *in, *out;
      CHECK(cudaMalloc(&in, tokens * 2 * d * 2));
      CHECK(cudaMalloc(&out, tokens * d * 2));
      Fill<<<unsigned((tokens * 2 * d + 255) / 256), 256>>>(in, tokens * 2 * d, 5);
      cudaStream_t stream;
      CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      for (size_t vi = 0; vi < variants.size(); ++vi) {
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
        for (int i = 0; i < 20; ++i) CHECK(variants[vi].launch(out, in, d, tokens, stream));
        CHECK(cudaStreamEndCapture(stream, &graph));
        CHECK(cudaGraphInstantiate(&exec, graph, 0));
        cudaEvent_t a, b;
        CHECK(cudaEventCreate(&a));
        CHECK(cudaEventCreate(&b));
        for (int i = 0; i < 10; ++i) CHECK(cudaGraphLaunch(exec, stream));
        std::vector<float> t;
        for (int i = 0; i < 50; ++i) {
          CHECK(cudaEventRecord(a, stream));
          CHECK(cudaGraphLaunch(exec, stream));
          CHECK(cudaEventRecord(b, stream));
          CHECK(cudaEventSynchronize(b));
          float ms;
          CHECK(cudaEventElapsedTime(&ms, a, b));
          t.push_back(ms);
        }
        std::nth_element(t.begin(), t.begin() + 25, t.end());
        lat[vi][pass * 4 + ti] = t[25] * 1e3 / 20;
        CHECK(cudaEventDestroy(a));
        CHECK(cudaEventDestroy(b));
        CHECK(cudaGraphExecDestroy(exec));
        CHECK(cudaGraphDestroy(graph));
      }
      CHECK(cudaStreamDestroy(stream));
      CHECK(cudaFree(in));
      CHECK(cudaFree(out));
    }
  }
  for (size_t vi = 0; vi < variants.size(); ++vi) {
    std::printf("%-24s", variants[vi].name.c_str());
    for (int ti = 0; ti < 4; ++ti) std::printf("   %4.2f/%4.2f  ", lat[vi][ti], lat[vi][4 + ti]);
    std::printf("\n");
  }
}

int main() {
  const size_t flush_bytes = size_t(256) << 20;
  char* flush;
  CHECK(cudaMalloc(&flush, flush_bytes));
  Bench("silu_and_mul", [](double x) { return x / (1 + std::exp(-x)); }, Variants<SiLU, SiLUFast, FISiLU>(), flush,
        flush_bytes);
  Bench("gelu_tanh_and_mul",
        [](double x) { return 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); },
        Variants<GELUTanh, GELUTanhFast, FIGELUTanh>(), flush, flush_bytes);
  Bench("gelu_and_mul", [](double x) { return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0))); },
        Variants<GELU, GELU, GELU>(), flush, flush_bytes);
  std::printf("\n(FI's gelu uses ::erf; here the FI row runs our GELU in FI's kernel shape)\n");
}
