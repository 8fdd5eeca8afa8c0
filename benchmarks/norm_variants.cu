// Design experiment for include/aotinfer/norm.cuh: which row shape (threads per row x vectors per
// thread x rows per block) reaches the copy bandwidth for RMSNorm and the fused add + RMSNorm, on
// bf16 rows of 4096 and 8192. Each variant is the shipped NormKernel with another launch shape;
// its first row is checked against a host reference, then it is timed (CUDA events, median of 30
// after 5 warm-ups) beside cudaMemcpyAsync of the same number of bytes. Results: benchmarks/NOTES.md.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I include benchmarks/norm_variants.cu
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "aotinfer/norm.cuh"
#include "cuda_timer.cuh"

using namespace aotinfer;
using bf16 = __nv_bfloat16;

struct Shape {
  int threads, items, rows_per_block;
  bool prefetch;  // weights loaded beside the row, before the reduction
};

template <NormKind kKind, int kItems>
void launch(const NormParams<bf16, bf16>& p, Shape s) {
  const dim3 block(unsigned(s.threads), unsigned(s.rows_per_block));
  const dim3 grid(unsigned((p.num_rows + s.rows_per_block - 1) / s.rows_per_block));
  if (s.prefetch) {
    NormKernel<kKind, bf16, bf16, 8, kItems, true><<<grid, block>>>(p);
  } else {
    NormKernel<kKind, bf16, bf16, 8, kItems, false><<<grid, block>>>(p);
  }
}

template <NormKind kKind>
void launch_shape(const NormParams<bf16, bf16>& p, Shape s) {
  switch (s.items) {
    case 1: return launch<kKind, 1>(p, s);
    case 2: return launch<kKind, 2>(p, s);
    case 4: return launch<kKind, 4>(p, s);
    case 8: return launch<kKind, 8>(p, s);
  }
}

template <NormKind kKind>
void run(const char* name, int64_t rows, int64_t hidden, const std::vector<Shape>& shapes) {
  const size_t n = size_t(rows) * hidden;
  std::vector<bf16> h(n), hw(hidden);
  srand(7);
  for (auto& v : h) v = __float2bfloat16(float(rand()) / RAND_MAX * 4.f - 2.f);
  for (auto& v : hw) v = __float2bfloat16(float(rand()) / RAND_MAX * 2.f - 1.f);
  bf16 *x, *res, *out, *w, *scratch;
  CHECK(cudaMalloc(&x, n * 2));
  CHECK(cudaMalloc(&res, n * 2));
  CHECK(cudaMalloc(&out, n * 2));
  CHECK(cudaMalloc(&w, hidden * 2));
  CHECK(cudaMalloc(&scratch, n * 2 * 4));
  CHECK(cudaMemcpy(w, hw.data(), hidden * 2, cudaMemcpyHostToDevice));
  const bool fused = kKind == NormKind::kFusedAddRMS;
  const size_t bytes = (fused ? 4 : 2) * n * 2;  // read input (+ residual), write out (+ residual)
  char* half = reinterpret_cast<char*>(scratch);
  const float copy_ms = median_ms([&] { CHECK(cudaMemcpyAsync(half + bytes / 2, half, bytes / 2, cudaMemcpyDeviceToDevice)); }, 5, 30);
  const double copy_bw = bytes / copy_ms / 1e6;
  std::printf("%-18s %6lld x %5lld  same-size cudaMemcpy %7.1f us %6.0f GB/s\n", name, (long long)rows,
              (long long)hidden, copy_ms * 1e3, copy_bw);
  NormParams<bf16, bf16> p{fused ? x : out, {1, hidden, 0}, x, {1, hidden, 0}, res, {1, hidden, 0},
                           w, nullptr, hidden, rows, 1e-6f, 0.f};
  for (const Shape& s : shapes) {
    // Check row 0 against the host: fresh input and residual, one launch.
    CHECK(cudaMemcpy(x, h.data(), n * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(res, h.data() + 1, (n - 1) * 2, cudaMemcpyHostToDevice));
    launch_shape<kKind>(p, s);
    CHECK(cudaGetLastError());
    std::vector<bf16> got(hidden);
    CHECK(cudaMemcpy(got.data(), fused ? x : out, hidden * 2, cudaMemcpyDeviceToHost));
    double sum = 0;
    std::vector<double> v(hidden);
    for (int64_t i = 0; i < hidden; ++i) {
      v[i] = double(__bfloat162float(h[i])) + (fused ? double(__bfloat162float(h[i + 1])) : 0.0);
      sum += v[i] * v[i];
    }
    const double scale = 1.0 / std::sqrt(sum / hidden + 1e-6);
    double worst = 0;
    for (int64_t i = 0; i < hidden; ++i) {
      const double want = v[i] * scale * double(__bfloat162float(hw[i]));
      worst = std::max(worst, std::fabs(double(__bfloat162float(got[i])) - want) / (1.0 + std::fabs(want)));
    }
    const float ms = median_ms([&] { launch_shape<kKind>(p, s); }, 5, 30);
    CHECK(cudaGetLastError());
    const double bw = bytes / ms / 1e6;
    std::printf("  %4d threads x %d vectors, %d rows/block, weights %-6s %7.1f us %6.0f GB/s  %.3f of same-size copy%s\n",
                s.threads, s.items, s.rows_per_block, s.prefetch ? "first" : "after", ms * 1e3, bw, bw / copy_bw,
                worst < 2e-2 ? "" : "  WRONG");
  }
  CHECK(cudaFree(x));
  CHECK(cudaFree(res));
  CHECK(cudaFree(out));
  CHECK(cudaFree(w));
  CHECK(cudaFree(scratch));
}

int main() {
  const std::vector<Shape> h4096 = {{512, 1, 1, true}, {128, 4, 1, true}, {128, 4, 1, false}, {256, 2, 1, false}};
  const std::vector<Shape> h8192 = {{512, 2, 1, true}, {512, 2, 1, false}, {256, 4, 1, false}, {128, 8, 1, false}};
  for (int64_t rows : {4096, 16384}) {
    run<NormKind::kRMS>("rmsnorm", rows, 4096, h4096);
    run<NormKind::kRMS>("rmsnorm", rows, 8192, h8192);
    run<NormKind::kFusedAddRMS>("fused_add_rmsnorm", rows, 4096, h4096);
    run<NormKind::kFusedAddRMS>("fused_add_rmsnorm", rows, 8192, h8192);
  }
  float ms;
  {
    void *a, *b;
    CHECK(cudaMalloc(&a, 1 << 30));
    CHECK(cudaMalloc(&b, 1 << 30));
    ms = median_ms([&] { CHECK(cudaMemcpyAsync(b, a, 1 << 30, cudaMemcpyDeviceToDevice)); }, 5, 30);
    std::printf("1 GiB cudaMemcpy: %.0f GB/s\n", 2.0 * (1 << 30) / ms / 1e6);
  }
}
