// MLA attention in its absorbed form (DeepSeek-V2/V3-class models' decode and incremental
// prefill): every query head against one latent KV head. A key is a token's compressed KV (ckv,
// 512 dims) and its rotary part (kpe, 64 dims); a value is its ckv. So a query row's score is
// q_nope . ckv + q_pe . kpe, and its output 512 wide: attention with 576-dim keys and 512-dim
// values, all heads sharing each key (MQA).
//
// The work partition is the prefill's (prefill.cuh, plan_prefill): an item is a request, a tile of
// kTileQ packed rows (query token r / num_heads, head r % num_heads: the rows of one token's heads
// side by side) and a range of keys; a request whose keys were split writes float32 partials that
// MergePartialsKernel combines. A block of 4 warps takes an item:
// - Q (the rows' q_nope and q_pe, 576 dims) lands in shared memory once; key tiles of kTileKV
//   tokens (their ckv and kpe side by side, 576 dims a row) stream through a cp.async double
//   buffer, the threads of a token copying its chunks (one page lookup a thread and tile).
// - S = Q K^T: warp w takes rows 16 (w % 2).. and the keys of half w / 2 of the tile: 8 or 16 of
//   them, m16n8 tiles over 36 k-steps. The row maxima of the two key halves meet in shared memory;
//   the exponentials (P, 16-bit) are written there too.
// - O += P V: warp w takes the same 16 rows and output dims 256 (w / 2)..: P's rows from shared
//   memory, V = the tile's ckv through ldmatrix.trans; O holds 128 floats a thread.
// The softmax is online in base 2, as prefill.cuh's; both warps of a row group keep the same
// running max (they compute it from the same shared values), each the sum over its own keys,
// added together at the end. Causal: query token i of q_len sees keys j <= i + kv_len - q_len.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "aotinfer/async_copy.cuh"
#include "aotinfer/attention.cuh"
#include "aotinfer/launch.cuh"
#include "aotinfer/mma.cuh"
#include "aotinfer/prefill.cuh"

namespace aotinfer {

constexpr int kMlaDimCkv = 512, kMlaDimKpe = 64, kMlaDimQk = kMlaDimCkv + kMlaDimKpe;

// One launch: PrefillParams' tables and outputs (head_dim 512; one KV head), q = q_nope, k = ckv
// (v unused), and the rotary parts beside them.
struct MlaParams : PrefillParams {
  const void* q_pe;  // [rows, num_heads, 64]
  int64_t q_pe_stride_n, q_pe_stride_h;
  const void* kpe;   // [pages, page_size, 64]
  int64_t kpe_stride_page, kpe_stride_slot;
};

// Tiles of kTileKV keys: 32 where a block may take 111 KB of shared memory (sm80, sm90, sm100),
// else 16 (sm86, sm89, sm120 grant 99 KB).
template <int kTileKV_>
struct MlaShape {
  static constexpr int kWarps = 4, kThreads = 32 * kWarps;
  static constexpr int kTileQ = 32, kTileKV = kTileKV_;
  static constexpr int kNT = kTileKV / 16;  // 8-key tiles of S a warp (its half of the keys)
  static constexpr int kRowChunks = kMlaDimQk / 8;   // 72 16-byte chunks a Q or K row
  static constexpr int kCkvChunks = kMlaDimCkv / 8;  // the first 64 of them
  static constexpr int kRowBytes = kRowChunks * 16;
  static constexpr int kQBytes = kTileQ * kRowBytes;
  static constexpr int kKBytes = kTileKV * kRowBytes;
  static constexpr int kPRowBytes = kTileKV * 2 + 16;  // P's keys and 16 bytes of padding: ldmatrix rows on distinct banks
  static constexpr int kPBytes = kTileQ * kPRowBytes;
  // Q, K x2, P, the row maxima (then sums) of the two key halves.
  static constexpr size_t kSharedBytes = size_t(kQBytes) + 2 * kKBytes + kPBytes + 2 * kTileQ * 4;
  // A tile's copy: thread t takes token t / 8 and chunks t % 8 + 8 c, c < 9.
  static constexpr int kThreadsPerToken = kThreads / kTileKV;
  static constexpr int kChunksPerThread = kRowChunks / kThreadsPerToken;
  static_assert(kThreadsPerToken * kTileKV == kThreads && kChunksPerThread * kThreadsPerToken == kRowChunks);
  static_assert(kTileKV == 16 || kTileKV == 32, "16 or 32 keys a tile");
};

template <typename T, int kTileKV>
__device__ __forceinline__ void MlaItem(const MlaParams& p, int4 item, int chunk_index, uint8_t* shared) {
  using S = MlaShape<kTileKV>;
  constexpr int kNT = S::kNT;
  uint8_t* const q_tile = shared;
  uint8_t* const k_stages = q_tile + S::kQBytes;
  uint8_t* const p_tile = k_stages + 2 * S::kKBytes;
  float* const halves = reinterpret_cast<float*>(p_tile + S::kPBytes);  // [2 key halves][kTileQ]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4, l7 = lane % 8;
  const int request = item.x, row_begin = item.y;
  const int4 info = p.requests[2 * request];
  const int4 split = p.requests[2 * request + 1];
  const int q_begin = info.x, q_len = info.y, kv_offset = info.z, kv_len = info.w;
  const int rows = min(S::kTileQ, q_len * p.group - row_begin);
  const int delta = kv_len - q_len;  // query i's diagonal: key i + delta
  const int last_token = int(p.group_divisor.Divide(uint32_t(row_begin + rows - 1)));
  const int begin = max(item.z, 0);
  int end = min(item.w, kv_len);
  if (p.causal) end = min(end, last_token + delta + 1);
  const int num_tiles = end > begin ? (end - begin + kTileKV - 1) / kTileKV : 0;

  const int row_group = (warp % 2) * 16, half = warp / 2;  // rows of S and O; S's keys kTileKV / 2 half.., O's dims 256 half..
  int token[2];  // of this thread's rows g and g + 8
#pragma unroll
  for (int r = 0; r < 2; ++r) token[r] = int(p.group_divisor.Divide(uint32_t(row_begin + row_group + g + 8 * r)));

  float o[32][4];
#pragma unroll
  for (int n = 0; n < 32; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};  // the sums over this warp's keys

  if (num_tiles > 0) {
    // Q rows (zeros past the item's): q_nope's 64 chunks, then q_pe's 8.
    const T* q_nope = static_cast<const T*>(p.q);
    const T* q_pe = static_cast<const T*>(p.q_pe);
    for (int c = tid; c < S::kTileQ * S::kRowChunks; c += S::kThreads) {
      const int r = c / S::kRowChunks, column = c % S::kRowChunks;
      const bool valid = r < rows;
      const int packed = row_begin + min(r, rows - 1);
      const int tok = int(p.group_divisor.Divide(uint32_t(packed)));
      const int head = packed - tok * p.group;
      const T* src = column < S::kCkvChunks
                         ? q_nope + int64_t(q_begin + tok) * p.q_stride_n + int64_t(head) * p.q_stride_h + column * 8
                         : q_pe + int64_t(q_begin + tok) * p.q_pe_stride_n + int64_t(head) * p.q_pe_stride_h +
                               (column - S::kCkvChunks) * 8;
      CopyAsync16OrZero(q_tile + SwizzledOffset<S::kRowChunks>(r, column), src, valid);
    }

    // This thread's token of a tile and its chunks: ckv's where the chunk is below 64, else kpe's.
    const int copy_token = tid / S::kThreadsPerToken, copy_column = tid % S::kThreadsPerToken;
    const T* ckv = static_cast<const T*>(p.k);
    const T* kpe = static_cast<const T*>(p.kpe);
    const int32_t* pages = p.indices + kv_offset;
    auto copy_tile = [&](int tile) {
      const int pos = begin + tile * kTileKV + copy_token;
      const bool valid = pos < end;
      const int index = valid ? int(p.page_size.Divide(uint32_t(pos))) : 0;
      const int64_t page = PageInCache(valid ? __ldg(pages + index) : 0, p.last_page);
      const int64_t slot = pos - index * int(p.page_size.divisor);
      const T* ckv_row = ckv + page * p.k_stride_page + slot * p.k_stride_slot;
      const T* kpe_row = kpe + page * p.kpe_stride_page + slot * p.kpe_stride_slot;
      uint8_t* const dst = k_stages + (tile % 2) * S::kKBytes;
#pragma unroll
      for (int c = 0; c < S::kChunksPerThread; ++c) {
        const int column = copy_column + c * S::kThreadsPerToken;
        const T* src = column < S::kCkvChunks ? ckv_row + column * 8 : kpe_row + (column - S::kCkvChunks) * 8;
        CopyAsync16OrZero(dst + SwizzledOffset<S::kRowChunks>(copy_token, column), valid ? src : ckv, valid);
      }
    };
    copy_tile(0);
    CommitAsyncGroup();

    const uint32_t q_base = SharedAddress(q_tile), k_base = SharedAddress(k_stages), p_base = SharedAddress(p_tile);
    const int a_row = row_group + (lane / 8) % 2 * 8 + l7;  // ldmatrix rows of A (Q, P) and their chunk's half
    const int a_half = lane / 16;
    for (int tile = 0; tile < num_tiles; ++tile) {
      WaitAsyncGroups<0>();
      __syncthreads();  // the tile (and Q) landed for every thread; the other stage and P are free
      if (tile + 1 < num_tiles) copy_tile(tile + 1);
      CommitAsyncGroup();
      const uint32_t stage = k_base + (tile % 2) * S::kKBytes;

      // S of this warp's rows and half of the keys (8 or 16).
      float s[kNT][4];
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
      const int key_half = half * (kTileKV / 2);
#pragma unroll 12
      for (int kk = 0; kk < S::kRowChunks / 2; ++kk) {
        uint32_t a[4];
        LoadMatrixX4(a, q_base + SwizzledOffset<S::kRowChunks>(a_row, 2 * kk + a_half));
        if constexpr (kNT == 1) {
          uint32_t b[2];
          LoadMatrixX2(b, stage + SwizzledOffset<S::kRowChunks>(key_half + l7, 2 * kk + (lane / 8) % 2));
          Mma16816<T>(s[0], a, b[0], b[1]);
        } else {  // two 8-key tiles from one load: keys lane / 16 * 8 + l7, chunk 2 kk + (lane / 8) % 2
          uint32_t b[4];
          LoadMatrixX4(b, stage + SwizzledOffset<S::kRowChunks>(key_half + lane / 16 * 8 + l7, 2 * kk + (lane / 8) % 2));
          Mma16816<T>(s[0], a, b[0], b[1]);
          Mma16816<T>(s[1], a, b[2], b[3]);
        }
      }
      // Logits in base 2, masked past the keys' end and (causal) the diagonal; the row maxima of
      // this warp's keys, then of both halves.
      const int tile_pos = begin + tile * kTileKV, key0 = tile_pos + key_half + 2 * t;
      float tile_max[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int last_seen = min(end - 1, p.causal ? token[r] + delta : INT_MAX);
        tile_max[r] = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = s[nt][2 * r + e];
            x = key0 + 8 * nt + e <= last_seen ? x * p.scale_log2 : -INFINITY;
            tile_max[r] = fmaxf(tile_max[r], x);
          }
        }
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
        if (t == 0) halves[half * S::kTileQ + row_group + g + 8 * r] = tile_max[r];
      }
      __syncthreads();
      float alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row_group + g + 8 * r;
        const float new_max = fmaxf(row_max[r], fmaxf(halves[row], halves[S::kTileQ + row]));
        alpha[r] = Exp2(row_max[r] - SafeBase(new_max));
        row_max[r] = new_max;
        const float base = SafeBase(new_max);
        row_sum[r] *= alpha[r];
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          float& lo = s[nt][2 * r];
          float& hi = s[nt][2 * r + 1];
          lo = Exp2(lo - base);
          hi = Exp2(hi - base);
          row_sum[r] += lo + hi;
          *reinterpret_cast<uint32_t*>(p_tile + row * S::kPRowBytes + (key_half + 8 * nt + 2 * t) * 2) = PackPair<T>(lo, hi);
        }
      }
      if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int n = 0; n < 32; ++n) {
          o[n][0] *= alpha[0];
          o[n][1] *= alpha[0];
          o[n][2] *= alpha[1];
          o[n][3] *= alpha[1];
        }
      }
      __syncthreads();  // P's two key halves are in

      // O += P V over the tile's keys, 16 at a time, V their ckv: this warp's 256 dims.
#pragma unroll
      for (int j = 0; j < kTileKV / 16; ++j) {
        uint32_t pa[4];
        LoadMatrixX4(pa, p_base + a_row * S::kPRowBytes + (2 * j + a_half) * 16);
#pragma unroll
        for (int np = 0; np < 16; ++np) {
          uint32_t b[4];
          LoadMatrixX4Trans(b, stage + SwizzledOffset<S::kRowChunks>(16 * j + (lane / 8) % 2 * 8 + l7, 32 * half + 2 * np + a_half));
          Mma16816<T>(o[2 * np], pa, b[0], b[1]);
          Mma16816<T>(o[2 * np + 1], pa, b[2], b[3]);
        }
      }
    }
    WaitAsyncGroups<0>();  // the (empty) group past the last tile
  }

  // Each row's sum over its quad, then over both key halves; the LSE; the output or partials.
  __syncthreads();  // every warp is done with the row maxima
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
    if (t == 0) halves[half * S::kTileQ + row_group + g + 8 * r] = row_sum[r];
  }
  __syncthreads();
  const bool final = split.y <= 1 || int(p.group_divisor.Divide(uint32_t(row_begin))) < split.z;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int local = row_group + g + 8 * r;
    if (local >= rows) continue;
    const int packed = row_begin + local;
    const int head = packed - token[r] * p.group;
    const float total = halves[local] + halves[S::kTileQ + local];
    const float inv = total > 0.f ? 1.f / total : 0.f;
    const float lse = total > 0.f ? row_max[r] + __log2f(total) : -INFINITY;
    if (final) {
      T* out = static_cast<T*>(p.out) + int64_t(q_begin + token[r]) * p.out_stride_n + int64_t(head) * p.out_stride_h +
               256 * half + 2 * t;
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        *reinterpret_cast<uint32_t*>(out + 8 * n) = PackPair<T>(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
      }
      if (half == 0 && t == 0 && p.lse != nullptr) p.lse[int64_t(q_begin + token[r]) * p.num_qo_heads + head] = lse;
    } else {
      const int64_t slot = int64_t(split.x) + int64_t(token[r]) * split.y + chunk_index;
      float* out = p.partial_out + (slot * p.num_qo_heads + head) * kMlaDimCkv + 256 * half + 2 * t;
#pragma unroll
      for (int n = 0; n < 32; ++n) *reinterpret_cast<float2*>(out + 8 * n) = make_float2(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
      if (half == 0 && t == 0) p.partial_lse[slot * p.num_qo_heads + head] = lse;
    }
  }
  __syncthreads();  // shared memory is free for the next item
}

template <typename T, int kTileKV>
__global__ void __launch_bounds__(MlaShape<kTileKV>::kThreads) MlaKernel(const MlaParams p) {
  extern __shared__ __align__(128) uint8_t shared[];
  WaitForPriorGrids();
  const int num_items = p.work[0].x;
  for (int i = blockIdx.y; i < num_items; i += gridDim.y) {
    const int4 item = p.work[2 + 2 * i];
    if (item.x < 0) continue;  // idle
    MlaItem<T, kTileKV>(p, item, p.work[3 + 2 * i].x, shared);
  }
  AllowDependentGrids();
}

template <typename T, int kTileKV>
cudaError_t LaunchMla(const MlaParams& p, int ctas, cudaStream_t stream, bool pdl) {
  using S = MlaShape<kTileKV>;
  const dim3 grid(1, unsigned(min(ctas, 65535)));  // one KV head; blocks stride over the items
  return LaunchWithSharedMemory(MlaKernel<T, kTileKV>, grid, dim3(S::kThreads), S::kSharedBytes, stream, pdl, p);
}

// The kernel on `ctas` blocks (32-key tiles where the device's blocks take their shared memory,
// else 16), then, unless `merge_from` is -1, the merge of split requests' partials over query
// tokens merge_from .. q_tokens - 1.
template <typename T>
cudaError_t BatchMla(const MlaParams& p, int ctas, int merge_from, int q_tokens, cudaStream_t stream, bool pdl, int device) {
  if (p.batch == 0 || ctas == 0) return cudaSuccess;
  cudaError_t status = cudaErrorInvalidConfiguration;
  // BlocksPerSm also raises the kernel's shared-memory limit past 48 KB, once per device.
  if (BlocksPerSm<MlaKernel<T, 32>>(MlaShape<32>::kThreads, MlaShape<32>::kSharedBytes, device) > 0) {
    status = LaunchMla<T, 32>(p, ctas, stream, pdl);
  } else if (BlocksPerSm<MlaKernel<T, 16>>(MlaShape<16>::kThreads, MlaShape<16>::kSharedBytes, device) > 0) {
    status = LaunchMla<T, 16>(p, ctas, stream, pdl);
  }
  if (status != cudaSuccess || merge_from < 0) return status;
  return MergePartials<T, kMlaDimCkv>(p, q_tokens - merge_from, PrefillPartials{p.requests, p.batch}, stream, pdl,
                                      merge_from);
}

}  // namespace aotinfer
