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

// As CopyAsync16 to the shared-window address `dst`, or 16 zero bytes when !valid (src is then
// not read). sm80 and up only.
__device__ __forceinline__ void CopyAsync16OrZero(uint32_t dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
#else
  (void)dst, (void)src, (void)valid;
#endif
}

// As CopyAsync16, or 16 zero bytes when !valid (src is then not read).
__device__ __forceinline__ void CopyAsync16OrZero(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  CopyAsync16OrZero(static_cast<uint32_t>(__cvta_generic_to_shared(dst)), src, valid);
#else
  *static_cast<uint4*>(dst) = valid ? *static_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
#endif
}

// The L2 cache policy evict-first for the whole access, as createpolicy encodes it for the GPU at
// hand. Evict-first lines are the first to go when the L2 needs room: bytes read once so cached
// displace one another rather than what the L2 held before (which later kernels may read again,
// or, dirty, would be written back to memory while this kernel reads).
__device__ __forceinline__ uint64_t L2EvictFirstPolicy() {
  uint64_t policy = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
#endif
  return policy;
}

// As CopyAsync16OrZero, to the shared-window address `dst`, the line cached in L2 under `policy`
// (L2EvictFirstPolicy). ptxas 13.0 miscompiles a cache policy on copies whose shared address it splits
// into a register plus a uniform register (an illegal instruction at run time): callers keep
// `dst` in a per-thread register (SharedAddressInRegister).
__device__ __forceinline__ void CopyAsync16OrZero(uint32_t dst, const void* src, bool valid, uint64_t policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0), "l"(policy)
               : "memory");
#else
  (void)dst, (void)src, (void)valid, (void)policy;  // sm80 and up only
#endif
}

// The shared-window address of `p`, through a shuffle from the thread's own lane (all 32 lanes
// call it) so that ptxas cannot fold a uniform part into the addressing of the copies above.
__device__ __forceinline__ uint32_t SharedAddressInRegister(const void* p) {
  uint32_t lane;
  asm("mov.u32 %0, %%laneid;" : "=r"(lane));
  return __shfl_sync(0xffffffffu, static_cast<uint32_t>(__cvta_generic_to_shared(p)), lane);
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
