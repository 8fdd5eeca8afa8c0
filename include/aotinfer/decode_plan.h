// The decode plan's work partition, on the host: split each request's attended positions into
// work items and write the int32 tables the decode kernel reads (decode.cuh: `work` rows
// (request, kv_begin, kv_end, slot), `requests` rows (page_begin, kv_len, first_partial,
// num_partials), zeroed `counters`).
//
// Compiled because a serving loop plans every step: the partition as torch calls cost about as
// much host time as FlashInfer's whole plan (docs/design/decode.md#plan-host-cost). The policy
// (how many items fill the GPU, the chunk sizes allowed) stays in python/aotinfer/decode.py, which
// passes it in; this file holds the arithmetic alone. Plain C++: no framework types.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace aotinfer {

struct DecodeSplitPolicy {
  int64_t fill;           // items that fill the GPU (2 CTAs an SM)
  int64_t fill_short;     // the same at 1 CTA an SM, where no request attends more than short_request
  int64_t short_request;  // positions
  int64_t min_chunk;      // the smallest chunk, in positions; no split where no request attends more
  int64_t chunk_unit;     // chunk sizes are multiples of this
  bool disable_split;     // one item a request
  int64_t fixed_chunk;    // positions a chunk (a fixed split); 0: the plan chooses
};

// Where a request attends: positions [lo, hi).
struct Attended {
  int64_t lo, hi;
};

// Chunks of `chunk` positions, aligned to multiples of it from position 0, that cover [lo, hi);
// one (empty) item for an empty range, one item for chunk 0 (no split). As
// python/aotinfer/_attention.py's num_chunks, which the prefill plan uses.
inline int64_t NumChunks(Attended a, int64_t chunk) {
  return chunk > 0 && a.hi > a.lo ? (a.hi - 1) / chunk - a.lo / chunk + 1 : 1;
}

// The chunk size: 0 (none) where the policy disables the split or the batch fills the GPU alone;
// the fixed one; else the smallest multiple of chunk_unit, at least min_chunk, whose partition
// has at most `fill` items (binary search: the chunk as long as the longest request fits, one
// item a request, so the answer fits even where the count is not monotonic, chunks being aligned
// to their size). As _attention.smallest_chunk.
inline int64_t ChooseChunk(const std::vector<Attended>& attended, const DecodeSplitPolicy& policy) {
  const int64_t batch = static_cast<int64_t>(attended.size());
  if (policy.disable_split || (policy.fixed_chunk == 0 && batch >= policy.fill)) return 0;
  if (policy.fixed_chunk > 0) return policy.fixed_chunk;
  int64_t longest = 0, end = 0;
  for (const Attended& a : attended) {
    longest = std::max(longest, a.hi - a.lo);
    end = std::max(end, a.hi);
  }
  const int64_t fill = longest <= policy.short_request ? policy.fill_short : policy.fill;
  if (batch >= fill || longest <= policy.min_chunk) return 0;
  auto items = [&](int64_t chunk) {
    int64_t n = 0;
    for (const Attended& a : attended) n += NumChunks(a, chunk);
    return n;
  };
  const int64_t unit = policy.chunk_unit;
  int64_t k_lo = (policy.min_chunk + unit - 1) / unit, k_hi = std::max<int64_t>((end + unit - 1) / unit, 1);
  while (k_lo < k_hi) {
    const int64_t mid = (k_lo + k_hi) / 2;
    if (items(mid * unit) <= fill) {
      k_hi = mid;
    } else {
      k_lo = mid + 1;
    }
  }
  return k_hi * unit;
}

struct WorkItem {
  int32_t request, kv_begin, kv_end, slot;  // slot -1: the request's only item, written in place
};

struct DecodePartition {
  std::vector<WorkItem> items;  // longest first; ties in request order
  std::vector<int32_t> first_partial, num_partials;  // a request's slots: -1 and 0 where unsplit
  int64_t num_slots = 0;
  int64_t chunk = 0;
  int64_t max_partials = 0;  // the most items a request has
};

// The items of a batch under `chunk` (ChooseChunk). Items are ordered longest first, so that the
// tail of a ragged batch starts early; a request's items depend on the request and the chunk
// alone (chunk boundaries at multiples of it), which batch-invariant serving relies on.
inline DecodePartition PartitionDecode(const std::vector<Attended>& attended, int64_t chunk) {
  DecodePartition p;
  p.chunk = chunk;
  const int64_t batch = static_cast<int64_t>(attended.size());
  p.first_partial.assign(batch, -1);
  p.num_partials.assign(batch, 0);
  p.items.reserve(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const Attended a = attended[b];
    const int64_t n = NumChunks(a, chunk);
    if (n == 1) {
      p.items.push_back({int32_t(b), int32_t(a.lo), int32_t(a.hi), -1});
      continue;
    }
    const int64_t first = a.lo / chunk;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t begin = std::max(a.lo, (first + i) * chunk), end = std::min(a.hi, (first + i + 1) * chunk);
      p.items.push_back({int32_t(b), int32_t(begin), int32_t(end), int32_t(p.num_slots + i)});
    }
    p.first_partial[b] = int32_t(p.num_slots);
    p.num_partials[b] = int32_t(n);
    p.num_slots += n;
    p.max_partials = std::max(p.max_partials, n);
  }
  std::stable_sort(p.items.begin(), p.items.end(), [](const WorkItem& x, const WorkItem& y) {
    return x.kv_end - x.kv_begin > y.kv_end - y.kv_begin;
  });
  return p;
}

}  // namespace aotinfer
