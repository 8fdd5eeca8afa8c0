"""Batch prefill attention, with FlashInfer's API (module ``flashinfer.prefill``):
``BatchPrefillWithRaggedKVCacheWrapper`` (keys and values contiguous, e.g. a prompt's new tokens
against themselves), ``BatchPrefillWithPagedKVCacheWrapper`` (against a paged KV cache: prompts,
chunked prefill, appends) and ``single_prefill_with_kv_cache``.

Request ``i`` has queries ``q[qo_indptr[i]:qo_indptr[i + 1]]`` (``q_len`` tokens) and ``kv_len``
keys: ragged, rows ``kv_indptr[i]:kv_indptr[i + 1]`` of K and V; paged, pages
``paged_kv_indices[paged_kv_indptr[i]:paged_kv_indptr[i + 1]]`` holding ``page_size * (pages - 1)
+ last_page_len[i]`` tokens. Logits are ``sm_scale * q.k`` (optionally soft-capped, ``cap *
tanh(x / cap)``); ``causal`` is aligned to the end, as FlashInfer's: query ``t`` sees key ``j``
when ``j <= t + kv_len - q_len``; ``window_left >= 0`` also limits it to ``j >= t + kv_len - q_len
- window_left``. The softmax runs in float32 and the log-sum-exp returned is base 2
(``log2(sum(exp(logit)))``, FlashInfer's convention, which aotinfer.cascade merges). A query that
sees no key gives zeros and ``-inf`` (causal with ``q_len > kv_len``: the first queries).

The design choice, as in aotinfer.decode: ``plan`` makes every host decision and ``run`` none.
``plan`` reads the index arrays on the host, cuts each request's query rows into tiles (with
grouped-query attention the ``group`` query heads of a KV head are packed into the rows: row ``r``
is token ``r // group`` of head ``r % group``), splits the keys of long requests into chunks when
the tiles alone would leave the GPU idle, and writes two int32 tables into the workspace:

    requests  [batch, 8]      (q_begin, q_len, kv_offset, kv_len, first_partial, num_partials,
                              split_from, mask_begin)
                              kv_offset: the first KV row (ragged) or page-table entry (paged);
                              mask_begin: the byte of the packed custom mask where the request's
                              bits start (0 without a mask);
                              num_partials > 1: split, query token t >= split_from has its
                              partial i at slot first_partial + t * num_partials + i (the tokens
                              before split_from are whole: a lone request's last tiles alone are
                              split, ``tiles_to_halve``)
    work      [1 + items, 8]  row 0: (items, heads, grouped, 0, ...); then (request, row_begin,
                              kv_begin, kv_end, chunk, 0, 0, 0) an item, the most costly first;
                              request -1: idle; heads: how many KV heads the blocks starting
                              together share, so that their K and V stay in L2
                              (``heads_sharing_l2``), for the first ``grouped`` items (0: all);
                              the rest, the shortest, go with every head at once
                              (``items_in_head_groups``)

``run`` only launches the kernel (a CTA per item and KV head) and, when something was split, the
merge of the partials, so a CUDA graph can capture it.

Two kernels read these tables: prefill.cuh's, on mma.sync for every arch from sm80 (two CTAs an
SM), and prefill_sm90.cuh's for Hopper, on warpgroup MMA with a producer warpgroup (one CTA an
SM; head_dim 64, 128 and 256, K and V of q's dtype). ``plan`` picks one by FlashInfer's backend
names (``use_sm90``): ``"fa3"`` asks for Hopper's, ``"auto"`` takes it on compute capability 9.0
where it applies, the others take the first.

FlashInfer behaviours followed, and the decisions they settle:

- ``plan`` copies ``qo_indptr``, the KV ``indptr`` and ``last_page_len`` to the host (a
  synchronization when they are on the GPU, as in FlashInfer) and leaves the page indices on the
  GPU (copied into the caller's buffer under ``use_cuda_graph``).
- ``causal`` with ``q_len > kv_len``: the batch wrappers run it (the first ``q_len - kv_len``
  queries see nothing); ``single_prefill_with_kv_cache`` refuses it, as FlashInfer's does.
- ``forward`` (deprecated) takes ``causal``, ``window_left``, ``logits_soft_cap`` and ``sm_scale``
  and keeps them for later calls, as FlashInfer's does (SGLang passes them there); the plan does
  not depend on them.
- ``custom_mask`` (bool, each request's ``[qo_len, kv_len]`` flattened, one after another) or
  ``packed_custom_mask`` (those bits packed little-endian a request at a time, each request's
  segment starting at a byte: what ``segment_packbits(..., bitorder="little")`` makes) replace
  ``causal``; a window still applies. A query that sees no key gets a zero output and an LSE of
  -inf, as FlashInfer's kernels give. Under ``use_cuda_graph`` the wrapper's ``custom_mask_buf``
  holds the packed mask (and ``mask_indptr_buf`` the segments' byte offsets), filled by ``plan``.
  The sm80-class kernel applies masks, in a kernel of its own (the unmasked kernels keep their
  registers); ``backend="fa3"`` with a mask raises NotImplementedError and ``"auto"`` takes the
  sm80-class kernel for it. Masks with fp8 KV caches raise NotImplementedError.
- DeepSeek's head dims, ``head_dim_qk=192`` with ``head_dim_vo=128`` (q and k 192 wide, v and the
  output 128), run on both kernels with K and V of q's dtype; any other ``head_dim_vo !=
  head_dim_qk`` is a ValueError.
- Position encodings other than ``"NONE"``, ``use_fp16_qk_reduction=True`` and fp8 K and V outside
  a paged cache (the ragged wrapper's ``kv_data_type``, an fp8 ``k`` given to
  ``single_prefill_with_kv_cache``) raise NotImplementedError naming the argument; they are never
  ignored.
- The paged wrapper takes fp8 caches (``kv_data_type`` float8_e4m3fn or float8_e5m2; q float16
  or bfloat16, the output q's dtype): the kernel widens them to float16, which holds every fp8
  value exactly, and runs the tensor cores in float16; a bfloat16 q is converted to float16 once,
  clamped to +-65504 (P is float16 there too, with more mantissa than bfloat16).
- ``k_scale`` (and ``q_scale``) multiply ``sm_scale``; ``v_scale`` multiplies the output, in the
  kernel's epilogue (any cache dtype); the log-sum-exp is that of the logits alone.
- Sinks (``run(sinks=...)`` of the paged wrapper, float32 per query head) are natural-log logits
  added once to each query's softmax denominator; the log-sum-exp includes them.
- ``fixed_split_size`` is in pages (tokens for ragged KV); ``disable_split_kv=True`` gives each
  query tile one item (batch-invariant, deterministic output).
"""

from __future__ import annotations

import math

from . import _loader
from ._attention import (
    FP8_DTYPES,
    AttentionWrapper,
    check_backend,
    check_dtypes,
    check_head_dim,
    check_heads,
    check_int32,
    check_kv_layout,
    check_optional_reals,
    check_options,
    check_pos_encoding_mode,
    check_rope_options,
    check_rope_supported,
    check_soft_cap,
    check_window_left,
    device_property,
    fixed_split,
    host_binding,
    last_page_len_of,
    num_chunks,
    num_sms,
    rope_arguments,
    smallest_chunk,
)
from ._kernels import kernel
from ._workspace import _aligned
from .api_logging import aotinfer_api
from .trace.template import dtype_name
from .trace.templates.prefill import single_prefill_with_kv_cache_trace
from .utils import check_enable_pdl, check_int, check_real, check_tensor

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, List, Optional, Tuple, Union

    import torch

_batch_prefill = kernel("prefill", "batch_prefill")
# Hopper's kernel (prefill_sm90.cuh: wgmma, a producer warpgroup), the same tables and signature.
_batch_prefill_sm90 = kernel("prefill_sm90", "batch_prefill_sm90")

_CTAS_PER_SM = 2  # 96 KB of shared memory a CTA: two fit an SM of sm80/sm90/sm100
_SM90_CTAS_PER_SM = 1  # up to 225 KB and 384 threads
DEEPSEEK_HEAD_DIMS = (192, 128)  # (q and k, v and out): the other pair both kernels take
_SM90_HEAD_DIMS = (64, 128, 256, DEEPSEEK_HEAD_DIMS[0])
_GRAPH_WORK_ROWS = 1 << 16  # work items a CUDA graph's plan may have
_WORK_WIDTH = 8
# Keys below which a lone request's last tiles are never halved (tiles_to_halve): shorter items
# gain less than the merge costs.
_HALVED_KEYS = 4096
_CPU_L2_BYTES = 50 << 20  # plans made for a CPU device (tests): an H100's


def tile_rows(head_dim_vo: int, sm90: bool = False) -> int:
    """Query rows (tokens x packed heads) a CTA takes: the kernel's kTileQ (prefill.cuh's, set by
    v's head_dim, or prefill_sm90.cuh's with ``sm90``: 64 rows a consumer warpgroup, three groups
    at head_dim 64 and 128, two at 256)."""
    head_dim = head_dim_vo
    if sm90:
        return 128 if head_dim == 256 else 192
    return 128 if head_dim <= 128 else 64


def use_sm90(backend: str, device: Any, head_dim: int, q_dtype: Any, kv_dtype: Any, masked: bool = False,
             rope: bool = False) -> bool:  # fmt: skip
    """Whether the Hopper kernel runs: ``backend="fa3"`` (FlashInfer's name for its Hopper
    backend), or ``"auto"`` on a GPU of compute capability 9.0 where the kernel takes the shapes
    (head_dim 64, 128, 256 or 192, K and V of q's dtype, no custom mask: ``masked``, no RoPE inside
    the kernel: ``rope``, which FlashInfer's "auto" also gives to its fa2 kernel); every other case
    runs the kernel of every arch."""
    import torch

    if backend == "fa3" and masked:
        raise NotImplementedError("custom masks on backend='fa3' are not implemented yet: use backend='auto' or 'fa2'")
    if backend == "fa3" and rope:
        raise NotImplementedError("pos_encoding_mode='ROPE_LLAMA' on backend='fa3' is not implemented (nor is it "
                                  "FlashInfer's): use backend='auto' or 'fa2'")
    if backend not in ("auto", "fa3") or masked or rope:
        return False
    # None off a GPU, and for fake CUDA tensors where torch has no CUDA (a tracer's, which records
    # the choice of "auto" made here); the loader's capability, asked once a device.
    cc = _loader.device_capability(device.index) if device.type == "cuda" and torch.cuda.is_available() else None
    fits = head_dim in _SM90_HEAD_DIMS and kv_dtype == q_dtype
    if backend == "fa3":
        if cc != (9, 0):
            raise ValueError(
                f"backend='fa3' runs on GPUs of compute capability 9.0 (Hopper), got {'a CPU' if cc is None else cc} "
                f"for {device}: use backend='auto' or 'fa2'"
            )
        if not fits:
            raise NotImplementedError(
                f"backend='fa3' takes head_dim 64, 128, 256 or 192 and K and V of q's dtype, got head_dim {head_dim} and "
                f"{dtype_name(kv_dtype)} K and V with {dtype_name(q_dtype)} q: use backend='auto' or 'fa2'"
            )
    return cc == (9, 0) and fits


# ---- argument checks (what the binding cannot name) --------------------------------------------


def _check_mask_forms(custom_mask: Any, packed_custom_mask: Any) -> None:
    import torch

    if custom_mask is not None and packed_custom_mask is not None:
        raise ValueError("Expected custom_mask or packed_custom_mask, got both: pass one")
    if custom_mask is not None:
        check_tensor(custom_mask, "custom_mask")
        if custom_mask.dtype != torch.bool:
            raise TypeError(f"Expected custom_mask to have dtype torch.bool, got {custom_mask.dtype}")
    if packed_custom_mask is not None:
        check_tensor(packed_custom_mask, "packed_custom_mask")
        if packed_custom_mask.dtype != torch.uint8:
            raise TypeError(f"Expected packed_custom_mask to have dtype torch.uint8, got {packed_custom_mask.dtype}")


def _packed_mask(custom_mask: Any, packed_custom_mask: Any, q_len: Any, kv_len: Any):
    """The requests' masks as the kernel reads them: uint8 bits, little-endian within a byte, a
    segment a request (request i's query t sees key j where bit t * kv_len + j of its segment is
    set), each starting at a byte; and the segments' byte offsets, int64 ``[batch + 1]`` on the
    host. ``custom_mask``: bool, request i's ``q_len[i] * kv_len[i]`` values one after another
    (FlashInfer's flattened form); ``packed_custom_mask``: those segments packed already, as
    ``segment_packbits(custom_mask, ..., bitorder="little")`` makes them."""
    import torch

    from .quantization import segment_packbits

    bits = q_len * kv_len
    begin = torch.zeros(bits.numel() + 1, dtype=torch.int64)
    torch.cumsum((bits + 7) // 8, 0, out=begin[1:])
    total_bytes = int(begin[-1])
    if total_bytes >= 1 << 31:
        raise ValueError(f"Expected custom masks of less than 2^31 bytes packed, these take {total_bytes}")
    if custom_mask is not None:
        total_bits = int(bits.sum())
        if custom_mask.numel() != total_bits:
            raise ValueError(
                f"Expected custom_mask to hold sum(qo_len * kv_len) = {total_bits} values (each request's "
                f"[qo_len, kv_len] mask, flattened, one after another), got {custom_mask.numel()}"
            )
        bit_begin = torch.zeros_like(begin)
        torch.cumsum(bits, 0, out=bit_begin[1:])
        packed, _ = segment_packbits(custom_mask.reshape(-1), bit_begin.to(custom_mask.device), bitorder="little")
        return packed, begin
    if packed_custom_mask.numel() < total_bytes:
        raise ValueError(
            f"Expected packed_custom_mask to hold the requests' packed masks, {total_bytes} bytes (each request's "
            f"qo_len * kv_len bits rounded up to whole bytes), got {packed_custom_mask.numel()}"
        )
    return packed_custom_mask.reshape(-1), begin


def head_dim_of_v(head_dim_qk: Any, head_dim_vo: Any) -> int:
    """v's (and the output's) head_dim, checked: ``head_dim_qk`` (None: the same) of 64, 128 or
    256, or DeepSeek's pair, 192 with 128."""
    if head_dim_qk == DEEPSEEK_HEAD_DIMS[0]:
        check_int(head_dim_qk, "head_dim_qk", 1)
        if head_dim_vo != DEEPSEEK_HEAD_DIMS[1]:
            raise ValueError(f"Expected head_dim_vo {DEEPSEEK_HEAD_DIMS[1]} with head_dim_qk {head_dim_qk}, got {head_dim_vo}")
        return head_dim_vo
    check_head_dim(head_dim_qk)
    if head_dim_vo is not None:
        check_int(head_dim_vo, "head_dim_vo", 1)
        if head_dim_vo != head_dim_qk:
            raise ValueError(
                f"Expected head_dim_vo equal to head_dim_qk {head_dim_qk} (or 128 with head_dim_qk 192), got {head_dim_vo}"
            )
    return head_dim_qk


def _check_plan_options(head_dim_qk, head_dim_vo, use_fp16_qk_reduction, fixed_split_size) -> None:
    head_dim_of_v(head_dim_qk, head_dim_vo)
    fixed_split(fixed_split_size)
    if use_fp16_qk_reduction:
        raise NotImplementedError("use_fp16_qk_reduction=True is not implemented: q.k is reduced in float32")


def _request_lengths(qo_indptr: Any, kv_indptr: Any, kv_indptr_name: str, device: Any, last_page_len: Any = None,
                     seq_lens: Any = None, page_size: int = 0, num_indices: int = -1):
    """int64 ``[4, batch]`` on the host, each request's q_begin, q_len, kv_offset and kv_len,
    from the int32 indptrs (``kv_indptr`` in key rows where ``page_size`` is 0, else in pages with
    ``last_page_len`` or ``seq_lens``), checked in compiled code (prefill_lengths in
    csrc/prefill.cu: the errors name the first bad entry); and the indptrs' last entries."""
    import torch

    check_int32(qo_indptr, "qo_indptr")
    check_int32(kv_indptr, kv_indptr_name)
    if qo_indptr.dim() != 1 or qo_indptr.numel() < 1:
        raise ValueError(f"Expected qo_indptr to have batch_size + 1 elements, got shape {list(qo_indptr.shape)}")
    qo_host, kv_host = qo_indptr.to("cpu").contiguous(), kv_indptr.to("cpu").contiguous()
    lengths = torch.empty(4, qo_host.numel() - 1, dtype=torch.int64)
    no_table = _no_table()
    has_seq_lens = seq_lens is not None
    if has_seq_lens:
        check_tensor(seq_lens, "seq_lens")
        seq_lens = seq_lens.to("cpu", torch.int64).reshape(-1).contiguous()
    elif last_page_len is not None:
        last_page_len = last_page_len.to("cpu").contiguous()
    host_binding("prefill", "prefill_lengths", device)(
        lengths, qo_host, kv_host, no_table if last_page_len is None else last_page_len,
        seq_lens if has_seq_lens else no_table, has_seq_lens, page_size, num_indices, kv_indptr_name,
    )  # fmt: skip
    return lengths, int(qo_host[-1]), int(kv_host[-1])


_NO_TABLE: List[Any] = []


def _no_table() -> "torch.Tensor":
    """An int32 host tensor of no elements: a table left out (made once)."""
    if not _NO_TABLE:
        import torch

        _NO_TABLE.append(torch.empty(0, dtype=torch.int32))
    return _NO_TABLE[0]


# ---- the work partition (host only) ------------------------------------------------------------


def keys_attended(t0: int, t1: int, kv_begin: int, kv_end: int, delta: int, causal: bool, window_left: int):
    """The keys (first, end) that query tokens t0..t1 of a request (kv_len - q_len = ``delta``)
    attend among kv_begin..kv_end - 1: the causal diagonal of t1, the window of t0."""
    lo, hi = kv_begin, kv_end
    if causal:
        hi = min(hi, t1 + delta + 1)
    if window_left >= 0:
        lo = max(lo, t0 + delta - window_left)
    return lo, hi


class PrefillPartition:
    """The int32 tables a plan writes for the kernel (on the host), and what sized them."""

    __slots__ = ("work", "requests", "num_items", "num_slots", "chunk", "span_table", "halves", "merge_from", "work_offset")

    def __init__(self, work, requests, num_items, num_slots, chunk, span_table, halves, merge_from, work_offset):
        self.work = work  # [1 + items, 8]: the count row (heads, grouped: set by plan), then (request, row_begin, kv_begin, kv_end, chunk, 0, 0, 0)
        self.span_table = span_table  # int64 [items, 3]: each item's (request, first key, end key) attended, in the work table's order
        self.halves = halves  # the last items: halves of a lone request's last tiles (tiles_to_halve)
        self.merge_from = merge_from  # the first query token (of the batch) with partials to merge; -1: none
        self.requests = requests  # [batch, 8]: (q_begin, q_len, kv_offset, kv_len, first_partial, num_partials, split_from, mask_begin)
        self.num_items = num_items
        self.num_slots = num_slots  # partial results written (query tokens x chunks of split requests)
        self.chunk = chunk  # KV tokens per chunk; 0: nothing split
        self.work_offset = work_offset  # bytes from the requests' first row to the work table's (both in one buffer)

    @property
    def spans(self) -> List[Tuple[int, int, int]]:
        """``span_table`` as tuples (made when asked: thousands of tuples cost milliseconds)."""
        return [tuple(span) for span in self.span_table.tolist()]


def partition_prefill(
    q_begin: List[int],
    q_len: List[int],
    kv_offset: List[int],
    kv_len: List[int],
    *,
    group: int,
    head_dim: int,
    num_kv_heads: int,
    num_sms: int,
    page_size: int = 1,
    causal: bool = False,
    window_left: int = -1,
    disable_split_kv: bool = False,
    fixed_split_size: Optional[int] = None,
    ctas_per_sm: int = _CTAS_PER_SM,
    rows_per_tile: Optional[int] = None,
    last_wave_slots: int = 0,
    planner: Any = None,
    staging: Any = None,
    spans: Any = None,
) -> PrefillPartition:
    """Cut each request's query rows into tiles and, where the tiles leave the GPU idle, its keys
    into chunks (see the module doc). The chunk size: ``disable_split_kv``: none;
    ``fixed_split_size``: that many pages (chunks from position 0, so a request's output depends on
    the request alone); otherwise none when the tiles fill the GPU (``ctas_per_sm`` blocks an
    SM), else the smallest (a multiple of 64 tokens and of the page size, at least 128) that keeps
    the items within it. Where the tiles fill the GPU but leave its last wave part full, a lone
    request under full attention has its last tiles' keys split in two (``tiles_to_halve``),
    within ``last_wave_slots`` partial slots (0: never). Items are ordered by their cost (rows x
    keys attended under ``causal`` and ``window_left``), most costly first: the tail of a ragged
    batch starts early. ``q_begin``, ``q_len``, ``kv_offset``, ``kv_len``: lists or int64 tensors;
    ``planner``: the device's plan_prefill (_attention.host_binding). ``staging``: uint8 host bytes
    to write the request rows and the work table into (at 0 and ``work_offset``); ``spans``: an
    int64 buffer of at least [items, 3] for the span table; both made here when None."""
    import torch

    i64 = torch.int64
    q_begin, q_len, kv_offset, kv_len = (torch.as_tensor(c, dtype=i64) for c in (q_begin, q_len, kv_offset, kv_len))
    q_len_list, kv_len_list = q_len.tolist(), kv_len.tolist()
    rows_per_tile = rows_per_tile or tile_rows(head_dim)
    tiles = [-(-q * group // rows_per_tile) for q in q_len_list]
    fill = max(1, -(-ctas_per_sm * num_sms // max(num_kv_heads, 1)))
    if disable_split_kv or (fixed_split_size is None and sum(tiles) >= fill):
        chunk = 0
    elif fixed_split_size is not None:
        chunk = fixed_split_size * page_size
    else:
        longest = max(kv_len_list) if kv_len_list else 0

        def count(c):
            return sum(t * num_chunks(0, k, c) for t, k in zip(tiles, kv_len_list))

        chunk = smallest_chunk(longest, longest, fill, page_size, count)
    split_from = [0] * len(q_len_list)  # a request's first token whose keys are split (those before are whole)
    if chunk == 0 and len(q_len_list) == 1 and not disable_split_kv and fixed_split_size is None:
        split_from[0], chunk = halving(q_len_list[0], kv_len_list[0], group, rows_per_tile, num_kv_heads, ctas_per_sm * num_sms,
                                       causal, window_left, page_size, last_wave_slots)

    # The request rows and the items (tiles x chunks, thousands for a large prefill) in compiled
    # host code (plan_prefill in csrc/prefill.cu, include/aotinfer/prefill_plan.h): plan's host
    # cost, docs/design/prefill.md#plan-host-cost. Room for the items there are without a
    # split_from (those with one have fewer).
    rows = sum(t * (num_chunks(0, k, chunk) if chunk else 1) for t, k in zip(tiles, kv_len_list))
    batch = len(q_len_list)
    work_offset = _aligned(4 * _WORK_WIDTH * batch)
    need = work_offset + 4 * _WORK_WIDTH * (1 + rows)
    if staging is None:
        staging = torch.empty(need, dtype=torch.uint8)
    elif need > staging.numel():
        raise ValueError(
            f"The int workspace holds {staging.numel()} bytes of work tables, this plan needs {need}: give "
            "reset_workspace_buffer a larger int_workspace_buffer"
        )
    requests = staging[: work_offset].view(torch.int32)[: batch * _WORK_WIDTH].view(batch, _WORK_WIDTH)
    work = staging[work_offset:need].view(torch.int32).view(1 + rows, _WORK_WIDTH)
    if spans is None or spans.shape[0] < rows:
        spans = torch.empty(rows, 3, dtype=i64)
    facts = torch.empty(4, dtype=i64)
    (planner or host_binding("prefill", "plan_prefill", torch.device("cpu")))(
        work, requests, spans, facts, q_begin, q_len, kv_offset, kv_len, split_from[0] if split_from else 0,
        group, rows_per_tile, chunk, causal, window_left,
    )  # fmt: skip
    num_items, num_slots, merge_from, halves = facts.tolist()
    return PrefillPartition(work[: 1 + num_items], requests, num_items, num_slots, chunk, spans[:num_items], halves,
                            merge_from, work_offset)  # fmt: skip


def halving(q_len: int, kv_len: int, group: int, rows: int, heads: int, slots: int, causal: bool, window_left: int,
            page_size: int, room: int) -> Tuple[int, int]:
    """A lone request's (split_from, chunk): its tokens from split_from on (the last tiles of
    ``rows`` packed rows, ``tiles_to_halve``'s) have their keys cut into two chunks of ``chunk``
    (a multiple of 64 and of the page size), merged after; (0, 0): none. Only under full
    attention, with at least _HALVED_KEYS keys, a cut at a token and partials within ``room``
    slots."""
    if causal or window_left >= 0 or kv_len < _HALVED_KEYS:
        return 0, 0
    tiles = -(-q_len * group // rows)
    whole_rows = (tiles - tiles_to_halve(tiles, heads, slots)) * rows
    if whole_rows == tiles * rows or whole_rows % group or 2 * (q_len - whole_rows // group) > room:
        return 0, 0
    half, align = -(-kv_len // 2), math.lcm(64, page_size)
    chunk = -(-half // align) * align
    return (whole_rows // group, chunk) if chunk < kv_len else (0, 0)  # pages too large to halve the keys


def tiles_to_halve(tiles: int, heads: int, slots: int) -> int:
    """How many of a lone request's last tiles (``heads`` blocks each, ``slots`` blocks at once,
    each as long, taken in order) to split into two halves of their keys, taken after the whole
    ones, so that the blocks end soonest: full attention at 8192 tokens, 32 heads and 192-row
    tiles is 1376 blocks on 132 SMs, 10.4 waves that take 11; two tiles halved take 10.5. 0 where
    no split gains a quarter of a block's time (the merge costs a few microseconds)."""

    def waves(halved):
        full, rest = divmod(heads * (tiles - halved), slots)
        halves = 2 * heads * halved
        if rest:  # the slots the last whole blocks leave idle take two halves each
            full, halves = full + 1, max(halves - 2 * (slots - rest), 0)
        return full + 0.5 * -(-halves // slots)

    best = min(range(tiles + 1), key=lambda halved: (waves(halved), halved))
    return best if waves(0) - waves(best) >= 0.25 else 0


def heads_sharing_l2(num_kv_heads: int, kv_head_bytes: int, l2_bytes: int) -> int:
    """How many KV heads the blocks running at once work on (the kernels' BlockHeadAndItem): as
    many as have their keys and values (``kv_head_bytes`` each) in a third of the L2, at least
    one. Measured on the Hopper kernel (docs/design/prefill_sm90.md#heads-in-l2): all 32 heads of a causal 8192-token
    prefill at once read K and V from memory; one or two at a time leave the last heads' costly
    items running alone at the end; four (a third of an H200's L2) did best."""
    return max(1, min(num_kv_heads, l2_bytes // 3 // max(kv_head_bytes, 1)))


def items_in_head_groups(spans: List[Tuple[int, int, int]], num_kv_heads: int, key_bytes: int, l2_bytes: int) -> int:
    """How many of the plan's items (most costly first) the blocks take a few heads at a time
    (``heads_sharing_l2``); the rest, the shortest, go with every head at once: as many as read
    keys that, for every head (``key_bytes`` a key and head, K and V), fit in a third of the L2
    together. ``spans``: each item's (request, first key, end key), in the plan's order. A
    causal 8192-token prefill with 32 KV heads: in head groups alone, the last group's costly
    items start late and leave SMs idle at the end (3% by a model of the schedule), which its 6
    shortest items of every head, run last, fill."""
    budget = l2_bytes // 3 // max(num_kv_heads * key_bytes, 1)  # keys
    tail, keys, hulls = 0, 0, {}
    for request, lo, hi in _from_the_end(spans):
        old = hulls.get(request)
        new = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
        keys += (new[1] - new[0]) - (0 if old is None else old[1] - old[0])
        if keys > budget:
            break
        hulls[request] = new
        tail += 1
    return len(spans) - tail


def _from_the_end(spans: Any):
    """The spans, last first: a span table (int64 [items, 3]) is read in blocks from its end, since
    the walk above stops after the few shortest items (a list of thousands costs milliseconds)."""
    if isinstance(spans, list):
        yield from reversed(spans)
        return
    end = spans.shape[0]
    while end > 0:
        begin = max(end - 64, 0)
        yield from reversed(spans[begin:end].tolist())
        end = begin


def _head_schedule(sm90: bool, num_kv_heads: int, kv_tokens: int, spans, kv_dims: int, kv_itemsize: int, device,
                   halves: int = 0):
    """The (heads, grouped) of the work table's first row: Hopper's kernel (one block an SM)
    takes the heads a few at a time (``heads_sharing_l2``) and the shortest items with every
    head (``items_in_head_groups``), the last ``halves`` items (``tiles_to_halve``'s) always so.
    The first kernel, two blocks an SM, lost up to 12% so (its causal d64 prefill, 32 heads) and
    keeps them all together while at least 4 of its blocks running at once share a head's keys;
    past that (above 66 KV heads on 132 SMs) too few blocks read each head's keys while they are
    in L2, and it takes them as Hopper's does (docs/design/prefill.md#many-heads).
    ``spans``: as ``items_in_head_groups``; ``kv_dims``: K's head_dim and V's together."""
    if not sm90 and 4 * num_kv_heads <= _CTAS_PER_SM * num_sms(device):
        return num_kv_heads, 0
    l2_bytes = device_property(device, "L2_cache_size", _CPU_L2_BYTES)
    key_bytes = kv_dims * kv_itemsize
    heads = heads_sharing_l2(num_kv_heads, kv_tokens * key_bytes, l2_bytes)
    if heads == num_kv_heads:
        return heads, 0
    return heads, min(items_in_head_groups(spans, num_kv_heads, key_bytes, l2_bytes), len(spans) - halves)


# ---- the wrappers ------------------------------------------------------------------------------


class _Plan:
    """What plan decided, for run: the tables on the device and the shapes they were made for."""

    __slots__ = (
        "batch_size", "total_q", "total_kv", "num_qo_heads", "num_kv_heads", "head_dim", "head_dim_vo", "page_size", "q_dtype",
        "kv_dtype",
        "work", "requests", "indices", "partial_out", "partial_lse", "merge_from", "ctas", "empty", "partition", "binding",
        "mask",
    )  # fmt: skip


def _run_prefill(wrapper, plan: _Plan, q, k, v, kv_layout_code, out, lse, return_lse, enable_pdl, sinks, sm_scale, v_scale):
    """The launch both wrappers' ``run`` make, through the binding the plan chose."""
    import torch

    if out is None:
        out = torch.empty((*q.shape[:2], plan.head_dim_vo), dtype=q.dtype, device=wrapper.device)
    if lse is None and return_lse:
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=wrapper.device)
    sm90 = plan.binding is _batch_prefill_sm90
    if sm90 and wrapper._rope_arguments[0]:  # forward's options, after a plan without them
        raise NotImplementedError("pos_encoding_mode='ROPE_LLAMA' on the Hopper kernel that this plan chose: plan "
                                  "with pos_encoding_mode='ROPE_LLAMA'")
    plan.binding(
        out,
        plan.empty if lse is None else lse,
        plan.partial_out,
        plan.partial_lse,
        q,
        k,
        v,
        plan.indices,
        plan.work,
        plan.requests,
        plan.empty if sinks is None else sinks,
        *(() if sm90 else (plan.empty if plan.mask is None else plan.mask,)),
        wrapper._captured_address,
        kv_layout_code,
        sm_scale,
        wrapper._logits_soft_cap or 0.0,
        wrapper._window_left,
        *(() if sm90 else wrapper._rope_arguments),
        1.0 if v_scale is None else v_scale,
        wrapper._causal,
        plan.ctas,
        plan.merge_from,
        -1 if enable_pdl is None else enable_pdl,
    )
    return (out, lse) if return_lse else out


def _check_run_common(wrapper, q, enable_pdl) -> None:
    check_enable_pdl(enable_pdl)
    plan = wrapper._plan
    if plan is None:
        return  # run says it
    check_tensor(q, "q")
    if q.dim() != 3 or q.shape[1] != plan.num_qo_heads or q.shape[2] != plan.head_dim or q.shape[0] < plan.total_q:
        raise ValueError(
            f"Expected q to have shape [at least qo_indptr[-1] = {plan.total_q}, num_qo_heads = {plan.num_qo_heads}, "
            f"head_dim = {plan.head_dim}] as planned, got {list(q.shape)}"
        )
    if q.dtype != plan.q_dtype:
        raise ValueError(f"The dtype of q {q.dtype} does not match the q_data_type {plan.q_dtype} specified in plan")


class _BatchPrefillWrapper(AttentionWrapper):
    """What the ragged and paged wrappers share beyond AttentionWrapper: custom masks, causal
    among the options, the partition and the tables."""

    def _init_common(self, float_workspace_buffer, kv_layout, use_cuda_graph, backend, custom_mask_buf, mask_indptr_buf):
        import torch

        self._init_wrapper(float_workspace_buffer, kv_layout, use_cuda_graph, backend)
        self._spans: Optional[torch.Tensor] = None  # the span tables of plans, kept from plan to plan
        # Under use_cuda_graph, where plan puts the packed mask and its segments' byte offsets
        # (a captured run reads the mask there); else what the last plan used, as FlashInfer's.
        if custom_mask_buf is not None:
            check_tensor(custom_mask_buf, "custom_mask_buf")
            if custom_mask_buf.dtype != torch.uint8 or custom_mask_buf.dim() != 1 or custom_mask_buf.device != self.device:
                raise ValueError(
                    f"Expected custom_mask_buf to be a 1-D uint8 tensor on {self.device}, got {custom_mask_buf.dtype} "
                    f"{list(custom_mask_buf.shape)} on {custom_mask_buf.device}"
                )
        if mask_indptr_buf is not None:
            check_int32(mask_indptr_buf, "mask_indptr_buf")
        self._custom_mask_buf = custom_mask_buf
        self._mask_indptr_buf = mask_indptr_buf

    def _tile_rows(self, head_dim_vo: int, sm90: bool) -> int:
        """Query rows a block of this wrapper's kernel takes (tile_rows; MLA's wrapper has its own)."""
        return tile_rows(head_dim_vo, sm90)

    def _plan_common(
        self, lengths, total_q, num_qo_heads, num_kv_heads, head_dim, head_dim_vo, page_size, causal, pos_encoding_mode,
        window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, q_dtype, kv_dtype, fixed_split_size,
        disable_split_kv, non_blocking, indices, total_kv, custom_mask=None, packed_custom_mask=None,
    ) -> None:  # fmt: skip
        """``lengths``, ``total_q``: _request_lengths'. ``head_dim``: q's and k's, ``head_dim_vo``:
        v's and the output's."""
        import torch

        fixed_split_size = fixed_split(fixed_split_size)  # None where <= 0, as FlashInfer reads it

        batch = lengths.shape[1]
        q_begin, q_len, kv_offset, kv_len = lengths
        if self._use_cuda_graph and batch != self._fixed_batch_size:
            raise ValueError(
                f"The batch size is fixed under use_cuda_graph: got {batch}, the buffers given to the wrapper hold "
                f"{self._fixed_batch_size}"
            )
        masked = custom_mask is not None or packed_custom_mask is not None
        if head_dim_vo != head_dim and kv_dtype != q_dtype:
            raise NotImplementedError(
                f"a {dtype_name(kv_dtype)} KV cache with head_dim_qk {head_dim} and head_dim_vo {head_dim_vo} is not "
                "implemented: K and V of q's dtype take them"
            )
        if masked and kv_dtype != q_dtype:
            raise NotImplementedError(
                f"custom masks with a {dtype_name(kv_dtype)} KV cache are not implemented: K and V of q's dtype take them"
            )
        if masked:
            mask, mask_begin = _packed_mask(custom_mask, packed_custom_mask, q_len, kv_len)
            if self._use_cuda_graph and (self._custom_mask_buf is None or self._custom_mask_buf.numel() < int(mask_begin[-1])):
                raise ValueError(
                    f"Expected custom_mask_buf of at least {int(mask_begin[-1])} bytes (the packed masks) under "
                    f"use_cuda_graph, got {None if self._custom_mask_buf is None else self._custom_mask_buf.numel()}"
                )
        elif self._use_cuda_graph and self._custom_mask_buf is not None:
            raise ValueError(
                "This wrapper was made with custom_mask_buf under use_cuda_graph: a captured run reads a mask, so "
                "every plan takes custom_mask or packed_custom_mask"
            )
        causal = causal and not masked  # a custom mask replaces causal (FlashInfer's mask modes)
        check_rope_supported(pos_encoding_mode, q_dtype, kv_dtype, head_dim, head_dim_vo)
        sm90 = use_sm90(self._backend, self.device, head_dim, q_dtype, kv_dtype, masked, pos_encoding_mode == "ROPE_LLAMA")
        ctas_per_sm = _SM90_CTAS_PER_SM if sm90 else _CTAS_PER_SM
        staging = self._staging()
        most_items = self._table_bytes() // (4 * _WORK_WIDTH)  # what the staging half holds
        if self._spans is None or self._spans.shape[0] < most_items:
            self._spans = torch.empty(most_items, 3, dtype=torch.int64)
        partition = partition_prefill(
            q_begin, q_len, kv_offset, kv_len,
            group=num_qo_heads // num_kv_heads, head_dim=head_dim, num_kv_heads=num_kv_heads,
            num_sms=num_sms(self.device), page_size=page_size, causal=causal, window_left=window_left,
            disable_split_kv=disable_split_kv, fixed_split_size=fixed_split_size, ctas_per_sm=ctas_per_sm,
            rows_per_tile=self._tile_rows(head_dim_vo, sm90),
            # Hopper's kernel, one block an SM; a CUDA graph's fixed grid has blocks striding
            # over the items, no last wave.
            last_wave_slots=self._partial_capacity(num_qo_heads, head_dim_vo) if sm90 and not self._use_cuda_graph else 0,
            planner=host_binding("prefill", "plan_prefill", self.device), staging=staging, spans=self._spans,
        )  # fmt: skip
        if masked:
            partition.requests[:, 7] = mask_begin[:-1]  # each request's mask_begin (prefill.cuh)
        partition.work[0, 1], partition.work[0, 2] = _head_schedule(
            sm90, num_kv_heads, int(kv_len.sum()), partition.span_table, head_dim + head_dim_vo, kv_dtype.itemsize, self.device,
            partition.halves)  # fmt: skip

        # The partial results, the tables and the page ids on the device (what can fail first: a
        # plan that raises leaves the wrapper as it was). Under CUDA graphs every view keeps its
        # address and shape from plan to plan: the work table its capacity, the partials the
        # whole float workspace, the grid a fixed number of CTAs (items are taken in strides).
        plan = _Plan()
        if self._use_cuda_graph:
            capacity = min(_GRAPH_WORK_ROWS, self._table_bytes() // (4 * _WORK_WIDTH) - batch - 1)
            if partition.num_items > capacity:
                raise ValueError(
                    f"this plan needs {partition.num_items} work items, more than the {capacity} a CUDA graph's plan "
                    "holds: use fewer tokens, a larger fixed_split_size or disable_split_kv=True"
                )
            slots = self._partial_capacity(num_qo_heads, head_dim_vo)
            if partition.num_slots > slots:
                raise ValueError(
                    f"float_workspace_buffer holds the partial results of {slots} (query token, chunk) pairs, this plan "
                    f"needs {partition.num_slots}: give the wrapper a larger one or pass disable_split_kv=True"
                )
            plan.ctas = max(1, -(-ctas_per_sm * num_sms(self.device) // num_kv_heads))
        else:
            capacity, slots = partition.num_items, partition.num_slots
            plan.ctas = partition.num_items
        plan.partial_out, plan.partial_lse = self._partial_views(slots, num_qo_heads, head_dim_vo)
        requests, work = self._upload(
            staging, partition.work_offset + partition.work.numel() * 4,
            [(0, tuple(partition.requests.shape)), (partition.work_offset, tuple(partition.work.shape))], non_blocking)
        if self._use_cuda_graph:
            begin = work.data_ptr() - self._int_bytes.data_ptr()
            work = self._int_bytes[begin : begin + (capacity + 1) * 4 * _WORK_WIDTH].view(torch.int32).view(-1, _WORK_WIDTH)
        plan.requests, plan.work = requests, work
        plan.indices = indices
        plan.binding = _batch_prefill_sm90 if sm90 else _batch_prefill
        plan.mask = None
        if self._use_cuda_graph and masked:
            plan.mask = self._custom_mask_buf
            if mask.data_ptr() != plan.mask.data_ptr():  # else packed there already (SGLang's fast plan)
                plan.mask[: mask.numel()].copy_(mask, non_blocking=non_blocking)
            if self._mask_indptr_buf is not None:
                self._mask_indptr_buf.copy_(mask_begin.to(torch.int32), non_blocking=non_blocking)
        elif not self._use_cuda_graph:
            plan.mask = mask.to(self.device, non_blocking=non_blocking) if masked else None
            self._custom_mask_buf = plan.mask
            self._mask_indptr_buf = mask_begin.to(self.device, torch.int32) if masked else None
        # The merge reads the query tokens from the first split one on (all under a CUDA graph, whose
        # replays may follow other plans); -1: none.
        plan.merge_from = 0 if self._use_cuda_graph else partition.merge_from
        plan.empty = self._empty_tensor()
        plan.partition = partition
        plan.batch_size, plan.total_q, plan.total_kv = batch, total_q, total_kv
        plan.num_qo_heads, plan.num_kv_heads, plan.head_dim = num_qo_heads, num_kv_heads, head_dim
        plan.head_dim_vo = head_dim_vo
        plan.page_size, plan.q_dtype, plan.kv_dtype = page_size, q_dtype, kv_dtype

        self._plan = plan
        self._causal = bool(causal)
        sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
        self._keep_options(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)

    def _set_forward_options(self, causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap,
                             sm_scale, rope_scale, rope_theta) -> None:  # fmt: skip
        """The options of the deprecated ``forward``: they replace the planned ones from now on."""
        if use_fp16_qk_reduction:
            raise NotImplementedError("use_fp16_qk_reduction=True is not implemented: q.k is reduced in float32")
        self._set_options(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)
        self._causal = bool(causal)


def _check_plan_scalars(num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, causal, pos_encoding_mode,
                        use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                        fixed_split_size, custom_mask, packed_custom_mask) -> None:  # fmt: skip
    _check_mask_forms(custom_mask, packed_custom_mask)
    check_options(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)
    check_heads(num_qo_heads, num_kv_heads)
    _check_plan_options(head_dim_qk, head_dim_vo, use_fp16_qk_reduction, fixed_split_size)
    if not isinstance(causal, bool):
        raise TypeError(f"Expected causal to be a bool, got {type(causal).__name__}")


def _check_ragged_run(self, q, k, v, enable_pdl) -> None:
    """What run's binding cannot name: enable_pdl, and q, k, v against the plan."""
    _check_run_common(self, q, enable_pdl)
    plan = self._plan
    if plan is not None:
        check_tensor(k, "k")
        check_tensor(v, "v")
        rows = k.shape[0 if self._kv_layout == "NHD" else 1] if k.dim() == 3 else None
        if rows is None or rows < plan.total_kv:
            layout = "[kv_tokens, num_kv_heads, head_dim]" if self._kv_layout == "NHD" else "[num_kv_heads, kv_tokens, head_dim]"
            raise ValueError(f"Expected k of shape {layout} with at least kv_indptr[-1] = {plan.total_kv} tokens, got {list(k.shape)}")
        if k.dtype != plan.q_dtype:
            raise ValueError(f"The dtype of k {k.dtype} does not match the kv_data_type {plan.q_dtype} specified in plan")


class _PagedPlanModule:
    """What a paged prefill wrapper's ``_cached_module`` is to SGLang's ``fast_prefill_plan`` (EAGLE
    draft extend, DFlash verification under CUDA graphs): it puts the page table in the wrapper's
    CUDA-graph buffers, calls ``_cached_module.plan`` with the host tables and the arguments of
    FlashInfer's fa2 (20) or fa3 (16) prefill planner, and sets the options on the wrapper. This
    plans the wrapper again: the page ids from ``_paged_kv_indices_buf``, the lengths from the
    host ``kv_len``, the dtypes, soft cap and scale of the last ``plan``, and, for a wrapper made
    with ``custom_mask_buf``, the masks SGLang packed there (tree verification)
    (docs/design/overlay.md#sglangs-flashinfer-backend)."""

    def __init__(self, wrapper: "BatchPrefillWithPagedKVCacheWrapper") -> None:
        self._wrapper = wrapper

    def plan(self, float_workspace_buffer, int_workspace_buffer, page_locked_int_workspace_buffer, qo_indptr, kv_indptr,
             kv_len, total_num_rows, batch_size, num_qo_heads, num_kv_heads, page_size, enable_cuda_graph, head_dim_qk,
             head_dim_vo, causal, window_left=-1, fixed_split_size=-1, disable_split_kv=False, num_colocated_ctas=0,
             uniform_q_len=0) -> list:  # fmt: skip
        import torch

        wrapper, last = self._wrapper, self._wrapper._plan
        if last is None:
            raise RuntimeError("_cached_module.plan keeps the dtypes of the last plan(): call plan() first")
        if wrapper._paged_kv_indices_buf is None:
            raise RuntimeError("_cached_module.plan reads the page ids from _paged_kv_indices_buf: set it")
        kv_indptr = kv_indptr.to("cpu")
        kv_len = kv_len.to("cpu", torch.int64).reshape(-1)
        last_page_len = last_page_len_of(kv_len, page_size)
        # A wrapper made with custom_mask_buf (EAGLE tree verification): SGLang has packed this
        # step's masks there, a request's segment from a byte of its own, as plan would.
        mask = wrapper._custom_mask_buf if wrapper._use_cuda_graph else None
        wrapper.plan(
            qo_indptr, kv_indptr, wrapper._paged_kv_indices_buf[: int(kv_indptr[-1])], last_page_len, num_qo_heads,
            num_kv_heads, head_dim_qk, page_size, head_dim_vo=head_dim_vo, packed_custom_mask=mask, causal=causal,
            window_left=window_left, logits_soft_cap=wrapper._logits_soft_cap, q_data_type=last.q_dtype,
            kv_data_type=last.kv_dtype, sm_scale=wrapper._sm_scale, seq_lens=kv_len, fixed_split_size=fixed_split_size,
            disable_split_kv=disable_split_kv,
        )  # fmt: skip
        return []  # FlashInfer's plan info: SGLang keeps it as _plan_info, and nothing here reads it


class BatchPrefillWithRaggedKVCacheWrapper(_BatchPrefillWrapper):
    r"""Prefill attention for a batch of requests whose keys and values are contiguous rows
    (FlashInfer's wrapper): ``plan`` once per batch with ``qo_indptr`` and ``kv_indptr``, then
    ``run`` once per layer. See the module doc for the math and how the work is split.

    >>> workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    >>> wrapper = aotinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
    >>> wrapper.plan(qo_indptr, kv_indptr, 32, 8, 128, causal=True, q_data_type=torch.bfloat16)
    >>> out = wrapper.run(q, k, v)  # q: [tokens, 32, 128]; k, v: [kv_tokens, 8, 128]
    """

    @aotinfer_api
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: Optional[torch.Tensor] = None,
        kv_indptr_buf: Optional[torch.Tensor] = None,
        custom_mask_buf: Optional[torch.Tensor] = None,
        mask_indptr_buf: Optional[torch.Tensor] = None,
        backend: str = "auto",
    ) -> None:
        r"""
        Parameters
        ----------
        float_workspace_buffer : torch.Tensor
            Holds the partial results of split sequences: a contiguous, 16-byte aligned buffer of
            any dtype on the GPU that runs (128 MB is plenty; ``plan`` says when it is too small).
        kv_layout : str
            ``"NHD"`` (K and V ``[kv_tokens, heads, dim]``) or ``"HND"`` (``[heads, kv_tokens, dim]``).
        use_cuda_graph : bool
            ``run`` launches a fixed grid over tables that keep their place: a captured ``run``
            replays correctly after ``plan`` with new lengths of the same batch size. Without it, a
            ``run`` captured into a graph replays right under its own plan, and the wrapper refuses
            a new ``plan`` (RuntimeError).
        qo_indptr_buf, kv_indptr_buf : torch.Tensor
            With ``use_cuda_graph``: int32 GPU buffers of ``batch_size + 1`` elements, which
            ``plan`` fills. The batch size is fixed by them.
        custom_mask_buf, mask_indptr_buf : torch.Tensor
            With ``use_cuda_graph`` and custom masks: a uint8 GPU buffer large enough for the packed
            masks of every plan (``plan`` copies them there; a captured ``run`` reads them there), and
            optionally an int32 ``[batch_size + 1]`` one that ``plan`` fills with their byte offsets.
            Given ``custom_mask_buf``, every plan takes a mask.
        backend : str
            FlashInfer's names: ``"fa3"`` runs the Hopper kernel (wgmma; compute capability 9.0,
            head_dim 64, 128, 256 or 192, K and V of q's dtype: else ValueError / NotImplementedError at
            ``plan``), ``"auto"`` runs it where it applies; ``"fa2"``, ``"trtllm-gen"`` and
            ``"cute-dsl"`` run the kernel of every arch from sm80.
        """
        self._init_common(float_workspace_buffer, kv_layout, use_cuda_graph, backend, custom_mask_buf, mask_indptr_buf)
        if self._use_cuda_graph:
            self._fix_batch_size({"qo_indptr_buf": qo_indptr_buf, "kv_indptr_buf": kv_indptr_buf}, "qo_indptr_buf")
        self._qo_indptr_buf = qo_indptr_buf
        self._kv_indptr_buf = kv_indptr_buf

    @aotinfer_api
    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        head_dim_vo: Optional[int] = None,
        custom_mask: Optional[torch.Tensor] = None,
        packed_custom_mask: Optional[torch.Tensor] = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        q_data_type: Union[str, torch.dtype] = "float16",
        kv_data_type: Optional[Union[str, torch.dtype]] = None,
        o_data_type: Optional[Union[str, torch.dtype]] = None,
        non_blocking: bool = True,
        fixed_split_size: Optional[int] = None,
        disable_split_kv: bool = False,
    ) -> None:
        r"""Plan prefill attention over contiguous K and V: read the lengths, split the work,
        write the tables.

        Parameters
        ----------
        qo_indptr : torch.Tensor
            int32 ``[batch_size + 1]``: request ``i``'s queries are ``q[qo_indptr[i]:qo_indptr[i + 1]]``.
        kv_indptr : torch.Tensor
            int32 ``[batch_size + 1]``: its keys and values are rows ``kv_indptr[i]:kv_indptr[i + 1]``.
        num_qo_heads, num_kv_heads : int
            Query and KV heads; ``num_qo_heads`` a multiple of ``num_kv_heads``.
        head_dim_qk : int
            64, 128, 256, or 192 (DeepSeek's, with ``head_dim_vo=128``).
        head_dim_vo : Optional[int]
            v's and the output's head_dim: None or ``head_dim_qk``, or 128 with 192.
        custom_mask : Optional[torch.Tensor]
            bool, each request's ``[qo_len, kv_len]`` mask (True: the query sees the key) flattened,
            one after another: ``sum(qo_len * kv_len)`` values. It replaces ``causal``; a window
            still applies.
        packed_custom_mask : Optional[torch.Tensor]
            uint8, the same masks packed: ``segment_packbits(custom_mask, ..., bitorder="little")``,
            each request's bits from a byte of its own. One of the two forms, or neither.
        causal : bool
            Causal mask aligned to the end (see the module doc).
        pos_encoding_mode : str
            ``"NONE"``, or ``"ROPE_LLAMA"``: each query (at ``kv_len - qo_len`` plus its index) and key
            (at its index) turned by RoPE inside the kernel of every arch, as FlashInfer's (``"auto"``
            takes that kernel; ``"fa3"`` raises NotImplementedError), K and V of q's dtype and one
            head dim. ``"ALIBI"`` raises NotImplementedError.
        use_fp16_qk_reduction : bool
            False (True raises NotImplementedError).
        window_left : int
            Sliding window: each query sees at most ``window_left + 1`` keys back; -1: all.
        logits_soft_cap : Optional[float]
            ``cap * tanh(logit / cap)`` on the scaled logits; None or 0: off.
        sm_scale : Optional[float]
            Logit scale; None: ``1 / sqrt(head_dim)``.
        rope_scale, rope_theta : Optional[float]
            ROPE_LLAMA's position scale and base; None: 1 and 1e4.
        q_data_type, kv_data_type, o_data_type : str or torch.dtype
            float16 (FlashInfer's default) or bfloat16; K, V and the output have q's dtype (fp8
            K and V: the paged wrapper; here NotImplementedError).
        non_blocking : bool
            Copy the tables to the GPU without waiting for the copy.
        fixed_split_size : Optional[int]
            Split every request's keys into chunks of this many tokens (batch-invariant output);
            None or <= 0 (vLLM passes -1): the plan splits as it sees fit.
        disable_split_kv : bool
            One item a query tile: deterministic, batch-invariant output (it wins
            over ``fixed_split_size``, as in FlashInfer).
        """
        self._check_not_captured()
        _check_plan_scalars(num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, causal, pos_encoding_mode,
                            use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                            fixed_split_size, custom_mask, packed_custom_mask)  # fmt: skip
        q_dtype, kv_dtype = check_dtypes(q_data_type, kv_data_type, o_data_type, fp8_kv=False)
        # Before any work that grows with the batch: the tables hold a row a request and the
        # count row (10^7 requests are refused at once).
        check_int32(qo_indptr, "qo_indptr")
        self._check_table_bytes(4 * _WORK_WIDTH * qo_indptr.numel(), f"a plan of {qo_indptr.numel() - 1} requests")
        lengths, total_q, total_kv = _request_lengths(qo_indptr, kv_indptr, "kv_indptr", self.device)
        self._plan_common(
            lengths, total_q, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_of_v(head_dim_qk, head_dim_vo), 1, causal,
            pos_encoding_mode,
            window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, q_dtype, kv_dtype, fixed_split_size,
            disable_split_kv, non_blocking, _empty_indices(self.device), total_kv, custom_mask, packed_custom_mask,
        )  # fmt: skip
        if self._use_cuda_graph:
            self._qo_indptr_buf.copy_(qo_indptr, non_blocking=non_blocking)
            self._kv_indptr_buf.copy_(kv_indptr, non_blocking=non_blocking)
        else:
            self._qo_indptr_buf, self._kv_indptr_buf = qo_indptr, kv_indptr

    begin_forward = plan

    @aotinfer_api
    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        return_lse: bool = False,
        enable_pdl: Optional[bool] = None,
        skip_check: bool = False,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        r"""Prefill attention of one layer with the planned lengths. Launches only.

        Parameters
        ----------
        q : torch.Tensor
            ``[qo_indptr[-1], num_qo_heads, head_dim]`` (more rows are left alone), the planned
            dtype; last dimension contiguous, rows on 16-byte boundaries.
        k, v : torch.Tensor
            ``[kv_indptr[-1], num_kv_heads, head_dim]`` (NHD) or ``[num_kv_heads, kv_indptr[-1],
            head_dim]`` (HND), q's dtype; strided views are fine (last dimension contiguous).
        out : Optional[torch.Tensor]
            Output of q's shape (with v's head_dim) and dtype; allocated when None.
        lse : Optional[torch.Tensor]
            float32 ``[q.shape[0], num_qo_heads]``, written when given; allocated when None and
            ``return_lse``.
        return_lse : bool
            Also return the log-sum-exp (base 2).
        enable_pdl : Optional[bool]
            Programmatic dependent launch: None where the GPU supports it.

        Returns
        -------
        torch.Tensor or Tuple[torch.Tensor, torch.Tensor]
            ``out``, or ``(out, lse)`` with ``return_lse``.
        """
        if not skip_check:
            _check_ragged_run(self, q, k, v, enable_pdl)
        plan = self._plan
        if plan is None:
            raise RuntimeError("BatchPrefillWithRaggedKVCacheWrapper.run: call plan() first")
        self._require_workspace_on(q.device)
        if self._kv_layout == "HND":
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        return _run_prefill(self, plan, q, k, v, 0, out, lse, return_lse, enable_pdl, None, self._sm_scale_for(plan.head_dim), None)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ) -> torch.Tensor:
        r"""Deprecated form of ``run`` (FlashInfer's): the attention options given here replace the
        planned ones, for this call and the ones after it."""
        self._set_forward_options(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale,
                                  rope_scale, rope_theta)
        return self.run(q, k, v)

    def forward_return_lse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        r"""Deprecated form of ``run_return_lse``, as ``forward``."""
        self._set_forward_options(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale,
                                  rope_scale, rope_theta)
        return self.run(q, k, v, return_lse=True)


def _empty_indices(device) -> "torch.Tensor":
    import torch

    return torch.empty(0, dtype=torch.int32, device=device)


def _check_paged_run(self, q, q_scale, k_scale, v_scale, enable_pdl, window_left) -> None:
    """What run's binding cannot name: the scalars, and q against the plan."""
    check_optional_reals(q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
    _check_run_common(self, q, enable_pdl)
    if window_left is not None:
        check_window_left(window_left)


class BatchPrefillWithPagedKVCacheWrapper(_BatchPrefillWrapper):
    r"""Prefill attention for a batch of requests against a paged KV cache (FlashInfer's
    wrapper): ``plan`` once per batch with the page table, then ``run`` once per layer. See the
    module doc for the math and how the work is split.

    >>> workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    >>> wrapper = aotinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    >>> wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16, causal=True,
    ...              q_data_type=torch.bfloat16)
    >>> out = wrapper.run(q, kv_cache)  # q: [tokens, 32, 128]
    """

    @aotinfer_api
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: Optional[torch.Tensor] = None,
        paged_kv_indptr_buf: Optional[torch.Tensor] = None,
        paged_kv_indices_buf: Optional[torch.Tensor] = None,
        paged_kv_last_page_len_buf: Optional[torch.Tensor] = None,
        custom_mask_buf: Optional[torch.Tensor] = None,
        mask_indptr_buf: Optional[torch.Tensor] = None,
        backend: str = "auto",
    ) -> None:
        r"""
        Parameters
        ----------
        float_workspace_buffer : torch.Tensor
            Holds the partial results of split sequences: a contiguous, 16-byte aligned buffer of
            any dtype on the GPU that runs (128 MB is plenty; ``plan`` says when it is too small).
        kv_layout : str
            ``"NHD"`` (``[pages, page_size, heads, dim]``) or ``"HND"`` (``[pages, heads, page_size, dim]``).
        use_cuda_graph : bool
            ``run`` reads the page ids from ``paged_kv_indices_buf``, which ``plan`` fills, and
            launches a fixed grid: a captured ``run`` replays correctly after ``plan`` with a new
            page table of the same batch size. Without it, a ``run`` captured into a graph replays
            right under its own plan, and the wrapper refuses a new ``plan`` (RuntimeError).
        qo_indptr_buf, paged_kv_indptr_buf, paged_kv_last_page_len_buf : torch.Tensor
            With ``use_cuda_graph``: int32 GPU buffers of ``batch_size + 1``, ``batch_size + 1``
            and ``batch_size`` elements. The batch size is fixed by them.
        paged_kv_indices_buf : torch.Tensor
            With ``use_cuda_graph``: int32 GPU buffer for the most page ids any plan uses.
        custom_mask_buf, mask_indptr_buf : torch.Tensor
            With ``use_cuda_graph`` and custom masks: a uint8 GPU buffer large enough for the packed
            masks of every plan (``plan`` copies them there; a captured ``run`` reads them there), and
            optionally an int32 ``[batch_size + 1]`` one that ``plan`` fills with their byte offsets.
            Given ``custom_mask_buf``, every plan takes a mask.
        backend : str
            FlashInfer's names: ``"fa3"`` runs the Hopper kernel (wgmma; compute capability 9.0,
            head_dim 64, 128, 256 or 192, K and V of q's dtype: else ValueError / NotImplementedError at
            ``plan``), ``"auto"`` runs it where it applies; ``"fa2"``, ``"trtllm-gen"`` and
            ``"cute-dsl"`` run the kernel of every arch from sm80.
        """
        self._init_common(float_workspace_buffer, kv_layout, use_cuda_graph, backend, custom_mask_buf, mask_indptr_buf)
        if self._use_cuda_graph:
            self._fix_batch_size({
                "qo_indptr_buf": qo_indptr_buf, "paged_kv_indptr_buf": paged_kv_indptr_buf,
                "paged_kv_indices_buf": paged_kv_indices_buf, "paged_kv_last_page_len_buf": paged_kv_last_page_len_buf,
            }, "paged_kv_last_page_len_buf")  # fmt: skip
        self._qo_indptr_buf = qo_indptr_buf
        self._paged_kv_indptr_buf = paged_kv_indptr_buf
        self._paged_kv_indices_buf = paged_kv_indices_buf
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buf
        self._max_total_num_rows = None  # FlashInfer's; SGLang's fast_prefill_plan reads and sets it, nothing here does

    @property
    def _cached_module(self) -> "_PagedPlanModule":
        """FlashInfer's planning module, as servers that plan through it call it (_PagedPlanModule)."""
        return _PagedPlanModule(self)

    @aotinfer_api
    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: Optional[int] = None,
        custom_mask: Optional[torch.Tensor] = None,
        packed_custom_mask: Optional[torch.Tensor] = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: Optional[float] = None,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        q_data_type: Union[str, torch.dtype] = "float16",
        kv_data_type: Optional[Union[str, torch.dtype]] = None,
        o_data_type: Optional[Union[str, torch.dtype]] = None,
        non_blocking: bool = True,
        seq_lens: Optional[torch.Tensor] = None,
        fixed_split_size: Optional[int] = None,
        disable_split_kv: bool = False,
    ) -> None:
        r"""Plan prefill attention against a paged KV cache: read the page table, split the work,
        write the tables.

        Parameters
        ----------
        qo_indptr : torch.Tensor
            int32 ``[batch_size + 1]``: request ``i``'s queries are ``q[qo_indptr[i]:qo_indptr[i + 1]]``.
        paged_kv_indptr : torch.Tensor
            int32 ``[batch_size + 1]``: request ``i`` owns ``paged_kv_indices[paged_kv_indptr[i]:paged_kv_indptr[i + 1]]``.
        paged_kv_indices : torch.Tensor
            int32 page ids, at least ``paged_kv_indptr[-1]`` of them (on the GPU; copied there otherwise).
        paged_kv_last_page_len : torch.Tensor
            int32 ``[batch_size]``: tokens in each request's last page, ``0..page_size``.
        num_qo_heads, num_kv_heads : int
            Query and KV heads; ``num_qo_heads`` a multiple of ``num_kv_heads``.
        head_dim_qk : int
            64, 128 or 256.
        page_size : int
            Tokens a page.
        head_dim_vo, custom_mask, packed_custom_mask, causal, pos_encoding_mode, use_fp16_qk_reduction,
        sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta, q_data_type, o_data_type,
        non_blocking, fixed_split_size, disable_split_kv
            As ``BatchPrefillWithRaggedKVCacheWrapper.plan``; ``fixed_split_size`` in pages.
        kv_data_type : str or torch.dtype
            The cache's dtype: None (q's), q's, ``float8_e4m3fn`` or ``float8_e5m2`` (widened to
            float16 in the kernel; ``run``'s ``k_scale`` and ``v_scale`` dequantize).
        seq_lens : Optional[torch.Tensor]
            KV lengths ``[batch_size]`` to use instead of those of ``paged_kv_last_page_len``.
        """
        self._check_not_captured()
        _check_plan_scalars(num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, causal, pos_encoding_mode,
                            use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta,
                            fixed_split_size, custom_mask, packed_custom_mask)  # fmt: skip
        check_int(page_size, "page_size", 1)
        q_dtype, kv_dtype = check_dtypes(q_data_type, kv_data_type, o_data_type, fp8_kv=True)
        # Before any work that grows with the batch: the tables hold a row a request and the
        # count row (10^7 requests are refused at once).
        check_int32(qo_indptr, "qo_indptr")
        self._check_table_bytes(4 * _WORK_WIDTH * qo_indptr.numel(), f"a plan of {qo_indptr.numel() - 1} requests")
        check_int32(paged_kv_indices, "paged_kv_indices")
        check_int32(paged_kv_last_page_len, "paged_kv_last_page_len")
        lengths, total_q, _ = _request_lengths(qo_indptr, paged_kv_indptr, "paged_kv_indptr", self.device,
                                               paged_kv_last_page_len, seq_lens, page_size, paged_kv_indices.numel())  # fmt: skip
        if self._use_cuda_graph and paged_kv_indices.numel() > self._paged_kv_indices_buf.numel():
            raise ValueError(
                f"Expected at most {self._paged_kv_indices_buf.numel()} page ids (paged_kv_indices_buf's size), got "
                f"{paged_kv_indices.numel()}"
            )
        indices = self._paged_kv_indices_buf if self._use_cuda_graph else paged_kv_indices.to(self.device, non_blocking=non_blocking)
        self._plan_common(
            lengths, total_q, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_of_v(head_dim_qk, head_dim_vo), page_size, causal,
            pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, q_dtype, kv_dtype,
            fixed_split_size, disable_split_kv, non_blocking, indices, 0, custom_mask, packed_custom_mask,
        )  # fmt: skip
        if self._use_cuda_graph:
            self._qo_indptr_buf.copy_(qo_indptr, non_blocking=non_blocking)
            self._paged_kv_indptr_buf.copy_(paged_kv_indptr, non_blocking=non_blocking)
            self._paged_kv_last_page_len_buf.copy_(paged_kv_last_page_len, non_blocking=non_blocking)
            if paged_kv_indices.data_ptr() != self._paged_kv_indices_buf.data_ptr():
                self._paged_kv_indices_buf[: paged_kv_indices.numel()].copy_(paged_kv_indices, non_blocking=non_blocking)
        else:
            self._qo_indptr_buf, self._paged_kv_indptr_buf = qo_indptr, paged_kv_indptr
            self._paged_kv_indices_buf, self._paged_kv_last_page_len_buf = indices, paged_kv_last_page_len

    begin_forward = plan

    @aotinfer_api
    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
        *,
        q_scale: Optional[float] = None,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        return_lse: bool = False,
        enable_pdl: Optional[bool] = None,
        window_left: Optional[int] = None,
        sinks: Optional[torch.Tensor] = None,
        skip_check: bool = False,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        r"""Prefill attention of one layer with the planned page table. Launches only.

        Parameters
        ----------
        q : torch.Tensor
            ``[qo_indptr[-1], num_qo_heads, head_dim]`` (more rows are left alone), the planned dtype.
        paged_kv_cache : torch.Tensor or Tuple[torch.Tensor, torch.Tensor]
            ``(k_cache, v_cache)``, each ``[pages, page_size, num_kv_heads, head_dim]`` (NHD) or
            ``[pages, num_kv_heads, page_size, head_dim]`` (HND), or 3-D for page_size 1; or one
            tensor ``[pages, 2, ...]``. Views into a larger pool are fine (last dimension contiguous).
        q_scale, k_scale : Optional[float]
            Multiply ``sm_scale`` (fp8 calibration scales: the logits are ``sm_scale * q_scale *
            k_scale * q.k`` over the cache as stored).
        v_scale : Optional[float]
            Multiplies the output (in the kernel's epilogue, any cache dtype), not the log-sum-exp.
        out, lse, return_lse, enable_pdl
            As ``BatchPrefillWithRaggedKVCacheWrapper.run``.
        window_left : Optional[int]
            None: the planned (or ``forward``'s) window; else this one, for this call.
        sinks : Optional[torch.Tensor]
            float32 ``[num_qo_heads]``: a logit per head added to the softmax denominator.
        """
        if not skip_check:
            _check_paged_run(self, q, q_scale, k_scale, v_scale, enable_pdl, window_left)
        plan = self._plan
        if plan is None:
            raise RuntimeError("BatchPrefillWithPagedKVCacheWrapper.run: call plan() first")
        self._require_workspace_on(q.device)
        k_cache, v_cache = self._paged_cache(paged_kv_cache, plan)
        planned_window = self._window_left
        if window_left is not None:
            self._window_left = window_left
        try:
            return _run_prefill(
                self, plan, q, k_cache, v_cache, self._kv_layout_code, out, lse, return_lse, enable_pdl, sinks,
                self._sm_scale_for(plan.head_dim, q_scale, k_scale), v_scale,
            )  # fmt: skip
        finally:
            self._window_left = planned_window

    def forward(
        self,
        q: torch.Tensor,
        paged_kv_cache: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ) -> torch.Tensor:
        r"""Deprecated form of ``run`` (FlashInfer's): the attention options given here replace the
        planned ones, for this call and the ones after it."""
        self._set_forward_options(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale,
                                  rope_scale, rope_theta)
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale)

    def forward_return_lse(
        self,
        q: torch.Tensor,
        paged_kv_cache: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        r"""Deprecated form of ``run_return_lse``, as ``forward``."""
        self._set_forward_options(causal, pos_encoding_mode, use_fp16_qk_reduction, window_left, logits_soft_cap, sm_scale,
                                  rope_scale, rope_theta)
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, return_lse=True)


class BatchAttentionWithAttentionSinkWrapper(BatchPrefillWithPagedKVCacheWrapper):
    r"""Prefill or decode attention over a paged KV cache with a sink logit per query head
    (gpt-oss), FlashInfer's wrapper: the paged prefill wrapper, whose ``run`` also takes the sinks
    and ``sm_scale`` positionally after the cache, as FlashInfer's attention-sink variant does.

    >>> wrapper = aotinfer.BatchAttentionWithAttentionSinkWrapper(workspace, "NHD", q_data_type=torch.bfloat16,
    ...                                                            kv_data_type=torch.bfloat16, head_dim_qk=64,
    ...                                                            head_dim_vo=64, window_left=127)
    >>> wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, 64, 8, 64, 16, causal=True,
    ...              window_left=127, q_data_type=torch.bfloat16)
    >>> out = wrapper.run(q, kv_cache, sinks, 0.125)  # sinks: float32 [64]
    """

    @aotinfer_api
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: Optional[torch.Tensor] = None,
        paged_kv_indptr_buf: Optional[torch.Tensor] = None,
        paged_kv_indices_buf: Optional[torch.Tensor] = None,
        paged_kv_last_page_len_buf: Optional[torch.Tensor] = None,
        custom_mask_buf: Optional[torch.Tensor] = None,
        mask_indptr_buf: Optional[torch.Tensor] = None,
        backend: str = "auto",
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        q_data_type: Union[str, "torch.dtype"] = "bfloat16",
        kv_data_type: Union[str, "torch.dtype"] = "bfloat16",
        head_dim_qk: int = 128,
        head_dim_vo: int = 128,
        window_left: int = -1,
    ) -> None:
        r"""The paged prefill wrapper's parameters, then those FlashInfer compiles its variant for:
        ``pos_encoding_mode`` ("NONE" or "ROPE_LLAMA": ``plan``'s is the one applied), ``use_fp16_qk_reduction`` (False only), the dtypes and
        head dims (checked by ``plan``, which takes them again) and ``window_left`` (``plan``'s
        window is the one applied)."""
        check_pos_encoding_mode(pos_encoding_mode)
        _check_plan_options(head_dim_qk, head_dim_vo, use_fp16_qk_reduction, None)
        check_window_left(window_left)
        check_dtypes(q_data_type, kv_data_type, None, fp8_kv=True)
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, qo_indptr_buf, paged_kv_indptr_buf,
                         paged_kv_indices_buf, paged_kv_last_page_len_buf, custom_mask_buf, mask_indptr_buf, backend)

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
        *args: Any,
        sinks: Optional[torch.Tensor] = None,
        **kwargs: Any,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        r"""``BatchPrefillWithPagedKVCacheWrapper.run``, with ``sinks`` (float32 ``[num_qo_heads]``)
        and ``sm_scale`` (for this call, in place of the planned one) also taken positionally after
        the cache: ``run(q, kv_cache, sinks, sm_scale)``."""
        if len(args) > 2:
            raise TypeError(f"run takes the sinks and sm_scale after the cache, got {len(args)} more arguments")
        if args and sinks is not None:
            raise TypeError("run got sinks both positionally and by keyword")
        sinks = args[0] if args else sinks
        if len(args) < 2 or args[1] is None:
            return super().run(q, paged_kv_cache, sinks=sinks, **kwargs)
        sm_scale = args[1]
        check_real(sm_scale, "sm_scale")
        if not sm_scale > 0:
            raise ValueError(f"Expected sm_scale to be a positive number, got {sm_scale!r}")
        planned, self._sm_scale = self._sm_scale, float(sm_scale)
        try:
            return super().run(q, paged_kv_cache, sinks=sinks, **kwargs)
        finally:
            self._sm_scale = planned


# ---- single request ----------------------------------------------------------------------------


def _check_single_prefill(q, k, v, custom_mask, packed_custom_mask, causal, kv_layout, pos_encoding_mode,
                          use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta,
                          backend) -> None:  # fmt: skip
    """What single_prefill_with_kv_cache's binding cannot name: the options and scalars."""
    _check_mask_forms(custom_mask, packed_custom_mask)
    check_backend(backend)
    check_kv_layout(kv_layout)
    check_pos_encoding_mode(pos_encoding_mode)
    if use_fp16_qk_reduction:
        raise NotImplementedError("use_fp16_qk_reduction=True is not implemented: q.k is reduced in float32")
    if not isinstance(causal, bool):
        raise TypeError(f"Expected causal to be a bool, got {type(causal).__name__}")
    check_window_left(window_left)
    check_soft_cap(logits_soft_cap)
    check_optional_reals(sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta)
    check_rope_options(pos_encoding_mode, rope_scale, rope_theta)
    for value, name in ((k, "k"), (v, "v")):
        if dtype_name(getattr(value, "dtype", None)) in FP8_DTYPES:
            raise NotImplementedError(
                f"{name} of dtype {dtype_name(value.dtype)} is not implemented: single_prefill_with_kv_cache takes K and V "
                "of q's dtype (fp8 KV: BatchPrefillWithPagedKVCacheWrapper)"
            )


@aotinfer_api(trace=single_prefill_with_kv_cache_trace)
def single_prefill_with_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    custom_mask: Optional[torch.Tensor] = None,
    packed_custom_mask: Optional[torch.Tensor] = None,
    causal: bool = False,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    use_fp16_qk_reduction: bool = False,
    sm_scale: Optional[float] = None,
    window_left: int = -1,
    logits_soft_cap: Optional[float] = None,
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
    return_lse: bool = False,
    backend: str = "auto",
    *,
    skip_check: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    r"""Prefill attention of one request over contiguous K and V (FlashInfer's API).

    Parameters
    ----------
    q : torch.Tensor
        ``[qo_len, num_qo_heads, head_dim]``, float16 or bfloat16; head_dim 64, 128, 256 or 192.
    k, v : torch.Tensor
        ``[kv_len, num_kv_heads, head_dim]`` (NHD) or ``[num_kv_heads, kv_len, head_dim]`` (HND),
        q's dtype; v's head_dim q's, or 128 where q's is 192 (DeepSeek's prefill). Strided views
        are fine (last dimension contiguous).
    custom_mask : Optional[torch.Tensor]
        bool ``[qo_len, kv_len]`` (or those values flattened): True where the query sees the key.
        It replaces ``causal``; a window still applies.
    packed_custom_mask : Optional[torch.Tensor]
        uint8, the same bits packed: ``packbits(custom_mask.flatten(), bitorder="little")``. One of
        the two forms, or neither.
    causal : bool
        Causal mask aligned to the end; needs ``qo_len <= kv_len`` (ValueError otherwise).
    kv_layout : str
        ``"NHD"`` or ``"HND"``.
    pos_encoding_mode : str
        ``"NONE"`` or ``"ROPE_LLAMA"`` (as the wrappers' plan; ``"ALIBI"`` raises NotImplementedError).
    use_fp16_qk_reduction : bool
        False (True raises NotImplementedError).
    sm_scale : Optional[float]
        Logit scale; None: ``1 / sqrt(head_dim)``.
    window_left : int
        Sliding window; -1: off.
    logits_soft_cap : Optional[float]
        ``cap * tanh(logit / cap)``; None or 0: off.
    rope_scale, rope_theta : Optional[float]
        ROPE_LLAMA's position scale and base; None: 1 and 1e4.
    return_lse : bool
        Also return the log-sum-exp (base 2), float32 ``[qo_len, num_qo_heads]``.
    backend : str
        As the wrappers' (``"fa3"``: the Hopper kernel; ``"auto"``: it where it applies).

    Returns
    -------
    torch.Tensor or Tuple[torch.Tensor, torch.Tensor]
        The output ``[qo_len, num_qo_heads, head_dim_vo]`` (q's dtype), or ``(out, lse)``.
    """
    if not skip_check:
        _check_single_prefill(q, k, v, custom_mask, packed_custom_mask, causal, kv_layout, pos_encoding_mode,
                              use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta,
                              backend)  # fmt: skip
    import torch

    for value, name in ((q, "q"), (k, "k"), (v, "v")):
        check_tensor(value, name)
    if q.dim() != 3:
        raise ValueError(f"Expected q to have shape [qo_len, num_qo_heads, head_dim], got {list(q.shape)}")
    if k.dim() != 3 or v.dim() != 3 or v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"Expected k and v to have one shape but for head_dim, [kv_len, num_kv_heads, head_dim] (NHD) or "
            f"[num_kv_heads, kv_len, head_dim] (HND), got {list(k.shape)} and {list(v.shape)}"
        )
    if kv_layout == "HND":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    qo_len, num_qo_heads, head_dim = q.shape
    kv_len, num_kv_heads, head_dim_vo = v.shape
    masked = custom_mask is not None or packed_custom_mask is not None
    causal = causal and not masked  # a custom mask replaces causal
    if causal and qo_len > kv_len:
        raise ValueError(f"Expected qo_len ({qo_len}) <= kv_len ({kv_len}) with causal=True")
    device = k.device  # everything the op makes goes beside K and V: a q elsewhere is what the binding names
    mask = torch.empty(0, dtype=torch.uint8, device=device)
    if masked:  # one request: its segment at byte 0
        lengths = torch.tensor([qo_len]), torch.tensor([kv_len])
        mask = _packed_mask(custom_mask, packed_custom_mask, *lengths)[0].to(device)
    group = max(num_qo_heads // max(num_kv_heads, 1), 1)
    check_rope_supported(pos_encoding_mode, q.dtype, k.dtype, head_dim, head_dim_vo)
    sm90 = use_sm90(backend, device, head_dim, q.dtype, k.dtype, masked, pos_encoding_mode == "ROPE_LLAMA")
    rows = tile_rows(head_dim_vo, sm90)
    tiles = (qo_len * group + rows - 1) // rows
    # Under full attention the last tiles' keys may be halved, as the wrappers' plan does
    # (``halving``): their items go last, and their partials to the merge.
    split_from, chunk = halving(qo_len, kv_len, group, rows, num_kv_heads, num_sms(device), causal, window_left, 1,
                                1 << 30) if sm90 else (0, 0)  # fmt: skip
    whole = split_from * group // rows if chunk else tiles
    halved = tiles - whole
    # The tables on the device, by tensor ops (no copy from the host: tracers and CUDA graph
    # capture take them); whole tiles last to first (the most keys first under causal), then the
    # halved tiles' two chunks each.
    zeros = torch.zeros(whole + 2 * halved, dtype=torch.int32, device=device)
    row_begin = (whole - 1) * rows - torch.arange(0, whole * rows, rows, dtype=torch.int32, device=device)
    second = torch.arange(2 * halved, dtype=torch.int32, device=device) % 2  # a halved tile's chunk
    row_begin = torch.cat((row_begin, whole * rows + torch.arange(2 * halved, dtype=torch.int32, device=device) // 2 * rows))
    whole_zeros = zeros.narrow(0, 0, whole)  # not zeros[:whole]: a CPU-only torch's fake CUDA tensors refuse slices
    kv_begin = torch.cat((whole_zeros, second * chunk))
    kv_end = torch.cat((whole_zeros + kv_len, chunk + second * (kv_len - chunk)))
    chunk_index = torch.cat((whole_zeros, second))
    items = torch.stack((zeros, row_begin, kv_begin, kv_end, chunk_index, zeros, zeros, zeros), dim=1)
    header = torch.zeros((1, 8), dtype=torch.int32, device=device)
    header.narrow(1, 0, 1).fill_(whole + 2 * halved)
    spans = []  # as the items
    for j in reversed(range(whole)):
        r0, r1 = j * rows, min((j + 1) * rows, qo_len * group) - 1
        spans.append((0, *keys_attended(r0 // group, r1 // group, 0, kv_len, kv_len - qo_len, causal, window_left)))
    spans += [(0, 0, chunk), (0, chunk, kv_len)] * halved
    heads, grouped = _head_schedule(sm90, num_kv_heads, kv_len, spans, head_dim + head_dim_vo, k.element_size(), device,
                                    2 * halved)  # fmt: skip
    header.narrow(1, 1, 1).fill_(heads)
    header.narrow(1, 2, 1).fill_(grouped)
    work = torch.cat((header, items))
    requests = torch.zeros((1, 8), dtype=torch.int32, device=device)
    requests.narrow(1, 1, 1).fill_(qo_len)
    requests.narrow(1, 3, 1).fill_(kv_len)
    empty = torch.empty(0, dtype=torch.float32, device=device)
    partial_out, partial_lse = empty, empty
    if halved:  # token t >= split_from: chunk i's partial at slot 2 t + i - 2 split_from
        for column, value in ((4, -2 * split_from), (5, 2), (6, split_from)):
            requests.narrow(1, column, 1).fill_(value)
        slots = 2 * (qo_len - split_from)
        partial_out = torch.empty((slots, num_qo_heads, head_dim_vo), dtype=torch.float32, device=device)
        partial_lse = torch.empty((slots, num_qo_heads), dtype=torch.float32, device=device)

    out = torch.empty((qo_len, num_qo_heads, head_dim_vo), dtype=q.dtype, device=device)
    lse = torch.empty((qo_len, num_qo_heads) if return_lse else (0,), dtype=torch.float32, device=device)
    binding = _batch_prefill_sm90 if sm90 else _batch_prefill
    binding(
        out,
        lse,
        partial_out,
        partial_lse,
        q,
        k,
        v,
        torch.empty(0, dtype=torch.int32, device=device),
        work,
        requests,
        empty,  # no sinks
        *(() if sm90 else (mask,)),
        0,  # captured: each call has tables of its own
        0,
        1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale,
        logits_soft_cap or 0.0,
        window_left,
        *(() if sm90 else rope_arguments(pos_encoding_mode, rope_scale, rope_theta)),
        1.0,
        causal,
        whole + 2 * halved,
        split_from if halved else -1,  # the merge of the halved tiles' tokens
        -1,
    )
    return (out, lse) if return_lse else out


def single_prefill_with_kv_cache_return_lse(*args: Any, **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""``single_prefill_with_kv_cache(..., return_lse=True)``: (output, LSE) (FlashInfer's name)."""
    return single_prefill_with_kv_cache(*args, **kwargs, return_lse=True)
