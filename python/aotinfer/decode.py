"""Decode attention over a paged KV cache, with FlashInfer's API (module ``flashinfer.decode``):
``BatchDecodeWithPagedKVCacheWrapper`` (``plan`` once per decode step, ``run`` once per layer) and
``single_decode_with_kv_cache``.

One query token per request attends the request's keys and values, read from pages of a KV
cache: request ``i`` owns pages ``indices[indptr[i]:indptr[i + 1]]`` and holds
``page_size * (pages - 1) + last_page_len[i]`` tokens. Logits are ``sm_scale * q.k`` (optionally
soft-capped, ``cap * tanh(x / cap)``, and limited to the last ``window_left + 1`` positions);
the softmax runs in float32, and the log-sum-exp returned is base 2 (``log2(sum(exp(logit)))``,
FlashInfer's convention, which aotinfer.cascade merges). A request with no tokens gives zeros and
``-inf``.

The design choice: ``plan`` makes every host decision and ``run`` none. ``plan`` reads the small
index arrays on the host, splits long sequences into chunks when the batch alone would leave the
GPU idle, and writes the result into the workspace as int32 tables the kernel reads:

    work      [items, 4]  (request, kv_begin, kv_end, slot): one CTA column per item, attending
                          positions [kv_begin, kv_end) of its request; slot -1 writes the output
                          directly, slot >= 0 a partial result that a merge kernel combines;
                          request -1 is an idle item (a CUDA graph's fixed grid, see below)
    requests  [batch, 4]  (page_begin, kv_len, first_partial, num_partials) per request
    counters  [batch * num_kv_heads * ceil(group / 16)]  zeros: a split request's items done (per
                          block row); the last of a few items merges them in the decode launch
                          and zeroes its counter again

``run`` only launches, with the planned tables: the decode kernel, then, where a request has more
items than the kernel merges itself (the binding decides from the most items a request has), the
merge kernel; so every layer reuses one plan and a CUDA graph can capture ``run``.

FlashInfer behaviours followed, and the decisions they settle:

- ``plan`` copies ``indptr`` and ``last_page_len`` to the host (a synchronization when they are on
  the GPU, as in FlashInfer) and leaves ``indices`` on the GPU: copied into the caller's buffer
  under ``use_cuda_graph``, moved to the workspace's device otherwise.
- ``fixed_split_size`` is in pages, as FlashInfer's FA2 scheduler counts it; chunks start at
  multiples of ``fixed_split_size * page_size`` tokens from position 0, so a request's output does
  not depend on the rest of the batch (FlashInfer allows it with tensor cores only; every decode
  here takes it). ``disable_split_kv=True`` gives each request one item.
- Sinks (``run(sinks=...)``, float32 per query head) are logits in the natural-log domain, not
  scaled by ``sm_scale``, added to the softmax denominator once per request; the log-sum-exp
  includes them, as FlashInfer's FA2 ``AttentionSink`` variant writes it (an empty request with
  sinks gives ``lse = sink * log2(e)``).
- The output dtype is q's: ``o_data_type`` may be left out or equal to ``q_data_type``.
- ``q_scale * k_scale`` multiply ``sm_scale``; ``v_scale`` multiplies the output (in the kernel).
- An fp8 cache is widened to float16 (which holds every fp8 value exactly) and the tensor cores
  run in float16; a bfloat16 q is converted to float16 once, clamped to +-65504. P is float16
  there too, with more mantissa than bfloat16; only a q entry beyond float16's range differs.
- ``run`` checks q's and the cache's dtypes against ``plan`` (ValueError, as FlashInfer). Its
  ``window_left`` may narrow the planned window but not widen it: ``plan`` only splits the planned
  window's positions (FlashInfer's ``run`` requires the planned value). ``forward`` sets the
  options it takes on the wrapper for later calls too, as FlashInfer's does.
- ``plan`` takes FlashInfer's optional arguments by keyword or in its legacy positional order;
  ``block_tables`` is accepted and unused (as by FlashInfer's FA2 and CUDA-core decode);
  ``seq_lens`` replaces the lengths computed from ``last_page_len``.
- ``use_tensor_cores`` and ``backend`` (any of FlashInfer's names) pick nothing: one kernel serves
  every group size.
- ``plan(q_len_per_req=N)``, N > 1 (speculative verification, MTP): N query tokens a request, its
  last N positions, causal among themselves; a paged prefill wrapper over the same workspace and
  buffers plans and runs them (FlashInfer's tensor-core decode runs its prefill kernel too).
"""

from __future__ import annotations

import math

from . import _attention
from ._attention import (
    KV_LAYOUTS,
    AttentionWrapper,
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
    chunk_unit,
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
from .page import get_seq_lens
from .prefill import BatchPrefillWithPagedKVCacheWrapper
from .trace.templates.decode import single_decode_with_kv_cache_trace
from .utils import check_enable_pdl, check_int, check_tensor

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Optional, Tuple, Union

    import torch

_batch_decode = kernel("decode", "batch_decode")


# The split heuristic. A CTA serves up to 16 query heads of one KV head, so the grid is
# items x (num_kv_heads * ceil(group / 16)); plan aims at 2 CTAs an SM, or at 1 where no request
# attends more than _SHORT_REQUEST positions: a batch of those that fills the SMs once gains
# nothing from blocks with half as much to read and a merge of their partials (H100, 16 x 1024 and
# 16 x 2048 unsplit: 2-6% faster; longer requests want 2, a lone block an SM holding too few bytes
# in flight; docs/design/decode.md#split-kv-and-merge). Chunks: _attention.smallest_chunk.
_HEADS_PER_CTA = 16
_CTAS_PER_SM = 2
_SHORT_REQUEST = 2048
# single_decode_with_kv_cache plans without asking the GPU (it runs under tracers and CUDA graph
# capture, and its output then does not depend on the GPU model): as for this many SMs (H100/H200).
_SINGLE_DECODE_SMS = 132
# K and V are read once a step. Cached evict-first in L2 (the binding's kv_read_once), their lines
# displace one another rather than what the L2 held, which is otherwise evicted, and written back
# to memory while the cache streams in where it is dirty. Under bench_decode's cold-L2 flush (which
# leaves the L2 dirty), on an H100: +2-15% at steps of 34-202 MB, but -1-3% from 269 MB, where what
# it saves (at most an L2's worth) is small beside the bytes (docs/design/decode.md#mainloop). So: evict-first
# up to this many L2s of K and V a step, where one CTA reads each KV head (groups of up to 16: a
# second CTA of a larger group reads the same lines, which should still be in L2).
_READ_ONCE_L2S = 4
_ASSUMED_L2_BYTES = 50 << 20  # as _SINGLE_DECODE_SMS and _attention.CPU_SMS: the L2 of an H100/H200


# ---- the work partition (host only) ------------------------------------------------------------


def heads_ctas(num_qo_heads: int, num_kv_heads: int) -> int:
    """CTAs per work item: each KV head's query heads, 16 to a CTA."""
    group = max(num_qo_heads // max(num_kv_heads, 1), 1)
    return max(num_kv_heads, 1) * -(-group // _HEADS_PER_CTA)


def target_items(num_sms: int, num_qo_heads: int, num_kv_heads: int, ctas_per_sm: int = _CTAS_PER_SM) -> int:
    """The number of work items that fills the GPU (ctas_per_sm CTAs an SM)."""
    return max(1, -(-ctas_per_sm * num_sms // heads_ctas(num_qo_heads, num_kv_heads)))


class WorkPartition:
    """What a plan wrote into its host tables (plan_decode in csrc/decode.cu): the facts that
    sized them, and views of the int32 tables themselves."""

    __slots__ = ("tables", "batch", "rows", "counters_size", "need", "num_items", "num_slots", "chunk",
                 "max_partials", "attended", "work_offset", "counters_offset")

    def layout(self) -> tuple:
        """(byte offset, shape) of requests, work and counters in the tables."""
        return ((0, (self.batch, 4)), (self.work_offset, (self.rows, 4)), (self.counters_offset, (self.counters_size,)))

    def _view(self, which: int) -> "torch.Tensor":
        import torch

        offset, shape = self.layout()[which]
        size = math.prod(shape) * 4
        return self.tables[offset : offset + size].view(torch.int32).view(shape)

    @property
    def requests(self) -> "torch.Tensor":  # [batch, 4] (page_begin, kv_len, first_partial, num_partials)
        return self._view(0)

    @property
    def work(self) -> "torch.Tensor":  # [items or capacity, 4] (request, kv_begin, kv_end, slot)
        return self._view(1)

    @property
    def counters(self) -> "torch.Tensor":  # zeros, one a request and block row
        return self._view(2)


def partition_work(
    indptr: "torch.Tensor",
    last_page_len: "torch.Tensor",
    seq_lens: "Optional[torch.Tensor]" = None,
    *,
    num_indices: int,
    page_size: int,
    num_qo_heads: int,
    num_kv_heads: int,
    num_sms: int,
    window_left: int = -1,
    disable_split_kv: bool = False,
    fixed_split_size: Optional[int] = None,
    capacity: Optional[int] = None,
    tables: "Optional[torch.Tensor]" = None,
    facts: "Optional[torch.Tensor]" = None,
    planner: Any = None,
) -> WorkPartition:
    """Split each request's attended positions into work items (see the module doc) and write the
    tables, in compiled host code (plan_decode in csrc/decode.cu; the arithmetic in
    include/aotinfer/decode_plan.h): the policy is this function's.

    ``indptr`` (int32 ``[batch + 1]``), ``last_page_len`` (int32 ``[batch]``) and ``seq_lens``
    (int64 ``[batch]``, replacing the lengths of ``last_page_len``) are contiguous host tensors;
    ``num_indices`` bounds ``indptr``. A request attends positions ``[lo, kv_len)``, ``lo =
    max(0, kv_len - 1 - window_left)`` with a window, else 0. Chunks start at multiples of the
    chunk size from position 0, so a request's items depend on the request and the chunk size
    alone. The chunk size: ``disable_split_kv``: none (one item a request);
    ``fixed_split_size``: that many pages; otherwise none when the batch fills the GPU
    (``target_items``: 2 CTAs an SM, 1 where no request attends more than _SHORT_REQUEST
    positions), else the smallest that keeps the items within it (_attention.smallest_chunk's
    rule). Items are ordered longest first (the tail of a ragged batch starts early).
    ``capacity`` (CUDA graphs): the work table has exactly this many rows, idle ones at the end;
    ValueError when the items do not fit. ``tables``: the host bytes to write (a plan's pinned
    staging), ``facts``: int64 ``[8]`` for what sized them; None: new ones. ``planner``: the
    device's plan_decode (_attention.host_binding).
    """
    import torch

    batch = last_page_len.numel()
    ctas = heads_ctas(num_qo_heads, num_kv_heads)
    result = WorkPartition()
    result.batch, result.counters_size = batch, batch * ctas
    if tables is None:  # room for the most items there can be: a chunk of one position
        rows = capacity if capacity is not None else 2 * batch + int(indptr[-1]) * page_size
        tables = torch.empty(_aligned(16 * batch) + _aligned(16 * rows) + _aligned(4 * result.counters_size), dtype=torch.uint8)
    if facts is None:
        facts = torch.empty(8, dtype=torch.int64)
    (planner or host_binding("decode", "plan_decode", torch.device("cpu")))(
        tables, facts, indptr, last_page_len, last_page_len if seq_lens is None else seq_lens, seq_lens is not None,  # (unread without)
        num_indices, page_size, ctas,
        target_items(num_sms, num_qo_heads, num_kv_heads), target_items(num_sms, num_qo_heads, num_kv_heads, ctas_per_sm=1),
        _SHORT_REQUEST, _attention.MIN_CHUNK, chunk_unit(page_size), window_left, disable_split_kv,
        0 if fixed_split_size is None else fixed_split_size * page_size, -1 if capacity is None else capacity,
    )  # fmt: skip
    (result.need, result.num_items, result.num_slots, result.chunk, result.max_partials, result.attended,
     result.work_offset, result.counters_offset) = facts.tolist()  # fmt: skip
    result.tables = tables
    result.rows = result.num_items if capacity is None else capacity
    return result


def reads_once(tokens: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, kv_itemsize: int, l2_bytes: int) -> int:
    """1 where a step attending ``tokens`` positions in all caches its K and V evict-first
    (_READ_ONCE_L2S), else 0: the binding's kv_read_once."""
    kv_bytes = tokens * num_kv_heads * head_dim * 2 * kv_itemsize
    return int(kv_bytes <= _READ_ONCE_L2S * l2_bytes and heads_ctas(num_qo_heads, num_kv_heads) == num_kv_heads)


# ---- the wrapper -------------------------------------------------------------------------------


class _Plan:
    """What plan decided, for run: the tables on the device and the shapes they were made for."""

    __slots__ = (
        "batch_size", "num_qo_heads", "num_kv_heads", "head_dim", "page_size", "q_dtype", "kv_dtype",
        "window_left", "work", "requests", "counters", "indices", "partial_out", "partial_lse", "max_partials", "empty",
        "kv_read_once",
        "partition",
    )  # fmt: skip


def _check_run(self, q, q_scale, k_scale, v_scale, enable_pdl, window_left) -> None:
    """What run's binding cannot name: the scalars, and q against the plan."""
    check_optional_reals(q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
    check_enable_pdl(enable_pdl)
    plan = self._plan
    if plan is None:
        return  # run says it
    check_tensor(q, "q")
    expected = (plan.batch_size, plan.num_qo_heads, plan.head_dim)
    if tuple(q.shape) != expected:
        raise ValueError(f"Expected q to have the planned shape [batch_size, num_qo_heads, head_dim] = {list(expected)}, got {list(q.shape)}")
    if q.dtype != plan.q_dtype:
        raise ValueError(f"The dtype of q {q.dtype} does not match the q_data_type {plan.q_dtype} specified in plan")
    window = self._window_left if window_left is None else window_left
    check_window_left(window)
    if plan.window_left >= 0 and not 0 <= window <= plan.window_left:
        raise ValueError(
            f"window_left={window} attends positions that plan (window_left={plan.window_left}) did not assign to any "
            "CTA: plan with the widest window the runs use"
        )


class BatchDecodeWithPagedKVCacheWrapper(AttentionWrapper):
    r"""Decode attention for a batch of requests over a paged KV cache (FlashInfer's wrapper).

    ``plan`` once per decode step, with the page table; then ``run`` once per layer with that
    layer's queries and cache. See the module doc for the page table, the math and how the work
    is split.

    >>> workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    >>> wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    >>> wrapper.plan(kv_indptr, kv_indices, kv_last_page_len, 32, 8, 128, 16, q_data_type=torch.bfloat16)
    >>> out = wrapper.run(q, kv_cache)  # q: [batch, 32, 128]
    """

    @aotinfer_api
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: Optional[torch.Tensor] = None,
        paged_kv_indices_buffer: Optional[torch.Tensor] = None,
        paged_kv_last_page_len_buffer: Optional[torch.Tensor] = None,
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
            ``run`` reads the page table from the three buffers below, which ``plan`` fills, and
            launches a fixed grid: a captured ``run`` replays correctly after ``plan`` with a new
            page table of the same batch size. Without it, a ``run`` captured into a graph replays
            right under its own plan, and the wrapper refuses a new ``plan`` (RuntimeError).
        use_tensor_cores : bool
            Accepted for FlashInfer's API; one kernel serves every group size.
        paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer : torch.Tensor
            With ``use_cuda_graph``: int32 GPU buffers of ``batch_size + 1``, the most pages any
            plan uses, and ``batch_size`` elements. The batch size is fixed by them.
        backend : str
            FlashInfer's ``"auto"``, ``"fa2"``, ``"fa3"``, ``"trtllm-gen"`` or ``"cute-dsl"``; all
            run aotinfer's kernel.
        """
        self._init_wrapper(float_workspace_buffer, kv_layout, use_cuda_graph, backend)
        self._use_tensor_cores = bool(use_tensor_cores)
        if self._use_cuda_graph:
            self._fix_batch_size({
                "paged_kv_indptr_buffer": paged_kv_indptr_buffer, "paged_kv_indices_buffer": paged_kv_indices_buffer,
                "paged_kv_last_page_len_buffer": paged_kv_last_page_len_buffer,
            }, "paged_kv_last_page_len_buffer")  # fmt: skip
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer
        # Several query tokens a request (plan's q_len_per_req > 1): a paged prefill wrapper over the
        # same workspace and buffers runs them, causal among the new tokens (_plan_several_tokens).
        self._several_tokens = None
        self._q_len_per_req = 1
        self._graph_q_len = None  # under use_cuda_graph, the first plan's q_len_per_req: frozen

    @property
    def _cached_module(self) -> _PlanModule:
        """FlashInfer's planning module, as servers that plan through it call it (_PlanModule)."""
        return _PlanModule(self)

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    @aotinfer_api
    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        q_data_type: Optional[Union[str, torch.dtype]] = "float16",
        kv_data_type: Optional[Union[str, torch.dtype]] = None,
        o_data_type: Optional[Union[str, torch.dtype]] = None,
        data_type: Optional[Union[str, torch.dtype]] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        non_blocking: bool = True,
        block_tables: Optional[torch.Tensor] = None,
        seq_lens: Optional[torch.Tensor] = None,
        fixed_split_size: Optional[int] = None,
        disable_split_kv: bool = False,
        q_len_per_req: int = 1,
    ) -> None:
        r"""Plan the decode of one step: read the page table, split the work, write the tables.

        Parameters
        ----------
        indptr : torch.Tensor
            int32 ``[batch_size + 1]``: request ``i`` owns ``indices[indptr[i]:indptr[i + 1]]``.
        indices : torch.Tensor
            int32 page ids, at least ``indptr[-1]`` of them (on the GPU; copied there otherwise).
        last_page_len : torch.Tensor
            int32 ``[batch_size]``: tokens in each request's last page, ``0..page_size``.
        num_qo_heads, num_kv_heads : int
            Query and KV heads; ``num_qo_heads`` a multiple of ``num_kv_heads``.
        head_dim : int
            64, 128 or 256.
        page_size : int
            Tokens a page.
        pos_encoding_mode : str
            ``"NONE"``, or ``"ROPE_LLAMA"``: q (at each request's last position) and every key (at
            its position) turned by RoPE inside the kernel, as FlashInfer's; K and V of q's dtype
            (an fp8 cache raises NotImplementedError, so does ``"ALIBI"``).
        window_left : int
            Attend the last ``window_left + 1`` positions only; -1: all. ``run`` may narrow it.
        logits_soft_cap : Optional[float]
            ``cap * tanh(logit / cap)`` on the scaled logits; None or 0: off.
        q_data_type : str or torch.dtype
            float16 (FlashInfer's default) or bfloat16; ``run`` checks q against it.
        kv_data_type : str or torch.dtype
            The cache's dtype: q's, float8_e4m3fn or float8_e5m2; None: ``q_data_type``.
        o_data_type : str or torch.dtype
            None or ``q_data_type``: the output has q's dtype.
        data_type : str or torch.dtype
            Deprecated: fills ``q_data_type`` and ``kv_data_type`` where they are None.
        sm_scale : Optional[float]
            Logit scale; None: ``1 / sqrt(head_dim)``.
        rope_scale, rope_theta : Optional[float]
            ROPE_LLAMA's position scale and base; None: 1 and 1e4.
        non_blocking : bool
            Copy the tables to the GPU without waiting for the copy.
        block_tables : Optional[torch.Tensor]
            Unused (FlashInfer's trtllm-gen backend reads it).
        seq_lens : Optional[torch.Tensor]
            Sequence lengths ``[batch_size]`` to use instead of those of ``last_page_len``.
        fixed_split_size : Optional[int]
            Split every sequence into chunks of this many pages (batch-invariant output); None
            or <= 0 (vLLM passes -1): the plan splits as it sees fit.
        disable_split_kv : bool
            One CTA column per request: deterministic, batch-invariant output (it wins
            over ``fixed_split_size``, as in FlashInfer).
        q_len_per_req : int
            Query tokens a request (speculative decoding's verification, MTP): ``run`` takes q of
            ``[batch_size * q_len_per_req, ...]``, request ``i``'s tokens at rows ``i *
            q_len_per_req`` on, the last of the request's KV positions, causal among themselves
            (every request holds at least ``q_len_per_req`` tokens). Above 1 the paged prefill
            kernel runs them; as FlashInfer's, that takes a wrapper made with
            ``use_tensor_cores=True``, and a CUDA-graph wrapper keeps its first plan's value.
        """
        import torch

        self._check_not_captured()
        check_int(q_len_per_req, "q_len_per_req", 1)
        if self._use_cuda_graph and self._graph_q_len not in (None, q_len_per_req):
            raise ValueError(f"q_len_per_req is frozen at {self._graph_q_len} for a wrapper made with "
                             f"use_cuda_graph=True (its graphs' q shape), got {q_len_per_req}")
        if data_type is not None:
            q_data_type = data_type if q_data_type is None else q_data_type
            kv_data_type = data_type if kv_data_type is None else kv_data_type
        if q_len_per_req > 1:
            self._plan_several_tokens(
                q_len_per_req, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
                q_data_type=q_data_type, kv_data_type=kv_data_type,
                o_data_type=o_data_type, sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
                non_blocking=non_blocking, seq_lens=seq_lens, fixed_split_size=fixed_split_size,
                disable_split_kv=disable_split_kv,
            )  # fmt: skip
            return

        # ---- options
        check_options(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)
        check_heads(num_qo_heads, num_kv_heads)
        check_head_dim(head_dim)
        check_int(page_size, "page_size", 1)
        fixed_split_size = fixed_split(fixed_split_size)
        q_dtype, kv_dtype = check_dtypes(q_data_type, kv_data_type, o_data_type, fp8_kv=True)
        check_rope_supported(pos_encoding_mode, q_dtype, kv_dtype, head_dim, head_dim)

        # ---- the page table, on the host
        check_int32(indptr, "indptr")
        check_int32(indices, "indices")
        check_int32(last_page_len, "last_page_len")
        batch = last_page_len.numel()
        if indptr.numel() != batch + 1:
            raise ValueError(f"Expected indptr to have batch_size + 1 = {batch + 1} elements, got {indptr.numel()}")
        if self._use_cuda_graph:
            if batch != self._fixed_batch_size:
                raise ValueError(
                    f"The batch size is fixed under use_cuda_graph: got {batch}, the buffers given to the wrapper hold "
                    f"{self._fixed_batch_size}"
                )
            if indices.numel() > self._paged_kv_indices_buf.numel():
                raise ValueError(
                    f"Expected at most {self._paged_kv_indices_buf.numel()} indices (paged_kv_indices_buffer's size), "
                    f"got {indices.numel()}"
                )
        # Before any work that grows with the batch: the tables hold a request row, at least one
        # work item and the counters of each request (10^7 requests are refused at once).
        self._check_table_bytes(
            _aligned(16 * batch) * 2 + _aligned(4 * batch * heads_ctas(num_qo_heads, num_kv_heads)), f"a plan of {batch} requests"
        )
        seq_lens_host = None
        if seq_lens is not None:
            check_tensor(seq_lens, "seq_lens")
            seq_lens_host = seq_lens.to("cpu", torch.int64).reshape(-1).contiguous()

        # ---- the work partition and its tables, written into the pinned staging bytes
        fill = target_items(num_sms(self.device), num_qo_heads, num_kv_heads)
        capacity = max(batch, fill) if self._use_cuda_graph else None
        staging = self._staging()
        partition = partition_work(
            indptr.to("cpu").contiguous(),
            last_page_len.to("cpu").contiguous(),
            seq_lens_host,
            num_indices=indices.numel(),
            page_size=page_size,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            num_sms=num_sms(self.device),
            window_left=window_left,
            disable_split_kv=disable_split_kv,
            fixed_split_size=fixed_split_size,
            capacity=capacity,
            tables=staging,
            facts=self._plan_facts,
            planner=host_binding("decode", "plan_decode", self.device),
        )

        # ---- the partial results, the tables and the page indices on the device (what can fail
        # first: a plan that raises leaves the wrapper as it was)
        plan = _Plan()
        # Partial results: under CUDA graphs as many slots as items can ever be, so that the views
        # run captured stay the same.
        slots = capacity if self._use_cuda_graph else partition.num_slots
        plan.partial_out, plan.partial_lse = self._partial_views(slots, num_qo_heads, head_dim)
        plan.requests, plan.work, plan.counters = self._upload(staging, partition.need, partition.layout(), non_blocking)
        if self._use_cuda_graph:
            self._paged_kv_indptr_buf.copy_(indptr, non_blocking=non_blocking)
            self._paged_kv_last_page_len_buf.copy_(last_page_len, non_blocking=non_blocking)
            if indices.data_ptr() != self._paged_kv_indices_buf.data_ptr():
                self._paged_kv_indices_buf[: indices.numel()].copy_(indices, non_blocking=non_blocking)
            plan.indices = self._paged_kv_indices_buf
        else:
            plan.indices = indices.to(self.device, non_blocking=non_blocking)
            self._paged_kv_indptr_buf = indptr
            self._paged_kv_indices_buf = plan.indices
            self._paged_kv_last_page_len_buf = last_page_len
        # The most items a request has; a captured graph's, the most it may have after a new plan.
        plan.max_partials = capacity if self._use_cuda_graph else partition.max_partials
        plan.empty = self._empty_tensor()
        plan.partition = partition
        plan.batch_size, plan.num_qo_heads, plan.num_kv_heads = batch, num_qo_heads, num_kv_heads
        plan.head_dim, plan.page_size, plan.q_dtype, plan.kv_dtype = head_dim, page_size, q_dtype, kv_dtype
        plan.window_left = window_left
        l2_bytes = device_property(self.device, "L2_cache_size", _ASSUMED_L2_BYTES)
        plan.kv_read_once = reads_once(partition.attended, num_qo_heads, num_kv_heads, head_dim, kv_dtype.itemsize, l2_bytes)

        self._plan = plan
        self._q_len_per_req = 1
        if self._use_cuda_graph:
            self._graph_q_len = 1
        self._batch_size, self._num_qo_heads, self._num_kv_heads = batch, num_qo_heads, num_kv_heads
        self._cached_q_data_type, self._cached_kv_data_type, self._cached_o_data_type = q_dtype, kv_dtype, q_dtype
        sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
        self._keep_options(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)

    begin_forward = plan

    def _plan_several_tokens(self, q_len_per_req, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
                             head_dim, page_size, seq_lens, **options) -> None:  # fmt: skip
        """plan with ``q_len_per_req`` > 1: the paged prefill wrapper's plan, with ``q_len_per_req``
        query tokens a request, causal (FlashInfer's decode runs these on its prefill kernel too)."""
        import torch

        if not self._use_tensor_cores:
            raise ValueError(f"q_len_per_req={q_len_per_req} takes a wrapper made with use_tensor_cores=True, as "
                             "FlashInfer's (its query tokens run on the prefill kernel)")
        check_int32(last_page_len, "last_page_len")
        batch = last_page_len.numel()
        if self._several_tokens is None:
            graph = {}
            if self._use_cuda_graph:  # the decode wrapper's buffers, and one for the fixed query rows
                graph = dict(
                    qo_indptr_buf=torch.empty(self._fixed_batch_size + 1, dtype=torch.int32, device=self.device),
                    paged_kv_indptr_buf=self._paged_kv_indptr_buf, paged_kv_indices_buf=self._paged_kv_indices_buf,
                    paged_kv_last_page_len_buf=self._paged_kv_last_page_len_buf,
                )  # fmt: skip
            self._several_tokens = BatchPrefillWithPagedKVCacheWrapper(
                self._float_workspace_buffer, self._kv_layout, use_cuda_graph=self._use_cuda_graph,
                backend=self._backend if self._backend in ("auto", "fa2", "fa3") else "fa2", **graph,
            )  # fmt: skip
        qo_indptr = torch.arange(batch + 1, dtype=torch.int32) * q_len_per_req
        kv_len = (get_seq_lens(indptr, last_page_len, page_size) if seq_lens is None else seq_lens).to("cpu", torch.int64)
        if batch and int(kv_len.min()) < q_len_per_req:
            raise ValueError(
                f"q_len_per_req={q_len_per_req} needs every request to hold at least that many tokens (its query "
                f"tokens are its last positions; the first would attend an empty KV range), got kv lengths "
                f"{kv_len.tolist()}"
            )
        self._several_tokens.plan(
            qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, causal=True,
            seq_lens=seq_lens, **options,
        )  # fmt: skip
        inner = self._several_tokens
        self._batch_size = batch
        self._plan, self._q_len_per_req = None, q_len_per_req
        if self._use_cuda_graph:
            self._graph_q_len = q_len_per_req
        self._keep_options(inner._pos_encoding_mode, inner._window_left, inner._logits_soft_cap, inner._sm_scale,
                           inner._rope_scale, inner._rope_theta)  # fmt: skip

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
        r"""Decode attention of one layer with the planned page table. Launches only.

        Parameters
        ----------
        q : torch.Tensor
            ``[batch_size, num_qo_heads, head_dim]``, the planned dtype; last dimension contiguous.
        paged_kv_cache : torch.Tensor or Tuple[torch.Tensor, torch.Tensor]
            ``(k_cache, v_cache)``, each ``[pages, page_size, num_kv_heads, head_dim]`` (NHD) or
            ``[pages, num_kv_heads, page_size, head_dim]`` (HND), or 3-D for page_size 1; or one
            tensor ``[pages, 2, ...]``. Views into a larger pool are fine (last dimension contiguous).
        q_scale, k_scale : Optional[float]
            Multiply ``sm_scale`` (fp8 calibration scales).
        v_scale : Optional[float]
            Multiplies the output.
        out : Optional[torch.Tensor]
            Output of q's shape and dtype; allocated when None.
        lse : Optional[torch.Tensor]
            float32 ``[batch_size, num_qo_heads]``, written when given; allocated when None and
            ``return_lse``.
        return_lse : bool
            Also return the log-sum-exp (base 2).
        enable_pdl : Optional[bool]
            Programmatic dependent launch: None where the GPU supports it.
        window_left : Optional[int]
            None: the planned (or ``forward``'s) window; else a window no wider than the planned one.
        sinks : Optional[torch.Tensor]
            float32 ``[num_qo_heads]``: a logit per head added to the softmax denominator.

        Returns
        -------
        torch.Tensor or Tuple[torch.Tensor, torch.Tensor]
            ``out``, or ``(out, lse)`` with ``return_lse``.
        """
        import torch

        if self._q_len_per_req > 1:
            rows = self._batch_size * self._q_len_per_req
            check_tensor(q, "q")
            if not skip_check and (q.dim() != 3 or q.shape[0] != rows):
                raise ValueError(f"Expected q to have batch_size * q_len_per_req = {rows} rows (q_len_per_req="
                                 f"{self._q_len_per_req}), got shape {list(q.shape)}")
            return self._several_tokens.run(
                q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse,
                return_lse=return_lse, enable_pdl=enable_pdl, window_left=window_left, sinks=sinks, skip_check=skip_check,
            )  # fmt: skip
        if not skip_check:
            _check_run(self, q, q_scale, k_scale, v_scale, enable_pdl, window_left)
        plan = self._plan
        if plan is None:
            raise RuntimeError("BatchDecodeWithPagedKVCacheWrapper.run: call plan() first")
        self._require_workspace_on(q.device)
        k_cache, v_cache = self._paged_cache(paged_kv_cache, plan)
        # Outputs on the plan's device: a q on another one is the tensor the binding names.
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=self.device)
        if lse is None and return_lse:
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=self.device)
        _batch_decode(
            out,
            plan.empty if lse is None else lse,
            plan.partial_out,
            plan.partial_lse,
            q,
            k_cache,
            v_cache,
            plan.indices,
            plan.work,
            plan.requests,
            plan.counters,
            plan.empty if sinks is None else sinks,
            self._captured_address,
            self._kv_layout_code,
            self._sm_scale_for(plan.head_dim, q_scale, k_scale),
            self._logits_soft_cap or 0.0,
            self._window_left if window_left is None else window_left,
            *self._rope_arguments,
            1.0 if v_scale is None else v_scale,
            plan.max_partials,
            plan.kv_read_once,
            -1 if enable_pdl is None else enable_pdl,
        )
        return (out, lse) if return_lse else out

    def forward(
        self,
        q: torch.Tensor,
        paged_kv_cache: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
        pos_encoding_mode: str = "NONE",
        q_scale: Optional[float] = None,
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
        self._set_options(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)

    def forward_return_lse(
        self,
        q: torch.Tensor,
        paged_kv_cache: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
        pos_encoding_mode: str = "NONE",
        q_scale: Optional[float] = None,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        r"""Deprecated form of ``run_return_lse``, as ``forward``."""
        self._set_options(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=True)


def _get_range_buf(seq_len: int, device: Any) -> "torch.Tensor":
    """FlashInfer's private helper that vLLM's flashinfer backend imports from flashinfer.decode
    (the overlay serves it there): 0 .. seq_len - 1, int32, on ``device``."""
    import torch

    return torch.arange(seq_len, dtype=torch.int32, device=device)


class _PlanModule:
    """What a decode wrapper's ``_cached_module`` is to servers that plan through FlashInfer's
    internals (vLLM's ``fast_plan_decode``, SGLang's ``fast_decode_plan``): they put the page table
    in the wrapper's buffers (a CUDA-graph wrapper's, or ``_paged_kv_*_buf`` set to their tensors)
    and call ``_cached_module.plan`` with the arguments of one of FlashInfer's two decode planners,
    then set the options they planned with on the wrapper. This plans the wrapper again from those
    buffers, with the dtypes of the last plan or of the planner's arguments
    (docs/design/overlay.md#vllms-flashinfer-backend)."""

    def __init__(self, wrapper: "BatchDecodeWithPagedKVCacheWrapper") -> None:
        self._wrapper = wrapper

    def plan(self, *args) -> list:
        if len(args) > 4 and isinstance(args[4], int):
            self._plan_cuda_core(*args)
        else:
            self._plan_tensor_core(*args)
        return []  # FlashInfer's plan info: servers keep it as _plan_info, and nothing here reads it

    def _plan_tensor_core(self, float_workspace_buffer, int_workspace_buffer, page_locked_int_workspace_buffer,
                          qo_indptr, kv_indptr, kv_len, total_num_rows, batch_size, num_qo_heads, num_kv_heads,
                          page_size, enable_cuda_graph, head_dim_qk, head_dim_vo, causal, window_left=-1,
                          fixed_split_size=-1, disable_split_kv=False, num_colocated_ctas=0) -> None:  # fmt: skip
        import torch

        if total_num_rows != batch_size or causal:
            raise NotImplementedError(
                f"_cached_module.plan: one query token a request (total_num_rows {total_num_rows} for batch_size "
                f"{batch_size}) and causal=False are what it plans; use plan(q_len_per_req=...) for more"
            )
        last = self._wrapper._plan
        kv_len = kv_len.to("cpu", torch.int64)
        last_page_len = last_page_len_of(kv_len, page_size)
        self._replan(kv_indptr, last_page_len, kv_len.to(torch.int32), num_qo_heads, num_kv_heads, head_dim_qk,
                     head_dim_vo, page_size, window_left, None if last is None else last.q_dtype,
                     None if last is None else last.kv_dtype, fixed_split_size, disable_split_kv)  # fmt: skip

    def _plan_cuda_core(self, float_workspace_buffer, int_workspace_buffer, page_locked_int_workspace_buffer, indptr,
                        batch_size, num_qo_heads, num_kv_heads, page_size, enable_cuda_graph, window_left,
                        logits_soft_cap, head_dim_qk, head_dim_vo, empty_q_data, empty_kv_data) -> None:  # fmt: skip
        last_page_len = self._wrapper._paged_kv_last_page_len_buf
        if last_page_len is None:
            raise RuntimeError("_cached_module.plan reads the last page lengths from _paged_kv_last_page_len_buf: set it")
        self._replan(indptr, last_page_len, None, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, page_size,
                     window_left, empty_q_data.dtype, empty_kv_data.dtype, None, False)  # fmt: skip

    def _replan(self, indptr, last_page_len, seq_lens, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo,
                page_size, window_left, q_dtype, kv_dtype, fixed_split_size, disable_split_kv) -> None:  # fmt: skip
        wrapper = self._wrapper
        if q_dtype is None:
            raise RuntimeError("_cached_module.plan keeps the dtypes of the last plan(): call plan() first")
        if wrapper._paged_kv_indices_buf is None:
            raise RuntimeError("_cached_module.plan reads the page ids from _paged_kv_indices_buf: set it")
        if head_dim_vo != head_dim_qk:
            raise NotImplementedError(f"head_dim_vo={head_dim_vo} is not implemented: it must equal head_dim_qk")
        wrapper.plan(
            indptr, wrapper._paged_kv_indices_buf[: int(indptr[-1])], last_page_len, num_qo_heads, num_kv_heads,
            head_dim_qk, page_size, window_left=window_left, logits_soft_cap=wrapper._logits_soft_cap,
            q_data_type=q_dtype, kv_data_type=kv_dtype, sm_scale=wrapper._sm_scale, seq_lens=seq_lens,
            fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv,
        )  # fmt: skip


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    r"""FlashInfer's CUDA-graph form of the decode wrapper: ``BatchDecodeWithPagedKVCacheWrapper``
    with ``use_cuda_graph=True`` and the caller's fixed index buffers (``plan`` cannot be captured;
    ``run`` can)."""

    def __init__(
        self,
        workspace_buffer: torch.Tensor,
        indptr_buffer: torch.Tensor,
        indices_buffer: torch.Tensor,
        last_page_len_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_tensor_cores: bool = False,
    ) -> None:
        super().__init__(
            workspace_buffer,
            kv_layout,
            use_cuda_graph=True,
            use_tensor_cores=use_tensor_cores,
            paged_kv_indptr_buffer=indptr_buffer,
            paged_kv_indices_buffer=indices_buffer,
            paged_kv_last_page_len_buffer=last_page_len_buffer,
        )


def fast_decode_plan(
    self: BatchDecodeWithPagedKVCacheWrapper,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    last_page_len: torch.Tensor,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pos_encoding_mode: str = "NONE",
    window_left: int = -1,
    logits_soft_cap: Optional[float] = None,
    q_data_type: Optional[Union[str, torch.dtype]] = None,
    kv_data_type: Optional[Union[str, torch.dtype]] = None,
    data_type: Optional[Union[str, torch.dtype]] = None,
    sm_scale: Optional[float] = None,
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
    non_blocking: bool = True,
    fixed_split_size: Optional[int] = None,
    disable_split_kv: bool = False,
    q_len_per_req: int = 1,
    global_override_indptr_cpu: Optional[torch.Tensor] = None,
) -> None:
    r"""FlashInfer's plan for multi-step draft decoding, used as ``wrapper.plan = partial(fast_decode_plan,
    wrapper)``. It plans exactly as ``self.plan`` does (which copies nothing it need not): the same
    arguments, ``global_override_indptr_cpu`` taken as the host copy of ``indptr`` where given.
    ``q_len_per_req`` as ``plan``'s. The parameters are
    spelled out, not forwarded: FlashInfer's order here has no ``o_data_type``, unlike ``plan``'s."""
    BatchDecodeWithPagedKVCacheWrapper.plan(
        self,
        indptr if global_override_indptr_cpu is None else global_override_indptr_cpu,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        pos_encoding_mode=pos_encoding_mode,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        q_data_type=q_data_type,
        kv_data_type=kv_data_type,
        data_type=data_type,
        sm_scale=sm_scale,
        rope_scale=rope_scale,
        rope_theta=rope_theta,
        non_blocking=non_blocking,
        fixed_split_size=fixed_split_size,
        disable_split_kv=disable_split_kv,
        q_len_per_req=q_len_per_req,
    )


# ---- single request ----------------------------------------------------------------------------


def _single_request_tables(kv_len: int, lo: int, chunk: int, device: "torch.device") -> Tuple[torch.Tensor, torch.Tensor, int]:
    """The work and requests tables of one request whose positions [lo, kv_len) are split into
    chunks of ``chunk`` tokens (0: one item), and its number of partial slots. Built on the device
    by a few small launches (no copy from the host), so that CUDA graph capture and tracers take
    them; with tensor methods only (Python indexing of fake CUDA tensors needs a CUDA build)."""
    import torch

    if chunk <= 0:
        chunk = max(kv_len, 1)  # one chunk: edges [lo, kv_len]
    first, items = lo // chunk, num_chunks(lo, kv_len, chunk)
    split = items > 1
    # Item i covers [edges[i], edges[i + 1]): the chunk boundaries, clamped to [lo, kv_len].
    edges = torch.arange(first * chunk, (first + items + 1) * chunk, chunk, dtype=torch.int32, device=device)
    edges = edges.clamp_(lo, kv_len)
    if split:
        slots = torch.arange(items, dtype=torch.int32, device=device)
    else:
        slots = torch.full((1,), -1, dtype=torch.int32, device=device)
    work = torch.stack((torch.zeros_like(slots), edges.narrow(0, 0, items), edges.narrow(0, 1, items), slots), dim=1)
    requests = torch.zeros((1, 4), dtype=torch.int32, device=device)  # page_begin 0
    requests.narrow(1, 1, 1).fill_(kv_len)
    requests.narrow(1, 2, 1).fill_(0 if split else -1)  # first_partial
    requests.narrow(1, 3, 1).fill_(items if split else 0)  # num_partials
    return work, requests, (items if split else 0)


@aotinfer_api(trace=single_decode_with_kv_cache_trace)
def single_decode_with_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    use_tensor_cores: bool = False,
    q_scale: Optional[float] = None,
    k_scale: Optional[float] = None,
    v_scale: Optional[float] = None,
    window_left: int = -1,
    logits_soft_cap: Optional[float] = None,
    sm_scale: Optional[float] = None,
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
    return_lse: bool = False,
    *,
    skip_check: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    r"""Decode attention of one request over contiguous K and V (FlashInfer's API).

    Parameters
    ----------
    q : torch.Tensor
        ``[num_qo_heads, head_dim]``, float16 or bfloat16; head_dim 64, 128 or 256.
    k, v : torch.Tensor
        ``[kv_len, num_kv_heads, head_dim]`` (NHD) or ``[num_kv_heads, kv_len, head_dim]`` (HND):
        q's dtype, float8_e4m3fn or float8_e5m2. Strided views are fine (last dimension contiguous).
    kv_layout : str
        ``"NHD"`` or ``"HND"``.
    pos_encoding_mode : str
        ``"NONE"``, or ``"ROPE_LLAMA"``: q (at position ``kv_len - 1``) and each key (at its index)
        turned by RoPE inside the kernel, K and V of q's dtype (``"ALIBI"`` raises NotImplementedError).
    use_tensor_cores : bool
        Accepted for FlashInfer's API; one kernel serves every group size.
    q_scale, k_scale : Optional[float]
        Multiply ``sm_scale``.
    v_scale : Optional[float]
        Multiplies the output.
    window_left : int
        Attend the last ``window_left + 1`` positions; -1: all.
    logits_soft_cap : Optional[float]
        ``cap * tanh(logit / cap)``; None or 0: off.
    sm_scale : Optional[float]
        Logit scale; None: ``1 / sqrt(head_dim)``.
    rope_scale, rope_theta : Optional[float]
        ROPE_LLAMA's position scale and base; None: 1 and 1e4.
    return_lse : bool
        Also return the log-sum-exp (base 2), float32 ``[num_qo_heads]``.

    Returns
    -------
    torch.Tensor or Tuple[torch.Tensor, torch.Tensor]
        The output ``[num_qo_heads, head_dim]`` (q's dtype), or ``(out, lse)``.
    """
    if not skip_check:
        check_kv_layout(kv_layout)
        check_pos_encoding_mode(pos_encoding_mode)
        check_window_left(window_left)
        check_soft_cap(logits_soft_cap)
        check_optional_reals(q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, sm_scale=sm_scale,
                              rope_scale=rope_scale, rope_theta=rope_theta)
        check_rope_options(pos_encoding_mode, rope_scale, rope_theta)

    import torch

    for value, name in ((q, "q"), (k, "k"), (v, "v")):
        check_tensor(value, name)
    if q.dim() != 2:
        raise ValueError(f"Expected q to have shape [num_qo_heads, head_dim], got {list(q.shape)}")
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"Expected k and v to have one shape, [kv_len, num_kv_heads, head_dim] (NHD) or [num_kv_heads, kv_len, head_dim] "
            f"(HND), got {list(k.shape)} and {list(v.shape)}"
        )
    num_qo_heads, head_dim = q.shape
    if not skip_check:
        check_rope_supported(pos_encoding_mode, q.dtype, k.dtype, head_dim, head_dim)
    # As pages of one token: [kv_len, 1, heads, dim] (NHD) or [kv_len, heads, 1, dim] (HND), views.
    if kv_layout == "NHD":
        kv_len, num_kv_heads = k.shape[0], k.shape[1]
        k_cache, v_cache = k.unsqueeze(1), v.unsqueeze(1)
    else:
        num_kv_heads, kv_len = k.shape[0], k.shape[1]
        k_cache, v_cache = k.transpose(0, 1).unsqueeze(2), v.transpose(0, 1).unsqueeze(2)
    device = k.device  # everything the op makes goes beside K and V: a q elsewhere is what the binding names
    lo = max(kv_len - 1 - window_left, 0) if window_left >= 0 else 0
    fill = target_items(_SINGLE_DECODE_SMS, num_qo_heads, num_kv_heads)
    chunk = smallest_chunk(kv_len - lo, kv_len, fill, 1, lambda c: num_chunks(lo, kv_len, c)) if fill > 1 else 0
    work, requests, slots = _single_request_tables(kv_len, lo, chunk, device)
    indices = torch.arange(kv_len, dtype=torch.int32, device=device)

    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if q_scale is not None:
        sm_scale *= q_scale
    if k_scale is not None:
        sm_scale *= k_scale
    out = torch.empty((1, num_qo_heads, head_dim), dtype=q.dtype, device=device)
    lse = torch.empty((1, num_qo_heads) if return_lse else (0,), dtype=torch.float32, device=device)
    none = torch.empty(0, dtype=torch.float32, device=device)
    _batch_decode(
        out,
        lse,
        torch.empty((slots, num_qo_heads, head_dim), dtype=torch.float32, device=device),
        torch.empty((slots, num_qo_heads), dtype=torch.float32, device=device),
        q.unsqueeze(0),
        k_cache,
        v_cache,
        indices,
        work,
        requests,
        torch.zeros(heads_ctas(num_qo_heads, num_kv_heads), dtype=torch.int32, device=device),
        none,  # no sinks
        0,  # captured: each call has tables of its own
        KV_LAYOUTS[kv_layout],
        sm_scale,
        logits_soft_cap or 0.0,
        window_left,
        *rope_arguments(pos_encoding_mode, rope_scale, rope_theta),
        1.0 if v_scale is None else v_scale,
        slots,
        reads_once(kv_len - lo, num_qo_heads, num_kv_heads, head_dim, k.element_size(), _ASSUMED_L2_BYTES),
        -1,
    )
    return (out.squeeze(0), lse.squeeze(0)) if return_lse else out.squeeze(0)
