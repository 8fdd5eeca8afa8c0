// Asynchronous 16-byte copies from global to shared memory (cp.async, sm80+): the bytes in flight
// wait in shared memory instead of registers. A thread's copies form groups, one per commit;
// WaitAsyncGroups<n>() returns once all but the newest n groups have landed, and from then on the
// thread sees their bytes (other threads of the block do after a __syncthreads that follows).
// Below sm80 the copy is a plain load and store, done when it returns.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace aotinfer {

// dst and src 16-byte aligned. Bypasses L1: streamed rows are read once.
__device__ __forceinline__ void CopyAsync16(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t shared_dst = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_dst), "l"(src) : "memory");
#else
  *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
#endif
}

// As CopyAsync16, or 16 zero bytes when !valid (src is then not read).
__device__ __forceinline__ void CopyAsync16OrZero(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t shared_dst = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
#else
  *static_cast<uint4*>(dst) = valid ? *static_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
#endif
}

// 4 bytes (an index) through L1, or 4 zero bytes when !valid (src is then not read).
__device__ __forceinline__ void CopyAsync4OrZero(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t shared_dst = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(shared_dst), "l"(src), "r"(valid ? 4 : 0)
               : "memory");
#else
  *static_cast<uint32_t*>(dst) = valid ? *static_cast<const uint32_t*>(src) : 0u;
#endif
}

__device__ __forceinline__ void CommitAsyncGroup() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int kPending>
__device__ __forceinline__ void WaitAsyncGroups() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
#endif
}

}  // namespace aotinfer
