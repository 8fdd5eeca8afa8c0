"""Merging attention states, with FlashInfer's signatures: merge_state, merge_state_in_place and
merge_states (module ``flashinfer.cascade``), and MultiLevelCascadeAttentionWrapper, which merges
the states of attention over levels of shared keys.

An attention state is the output ``v`` of attention over one segment of the keys and the
log-sum-exp ``s`` of its logits, base 2 (``s = log2(sum(exp(logits)))``, as FlashInfer's kernels
return it). Merging the states of two segments gives the state of their union::

    s = log2(2**s_a + 2**s_b)
    v = v_a * 2**(s_a - s) + v_b * 2**(s_b - s)

computed in float32. A segment with no keys has ``s = -inf`` and contributes nothing; merging two
such states gives ``v = 0``, ``s = -inf``. ``v`` is float16, bfloat16 or float32 with a contiguous
last dimension; ``s`` is float32. Batched decode (aotinfer.decode) merges its split chunks with
the same math.
"""

from __future__ import annotations

from ._kernels import kernel
from .api_logging import aotinfer_api
from .trace.templates.cascade import merge_state_in_place_trace, merge_state_trace, merge_states_trace
from .utils import check_int, check_tensor

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, List, Optional, Tuple, Union

    import torch

_merge_state = kernel("cascade", "merge_state")
_merge_state_in_place = kernel("cascade", "merge_state_in_place")
_merge_states = kernel("cascade", "merge_states")


@aotinfer_api(trace=merge_state_trace)
def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor, *, skip_check: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Merge the attention states of two KV segments ``A`` and ``B`` (see the module doc).

    Parameters
    ----------
    v_a, v_b : torch.Tensor
        Attention outputs of the segments, ``[seq_len, num_heads, head_dim]``, one dtype (float16,
        bfloat16 or float32).
    s_a, s_b : torch.Tensor
        Their log-sum-exp values (base 2), ``[seq_len, num_heads]``; converted to float32 when
        they are not (as FlashInfer does).

    Returns
    -------
    Tuple[torch.Tensor, torch.Tensor]
        ``v_merged`` (``[seq_len, num_heads, head_dim]``, v_a's dtype) and ``s_merged``
        (``[seq_len, num_heads]``, float32): the state of the segment ``[A, B]``.
    """
    import torch

    for value, name in ((v_a, "v_a"), (s_a, "s_a"), (v_b, "v_b"), (s_b, "s_b")):
        check_tensor(value, name)
    if s_a.dtype != torch.float32:
        s_a = s_a.float()
    if s_b.dtype != torch.float32:
        s_b = s_b.float()
    v_merged = torch.empty(v_a.shape, dtype=v_a.dtype, device=v_a.device)
    s_merged = torch.empty(s_a.shape, dtype=torch.float32, device=s_a.device)
    _merge_state(v_merged, s_merged, v_a, s_a, v_b, s_b, -1)
    return v_merged, s_merged


@aotinfer_api(trace=merge_state_in_place_trace)
def merge_state_in_place(
    v: torch.Tensor,
    s: torch.Tensor,
    v_other: torch.Tensor,
    s_other: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    skip_check: bool = False,
) -> None:
    r"""Merge the state ``(v_other, s_other)`` into ``(v, s)``, in place (see the module doc).

    Parameters
    ----------
    v : torch.Tensor
        ``[seq_len, num_heads, head_dim]``, float16, bfloat16 or float32, updated in place.
    s : torch.Tensor
        ``[seq_len, num_heads]``, float32 (it is written), updated in place.
    v_other : torch.Tensor
        ``[seq_len, num_heads, head_dim]``, v's dtype.
    s_other : torch.Tensor
        ``[seq_len, num_heads]``, float32.
    mask : Optional[torch.Tensor]
        ``[seq_len]`` bool: rows where it is False keep their state (useful under CUDA graphs,
        where the rows to merge change between replays). None merges every row.

    Returns
    -------
    None
        The merged state is in ``v`` and ``s``.
    """
    import torch

    check_tensor(v, "v")
    if mask is None:
        mask = torch.empty(0, dtype=torch.bool, device=v.device)
    _merge_state_in_place(v, s, v_other, s_other, mask, -1)


@aotinfer_api(trace=merge_states_trace)
def merge_states(
    v: torch.Tensor, s: torch.Tensor, *, skip_check: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Merge ``num_states`` attention states per row (see the module doc).

    Parameters
    ----------
    v : torch.Tensor
        ``[seq_len, num_states, num_heads, head_dim]``, float16, bfloat16 or float32.
    s : torch.Tensor
        ``[seq_len, num_states, num_heads]``; converted to float32 when it is not (as FlashInfer
        does).

    Returns
    -------
    Tuple[torch.Tensor, torch.Tensor]
        ``v_merged`` (``[seq_len, num_heads, head_dim]``, v's dtype) and ``s_merged``
        (``[seq_len, num_heads]``, float32). With ``num_states == 0`` the output is zeros and
        ``-inf``.
    """
    import torch

    check_tensor(v, "v")
    check_tensor(s, "s")
    if v.dim() != 4:
        raise ValueError(f"Expected v to have 4 dimensions [seq_len, num_states, num_heads, head_dim], got shape {list(v.shape)}")
    if s.dtype != torch.float32:
        s = s.float()
    seq_len, _, num_heads, head_dim = v.shape
    v_merged = torch.empty((seq_len, num_heads, head_dim), dtype=v.dtype, device=v.device)
    s_merged = torch.empty((seq_len, num_heads), dtype=torch.float32, device=v.device)
    _merge_states(v_merged, s_merged, v, s, -1)
    return v_merged, s_merged


class MultiLevelCascadeAttentionWrapper:
    r"""Attention over keys in levels of one paged cache (FlashInfer's wrapper): a shared prefix
    (level 0), then what fewer requests share, down to each request's own keys (the last level).
    Each level is a paged prefill over its own page table, with its own query ranges (requests
    that share a level's keys are one query range there); the levels' states merge into the
    output (see the module doc). Only the last level is causal.

    >>> wrapper = aotinfer.MultiLevelCascadeAttentionWrapper(2, workspace, "NHD")
    >>> wrapper.plan([shared_qo_indptr, unique_qo_indptr], [shared_kv_indptr, unique_kv_indptr],
    ...              [shared_kv_indices, unique_kv_indices], [shared_last_page_len, unique_last_page_len],
    ...              32, 8, 128, 16, q_data_type=torch.float16)
    >>> out = wrapper.run(q, kv_cache)  # every layer, one plan
    """

    @aotinfer_api
    def __init__(
        self,
        num_levels: int,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf_arr: Optional[List[torch.Tensor]] = None,
        paged_kv_indptr_buf_arr: Optional[List[torch.Tensor]] = None,
        paged_kv_indices_buf_arr: Optional[List[torch.Tensor]] = None,
        paged_kv_last_page_len_buf_arr: Optional[List[torch.Tensor]] = None,
    ) -> None:
        r"""
        Parameters
        ----------
        num_levels : int
            Levels of the cascade, 1 or more.
        float_workspace_buffer : torch.Tensor
            As ``BatchPrefillWithPagedKVCacheWrapper``'s; the levels share it (they run in turn).
        kv_layout : str
            ``"NHD"`` or ``"HND"``.
        use_cuda_graph : bool
            Each level plans into the fixed buffers of the ``*_buf_arr`` lists (one a level), as
            ``BatchPrefillWithPagedKVCacheWrapper``'s ``use_cuda_graph``.
        qo_indptr_buf_arr, paged_kv_indptr_buf_arr, paged_kv_indices_buf_arr, paged_kv_last_page_len_buf_arr
            With ``use_cuda_graph``: a list of ``num_levels`` buffers each.
        """
        from .prefill import BatchPrefillWithPagedKVCacheWrapper

        check_int(num_levels, "num_levels", 1)
        buffers = {"qo_indptr_buf_arr": qo_indptr_buf_arr, "paged_kv_indptr_buf_arr": paged_kv_indptr_buf_arr,
                   "paged_kv_indices_buf_arr": paged_kv_indices_buf_arr,
                   "paged_kv_last_page_len_buf_arr": paged_kv_last_page_len_buf_arr}
        if use_cuda_graph:
            for name, arr in buffers.items():
                _check_levels(arr, num_levels, name)
            per_level = list(zip(*buffers.values()))
        else:
            per_level = [(None, None, None, None)] * num_levels
        self._batch_prefill_wrappers = [
            BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout, bool(use_cuda_graph), *level)
            for level in per_level
        ]
        self._num_levels = int(num_levels)
        self._kv_layout = kv_layout
        self._use_cuda_graph = bool(use_cuda_graph)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffers: List[torch.Tensor]) -> None:
        r"""New workspaces from the next ``plan`` on: the float one for every level, an int one a
        level (as ``BatchPrefillWithPagedKVCacheWrapper.reset_workspace_buffer``)."""
        _check_levels(int_workspace_buffers, self._num_levels, "int_workspace_buffers")
        for wrapper, int_workspace_buffer in zip(self._batch_prefill_wrappers, int_workspace_buffers):
            wrapper.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)

    @aotinfer_api
    def plan(
        self,
        qo_indptr_arr: List[torch.Tensor],
        paged_kv_indptr_arr: List[torch.Tensor],
        paged_kv_indices_arr: List[torch.Tensor],
        paged_kv_last_page_len: List[torch.Tensor],
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
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
    ) -> None:
        r"""Plan every level, once per batch (every layer then runs with it).

        Parameters
        ----------
        qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len : List[torch.Tensor]
            A list of ``num_levels`` each: level ``i``'s query ranges over the rows of ``q`` (each
            ends at ``q``'s row count), and its page table, as ``BatchPrefillWithPagedKVCacheWrapper.plan``
            takes them.
        causal : bool
            For the last level only (a query sees all the keys of the levels above).
        num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode, use_fp16_qk_reduction, sm_scale,
        window_left, logits_soft_cap, rope_scale, rope_theta, q_data_type, kv_data_type
            As ``BatchPrefillWithPagedKVCacheWrapper.plan``, for every level.
        """
        for name, arr in (("qo_indptr_arr", qo_indptr_arr), ("paged_kv_indptr_arr", paged_kv_indptr_arr),
                          ("paged_kv_indices_arr", paged_kv_indices_arr), ("paged_kv_last_page_len", paged_kv_last_page_len)):
            _check_levels(arr, self._num_levels, name)
        last = self._num_levels - 1
        for i, wrapper in enumerate(self._batch_prefill_wrappers):
            wrapper.plan(
                qo_indptr_arr[i], paged_kv_indptr_arr[i], paged_kv_indices_arr[i], paged_kv_last_page_len[i],
                num_qo_heads, num_kv_heads, head_dim, page_size, causal=bool(causal) and i == last,
                pos_encoding_mode=pos_encoding_mode, use_fp16_qk_reduction=use_fp16_qk_reduction, sm_scale=sm_scale,
                window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
                q_data_type=q_data_type, kv_data_type=kv_data_type,
            )  # fmt: skip

    begin_forward = plan

    @aotinfer_api
    def run(self, q: torch.Tensor, paged_kv_cache: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        r"""Cascade attention of one layer: each level's attention over the same ``q`` and cache,
        merged from the last level up.

        Parameters
        ----------
        q : torch.Tensor
            ``[rows, num_qo_heads, head_dim]``, the planned dtype.
        paged_kv_cache : torch.Tensor or Tuple[torch.Tensor, torch.Tensor]
            The one cache every level's page table points into, as ``BatchPrefillWithPagedKVCacheWrapper.run``.

        Returns
        -------
        torch.Tensor
            ``[rows, num_qo_heads, head_dim]``, q's dtype.
        """
        out, lse = self._batch_prefill_wrappers[-1].run(q, paged_kv_cache, return_lse=True)
        for wrapper in self._batch_prefill_wrappers[:-1]:
            out_level, lse_level = wrapper.run(q, paged_kv_cache, return_lse=True)
            merge_state_in_place(out, lse, out_level, lse_level)
        return out

    forward = run


def _check_levels(arr: Any, num_levels: int, name: str) -> None:
    if not isinstance(arr, (list, tuple)) or len(arr) != num_levels:
        got = f"a list of {len(arr)}" if isinstance(arr, (list, tuple)) else type(arr).__name__
        raise ValueError(f"Expected {name} to be a list of num_levels = {num_levels} entries, got {got}")
