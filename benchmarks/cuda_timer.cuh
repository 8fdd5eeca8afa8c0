// Shared by the standalone design experiments (*_variants.cu): a checked CUDA call and the median
// of 50 event-timed runs after 10 warm-ups, each after an optional setup.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                                \
  do {                                                                             \
    cudaError_t e_ = (call);                                                       \
    if (e_ != cudaSuccess) {                                                       \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));       \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

struct NoSetup {
  void operator()() const {}
};

// setup() runs before each timed call, outside the events (e.g. to flush L2).
template <typename F, typename Setup = NoSetup>
float median_ms(F&& f, int warmups = 10, int runs = 50, Setup setup = {}) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < warmups; ++i) f();
  std::vector<float> t;
  for (int i = 0; i < runs; ++i) {
    setup();
    CHECK(cudaEventRecord(a));
    f();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
  return t[t.size() / 2];
}
