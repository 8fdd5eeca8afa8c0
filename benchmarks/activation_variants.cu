// Design experiment for include/aotinfer/activation.cuh (issue 13): which gated-activation kernel
// moves bytes fastest at prefill sizes and finishes soonest at decode sizes. "shipped" is
// aotinfer::ActAndMul (a 1-D grid, a vector a thread); "AxB" rows the same code with A threads a
// block, B vectors a thread and the PDL trigger placed elsewhere (the decode-size experiment; the
// 2-D grid of commit 042a625 lived here before); "row loop" is the shape FlashInfer 0.7.2's
// act_and_mul kernel has (a block a row, up to 256 threads stepping through the row a 16-byte
// vector at a time, the trigger at the end, fast-math exp, division and tanh), written here for
// the comparison; "stream" is
// benchmarks/streaming.cu's read-2-write-1 kernel at its best configuration. Every variant is
// checked against a host reference on sampled rows, then timed with CUDA events (L2 flushed before
// each call, median of 30) beside cudaMemcpyAsync of the same bytes; decode sizes as graph replays
// of 20 PDL launches. The first version of this file (commit 34ec90a) compared slice shapes,
// trigger placement, cache hints and exact against fast math on the kernel of that time;
// docs/design/activation.md has its results (raw log: benchmarks/log/NOTES.md).
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

// Fast-math forms of the activations, for the row-loop baseline.
struct FastSiLU {
  template <typename T>
  __device__ __forceinline__ static float apply(float x) { return __fdividef(x, 1.f + __expf(-x)); }
};
struct FastGELUTanh {
  template <typename T>
  __device__ __forceinline__ static float apply(float x) {
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(0.79788456080286536f * (x + 0.044715f * x * x * x)));
    return 0.5f * x * (1.f + t);
  }
};

// The row-loop baseline: block r takes row r, its threads step through it a vector at a time.
template <typename Act>
__global__ void RowLoopKernel(bf16* out, const bf16* in, int64_t d) {
  const bf16* gate = in + int64_t(blockIdx.x) * 2 * d;
  bf16* row_out = out + int64_t(blockIdx.x) * d;
  WaitForPriorGrids();
  for (int64_t j = int64_t(threadIdx.x) * 8; j < d; j += int64_t(blockDim.x) * 8) {
    Vec<bf16, 8> g, u, y;
    g.load(gate + j);
    u.load(gate + d + j);
#pragma unroll
    for (int e = 0; e < 8; ++e) y[e] = from_float<bf16>(Act::template apply<bf16>(to_float(g[e])) * to_float(u[e]));
    y.store(row_out + j);
  }
  AllowDependentGrids();
}

template <typename Act>
cudaError_t LaunchRowLoop(bf16* out, const bf16* in, int64_t d, int64_t rows, cudaStream_t stream) {
  const unsigned threads = unsigned(std::min<int64_t>(d / 8, 256));
  return Launch(RowLoopKernel<Act>, dim3(unsigned(rows)), dim3(threads), stream, true, out, in, d);
}

using LaunchFn = std::function<cudaError_t(bf16*, const bf16*, int64_t, int64_t, cudaStream_t)>;
struct Variant {
  std::string name;
  LaunchFn launch;
};

// The decode-size experiment (docs/design/activation.md#pdl-trigger): the kernel of the time
// with its shape and trigger as parameters. Block b takes slice b % slices of row b / slices;
// each thread kItems vectors kThreads apart, every load issued before the first is used; the
// trigger before the loads (right after the wait), after them (shipped then) or at the end.
enum class Trigger { kBeforeLoads, kAfterLoads, kAtEnd };

template <typename Act, int kThreads, int kItems, Trigger kTrigger>
__global__ void __launch_bounds__(kThreads) Tiled(bf16* out, const bf16* in, int64_t d, unsigned slices) {
  const int64_t row = blockIdx.x / slices;
  const int64_t first = int64_t(blockIdx.x % slices) * kThreads * kItems + threadIdx.x;
  const bf16* src = in + row * 2 * d;
  WaitForPriorGrids();
  if (kTrigger == Trigger::kBeforeLoads) AllowDependentGrids();
  Vec<bf16, 8> gate[kItems], up[kItems];
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int64_t j = first + k * kThreads;
    if (j < d / 8) {
      gate[k].load(src + j * 8);
      up[k].load(src + d + j * 8);
    }
  }
  if (kTrigger == Trigger::kAfterLoads) AllowDependentGrids();
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int64_t j = first + k * kThreads;
    if (j < d / 8) {
      Vec<bf16, 8>::from_floats([&](int e) { return Act::template apply<bf16>(to_float(gate[k][e])) * to_float(up[k][e]); })
          .store_unsplit(out + row * d + j * 8);
    }
  }
  if (kTrigger == Trigger::kAtEnd) AllowDependentGrids();
}

template <typename Act, int kThreads, int kItems, Trigger kTrigger>
cudaError_t LaunchTiled(bf16* o, const bf16* i, int64_t d, int64_t r, cudaStream_t s) {
  const int64_t slices = (d / 8 + kThreads * kItems - 1) / (kThreads * kItems);
  return Launch(Tiled<Act, kThreads, kItems, kTrigger>, dim3(unsigned(r * slices)), dim3(kThreads), s, true, o, i, d,
                unsigned(slices));
}

template <typename Act>
cudaError_t LaunchShipped(bf16* o, const bf16* i, int64_t d, int64_t r, cudaStream_t s) {
  return ActAndMul<Act, bf16>(o, {1, d, 0}, i, {1, 2 * d, 0}, d, r, 0, s, true);
}

// Variants for one activation: Act is the shipped math, Fast the row-loop baseline's.
template <typename Act, typename Fast>
std::vector<Variant> Variants() {
  return {
      {"shipped", LaunchShipped<Act>},
      {"128x1, trigger at end", LaunchTiled<Act, 128, 1, Trigger::kAtEnd>},
      {"128x1, trigger first", LaunchTiled<Act, 128, 1, Trigger::kBeforeLoads>},
      {"256x1, after loads", LaunchTiled<Act, 256, 1, Trigger::kAfterLoads>},
      {"256x1, at end", LaunchTiled<Act, 256, 1, Trigger::kAtEnd>},
      {"256x2, at end", LaunchTiled<Act, 256, 2, Trigger::kAtEnd>},
      {"128x4, after loads", LaunchTiled<Act, 128, 4, Trigger::kAfterLoads>},
      {"row loop", LaunchRowLoop<Fast>},
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
        lat[vi][pass * 4 + ti] = GraphReplayUs([&](cudaStream_t s) { return variants[vi].launch(out, in, d, tokens, s); }, stream);
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

// Decode-size latency over more shapes: which shape and trigger wins where, for the rule that
// picks the launch at small sizes (docs/design/activation.md#pdl-trigger).
template <typename Act>
void LatencySweep(const char* act) {
  const std::vector<Variant> variants = {
      {"shipped", LaunchShipped<Act>},
      {"128x1 first", LaunchTiled<Act, 128, 1, Trigger::kBeforeLoads>},
      {"256x2 end", LaunchTiled<Act, 256, 2, Trigger::kAtEnd>},
      {"256x1 end", LaunchTiled<Act, 256, 1, Trigger::kAtEnd>},
      {"128x2 end", LaunchTiled<Act, 128, 2, Trigger::kAtEnd>},
      {"256x4 end", LaunchTiled<Act, 256, 4, Trigger::kAtEnd>},
  };
  std::printf("\n-- %s: graph replay of 20 launches (PDL), us per launch\n%-8s %-6s", act, "d", "tokens");
  for (auto& v : variants) std::printf(" %12s", v.name.c_str());
  std::printf("\n");
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int64_t d : {2048, 4096, 8192}) {
    for (int64_t tokens : {1, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024}) {
      bf16 *in, *out;
      CHECK(cudaMalloc(&in, tokens * 2 * d * 2));
      CHECK(cudaMalloc(&out, tokens * d * 2));
      Fill<<<unsigned((tokens * 2 * d + 255) / 256), 256>>>(in, tokens * 2 * d, 7);
      std::printf("%-8lld %-6lld", (long long)d, (long long)tokens);
      for (auto& v : variants) {
        std::printf(" %12.2f", GraphReplayUs([&](cudaStream_t s) { return v.launch(out, in, d, tokens, s); }, stream));
      }
      std::printf("\n");
      CHECK(cudaFree(in));
      CHECK(cudaFree(out));
    }
  }
  CHECK(cudaStreamDestroy(stream));
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "sweep") {
    LatencySweep<SiLU>("silu_and_mul");
    LatencySweep<GELUTanh>("gelu_tanh_and_mul");
    return 0;
  }
  const size_t flush_bytes = size_t(256) << 20;
  char* flush;
  CHECK(cudaMalloc(&flush, flush_bytes));
  Bench("silu_and_mul", [](double x) { return x / (1 + std::exp(-x)); }, Variants<SiLU, FastSiLU>(), flush,
        flush_bytes);
  Bench("gelu_tanh_and_mul",
        [](double x) { return 0.5 * x * (1 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); },
        Variants<GELUTanh, FastGELUTanh>(), flush, flush_bytes);
  Bench("gelu_and_mul", [](double x) { return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0))); },
        Variants<GELU, GELU>(), flush, flush_bytes);
  std::printf("\n(gelu's row-loop row runs our GELU in the row-loop shape)\n");
}
