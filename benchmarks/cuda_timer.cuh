// Shared by the standalone design experiments (*_variants.cu): a checked CUDA call, the median of 50
// event-timed runs after 10 warm-ups (each after an optional setup), and the time a launch under
// CUDA-graph replay.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
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

// Microseconds a call under CUDA-graph replay: `calls` calls captured back to back on `stream`,
// the median of 50 replays after 10, divided by `calls`.
inline float GraphReplayUs(const std::function<cudaError_t(cudaStream_t)>& call, cudaStream_t stream, int calls = 20) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < calls; ++i) CHECK(call(stream));
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
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  return t[25] * 1e3f / calls;
}
