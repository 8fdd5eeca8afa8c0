// Design experiment for include/aotinfer/norm.cuh: which row shape (threads per row x vectors per
// thread) and which time to load the weights reach the copy bandwidth for RMSNorm, the fused add +
// RMSNorm and LayerNorm (float32 and bf16 weights), on bf16 rows of 4096 and 8192; and whether
// LayerNorm gains from keeping its weights in registers across rows (LayerNormResident). Each
// variant's first two rows and its last are checked against a host reference, then it is timed
// (CUDA events, median of 30 after 5 warm-ups) beside cudaMemcpyAsync of the same number of
// bytes. Results: benchmarks/NOTES.md.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I include -I benchmarks benchmarks/norm_variants.cu
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
  int threads, items;
  bool weights_first;     // weights loaded beside the row, before the reduction
  bool resident = false;  // LayerNormResident below instead of NormKernel
};

// LayerNorm variant: a grid of as many blocks as fit, each walking rows blockIdx.x, + gridDim.x,
// ...; a thread loads its gamma and beta once and keeps them in registers, and the next row's
// loads are in flight while the current row is reduced and written. Rows fit the block exactly
// (hidden == blockDim.x * kItems * 8).
template <typename W, int kItems>
__global__ void __launch_bounds__(256) LayerNormResident(const NormParams<bf16, W> p) {
  __shared__ float2 shared[1][32];
  Vec<W, 8> w[kItems], b[kItems];
  Vec<bf16, 8> x[kItems], next[kItems];
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int64_t j = threadIdx.x + int64_t(k) * blockDim.x;
    w[k].load(p.weight + j * 8);
    b[k].load(p.bias + j * 8);
  }
  int64_t row = blockIdx.x;
  float pivot = 0.f, next_pivot = 0.f;
  if (row < p.num_rows) {
    const bf16* in = p.input + row * p.hidden;
    pivot = to_float(in[0]);
#pragma unroll
    for (int k = 0; k < kItems; ++k) x[k].load(in + (threadIdx.x + int64_t(k) * blockDim.x) * 8);
  }
  for (; row < p.num_rows; row += gridDim.x) {
    const int64_t next_row = row + gridDim.x;
    if (next_row < p.num_rows) {
      const bf16* in = p.input + next_row * p.hidden;
      next_pivot = to_float(in[0]);
#pragma unroll
      for (int k = 0; k < kItems; ++k) next[k].load(in + (threadIdx.x + int64_t(k) * blockDim.x) * 8);
    }
    float sum = 0.f, sum_sq = 0.f;
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float v = to_float(x[k][e]) - pivot;
        sum += v;
        sum_sq += v * v;
      }
    }
    const float2 totals = RowSum(make_float2(sum, sum_sq), shared);
    const float n = float(p.hidden);
    const float mean = totals.x / n;
    const float scale = rsqrtf(fmaxf(totals.y / n - mean * mean, 0.f) + p.eps);
    bf16* out = p.out + row * p.hidden;
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      Vec<bf16, 8> y;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        y[e] = from_float<bf16>((to_float(x[k][e]) - pivot - mean) * scale * to_float(w[k][e]) + to_float(b[k][e]));
      }
      y.store(out + (threadIdx.x + int64_t(k) * blockDim.x) * 8);
      x[k] = next[k];
    }
    pivot = next_pivot;
  }
}

template <NormKind kKind, typename W, int kItems>
void launch_items(const NormParams<bf16, W>& p, Shape s) {
  const dim3 grid(unsigned(p.num_rows)), block(unsigned(s.threads));
  if (s.weights_first) {
    NormKernel<kKind, bf16, W, 8, kItems, true><<<grid, block>>>(p);
  } else {
    NormKernel<kKind, bf16, W, 8, kItems, false><<<grid, block>>>(p);
  }
}

template <NormKind kKind, typename W>
void launch_shape(const NormParams<bf16, W>& p, Shape s) {
  if (kKind == NormKind::kLayer && s.resident) {
    auto kernel = s.items == 4 ? LayerNormResident<W, 4> : LayerNormResident<W, 2>;
    int blocks_per_sm = 0, sms = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, s.threads, 0));
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int64_t grid = std::min<int64_t>(p.num_rows, int64_t(blocks_per_sm) * sms);
    kernel<<<unsigned(grid), s.threads>>>(p);
    return;
  }
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
    if (s.resident && kKind != NormKind::kLayer) continue;
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
    std::printf("  %4d threads x %d vectors, weights %-8s %7.1f us %6.0f GB/s  %.3f of same-size copy%s\n",
                s.threads, s.items, s.resident ? "resident" : s.weights_first ? "first" : "after", ms * 1e3, bw,
                bw / copy_bw,
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
  const std::vector<Shape> h4096 = {{128, 4, false}, {128, 4, true}, {256, 2, false}, {128, 4, false, true},
                                    {256, 2, false, true}};
  const std::vector<Shape> h8192 = {{256, 4, false}, {512, 2, false}, {128, 8, false}, {256, 4, false, true}};
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
