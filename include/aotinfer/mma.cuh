// Warp-level tensor-core tiles (mma.sync m16n8k16, fp32 accumulators) and the shared-memory
// layout they read with ldmatrix (sm80+).
//
// A tile in shared memory is row-major, rows of kRowChunks 16-byte chunks (8 16-bit elements each).
// Chunk c of row r is stored at chunk c ^ (r % 8) of that row: ldmatrix reads 8 rows at one column
// at once, which without the swizzle would all hit the same banks.
//
// Fragments, as PTX defines them for m16n8k16 (g = lane / 4, t = lane % 4):
//   A (16x16, row-major), 4 registers of 2 elements: {r g, cols 2t..}, {r g+8, cols 2t..},
//                                                   {r g, cols 8+2t..}, {r g+8, cols 8+2t..}
//   B (16x8, "column-major": element (k, n) beside (k+1, n)), 2 registers: {k 2t.., n g},
//                                                   {k 8+2t.., n g}
//   C (16x8, fp32), 4 floats: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace aotinfer {

// Byte offset of chunk `chunk` of row `row` in a swizzled tile with kRowChunks 16-byte chunks a
// row: ldmatrix's 8 rows of one chunk column hit distinct banks. Rows of 4 chunks (fp8 rows of 64
// elements) are swizzled two to a 128-byte line.
template <int kRowChunks>
__device__ __forceinline__ uint32_t SwizzledOffset(int row, int chunk) {
  static_assert(kRowChunks == 4 || kRowChunks % 8 == 0, "the swizzle spans 8 chunks");
  if constexpr (kRowChunks == 4) return uint32_t(row / 2 * 8 + ((row % 2 * 4 + chunk) ^ (row / 2 & 7))) * 16u;
  else return uint32_t(row * kRowChunks + (chunk ^ (row & 7))) * 16u;
}

__device__ __forceinline__ uint32_t SharedAddress(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Four 8x8 matrices of 16-bit elements; lane i gives the address of row i % 8 of matrix i / 8.
// Register j receives matrix j's elements (row lane / 4, cols 2 (lane % 4) and the next).
__device__ __forceinline__ void LoadMatrixX4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// The same, each matrix transposed: register j holds (rows 2 (lane % 4) and the next, col lane / 4).
__device__ __forceinline__ void LoadMatrixX4Trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// Two matrices (lanes 0-15 give the addresses), and the same transposed.
__device__ __forceinline__ void LoadMatrixX2(uint32_t (&r)[2], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(address));
}

__device__ __forceinline__ void LoadMatrixX2Trans(uint32_t (&r)[2], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(address));
}

// c += a * b for one m16n8k16 tile of T (half or nv_bfloat16) operands.
template <typename T>
__device__ __forceinline__ void Mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats as one register of two T, the first in the low half (an A or B fragment register).
template <typename T>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi) {
  uint32_t r;
  if constexpr (std::is_same_v<T, half>) {
    const __half2 h = __floats2half2_rn(lo, hi);
    memcpy(&r, &h, sizeof(r));
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    memcpy(&r, &h, sizeof(r));
  }
  return r;
}

}  // namespace aotinfer
