// FlashInfer's own kernels as a baseline column of the bandwidth benchmarks, timed in the same run
// as ours (issue 13 compares against them). Not shipped and not part of the build: compiled at
// benchmark start, only when AOTINFER_BENCH_FLASHINFER_INCLUDE names FlashInfer's header directory
// (`flashinfer/data/include` of an unpacked flashinfer-python wheel); benchmarks/_bandwidth.py
// builds it with the flags FlashInfer's JIT gives these modules and calls it through ctypes.
//
// The norms are FlashInfer's host launchers, called as its bindings call them. Its gated
// activations have their launch in a generated binding, so the launch configuration below follows
// that binding (a block a row of min(d / 8, 256) threads, the PDL attribute as asked), and the
// activation functions are the ones its JIT passes to the kernel template: SiLU as x / (1 + e^-x)
// with the fast exponential, GELU-tanh through the hardware tanh.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include <flashinfer/activation.cuh>
#include <flashinfer/norm.cuh>

namespace {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float Silu(const float& x) { return x / (1.0f + __expf(-x)); }

__device__ __forceinline__ float Gelu(const float& x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }

__device__ __forceinline__ float GeluTanh(const float& x) {
  const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.0f + flashinfer::math::tanh(inner));
}

template <float (*Act)(const float&)>
int ActAndMul(void* out, const void* input, int64_t tokens, int d, int enable_pdl, cudaStream_t stream) {
  constexpr uint32_t kVec = 8;  // 16 bytes of bf16; the benchmark's hidden sizes are multiples of 8
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = enable_pdl;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(tokens));
  config.blockDim = dim3(std::min<unsigned>(unsigned(d) / kVec, 256u));
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, flashinfer::activation::act_and_mul_kernel<bf16, Act, kVec>,
                            static_cast<bf16*>(out), static_cast<const bf16*>(input), d);
}

}  // namespace

extern "C" {

int fi_silu_and_mul(void* out, const void* input, int64_t tokens, int d, int pdl, void* stream) {
  return ActAndMul<Silu>(out, input, tokens, d, pdl, static_cast<cudaStream_t>(stream));
}

int fi_gelu_and_mul(void* out, const void* input, int64_t tokens, int d, int pdl, void* stream) {
  return ActAndMul<Gelu>(out, input, tokens, d, pdl, static_cast<cudaStream_t>(stream));
}

int fi_gelu_tanh_and_mul(void* out, const void* input, int64_t tokens, int d, int pdl, void* stream) {
  return ActAndMul<GeluTanh>(out, input, tokens, d, pdl, static_cast<cudaStream_t>(stream));
}

// Rows contiguous (stride d), as the benchmarks lay them out.
int fi_rmsnorm(void* out, void* input, void* weight, int64_t rows, int d, float eps, int gemma, int pdl,
               void* stream) {
  auto* x = static_cast<bf16*>(input);
  auto* w = static_cast<bf16*>(weight);
  auto* y = static_cast<bf16*>(out);
  const auto s = static_cast<cudaStream_t>(stream);
  return gemma ? flashinfer::norm::GemmaRMSNorm(x, w, y, uint32_t(rows), uint32_t(d), uint32_t(d), uint32_t(d), eps,
                                                pdl, s)
               : flashinfer::norm::RMSNorm(x, w, y, uint32_t(rows), uint32_t(d), uint32_t(d), uint32_t(d), eps, pdl, s);
}

int fi_fused_add_rmsnorm(void* input, void* residual, void* weight, int64_t rows, int d, float eps, int gemma,
                         int pdl, void* stream) {
  auto* x = static_cast<bf16*>(input);
  auto* r = static_cast<bf16*>(residual);
  auto* w = static_cast<bf16*>(weight);
  const auto s = static_cast<cudaStream_t>(stream);
  return gemma ? flashinfer::norm::GemmaFusedAddRMSNorm(x, r, w, uint32_t(rows), uint32_t(d), uint32_t(d),
                                                        uint32_t(d), eps, pdl, s)
               : flashinfer::norm::FusedAddRMSNorm(x, r, w, uint32_t(rows), uint32_t(d), uint32_t(d), uint32_t(d),
                                                   eps, pdl, s);
}

// bf16 rows with float32 gamma and beta: the one combination FlashInfer's layernorm takes.
int fi_layernorm(void* out, void* input, void* gamma, void* beta, int64_t rows, int d, float eps, void* stream) {
  return flashinfer::norm::LayerNorm(static_cast<bf16*>(input), static_cast<float*>(gamma), static_cast<float*>(beta),
                                     static_cast<bf16*>(out), uint32_t(rows), uint32_t(d), eps,
                                     static_cast<cudaStream_t>(stream));
}

// The FP8-output norms (bench_norm_quant.py): bf16 rows, e4m3 out, the scale a float32 on the device.
int fi_rmsnorm_quant(void* out, void* input, void* weight, void* scale, int64_t rows, int d, float eps,
                     void* stream) {
  return flashinfer::norm::RMSNormQuant(static_cast<bf16*>(input), static_cast<bf16*>(weight),
                                        static_cast<__nv_fp8_e4m3*>(out), uint32_t(rows), uint32_t(d), uint32_t(d),
                                        uint32_t(d), static_cast<float*>(scale), eps, false,
                                        static_cast<cudaStream_t>(stream));
}

int fi_fused_add_rmsnorm_quant(void* out, void* input, void* residual, void* weight, void* scale, int64_t rows, int d,
                               float eps, void* stream) {
  return flashinfer::norm::FusedAddRMSNormQuant(static_cast<bf16*>(input), static_cast<bf16*>(residual),
                                                static_cast<bf16*>(weight), static_cast<__nv_fp8_e4m3*>(out),
                                                uint32_t(rows), uint32_t(d), uint32_t(d), uint32_t(d), uint32_t(d),
                                                static_cast<float*>(scale), eps, false,
                                                static_cast<cudaStream_t>(stream));
}

int fi_layernorm_quant(void* out, void* input, void* gamma, void* beta, void* scale, int64_t rows, int d, float eps,
                       void* stream) {
  return flashinfer::norm::LayerNormQuant(static_cast<bf16*>(input), static_cast<float*>(gamma),
                                          static_cast<float*>(beta), static_cast<__nv_fp8_e4m3*>(out),
                                          static_cast<float*>(scale), uint32_t(rows), uint32_t(d), eps,
                                          static_cast<cudaStream_t>(stream));
}

}  // extern "C"
