// Batch prefill attention: each request's queries against its keys and values, held contiguous
// (ragged: [tokens, kv_heads, head_dim] from an offset) or in pages (a page table), on tensor cores.
//
// A block of 4 warps takes one work item -- a request, a tile of kTileQ query rows and a range of
// key positions -- for one KV head. Query rows are packed GQA-style: row r of a request is query
// token r / group of query head kv_head * group + r % group, so the query heads that share a KV
// head share every K and V byte read (group 1: plain query tiles). Each warp owns kMmaQ 16-row
// tiles of the block's rows. Q lands in shared memory once; K and V tiles of kTileKV tokens stream
// through a cp.async double buffer: the next tile's K and V are copied while this one is computed,
// one barrier a tile. Scores S = Q K^T and O += P V run on mma.sync m16n8k16 with fp32
// accumulators, fragments through ldmatrix (.trans for V); the softmax is online, in base 2, the
// scale folded into one FMA before exp2.
//
// Masks (causal aligned to the end: query i of q_len sees key j <= i + kv_len - q_len; window_left;
// the end of the keys) are applied only on tiles that a mask cuts; tiles that every row masks are
// never visited. A custom mask (bits, one a query and key) cuts every tile: each row reads its
// tile's bits once, a few bytes, and a row that sees no key gets a zero output and an LSE of -inf.
// A request whose keys were split over several items (the caller's plan decides) writes float32
// partial outputs and LSEs that MergePartialsKernel (attention.cuh) combines.
// v_scale multiplies the output (final or partial) where it is finished, never the LSE. RoPE
// (ROPE_LLAMA, a kernel of its own) turns Q where it lands and each K tile where it lands, every
// lane pair the rows it copied (RopeRowsInPlace, attention.cuh).
//
// An fp8 cache (paged only) lands in the stages as stored, half the bytes, and is widened to half
// (exactly) in registers between ldmatrix and the tensor cores, as decode.cuh does: ldmatrix on
// fp8 bytes hands lane (g, c) a K token's dims 4c..4c+3 of a 16-dim chunk, so Q's dims are stored
// in that order (each 16-dim group permuted once when Q lands); V comes transposed as dims 2g, 2g+1
// of tokens 2c, 2c+1, so the output tiles hold a chunk's even and odd dims apart, put back in order
// in the epilogue. The tensor cores run in half; a bfloat16 q is converted to half where it lands,
// and the output back to bfloat16. One kernel a head_dim and fp8 format serves both q types (a
// launch parameter, read outside the inner loops).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "aotinfer/async_copy.cuh"
#include "aotinfer/attention.cuh"
#include "aotinfer/launch.cuh"
#include "aotinfer/mma.cuh"
#include "aotinfer/vec.cuh"

namespace aotinfer {

// One prefill launch: the rows are the batch's query tokens; KV is ragged or paged.
struct PrefillParams : AttentionParams {
  // KV element (token position pos of a request, head, d). Paged: at page indices[kv_offset +
  // pos / page_size], slot pos % page_size; ragged (indices null): at token kv_offset + pos, so
  // stride_page is the token stride and stride_slot is unused.
  const int4* work;              // [1 + items][2]: row 0 (items, heads, grouped, -) (BlockHeadAndItem); then (request, row_begin, kv_begin, kv_end), (chunk, -)
  const int4* requests;          // [batch][2]: (q_begin, q_len, kv_offset, kv_len), (first_partial, num_partials, split_from, mask_begin)
  // A custom mask (null: none; it replaces causal, a window still applies): request b's query i
  // sees key j where bit i * kv_len + j of its segment is set, the segment starting at byte
  // mask_begin, bits little-endian within a byte (FlashInfer's packed_custom_mask).
  const uint8_t* custom_mask;
  PageDivisor group_divisor;
  float v_scale;                 // multiplies the output
  bool causal;
  // An fp8 cache only (the kernel then runs in half): q and out are bfloat16; the cache is e5m2.
  bool bf16_io;
  bool e5m2;
};

constexpr int kPrefillWarps = 4;
constexpr float kRescaleSlack = 8.f;  // log2 units: exp2 of a logit stays below 256 between rescales
constexpr int kPrefillThreads = kPrefillWarps * 32;

// Tiles of one pair of head dims, D of q and k, DV of v and the output (equal, or DeepSeek's 192
// and 128): kMmaQ 16-row tiles a warp (two where registers allow: each K and V fragment read feeds
// two tiles), kTileKV tokens a K/V tile (32 at d128: S in 32 registers leaves ptxas room for a
// deeper ldmatrix prefetch, measured faster than 64 and 16); all fit 96.5 KB of shared memory, so
// every arch from sm80 (sm86, sm89 and sm120 allow 99 KB a block) runs one configuration. T: the
// tensor cores' type (q's and out's but with an fp8 cache: half); KV: T, or the fp8 cache's type.
template <typename T, typename KV, int D, int DV = D>
struct PrefillShape {
  static_assert((D == DV && (D == 64 || D == 128 || D == 256)) || (D == 192 && DV == 128),
                "head dims 64, 128, 256 or 192 (q, k) with 128 (v)");
  static constexpr bool kWiden = sizeof(KV) == 1;  // an fp8 cache
  static_assert(!kWiden || std::is_same_v<T, half>, "fp8 caches run the tensor cores in half");
  static_assert(!kWiden || D == DV, "fp8 caches with one head dim");
  static constexpr int kMmaQ = DV <= 128 ? 2 : 1;
  static constexpr int kTileQ = kPrefillWarps * 16 * kMmaQ;  // query rows a block
  static constexpr int kTileKV = D == 64 ? 64 : 32;
  static constexpr int kRowChunks = D / 8;                    // 16-byte chunks of a 16-bit q or k row
  static constexpr int kVRowChunks = DV / 8;                  // ... of a v or output row
  static constexpr int kCachedRowChunks = DV * int(sizeof(KV)) / 16;  // ... of a v row as stored (fp8: k too)
  static constexpr int kElemsPerChunk = 16 / int(sizeof(KV));
  static constexpr int kQBytes = kTileQ * D * 2;
  static constexpr int kKBytes = kTileKV * D * 2;             // one 16-bit K tile
  static constexpr int kVBytes = kTileKV * DV * 2;            // one 16-bit V tile
  static constexpr int kCachedKBytes = kTileKV * D * int(sizeof(KV));   // ... as stored
  static constexpr int kCachedVBytes = kTileKV * DV * int(sizeof(KV));
  static constexpr int kPageIdBytes = 2 * kTileKV * 4;       // paged: the page ids of two tiles
  // Q, K x2, V x2 (as stored), the page ids.
  static constexpr size_t kSharedBytes = size_t(kQBytes) + 2 * kCachedKBytes + 2 * kCachedVBytes + kPageIdBytes;
  // Chunks of V (and of K's first DV dims) a thread copies a tile; K's last D - DV dims (the
  // tail) add kTailChunksPerThread.
  static constexpr int kChunksPerThread = kTileKV * kCachedRowChunks / kPrefillThreads;
  static_assert(kChunksPerThread * kPrefillThreads == kTileKV * kCachedRowChunks);
  static constexpr int kTailChunks = (D - DV) / 8;
  static constexpr int kTailChunksPerThread = kChunksPerThread * kTailChunks / kCachedRowChunks;
  static_assert(kTailChunksPerThread * kCachedRowChunks == kChunksPerThread * kTailChunks);
  static_assert(kSharedBytes <= 96 * 1024 + 256, "one configuration for every arch from sm80");
};

__device__ __forceinline__ float TanhApprox(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The mask of one thread's part of a score tile: rows r = 0, 1 (its rows g and g + 8) of query
// tokens token[r], columns col0 + nt * 8 + e % 2 (e: the fragment element) for n-tiles nt. A row
// sees keys up to the keys' end and (causal) its diagonal, and from its window's start; what it
// does not see becomes -inf. `at(nt, e)` is the score's register.
template <int kNT, typename At>
__device__ __forceinline__ void MaskScores(const PrefillParams& p, At at, const int (&token)[2], int delta, int end, int col0) {
  int lo[2], hi[2];  // a row sees keys col0 + c for lo <= c <= hi
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int diagonal = token[r] + delta;
    hi[r] = min(end - 1, p.causal ? diagonal : INT_MAX) - col0;
    lo[r] = p.window_left >= 0 ? diagonal - p.window_left - col0 : INT_MIN;
  }
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = nt * 8 + (e & 1);
      at(nt, e) = c <= hi[e / 2] && c >= lo[e / 2] ? at(nt, e) : -INFINITY;
    }
  }
}

// Bits [bit, bit + kBits) of a packed mask, little-endian within a byte, the first in bit 0; the
// bytes past bit `last` (inclusive) are not read and count as 0.
template <int kBits>
__device__ __forceinline__ uint64_t MaskBits(const uint8_t* mask, int64_t bit, int64_t last) {
  static_assert(kBits == 32 || kBits == 64, "a tile's keys");
  const uint8_t* bytes = mask + (bit >> 3);
  const int shift = int(bit & 7), bytes_needed = int((last >> 3) - (bit >> 3)) + 1;
  uint64_t lo = 0, hi = 0;
#pragma unroll
  for (int i = 0; i < kBits / 8 + 1; ++i) {
    const uint64_t byte = i < bytes_needed ? __ldg(bytes + i) : 0;
    if (i < 8) lo |= byte << (8 * i);
    else hi = byte;
  }
  return shift ? (lo >> shift) | (hi << (64 - shift)) : lo;
}

// Where a split request's partials are: query token t (of the request) has partials first_partial
// + t * num_partials + chunk, from its token split_from on (its tokens before it are whole: their
// items write the output). Row n of the merge is a query token of the batch, found among the
// requests by binary search on q_begin.
struct PrefillPartials {
  const int4* requests;
  int batch;
  __device__ __forceinline__ int2 operator()(int row) const {
    if (batch == 0) return make_int2(0, 0);
    int lo = 0, hi = batch;  // the last request with q_begin <= row: the empty ones before it end there
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (requests[2 * mid].x <= row) lo = mid;
      else hi = mid;
    }
    const int4 info = requests[2 * lo];
    if (row < info.x || row >= info.x + info.y) return make_int2(0, 0);  // padding rows
    const int4 split = requests[2 * lo + 1];
    if (row - info.x < split.z) return make_int2(0, 0);  // whole rows
    return make_int2(split.x + (row - info.x) * split.y, split.y);
  }
};

template <typename T, typename KV, int D, int DV, bool kPaged, bool kMasked, bool kRope>
__device__ __forceinline__ void PrefillItem(const PrefillParams& p, int kv_head, int4 item, int chunk, uint8_t* shared) {
  using S = PrefillShape<T, KV, D, DV>;
  static_assert(!S::kWiden || kPaged, "fp8 caches are paged");
  constexpr int kMmaQ = S::kMmaQ, kTileKV = S::kTileKV, kNT = kTileKV / 8;
  constexpr uint32_t kRowBytes = S::kRowChunks * 16;    // of Q and K in shared memory
  constexpr uint32_t kVRowBytes = S::kVRowChunks * 16;  // of V and the output
  uint8_t* const q_tile = shared;
  uint8_t* const k_stages = shared + S::kQBytes;               // [2][kTileKV][D] as stored
  uint8_t* const v_stages = k_stages + 2 * S::kCachedKBytes;   // [2][kTileKV][DV] as stored
  int32_t* const tile_pages = reinterpret_cast<int32_t*>(v_stages + 2 * S::kCachedVBytes);  // [2][kTileKV]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int request = item.x, row_begin = item.y;
  const int4 info = p.requests[2 * request];
  const int4 split = p.requests[2 * request + 1];
  const int q_begin = info.x, q_len = info.y, kv_offset = info.z, kv_len = info.w;
  const int rows = min(S::kTileQ, q_len * p.group - row_begin);
  const int delta = kv_len - q_len;  // query i's diagonal: key i + delta
  const int first_token = int(p.group_divisor.Divide(uint32_t(row_begin)));
  const int last_token = int(p.group_divisor.Divide(uint32_t(row_begin + rows - 1)));
  int begin = max(item.z, 0);
  int end = min(item.w, kv_len);
  if (p.causal) end = min(end, last_token + delta + 1);
  if (p.window_left >= 0) begin = max(begin, first_token + delta - p.window_left);
  // Paged copies take runs of kRun tokens from one page where the page size allows (see below):
  // the runs start at multiples of kRun. Keys below the window's bound are masked anyway, and
  // a split's item starts at a multiple of the page size.
  constexpr int kRun = S::kChunksPerThread;
  const bool runs_in_page = kPaged && p.page_size.divisor % kRun == 0;
  if (runs_in_page) begin -= begin % kRun;
  const int num_tiles = end > begin ? (end - begin + kTileKV - 1) / kTileKV : 0;
  // Below these bounds no row of the block is masked (but for the keys' end).
  const int all_see_up_to = p.causal ? first_token + delta : INT_MAX;
  const int all_see_from = p.window_left >= 0 ? last_token + delta - p.window_left : INT_MIN;
  static_assert(!kMasked || !S::kWiden, "custom masks with 16-bit caches");
  static_assert(!kRope || (!S::kWiden && D == DV), "RoPE with 16-bit caches of one head dim");

  // This thread's rows: g and g + 8 of each of its warp's tiles; a row's query token and the
  // key on its diagonal.
  const int warp_row0 = warp * 16 * kMmaQ;
  auto token_of = [&](int mq, int r) {
    return int(p.group_divisor.Divide(uint32_t(row_begin + warp_row0 + mq * 16 + lane / 4 + r * 8)));
  };

  float o[kMmaQ][DV / 8][4];
  float row_max[kMmaQ][2], row_sum[kMmaQ][2];
#pragma unroll
  for (int mq = 0; mq < kMmaQ; ++mq) {
#pragma unroll
    for (int n = 0; n < DV / 8; ++n) o[mq][n][0] = o[mq][n][1] = o[mq][n][2] = o[mq][n][3] = 0.f;
    row_max[mq][0] = row_max[mq][1] = -INFINITY;
    row_sum[mq][0] = row_sum[mq][1] = 0.f;
  }

  if (num_tiles > 0) {
    // Q rows (zero past the request's rows), in the first commit group with K of tile 0.
    // fp8: a thread copies both chunks of a 16-dim group, which it permutes once they land.
    const T* q = static_cast<const T*>(p.q);
    constexpr int kQChunksTogether = S::kWiden ? 2 : 1;
    for (int c = tid * kQChunksTogether; c < S::kTileQ * S::kRowChunks; c += kPrefillThreads * kQChunksTogether) {
      const int r = c / S::kRowChunks, column = c % S::kRowChunks;
      const bool valid = r < rows;
      const int packed = row_begin + min(r, rows - 1);
      const int token = int(p.group_divisor.Divide(uint32_t(packed)));
      const int head = kv_head * p.group + (packed - token * p.group);
#pragma unroll
      for (int i = 0; i < kQChunksTogether; ++i) {
        CopyAsync16OrZero(q_tile + SwizzledOffset<S::kRowChunks>(r, column + i),
                          q + int64_t(q_begin + token) * p.q_stride_n + int64_t(head) * p.q_stride_h + (column + i) * 8, valid);
      }
    }

    // Each thread copies chunk column `column` (of V's row as stored) of kRun consecutive tokens,
    // first_row onwards, of every tile, of K and of V; where K is wider (D > DV), its tail chunks
    // of the same tokens too, kTailChunksPerThread of them. Ragged: rows kv_offset + pos, a stride
    // apart, from a pointer that moves a tile at a time. Paged: where the page size is a multiple
    // of kRun, a thread's run lies in one page (begin was rounded down to a multiple of kRun, so
    // every run starts on one): one page id a tile, read from shared memory (tile 0's from global
    // memory); otherwise each token's own.
    static_assert(kRun <= 8 && (kRun & (kRun - 1)) == 0, "a run's rows share their swizzle phase but for i");
    const int column = tid % S::kCachedRowChunks, first_row = tid / S::kCachedRowChunks * kRun;
    // 16-bit: row first_row + i holds this chunk at column ^ ((first_row + i) % 8); first_row % 8
    // is a multiple of kRun, so that is (column ^ first_row % 8) ^ i. fp8: the same swizzle over
    // its shorter rows (SwizzledOffset).
    const int run_column = column ^ (first_row % 8);
    auto chunk_at_row = [&](int i, uint32_t row_bytes) {
      if constexpr (S::kWiden) return SwizzledOffset<S::kCachedRowChunks>(first_row + i, column);
      else return uint32_t(first_row + i) * row_bytes + uint32_t(run_column ^ i) * 16u;
    };
    const KV* k = static_cast<const KV*>(p.k) + kv_head * p.k_stride_head + column * S::kElemsPerChunk;
    const KV* v = static_cast<const KV*>(p.v) + kv_head * p.v_stride_head + column * S::kElemsPerChunk;
    // Ragged: where registers allow (one 16-row tile a warp), pointers that move a tile at a time;
    // else recomputed from the tile (measured: each choice is faster where it is used).
    const int first_key = kv_offset + begin + first_row;  // ragged: the row of this thread's first key
    const KV* k_next = k + (kPaged ? 0 : int64_t(first_key) * p.k_stride_page);
    const KV* v_next = v + (kPaged ? 0 : int64_t(first_key) * p.v_stride_page);
    // Paged: the page ids of a tile's tokens land in shared memory (cp.async, in the commit group of
    // the tile two before), so a copy never waits on a global load; tile 0's are read directly.
    const int32_t* pages = p.indices + kv_offset;
    auto fetch_page_ids = [&](int tile) {  // for tile `tile`, into tile_pages[tile % 2]
      if constexpr (kPaged) {
        if (tid < kTileKV) {
          const int pos = begin + tile * kTileKV + tid;
          const bool valid = pos < end;
          CopyAsync4OrZero(tile_pages + (tile % 2) * kTileKV + tid, pages + (valid ? p.page_size.Divide(uint32_t(pos)) : 0), valid);
        }
      }
    };
    auto page_of = [&](int tile, int token, int index, bool valid) {  // the page of a tile's token
      return PageInCache(tile == 0 ? (valid ? __ldg(pages + index) : 0) : tile_pages[(tile % 2) * kTileKV + token],
                         p.last_page);
    };
    // K's tail chunk j of this thread: row tail_row(j) of its run, chunk tail_chunk(j).
    constexpr int kTail = S::kTailChunks > 0 ? S::kTailChunks : 1;  // (no tail: never called)
    auto tail_row = [&](int j) { return (column * S::kTailChunksPerThread + j) / kTail; };
    auto tail_chunk = [&](int j) { return S::kVRowChunks + (column * S::kTailChunksPerThread + j) % kTail; };
    // A run of kRun rows from src, stride apart, into dst (zeros for rows i >= left, past the
    // keys' end, where `head` stands for an address that is not read); K's with its tail.
    auto copy_run = [&](uint8_t* dst, const KV* src, int64_t stride, const KV* head, int left, uint32_t row_bytes) {
#pragma unroll
      for (int i = 0; i < kRun; ++i, src += stride) CopyAsync16OrZero(dst + chunk_at_row(i, row_bytes), i < left ? src : head, i < left);
    };
    auto copy_k_run = [&](uint8_t* dst, const KV* src, int64_t stride, int left) {
      copy_run(dst, src, stride, k, left, kRowBytes);
#pragma unroll
      for (int j = 0; j < S::kTailChunksPerThread; ++j) {
        const int r = tail_row(j), c = tail_chunk(j);
        CopyAsync16OrZero(dst + SwizzledOffset<S::kRowChunks>(first_row + r, c),
                          r < left ? src + r * stride + (c - column) * S::kElemsPerChunk : k, r < left);
      }
    };
    // This thread's runs of K and V of tile `tile`; paged, one page lookup serves both. (Ragged
    // with two 16-row tiles a warp: the same copies written apart, which ptxas schedules ~7% faster.)
    auto copy_tile = [&](int tile) {
      uint8_t* const k_dst = k_stages + (tile % 2) * S::kCachedKBytes;
      uint8_t* const v_dst = v_stages + (tile % 2) * S::kCachedVBytes;
      if constexpr (!kPaged && kMmaQ > 1) {
        const int left = end - begin - tile * kTileKV - first_row;
        copy_k_run(k_dst, k + int64_t(first_key + tile * kTileKV) * p.k_stride_page, p.k_stride_page, left);
        copy_run(v_dst, v + int64_t(first_key + tile * kTileKV) * p.v_stride_page, p.v_stride_page, v, left, kVRowBytes);
        return;
      }
      const int pos = begin + tile * kTileKV + first_row;  // of row first_row
      const int left = end - pos;
      if constexpr (!kPaged) {
        copy_k_run(k_dst, k_next, p.k_stride_page, left);
        copy_run(v_dst, v_next, p.v_stride_page, v, left, kVRowBytes);
        k_next += kTileKV * p.k_stride_page;
        v_next += kTileKV * p.v_stride_page;
      } else if (runs_in_page) {
        const int index = int(p.page_size.Divide(uint32_t(pos)));
        const int slot = pos - index * int(p.page_size.divisor);
        const int page = page_of(tile, first_row, index, left > 0);
        copy_k_run(k_dst, k + int64_t(page) * p.k_stride_page + int64_t(slot) * p.k_stride_slot, p.k_stride_slot, left);
        copy_run(v_dst, v + int64_t(page) * p.v_stride_page + int64_t(slot) * p.v_stride_slot, p.v_stride_slot, v, left,
                 kVRowBytes);
      } else {
        auto slot_of = [&](int i, bool valid) {  // (page, slot) of row first_row + i
          const int index = int(p.page_size.Divide(uint32_t(pos + i)));
          const int slot = pos + i - index * int(p.page_size.divisor);
          const int page = page_of(tile, first_row + i, index, valid);
          return int2{page, slot};
        };
#pragma unroll
        for (int i = 0; i < kRun; ++i) {
          const bool valid = i < left;
          const int2 at = slot_of(i, valid);
          const KV* k_src = k + int64_t(at.x) * p.k_stride_page + int64_t(at.y) * p.k_stride_slot;
          const KV* v_src = v + int64_t(at.x) * p.v_stride_page + int64_t(at.y) * p.v_stride_slot;
          CopyAsync16OrZero(k_dst + chunk_at_row(i, kRowBytes), valid ? k_src : k, valid);
          CopyAsync16OrZero(v_dst + chunk_at_row(i, kVRowBytes), valid ? v_src : v, valid);
        }
#pragma unroll
        for (int j = 0; j < S::kTailChunksPerThread; ++j) {
          const int r = tail_row(j), c = tail_chunk(j);
          const int2 at = slot_of(r, r < left);
          const KV* k_src = k + int64_t(at.x) * p.k_stride_page + int64_t(at.y) * p.k_stride_slot + (c - column) * S::kElemsPerChunk;
          CopyAsync16OrZero(k_dst + SwizzledOffset<S::kRowChunks>(first_row + r, c), r < left ? k_src : k, r < left);
        }
      }
    };
    copy_tile(0);
    fetch_page_ids(1);
    CommitAsyncGroup();

    // RoPE: the Q rows this lane pair copied (landed with tile 0), each at its query token's
    // position, kv_len - q_len + token.
    auto rope_q = [&] {
      for (int c0 = 0; c0 < S::kTileQ * S::kRowChunks; c0 += kPrefillThreads) {
        const int c = c0 + tid, r = c / S::kRowChunks;
        const int token = int(p.group_divisor.Divide(uint32_t(row_begin + min(r, rows - 1))));
        RopeRowsInPlace<T, D, 1>(
            p, c % S::kRowChunks, [&](int, int column) { return q_tile + SwizzledOffset<S::kRowChunks>(r, column); },
            token + delta, 0);
      }
    };

    // fp8: this thread's pairs of Q chunks (landed with tile 0: its own copies), each 16-dim group
    // stored in the order ldmatrix hands fp8 K's dims (k = 2c, 2c+1, 2c+8, 2c+9 are dims 4c..4c+3:
    // pairs 0, 2, 4, 6 of the group, then 1, 3, 5, 7), a bfloat16 q converted to half on the way.
    auto q_for_fp8 = [&] {
      for (int c = tid * 2; c < S::kTileQ * S::kRowChunks; c += kPrefillThreads * 2) {
        uint4* const lo = reinterpret_cast<uint4*>(q_tile + SwizzledOffset<S::kRowChunks>(c / S::kRowChunks, c % S::kRowChunks));
        uint4* const hi = reinterpret_cast<uint4*>(q_tile + SwizzledOffset<S::kRowChunks>(c / S::kRowChunks, c % S::kRowChunks + 1));
        uint4 a = *lo, b = *hi;
        if (p.bf16_io) a = BfloatToHalf8(a), b = BfloatToHalf8(b);
        *lo = make_uint4(a.x, a.z, b.x, b.z);
        *hi = make_uint4(a.y, a.w, b.y, b.w);
      }
    };
    // fp8: K of 16 tokens (rows `token0` on) and a 16-dim chunk, through ldmatrix of its bytes:
    // the B fragments of two 8-token tiles, widened. V: two 8-token matrices transposed, whose
    // even and odd dims' fragments a byte permute separates.
    auto fp8_k = [&](uint32_t (&b)[4], uint32_t stage, int token0, int chunk) {
      uint32_t raw[2];
      LoadMatrixX2(raw, stage + SwizzledOffset<S::kCachedRowChunks>(token0 + (lane / 8) % 2 * 8 + lane % 8, chunk));
      b[0] = WidenPairToHalf<KV>(uint16_t(raw[0])), b[1] = WidenPairToHalf<KV>(uint16_t(raw[0] >> 16));
      b[2] = WidenPairToHalf<KV>(uint16_t(raw[1])), b[3] = WidenPairToHalf<KV>(uint16_t(raw[1] >> 16));
    };
    auto fp8_v = [&](uint32_t (&b)[4], uint32_t stage, int token0, int chunk) {
      uint32_t raw[2];
      LoadMatrixX2Trans(raw, stage + SwizzledOffset<S::kCachedRowChunks>(token0 + (lane / 8) % 2 * 8 + lane % 8, chunk));
      const uint32_t even = __byte_perm(raw[0], raw[1], 0x6420), odd = __byte_perm(raw[0], raw[1], 0x7531);
      b[0] = WidenPairToHalf<KV>(uint16_t(even)), b[1] = WidenPairToHalf<KV>(uint16_t(even >> 16));
      b[2] = WidenPairToHalf<KV>(uint16_t(odd)), b[3] = WidenPairToHalf<KV>(uint16_t(odd >> 16));
    };

    const bool capped = p.soft_cap > 0.f;
    const float cap_scale = capped ? p.scale_log2 / (kLog2e * p.soft_cap) : 0.f;  // sm_scale / cap
    const float cap_log2 = p.soft_cap * kLog2e;
    const float scale = capped ? 1.f : p.scale_log2;  // logits (base 2) = scale * what S holds

    // ldmatrix addresses: every fragment row a lane gives is = lane (mod 8), so its chunk c sits
    // at c ^ (lane % 8); tiles further down add whole rows. (16-bit K and V; fp8's go through
    // fp8_k and fp8_v.)
    const int l7 = lane % 8;
    const uint32_t q_lane = SharedAddress(q_tile) + uint32_t(warp_row0 + (lane / 8) % 2 * 8 + l7) * kRowBytes;
    const uint32_t k_lane = SharedAddress(k_stages) + uint32_t(lane / 16 * 8 + l7) * kRowBytes;
    const uint32_t v_lane = SharedAddress(v_stages) + uint32_t((lane / 8) % 2 * 8 + l7) * kVRowBytes;
    const int q_half = lane / 16, k_half = (lane / 8) % 2;
    // Chunk two_e + half (two_e even, half 0 or 1) of such a row, `width` dims wide. At d64/d128:
    // (two_e % 8) ^ (half ^ l7) within its group of 8 chunks, the group's offset an immediate, so 4
    // lane offsets a half serve every k-step and ldmatrix needs no address arithmetic a k-step
    // (measured: +2.6% at d128, even at d64, -2% at d256, which keeps the plain form).
    auto chunk_at = [&](auto width, int two_e, int half) {
      if constexpr (decltype(width)::value > 128) return uint32_t((two_e + half) ^ l7) * 16u;
      else return uint32_t((two_e & 7) ^ (half ^ l7)) * 16u + uint32_t(two_e & ~7) * 16u;
    };
    constexpr std::integral_constant<int, D> kQK{};
    constexpr std::integral_constant<int, DV> kVO{};

    for (int tile = 0; tile < num_tiles; ++tile) {
      WaitAsyncGroups<0>();  // this tile's K and V (and Q) are in, copied during the tile before
      if constexpr (S::kWiden) {
        if (tile == 0) q_for_fp8();
      }
      if constexpr (kRope) {  // the rows this lane pair copied, turned before the barrier publishes them
        if (tile == 0) rope_q();
        const int pos0 = begin + tile * kTileKV + first_row;
        uint8_t* const k_tile = k_stages + (tile % 2) * S::kCachedKBytes;
        RopeRowsInPlace<T, D, kRun>(
            p, column, [&](int i, int c) { return k_tile + SwizzledOffset<S::kRowChunks>(first_row + i, c); }, pos0, 1);
      }
      __syncthreads();       // ... for every thread; every warp is done with the stage refilled next
      if (tile + 1 < num_tiles) {
        copy_tile(tile + 1);
        // Tile tile + 2's page ids go where tile tile's were, read when its copies were issued.
        if (tile + 2 < num_tiles) fetch_page_ids(tile + 2);
      }
      CommitAsyncGroup();

      // S = Q K^T: kMmaQ x kNT 16x8 tiles a warp, over D / 16 steps.
      float s[kMmaQ][kNT][4];
#pragma unroll
      for (int mq = 0; mq < kMmaQ; ++mq) {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) s[mq][nt][0] = s[mq][nt][1] = s[mq][nt][2] = s[mq][nt][3] = 0.f;
      }
      const uint32_t k_base = k_lane + (tile % 2) * S::kKBytes;
      const uint32_t k_stage = SharedAddress(k_stages) + (tile % 2) * S::kCachedKBytes;  // fp8
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[kMmaQ][4];
#pragma unroll
        for (int mq = 0; mq < kMmaQ; ++mq) LoadMatrixX4(a[mq], q_lane + mq * 16 * kRowBytes + chunk_at(kQK, 2 * kk, q_half));
#pragma unroll
        for (int nj = 0; nj < kTileKV / 16; ++nj) {
          uint32_t b[4];
          if constexpr (S::kWiden) fp8_k(b, k_stage, nj * 16, kk);
          else LoadMatrixX4(b, k_base + nj * 16 * kRowBytes + chunk_at(kQK, 2 * kk, k_half));
#pragma unroll
          for (int mq = 0; mq < kMmaQ; ++mq) {
            Mma16816<T>(s[mq][2 * nj], a[mq], b[0], b[1]);
            Mma16816<T>(s[mq][2 * nj + 1], a[mq], b[2], b[3]);
          }
        }
      }

      // Cap, mask where a mask cuts this tile, and fold into each row's running softmax. The cap
      // and the mask are separate warp-uniform branches: folded into one loop, the compiler
      // predicates both on every tile, ~400 issue slots a tile that most tiles never need.
      const int tile_pos = begin + tile * kTileKV;
      const bool masked = kMasked || tile_pos + kTileKV > end || tile_pos + kTileKV - 1 > all_see_up_to || tile_pos < all_see_from;
      if (capped) {
#pragma unroll
        for (int mq = 0; mq < kMmaQ; ++mq) {
#pragma unroll
          for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mq][nt][e] = cap_log2 * TanhApprox(s[mq][nt][e] * cap_scale);
          }
        }
      }
      if (masked) {
        const int col0 = tile_pos + (lane % 4) * 2;  // this thread's first key of the tile
#pragma unroll
        for (int mq = 0; mq < kMmaQ; ++mq) {
          const int token[2] = {token_of(mq, 0), token_of(mq, 1)};
          MaskScores<kNT>(p, [&](int nt, int e) -> float& { return s[mq][nt][e]; }, token, delta, end, col0);
          if constexpr (kMasked) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              // The row's bits of this tile (none past its keys' end, none for a padding row),
              // from the request's segment (its first byte: mask_begin).
              const int64_t first = int64_t(p.requests[2 * request + 1].w) * 8 + int64_t(token[r]) * kv_len + tile_pos;
              const uint64_t bits = token[r] < q_len ? MaskBits<kTileKV>(p.custom_mask, first, first + (end - 1 - tile_pos)) : 0;
              const uint64_t mine = bits >> ((lane % 4) * 2);
#pragma unroll
              for (int nt = 0; nt < kNT; ++nt) {
                if (!((mine >> (nt * 8)) & 1)) s[mq][nt][2 * r] = -INFINITY;
                if (!((mine >> (nt * 8 + 1)) & 1)) s[mq][nt][2 * r + 1] = -INFINITY;
              }
            }
          }
        }
      }
#pragma unroll
      for (int mq = 0; mq < kMmaQ; ++mq) {
        // Row maxima and sums as trees (chains of dependent adds would leave the warp waiting).
        float partial[2][kNT];
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          partial[0][nt] = fmaxf(s[mq][nt][0], s[mq][nt][1]);
          partial[1][nt] = fmaxf(s[mq][nt][2], s[mq][nt][3]);
        }
#pragma unroll
        for (int width = kNT / 2; width >= 1; width /= 2) {
#pragma unroll
          for (int i = 0; i < width; ++i) {
            partial[0][i] = fmaxf(partial[0][i], partial[0][i + width]);
            partial[1][i] = fmaxf(partial[1][i], partial[1][i + width]);
          }
        }
        // The running max moves only when a row's grows past it by kRescaleSlack (lazily: until
        // then exp2 stays below 2^kRescaleSlack and the output, sum and LSE keep one base), and
        // then for the whole warp: most tiles skip rescaling the output.
        // Whether it grows is decided on each thread's own columns (the vote spans the warp, so
        // the outcome is the same); the row's max over its quad (two shuffles) only when it does.
        float tile_max[2];
        bool grows = false;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          tile_max[r] = partial[r][0] * scale;
          grows |= tile_max[r] > row_max[mq][r] + kRescaleSlack;
        }
        if (__any_sync(0xffffffffu, grows)) {
          float alpha[2];
#pragma unroll
          for (int r = 0; r < 2; ++r) alpha[r] = MoveRowMax(tile_max[r], row_max[mq][r], row_sum[mq][r]);
#pragma unroll
          for (int n = 0; n < DV / 8; ++n) {
            o[mq][n][0] *= alpha[0];
            o[mq][n][1] *= alpha[0];
            o[mq][n][2] *= alpha[1];
            o[mq][n][3] *= alpha[1];
          }
        }
        const float base[2] = {SafeBase(row_max[mq][0]), SafeBase(row_max[mq][1])};
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mq][nt][e] = Exp2(fmaf(s[mq][nt][e], scale, -base[e / 2]));
          partial[0][nt] = s[mq][nt][0] + s[mq][nt][1];
          partial[1][nt] = s[mq][nt][2] + s[mq][nt][3];
        }
#pragma unroll
        for (int width = kNT / 2; width >= 1; width /= 2) {
#pragma unroll
          for (int i = 0; i < width; ++i) {
            partial[0][i] += partial[0][i + width];
            partial[1][i] += partial[1][i + width];
          }
        }
        row_sum[mq][0] += partial[0][0];
        row_sum[mq][1] += partial[1][0];
      }

      // O += P V: P straight from the score registers, V through ldmatrix.trans.
      const uint32_t v_base = v_lane + (tile % 2) * S::kVBytes;
      const uint32_t v_stage = SharedAddress(v_stages) + (tile % 2) * S::kCachedVBytes;  // fp8
#pragma unroll
      for (int j = 0; j < kTileKV / 16; ++j) {
        uint32_t pa[kMmaQ][4];
#pragma unroll
        for (int mq = 0; mq < kMmaQ; ++mq) {
          pa[mq][0] = PackPair<T>(s[mq][2 * j][0], s[mq][2 * j][1]);
          pa[mq][1] = PackPair<T>(s[mq][2 * j][2], s[mq][2 * j][3]);
          pa[mq][2] = PackPair<T>(s[mq][2 * j + 1][0], s[mq][2 * j + 1][1]);
          pa[mq][3] = PackPair<T>(s[mq][2 * j + 1][2], s[mq][2 * j + 1][3]);
        }
#pragma unroll
        for (int np = 0; np < DV / 16; ++np) {
          uint32_t b[4];  // fp8: o[2 np] takes the chunk's even dims, o[2 np + 1] its odd ones
          if constexpr (S::kWiden) fp8_v(b, v_stage, j * 16, np);
          else LoadMatrixX4Trans(b, v_base + j * 16 * kVRowBytes + chunk_at(kVO, 2 * np, q_half));
#pragma unroll
          for (int mq = 0; mq < kMmaQ; ++mq) {
            Mma16816<T>(o[mq][2 * np], pa[mq], b[0], b[1]);
            Mma16816<T>(o[mq][2 * np + 1], pa[mq], b[2], b[3]);
          }
        }
      }
    }
    WaitAsyncGroups<0>();  // the (empty) group past the last tile
  }

  // Finish each row: its sum over the quad, the sink (once, where the row is not split), the
  // LSE; then the output times v_scale, through shared memory (16-byte stores) or as float32
  // partials (the merge is linear in them).
  const bool final = split.y <= 1 || first_token < split.z;
  const int g = lane / 4, t = lane % 4;
  auto pack_out = [&](float lo, float hi) {  // two outputs in out's type
    if constexpr (S::kWiden) return p.bf16_io ? PackPair<nv_bfloat16>(lo, hi) : PackPair<half>(lo, hi);
    else return PackPair<T>(lo, hi);
  };
  __syncthreads();  // every warp is done reading Q: its tile takes the output
#pragma unroll
  for (int mq = 0; mq < kMmaQ; ++mq) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = row_sum[mq][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int local = warp_row0 + mq * 16 + g + r * 8;
      const int packed = row_begin + local;
      const int token = token_of(mq, r);
      const int head = kv_head * p.group + (packed - token * p.group);
      float m = row_max[mq][r];
      const float sink = final && p.sinks != nullptr ? p.sinks[head] * kLog2e : -INFINITY;
      const float base = SafeBase(fmaxf(m, sink));
      const float total = sum * Exp2(m - base) + Exp2(sink - base);
      const float inv = total > 0.f ? p.v_scale * Exp2(m - base) / total : 0.f;
      const float lse = total > 0.f ? base + __log2f(total) : -INFINITY;
      const bool valid = local < rows;
      if (final && S::kWiden) {  // chunk j's even and odd dims interleaved again: this thread's are 16 j + 4t .. + 3
#pragma unroll
        for (int j = 0; j < DV / 16; ++j) {
          *reinterpret_cast<uint2*>(q_tile + SwizzledOffset<S::kVRowChunks>(local, 2 * j + t / 2) + 8 * (t % 2)) =
              make_uint2(pack_out(o[mq][2 * j][2 * r] * inv, o[mq][2 * j + 1][2 * r] * inv),
                         pack_out(o[mq][2 * j][2 * r + 1] * inv, o[mq][2 * j + 1][2 * r + 1] * inv));
        }
        if (valid && t == 0 && p.lse != nullptr) p.lse[int64_t(q_begin + token) * p.num_qo_heads + head] = lse;
      } else if (final) {
#pragma unroll
        for (int n = 0; n < DV / 8; ++n) {
          *reinterpret_cast<uint32_t*>(q_tile + SwizzledOffset<S::kVRowChunks>(local, n) + 4 * t) =
              pack_out(o[mq][n][2 * r] * inv, o[mq][n][2 * r + 1] * inv);
        }
        if (valid && t == 0 && p.lse != nullptr) p.lse[int64_t(q_begin + token) * p.num_qo_heads + head] = lse;
      } else if (valid) {
        const int64_t slot = int64_t(split.x) + int64_t(token) * split.y + chunk;
        if constexpr (S::kWiden) {  // dims 16 j + 4t .. + 3, as in the final case
          float* out = p.partial_out + (slot * p.num_qo_heads + head) * DV + 4 * t;
#pragma unroll
          for (int j = 0; j < DV / 16; ++j) {
            *reinterpret_cast<float4*>(out + j * 16) =
                make_float4(o[mq][2 * j][2 * r] * inv, o[mq][2 * j + 1][2 * r] * inv, o[mq][2 * j][2 * r + 1] * inv,
                            o[mq][2 * j + 1][2 * r + 1] * inv);
          }
        } else {
          float* out = p.partial_out + (slot * p.num_qo_heads + head) * DV + 2 * t;
#pragma unroll
          for (int n = 0; n < DV / 8; ++n) {
            *reinterpret_cast<float2*>(out + n * 8) = make_float2(o[mq][n][2 * r] * inv, o[mq][n][2 * r + 1] * inv);
          }
        }
        if (t == 0) p.partial_lse[slot * p.num_qo_heads + head] = lse;
      }
    }
  }
  if (final) {
    __syncthreads();
    T* out = static_cast<T*>(p.out);
    for (int c = tid; c < rows * S::kVRowChunks; c += kPrefillThreads) {
      const int r = c / S::kVRowChunks, column = c % S::kVRowChunks;
      const int packed = row_begin + r;
      const int token = int(p.group_divisor.Divide(uint32_t(packed)));
      const int head = kv_head * p.group + (packed - token * p.group);
      *reinterpret_cast<uint4*>(out + int64_t(q_begin + token) * p.out_stride_n + int64_t(head) * p.out_stride_h + column * 8) =
          *reinterpret_cast<const uint4*>(q_tile + SwizzledOffset<S::kVRowChunks>(r, column));
    }
  }
  __syncthreads();  // shared memory is free for the next item
}

// A block's KV head and first work item; blocks stride over the items from there (one each,
// unless a CUDA graph's fixed grid is smaller than the plan's items). Blocks start in the order of
// their linear index, and consecutive ones take the items of the same few KV heads, in the plan's
// order of items (most costly first): work[0].y heads, which the plan chose so that their keys and
// values fit in L2 together. All heads at once read every head's keys from memory at 32 KV heads;
// one head at a time leaves its costly items to start last and run alone at the end (a causal
// 8192-token prefill with 32 KV heads lost 12% so). Past the first work[0].z items (0: none) all
// heads go at once: the plan puts there the shortest items, whose keys for every head fit in L2,
// so they fill the SMs that the last heads' costly items leave idle at the end.
__device__ __forceinline__ int2 BlockHeadAndItem(const PrefillParams& p) {
  const int heads = int(gridDim.x), slots = int(gridDim.y);
  const int group = min(max(p.work[0].y, 1), heads);
  const int grouped = p.work[0].z > 0 ? min(p.work[0].z, slots) : slots;
  const int linear = int(blockIdx.x) + int(blockIdx.y) * heads;
  if (linear >= heads * grouped) {
    const int rest = linear - heads * grouped;
    return make_int2(rest % heads, grouped + rest / heads);
  }
  const int first_head = linear / (group * grouped) * group;
  const int heads_here = min(group, heads - first_head);
  const int rank = linear - first_head * grouped;
  return make_int2(first_head + rank % heads_here, rank / heads_here);
}

template <typename T, typename KV, int D, int DV, bool kPaged, bool kMasked, bool kRope>
__global__ void __launch_bounds__(kPrefillThreads) PrefillKernel(const PrefillParams p) {
  extern __shared__ __align__(128) uint8_t shared[];
  WaitForPriorGrids();
  const int num_items = p.work[0].x;
  const int2 start = BlockHeadAndItem(p);
  for (int i = start.y; i < num_items; i += gridDim.y) {
    const int4 item = p.work[2 + 2 * i];
    if (item.x < 0) continue;  // idle
    PrefillItem<T, KV, D, DV, kPaged, kMasked, kRope>(p, start.x, item, p.work[3 + 2 * i].x, shared);
  }
  AllowDependentGrids();
}

template <typename T, typename KV, int D, int DV, bool kPaged, bool kMasked = false, bool kRope = false>
cudaError_t LaunchPrefill(const PrefillParams& p, int ctas, cudaStream_t stream, bool pdl, int device) {
  constexpr size_t kSharedBytes = PrefillShape<T, KV, D, DV>::kSharedBytes;
  // BlocksPerSm also raises the kernel's shared-memory limit past 48 KB, once per device.
  if (BlocksPerSm<PrefillKernel<T, KV, D, DV, kPaged, kMasked, kRope>>(kPrefillThreads, kSharedBytes, device) == 0) {
    return cudaErrorInvalidConfiguration;
  }
  const dim3 grid(unsigned(p.num_kv_heads), unsigned(min(ctas, 65535)));  // grid.y's limit; blocks stride
  return LaunchWithSharedMemory(PrefillKernel<T, KV, D, DV, kPaged, kMasked, kRope>, grid, dim3(kPrefillThreads), kSharedBytes,
                                stream, pdl, p);
}

// A 16-bit cache, ragged or paged, masked or not, RoPE or not: a masked kernel and a RoPE kernel
// of their own, so that neither's registers weigh on the kernels without it.
template <typename T, int D, int DV, bool kRope>
cudaError_t LaunchPrefill16(const PrefillParams& p, int ctas, cudaStream_t stream, bool pdl, int device) {
  const bool paged = p.indices != nullptr;
  if (p.custom_mask != nullptr) {
    return paged ? LaunchPrefill<T, T, D, DV, true, true, kRope>(p, ctas, stream, pdl, device)
                 : LaunchPrefill<T, T, D, DV, false, true, kRope>(p, ctas, stream, pdl, device);
  }
  return paged ? LaunchPrefill<T, T, D, DV, true, false, kRope>(p, ctas, stream, pdl, device)
               : LaunchPrefill<T, T, D, DV, false, false, kRope>(p, ctas, stream, pdl, device);
}

// The prefill kernel (paged where p.indices is set, else ragged; one fp8 kernel for both q types
// where `fp8_cache`, with p.bf16_io and p.e5m2 set: one head dim only; RoPE's kernels where `rope`,
// 16-bit caches of one head dim only) on a grid of num_kv_heads x `ctas` blocks, then, unless `merge_from` is -1, the merge of split requests' partials over query
// tokens merge_from .. q_tokens - 1. T: q's and out's type; D: q's and k's head dim, DV: v's and
// out's.
template <typename T, int D, int DV = D>
cudaError_t BatchPrefill(const PrefillParams& p, bool fp8_cache, bool rope, int ctas, int merge_from, int q_tokens,
                         cudaStream_t stream, bool pdl, int device) {
  if (p.batch == 0 || ctas == 0 || p.num_kv_heads == 0) return cudaSuccess;
  cudaError_t status = cudaErrorInvalidValue;
  if (rope) {
    if constexpr (D == DV) {
      if (!fp8_cache) status = LaunchPrefill16<T, D, DV, true>(p, ctas, stream, pdl, device);
    }
  } else if (!fp8_cache) {
    status = LaunchPrefill16<T, D, DV, false>(p, ctas, stream, pdl, device);
  } else if constexpr (D == DV) {
    status = p.e5m2 ? LaunchPrefill<half, __nv_fp8_e5m2, D, D, true>(p, ctas, stream, pdl, device)
                    : LaunchPrefill<half, __nv_fp8_e4m3, D, D, true>(p, ctas, stream, pdl, device);
  }
  if (status != cudaSuccess || merge_from < 0) return status;
  return MergePartials<T, DV>(p, q_tokens - merge_from, PrefillPartials{p.requests, p.batch}, stream, pdl, merge_from);
}

}  // namespace aotinfer
