// Vec<T, N>: N elements of T moved as one aligned memory access (16 bytes when N = 16 / sizeof(T)),
// and the float conversions of the element types the kernels take. Kernels compute in float and
// round once on the way out.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace aotinfer {

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float(float x) { return x; }
template <>
__device__ __forceinline__ float to_float(half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float(nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float(float x) { return x; }
template <>
__device__ __forceinline__ half from_float(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }

namespace detail {
// The unsigned type the hardware loads in one instruction for each access width.
template <int kBytes> struct AccessType;
template <> struct AccessType<2> { using type = uint16_t; };
template <> struct AccessType<4> { using type = uint32_t; };
template <> struct AccessType<8> { using type = uint2; };
template <> struct AccessType<16> { using type = uint4; };
}  // namespace detail

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  static constexpr int kBytes = sizeof(T) * N;
  static_assert(kBytes <= 16 && (kBytes & (kBytes - 1)) == 0, "one access moves 2 to 16 bytes");
  using Access = typename detail::AccessType<kBytes>::type;

  // The union keeps loads and stores one instruction wide after elements were written one by one.
  union {
    Access raw;
    T elems[N];
  };

  // ptr must be aligned to kBytes.
  __device__ __forceinline__ void load(const T* ptr) { raw = *reinterpret_cast<const Access*>(ptr); }
  __device__ __forceinline__ void store(T* ptr) const { *reinterpret_cast<Access*>(ptr) = raw; }
  __device__ __forceinline__ T& operator[](int i) { return elems[i]; }
  __device__ __forceinline__ const T& operator[](int i) const { return elems[i]; }
};

// Elements of T in one 16-byte access.
template <typename T>
constexpr int kVec16 = 16 / sizeof(T);

}  // namespace aotinfer
