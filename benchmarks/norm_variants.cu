// Design experiment for include/aotinfer/norm.cuh: which row shape (threads per row x vectors per
// thread x rows per block) and which time to load the weights reach the copy bandwidth for
// RMSNorm, the fused add + RMSNorm and LayerNorm (float32 and bf16 weights), on bf16 rows of 4096
// and 8192. Each variant is the shipped NormKernel with its own template arguments and launch
// shape; its first row is checked against a host reference, then it is timed (CUDA events, median
// of 30 after 5 warm-ups) beside cudaMemcpyAsync of the same number of bytes. Results:
// benchmarks/NOTES.md.
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
  int threads, items, rows_per_block, rows_per_thread;
  WeightLoad weights;
};

const char* WeightName(WeightLoad w) {
  return w == WeightLoad::kWithRow ? "with row" : w == WeightLoad::kAfterSum ? "after sum" : "per slot";
}

template <NormKind kKind, typename W, int kItems, int kRows>
void launch_rows(const NormParams<bf16, W>& p, Shape s) {
  const dim3 block(unsigned(s.threads), unsigned(s.rows_per_block));
  const int64_t rows_per_block = int64_t(s.rows_per_block) * kRows;
  const dim3 grid(unsigned((p.num_rows + rows_per_block - 1) / rows_per_block));
  if (s.weights == WeightLoad::kPerSlot) {
    NormKernel<kKind, bf16, W, 8, kItems, kRows, WeightLoad::kPerSlot><<<grid, block>>>(p);
  } else {
    NormKernel<kKind, bf16, W, 8, kItems, kRows, WeightLoad::kAfterSum><<<grid, block>>>(p);
  }
}

template <NormKind kKind, typename W, int kItems>
void launch_items(const NormParams<bf16, W>& p, Shape s) {
  if (s.rows_per_thread == 2) return launch_rows<kKind, W, kItems, 2>(p, s);
  return launch_rows<kKind, W, kItems, 1>(p, s);
}

template <NormKind kKind, typename W>
void launch_shape(const NormParams<bf16, W>& p, Shape s) {
  switch (s.items) {
    case 2: return launch_items<kKind, W, 2>(p, s);
    case 4: return launch_items<kKind, W, 4>(p, s);
    case 8: return launch_items<kKind, W, 8>(p, s);
  }
}

float ToFloat(bf16 v) { return __bfloat162float(v); }
float ToFloat(float v) { return v; }
template <typename W>
W FromFloat(float v) { return W(v); }
template <>
bf16 FromFloat<bf16>(float v) { return __float2bfloat16(v); }

// One row of the output against a double-precision host reference (the residual is the input
// shifted by one element).
template <NormKind kKind, typename W>
double worst_error(const std::vector<bf16>& h, const std::vector<W>& hw, const std::vector<W>& hb,
                   const bf16* got, int64_t row, int64_t hidden) {
  const bf16* x = h.data() + row * hidden;
  const bool fused = kKind == NormKind::kFusedAddRMS;
  std::vector<double> v(hidden);
  double sum = 0, sum_sq = 0;
  for (int64_t i = 0; i < hidden; ++i) {
    v[i] = double(ToFloat(x[i])) + (fused ? double(ToFloat(x[i + 1])) : 0.0);
    sum += v[i];
  }
  const double mean = kKind == NormKind::kLayer ? sum / hidden : 0.0;
  for (int64_t i = 0; i < hidden; ++i) sum_sq += (v[i] - mean) * (v[i] - mean);
  const double scale = 1.0 / std::sqrt(sum_sq / hidden + 1e-6);
  double worst = 0;
  for (int64_t i = 0; i < hidden; ++i) {
    const double want = (v[i] - mean) * scale * double(ToFloat(hw[i])) +
                        (kKind == NormKind::kLayer ? double(ToFloat(hb[i])) : 0.0);
    worst = std::max(worst, std::fabs(double(ToFloat(got[i])) - want) / (1.0 + std::fabs(want)));
  }
  return worst;
}

template <NormKind kKind, typename W>
void run(const char* name, int64_t rows, int64_t hidden, const std::vector<Shape>& shapes) {
  const size_t n = size_t(rows) * hidden;
  std::vector<bf16> h(n + 1);  // the residual is h[1:]
  std::vector<W> hw(hidden), hb(hidden);
  srand(7);
  for (auto& v : h) v = __float2bfloat16(float(rand()) / RAND_MAX * 4.f - 2.f);
  for (auto& v : hw) v = FromFloat<W>(float(rand()) / RAND_MAX * 2.f - 1.f);
  for (auto& v : hb) v = FromFloat<W>(float(rand()) / RAND_MAX * 2.f - 1.f);
  bf16 *x, *res, *out, *scratch;
  W *w, *b;
  CHECK(cudaMalloc(&x, n * 2));
  CHECK(cudaMalloc(&res, n * 2));
  CHECK(cudaMalloc(&out, n * 2));
  CHECK(cudaMalloc(&w, hidden * sizeof(W)));
  CHECK(cudaMalloc(&b, hidden * sizeof(W)));
  CHECK(cudaMalloc(&scratch, n * 2 * 4));
  CHECK(cudaMemcpy(w, hw.data(), hidden * sizeof(W), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(b, hb.data(), hidden * sizeof(W), cudaMemcpyHostToDevice));
  const bool fused = kKind == NormKind::kFusedAddRMS;
  const size_t bytes = (fused ? 4 : 2) * n * 2;  // read input (+ residual), write out (+ residual)
  char* half = reinterpret_cast<char*>(scratch);
  const float copy_ms = median_ms([&] { CHECK(cudaMemcpyAsync(half + bytes / 2, half, bytes / 2, cudaMemcpyDeviceToDevice)); }, 5, 30);
  const double copy_bw = bytes / copy_ms / 1e6;
  std::printf("%-18s %6lld x %5lld  same-size cudaMemcpy %7.1f us %6.0f GB/s\n", name, (long long)rows,
              (long long)hidden, copy_ms * 1e3, copy_bw);
  NormParams<bf16, W> p{fused ? x : out, {1, hidden, 0}, x, {1, hidden, 0}, res, {1, hidden, 0},
                        w, b, hidden, rows, 1e-6f, 0.f};
  for (const Shape& s : shapes) {
    // Check the first two rows and the last against the host: fresh input and residual, one launch.
    CHECK(cudaMemcpy(x, h.data(), n * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(res, h.data() + 1, n * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemset(out, 0xff, n * 2));
    launch_shape<kKind>(p, s);
    CHECK(cudaGetLastError());
    std::vector<bf16> got(n);
    CHECK(cudaMemcpy(got.data(), fused ? x : out, n * 2, cudaMemcpyDeviceToHost));
    double worst = 0;
    for (int64_t row : {int64_t(0), int64_t(1), rows - 1}) {
      worst = std::max(worst, worst_error<kKind>(h, hw, hb, got.data() + row * hidden, row, hidden));
    }
    const float ms = median_ms([&] { launch_shape<kKind>(p, s); }, 5, 30);
    CHECK(cudaGetLastError());
    const double bw = bytes / ms / 1e6;
    std::printf("  %4d threads x %d vectors, %d rows/thread, weights %-9s %7.1f us %6.0f GB/s  %.3f of same-size copy%s\n",
                s.threads, s.items, s.rows_per_thread, WeightName(s.weights), ms * 1e3, bw, bw / copy_bw,
                worst < 2e-2 ? "" : "  WRONG");
  }
  CHECK(cudaFree(x));
  CHECK(cudaFree(res));
  CHECK(cudaFree(out));
  CHECK(cudaFree(w));
  CHECK(cudaFree(b));
  CHECK(cudaFree(scratch));
}

int main() {
  constexpr auto kAfterSum = WeightLoad::kAfterSum, kPerSlot = WeightLoad::kPerSlot;
  const std::vector<Shape> h4096 = {{128, 4, 1, 1, kPerSlot}, {128, 4, 1, 2, kPerSlot}, {128, 4, 1, 2, kAfterSum},
                                    {256, 2, 1, 1, kPerSlot}, {256, 2, 1, 2, kPerSlot}};
  const std::vector<Shape> h8192 = {{256, 4, 1, 1, kPerSlot}, {256, 4, 1, 2, kPerSlot}, {256, 4, 1, 2, kAfterSum},
                                    {128, 8, 1, 1, kPerSlot}, {128, 8, 1, 2, kPerSlot}};
  for (int64_t rows : {4096, 16384}) {
    for (int64_t hidden : {4096, 8192}) {
      const auto& shapes = hidden == 4096 ? h4096 : h8192;
      run<NormKind::kRMS, bf16>("rmsnorm", rows, hidden, shapes);
      run<NormKind::kFusedAddRMS, bf16>("fused_add_rmsnorm", rows, hidden, shapes);
      run<NormKind::kLayer, float>("layernorm fp32 w", rows, hidden, shapes);
      run<NormKind::kLayer, bf16>("layernorm bf16 w", rows, hidden, shapes);
    }
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
