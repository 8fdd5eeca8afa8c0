// Keys: the 32-bit patterns of probabilities and logits that order like their values, which the
// threshold search's histograms split on, and the exact integer mass of a histogram bin of
// probabilities. The scheme: sampling.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

namespace aotinfer {

// Probabilities: the float's bits; only positive finite values take part (0 for the rest).
__device__ __forceinline__ uint32_t ProbKey(float p) {
  return (p > 0.f && p <= FLT_MAX) ? __float_as_uint(p) : 0u;
}
// Logits: every non-NaN float, negatives flipped so that the unsigned order is the float order (0
// for NaN, below -inf's key).
__device__ __forceinline__ uint32_t LogitKey(float x) {
  if (x != x) return 0u;
  const uint32_t bits = __float_as_uint(x);
  return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}
__device__ __forceinline__ float LogitFromKey(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? key & 0x7FFFFFFFu : ~key);
}

// The mass of a bin of probabilities as an exact integer: the mantissa (with its implicit bit) in
// units of the exponent's last place. Bins never span exponents, so one scale converts the sum.
__device__ __forceinline__ uint32_t MantissaOf(uint32_t key) {
  return (key & 0x7FFFFFu) | ((key & 0x7F800000u) ? 0x800000u : 0u);
}
// The sums are kept as two 32-bit halves (12 bits each, so a bin of 2^20 elements cannot overflow).
__device__ __forceinline__ double MassOf(uint32_t hi_sum, uint32_t lo_sum, uint32_t any_key_of_bin) {
  const int exponent = int((any_key_of_bin >> 23) & 0xFF);
  const int scale = (exponent ? exponent : 1) - 150;  // value = mantissa * 2^scale
  const double mantissa_sum = double(hi_sum) * 4096.0 + double(lo_sum);  // exact: < 2^53
  return mantissa_sum * __longlong_as_double(int64_t(scale + 1023) << 52);
}

}  // namespace aotinfer
