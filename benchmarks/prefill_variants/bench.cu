// A/B bench of prefill kernel variants in one process: each variant is a copy of
// include/aotinfer/prefill.cuh in its own namespace (make_variants.py writes them and variants.h),
// launched straight through its BatchPrefill on the same inputs, timed interleaved (CUDA events,
// medians, warm L2), outputs compared with variant 0's (and variant 0 with an fp64 reference on
// 24 rows). The work lists follow the plan's rule (one item a query tile, most costly first).
//
//   python3 make_variants.py base.cuh:v0 new.cuh:v1      # in this folder
//   nvcc -std=c++17 -O3 -arch=sm_90a -I../../include -I. bench.cu -o bench
//   ./bench [reps] [case substring]
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <functional>
#include <cmath>
#include <string>
#include "aotinfer/async_copy.cuh"
#include "aotinfer/attention.cuh"
#include "aotinfer/launch.cuh"
#include "aotinfer/mma.cuh"
#include "aotinfer/vec.cuh"
#include "variants.h"  // #include "vN.cuh" ...; #define VARIANTS(X) X(v0) X(v1) ...

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1); } } while (0)
using T = __nv_bfloat16;

struct Case {
  std::string name;
  int heads, kv_heads, D;
  bool causal, paged;
  std::vector<int> lens;
  int page = 16;
};

static uint32_t rng = 12345;
static float frand() { rng = rng * 1664525u + 1013904223u; return ((rng >> 8) / 16777216.f) * 2.f - 1.f; }

int main(int argc, char** argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 10;
  const char* only = argc > 2 ? argv[2] : nullptr;
  std::vector<Case> cases;
  cases.push_back({"8192 32/32 d128 causal", 32, 32, 128, true, false, {8192}});
  cases.push_back({"8192 32/32 d128 full", 32, 32, 128, false, false, {8192}});
  cases.push_back({"8192 32/8 d128 causal", 32, 8, 128, true, false, {8192}});
  cases.push_back({"8192 32/8 d128 full", 32, 8, 128, false, false, {8192}});
  cases.push_back({"8192 32/32 d64 causal", 32, 32, 64, true, false, {8192}});
  cases.push_back({"8192 32/32 d64 full", 32, 32, 64, false, false, {8192}});
  cases.push_back({"8192 16/16 d256 causal", 16, 16, 256, true, false, {8192}});
  cases.push_back({"8192 16/16 d256 full", 16, 16, 256, false, false, {8192}});
  std::vector<int> lens;
  uint32_t r = 7;
  for (int i = 0; i < 16; ++i) { r = r * 1103515245u + 12345u; lens.push_back(512 + int((r >> 8) % 3585)); }
  cases.push_back({"16 seqs 512-4096 32/8 d128 causal ragged", 32, 8, 128, true, false, lens});
  cases.push_back({"16 seqs 512-4096 32/8 d128 causal paged16", 32, 8, 128, true, true, lens});

  const char* names[] = {
#define NAME(v) #v,
      VARIANTS(NAME)
#undef NAME
  };
  const int nv = sizeof(names) / sizeof(names[0]);
  printf("variants:");
  for (int i = 0; i < nv; ++i) printf(" %s", names[i]);
  printf("\n");

  for (const Case& c : cases) {
    if (only && !strstr(c.name.c_str(), only)) continue;
    const int D = c.D, H = c.heads, KH = c.kv_heads, group = H / KH, batch = int(c.lens.size());
    int total = 0;
    for (int l : c.lens) total += l;
    // inputs
    std::vector<T> hq(size_t(total) * H * D), hk(size_t(total) * KH * D), hv(size_t(total) * KH * D);
    for (auto& x : hq) x = __float2bfloat16(frand() * 2.f);
    for (auto& x : hk) x = __float2bfloat16(frand() * 2.f);
    for (auto& x : hv) x = __float2bfloat16(frand());
    T *q, *k, *v;
    CK(cudaMalloc(&q, hq.size() * 2));
    CK(cudaMemcpy(q, hq.data(), hq.size() * 2, cudaMemcpyHostToDevice));
    // paged: pages scattered over a pool twice the size
    std::vector<int> page_indptr(1, 0), indices;
    int pool = 0;
    if (c.paged) {
      for (int l : c.lens) page_indptr.push_back(page_indptr.back() + (l + c.page - 1) / c.page);
      pool = 2 * page_indptr.back();
      std::vector<int> perm(pool);
      for (int i = 0; i < pool; ++i) perm[i] = i;
      for (int i = pool - 1; i > 0; --i) { r = r * 1103515245u + 12345u; std::swap(perm[i], perm[(r >> 4) % (i + 1)]); }
      indices.assign(perm.begin(), perm.begin() + page_indptr.back());
      std::vector<T> pk(size_t(pool) * c.page * KH * D, __float2bfloat16(0.f)), pv = pk;
      int tok = 0;
      for (int b = 0; b < batch; ++b) {
        for (int t = 0; t < c.lens[b]; ++t, ++tok) {
          const int pg = indices[page_indptr[b] + t / c.page], slot = t % c.page;
          memcpy(&pk[(size_t(pg) * c.page + slot) * KH * D], &hk[size_t(tok) * KH * D], KH * D * 2);
          memcpy(&pv[(size_t(pg) * c.page + slot) * KH * D], &hv[size_t(tok) * KH * D], KH * D * 2);
        }
      }
      CK(cudaMalloc(&k, pk.size() * 2));
      CK(cudaMalloc(&v, pv.size() * 2));
      CK(cudaMemcpy(k, pk.data(), pk.size() * 2, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(v, pv.data(), pv.size() * 2, cudaMemcpyHostToDevice));
    } else {
      CK(cudaMalloc(&k, hk.size() * 2));
      CK(cudaMalloc(&v, hv.size() * 2));
      CK(cudaMemcpy(k, hk.data(), hk.size() * 2, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(v, hv.data(), hv.size() * 2, cudaMemcpyHostToDevice));
    }
    int* d_indices = nullptr;
    if (c.paged) {
      CK(cudaMalloc(&d_indices, indices.size() * 4));
      CK(cudaMemcpy(d_indices, indices.data(), indices.size() * 4, cudaMemcpyHostToDevice));
    }
    std::vector<T*> outs(nv);
    for (auto& o : outs) { CK(cudaMalloc(&o, hq.size() * 2)); CK(cudaMemset(o, 0xff, hq.size() * 2)); }
    // requests
    std::vector<int> req;
    {
      int qb = 0;
      for (int b = 0; b < batch; ++b) {
        const int kvoff = c.paged ? page_indptr[b] : qb;
        int row[8] = {qb, c.lens[b], kvoff, c.lens[b], 0, 0, 0, 0};
        req.insert(req.end(), row, row + 8);
        qb += c.lens[b];
      }
    }
    int* d_req;
    CK(cudaMalloc(&d_req, req.size() * 4));
    CK(cudaMemcpy(d_req, req.data(), req.size() * 4, cudaMemcpyHostToDevice));
    double pairs = 0;
    for (int l : c.lens) pairs += c.causal ? double(l) * (l + 1) / 2 : double(l) * l;
    const double flops = 4.0 * H * D * pairs;

    // per-variant launchers
    std::vector<int*> d_works(nv);
    std::vector<int> ctas(nv);
    std::vector<std::function<void()>> launch(nv);
    int vi = 0;
#define SETUP(V)                                                                                              \
    {                                                                                                         \
      const int tile_q = D == 64 ? aotinfer_##V::PrefillShape<T, T, 64>::kTileQ                                  \
                       : D == 128 ? aotinfer_##V::PrefillShape<T, T, 128>::kTileQ : aotinfer_##V::PrefillShape<T, T, 256>::kTileQ; \
      std::vector<std::pair<long, std::vector<int>>> items;                                                   \
      for (int b = 0; b < batch; ++b) {                                                                       \
        const int ql = c.lens[b];                                                                             \
        const int tiles = (ql * group + tile_q - 1) / tile_q;                                                 \
        for (int j = 0; j < tiles; ++j) {                                                                     \
          const int r0 = j * tile_q, r1 = std::min((j + 1) * tile_q, ql * group) - 1;                         \
          const int t1 = r1 / group;                                                                          \
          const int hi = c.causal ? std::min(ql, t1 + 1) : ql;                                                \
          items.push_back({long(r1 - r0 + 1) * hi, {b, r0, 0, ql, 0, 0, 0, 0}});                              \
        }                                                                                                     \
      }                                                                                                       \
      std::stable_sort(items.begin(), items.end(), [](auto& a, auto& b) { return a.first > b.first; });     \
      std::vector<int> work = {int(items.size()), 0, 0, 0, 0, 0, 0, 0};                                       \
      for (auto& it : items) work.insert(work.end(), it.second.begin(), it.second.end());                     \
      CK(cudaMalloc(&d_works[vi], work.size() * 4));                                                          \
      CK(cudaMemcpy(d_works[vi], work.data(), work.size() * 4, cudaMemcpyHostToDevice));                      \
      ctas[vi] = int(items.size());                                                                           \
      aotinfer_##V::PrefillParams p{};                                                                        \
      p.out = outs[vi]; p.out_stride_n = int64_t(H) * D; p.out_stride_h = D;                                  \
      p.lse = nullptr; p.partial_out = nullptr; p.partial_lse = nullptr;                                      \
      p.q = q; p.q_stride_n = int64_t(H) * D; p.q_stride_h = D;                                              \
      p.k = k; p.v = v;                                                                                       \
      if (c.paged) { p.k_stride_page = int64_t(c.page) * KH * D; p.k_stride_slot = int64_t(KH) * D; }        \
      else { p.k_stride_page = int64_t(KH) * D; p.k_stride_slot = 0; }                                       \
      p.k_stride_head = D; p.v_stride_page = p.k_stride_page; p.v_stride_slot = p.k_stride_slot; p.v_stride_head = D; \
      p.indices = d_indices; p.sinks = nullptr; p.batch = batch; p.num_qo_heads = H; p.num_kv_heads = KH;    \
      p.group = group; p.page_size = aotinfer::PageDivisor(uint32_t(c.paged ? c.page : 1));                  \
      p.scale_log2 = float(1.0 / sqrt(double(D)) * 1.4426950408889634); p.soft_cap = 0.f; p.window_left = -1; \
      p.work = reinterpret_cast<const int4*>(d_works[vi]); p.requests = reinterpret_cast<const int4*>(d_req); \
      p.group_divisor = aotinfer::PageDivisor(uint32_t(group)); p.causal = c.causal; p.v_scale = 1.f;                          \
      const int n = ctas[vi];                                                                                 \
      launch[vi] = [p, n, D]() {                                                                              \
        cudaError_t e;                                                                                        \
        if (D == 64) e = aotinfer_##V::BatchPrefill<T, 64>(p, false, n, false, 0, 0, false, 0);                      \
        else if (D == 128) e = aotinfer_##V::BatchPrefill<T, 128>(p, false, n, false, 0, 0, false, 0);               \
        else e = aotinfer_##V::BatchPrefill<T, 256>(p, false, n, false, 0, 0, false, 0);                             \
        if (e != cudaSuccess) { printf("launch: %s\n", cudaGetErrorString(e)); exit(1); }                    \
      };                                                                                                      \
      ++vi;                                                                                                   \
    }
    VARIANTS(SETUP)
#undef SETUP
    // correctness: each variant against variant 0
    for (int i = 0; i < nv; ++i) launch[i]();
    CK(cudaDeviceSynchronize());
    std::vector<T> ref(hq.size()), got(hq.size());
    CK(cudaMemcpy(ref.data(), outs[0], ref.size() * 2, cudaMemcpyDeviceToHost));
    // spot check variant 0 against an fp64 reference on a few rows
    double worst0 = 0;
    for (int s = 0; s < 24; ++s) {
      const int b = s % batch;
      int qb = 0; for (int i = 0; i < b; ++i) qb += c.lens[i];
      const int t = (s * 997 + 13) % c.lens[b], h = (s * 7) % H, kh = h / group;
      const int see = c.causal ? t + 1 : c.lens[b];
      std::vector<double> w(see); double mx = -1e30;
      for (int j = 0; j < see; ++j) {
        double acc = 0;
        for (int d = 0; d < D; ++d) acc += double(__bfloat162float(hq[(size_t(qb + t) * H + h) * D + d])) * __bfloat162float(hk[(size_t(qb + j) * KH + kh) * D + d]);
        w[j] = acc / sqrt(double(D)); mx = std::max(mx, w[j]);
      }
      double sum = 0; for (auto& x : w) { x = exp(x - mx); sum += x; }
      for (int d = 0; d < D; ++d) {
        double o = 0; for (int j = 0; j < see; ++j) o += w[j] * __bfloat162float(hv[(size_t(qb + j) * KH + kh) * D + d]);
        o /= sum;
        worst0 = std::max(worst0, fabs(o - __bfloat162float(ref[(size_t(qb + t) * H + h) * D + d])));
      }
    }
    printf("%s: variant0 vs fp64 (24 rows) max err %.3g%s\n", c.name.c_str(), worst0, worst0 > 2e-2 ? "  <-- BAD" : "");
    for (int i = 1; i < nv; ++i) {
      CK(cudaMemcpy(got.data(), outs[i], got.size() * 2, cudaMemcpyDeviceToHost));
      double worst = 0; long bad = 0;
      for (size_t j = 0; j < got.size(); ++j) {
        const float a = __bfloat162float(ref[j]), b2 = __bfloat162float(got[j]);
        const double d = fabs(double(a) - b2);
        if (!(d <= 1e-2 + 1e-2 * fabs(a))) ++bad;
        if (d > worst || d != d) worst = d;
      }
      printf("   %s vs v0: max diff %.3g, %ld outside tolerance%s\n", names[i], worst, bad, bad ? "  <-- BAD" : "");
    }
    // timing: interleaved, warm
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    std::vector<std::vector<float>> ts(nv);
    for (int w = 0; w < 2; ++w) for (int i = 0; i < nv; ++i) launch[i]();
    for (int rep = 0; rep < reps; ++rep) {
      for (int i = 0; i < nv; ++i) {
        CK(cudaEventRecord(e0));
        launch[i]();
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
        ts[i].push_back(ms);
      }
    }
    printf("%-44s", c.name.c_str());
    double base = 0;
    for (int i = 0; i < nv; ++i) {
      std::sort(ts[i].begin(), ts[i].end());
      const double med = ts[i][ts[i].size() / 2];
      const double tf = flops / (med * 1e-3) / 1e12;
      if (i == 0) base = med;
      printf("  %s %6.1f (%.3f ms, x%.3f)", names[i], tf, med, base / med);
    }
    printf("\n");
    fflush(stdout);
    CK(cudaFree(q)); CK(cudaFree(k)); CK(cudaFree(v)); CK(cudaFree(d_req));
    if (d_indices) CK(cudaFree(d_indices));
    for (auto o : outs) CK(cudaFree(o));
    for (auto w : d_works) CK(cudaFree(w));
  }
  return 0;
}
