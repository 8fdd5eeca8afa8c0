// Batch prefill attention for Hopper (sm90a): the work items, masks, softmax and outputs of
// prefill.cuh, on warpgroup MMA (wgmma) with a producer warpgroup that keeps K and V in flight.
//
// A block is one producer warpgroup and three consumer warpgroups (two at head_dim 256), one
// block an SM, taking the plan's work items (a request, kTileQ = 64 packed query rows a consumer
// group, a range of keys) for one KV head:
// - the producer copies K and V tiles of kTileKV tokens (80; 128 at head_dim 64, 96 there for a
//   paged cache) into kStages stages of the 128-byte-swizzled layout wgmma reads: a ragged batch's
//   full tiles by the TMA unit (tensor maps made by the launcher), pages through the page table
//   and an item's last, partial tile by the warpgroup's cp.async (zeros past the keys). Each
//   stage's K and V have a "full" mbarrier, counted as the copies land, and an "empty" one that
//   every consumer warp arrives on once its MMAs have read the tile; it runs up to kStages tiles
//   ahead, across items too. `setmaxnreg` gives its registers to the consumers;
// - consumer warpgroup w takes query rows 64w..64w+63 of the item: Q lands once (one TMA copy
//   where the group of query heads divides 64, else its threads' copies), then a tile is
//   S = Q K^T (wgmma, both operands in shared memory), the online softmax in base 2 on S in
//   registers (lazy rescaling, as in prefill.cuh), and O += P V (wgmma, P from registers, V
//   N-major as stored). Tile n's S is issued with tile n - 1's P V, so the softmax of tile n runs
//   while P V does; and the warpgroups take turns issuing their MMAs (named barriers, round
//   robin), so one's softmax runs while another's MMAs do. A group skips the MMAs of the tiles
//   its rows do not see (those past its rows' causal diagonal; every tile where the item ends
//   before its rows), keeping its turns.
// Outputs: the final output through shared memory (the warpgroup's Q rows), written by one TMA
// store where all 64 rows are the item's (else 16-byte stores), and its LSE; or float32 partials
// of a split request for MergePartialsKernel, as prefill.cuh writes them. docs/design/prefill_sm90.md has
// what each step measured.
#pragma once

#include <cuda.h>  // CUtensorMap: the driver's types only (its encoder is looked up at run time)
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "aotinfer/async_copy.cuh"
#include "aotinfer/attention.cuh"
#include "aotinfer/launch.cuh"
#include "aotinfer/prefill.cuh"
#include "aotinfer/wgmma.cuh"

namespace aotinfer {

// D: the head dim of q and k; DV: of v and the output (D, or 128 with DeepSeek's 192).
template <typename T, int D, bool kPaged, int DV = D>
struct Sm90PrefillShape {
  static_assert((D == DV && (D == 64 || D == 128 || D == 256)) || (D == 192 && DV == 128),
                "head dims 64, 128, 256 or 192 (q, k) with 128 (v)");
  // Consumer warpgroups, 64 query rows each: three, so that while two are in their softmax the
  // third keeps the tensor cores busy; two at head_dim 256, whose output alone takes 128 registers.
  static constexpr int kConsumers = DV == 256 ? 2 : 3;
  static constexpr int kTileQ = 64 * kConsumers;
  // Named barriers: 0 the block's, 1 + w consumer group w's own, kTurnBarriers + w its turn on the
  // tensor cores.
  static constexpr int kTurnBarriers = 1 + kConsumers;
  // Registers a thread (setmaxnreg), moved between warpgroups from the 65536 / kThreads each a
  // block is launched with: the producer needs few (a ragged batch's full tiles go by TMA, and 32
  // do; the paged copies' addresses take 56, as do K's two copy layouts at 192), the consumers
  // hold S, P and O.
  static constexpr int kProducerRegisters = kConsumers == 3 && !kPaged && D == DV ? 32 : 56;
  static constexpr int kConsumerRegisters = (65536 / 128 - kProducerRegisters) / kConsumers / 8 * 8;  // setmaxnreg's steps
  // Keys a tile, as many as S and P fit beside the output in kConsumerRegisters: at head_dim 64
  // 128 (96 in the 152 registers beside the paged producer), at 128 and 256 80 (the output takes
  // 64 and 128 registers).
  static constexpr int kTileKV = D == 64 ? (kPaged ? 96 : 128) : 80;
  // Stages of K and V: 3 for a paged cache at head_dim 128 (its producer's copies run further ahead:
  // +2-3%), 2 elsewhere (3 cost ragged K and V 7-12% at head_dim 128; 4 gained nothing at 64).
  static constexpr int kStages = D == 128 && kPaged ? 3 : 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);  // the producer warpgroup first
  static constexpr int kRowChunks = D / 8;                // 16-byte chunks of a q or k row
  static constexpr int kVRowChunks = DV / 8;              // ... of a v or output row
  static constexpr int kQBytes = kTileQ * D * 2;
  static constexpr int kKBytes = kTileKV * D * 2;
  static constexpr int kVBytes = kTileKV * DV * 2;
  static constexpr int kBarrierBytes = 4 * kStages * 8 + kConsumers * 8;  // K and V full and empty a stage; Q a group
  // 1024 bytes of slack: the tiles start at a multiple of 1024 (the swizzle's period).
  static constexpr size_t kSharedBytes = 1024 + kQBytes + kStages * (kKBytes + kVBytes) + kBarrierBytes;
  static_assert(kSharedBytes <= 227 * 1024, "an sm90 block's shared memory");
};

// The TMA unit's maps of a launch, made by the launcher, in the 128-byte swizzle. `kv`: a ragged
// batch's K and V, 3-D (head_dim, tokens, heads), boxes of 64 dims x kTileKV tokens; 0 for a paged
// cache, whose producer copies pages itself. `q_out`: Q and the output, 4-D (head_dim, the group's
// query heads, KV heads, tokens), boxes of 64 dims x a warpgroup's 64 packed rows (64 / group
// tokens of every head of the group); 0 where the group does not divide 64, and the consumers copy
// Q and write the output themselves. Each 0 too where the strides are not what the TMA unit takes.
struct Sm90TensorMaps {
  CUtensorMap k, v, q, out;
  int kv, q_out;
};

// cuTensorMapEncodeTiled, from the driver the runtime has loaded (no link to libcuda); null where
// the driver has none.
inline PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t status =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
    if (status != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// The map of a 16-bit tensor at `base` of kRank dimensions, dims[0] contiguous (head_dim), the
// others `strides[i]` elements apart, in boxes of `box` elements. False where the TMA unit cannot
// take it: a stride that is not a positive multiple of 16 bytes below 2^40 (a dimension of one
// element takes any), a dimension past 2^31, no encoder.
template <typename T, int kRank>
inline bool EncodeTileMap(CUtensorMap* map, const void* base, const int64_t (&dims)[kRank],
                          const int64_t (&strides)[kRank], const uint32_t (&box)[kRank]) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  if (encode == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  cuuint64_t global_dims[kRank], global_strides[kRank - 1];
  cuuint32_t box_dims[kRank], element_strides[kRank];
  for (int i = 0; i < kRank; ++i) {
    if (dims[i] < 1 || dims[i] > INT_MAX) return false;
    if (i > 0) {
      const bool takes = strides[i] > 0 && strides[i] % 8 == 0 && strides[i] < (int64_t(1) << 39);
      if (!takes && dims[i] > 1) return false;
      global_strides[i - 1] = cuuint64_t(takes ? strides[i] : 8) * 2;  // bytes; one element's is never stepped
    }
    global_dims[i] = cuuint64_t(dims[i]);
    box_dims[i] = box[i];
    element_strides[i] = 1;
  }
  const CUtensorMapDataType type =
      std::is_same_v<T, half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  return encode(map, type, kRank, const_cast<void*>(base), global_dims, global_strides, box_dims, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The keys an item attends (begin, end) and its tiles: the item's range cut by the request's
// length, the causal diagonal of its last query and the window of its first.
struct Sm90ItemKeys {
  int begin, end, num_tiles, first_token, last_token, rows;
};

template <int kTileQ, int kTileKV>
__device__ __forceinline__ Sm90ItemKeys ItemKeys(const PrefillParams& p, int4 item, int4 info) {
  Sm90ItemKeys keys;
  const int q_len = info.y, kv_len = info.w, delta = kv_len - q_len;
  keys.rows = min(kTileQ, q_len * p.group - item.y);
  keys.first_token = int(p.group_divisor.Divide(uint32_t(item.y)));
  keys.last_token = int(p.group_divisor.Divide(uint32_t(item.y + keys.rows - 1)));
  keys.begin = max(item.z, 0);
  keys.end = min(item.w, kv_len);
  if (p.causal) keys.end = min(keys.end, keys.last_token + delta + 1);
  if (p.window_left >= 0) keys.begin = max(keys.begin, keys.first_token + delta - p.window_left);
  keys.num_tiles = keys.end > keys.begin ? (keys.end - keys.begin + kTileKV - 1) / kTileKV : 0;
  return keys;
}

// The shared memory of a block: Q, the K and V stages (each tile 1024-byte aligned), barriers.
template <typename T, int D, bool kPaged, int DV>
struct Sm90PrefillSmem {
  using S = Sm90PrefillShape<T, D, kPaged, DV>;
  uint8_t* q;
  uint8_t* k;  // [kStages][kKBytes]
  uint8_t* v;  // [kStages][kVBytes]
  uint64_t* k_full;  // [kStages] each
  uint64_t* v_full;
  uint64_t* k_empty;
  uint64_t* v_empty;
  uint64_t* q_full;  // [kConsumers]: a warpgroup's Q rows have landed (TMA's, where maps.q_out)
  __device__ __forceinline__ explicit Sm90PrefillSmem(uint8_t* raw) {
    uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
    q = base;
    k = q + S::kQBytes;
    v = k + S::kStages * S::kKBytes;
    k_full = reinterpret_cast<uint64_t*>(v + S::kStages * S::kVBytes);
    v_full = k_full + S::kStages;
    k_empty = v_full + S::kStages;
    v_empty = k_empty + S::kStages;
    q_full = v_empty + S::kStages;
  }
};

// How the producer's threads copy rows of kChunks 16-byte chunks of a tile (a row's chunks from
// first_chunk on): thread t copies chunk t % kChunks of rows t / kChunks + c * kRowsAtOnce (in
// kPhases swizzle phases: one where kRowsAtOnce is a multiple of 8, two at 32 chunks). A paged
// row's offset is computed by the lane that looked up its page (one row a lane) and handed over by
// shuffle: lane l looks up the warp's row l % kWarpRows of copy l / kWarpRows (lanes past the
// tile's rows look up the last one again).
template <int kChunks, int kTileKV>
struct Sm90CopyLayout {
  static constexpr int kRowsAtOnce = 128 / kChunks, kCopies = kTileKV / kRowsAtOnce;
  static constexpr int kWarpRows = 32 / kChunks;  // rows a warp copies at once
  static_assert(kCopies * kWarpRows <= 32, "a lane looks up at most one row");
  static constexpr int kPhases = kRowsAtOnce % 8 == 0 ? 1 : 8 / kRowsAtOnce;
  int chunk, row0, lookup_row;
  uint32_t dst_phase[kPhases];  // copy c lands at dst_phase[c % kPhases] + c * kRowsAtOnce * 128
  __device__ __forceinline__ Sm90CopyLayout(int tid, int first_chunk) {
    const int warp = tid / 32, lane = tid % 32;
    chunk = first_chunk + tid % kChunks;
    row0 = tid / kChunks;
    lookup_row = warp * kWarpRows + lane % kWarpRows + min(lane / kWarpRows, kCopies - 1) * kRowsAtOnce;
#pragma unroll
    for (int c = 0; c < kPhases; ++c) {
      dst_phase[c] = SwizzledTileOffset<kTileKV>(row0 + c * kRowsAtOnce, chunk) - c * kRowsAtOnce * 128;
    }
  }
};

// The producer warpgroup: every item's K and V tiles into the stages, in the consumers' order.
// A ragged full tile is one TMA copy a 64-dim region, issued by thread 0 (the others count their
// arrival). Otherwise the threads copy rows as an Sm90CopyLayout of the row's chunks says (K at
// 192 dims: its first 128 as V's, its last 64 as a second layout); ragged rows are a stride apart.
// The copies are the producer's whole cost, so their addresses are one add each.
template <typename T, int D, bool kPaged, int DV>
__device__ __forceinline__ void Sm90Produce(const PrefillParams& p, const Sm90TensorMaps& maps,
                                            const Sm90PrefillSmem<T, D, kPaged, DV>& smem, int2 start) {
  using S = Sm90PrefillShape<T, D, kPaged, DV>;
  using Layout = Sm90CopyLayout<S::kVRowChunks, S::kTileKV>;                     // V, and K's first DV dims
  using TailLayout = Sm90CopyLayout<D == DV ? 8 : (D - DV) / 8, S::kTileKV>;  // K's dims past DV
  const int tid = threadIdx.x, kv_head = start.x;
  const Layout layout(tid, 0);
  const TailLayout tail(tid, S::kVRowChunks);
  const T* const k = static_cast<const T*>(p.k) + kv_head * p.k_stride_head;
  const T* const v = static_cast<const T*>(p.v) + kv_head * p.v_stride_head;
  uint32_t counter = 0;  // tiles produced, over every item
  const int num_items = p.work[0].x;
  for (int i = start.y; i < num_items; i += gridDim.y) {
    const int4 item = p.work[2 + 2 * i];
    if (item.x < 0) continue;
    const int4 info = p.requests[2 * item.x];
    const Sm90ItemKeys keys = ItemKeys<S::kTileQ, S::kTileKV>(p, item, info);
    const int kv_offset = info.z;
    for (int tile = 0; tile < keys.num_tiles; ++tile, ++counter) {
      const int stage = counter % S::kStages;
      const uint32_t parity = (counter / S::kStages) & 1;
      const int tile_pos = keys.begin + tile * S::kTileKV;
      // The row offsets of K and V in a layout: paged, of its lookup_row; ragged, of its row0.
      auto row_offsets = [&](const auto& l) {
        if constexpr (kPaged) {
          const int pos = min(tile_pos + l.lookup_row, keys.end - 1);
          const int index = int(p.page_size.Divide(uint32_t(pos)));
          const int64_t page = PageInCache(p.indices[kv_offset + index], p.last_page), slot = pos - index * int(p.page_size.divisor);
          return make_longlong2(page * p.k_stride_page + slot * p.k_stride_slot, page * p.v_stride_page + slot * p.v_stride_slot);
        } else {
          return make_longlong2(int64_t(kv_offset + tile_pos + l.row0) * p.k_stride_page,
                                int64_t(kv_offset + tile_pos + l.row0) * p.v_stride_page);
        }
      };
      // A full tile (every row a key: all but an item's last) copies without predicates.
      const bool full = keys.end - tile_pos >= S::kTileKV;
      auto copy_tile = [&](const auto& l, uint8_t* stage_base, const T* src, int64_t row_offset, int64_t row_step) {
        using L = std::decay_t<decltype(l)>;
        const int left = keys.end - tile_pos - l.row0;  // this thread's rows c with c * kRowsAtOnce < left are keys
        src += l.chunk * 8;
        const T* row = src + row_offset;  // ragged: this thread's row c, a step at a time
#pragma unroll
        for (int c = 0; c < L::kCopies; ++c, row += row_step) {
          if constexpr (kPaged) {
            const int from = c * L::kWarpRows + l.row0 % L::kWarpRows;
            const uint32_t lo = __shfl_sync(0xffffffffu, uint32_t(row_offset), from);
            const uint32_t hi = __shfl_sync(0xffffffffu, uint32_t(uint64_t(row_offset) >> 32), from);
            row = src + int64_t(uint64_t(hi) << 32 | lo);
          }
          uint8_t* const dst = stage_base + l.dst_phase[c % L::kPhases] + c * L::kRowsAtOnce * 128;
          if (full) CopyAsync16(dst, row);
          else CopyAsync16OrZero(dst, c * L::kRowsAtOnce < left ? row : src, c * L::kRowsAtOnce < left);
        }
      };
      if (!kPaged && full && maps.kv) {
        auto load_tile = [&](uint8_t* stage_base, const CUtensorMap& map, uint64_t* full_barrier, auto regions) {
          if (tid == 0) {
            BarrierArriveExpectingBytes(full_barrier, decltype(regions)::value * S::kTileKV * 128);
#pragma unroll
            for (int region = 0; region < decltype(regions)::value; ++region) {
              CopyBox3d(stage_base + region * S::kTileKV * 128, &map, region * 64, kv_offset + tile_pos, kv_head,
                        full_barrier);
            }
          } else {
            BarrierArrive(full_barrier);
          }
        };
        BarrierWait(&smem.k_empty[stage], parity ^ 1);
        load_tile(smem.k + stage * S::kKBytes, maps.k, &smem.k_full[stage], std::integral_constant<int, D / 64>{});
        BarrierWait(&smem.v_empty[stage], parity ^ 1);
        load_tile(smem.v + stage * S::kVBytes, maps.v, &smem.v_full[stage], std::integral_constant<int, DV / 64>{});
        continue;
      }
      const longlong2 rows = row_offsets(layout);
      BarrierWait(&smem.k_empty[stage], parity ^ 1);
      copy_tile(layout, smem.k + stage * S::kKBytes, k, rows.x, Layout::kRowsAtOnce * p.k_stride_page);
      if constexpr (D != DV) {
        copy_tile(tail, smem.k + stage * S::kKBytes, k, row_offsets(tail).x, TailLayout::kRowsAtOnce * p.k_stride_page);
      }
      ArriveWhenCopiesLand(&smem.k_full[stage]);
      BarrierWait(&smem.v_empty[stage], parity ^ 1);
      copy_tile(layout, smem.v + stage * S::kVBytes, v, rows.y, Layout::kRowsAtOnce * p.v_stride_page);
      ArriveWhenCopiesLand(&smem.v_full[stage]);
    }
  }
  WaitAsyncGroups<0>();
}

// One consumer warpgroup's part of an item, the group's `items_done`-th: its 64 query rows against
// the item's keys. `tma`: the producer copies every full tile by TMA, so only the item's last tile
// (cp.async's) needs the proxy fence before wgmma reads it.
template <typename T, int D, bool kPaged, int DV>
__device__ __forceinline__ void Sm90ConsumeItem(const PrefillParams& p, const Sm90TensorMaps& maps,
                                                const Sm90PrefillSmem<T, D, kPaged, DV>& smem, int kv_head, int4 item,
                                                int chunk_index, bool tma, uint32_t items_done, uint32_t& counter) {
  using S = Sm90PrefillShape<T, D, kPaged, DV>;
  constexpr int kNT = S::kTileKV / 8;  // 8-column tiles of S
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  // Broadcast from lane 0, so the compiler knows it is the same across the warp: what derives from
  // it (the Q tile's descriptors) then lives in uniform registers, where wgmma takes them.
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0) - 1;
  const int g = lane / 4, t = lane % 4;
  const int4 info = p.requests[2 * item.x];
  const int4 split = p.requests[2 * item.x + 1];
  const int q_begin = info.x, q_len = info.y, kv_len = info.w, delta = kv_len - q_len;
  const int row_begin = item.y;
  const Sm90ItemKeys keys = ItemKeys<S::kTileQ, S::kTileKV>(p, item, info);
  const int wg_row0 = wg * 64;  // of the item's rows
  const int barrier_id = 1 + wg;

  // Q rows of this warpgroup: one TMA copy (rows past the item's are another request's, or zeros
  // past the tensor: their outputs are never written), or copied here (zeros past them).
  if (maps.q_out) {
    uint64_t* q_full = &smem.q_full[wg];
    if (tid == 0) {
      BarrierArriveExpectingBytes(q_full, S::kQBytes / S::kConsumers);
      const int token = q_begin + int(p.group_divisor.Divide(uint32_t(row_begin + wg_row0)));
#pragma unroll
      for (int region = 0; region < D / 64; ++region) {
        CopyBox4d(smem.q + region * S::kTileQ * 128 + wg_row0 * 128, &maps.q, region * 64, 0, kv_head, token, q_full);
      }
    }
    BarrierWait(q_full, items_done & 1);
  } else {
    const T* q = static_cast<const T*>(p.q);
    for (int c = tid; c < 64 * S::kRowChunks; c += 128) {
      const int r = wg_row0 + c / S::kRowChunks, column = c % S::kRowChunks;
      const bool valid = r < keys.rows;
      const int packed = row_begin + min(r, keys.rows - 1);
      const int token = int(p.group_divisor.Divide(uint32_t(packed)));
      const int head = kv_head * p.group + (packed - token * p.group);
      CopyAsync16OrZero(smem.q + SwizzledTileOffset<S::kTileQ>(r, column),
                        q + int64_t(q_begin + token) * p.q_stride_n + int64_t(head) * p.q_stride_h + column * 8, valid);
    }
    CommitAsyncGroup();
    WaitAsyncGroups<0>();
    FenceAsyncProxy();
    NamedBarrierSync(barrier_id, 128);
  }

  // This thread's rows: g and g + 8 of its warp's 16; their query tokens.
  const int local0 = wg_row0 + warp * 16 + g;  // of the item's rows
  int token[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) token[r] = int(p.group_divisor.Divide(uint32_t(row_begin + local0 + 8 * r)));

  float o[DV / 2];
#pragma unroll
  for (int i = 0; i < DV / 2; ++i) o[i] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};

  const bool capped = p.soft_cap > 0.f;
  const float cap_scale = capped ? p.scale_log2 / (kLog2e * p.soft_cap) : 0.f;
  const float cap_log2 = p.soft_cap * kLog2e;
  const float scale = capped ? 1.f : p.scale_log2;
  // This group's rows (fewer than 64 where the item ends inside them) and their first and last
  // tokens: a tile that every one of them sees whole needs no mask.
  const int group_rows = min(64, keys.rows - wg_row0);
  const int group_first = int(p.group_divisor.Divide(uint32_t(row_begin + wg_row0)));
  const int group_last = int(p.group_divisor.Divide(uint32_t(row_begin + wg_row0 + max(group_rows, 1) - 1)));
  const int all_see_up_to = p.causal ? group_first + delta : INT_MAX;
  const int all_see_from = p.window_left >= 0 ? group_last + delta - p.window_left : INT_MIN;

  // Matrix descriptors: made once, then moved by constants (the address field, in 16-byte units,
  // is the descriptor's low bits; shared memory addresses stay below its 256 KB).
  const uint64_t q_desc = MatrixDescriptor(SharedAddress(smem.q) + wg_row0 * 128);
  const uint64_t k_desc = MatrixDescriptor(SharedAddress(smem.k));
  const uint64_t v_desc = MatrixDescriptor(SharedAddress(smem.v), S::kTileKV * 128);
  // S = Q K^T of the tile in stage `stage`, issued and committed (not waited for).
  auto issue_s = [&](float (&s)[S::kTileKV / 2], int stage) {
    const uint64_t k_stage = k_desc + uint64_t(stage * (S::kKBytes >> 4));
    WgmmaFence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      // Region kk / 4 of the rows, 32 bytes a k-step into it.
      WgmmaSS<T>(s, q_desc + ((kk / 4) * S::kTileQ * 128 + (kk % 4) * 32) / 16,
                 k_stage + ((kk / 4) * S::kTileKV * 128 + (kk % 4) * 32) / 16, kk > 0);
    }
    WgmmaCommit();
  };
  // O += P V of the tile in stage `stage`, issued and committed: P from registers, V N-major.
  auto issue_pv = [&](const uint32_t (&pa)[S::kTileKV / 16][4], int stage) {
    const uint64_t v_stage = v_desc + uint64_t(stage * (S::kVBytes >> 4));
    FenceOperands(o);
    WgmmaFence();
#pragma unroll
    for (int j = 0; j < S::kTileKV / 16; ++j) WgmmaRS<T>(o, pa[j], v_stage + j * 16 * 128 / 16, 1);
    WgmmaCommit();
  };

  // Softmax of a tile's S in place (S becomes P, unnormalized): cap, mask where a mask cuts the
  // tile, the running max (moved lazily, as in prefill.cuh) and sums. Where a row's max moved,
  // alpha scales what O holds; the caller applies it once O is out of the tensor cores.
  auto softmax = [&](float (&s)[S::kTileKV / 2], int tile, float (&alpha)[2]) {
    const int tile_pos = keys.begin + tile * S::kTileKV;
    const bool masked = tile_pos + S::kTileKV > keys.end || tile_pos + S::kTileKV - 1 > all_see_up_to || tile_pos < all_see_from;
    if (capped) {
#pragma unroll
      for (int i = 0; i < S::kTileKV / 2; ++i) s[i] = cap_log2 * TanhApprox(s[i] * cap_scale);
    }
    if (masked) {
      MaskScores<kNT>(p, [&](int nt, int e) -> float& { return s[4 * nt + e]; }, token, delta, keys.end, tile_pos + 2 * t);
    }
    // Row maxima and sums in 4 independent chains a row (a plain chain would leave the warp
    // waiting on each step; an array tree is not unrolled here and goes to local memory).
    float chain[2][4];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float pair = fmaxf(s[4 * nt + 2 * r], s[4 * nt + 2 * r + 1]);
        chain[r][nt % 4] = nt < 4 ? pair : fmaxf(chain[r][nt % 4], pair);
      }
    }
    float partial[2][1];
#pragma unroll
    for (int r = 0; r < 2; ++r) partial[r][0] = fmaxf(fmaxf(chain[r][0], chain[r][1]), fmaxf(chain[r][2], chain[r][3]));
    float tile_max[2];
    bool grows = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      alpha[r] = 1.f;
      tile_max[r] = partial[r][0] * scale;
      grows |= tile_max[r] > row_max[r] + kRescaleSlack;
    }
    if (__any_sync(0xffffffffu, grows)) {
#pragma unroll
      for (int r = 0; r < 2; ++r) alpha[r] = MoveRowMax(tile_max[r], row_max[r], row_sum[r]);
    }
    const float base[2] = {SafeBase(row_max[0]), SafeBase(row_max[1])};
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[4 * nt + e] = Exp2(fmaf(s[4 * nt + e], scale, -base[e / 2]));
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float pair = s[4 * nt + 2 * r] + s[4 * nt + 2 * r + 1];
        chain[r][nt % 4] = nt < 4 ? pair : chain[r][nt % 4] + pair;
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) partial[r][0] = (chain[r][0] + chain[r][1]) + (chain[r][2] + chain[r][3]);
    row_sum[0] += partial[0][0];
    row_sum[1] += partial[1][0];
  };
  auto rescale_o = [&](const float (&alpha)[2]) {
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int n = 0; n < DV / 8; ++n) {
        o[4 * n] *= alpha[0];
        o[4 * n + 1] *= alpha[0];
        o[4 * n + 2] *= alpha[1];
        o[4 * n + 3] *= alpha[1];
      }
    }
  };
  auto pack_p = [&](uint32_t (&pa)[S::kTileKV / 16][4], const float (&s)[S::kTileKV / 2]) {
#pragma unroll
    for (int j = 0; j < S::kTileKV / 16; ++j) {
      pa[j][0] = PackPair<T>(s[8 * j], s[8 * j + 1]);
      pa[j][1] = PackPair<T>(s[8 * j + 2], s[8 * j + 3]);
      pa[j][2] = PackPair<T>(s[8 * j + 4], s[8 * j + 5]);
      pa[j][3] = PackPair<T>(s[8 * j + 6], s[8 * j + 7]);
    }
  };
  // The warpgroups take turns on the tensor cores, round robin: each issues its MMAs once the one
  // before it has issued its own, so one's softmax runs while another's MMAs do.
  const int my_turn = S::kTurnBarriers + wg, their_turn = S::kTurnBarriers + (wg + 1) % S::kConsumers;
  auto take_turn = [&] { NamedBarrierSync(my_turn, 256); };
  auto pass_turn = [&] { NamedBarrierArrive(their_turn, 256); };
  auto stage_of = [&](uint32_t n) { return int(n % S::kStages); };
  auto parity_of = [&](uint32_t n) { return (n / S::kStages) & 1; };

  // The tiles this group's rows see, a prefix of the item's: under causal the group's last row
  // sees fewer keys than the item's last (1-2 tiles fewer for the first groups of a 192-row
  // item), and a group past the item's rows (a request's last, short tile) sees none.
  int group_tiles = 0;
  if (group_rows > 0) {
    const int end = p.causal ? min(keys.end, group_last + delta + 1) : keys.end;
    group_tiles = end > keys.begin ? (end - keys.begin + S::kTileKV - 1) / S::kTileKV : 0;
  }

  // The pipeline: tile n's S is issued with tile n - 1's P V, and its softmax runs while P V is
  // in the tensor cores; P is packed once P V is done, and O rescaled between the next issues
  // (while S runs, where the warps would wait for the tensor cores anyway).
  if (group_tiles > 0) {
    float s[S::kTileKV / 2], alpha[2];
    uint32_t pa[S::kTileKV / 16][4];
    const int last_tile = keys.num_tiles - 1;
    BarrierWait(&smem.k_full[stage_of(counter)], parity_of(counter));
    if (!tma || last_tile == 0) FenceAsyncProxy();
    take_turn();
    issue_s(s, stage_of(counter));
    pass_turn();
    WgmmaWait<0>();
    FenceOperands(s);
    if (lane == 0) BarrierArrive(&smem.k_empty[stage_of(counter)]);
    softmax(s, 0, alpha);  // O is zero: nothing to rescale
    pack_p(pa, s);
    // Tile n + 1's K and tile n's V, waited for before tile n + 1's S and n's P V are issued.
    // At head_dim 256 the wait comes between the softmax and the P V wait: its loop ends the basic
    // block, which keeps the compiler from hoisting the P V wait above the exponentials, so they
    // run while P V does (2% faster). At 64 and 128 the same order was 3-8% slower with two groups
    // and 128-key tiles (docs/design/prefill_sm90.md#what-holds-a-tile): there P V is done by the time the
    // row maxima are, and the wait
    // stays at the loop's head.
    constexpr bool kWaitBeforePv = D == 256;
    auto wait_next_tile = [&](uint32_t n) {
      BarrierWait(&smem.k_full[stage_of(n + 1)], parity_of(n + 1), &smem.v_full[stage_of(n)], parity_of(n));
    };
    if (kWaitBeforePv && group_tiles > 1) wait_next_tile(counter);
    for (int tile = 1; tile < group_tiles; ++tile) {
      if (!kWaitBeforePv) wait_next_tile(counter);
      const uint32_t previous = counter++;
      if (!tma || tile == last_tile) FenceAsyncProxy();  // K of `tile` and V of the one before
      take_turn();
      issue_s(s, stage_of(counter));
      rescale_o(alpha);  // while S runs: O is out of the tensor cores until P V is issued
      issue_pv(pa, stage_of(previous));
      pass_turn();
      WgmmaWait<1>();  // S (P V may still run)
      FenceOperands(s);
      if (lane == 0) BarrierArrive(&smem.k_empty[stage_of(counter)]);
      softmax(s, tile, alpha);
      if (kWaitBeforePv && tile + 1 < group_tiles) {
        FenceOperands(s);  // the exponentials before the wait
        wait_next_tile(counter);
      }
      WgmmaWait<0>();  // P V
      FenceOperands(o);
      FenceOperands(pa);
      if (lane == 0) BarrierArrive(&smem.v_empty[stage_of(previous)]);
      pack_p(pa, s);
    }
    BarrierWait(&smem.v_full[stage_of(counter)], parity_of(counter));
    FenceAsyncProxy();
    take_turn();
    rescale_o(alpha);
    issue_pv(pa, stage_of(counter));
    pass_turn();
    WgmmaWait<0>();
    FenceOperands(o);
    FenceOperands(pa);
    if (lane == 0) BarrierArrive(&smem.v_empty[stage_of(counter)]);
    ++counter;
  }
  // The item's tiles past the group's: no MMAs and no softmax, but every group arrives on each
  // tile's "empty" barriers (once the tile has landed, so no arrival counts toward the stage's
  // previous use) and takes as many turns an item (tiles + 1), which keeps the round robin whole.
  for (int tile = group_tiles; tile < keys.num_tiles; ++tile, ++counter) {
    BarrierWait(&smem.k_full[stage_of(counter)], parity_of(counter), &smem.v_full[stage_of(counter)], parity_of(counter));
    if (lane == 0) {
      BarrierArrive(&smem.k_empty[stage_of(counter)]);
      BarrierArrive(&smem.v_empty[stage_of(counter)]);
    }
    take_turn();
    pass_turn();
  }
  if (group_tiles == 0 && keys.num_tiles > 0) {
    take_turn();
    pass_turn();
  }

  // Finish each row (prefill.cuh's epilogue): the sum over the quad, the sink where the row is
  // not split, the LSE; the output through this warpgroup's Q rows, or float32 partials.
  const bool final = split.y <= 1 || keys.first_token < split.z;
  const bool store_by_tma = final && maps.q_out && wg_row0 + 64 <= keys.rows;
  NamedBarrierSync(barrier_id, 128);  // every warp of the group is done reading Q
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int local = local0 + 8 * r;
    const int packed = row_begin + local;
    const int head = kv_head * p.group + (packed - token[r] * p.group);
    const float m = row_max[r];
    const float sink = final && p.sinks != nullptr ? p.sinks[head] * kLog2e : -INFINITY;
    const float top = SafeBase(fmaxf(m, sink));
    const float total = sum * Exp2(m - top) + Exp2(sink - top);
    const float inv = total > 0.f ? p.v_scale * Exp2(m - top) / total : 0.f;
    const float lse = total > 0.f ? top + __log2f(total) : -INFINITY;
    const bool valid = local < keys.rows;
    if (final) {
#pragma unroll
      for (int n = 0; n < DV / 8; ++n) {
        *reinterpret_cast<uint32_t*>(smem.q + SwizzledTileOffset<S::kTileQ>(local, n) + 4 * t) =
            PackPair<T>(o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv);
      }
      if (valid && t == 0 && p.lse != nullptr) p.lse[int64_t(q_begin + token[r]) * p.num_qo_heads + head] = lse;
    } else if (valid) {
      const int64_t slot = int64_t(split.x) + int64_t(token[r]) * split.y + chunk_index;
      float* out = p.partial_out + (slot * p.num_qo_heads + head) * DV + 2 * t;
#pragma unroll
      for (int n = 0; n < DV / 8; ++n) {
        *reinterpret_cast<float2*>(out + n * 8) = make_float2(o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv);
      }
      if (t == 0) p.partial_lse[slot * p.num_qo_heads + head] = lse;
    }
  }
  // The next writers of Q's rows are the TMA unit's (the output's store, the next item's Q): this
  // thread's writes first.
  if (final) FenceAsyncProxy();
  if (store_by_tma) {
    NamedBarrierSync(barrier_id, 128);
    if (tid == 0) {
      const int token = q_begin + int(p.group_divisor.Divide(uint32_t(row_begin + wg_row0)));
#pragma unroll
      for (int region = 0; region < DV / 64; ++region) {
        StoreBox4d(&maps.out, region * 64, 0, kv_head, token, smem.q + region * S::kTileQ * 128 + wg_row0 * 128);
      }
      BulkStoresRead();
    }
  } else if (final) {
    NamedBarrierSync(barrier_id, 128);
    T* out = static_cast<T*>(p.out);
    for (int c = tid; c < 64 * S::kVRowChunks; c += 128) {
      const int r = wg_row0 + c / S::kVRowChunks, column = c % S::kVRowChunks;
      if (r >= keys.rows) break;
      const int packed = row_begin + r;
      const int tok = int(p.group_divisor.Divide(uint32_t(packed)));
      const int head = kv_head * p.group + (packed - tok * p.group);
      *reinterpret_cast<uint4*>(out + int64_t(q_begin + tok) * p.out_stride_n + int64_t(head) * p.out_stride_h + column * 8) =
          *reinterpret_cast<const uint4*>(smem.q + SwizzledTileOffset<S::kTileQ>(r, column));
    }
  }
  NamedBarrierSync(barrier_id, 128);  // the group's Q rows are free for the next item
}

template <typename T, int D, bool kPaged, int DV>
__global__ void __launch_bounds__(Sm90PrefillShape<T, D, kPaged, DV>::kThreads, 1)
    Sm90PrefillKernel(const PrefillParams p, const __grid_constant__ Sm90TensorMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = Sm90PrefillShape<T, D, kPaged, DV>;
  extern __shared__ uint8_t shared[];
  const Sm90PrefillSmem<T, D, kPaged, DV> smem(shared);
  if (threadIdx.x == 0) {
    for (int s = 0; s < S::kStages; ++s) {
      BarrierInit(&smem.k_full[s], 128);  // the producer's threads, as their copies land
      BarrierInit(&smem.v_full[s], 128);
      BarrierInit(&smem.k_empty[s], 4 * S::kConsumers);  // a consumer warp's lane 0
      BarrierInit(&smem.v_empty[s], 4 * S::kConsumers);
    }
    for (int g = 0; g < S::kConsumers; ++g) BarrierInit(&smem.q_full[g], 1);  // the group's thread 0, with Q's bytes
    BarrierInitFence();
  }
  __syncthreads();
  WaitForPriorGrids();
  const int2 start = BlockHeadAndItem(p);
  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(S::kProducerRegisters));
    Sm90Produce<T, D, kPaged, DV>(p, maps, smem, start);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(S::kConsumerRegisters));
    if (threadIdx.x >= 128 * S::kConsumers) {
      NamedBarrierArrive(S::kTurnBarriers, 256);  // the first turn on the tensor cores is warpgroup 0's
    }
    uint32_t counter = 0, items_done = 0;  // tiles and items consumed
    const int num_items = p.work[0].x;
    const bool tma = !kPaged && maps.kv;
    for (int i = start.y; i < num_items; i += gridDim.y) {
      const int4 item = p.work[2 + 2 * i];
      if (item.x < 0) continue;
      Sm90ConsumeItem<T, D, kPaged, DV>(p, maps, smem, start.x, item, p.work[3 + 2 * i].x, tma, items_done++, counter);
    }
    if (threadIdx.x % 128 == 0) BulkStoresDone();
  }
  AllowDependentGrids();
#else
  __trap();  // an sm_90 build without the "a" features: the binding refuses to launch it
#endif
}

// Whether this object's device code has sm_90a's features (wgmma): an sm_90 build without them
// holds kernels that only trap, so the binding refuses it (read once a process).
__device__ const int kSm90aFeatures =
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    1;
#else
    0;
#endif

inline bool HasSm90aFeatures() {
  static const bool has = [] {
    int value = 0;
    return cudaMemcpyFromSymbol(&value, kSm90aFeatures, sizeof(value)) == cudaSuccess && value == 1;
  }();
  return has;
}

template <typename T, int D, bool kPaged, int DV>
cudaError_t LaunchPrefillSm90(const PrefillParams& p, const Sm90TensorMaps& maps, int ctas, cudaStream_t stream,
                              bool pdl, int device) {
  using S = Sm90PrefillShape<T, D, kPaged, DV>;
  // BlocksPerSm also raises the kernel's shared-memory limit past 48 KB, once per device.
  if (BlocksPerSm<Sm90PrefillKernel<T, D, kPaged, DV>>(S::kThreads, S::kSharedBytes, device) == 0) {
    return cudaErrorInvalidConfiguration;
  }
  const dim3 grid(unsigned(p.num_kv_heads), unsigned(min(ctas, 65535)));  // grid.y's limit; blocks stride
  return LaunchWithSharedMemory(Sm90PrefillKernel<T, D, kPaged, DV>, grid, dim3(S::kThreads), S::kSharedBytes, stream,
                                pdl, p, maps);
}

// The kernel (`q_tokens` query tokens; `paged`, else ragged, K and V then `kv_tokens` rows) on
// num_kv_heads x `ctas` blocks, then, unless `merge_from` is -1, the merge of split requests'
// partials over query tokens merge_from .. q_tokens - 1. The caller has checked HasSm90aFeatures,
// and planned the query tiles of that kind's kTileQ. D: q's and k's head dim, DV: v's and out's.
template <typename T, int D, int DV = D>
cudaError_t BatchPrefillSm90(const PrefillParams& p, bool paged, int q_tokens, int64_t kv_tokens, int ctas,
                             int merge_from, cudaStream_t stream, bool pdl, int device) {
  if (p.batch == 0 || ctas == 0 || p.num_kv_heads == 0) return cudaSuccess;
  using S = Sm90PrefillShape<T, D, false, DV>;  // the maps of K and V are a ragged batch's
  Sm90TensorMaps maps{};
  const int64_t heads = p.num_kv_heads, group = p.group;
  if (!paged) {
    const int64_t k_dims[3] = {D, kv_tokens, heads}, v_dims[3] = {DV, kv_tokens, heads};
    const uint32_t kv_box[3] = {64, S::kTileKV, 1};
    const int64_t k_strides[3] = {1, p.k_stride_page, p.k_stride_head};
    const int64_t v_strides[3] = {1, p.v_stride_page, p.v_stride_head};
    maps.kv = EncodeTileMap<T, 3>(&maps.k, p.k, k_dims, k_strides, kv_box) &&
              EncodeTileMap<T, 3>(&maps.v, p.v, v_dims, v_strides, kv_box);
  }
  if (64 % group == 0) {  // a warpgroup's 64 packed rows: 64 / group tokens of the group's heads
    const int64_t q_dims[4] = {D, group, heads, int64_t(q_tokens)}, out_dims[4] = {DV, group, heads, int64_t(q_tokens)};
    const uint32_t q_box[4] = {64, uint32_t(group), 1, uint32_t(64 / group)};
    const int64_t q_strides[4] = {1, p.q_stride_h, group * p.q_stride_h, p.q_stride_n};
    const int64_t out_strides[4] = {1, p.out_stride_h, group * p.out_stride_h, p.out_stride_n};
    maps.q_out = EncodeTileMap<T, 4>(&maps.q, p.q, q_dims, q_strides, q_box) &&
                 EncodeTileMap<T, 4>(&maps.out, p.out, out_dims, out_strides, q_box);
  }
  const cudaError_t status = paged ? LaunchPrefillSm90<T, D, true, DV>(p, maps, ctas, stream, pdl, device)
                                  : LaunchPrefillSm90<T, D, false, DV>(p, maps, ctas, stream, pdl, device);
  if (status != cudaSuccess || merge_from < 0) return status;
  return MergePartials<T, DV>(p, q_tokens - merge_from, PrefillPartials{p.requests, p.batch}, stream, pdl, merge_from);
}

}  // namespace aotinfer
