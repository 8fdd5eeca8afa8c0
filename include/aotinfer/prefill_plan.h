// The prefill plan's work items, on the host: each request's packed query rows (query tokens x
// the query heads of a KV head) cut into tiles, each tile's keys into chunks where the request is
// split, the items ordered by cost, and the int32 tables the prefill kernels read (prefill.cuh,
// prefill_sm90.cuh: `work` rows (request, row_begin, kv_begin, kv_end, chunk, 0, 0, 0) after a
// count row, `requests` rows (q_begin, q_len, kv_offset, kv_len, first_partial, num_partials,
// split_from, 0)).
//
// Compiled for the host cost of plan (docs/design/prefill.md#plan-host-cost): a prefill of
// thousands of tiles built by torch calls cost twice FlashInfer's whole plan. The choices (the
// chunk, a lone request's split_from) stay in python/aotinfer/prefill.py, which passes them in.
// Plain C++: no framework types.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "aotinfer/decode_plan.h"  // NumChunks

namespace aotinfer {

struct PrefillRequest {
  int64_t q_begin, q_len, kv_offset, kv_len, split_from;  // split_from: its first token whose keys are split
};

struct PrefillItemsPolicy {
  int64_t group;          // query heads a KV head: packed rows a query token
  int64_t rows_per_tile;  // packed rows a tile
  int64_t chunk;          // keys a chunk of a split request; 0: nothing split
  bool causal;
  int64_t window_left;    // -1: none
};

struct PlannedItem {
  int64_t request, row_begin, kv_begin, kv_end, chunk;
  int64_t lo, hi;  // the keys its rows attend (causal diagonal, window)
  int64_t cost;    // rows x keys attended
};

struct PrefillItems {
  std::vector<PlannedItem> items;  // in (request, tile, chunk) order
  std::vector<int32_t> by_cost;    // indices into items: most costly first, ties in the items' order
  std::vector<int32_t> scratch;    // the radix sort's other buffer
  int64_t num_slots = 0;    // partial results: (query token, chunk) pairs of split requests
  int64_t merge_from = -1;  // the first query token of the batch with partials to merge
  int64_t halves = 0;       // items of split tiles in a batch with a split_from (a lone request)
  std::vector<int64_t> first_partial, num_partials;  // a request's slots: both 0 where unsplit

  const PlannedItem& operator[](size_t i) const { return items[by_cost[i]]; }  // the i-th most costly
};

inline int64_t TilesOf(const PrefillRequest& r, const PrefillItemsPolicy& policy) {
  return (r.q_len * policy.group + policy.rows_per_tile - 1) / policy.rows_per_tile;
}

// A request's chunks: 1 where nothing is split.
inline int64_t ChunksOf(const PrefillRequest& r, const PrefillItemsPolicy& policy) {
  return policy.chunk ? NumChunks({0, r.kv_len}, policy.chunk) : 1;
}

// The items of one request's tile that starts at packed row r0 (rows before the request's
// split_from are whole: one item).
inline int64_t ChunksOfTile(const PrefillRequest& r, int64_t r0, const PrefillItemsPolicy& policy) {
  return r0 >= r.split_from * policy.group ? ChunksOf(r, policy) : 1;
}

// Orders `p.by_cost`: a stable radix sort of the items by descending cost, a byte of the cost a
// pass. A comparison sort of thousands of items cost a plan more than everything else it does.
inline void SortByCost(PrefillItems& p) {
  const int32_t n = static_cast<int32_t>(p.items.size());
  int64_t most = 0;
  for (const PlannedItem& item : p.items) most = std::max(most, item.cost);
  p.by_cost.resize(n);
  p.scratch.resize(n);
  for (int32_t i = 0; i < n; ++i) p.by_cost[i] = i;
  for (int shift = 0; (most >> shift) > 0; shift += 8) {  // keys most - cost: ascending is most costly first
    int32_t start[257] = {};
    for (int32_t i : p.by_cost) ++start[1 + (((most - p.items[i].cost) >> shift) & 255)];
    for (int d = 0; d < 256; ++d) start[d + 1] += start[d];
    for (int32_t i : p.by_cost) p.scratch[start[((most - p.items[i].cost) >> shift) & 255]++] = i;
    p.by_cost.swap(p.scratch);
  }
}

// Fills `p`, reusing its vectors' memory: a plan builds thousands of items every serving step,
// and fresh buffers of that size cost page faults on every call.
inline void BuildPrefillItems(const std::vector<PrefillRequest>& requests, const PrefillItemsPolicy& policy,
                              PrefillItems& p) {
  p.items.clear();
  p.first_partial.clear();
  p.num_partials.clear();
  p.num_slots = p.halves = 0;
  p.merge_from = -1;
  bool any_split_from = false;
  for (const PrefillRequest& r : requests) {
    const int64_t n = ChunksOf(r, policy);
    p.first_partial.push_back(n > 1 ? p.num_slots - r.split_from * n : 0);  // token t's slots: first + t * n + i
    p.num_partials.push_back(n > 1 ? n : 0);
    if (n > 1) {
      p.num_slots += (r.q_len - r.split_from) * n;
      if (p.merge_from < 0) p.merge_from = r.q_begin + r.split_from;
    }
    any_split_from |= r.split_from != 0;
  }
  for (int64_t b = 0; b < static_cast<int64_t>(requests.size()); ++b) {
    const PrefillRequest& r = requests[b];
    const int64_t tiles = TilesOf(r, policy), delta = r.kv_len - r.q_len;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t r0 = t * policy.rows_per_tile;
      const int64_t r1 = std::min(r0 + policy.rows_per_tile, r.q_len * policy.group) - 1;
      const int64_t chunks = ChunksOfTile(r, r0, policy);
      for (int64_t c = 0; c < chunks; ++c) {
        PlannedItem item{b, r0, 0, r.kv_len, c, 0, 0, 0};
        if (chunks > 1) {
          item.kv_begin = c * policy.chunk;
          item.kv_end = std::min((c + 1) * policy.chunk, r.kv_len);
        }
        item.lo = item.kv_begin;
        item.hi = item.kv_end;
        if (policy.causal) item.hi = std::min(item.hi, r1 / policy.group + delta + 1);
        if (policy.window_left >= 0) item.lo = std::max(item.lo, r0 / policy.group + delta - policy.window_left);
        item.cost = (r1 - r0 + 1) * std::max<int64_t>(item.hi - item.lo, 0);
        if (any_split_from && r0 >= r.split_from * policy.group) ++p.halves;
        p.items.push_back(item);
      }
    }
  }
  SortByCost(p);
}

}  // namespace aotinfer
