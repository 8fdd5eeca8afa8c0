// Hopper (sm90a) building blocks: shared-memory barriers (mbarrier), named barriers, the fence
// between the generic and the async proxy, tensor copies by the TMA unit, and warpgroup MMA
// (wgmma.mma_async) with its operands in 128-byte-swizzled shared memory described by matrix
// descriptors.
//
// Tiles in shared memory (what the descriptors below describe): 16-bit elements, cut into regions
// of 64 columns (128 bytes a row); region c / 64 of a tile of R rows starts at (c / 64) * R * 128
// bytes, row r of it at r * 128, and its 16-byte chunk j (columns 8j..8j+7 of the region) at
// (j ^ (r % 8)) * 16: the 128-byte swizzle, the same XOR the hardware applies to the address bits
// 4-6 with bits 7-9, so a tile must start at a multiple of 1024 bytes. A TMA box of 64 columns
// (128 bytes) x R rows with the 128-byte swizzle lands as one such region.
//
// wgmma: a warpgroup (4 consecutive warps, the first a multiple of 4) multiplies a 64 x 16 A by a
// 16 x N B into a 64 x N float32 accumulator spread over its threads like N / 8 m16n8 tiles of
// mma.sync: warp w holds rows 16w..16w+15; d[4n + e] is row 16w + lane / 4 + 8 (e / 2), column
// 8n + 2 (lane % 4) + e % 2. The MMAs run asynchronously: wgmma.fence before the first (after
// the registers they use were written), commit_group after the last, wait_group before their
// accumulators are read; FenceOperands keeps the compiler from moving the accumulators' uses
// across them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "aotinfer/mma.cuh"  // SharedAddress

namespace aotinfer {

// ---- barriers ---------------------------------------------------------------------------------

__device__ __forceinline__ void BarrierInit(uint64_t* barrier, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SharedAddress(barrier)), "r"(arrivals) : "memory");
}

// Makes the initialized barriers visible to the other threads and to the async proxy (before a
// __syncthreads).
__device__ __forceinline__ void BarrierInitFence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

__device__ __forceinline__ void BarrierArrive(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(SharedAddress(barrier)) : "memory");
}

// Waits until the phase of parity `parity` of the barrier has completed (a fresh barrier is in
// phase 0: waiting for parity 1 returns at once).
__device__ __forceinline__ void BarrierWait(uint64_t* barrier, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "wait:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n}\n" ::"r"(SharedAddress(barrier)),
      "r"(parity)
      : "memory");
}

// Waits for two barriers at once (the phases of parities `parity_a` and `parity_b`): one round trip
// to shared memory where both have completed, not two in sequence.
__device__ __forceinline__ void BarrierWait(uint64_t* barrier_a, uint32_t parity_a, uint64_t* barrier_b, uint32_t parity_b) {
  asm volatile(
      "{\n.reg .pred done_a, done_b;\n"
      "wait:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done_a, [%0], %1;\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done_b, [%2], %3;\n"
      "@!done_a bra wait;\n"
      "@!done_b bra wait;\n}\n" ::"r"(SharedAddress(barrier_a)),
      "r"(parity_a), "r"(SharedAddress(barrier_b)), "r"(parity_b)
      : "memory");
}

// The barrier counts one arrival when every cp.async this thread issued before has landed.
__device__ __forceinline__ void ArriveWhenCopiesLand(uint64_t* barrier) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(SharedAddress(barrier)) : "memory");
}

// Counts this thread's arrival and tells the barrier's current phase to wait, as well, for `bytes`
// more bytes of bulk copies (CopyBox3d) to land.
__device__ __forceinline__ void BarrierArriveExpectingBytes(uint64_t* barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(SharedAddress(barrier)),
               "r"(bytes)
               : "memory");
}

// The TMA unit copies the box of the 3-D tensor map `map` (a __grid_constant__ kernel parameter,
// made on the host) at element coordinates (x, y, z), innermost first, to shared memory at `dst`,
// laid out as the map's swizzle says; `barrier` counts its bytes as they land. Its writes are the
// async proxy's, which wgmma reads with no proxy fence.
__device__ __forceinline__ void CopyBox3d(void* dst, const void* map, int x, int y, int z, uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];" ::
          "r"(SharedAddress(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(SharedAddress(barrier))
      : "memory");
}

// The same for a box of a 4-D tensor map at (x, y, z, w).
__device__ __forceinline__ void CopyBox4d(void* dst, const void* map, int x, int y, int z, int w, uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];" ::
          "r"(SharedAddress(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(w), "r"(SharedAddress(barrier))
      : "memory");
}

// The TMA unit writes shared memory at `src` (laid out as the map's swizzle says) to the box of
// the 4-D tensor map `map` at (x, y, z, w); elements past the tensor's bounds are not written. The
// shared memory must have been written before through the async proxy's view (FenceAsyncProxy by
// the writing threads, then a barrier). Committed as a bulk group (BulkStoresRead).
__device__ __forceinline__ void StoreBox4d(const void* map, int x, int y, int z, int w, const void* src) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(x), "r"(y), "r"(z), "r"(w), "r"(SharedAddress(src))
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Waits until this thread's bulk stores have read their shared memory (it may be written again).
__device__ __forceinline__ void BulkStoresRead() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

// Waits until this thread's bulk stores are complete (their writes visible).
__device__ __forceinline__ void BulkStoresDone() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Orders this thread's view of shared memory (writes by cp.async or plain stores, seen through a
// barrier) before the async proxy's reads (wgmma's operands).
__device__ __forceinline__ void FenceAsyncProxy() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// A barrier among `threads` threads (whole warps) by id (0 is __syncthreads'), e.g. a warpgroup's;
// NamedBarrierArrive counts this warp without waiting (a producer-consumer handoff).
__device__ __forceinline__ void NamedBarrierSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void NamedBarrierArrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- warpgroup MMA ----------------------------------------------------------------------------

// Byte offset of 16-byte chunk `chunk` (of the whole row) of row `row` in a swizzled tile of
// kRows rows (the layout above).
template <int kRows>
__device__ __forceinline__ uint32_t SwizzledTileOffset(int row, int chunk) {
  return uint32_t(chunk / 8 * kRows * 128 + row * 128 + ((chunk % 8) ^ (row % 8)) * 16);
}

// The descriptor of a matrix at shared address `address` in the swizzled layout: 8-row groups
// 1024 bytes apart (the "stride byte offset"); `leading_bytes`: for an N-major B, the distance
// between its 64-column regions (K-major operands ignore it).
__device__ __forceinline__ uint64_t MatrixDescriptor(uint32_t address, uint32_t leading_bytes = 16) {
  return uint64_t((address >> 4) & 0x3fff) | uint64_t((leading_bytes >> 4) & 0x3fff) << 16 |
         uint64_t(1024 >> 4) << 32 | uint64_t(1) << 62;  // 62-63: the 128-byte swizzle
}

__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

template <int N>
__device__ __forceinline__ void FenceOperands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The same for A fragments in registers, which an MMA reads until it is waited for: kept alive
// (and unmoved) up to here, so the compiler never gives their registers to other values before.
template <int N>
__device__ __forceinline__ void FenceOperands(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
  }
}

// The accumulator operands of a wgmma in order, "+f"(d[0]) .. "+f"(d[N - 1]).
#define AOTINFER_WGMMA_D8(i) \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define AOTINFER_WGMMA_D32 AOTINFER_WGMMA_D8(0), AOTINFER_WGMMA_D8(8), AOTINFER_WGMMA_D8(16), AOTINFER_WGMMA_D8(24)
#define AOTINFER_WGMMA_D40 AOTINFER_WGMMA_D32, AOTINFER_WGMMA_D8(32)
#define AOTINFER_WGMMA_D48 AOTINFER_WGMMA_D40, AOTINFER_WGMMA_D8(40)
#define AOTINFER_WGMMA_D64 AOTINFER_WGMMA_D32, AOTINFER_WGMMA_D8(32), AOTINFER_WGMMA_D8(40), AOTINFER_WGMMA_D8(48), AOTINFER_WGMMA_D8(56)
#define AOTINFER_WGMMA_D128 \
  AOTINFER_WGMMA_D64, AOTINFER_WGMMA_D8(64), AOTINFER_WGMMA_D8(72), AOTINFER_WGMMA_D8(80), AOTINFER_WGMMA_D8(88), \
      AOTINFER_WGMMA_D8(96), AOTINFER_WGMMA_D8(104), AOTINFER_WGMMA_D8(112), AOTINFER_WGMMA_D8(120)

// d = A B (accumulate: d += A B), A 64x16 in registers (each warp's 16 rows as an m16n8k16
// A fragment), B 16x64 N-major (B's rows contiguous) in shared memory.
template <typename T>
__device__ __forceinline__ void WgmmaRS(float (&d)[32], const uint32_t (&a)[4], uint64_t b, int accumulate) {
#define AOTINFER_WGMMA(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
      "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n" \
      : AOTINFER_WGMMA_D32 \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate))
  if constexpr (std::is_same_v<T, half>) AOTINFER_WGMMA("f16");
  else AOTINFER_WGMMA("bf16");
#undef AOTINFER_WGMMA
}

// d = A B (accumulate: d += A B), A 64x16 and B 16x64 both K-major in shared memory.
template <typename T>
__device__ __forceinline__ void WgmmaSS(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
#define AOTINFER_WGMMA(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, " \
      "%32, %33, p, 1, 1, 0, 0;\n}\n" \
      : AOTINFER_WGMMA_D32 \
      : "l"(a), "l"(b), "r"(accumulate))
  if constexpr (std::is_same_v<T, half>) AOTINFER_WGMMA("f16");
  else AOTINFER_WGMMA("bf16");
#undef AOTINFER_WGMMA
}

// d = A B (accumulate: d += A B), A 64x16 and B 16x80 both K-major in shared memory.
template <typename T>
__device__ __forceinline__ void WgmmaSS(float (&d)[40], uint64_t a, uint64_t b, int accumulate) {
#define AOTINFER_WGMMA(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n80k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, " \
      "%40, %41, p, 1, 1, 0, 0;\n}\n" \
      : AOTINFER_WGMMA_D40 \
      : "l"(a), "l"(b), "r"(accumulate))
  if constexpr (std::is_same_v<T, half>) AOTINFER_WGMMA("f16");
  else AOTINFER_WGMMA("bf16");
#undef AOTINFER_WGMMA
}

// d = A B (accumulate: d += A B), A 64x16 and B 16x96 both K-major in shared memory.
template <typename T>
__device__ __forceinline__ void WgmmaSS(float (&d)[48], uint64_t a, uint64_t b, int accumulate) {
#define AOTINFER_WGMMA(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n96k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, " \
      "%48, %49, p, 1, 1, 0, 0;\n}\n" \
      : AOTINFER_WGMMA_D48 \
      : "l"(a), "l"(b), "r"(accumulate))
  if constexpr (std::is_same_v<T, half>) AOTINFER_WGMMA("f16");
  else AOTINFER_WGMMA("bf16");
#undef AOTINFER_WGMMA
}

// d = A B (accumulate: d += A B), A 64x16 and B 16x128 both K-major in shared memory.
template <typename T>
__device__ __forceinline__ void WgmmaSS(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
#define AOTINFER_WGMMA(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
      "%64, %65, p, 1, 1, 0, 0;\n}\n" \
      : AOTINFER_WGMMA_D64 \
      : "l"(a), "l"(b), "r"(accumulate))
  if constexpr (std::is_same_v<T, half>) AOTINFER_WGMMA("f16");
  else AOTINFER_WGMMA("bf16");
#undef AOTINFER_WGMMA
}

// d = A B (accumulate: d += A B), A 64x16 in registers (each warp's 16 rows as an m16n8k16
// A fragment), B 16x128 N-major (B's rows contiguous) in shared memory.
template <typename T>
__device__ __forceinline__ void WgmmaRS(float (&d)[64], const uint32_t (&a)[4], uint64_t b, int accumulate) {
#define AOTINFER_WGMMA(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, " \
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
      : AOTINFER_WGMMA_D64 \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate))
  if constexpr (std::is_same_v<T, half>) AOTINFER_WGMMA("f16");
  else AOTINFER_WGMMA("bf16");
#undef AOTINFER_WGMMA
}

// d = A B (accumulate: d += A B), A 64x16 in registers (each warp's 16 rows as an m16n8k16
// A fragment), B 16x256 N-major (B's rows contiguous) in shared memory.
template <typename T>
__device__ __forceinline__ void WgmmaRS(float (&d)[128], const uint32_t (&a)[4], uint64_t b, int accumulate) {
#define AOTINFER_WGMMA(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, " \
      "{%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n" \
      : AOTINFER_WGMMA_D128 \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate))
  if constexpr (std::is_same_v<T, half>) AOTINFER_WGMMA("f16");
  else AOTINFER_WGMMA("bf16");
#undef AOTINFER_WGMMA
}

}  // namespace aotinfer
