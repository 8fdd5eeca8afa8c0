"""MLA attention for DeepSeek-class models (module ``flashinfer.mla``): BatchMLAPagedAttentionWrapper.

Multi-head latent attention in its absorbed form, for decode and incremental prefill: every query
head attends one latent KV head. A token's key is its compressed KV ``ckv`` (512 dims) and its
rotary part ``kpe`` (64 dims); its value is its ``ckv``. Query row ``(token, head)`` has
``q_nope`` (512) and ``q_pe`` (64)::

    logit = sm_scale * (q_nope . ckv + q_pe . kpe)
    out   = sum over keys of softmax(logit) * ckv            (512 dims)

``causal``: query token i of a request's ``q_len`` sees keys ``j <= i + kv_len - q_len`` (the
query tokens are the last of the sequence: MTP and incremental prefill). The caches are paged:
``ckv_cache [pages, page_size, 512]`` and ``kpe_cache [pages, page_size, 64]`` (``[pages, dim]`` for
page_size 1), a request's pages listed in ``kv_indices`` from ``kv_indptr``. The LSE is base 2 (as
FlashInfer's), or natural with ``return_lse_base_on_e``.

The work is the prefill plan's (aotinfer.prefill) for one KV head: tiles of 32 packed rows (a
token's heads side by side), and keys split over the GPU where the tiles leave it idle, their
partials merged. The kernel (include/aotinfer/mla.cuh, module ``mla``) runs on tensor cores on every
arch from sm80; docs/design/mla.md has its design and figures.

Not implemented (NotImplementedError): fp8 caches, a cache without its rotary part
(``head_dim_kpe=0``), ``backend="fa3"`` and FlashInfer's other MLA backends (``"auto"`` and ``"fa2"``
run this kernel), the profiler; other head dims than 512 and 64 are a ValueError.
"""

from __future__ import annotations

import math

from ._attention import check_dtypes, check_int32
from ._kernels import kernel
from .api_logging import aotinfer_api
from .prefill import _BatchPrefillWrapper
from .prefill import _request_lengths as prefill_request_lengths
from .trace.template import dtype_name
from .utils import check_enable_pdl, check_int, check_real, check_tensor

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Optional, Tuple, Union

    import torch

_batch_mla = kernel("mla", "batch_mla")

HEAD_DIM_CKV, HEAD_DIM_KPE = 512, 64
#: FlashInfer's MLA backends; this kernel serves "auto" and "fa2".
_BACKENDS = ("auto", "fa2", "fa3", "cutlass", "cutile", "trtllm-gen", "xqa", "cute-dsl", "cute-dsl-monolithic",
             "cute-dsl-modular")  # fmt: skip
_LN2 = math.log(2.0)


def _split(value: Any, name: str) -> Tuple[Any, Any]:
    """A structural ``query=`` / ``kv_cache=`` value as its (512-dim, 64-dim) parts: a pair, or one
    tensor whose last dimension joins them (views of it)."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"Expected {name} to be a pair of tensors (no-PE part, PE part), got {len(value)}")
        return value[0], value[1]
    check_tensor(value, name)
    if value.shape[-1] != HEAD_DIM_CKV + HEAD_DIM_KPE:
        raise ValueError(f"Expected the last dimension of a packed {name} to be {HEAD_DIM_CKV + HEAD_DIM_KPE}, got {list(value.shape)}")
    return value[..., :HEAD_DIM_CKV], value[..., HEAD_DIM_CKV:]


def _request_lengths(qo_indptr: Any, kv_indptr: Any, kv_len_arr: Any, page_size: int, num_indices: int, device: Any):
    """int64 ``[4, batch]`` on the host, each request's q_begin, q_len, first page (in
    ``kv_indices``) and kv_len, and the query tokens in all. As FlashInfer's MLA plan reads them,
    request i's pages start at ``kv_indptr[i]`` and its length is ``kv_len_arr[i]``: ``kv_indptr``
    needs no end entry (FlashInfer's own tests pass one interleaved with others'), but each request's
    pages must lie inside ``kv_indices``. A ``kv_indptr`` that is an indptr of the batch (what
    servers pass) is read by the prefill plan's compiled code, 4-5x faster on the host; what that
    refuses, this reading decides."""
    import torch

    for value, name in ((qo_indptr, "qo_indptr"), (kv_indptr, "kv_indptr"), (kv_len_arr, "kv_len_arr")):
        check_int32(value, name)
    if kv_indptr.numel() == qo_indptr.numel() == kv_len_arr.numel() + 1:
        try:
            lengths, total_q, _ = prefill_request_lengths(qo_indptr, kv_indptr, "kv_indptr", device, None, kv_len_arr,
                                                          page_size, num_indices)  # fmt: skip
            return lengths, total_q
        except ValueError:
            pass
    if qo_indptr.dim() != 1 or qo_indptr.numel() < 1:
        raise ValueError(f"Expected qo_indptr to have batch_size + 1 elements, got shape {list(qo_indptr.shape)}")
    qo = qo_indptr.to("cpu", torch.int64)
    batch = qo.numel() - 1
    kv_len = kv_len_arr.to("cpu", torch.int64).reshape(-1)
    first_page = kv_indptr.to("cpu", torch.int64).reshape(-1)[:batch]
    if kv_len.numel() != batch or first_page.numel() != batch:
        raise ValueError(
            f"Expected kv_len_arr to have batch_size = {batch} elements and kv_indptr at least that many (batch_size "
            f"from qo_indptr), got {kv_len.numel()} and {kv_indptr.numel()}"
        )
    q_len = qo[1:] - qo[:-1]
    for bad, what in ((qo[0] != 0, "qo_indptr to start at 0"), ((q_len < 0).any(), "qo_indptr never to decrease"),
                      ((kv_len < 0).any(), "kv_len_arr >= 0"), ((first_page < 0).any(), "kv_indptr >= 0")):  # fmt: skip
        if bool(bad):
            raise ValueError(f"Expected {what}")
    last = first_page + (kv_len + page_size - 1) // page_size
    outside = (last > num_indices).nonzero()
    if outside.numel():
        i = int(outside[0])
        raise ValueError(
            f"Expected request {i}'s pages (kv_indptr[{i}] = {int(first_page[i])}, kv_len_arr[{i}] = {int(kv_len[i])} "
            f"tokens of page_size {page_size}) inside kv_indices' {num_indices} page ids"
        )
    return torch.stack((qo[:-1], q_len, first_page, kv_len)), int(qo[-1])


class BatchMLAPagedAttentionWrapper(_BatchPrefillWrapper):
    r"""MLA attention over a paged latent cache (FlashInfer's wrapper): ``plan`` once per batch,
    ``run`` once per layer. See the module doc.

    >>> workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    >>> wrapper = aotinfer.BatchMLAPagedAttentionWrapper(workspace)
    >>> wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, 128, 512, 64, 64, False, 1 / math.sqrt(192),
    ...              torch.bfloat16, torch.bfloat16)
    >>> out = wrapper.run(q_nope, q_pe, ckv_cache, kpe_cache)  # [tokens, 128, 512]
    """

    @aotinfer_api
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        use_cuda_graph: bool = False,
        qo_indptr: Optional[torch.Tensor] = None,
        kv_indptr: Optional[torch.Tensor] = None,
        kv_indices: Optional[torch.Tensor] = None,
        kv_len_arr: Optional[torch.Tensor] = None,
        backend: str = "auto",
    ) -> None:
        r"""
        Parameters
        ----------
        float_workspace_buffer : torch.Tensor
            Holds the partial results of split requests (128 MB is plenty; ``plan`` says when it is
            too small).
        use_cuda_graph : bool
            ``run`` reads the page ids from ``kv_indices``, which ``plan`` fills, and launches a
            fixed grid: a captured ``run`` replays right after ``plan`` with a new page table of the
            same batch size. Without it, a captured ``run`` replays right under its own plan only,
            and the wrapper refuses a new ``plan`` (RuntimeError).
        qo_indptr, kv_indptr, kv_indices, kv_len_arr : Optional[torch.Tensor]
            With ``use_cuda_graph``: int32 GPU buffers of ``batch_size + 1``, ``batch_size + 1``,
            the most page ids any plan uses, and ``batch_size`` elements.
        backend : str
            ``"auto"`` or ``"fa2"``: the kernel of every arch from sm80. FlashInfer's others raise
            NotImplementedError.
        """
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(map(repr, _BACKENDS))}, got {backend!r}")
        if backend not in ("auto", "fa2"):
            raise NotImplementedError(f"backend={backend!r} is not implemented: 'auto' and 'fa2' run the MLA kernel of every arch")
        self._init_common(float_workspace_buffer, "NHD", use_cuda_graph, "fa2", None, None)
        self._mla_backend = backend
        if self._use_cuda_graph:
            self._fix_batch_size(
                {"qo_indptr": qo_indptr, "kv_indptr": kv_indptr, "kv_indices": kv_indices, "kv_len_arr": kv_len_arr},
                "kv_len_arr",
            )
        self._qo_indptr_buf, self._kv_indptr_buf = qo_indptr, kv_indptr
        self._kv_indices_buf, self._kv_len_arr_buf = kv_indices, kv_len_arr

    def _tile_rows(self, head_dim_vo: int, sm90: bool) -> int:
        return 32  # mla.cuh's MlaShape::kTileQ

    @aotinfer_api
    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_len_arr: torch.Tensor,
        num_heads: int,
        head_dim_ckv: int,
        head_dim_kpe: int,
        page_size: int,
        causal: bool,
        sm_scale: float,
        q_data_type: torch.dtype,
        kv_data_type: torch.dtype,
        use_profiler: bool = False,
    ) -> None:
        r"""Plan attention for a batch (host work; one copy of the tables to the GPU).

        Parameters
        ----------
        qo_indptr : torch.Tensor
            int32 ``[batch_size + 1]``: request i's query tokens are rows ``qo_indptr[i]:qo_indptr[i + 1]``.
        kv_indptr : torch.Tensor
            int32 ``[batch_size + 1]``: its pages are ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``.
        kv_indices : torch.Tensor
            int32 page ids.
        kv_len_arr : torch.Tensor
            int32 ``[batch_size]``: each request's tokens in its pages.
        num_heads : int
            Query heads (of this tensor-parallel rank).
        head_dim_ckv, head_dim_kpe : int
            512 and 64.
        page_size : int
            Tokens a page.
        causal : bool
            Each query token sees the keys up to its own position (several query tokens a request).
        sm_scale : float
            Logit scale (DeepSeek's: ``1 / sqrt(192)`` times its rope scaling factor).
        q_data_type, kv_data_type : torch.dtype
            float16 or bfloat16, the same.
        use_profiler : bool
            False (True raises NotImplementedError).
        """
        self._check_not_captured()
        check_int(num_heads, "num_heads", 1)
        check_int(page_size, "page_size", 1)
        for value, name, want in ((head_dim_ckv, "head_dim_ckv", HEAD_DIM_CKV), (head_dim_kpe, "head_dim_kpe", HEAD_DIM_KPE)):
            check_int(value, name, 0)
            if name == "head_dim_kpe" and value == 0:
                raise NotImplementedError("head_dim_kpe=0 (a latent cache without its rotary part) is not implemented")
            if value != want:
                raise ValueError(f"Expected {name} {want} (DeepSeek's latent cache), got {value}")
        if not isinstance(causal, bool):
            raise TypeError(f"Expected causal to be a bool, got {type(causal).__name__}")
        check_real(sm_scale, "sm_scale")
        if not sm_scale > 0:
            raise ValueError(f"Expected sm_scale > 0, got {sm_scale}")
        if use_profiler:
            raise NotImplementedError("use_profiler=True is not implemented")
        q_dtype, kv_dtype = check_dtypes(q_data_type, kv_data_type, None, fp8_kv=True)
        if kv_dtype != q_dtype:
            raise NotImplementedError(f"a {dtype_name(kv_dtype)} latent cache is not implemented: the cache takes q's dtype")
        check_int32(kv_indices, "kv_indices")
        lengths, total_q = _request_lengths(qo_indptr, kv_indptr, kv_len_arr, page_size, kv_indices.numel(), self.device)
        # The page ids the requests read: a longer kv_indices (a server's pool of them) is not copied,
        # and the kernel is handed the first `used` ids (under CUDA graphs the buffer's, one at least,
        # so that every plan hands the address a captured run holds).
        used = int((lengths[2] + (lengths[3] + page_size - 1) // page_size).max()) if lengths.shape[1] else 0
        if self._use_cuda_graph and used > self._kv_indices_buf.numel():
            raise ValueError(f"Expected at most {self._kv_indices_buf.numel()} page ids (kv_indices' buffer), the requests read {used}")
        if self._use_cuda_graph:
            indices = self._kv_indices_buf[: max(used, 1)]
        else:
            indices = kv_indices[:used].to(self.device, non_blocking=True)
        self._plan_common(
            lengths, total_q, num_heads, 1, HEAD_DIM_CKV + HEAD_DIM_KPE, HEAD_DIM_CKV, page_size, causal, "NONE", -1, None,
            sm_scale, None, None, q_dtype, kv_dtype, None, False, True, indices, 0,
        )  # fmt: skip
        self._plan.binding = _batch_mla
        self._pages_read = used
        if self._use_cuda_graph:
            for buffer, value in ((self._qo_indptr_buf, qo_indptr), (self._kv_indptr_buf, kv_indptr), (self._kv_len_arr_buf, kv_len_arr)):
                buffer[: value.numel()].copy_(value[: buffer.numel()], non_blocking=True)
            if kv_indices.data_ptr() != self._kv_indices_buf.data_ptr():
                self._kv_indices_buf[:used].copy_(kv_indices[:used], non_blocking=True)
        else:
            self._qo_indptr_buf, self._kv_indptr_buf, self._kv_indices_buf = qo_indptr, kv_indptr, indices
            self._kv_len_arr_buf = kv_len_arr

    @aotinfer_api
    def run(
        self,
        q_nope: Optional[torch.Tensor] = None,
        q_pe: Optional[torch.Tensor] = None,
        ckv_cache: Optional[torch.Tensor] = None,
        kpe_cache: Optional[torch.Tensor] = None,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        return_lse: bool = False,
        profiler_buffer: Optional[torch.Tensor] = None,
        kv_len: Optional[torch.Tensor] = None,
        page_table: Optional[torch.Tensor] = None,
        return_lse_base_on_e: bool = False,
        *,
        query: Any = None,
        kv_cache: Any = None,
        enable_pdl: Optional[bool] = None,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        r"""MLA attention of one layer with the planned page table. Launches only.

        Parameters
        ----------
        q_nope, q_pe : torch.Tensor
            ``[qo_indptr[-1], num_heads, 512]`` and ``[..., 64]`` of the planned dtype (rows of 16
            bytes, last dimension contiguous); or ``query=``: the pair, or one tensor ``[..., 576]``.
        ckv_cache, kpe_cache : torch.Tensor
            ``[pages, page_size, 512]`` and ``[pages, page_size, 64]`` (``[pages, dim]`` for page_size
            1); or ``kv_cache=``: the pair, or one tensor ``[pages, page_size, 576]``.
        out : Optional[torch.Tensor]
            ``[qo_indptr[-1], num_heads, 512]`` of q's dtype; allocated when None.
        lse : Optional[torch.Tensor]
            float32 ``[qo_indptr[-1], num_heads]``; allocated when None and ``return_lse``.
        return_lse : bool
            Also return the log-sum-exp: base 2, or natural with ``return_lse_base_on_e``.
        profiler_buffer, kv_len, page_table : None
            FlashInfer's profiler and CUTLASS metadata: not taken here (ValueError if given).
        enable_pdl : Optional[bool]
            Programmatic dependent launch: None where the GPU supports it.

        Returns
        -------
        torch.Tensor or Tuple[torch.Tensor, torch.Tensor]
            ``out``, or ``(out, lse)`` with ``return_lse``.
        """
        import torch

        if query is not None:
            if q_nope is not None or q_pe is not None:
                raise ValueError("Expected query= or q_nope and q_pe, got both")
            q_nope, q_pe = _split(query, "query")
        if kv_cache is not None:
            if ckv_cache is not None or kpe_cache is not None:
                raise ValueError("Expected kv_cache= or ckv_cache and kpe_cache, got both")
            ckv_cache, kpe_cache = _split(kv_cache, "kv_cache")
        for value, name in ((profiler_buffer, "profiler_buffer"), (kv_len, "kv_len"), (page_table, "page_table")):
            if value is not None:
                raise ValueError(f"Expected {name} to be None: the plan holds the page table (CUTLASS's run-time form is not taken)")
        check_enable_pdl(enable_pdl)
        plan = self._plan
        if plan is None:
            raise RuntimeError("BatchMLAPagedAttentionWrapper.run: call plan() first")
        for value, name in ((q_nope, "q_nope"), (q_pe, "q_pe"), (ckv_cache, "ckv_cache"), (kpe_cache, "kpe_cache")):
            check_tensor(value, name)
        if q_nope.dim() != 3 or q_nope.shape[0] < plan.total_q or q_nope.shape[1] != plan.num_qo_heads:
            raise ValueError(
                f"Expected q_nope to have shape [at least qo_indptr[-1] = {plan.total_q}, num_heads = {plan.num_qo_heads}, "
                f"512] as planned, got {list(q_nope.shape)}"
            )
        if q_nope.dtype != plan.q_dtype:
            raise ValueError(f"The dtype of q_nope {q_nope.dtype} does not match the q_data_type {plan.q_dtype} specified in plan")
        page_size = ckv_cache.shape[1] if ckv_cache.dim() == 3 else 1
        if page_size != plan.page_size:
            raise ValueError(f"Expected ckv_cache with the planned page_size {plan.page_size}, got {page_size}")
        self._require_workspace_on(q_nope.device)
        indices = plan.indices
        if ckv_cache.shape[0] == 0:  # a cache of no pages: the plan's requests must read none
            if self._pages_read:
                raise ValueError(f"Expected ckv_cache to have pages: the planned requests read {self._pages_read} page ids")
            indices = indices[:0]
        if out is None:
            out = torch.empty((q_nope.shape[0], q_nope.shape[1], HEAD_DIM_CKV), dtype=q_nope.dtype, device=q_nope.device)
        if lse is None and return_lse:
            lse = torch.empty(q_nope.shape[:2], dtype=torch.float32, device=q_nope.device)
        _batch_mla(
            out, plan.empty if lse is None else lse, plan.partial_out, plan.partial_lse, q_nope, q_pe, ckv_cache, kpe_cache,
            indices, plan.work, plan.requests, self._captured_address, self._sm_scale, self._causal, plan.ctas,
            plan.merge_from, -1 if enable_pdl is None else enable_pdl,
        )  # fmt: skip
        if lse is not None and return_lse_base_on_e:
            lse.mul_(_LN2)
        return (out, lse) if return_lse else out


__all__ = ["BatchMLAPagedAttentionWrapper"]
