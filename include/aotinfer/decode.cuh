// Paged decode attention: one query token of each request against its paged KV cache, at the speed
// of reading the cache.
//
// A block of 4 warps takes one work item -- a request and a range of its token positions -- for one
// KV head and up to 16 of the query heads that share it (GQA): every K and V byte is read once for
// all of them. Those query heads are the 16 rows of tensor-core tiles (mma.sync m16n8k16; rows past
// the group are zero), so scores and the weighted sum of V run on tensor cores whatever the group
// size. Tiles of K and V (64 tokens; 128 for fp8 up to head_dim 128, the same bytes) stream
// through a cp.async pipeline of kStages tiles in shared memory, gathered page by page; each warp
// takes a quarter of a tile's tokens and keeps its own running max, sum and output, and the four
// states are merged at the end. The copies cache K and V in L2 under the plan's policy (evict-first
// where a step reads a few L2s of cache: python/aotinfer/decode.py, _READ_ONCE_L2S).
//
// An fp8 cache stays fp8 in shared memory (twice the tokens a tile for the same bytes) and is
// widened to half (exactly) in registers, between ldmatrix and the tensor cores; the tensor cores
// then run in half, and a bfloat16 q is converted once a block (clamped to half's range, +-65504).
// ldmatrix reads 16-bit elements, so on fp8 bytes it hands each thread four neighbouring bytes:
//   - K (non-transposed): one token's dims 4c..4c+3 of a 16-dim chunk (c = lane % 4), where the
//     B fragment wants k = 2c, 2c+1, 2c+8, 2c+9. A dot product may sum its dims in any order, so
//     the dims are taken in that order for K and for q alike: q's fragments are loaded to match.
//   - V (transposed): tokens 2c and 2c + 1 of dims 2g and 2g + 1 (g = lane / 4); two matrices (tokens
//     0-7 and 8-15) give, after a byte permute, the fragments of dim 2g and of dim 2g + 1. So the
//     output tiles hold a chunk's even dims and its odd dims, put back in order on the way out.
//
// Softmax runs in base 2: logits are scaled by sm_scale * log2(e) (or soft-capped, cap * tanh(x /
// cap), then scaled by log2(e)), and the LSE written is log2 of the sum of exp2 of them. A sequence
// split over several work items (the caller's plan decides) writes one partial output and LSE per
// item. Where a request has at most kFusedMergeParts of them, the last of its items to finish (a
// counter a request and block row, zero between launches) merges them in the same launch, in slot
// order; MergePartialsKernel (attention.cuh), launched after, merges requests of more (one block
// would fold them slower than a grid does). Sinks (per query head, in the logits' natural-log
// domain) add exp(sink) to the denominator only, once, where a request's output is finished.
// RoPE inside the kernel (ROPE_LLAMA, an instantiation of its own, 16-bit caches) turns Q and each
// K tile where they land in shared memory (RopeRowsInPlace, attention.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "aotinfer/async_copy.cuh"
#include "aotinfer/attention.cuh"
#include "aotinfer/launch.cuh"
#include "aotinfer/mma.cuh"
#include "aotinfer/reduce.cuh"
#include "aotinfer/vec.cuh"

namespace aotinfer {

// One decode step: the rows are the batch's requests, one query token each; KV is paged.
struct DecodeParams : AttentionParams {
  const int4* work;              // [items]: (request, kv_begin, kv_end, slot); request -1: idle, slot -1: final
  const int4* requests;          // [batch]: (page_begin, kv_len, first_partial, num_partials)
  int* counters;                 // [batch][num_kv_heads * head_blocks]: a split request's items done; zero between launches
  int head_blocks;               // ceil(group / 16): blocks per KV head
  float v_scale;
  int kv_read_once;              // 1: the K and V copies cached evict-first in L2; 0: plain copies
};

constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * 32;
constexpr int kDecodeRows = 16;                       // query heads a block: the rows of a tile
constexpr int kFusedMergeParts = 4;                   // split requests of at most this many items merge in the launch

// Shapes of one instantiation: T the query's (and output's) type, KV the cache's, D the head dim,
// kStages tiles in flight (DecodeStages: fewer where a GPU has less shared memory).
template <typename T, typename KV, int D, int kStagesIn>
struct DecodeShape {
  static_assert(D == 64 || D == 128 || D == 256, "head_dim 64, 128 or 256");
  static constexpr bool kFp8 = !std::is_same_v<T, KV>;
  // The tensor cores' input type: an fp8 cache widens to half, which holds every fp8 value exactly
  // and takes one conversion instruction a pair (two fp8 to bfloat16 take four); q is converted
  // to half once a block.
  using MmaT = std::conditional_t<kFp8, half, T>;
  using CacheT = KV;
  static constexpr int kHeadDim = D;
  static constexpr int kStages = kStagesIn;
  // Tokens a warp takes of each tile, in 16-token steps: two for fp8 (up to head_dim 128), whose
  // tiles are then as many bytes as 16-bit ones, with twice the independent work between barriers.
  static constexpr int kSteps = kFp8 && D <= 128 ? 2 : 1;
  static constexpr int kTileTokens = kDecodeWarps * 16 * kSteps;
  static constexpr int kOffsetTiles = kStages < 2 ? 2 : kStages;  // tiles whose token offsets are published
  static constexpr int kRowChunks = D / 8;  // 16-byte chunks of a 16-bit row (q's)
  static constexpr int kCachedRowChunks = D * int(sizeof(KV)) / 16;
  static constexpr int kElemsPerChunk = 16 / int(sizeof(KV));
  static constexpr int kCachedTileBytes = kTileTokens * D * int(sizeof(KV));  // K or V, as stored
  static constexpr int kQBytes = kDecodeRows * D * 2;
  static constexpr int kChunksPerThread = kTileTokens * kCachedRowChunks / kDecodeThreads;
  static constexpr int kTokenStep = kDecodeThreads / kCachedRowChunks;  // between a thread's tokens
  // Q, then the stages (K then V each).
  static constexpr size_t kStageBytes = size_t(kStages) * 2 * kCachedTileBytes;
  static constexpr size_t kSharedBytes = kQBytes + kStageBytes;
  static_assert(kChunksPerThread * kDecodeThreads == kTileTokens * kCachedRowChunks && kTileTokens <= kDecodeThreads);
  // The merge of the warps' outputs reuses the stages: [warps][16 rows][D] floats.
  static_assert(kStageBytes >= size_t(kDecodeWarps) * kDecodeRows * D * 4);
};

// Stages where shared memory allows (sm80, sm90, sm100: about 227 KB a block; two blocks an SM
// at head_dim 128), and the most that fit a 99 KB limit (sm86, sm89, sm120) where that is fewer.
template <typename KV, int D>
constexpr int kDecodeStages = sizeof(KV) == 1 ? (D <= 64 ? 4 : 3) : (D <= 64 ? 4 : D <= 128 ? 3 : 2);
// fp8 at head_dim 128 also has a form of 2 stages, three blocks an SM (registers allow three):
// 12 warps an SM hide more of each tile's latency. Where its waves come out ragged (more than one
// wave, fewer than four) the two-block form is faster.
template <typename KV, int D>
constexpr int kDecodeStagesWide = sizeof(KV) == 1 && D == 128 ? 2 : kDecodeStages<KV, D>;
template <typename KV, int D>
constexpr int kDecodeStagesSmall = sizeof(KV) == 1 ? (D <= 64 ? 4 : 2) : (D <= 64 ? 4 : D <= 128 ? 2 : 1);

// out = sum_i 2^lse_i partial_i / (sum_i 2^lse_i + e^sink) for the `rows` query heads from
// qo_head0 of a request whose `count` partials start at slot `first`: a thread a 4-float column of
// a head, folding the partials in slot order (the same result whichever item finished last), read
// through L2 (other blocks wrote them in this launch).
template <typename T, int D>
__device__ __forceinline__ void MergeFewPartials(const DecodeParams& p, int request, int qo_head0, int rows, int first,
                                                 int count) {
  constexpr int kColumns = D / 4;
  const int64_t heads = p.num_qo_heads;
  for (int unit = threadIdx.x; unit < rows * kColumns; unit += kDecodeThreads) {
    const int head = qo_head0 + unit / kColumns, d = unit % kColumns * 4;
    const float* lse = p.partial_lse + int64_t(first) * heads + head;           // partial i at lse[i * heads]
    const float* x = p.partial_out + (int64_t(first) * heads + head) * D + d;  // partial i at x[i * heads * D]
    float l[kFusedMergeParts];
    float4 y[kFusedMergeParts];
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < kFusedMergeParts; ++i) {
      l[i] = i < count ? __ldcg(lse + i * heads) : -INFINITY;
      y[i] = i < count ? __ldcg(reinterpret_cast<const float4*>(x + i * heads * D)) : make_float4(0.f, 0.f, 0.f, 0.f);
      m = fmaxf(m, l[i]);
    }
    const float sink = p.sinks != nullptr ? p.sinks[head] * kLog2e : -INFINITY;
    const float base = SafeBase(fmaxf(m, sink));
    float total = Exp2(sink - base);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int i = 0; i < kFusedMergeParts; ++i) {
      const float w = Exp2(l[i] - base);
      total += w;
      acc = make_float4(acc.x + w * y[i].x, acc.y + w * y[i].y, acc.z + w * y[i].z, acc.w + w * y[i].w);
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    *reinterpret_cast<uint2*>(static_cast<T*>(p.out) + request * p.out_stride_n + head * p.out_stride_h + d) =
        make_uint2(PackPair<T>(acc.x * inv, acc.y * inv), PackPair<T>(acc.z * inv, acc.w * inv));
    if (p.lse != nullptr && d == 0) p.lse[int64_t(request) * heads + head] = total > 0.f ? base + __log2f(total) : -INFINITY;
  }
}

// ---- the kernel's phases ---------------------------------------------------------------------------
//
// DecodeKernel reads as a sequence of phases: the block's work (TakeDecodeWork); the prologue, which
// looks up the first tiles' pages, loads Q and starts the KV pipeline (DecodePrologue); the
// mainloop over the KV tiles (DecodeMainloop: per tile DecodeScores, DecodeOnlineSoftmax,
// DecodeAccumulatePV); the epilogue, which merges the four warps' states and writes the output or
// the item's partial (DecodeEpilogue); and, for a request split over few items, the split-KV
// merge by the last of them to finish (LastItemToFinish, MergeFewPartials). Why each is as it is:
// docs/design/decode.md#mainloop, #epilogue and #split-kv-and-merge.

// One thread's share of a block's work: work item blockIdx.x (a request and a range of its token
// positions) for KV head kv_head and query heads qo_head0 .. qo_head0 + rows - 1.
struct DecodeWork {
  int tid, warp, lane;
  int kv_head, qo_head0, rows;
  int request;
  int4 info;      // the request's (page_begin, kv_len, first_partial, num_partials)
  int slot;       // the item's partial slot; -1: final (the request's output is written here)
  int begin, end;  // the token positions [begin, end) it reads, the window applied
  int num_tiles;
};

// The work and page tables come from plan, not from the kernels before this one: with PDL they
// are read (and the first tiles' pages looked up) while those kernels finish; q and the cache
// only after WaitForPriorGrids. False for an idle item of a fixed (graph-captured) grid.
template <typename S>
__device__ __forceinline__ bool TakeDecodeWork(const DecodeParams& p, DecodeWork& w) {
  w.tid = threadIdx.x, w.warp = w.tid / 32, w.lane = w.tid % 32;
  w.kv_head = blockIdx.y / p.head_blocks;
  const int row0 = (blockIdx.y % p.head_blocks) * kDecodeRows;  // first query head of the group here
  w.rows = min(kDecodeRows, p.group - row0);
  w.qo_head0 = w.kv_head * p.group + row0;
  const int4 item = p.work[blockIdx.x];
  if (item.x < 0) return false;
  w.request = item.x;
  w.info = p.requests[w.request];
  w.slot = item.w;
  const int kv_len = w.info.y;
  w.begin = item.y;
  w.end = min(item.z, kv_len);
  if (p.window_left >= 0) w.begin = max(w.begin, kv_len - 1 - p.window_left);
  w.num_tiles = w.end > w.begin ? (w.end - w.begin + S::kTileTokens - 1) / S::kTileTokens : 0;
  return true;
}

// The KV side of the pipeline. Where each token of a tile lives: the first kTileTokens threads
// look up one token's page each, a tile ahead of publishing its K and V offsets (in elements; -1
// past the end) to a ring of kOffsetTiles tables in shared memory; every copy then reads them
// there. One lookup a token, not one a 16-byte chunk. Each thread copies chunk column `column` of
// tokens first_token + i * kTokenStep of every tile, of K and of V.
template <typename S, typename KV>
struct DecodeKvLoader {
  const DecodeParams& p;
  const DecodeWork& w;
  longlong2 (*const token_offsets)[S::kTileTokens];  // [kOffsetTiles][kTileTokens]: (K, V) of each token
  const int32_t* const pages;
  const bool looks_up;
  const int column, first_token;
  const KV* const k;
  const KV* const v;
  const uint32_t stages_at;
  // Evict-first where the plan says the step reads its cache once; else the plain copy, with no
  // policy, which ran as fast as an evict-normal policy or faster (docs/design/decode.md#mainloop).
  const uint64_t evict_first;

  __device__ __forceinline__ DecodeKvLoader(const DecodeParams& p, const DecodeWork& w,
                                            longlong2 (*token_offsets)[S::kTileTokens], uint8_t* stages)
      : p(p),
        w(w),
        token_offsets(token_offsets),
        pages(p.indices + w.info.x),
        looks_up(w.tid < S::kTileTokens),
        column(w.tid % S::kCachedRowChunks),
        first_token(w.tid / S::kCachedRowChunks),
        k(static_cast<const KV*>(p.k) + w.kv_head * p.k_stride_head + column * S::kElemsPerChunk),
        v(static_cast<const KV*>(p.v) + w.kv_head * p.v_stride_head + column * S::kElemsPerChunk),
        stages_at(SharedAddressInRegister(stages)),
        evict_first(L2EvictFirstPolicy()) {}

  // The page of this thread's token of `tile` (-1 past the end), and its slot in the page.
  __device__ __forceinline__ void look_up(int tile, int& page, int& slot) const {
    const int pos = w.begin + tile * S::kTileTokens + w.tid;
    page = -1;
    slot = 0;
    if (looks_up && tile < w.num_tiles && pos < w.end) {
      const int index = int(p.page_size.Divide(uint32_t(pos)));
      slot = pos - index * int(p.page_size.divisor);
      page = __ldg(pages + index);
    }
  }
  // A looked-up page as offsets, into tile's table; past the end, or a page id outside the cache
  // (the caller's error, which FlashInfer leaves undefined), as (-1, -1): rows of zeros, never
  // memory beyond the cache. One unsigned compare tests both, where a clamp of the id on its way
  // to the copies' addresses made short decodes slower (docs/design/decode.md#page-ids).
  __device__ __forceinline__ void publish(int tile, int page, int slot) const {
    if (!looks_up) return;
    const bool in_cache = uint32_t(page) <= p.last_page;
    const int64_t pg = in_cache ? page : 0;
    token_offsets[tile % S::kOffsetTiles][w.tid] =
        in_cache ? make_longlong2(pg * p.k_stride_page + slot * p.k_stride_slot, pg * p.v_stride_page + slot * p.v_stride_slot)
                  : make_longlong2(-1, -1);
  }
  // Tile `tile`'s K and V into its stage: its table published and a barrier passed since.
  __device__ __forceinline__ void copy(int tile) const {
    const uint32_t k_dst = stages_at + (tile % S::kStages) * 2 * S::kCachedTileBytes;
    const uint32_t v_dst = k_dst + S::kCachedTileBytes;
    const longlong2* offsets = token_offsets[tile % S::kOffsetTiles];
#pragma unroll
    for (int i = 0; i < S::kChunksPerThread; ++i) {
      const int token = first_token + i * S::kTokenStep;
      const longlong2 offset = offsets[token];
      const bool valid = offset.x >= 0;
      const uint32_t at = SwizzledOffset<S::kCachedRowChunks>(token, column);
      if (p.kv_read_once != 0) {
        CopyAsync16OrZero(k_dst + at, k + (valid ? offset.x : 0), valid, evict_first);
        CopyAsync16OrZero(v_dst + at, v + (valid ? offset.y : 0), valid, evict_first);
      } else {
        CopyAsync16OrZero(k_dst + at, k + (valid ? offset.x : 0), valid);
        CopyAsync16OrZero(v_dst + at, v + (valid ? offset.y : 0), valid);
      }
    }
  }
};

// The prologue: the tables of the first kStages tiles (their lookups all in flight at once) and
// the next tile's pages, before WaitForPriorGrids; then Q, 16 rows (query heads; zero past the
// group) of D in a commit group of its own (older than every tile's, so waiting for a tile waits
// for it too); the tables published; the copies of the first kStages tiles but the last (the
// mainloop's first), a commit group each.
template <typename S, typename T, typename KV>
__device__ __forceinline__ void DecodePrologue(const DecodeParams& p, const DecodeWork& w,
                                               const DecodeKvLoader<S, KV>& kv, uint8_t* q_tile, int& next_page,
                                               int& next_slot) {
  int page[S::kStages], slot[S::kStages];
#pragma unroll
  for (int t = 0; t < S::kStages; ++t) kv.look_up(t, page[t], slot[t]);
  kv.look_up(S::kStages, next_page, next_slot);
  WaitForPriorGrids();

  const T* q = static_cast<const T*>(p.q) + w.request * p.q_stride_n;
  for (int c = w.tid; c < kDecodeRows * S::kRowChunks; c += kDecodeThreads) {
    const int r = c / S::kRowChunks, chunk = c % S::kRowChunks;
    const bool valid = r < w.rows;
    CopyAsync16OrZero(q_tile + SwizzledOffset<S::kRowChunks>(r, chunk),
                      valid ? q + (w.qo_head0 + r) * p.q_stride_h + chunk * 8 : q, valid);
  }
  CommitAsyncGroup();

#pragma unroll
  for (int t = 0; t < S::kStages; ++t) kv.publish(t, page[t], slot[t]);
  __syncthreads();
#pragma unroll
  for (int s = 0; s + 1 < S::kStages; ++s) {
    if (s < w.num_tiles) kv.copy(s);
    CommitAsyncGroup();
  }
}

// q's A fragment of dims 16 kk .. 16 kk + 15, from the Q tile (as the tensor cores take it: half
// where the cache is fp8) at q_tile, q_base its shared-window address.
template <typename S>
__device__ __forceinline__ void LoadQFragment(uint32_t (&a)[4], const uint8_t* q_tile, uint32_t q_base, int kk,
                                              int lane) {
  if constexpr (S::kFp8) {  // in fp8 K's order: this thread's k = 2c, 2c+1, 2c+8, 2c+9 are dims 4c..4c+3
    const int c = lane % 4;
    const uint32_t within = SwizzledOffset<S::kRowChunks>(lane / 4, 2 * kk + c / 2) + 8 * (c % 2);
    const uint2 top = *reinterpret_cast<const uint2*>(q_tile + within);
    const uint2 bottom = *reinterpret_cast<const uint2*>(q_tile + within + 8 * S::kHeadDim * 2);  // row + 8: swizzle (row & 7) alike
    a[0] = top.x, a[1] = bottom.x, a[2] = top.y, a[3] = bottom.y;
  } else {
    LoadMatrixX4(a, q_base + SwizzledOffset<S::kRowChunks>((lane / 8) % 2 * 8 + lane % 8, 2 * kk + lane / 16));
  }
}

// Scores of the warp's tokens of the tile at k_base: s = q K^T, 16x8 tiles (two a 16-token step),
// over D / 16 steps. `q_frag`: Q's fragments where they stay in registers (kQInRegisters), else
// loaded from the Q tile step by step.
template <typename S, bool kQInRegisters, int kQFrags>
__device__ __forceinline__ void DecodeScores(float (&s)[2 * S::kSteps][4], const uint32_t (&q_frag)[kQFrags][4],
                                             const uint8_t* q_tile, uint32_t q_base, uint32_t k_base, int warp_token,
                                             int lane) {
  using MmaT = typename S::MmaT;
  using KV = typename S::CacheT;
  constexpr int D = S::kHeadDim;
  auto q_step = [&](uint32_t (&a_loaded)[4], int kk) -> const uint32_t(&)[4] {
    if constexpr (!kQInRegisters) {
      LoadQFragment<S>(a_loaded, q_tile, q_base, kk, lane);
      return a_loaded;
    } else {
      return q_frag[kk];
    }
  };
  if constexpr (S::kFp8) {
    // Matrices: a step's tokens 0-7 and 8-15 of chunk kk, then of chunk kk + 1 (a chunk is 16 dims).
#pragma unroll
    for (int kk = 0; kk < D / 16; kk += 2) {
      uint32_t b[S::kSteps][4];
#pragma unroll
      for (int st = 0; st < S::kSteps; ++st) {
        LoadMatrixX4(b[st], k_base + SwizzledOffset<S::kCachedRowChunks>(warp_token + st * 16 + (lane / 8) % 2 * 8 + lane % 8, kk + lane / 16));
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t a_loaded[4];
        const uint32_t(&a)[4] = q_step(a_loaded, kk + h);
#pragma unroll
        for (int st = 0; st < S::kSteps; ++st) {
          const uint32_t lo = b[st][2 * h], hi = b[st][2 * h + 1];
          Mma16816<MmaT>(s[2 * st], a, WidenPairToHalf<KV>(uint16_t(lo)), WidenPairToHalf<KV>(uint16_t(lo >> 16)));
          Mma16816<MmaT>(s[2 * st + 1], a, WidenPairToHalf<KV>(uint16_t(hi)), WidenPairToHalf<KV>(uint16_t(hi >> 16)));
        }
      }
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t a_loaded[4], b[4];
      const uint32_t(&a)[4] = q_step(a_loaded, kk);
      LoadMatrixX4(b, k_base + SwizzledOffset<S::kRowChunks>(warp_token + lane / 16 * 8 + lane % 8, 2 * kk + (lane / 8) % 2));
      Mma16816<MmaT>(s[0], a, b[0], b[1]);
      Mma16816<MmaT>(s[1], a, b[2], b[3]);
    }
  }
}

// Scale (or cap) the scores, mask positions past the end (the warp's tokens start at warp_pos),
// and fold them into each row's running softmax: s becomes the tile's probabilities (relative to
// the running max), the output rescaled where some row's max moved.
template <typename S>
__device__ __forceinline__ void DecodeOnlineSoftmax(float (&s)[2 * S::kSteps][4], float (&o)[S::kHeadDim / 8][4],
                                                    float (&row_max)[2], float (&row_sum)[2],
                                                    const DecodeParams& p, float cap_scale, float cap_log2,
                                                    int warp_pos, int end, int lane) {
  constexpr int D = S::kHeadDim;
  constexpr int kNt = 2 * S::kSteps;
  float tile_max[2] = {-INFINITY, -INFINITY};
  if (p.soft_cap > 0.f) {  // one branch a tile, not one a score
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = cap_log2 * tanhf(s[nt][e] * cap_scale);
  } else {
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] *= p.scale_log2;
  }
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int pos = warp_pos + nt * 8 + (lane % 4) * 2 + (e & 1);
      s[nt][e] = pos < end ? s[nt][e] : -INFINITY;
      tile_max[e / 2] = fmaxf(tile_max[e / 2], s[nt][e]);
    }
  }
  float alpha[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) alpha[r] = MoveRowMax(tile_max[r], row_max[r], row_sum[r]);
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[nt][e] = Exp2(s[nt][e] - SafeBase(row_max[e / 2]));
      row_sum[e / 2] += s[nt][e];
    }
  }
  // Rescale the output only when some row's max moved (rarely, after the first tiles).
  if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }
  }
}

// o += P V: P (16 rows x 16 tokens a step) straight from the score registers, V (the tile at
// v_base) through ldmatrix.trans.
template <typename S>
__device__ __forceinline__ void DecodeAccumulatePV(float (&o)[S::kHeadDim / 8][4], const float (&s)[2 * S::kSteps][4],
                                                   uint32_t v_base, int warp_token, int lane) {
  constexpr int D = S::kHeadDim;
  using MmaT = typename S::MmaT;
  using KV = typename S::CacheT;
  uint32_t pa[S::kSteps][4];
#pragma unroll
  for (int st = 0; st < S::kSteps; ++st) {
    pa[st][0] = PackPair<MmaT>(s[2 * st][0], s[2 * st][1]);
    pa[st][1] = PackPair<MmaT>(s[2 * st][2], s[2 * st][3]);
    pa[st][2] = PackPair<MmaT>(s[2 * st + 1][0], s[2 * st + 1][1]);
    pa[st][3] = PackPair<MmaT>(s[2 * st + 1][2], s[2 * st + 1][3]);
  }
  if constexpr (S::kFp8) {
    // Matrices as K's; o[2 j] takes chunk j's even dims, o[2 j + 1] its odd ones.
#pragma unroll
    for (int j = 0; j < D / 16; j += 2) {
#pragma unroll
      for (int st = 0; st < S::kSteps; ++st) {
        uint32_t b[4];
        LoadMatrixX4Trans(b, v_base + SwizzledOffset<S::kCachedRowChunks>(warp_token + st * 16 + (lane / 8) % 2 * 8 + lane % 8, j + lane / 16));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t even = __byte_perm(b[2 * h], b[2 * h + 1], 0x6420);  // tokens 2c, 2c+1, 2c+8, 2c+9
          const uint32_t odd = __byte_perm(b[2 * h], b[2 * h + 1], 0x7531);
          Mma16816<MmaT>(o[2 * (j + h)], pa[st], WidenPairToHalf<KV>(uint16_t(even)), WidenPairToHalf<KV>(uint16_t(even >> 16)));
          Mma16816<MmaT>(o[2 * (j + h) + 1], pa[st], WidenPairToHalf<KV>(uint16_t(odd)), WidenPairToHalf<KV>(uint16_t(odd >> 16)));
        }
      }
    }
  } else {
#pragma unroll
    for (int np = 0; np < D / 16; ++np) {
      uint32_t b[4];
      LoadMatrixX4Trans(b, v_base + SwizzledOffset<S::kRowChunks>(warp_token + (lane / 8) % 2 * 8 + lane % 8, 2 * np + lane / 16));
      Mma16816<MmaT>(o[2 * np], pa[0], b[0], b[1]);
      Mma16816<MmaT>(o[2 * np + 1], pa[0], b[2], b[3]);
    }
  }
}

// The mainloop over the work's KV tiles: each step keeps the pipeline kStages - 1 tiles ahead (the
// copy of tile c + kStages - 1, the table of the tile after it published, the pages of the one
// after that looked up), then the warp's quarter of the tile: scores, online softmax, P V.
// First, Q to half where the cache is fp8 and Q's fragments into registers where they fit beside
// the output (once Q has landed, with tile 0: not with a single stage, where Q's group is
// committed in the loop). RoPE (kRope, 16-bit caches): each lane pair turns the Q and K rows it
// copied once they land, before the barrier that publishes them (RopeRowsInPlace): Q at the
// request's last position, kv_len - 1, each key at its own.
template <typename S, typename T, typename KV, bool kRope>
__device__ __forceinline__ void DecodeMainloop(const DecodeParams& p, const DecodeWork& w,
                                               const DecodeKvLoader<S, KV>& kv, uint8_t* q_tile, uint8_t* stages,
                                               int& next_page, int& next_slot, float (&o)[S::kHeadDim / 8][4],
                                               float (&row_max)[2], float (&row_sum)[2]) {
  constexpr int D = S::kHeadDim;
  const float cap_scale = p.soft_cap > 0.f ? p.scale_log2 / (kLog2e * p.soft_cap) : 0.f;  // sm_scale / cap
  const float cap_log2 = p.soft_cap * kLog2e;
  const uint32_t q_base = SharedAddress(q_tile);
  using MmaT = typename S::MmaT;
  if constexpr (!std::is_same_v<MmaT, T>) {  // q to half, in place, once it has landed
    WaitAsyncGroups<S::kStages - 1>();
    __syncthreads();
    for (int c = w.tid; c < kDecodeRows * S::kRowChunks; c += kDecodeThreads) {
      uint4* chunk = reinterpret_cast<uint4*>(q_tile + SwizzledOffset<S::kRowChunks>(c / S::kRowChunks, c % S::kRowChunks));
      *chunk = BfloatToHalf8(*chunk);
    }
  }
  static_assert(!kRope || std::is_same_v<T, KV>, "RoPE with 16-bit caches");
  auto rope_q = [&] {  // the Q rows this lane pair copied (DecodePrologue)
#pragma unroll
    for (int c = w.tid; c < kDecodeRows * S::kRowChunks; c += kDecodeThreads) {
      RopeRowsInPlace<T, D, 1>(
          p, c % S::kRowChunks,
          [&](int, int column) { return q_tile + SwizzledOffset<S::kRowChunks>(c / S::kRowChunks, column); },
          w.info.y - 1, 0);
    }
  };
  auto rope_k = [&](int tile) {  // the tile's K rows this lane pair copied (DecodeKvLoader::copy)
    uint8_t* const k_tile = stages + size_t(tile % S::kStages) * 2 * S::kCachedTileBytes;
    const int pos0 = w.begin + tile * S::kTileTokens + kv.first_token;
    RopeRowsInPlace<T, D, S::kChunksPerThread>(
        p, kv.column,
        [&](int i, int column) { return k_tile + SwizzledOffset<S::kCachedRowChunks>(kv.first_token + i * S::kTokenStep, column); },
        pos0, S::kTokenStep);
  };
  constexpr bool kQInRegisters = D <= 128 && S::kStages >= 2;
  auto rope_tile = [&](int tile) {
    if constexpr (kRope) {
      if (!kQInRegisters && tile == 0) rope_q();
      rope_k(tile);
    }
  };
  uint32_t q_frag[kQInRegisters ? D / 16 : 1][4];
  if constexpr (kQInRegisters) {
    WaitAsyncGroups<S::kStages - 1>();
    if constexpr (kRope) rope_q();
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) LoadQFragment<S>(q_frag[kk], q_tile, q_base, kk, w.lane);
  } else if constexpr (!std::is_same_v<MmaT, T>) {
    __syncthreads();  // the converted q, for every warp
  }
  for (int tile = 0; tile < w.num_tiles; ++tile) {
    // Copy tile c, publish tile c + 1's table (its ring slot was last read before this barrier)
    // and prefetch tile c + 2's pages.
    if constexpr (S::kStages == 1) {  // no tile ahead: copy, wait, compute
      __syncthreads();  // every warp is done with the previous tile
      kv.copy(tile);
      CommitAsyncGroup();
      kv.publish(tile + 1, next_page, next_slot);
      kv.look_up(tile + 2, next_page, next_slot);
      WaitAsyncGroups<0>();
      rope_tile(tile);
      __syncthreads();
    } else {
      WaitAsyncGroups<S::kStages - 2>();
      rope_tile(tile);
      __syncthreads();  // the tile is in for every thread; every warp is done with the stage refilled next
      const int c = tile + S::kStages - 1;
      if (c < w.num_tiles) kv.copy(c);
      CommitAsyncGroup();
      kv.publish(c + 1, next_page, next_slot);
      kv.look_up(c + 2, next_page, next_slot);
    }
    const uint8_t* const k_tile = stages + size_t(tile % S::kStages) * 2 * S::kCachedTileBytes;
    const uint32_t k_base = SharedAddress(k_tile), v_base = k_base + S::kCachedTileBytes;
    const int warp_token = w.warp * 16 * S::kSteps;  // the warp's first token of the tile
    float s[2 * S::kSteps][4] = {};
    DecodeScores<S, kQInRegisters>(s, q_frag, q_tile, q_base, k_base, warp_token, w.lane);
    DecodeOnlineSoftmax<S>(s, o, row_max, row_sum, p, cap_scale, cap_log2, w.begin + tile * S::kTileTokens + warp_token,
                           w.end, w.lane);
    DecodeAccumulatePV<S>(o, s, v_base, warp_token, w.lane);
  }
}

// The epilogue: the four warps' states merged (outputs through the now free stages, max and sum
// beside them), then 8 threads a row, D / 8 dims each, write the request's output and LSE where
// the item is final, else the item's partial output and LSE.
template <typename S, typename T>
__device__ __forceinline__ void DecodeEpilogue(const DecodeParams& p, const DecodeWork& w, float (&o)[S::kHeadDim / 8][4],
                                               float (&row_max)[2], float (&row_sum)[2],
                                               uint8_t* stages, float (&warp_max)[kDecodeWarps][kDecodeRows],
                                               float (&warp_sum)[kDecodeWarps][kDecodeRows]) {
  constexpr int D = S::kHeadDim;
  const int tid = w.tid, warp = w.warp, lane = w.lane;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
  }
  WaitAsyncGroups<0>();  // copies of tiles past the end (empty groups) are done too
  __syncthreads();
  float* o_shared = reinterpret_cast<float*>(stages);  // [warp][row][D]
  const int g = lane / 4;
  float* const top = o_shared + (warp * kDecodeRows + g) * D;
  float* const bottom = top + 8 * D;
  if constexpr (S::kFp8) {  // chunk j's even and odd dims interleaved again: this thread's are 16 j + 4c .. + 3
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      const int col = j * 16 + (lane % 4) * 4;
      *reinterpret_cast<float4*>(top + col) = make_float4(o[2 * j][0], o[2 * j + 1][0], o[2 * j][1], o[2 * j + 1][1]);
      *reinterpret_cast<float4*>(bottom + col) = make_float4(o[2 * j][2], o[2 * j + 1][2], o[2 * j][3], o[2 * j + 1][3]);
    }
  } else {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int col = n * 8 + (lane % 4) * 2;
      *reinterpret_cast<float2*>(top + col) = make_float2(o[n][0], o[n][1]);
      *reinterpret_cast<float2*>(bottom + col) = make_float2(o[n][2], o[n][3]);
    }
  }
  if (lane % 4 == 0) {
    warp_max[warp][g] = row_max[0];
    warp_max[warp][g + 8] = row_max[1];
    warp_sum[warp][g] = row_sum[0];
    warp_sum[warp][g + 8] = row_sum[1];
  }
  __syncthreads();

  constexpr int kDims = D / 8;
  const int row = tid / 8, d0 = (tid % 8) * kDims;
  const bool final = w.slot < 0;
  if (row < w.rows) {
    const int head = w.qo_head0 + row;
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < kDecodeWarps; ++i) m = fmaxf(m, warp_max[i][row]);
    const float sink = final && p.sinks != nullptr ? p.sinks[head] * kLog2e : -INFINITY;
    m = fmaxf(m, sink);
    const float base = SafeBase(m);
    float weight[kDecodeWarps], total = Exp2(sink - base);
#pragma unroll
    for (int i = 0; i < kDecodeWarps; ++i) {
      weight[i] = Exp2(warp_max[i][row] - base);
      total += weight[i] * warp_sum[i][row];
    }
    const float inv = total > 0.f ? p.v_scale / total : 0.f;
    const float lse = total > 0.f ? base + __log2f(total) : -INFINITY;
    float acc[kDims];
#pragma unroll
    for (int d = 0; d < kDims; d += 4) {
      float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int i = 0; i < kDecodeWarps; ++i) {
        const float4 x = *reinterpret_cast<const float4*>(o_shared + (i * kDecodeRows + row) * D + d0 + d);
        sum.x += weight[i] * x.x;
        sum.y += weight[i] * x.y;
        sum.z += weight[i] * x.z;
        sum.w += weight[i] * x.w;
      }
      acc[d] = sum.x * inv;
      acc[d + 1] = sum.y * inv;
      acc[d + 2] = sum.z * inv;
      acc[d + 3] = sum.w * inv;
    }
    if (final) {
      T* out = static_cast<T*>(p.out) + w.request * p.out_stride_n + head * p.out_stride_h + d0;
#pragma unroll
      for (int d = 0; d < kDims; d += 8) {
        Vec<T, 8> y;
#pragma unroll
        for (int e = 0; e < 8; ++e) y[e] = from_float<T>(acc[d + e]);
        y.store(out + d);
      }
      if (p.lse != nullptr && tid % 8 == 0) p.lse[int64_t(w.request) * p.num_qo_heads + head] = lse;
    } else {
      float* out = p.partial_out + (int64_t(w.slot) * p.num_qo_heads + head) * D + d0;
#pragma unroll
      for (int d = 0; d < kDims; d += 4) *reinterpret_cast<float4*>(out + d) = make_float4(acc[d], acc[d + 1], acc[d + 2], acc[d + 3]);
      if (tid % 8 == 0) p.partial_lse[int64_t(w.slot) * p.num_qo_heads + head] = lse;
    }
  }
}

// The split-KV merge's turn: whether this block is the last of its request's items to finish (for
// its block row), which then merges them. The barrier and thread 0's fence order this block's
// partials before its count; the merging block's fence orders its reads after every count.
// `merges`: a flag in shared memory.
__device__ __forceinline__ bool LastItemToFinish(const DecodeParams& p, const DecodeWork& w, bool& merges) {
  __syncthreads();
  if (w.tid == 0) {
    int* const counter = p.counters + int64_t(w.request) * gridDim.y + blockIdx.y;
    __threadfence();
    merges = atomicAdd(counter, 1) == w.info.w - 1;
    if (merges) *counter = 0;  // every item has counted: zero for the next launch
  }
  __syncthreads();
  if (!merges) return false;
  __threadfence();
  return true;
}

template <typename T, typename KV, int D, int kStages, bool kRope>
__global__ void __launch_bounds__(kDecodeThreads) DecodeKernel(const DecodeParams p) {
  using S = DecodeShape<T, KV, D, kStages>;
  extern __shared__ __align__(128) uint8_t shared[];
  uint8_t* const q_tile = shared;
  uint8_t* const stages = shared + S::kQBytes;  // [kStages][K, V]
  __shared__ float warp_max[kDecodeWarps][kDecodeRows], warp_sum[kDecodeWarps][kDecodeRows];
  __shared__ longlong2 token_offsets[S::kOffsetTiles][S::kTileTokens];  // (K, V) of each token of a tile

  DecodeWork w;
  if (!TakeDecodeWork<S>(p, w)) return;  // an idle item of a fixed (graph-captured) grid
  DecodeKvLoader<S, KV> kv(p, w, token_offsets, stages);
  int next_page = -1, next_slot = 0;  // the page of this thread's token of the tile looked up ahead
  DecodePrologue<S, T>(p, w, kv, q_tile, next_page, next_slot);
  // This thread's share of the attention state: rows g = lane / 4 and g + 8 of its warp's tiles --
  // the output (unnormalized), the running max and sum.
  float o[D / 8][4] = {};
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  DecodeMainloop<S, T, KV, kRope>(p, w, kv, q_tile, stages, next_page, next_slot, o, row_max, row_sum);
  AllowDependentGrids();
  DecodeEpilogue<S, T>(p, w, o, row_max, row_sum, stages, warp_max, warp_sum);
  if (w.slot < 0 || w.info.w > kFusedMergeParts) return;  // final, or merged by MergePartialsKernel
  __shared__ bool merges;
  if (LastItemToFinish(p, w, merges)) MergeFewPartials<T, D>(p, w.request, w.qo_head0, w.rows, w.info.z, w.info.w);
}

template <typename T, typename KV, int D, int kStages, bool kRope>
cudaError_t LaunchDecode(const DecodeParams& p, int num_items, cudaStream_t stream, bool pdl) {
  const dim3 grid(unsigned(num_items), unsigned(p.num_kv_heads * p.head_blocks));
  return LaunchWithSharedMemory(DecodeKernel<T, KV, D, kStages, kRope>, grid, dim3(kDecodeThreads),
                                DecodeShape<T, KV, D, kStages>::kSharedBytes, stream, pdl, p);
}

template <typename T, typename KV, int D, int kStages, bool kRope>
int DecodeBlocksPerSm(int device) {  // also raises the kernel's shared-memory limit past 48 KB, once per device
  return BlocksPerSm<DecodeKernel<T, KV, D, kStages, kRope>>(kDecodeThreads, DecodeShape<T, KV, D, kStages>::kSharedBytes, device);
}

// Whether this launch takes the three-blocks-an-SM form (kDecodeStagesWide): where there is one,
// and the grid is one wave of it or at least four.
template <typename T, typename KV, int D>
bool DecodeTakesWideForm(const DecodeParams& p, int num_items, int device) {
  constexpr int kWide = kDecodeStagesWide<KV, D>;
  if constexpr (kWide == kDecodeStages<KV, D>) {
    return false;
  } else {
    const int blocks = DecodeBlocksPerSm<T, KV, D, kWide, false>(device);
    const int64_t wave = int64_t(blocks) * GetDeviceFacts(device).sms;
    const int64_t ctas = int64_t(num_items) * p.num_kv_heads * p.head_blocks;
    return blocks > 2 && (ctas <= wave || ctas >= 4 * wave);
  }
}

// The decode kernel of the stages that fit (the wide form where it pays) over num_items items.
template <typename T, typename KV, int D, bool kRope>
cudaError_t LaunchDecodeForm(const DecodeParams& p, int num_items, cudaStream_t stream, bool pdl, int device) {
  constexpr int kStages = kDecodeStages<KV, D>, kSmall = kDecodeStagesSmall<KV, D>;
  if (DecodeTakesWideForm<T, KV, D>(p, num_items, device)) {
    return LaunchDecode<T, KV, D, kDecodeStagesWide<KV, D>, kRope>(p, num_items, stream, pdl);
  }
  if (DecodeBlocksPerSm<T, KV, D, kStages, kRope>(device) > 0) return LaunchDecode<T, KV, D, kStages, kRope>(p, num_items, stream, pdl);
  if constexpr (kSmall != kStages) {
    if (DecodeBlocksPerSm<T, KV, D, kSmall, kRope>(device) > 0) return LaunchDecode<T, KV, D, kSmall, kRope>(p, num_items, stream, pdl);
  }
  return cudaErrorInvalidConfiguration;
}

// The decode kernel (RoPE's where `rope`: 16-bit caches only) over num_items work items, then, if
// `merge`, the merge of split requests of more than kFusedMergeParts items.
template <typename T, typename KV, int D>
cudaError_t BatchDecode(const DecodeParams& p, int num_items, bool merge, bool rope, cudaStream_t stream, bool pdl,
                        int device) {
  if (p.batch == 0 || num_items == 0 || p.num_kv_heads == 0) return cudaSuccess;
  cudaError_t status = cudaErrorInvalidValue;
  if (!rope) {
    status = LaunchDecodeForm<T, KV, D, false>(p, num_items, stream, pdl, device);
  } else if constexpr (std::is_same_v<T, KV>) {
    status = LaunchDecodeForm<T, KV, D, true>(p, num_items, stream, pdl, device);
  }
  if (status != cudaSuccess || !merge) return status;
  return MergePartials<T, D>(p, p.batch, RowTablePartials{p.requests, kFusedMergeParts}, stream, pdl);
}

}  // namespace aotinfer
