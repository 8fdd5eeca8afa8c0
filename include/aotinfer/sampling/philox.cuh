// The samplers' random numbers: Philox4x32-10 keyed by the seed, with counter (element / 4, output
// row, offset), so that the same seed and offset give the same tokens whatever the launch, and the
// exponential and uniform variates the races and draws take from its words. The scheme: sampling.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace aotinfer {

// Ten rounds of Philox4x32 on counter c under key (k0, k1).
__device__ __forceinline__ uint4 Philox4x32(uint4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
    const uint32_t lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

// The random stream of one output row: four 32-bit words per group of four elements.
struct RowRandom {
  uint32_t seed_lo, seed_hi, row, offset_lo, offset_hi;

  __device__ __forceinline__ uint4 group(int64_t group_index) const {
    return Philox4x32(make_uint4(uint32_t(group_index), row, offset_lo, offset_hi ^ uint32_t(group_index >> 32)),
                      seed_lo, seed_hi);
  }
  __device__ __forceinline__ uint32_t word(int64_t index) const {
    const uint4 r = group(index >> 2);
    const int lane = int(index & 3);
    return lane == 0 ? r.x : lane == 1 ? r.y : lane == 2 ? r.z : r.w;
  }
};

// E ~ Exp(1) from 32 random bits: -log(1 - d), d uniform in (0, 1) on a 2^-24 grid. The race is
// decided by the small E (d near 0), where the hardware's log2 of 1 - d loses its relative
// accuracy, so d < 1/16 takes the series d + d^2/2 + ... + d^5/5 instead; both keep E within a few
// 1e-6 of its value, relatively.
__device__ __forceinline__ float Exponential(uint32_t bits) {
  const float d = (float(bits >> 8) + 0.5f) * (1.0f / 16777216.0f);
  if (d < 0.0625f) return d * (1.f + d * (0.5f + d * (1.f / 3.f + d * (0.25f + d * 0.2f))));
  return -0.69314718f * __log2f(1.f - d);
}

// A uniform in (0, 1) from 64 random bits, on a 2^-53 grid.
__device__ __forceinline__ double Uniform53(uint32_t hi, uint32_t lo) {
  const uint64_t bits = (uint64_t(hi) << 32 | lo) >> 11;
  return (double(bits) + 0.5) * (1.0 / 9007199254740992.0);
}

// The Philox group of a row's draws that are not tied to an element (elements use groups below 2^62).
constexpr int64_t kDrawGroup = int64_t(1) << 62;

}  // namespace aotinfer
