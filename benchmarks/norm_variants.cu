// Design experiment for include/aotinfer/norm.cuh: the per-row kernel (NormKernel through
// LaunchNormVec) against NormStagedKernel, which walks rows with a grid that fills the GPU, keeps
// the weights in registers and stages rows through shared memory (4 vectors a thread, 3 or 4
// stages, whatever the grid's length); for RMSNorm and LayerNorm (float32 and bf16 weights) on
// bf16 rows, 1024-16384 x 4096 and 8192. Each variant's output is checked against a host
// reference on a sample of rows, then timed (CUDA events, L2 flushed before each call, median of
// 30 after 5 warm-ups) beside cudaMemcpyAsync of the same number of bytes, timed the same way.
// With an argument, each variant runs once on 4096 x 4096, for ncu. Results: docs/design/norm.md#staged-kernel.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I include -I benchmarks benchmarks/norm_variants.cu
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "aotinfer/norm.cuh"
#include "cuda_timer.cuh"

using namespace aotinfer;
using bf16 = __nv_bfloat16;

struct Variant {
  int items;   // vectors a thread in NormStagedKernel; 0: the per-row kernel
  int stages;  // rows staged a block
};

template <NormKind kKind, typename W, int kItems, int kStages>
cudaError_t LaunchStaged(const NormParams<bf16, W>& p) {
  constexpr int V = 8;
  const int64_t grid = NormStagedGrid<kKind, bf16, W, V, kItems, kStages>(p, p.num_rows, 0);
  if (grid == 0) {
    std::printf("  (staged %d x %d not taken)\n", kItems, kStages);
    return cudaErrorInvalidValue;
  }
  const int64_t num_vecs = p.hidden / V;
  return LaunchWithSharedMemory(NormStagedKernel<kKind, bf16, W, V, kItems, kStages>, dim3(unsigned(grid)),
                                dim3(unsigned(num_vecs / kItems)), size_t(kStages) * num_vecs * 16, nullptr, false, p);
}

template <NormKind kKind, typename W>
cudaError_t launch(const NormParams<bf16, W>& p, Variant v) {
  if (v.items == 0) return LaunchNormKernel<kKind, bf16, W, 8>(p, nullptr, false);
  if (v.items == 4 && v.stages == 3) return LaunchStaged<kKind, W, 4, 3>(p);
  if (v.items == 4 && v.stages == 4) return LaunchStaged<kKind, W, 4, 4>(p);
  return cudaErrorInvalidValue;
}

float ToFloat(bf16 v) { return __bfloat162float(v); }
float ToFloat(float v) { return v; }
template <typename W>
W FromFloat(float v) { return W(v); }
template <>
bf16 FromFloat<bf16>(float v) { return __float2bfloat16(v); }

// One row of the output against a double-precision host reference: the worst error relative to
// 1 + |expected|.
template <NormKind kKind, typename W>
double worst_error(const std::vector<bf16>& h, const std::vector<W>& hw, const std::vector<W>& hb,
                   const bf16* got, int64_t row, int64_t hidden) {
  const bf16* x = h.data() + row * hidden;
  double sum = 0, sum_sq = 0;
  for (int64_t i = 0; i < hidden; ++i) sum += ToFloat(x[i]);
  const double mean = kKind == NormKind::kLayer ? sum / hidden : 0.0;
  for (int64_t i = 0; i < hidden; ++i) sum_sq += (ToFloat(x[i]) - mean) * (ToFloat(x[i]) - mean);
  const double scale = 1.0 / std::sqrt(sum_sq / hidden + 1e-6);
  double worst = 0;
  for (int64_t i = 0; i < hidden; ++i) {
    const double want = (ToFloat(x[i]) - mean) * scale * double(ToFloat(hw[i])) +
                        (kKind == NormKind::kLayer ? double(ToFloat(hb[i])) : 0.0);
    worst = std::max(worst, std::fabs(double(ToFloat(got[i])) - want) / (1.0 + std::fabs(want)));
  }
  return worst;
}

template <NormKind kKind, typename W>
void run(const char* name, int64_t rows, int64_t hidden, const std::vector<Variant>& variants, char* flush,
         size_t flush_bytes, bool timed = true) {
  const size_t n = size_t(rows) * hidden;
  std::vector<bf16> h(n);
  std::vector<W> hw(hidden), hb(hidden);
  srand(7);
  // Each row its own offset, so that a pivot or mean taken from the wrong row shows.
  for (size_t i = 0; i < n; ++i) h[i] = __float2bfloat16(float(rand()) / RAND_MAX * 4.f - 2.f + float(i / hidden % 13));
  for (auto& v : hw) v = FromFloat<W>(float(rand()) / RAND_MAX * 2.f - 1.f);
  for (auto& v : hb) v = FromFloat<W>(float(rand()) / RAND_MAX * 2.f - 1.f);
  bf16 *x, *out, *scratch;
  W *w, *b;
  CHECK(cudaMalloc(&x, n * 2));
  CHECK(cudaMalloc(&out, n * 2));
  CHECK(cudaMalloc(&w, hidden * sizeof(W)));
  CHECK(cudaMalloc(&b, hidden * sizeof(W)));
  CHECK(cudaMalloc(&scratch, n * 2 * 2));
  CHECK(cudaMemcpy(x, h.data(), n * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(w, hw.data(), hidden * sizeof(W), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(b, hb.data(), hidden * sizeof(W), cudaMemcpyHostToDevice));
  const size_t bytes = 2 * n * 2;  // read the input, write the output
  auto flush_l2 = [&] { CHECK(cudaMemsetAsync(flush, 0, flush_bytes)); };
  char* half = reinterpret_cast<char*>(scratch);
  const float copy_ms = median_ms([&] { CHECK(cudaMemcpyAsync(half + bytes / 2, half, bytes / 2, cudaMemcpyDeviceToDevice)); },
                                  timed ? 5 : 0, timed ? 30 : 1, flush_l2);
  const double copy_bw = bytes / copy_ms / 1e6;
  std::printf("%-18s %6lld x %5lld  same-size cudaMemcpy %7.1f us %6.0f GB/s\n", name, (long long)rows,
              (long long)hidden, copy_ms * 1e3, copy_bw);
  NormParams<bf16, W> p{out, {1, hidden, 0}, x, {1, hidden, 0}, nullptr, {}, w, b, hidden, rows, 1e-6f, 0.f};
  for (const Variant& v : variants) {
    CHECK(cudaMemset(out, 0xff, n * 2));
    CHECK(launch<kKind>(p, v));
    std::vector<bf16> got(n);
    CHECK(cudaMemcpy(got.data(), out, n * 2, cudaMemcpyDeviceToHost));
    double worst = 0;
    for (int64_t row = 0; row < rows; row += (row % 3 == 0 ? 1 : 97)) {
      worst = std::max(worst, worst_error<kKind>(h, hw, hb, got.data() + row * hidden, row, hidden));
    }
    worst = std::max(worst, worst_error<kKind>(h, hw, hb, got.data() + (rows - 1) * hidden, rows - 1, hidden));
    if (!timed) continue;
    const float ms = median_ms([&] { CHECK(launch<kKind>(p, v)); }, 5, 30, flush_l2);
    const double bw = bytes / ms / 1e6;
    char label[32];
    std::snprintf(label, sizeof(label), v.items ? "staged %d x %d" : "per-row",
                  v.items, v.stages);
    std::printf("  %-16s %7.1f us %6.0f GB/s  %.3f of same-size copy%s\n", label, ms * 1e3, bw, bw / copy_bw,
                worst < 2e-2 ? "" : "  WRONG");
  }
  CHECK(cudaFree(x));
  CHECK(cudaFree(out));
  CHECK(cudaFree(w));
  CHECK(cudaFree(b));
  CHECK(cudaFree(scratch));
}

int main(int argc, char**) {
  const size_t flush_bytes = size_t(256) << 20;
  char* flush;
  CHECK(cudaMalloc(&flush, flush_bytes));
  const std::vector<Variant> variants = {{0, 0}, {4, 3}, {4, 4}};
  if (argc > 1) {  // for the profiler: LayerNorm (float32 weights) on 4096 x 4096, once each
    run<NormKind::kLayer, float>("layernorm fp32 w", 4096, 4096, {{0, 0}, {4, 4}}, flush, flush_bytes, false);
    return 0;
  }
  for (int64_t rows : {1024, 2048, 4096, 8192, 16384}) {
    for (int64_t hidden : {4096, 8192}) {
      run<NormKind::kLayer, float>("layernorm fp32 w", rows, hidden, variants, flush, flush_bytes);
      run<NormKind::kLayer, bf16>("layernorm bf16 w", rows, hidden, variants, flush, flush_bytes);
      run<NormKind::kRMS, bf16>("rmsnorm", rows, hidden, variants, flush, flush_bytes);
    }
  }
  // Host time of a launch (the staged launcher's occupancy is asked once per device and block size).
  {
    const int64_t rows = 4096, hidden = 4096;
    bf16 *x, *out;
    float *w;
    CHECK(cudaMalloc(&x, rows * hidden * 2));
    CHECK(cudaMalloc(&out, rows * hidden * 2));
    CHECK(cudaMalloc(&w, hidden * 4));
    NormParams<bf16, float> p{out, {1, hidden, 0}, x, {1, hidden, 0}, nullptr, {}, w, w, hidden, rows, 1e-6f, 0.f};
    for (Variant v : {Variant{0, 0}, Variant{4, 3}}) {
      for (int i = 0; i < 50; ++i) CHECK(launch<NormKind::kLayer>(p, v));
      CHECK(cudaDeviceSynchronize());
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < 200; ++i) CHECK(launch<NormKind::kLayer>(p, v));
      const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
      CHECK(cudaDeviceSynchronize());
      std::printf("host time a launch, %s: %.2f us\n", v.items ? "staged 4 x 3" : "per-row", us / 200);
    }
  }
  void *a, *b;
  CHECK(cudaMalloc(&a, 1 << 30));
  CHECK(cudaMalloc(&b, 1 << 30));
  const float ms = median_ms([&] { CHECK(cudaMemcpyAsync(b, a, 1 << 30, cudaMemcpyDeviceToDevice)); }, 5, 30);
  std::printf("1 GiB cudaMemcpy: %.0f GB/s\n", 2.0 * (1 << 30) / ms / 1e6);
}
