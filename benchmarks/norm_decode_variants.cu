// Design experiment for include/aotinfer/norm.cuh (issue 13): decode-size latency of NormKernel
// by vectors a thread (1, 2 or 4: 512, 256 or 128 threads a row of 4096 bf16), weights loaded
// beside the row, for RMSNorm, the fused add and LayerNorm (float32 and bf16 gemma/beta), and of
// aotinfer::Norm's own choice. Latency: GPU time a call from graph replays of 20 PDL launches
// back to back (median of 50 replays after 10), as bench_norm.py measures it. Where the PDL
// trigger sits is a constant of NormKernel: the run compares builds of this file against
// norm.cuh as it is and against a copy with the trigger after pass 1 (kTriggerAtEnd = false).
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I include -I benchmarks benchmarks/norm_decode_variants.cu
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "aotinfer/norm.cuh"
#include "cuda_timer.cuh"

using namespace aotinfer;
using bf16 = __nv_bfloat16;

__global__ void Fill(bf16* x, size_t n, unsigned seed) {
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  unsigned h = unsigned(i) * 2654435761u ^ seed * 2246822519u;
  h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
  x[i] = __float2bfloat16(float(h >> 8) * (4.f / 16777216.f) - 2.f);
}

// NormKernel with `items` vectors a thread, weights prefetched, a row a block.
template <NormKind kKind, typename W, int kItems>
cudaError_t Direct(const NormParams<bf16, W>& p, cudaStream_t stream) {
  const unsigned threads = unsigned((p.hidden / 8 + kItems - 1) / kItems + 31) / 32 * 32;
  return Launch(NormKernel<kKind, bf16, W, 8, kItems, true, true>, dim3(unsigned(p.num_rows)), dim3(threads), stream,
                true, p);
}

template <NormKind kKind, typename W>
void Row(const char* name, const char* config, const std::function<cudaError_t(const NormParams<bf16, W>&, cudaStream_t)>& launch) {
  const int64_t hidden = 4096;
  std::printf("%-22s %-10s", name, config);
  for (int64_t tokens : {1, 8, 32, 128}) {
    bf16 *x, *out, *res;
    W *w, *b;
    CHECK(cudaMalloc(&x, tokens * hidden * 2));
    CHECK(cudaMalloc(&out, tokens * hidden * 2));
    CHECK(cudaMalloc(&res, tokens * hidden * 2));
    CHECK(cudaMalloc(&w, hidden * sizeof(W)));
    CHECK(cudaMalloc(&b, hidden * sizeof(W)));
    Fill<<<unsigned((tokens * hidden + 255) / 256), 256>>>(x, tokens * hidden, 1);
    Fill<<<unsigned((tokens * hidden + 255) / 256), 256>>>(res, tokens * hidden, 2);
    CHECK(cudaMemset(w, 0, hidden * sizeof(W)));
    CHECK(cudaMemset(b, 0, hidden * sizeof(W)));
    const RowLayout rows{1, hidden, 0};
    const bool fused = kKind == NormKind::kFusedAddRMS;
    NormParams<bf16, W> p{fused ? x : out, rows, x, rows, fused ? res : nullptr, rows, w, b, hidden, tokens, 1e-6f, 0.f};
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::printf(" %6.2f", GraphReplayUs([&](cudaStream_t s) { return launch(p, s); }, stream));
    CHECK(cudaStreamDestroy(stream));
    for (void* ptr : {(void*)x, (void*)out, (void*)res, (void*)w, (void*)b}) CHECK(cudaFree(ptr));
  }
  std::printf("\n");
}

template <NormKind kKind, typename W>
void Kind(const char* name) {
  Row<kKind, W>(name, "shipped", [](const NormParams<bf16, W>& p, cudaStream_t s) { return Norm<kKind>(p, 0, s, true); });
  Row<kKind, W>(name, "1 item", Direct<kKind, W, 1>);
  Row<kKind, W>(name, "2 items", Direct<kKind, W, 2>);
  Row<kKind, W>(name, "4 items", Direct<kKind, W, 4>);
}

int main(int argc, char** argv) {
  std::printf("decode latency, hidden 4096, bf16 rows, us a call (graph replay of 20 PDL launches); build: %s\n",
              argc > 1 ? argv[1] : "norm.cuh as it is");
  std::printf("%-22s %-10s %6s %6s %6s %6s\n", "op", "config", "1", "8", "32", "128");
  for (int pass = 0; pass < 2; ++pass) {
    Kind<NormKind::kRMS, bf16>("rmsnorm");
    Kind<NormKind::kFusedAddRMS, bf16>("fused_add_rmsnorm");
    Kind<NormKind::kLayer, float>("layernorm fp32 w");
    Kind<NormKind::kLayer, bf16>("layernorm bf16 w");
  }
}
