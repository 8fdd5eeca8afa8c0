// Vec<T, N>: N elements of T moved as one aligned memory access (16 bytes when N = 16 / sizeof(T)),
// and the float conversions of the element types the kernels take. Kernels compute in float and
// round once on the way out.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

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
// Two floats rounded into the 32-bit word of a pair of 16-bit elements (element 0 in the low half).
template <typename T>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t PackPair<half>(float lo, float hi) {
  const half2 pair = __floats2half2_rn(lo, hi);
  uint32_t word;
  memcpy(&word, &pair, sizeof(word));
  return word;
}
template <>
__device__ __forceinline__ uint32_t PackPair<nv_bfloat16>(float lo, float hi) {
  const nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  uint32_t word;
  memcpy(&word, &pair, sizeof(word));
  return word;
}

// The unsigned type the hardware loads in one instruction for each access width.
template <int kBytes> struct AccessType;
template <> struct AccessType<2> { using type = uint16_t; };
template <> struct AccessType<4> { using type = uint32_t; };
template <> struct AccessType<8> { using type = uint2; };
template <> struct AccessType<16> { using type = uint4; };
}  // namespace detail

// N elements moved as kAccesses accesses of at most 16 bytes each (32 bytes: two 16-byte ones,
// as for 8 floats beside 8 bf16 values).
template <typename T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Vec {
  static constexpr int kBytes = sizeof(T) * N;
  static_assert((kBytes & (kBytes - 1)) == 0 && kBytes >= 2 && kBytes <= 32, "2 to 32 bytes, a power of two");
  static constexpr int kAccessBytes = kBytes < 16 ? kBytes : 16;
  static constexpr int kAccesses = kBytes / kAccessBytes;
  using Access = typename detail::AccessType<kAccessBytes>::type;

  // The union keeps loads and stores one instruction wide after elements were written one by one.
  union {
    Access raw[kAccesses];
    T elems[N];
  };

  // ptr must be aligned to kAccessBytes.
  __device__ __forceinline__ void load(const T* ptr) {
#pragma unroll
    for (int i = 0; i < kAccesses; ++i) raw[i] = reinterpret_cast<const Access*>(ptr)[i];
  }
  // load(), each line cached in L2 under `l2_policy` (a createpolicy value, as async_copy.cuh's
  // L2EvictFirstPolicy gives). Only 16-byte accesses carry it; narrower ones load plainly.
  __device__ __forceinline__ void load(const T* ptr, uint64_t l2_policy) {
#pragma unroll
    for (int i = 0; i < kAccesses; ++i) {
      if constexpr (kAccessBytes == 16) {
        asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(raw[i].x), "=r"(raw[i].y), "=r"(raw[i].z), "=r"(raw[i].w)
                     : "l"(reinterpret_cast<const Access*>(ptr) + i), "l"(l2_policy));
      } else {
        raw[i] = reinterpret_cast<const Access*>(ptr)[i];
      }
    }
  }
  __device__ __forceinline__ void store(T* ptr) const {
#pragma unroll
    for (int i = 0; i < kAccesses; ++i) reinterpret_cast<Access*>(ptr)[i] = raw[i];
  }
  // store() through PTX, so that it stays one instruction per 16 bytes: in the norm kernels'
  // unrolled slots, the front end turns some plain stores of a union filled element by element
  // into four 4-byte stores. Not the default: ptxas schedules around an asm statement with care
  // that costs where loads are still in flight (the fused add's residual store through it made
  // the kernel 0.5 us slower at decode sizes; docs/design/norm.md#split-stores).
  __device__ __forceinline__ void store_unsplit(T* ptr) const {
#pragma unroll
    for (int i = 0; i < kAccesses; ++i) {
      if constexpr (kAccessBytes == 16) {
        asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(reinterpret_cast<Access*>(ptr) + i),
                     "r"(raw[i].x), "r"(raw[i].y), "r"(raw[i].z), "r"(raw[i].w)
                     : "memory");
      } else {
        reinterpret_cast<Access*>(ptr)[i] = raw[i];
      }
    }
  }
  // The vector of from_float<T>(f(e)) for e < N. 16-bit elements are rounded in pairs into whole
  // 32-bit words and the words moved into raw at once: written element by element, the union
  // costs a PRMT/LOP3 shuffle per element and the front end splits its store into 4-byte pieces
  // (docs/design/norm.md#split-stores).
  template <typename F>
  __device__ __forceinline__ static Vec from_floats(F&& f) {
    Vec v;
    if constexpr (sizeof(T) == 2 && N % 2 == 0) {
      uint32_t words[N / 2];
#pragma unroll
      for (int i = 0; i < N / 2; ++i) words[i] = detail::PackPair<T>(f(2 * i), f(2 * i + 1));
#pragma unroll
      for (int a = 0; a < kAccesses; ++a) {
        constexpr int kWords = kAccessBytes / 4;
        if constexpr (kWords == 4) {
          v.raw[a] = make_uint4(words[4 * a], words[4 * a + 1], words[4 * a + 2], words[4 * a + 3]);
        } else if constexpr (kWords == 2) {
          v.raw[a] = make_uint2(words[2 * a], words[2 * a + 1]);
        } else {
          v.raw[a] = words[a];
        }
      }
    } else {
#pragma unroll
      for (int e = 0; e < N; ++e) v.elems[e] = from_float<T>(f(e));
    }
    return v;
  }
  // Element i as float, for a second pass over elements converted once already: for bf16 the
  // conversion is opaque to the compiler, which therefore converts again instead of keeping the
  // first pass's floats alive (a row held in bf16 takes half the registers). One instruction an
  // element: bf16 is the high half of a float.
  __device__ __forceinline__ float float_again(int i) const {
    if constexpr (std::is_same_v<T, nv_bfloat16> && N % 2 == 0) {
      uint32_t pair;
      memcpy(&pair, &elems[i & ~1], sizeof(pair));
      float f;
      if (i % 2 == 0) {
        asm("shl.b32 %0, %1, 16;" : "=f"(f) : "r"(pair));
      } else {
        asm("and.b32 %0, %1, 0xffff0000;" : "=f"(f) : "r"(pair));
      }
      return f;
    } else {
      return to_float(elems[i]);
    }
  }
  __device__ __forceinline__ T& operator[](int i) { return elems[i]; }
  __device__ __forceinline__ const T& operator[](int i) const { return elems[i]; }
};

// Elements of T in one 16-byte access.
template <typename T>
constexpr int kVec16 = 16 / sizeof(T);

}  // namespace aotinfer
