// Design experiment for the fused add + RMSNorm of include/aotinfer/norm.cuh (issue 13): the row
// normalized is now the float32 sum input + residual (FlashInfer's numerics), not the residual
// rounded to bf16. Variants of a one-row-a-block kernel: vectors a thread (the rest in threads),
// where the residual is written (pass 1, keeping the float sums in registers for pass 2; or pass
// 2, keeping input and residual as loaded and adding again), weights loaded beside the row or
// after the reduction, and the PDL trigger after pass 1 or at the end. "shipped" is aotinfer::Norm
// as it stands (a rounded residual before this change, the float sum after); "staged sums" is the
// shape FlashInfer's fused add + RMSNorm kernel has (a block a row, up to 1024 threads stepping
// through it, the float sums kept in shared memory between the passes), written here for the
// comparison; "stream" benchmarks/streaming.cu's read-2-write-2 kernel at its
// best configuration. Each is checked against a float64 host reference of the float sum on
// sampled rows (worst error in output ulps), then timed with CUDA events (L2 flushed before each
// call, median of 30) beside cudaMemcpyAsync of the same bytes; decode sizes as graph replays of
// 20 PDL launches.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I include -I benchmarks benchmarks/norm_fused_add_variants.cu
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "aotinfer/norm.cuh"
#include "cuda_timer.cuh"
#include "streaming.cu"

using namespace aotinfer;
using bf16 = __nv_bfloat16;
constexpr int V = 8;

struct Rows {
  bf16* input;  // [rows, hidden], normalized in place
  bf16* residual;
  const bf16* weight;
  int64_t hidden, rows;
};

template <int kItems, bool kPrefetch, bool kResidualLate, bool kLateTrigger>
__global__ void __launch_bounds__(kItems == 1 ? 1024 : 512) FusedKernel(Rows p) {
  __shared__ float2 shared[kNormMaxRowsPerBlock][32];
  const int64_t row = blockIdx.x;
  const int64_t nv = p.hidden / V;
  bf16* in = p.input + row * p.hidden;
  bf16* res = p.residual + row * p.hidden;
  WaitForPriorGrids();
  Vec<bf16, V> x[kItems], r[kItems], w[kItems];
  Vec<float, V> v[kResidualLate ? 1 : kItems];
  float sq[2] = {0.f, 0.f};
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
    if (j < nv) {
      x[k].load(in + j * V);
      r[k].load(res + j * V);
      if constexpr (kPrefetch) w[k].load(p.weight + j * V);
    }
  }
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
    if (j < nv) {
      Vec<bf16, V> rounded;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float s = to_float(x[k][e]) + to_float(r[k][e]);
        sq[e % 2] = fmaf(s, s, sq[e % 2]);
        if constexpr (!kResidualLate) {
          v[k][e] = s;
          rounded[e] = from_float<bf16>(s);
        }
      }
      if constexpr (!kResidualLate) rounded.store(res + j * V);
    }
  }
  if constexpr (!kLateTrigger) AllowDependentGrids();
  const float total = RowSum(make_float2(0.f, sq[0] + sq[1]), shared).y;
  const float scale = rsqrtf(total / float(p.hidden) + 1e-6f);
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
    if (j < nv) {
      if constexpr (!kPrefetch) w[k].load(p.weight + j * V);
      Vec<bf16, V> y, rounded;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float s = kResidualLate ? to_float(x[k][e]) + to_float(r[k][e]) : v[k][e];
        rounded[e] = from_float<bf16>(s);
        y[e] = from_float<bf16>(s * scale * to_float(w[k][e]));
      }
      if constexpr (kResidualLate) rounded.store(res + j * V);
      y.store_unsplit(in + j * V);
    }
  }
  if constexpr (kLateTrigger) AllowDependentGrids();
}

template <int kItems, bool kPrefetch, bool kResidualLate, bool kLateTrigger>
cudaError_t LaunchFused(const Rows& p, cudaStream_t stream) {
  const int64_t nv = p.hidden / V;
  const int64_t threads = ((nv + kItems - 1) / kItems + 31) / 32 * 32;
  if (threads > 1024) return cudaErrorInvalidConfiguration;
  return Launch(FusedKernel<kItems, kPrefetch, kResidualLate, kLateTrigger>, dim3(unsigned(p.rows)),
                dim3(unsigned(threads)), stream, true, p);
}

// The staged-sums baseline: block r takes row r; pass 1 adds input and residual, writes the
// residual rounded and keeps the float sums in shared memory; pass 2 normalizes them.
__global__ void StagedSumsKernel(bf16* input, bf16* residual, const bf16* weight, int64_t d, float eps) {
  extern __shared__ float sums[];  // [d]: the row's float sums
  __shared__ float2 partial[kNormMaxRowsPerBlock][32];
  bf16* in_row = input + int64_t(blockIdx.x) * d;
  bf16* res_row = residual + int64_t(blockIdx.x) * d;
  const int64_t step = int64_t(blockDim.x) * V;
  WaitForPriorGrids();
  float squares = 0.f;
  for (int64_t j = int64_t(threadIdx.x) * V; j < d; j += step) {
    Vec<bf16, V> a, b;
    a.load(in_row + j);
    b.load(res_row + j);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float x = to_float(a[e]) + to_float(b[e]);
      squares += x * x;
      sums[j + e] = x;
      b[e] = from_float<bf16>(x);
    }
    b.store(res_row + j);
  }
  const float scale = rsqrtf(RowSum(make_float2(0.f, squares), partial).y / float(d) + eps);
  for (int64_t j = int64_t(threadIdx.x) * V; j < d; j += step) {
    Vec<bf16, V> w, y;
    w.load(weight + j);
#pragma unroll
    for (int e = 0; e < V; ++e) y[e] = from_float<bf16>(sums[j + e] * scale * to_float(w[e]));
    y.store(in_row + j);
  }
  AllowDependentGrids();
}

cudaError_t LaunchStagedSums(const Rows& p, cudaStream_t stream) {
  const unsigned threads = unsigned(std::min<int64_t>(1024, p.hidden / V));
  const size_t bytes = size_t(p.hidden) * sizeof(float);
  const cudaError_t status = cudaFuncSetAttribute(StagedSumsKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  if (status != cudaSuccess) return status;
  return LaunchWithSharedMemory(StagedSumsKernel, dim3(unsigned(p.rows)), dim3(threads), bytes, stream, true, p.input,
                                p.residual, p.weight, p.hidden, 1e-6f);
}

cudaError_t LaunchShipped(const Rows& p, cudaStream_t stream) {
  const RowLayout rows{1, p.hidden, 0};
  NormParams<bf16, bf16> params{p.input, rows, p.input, rows, p.residual, rows, p.weight, nullptr,
                                p.hidden, p.rows, 1e-6f, 0.f};
  return Norm<NormKind::kFusedAddRMS>(params, 0, stream, true);
}

using LaunchFn = std::function<cudaError_t(const Rows&, cudaStream_t)>;
struct Variant {
  std::string name;
  LaunchFn launch;
};

// i: vectors a thread; p: weights prefetched beside the row; L: residual written in pass 2; T:
// trigger at the end.
std::vector<Variant> kVariants = {
    {"shipped", LaunchShipped},
    {"4 early-res", LaunchFused<4, false, false, false>},
    {"4 late-res", LaunchFused<4, false, true, false>},
    {"4 early-res p", LaunchFused<4, true, false, false>},
    {"4 late-res p", LaunchFused<4, true, true, false>},
    {"2 early-res", LaunchFused<2, false, false, false>},
    {"2 late-res", LaunchFused<2, false, true, false>},
    {"2 early-res p", LaunchFused<2, true, false, false>},
    {"2 late-res p", LaunchFused<2, true, true, false>},
    {"1 early-res p", LaunchFused<1, true, false, false>},
    {"1 late-res p", LaunchFused<1, true, true, false>},
    {"1 early-res p T", LaunchFused<1, true, false, true>},
    {"4 early-res p T", LaunchFused<4, true, false, true>},
    {"staged sums", LaunchStagedSums},
};

float Bf(bf16 v) { return __bfloat162float(v); }

__global__ void Fill(bf16* x, size_t n, unsigned seed) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  unsigned h = unsigned(i) * 2654435761u ^ unsigned(i >> 32) * 40503u ^ seed * 2246822519u;
  h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
  x[i] = __float2bfloat16(float(h >> 8) * (6.f / 16777216.f) - 3.f);
}

// The worst output error over sampled rows, in units of the bf16 spacing at the reference
// (0.5 is the floor), and whether every residual is the float sum rounded.
struct Check {
  double worst_ulps = 0;
  bool residual_ok = true;
};

Check CheckRows(const std::vector<bf16>& x0, const std::vector<bf16>& r0, const std::vector<bf16>& w,
                const std::vector<bf16>& x1, const std::vector<bf16>& r1, int64_t hidden) {
  Check c;
  double sq = 0;
  std::vector<double> s(hidden);
  for (int64_t i = 0; i < hidden; ++i) {
    s[i] = double(float(Bf(x0[i])) + float(Bf(r0[i])));
    sq += s[i] * s[i];
    if (Bf(r1[i]) != Bf(__float2bfloat16(float(s[i])))) c.residual_ok = false;
  }
  const double scale = 1.0 / std::sqrt(sq / hidden + 1e-6);
  for (int64_t i = 0; i < hidden; ++i) {
    const double want = s[i] * scale * Bf(w[i]);
    const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(want), 1e-30)) - 7);
    c.worst_ulps = std::max(c.worst_ulps, std::fabs(Bf(x1[i]) - want) / ulp);
  }
  return c;
}

// With the argument "shipped", only aotinfer::Norm (to time another version of norm.cuh).
int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "shipped") kVariants.resize(1);
  const size_t flush_bytes = size_t(256) << 20;
  char* flush;
  CHECK(cudaMalloc(&flush, flush_bytes));
  auto flush_l2 = [&] { CHECK(cudaMemsetAsync(flush, 0, flush_bytes)); };
  const int64_t shapes[][2] = {{4096, 4096}, {4096, 8192}, {16384, 4096}, {16384, 8192}};
  std::printf("fused_add_rmsnorm, bf16: bandwidth as a ratio to cudaMemcpy of the same bytes (two passes);\n"
              "worst error in bf16 ulps of the float64 reference of the float sum (0.5: rounding only)\n");
  std::printf("%-18s", "variant");
  for (auto& s : shapes) std::printf("   %5lldx%-5lld    ", (long long)s[0], (long long)s[1]);
  std::printf("  ulps\n");
  const size_t nv = kVariants.size();
  std::vector<std::vector<double>> ratio(nv + 1, std::vector<double>(8, 0));
  std::vector<double> ulps(nv, 0);
  std::vector<bool> res_ok(nv, true);
  for (int pass = 0; pass < 2; ++pass) {
    for (int si = 0; si < 4; ++si) {
      const int64_t rows = shapes[si][0], hidden = shapes[si][1];
      const size_t n = size_t(rows) * hidden;
      bf16 *x, *r, *x0, *r0, *w;
      CHECK(cudaMalloc(&x, n * 2));
      CHECK(cudaMalloc(&r, n * 2));
      CHECK(cudaMalloc(&x0, n * 2));
      CHECK(cudaMalloc(&r0, n * 2));
      CHECK(cudaMalloc(&w, hidden * 2));
      Fill<<<unsigned((n + 255) / 256), 256>>>(x0, n, 1 + si);
      Fill<<<unsigned((n + 255) / 256), 256>>>(r0, n, 100 + si);
      Fill<<<unsigned((hidden + 255) / 256), 256>>>(w, hidden, 7);
      CHECK(cudaGetLastError());
      const size_t bytes = 4 * n * 2;
      char* scratch;
      CHECK(cudaMalloc(&scratch, bytes));
      const float copy_ms = median_ms([&] { CHECK(cudaMemcpyAsync(scratch + bytes / 2, scratch, bytes / 2, cudaMemcpyDeviceToDevice)); },
                                      5, 30, flush_l2);
      const Rows p{x, r, w, hidden, rows};
      for (size_t vi = 0; vi < nv; ++vi) {
        if (pass == 0) {
          CHECK(cudaMemcpy(x, x0, n * 2, cudaMemcpyDeviceToDevice));
          CHECK(cudaMemcpy(r, r0, n * 2, cudaMemcpyDeviceToDevice));
          CHECK(kVariants[vi].launch(p, nullptr));
          std::vector<bf16> hx0(hidden), hr0(hidden), hx1(hidden), hr1(hidden), hw(hidden);
          CHECK(cudaMemcpy(hw.data(), w, hidden * 2, cudaMemcpyDeviceToHost));
          for (int64_t k = 0; k < rows; k += k % 2 ? 97 : 1) {
            const int64_t row = std::min(k, rows - 1);
            CHECK(cudaMemcpy(hx0.data(), x0 + row * hidden, hidden * 2, cudaMemcpyDeviceToHost));
            CHECK(cudaMemcpy(hr0.data(), r0 + row * hidden, hidden * 2, cudaMemcpyDeviceToHost));
            CHECK(cudaMemcpy(hx1.data(), x + row * hidden, hidden * 2, cudaMemcpyDeviceToHost));
            CHECK(cudaMemcpy(hr1.data(), r + row * hidden, hidden * 2, cudaMemcpyDeviceToHost));
            const Check c = CheckRows(hx0, hr0, hw, hx1, hr1, hidden);
            ulps[vi] = std::max(ulps[vi], c.worst_ulps);
            res_ok[vi] = res_ok[vi] && c.residual_ok;
          }
        }
        // Timed on its own output: the values stay finite (normalized rows, residuals that grow
        // by one row a call; the data differ from the check's, the bytes moved do not).
        CHECK(cudaMemcpy(x, x0, n * 2, cudaMemcpyDeviceToDevice));
        CHECK(cudaMemcpy(r, r0, n * 2, cudaMemcpyDeviceToDevice));
        const float ms = median_ms([&] { CHECK(kVariants[vi].launch(p, nullptr)); }, 5, 30, flush_l2);
        ratio[vi][pass * 4 + si] = copy_ms / ms;
      }
      double best = 0;
      for (int c = 0; c < streaming::kNumConfigs; ++c) {
        const void* reads[2] = {x, r};
        void* writes[2] = {x0, r0};
        const float ms = median_ms([&] { CHECK(cudaError_t(streaming_run(reads, 2, writes, 2, int64_t(n) * 2 / 16, c, nullptr))); },
                                   5, 30, flush_l2);
        best = std::max(best, double(copy_ms / ms));
      }
      ratio[nv][pass * 4 + si] = best;
      for (void* ptr : {(void*)x, (void*)r, (void*)x0, (void*)r0, (void*)w, (void*)scratch}) CHECK(cudaFree(ptr));
    }
  }
  for (size_t vi = 0; vi <= nv; ++vi) {
    std::printf("%-18s", vi < nv ? kVariants[vi].name.c_str() : "stream (best)");
    for (int si = 0; si < 4; ++si) std::printf("   %.3f/%.3f  ", ratio[vi][si], ratio[vi][4 + si]);
    if (vi < nv) std::printf("  %.2f%s", ulps[vi], res_ok[vi] ? "" : " RESIDUAL WRONG");
    std::printf("\n");
  }

  std::printf("\ngraph replay of 20 launches (PDL), hidden 4096, us per launch (two passes)\n");
  std::printf("%-18s %13s %13s %13s %13s\n", "variant", "1", "8", "32", "128");
  std::vector<std::vector<double>> lat(nv, std::vector<double>(8, 0));
  for (int pass = 0; pass < 2; ++pass) {
    for (int ti = 0; ti < 4; ++ti) {
      const int64_t tokens = (int64_t[]){1, 8, 32, 128}[ti], hidden = 4096;
      bf16 *x, *r, *w;
      CHECK(cudaMalloc(&x, tokens * hidden * 2));
      CHECK(cudaMalloc(&r, tokens * hidden * 2));
      CHECK(cudaMalloc(&w, hidden * 2));
      Fill<<<unsigned((tokens * hidden + 255) / 256), 256>>>(x, tokens * hidden, 3);
      Fill<<<unsigned((tokens * hidden + 255) / 256), 256>>>(r, tokens * hidden, 4);
      Fill<<<unsigned((hidden + 255) / 256), 256>>>(w, hidden, 5);
      cudaStream_t stream;
      CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      const Rows p{x, r, w, hidden, tokens};
      for (size_t vi = 0; vi < nv; ++vi) {
        lat[vi][pass * 4 + ti] = GraphReplayUs([&](cudaStream_t s) { return kVariants[vi].launch(p, s); }, stream);
      }
      CHECK(cudaStreamDestroy(stream));
      for (void* ptr : {(void*)x, (void*)r, (void*)w}) CHECK(cudaFree(ptr));
    }
  }
  for (size_t vi = 0; vi < nv; ++vi) {
    std::printf("%-18s", kVariants[vi].name.c_str());
    for (int ti = 0; ti < 4; ++ti) std::printf("   %4.2f/%4.2f  ", lat[vi][ti], lat[vi][4 + ti]);
    std::printf("\n");
  }
}
