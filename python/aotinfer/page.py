"""Writes into a paged KV cache, at FlashInfer's API: append_paged_kv_cache and its helpers.

A request's KV sequence lives in pages ``kv_indices[kv_indptr[r]:kv_indptr[r + 1]]``, its token at
position ``p`` in entry ``p % page_size`` of page ``kv_indices[kv_indptr[r] + p // page_size]``.
The cache is a ``(k_cache, v_cache)`` pair of ``[pages, page_size, heads, head_dim]`` tensors (NHD)
or ``[pages, heads, page_size, head_dim]`` (HND), or one 5-D tensor with K at ``[:, 0]`` and V at
``[:, 1]``.
"""

from __future__ import annotations

from ._attention import unpack_kv_cache
from ._kernels import kernel
from .api_logging import aotinfer_api
from .trace.templates.page import (
    append_paged_kv_cache_trace,
    append_paged_mla_kv_cache_trace,
    get_batch_indices_positions_trace,
)
from .utils import check_int, check_tensor

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional, Tuple, Union

    import torch

_append_paged_kv_cache = kernel("page", "append_paged_kv_cache")
_get_batch_indices_positions = kernel("page", "get_batch_indices_positions")
_append_paged_mla_kv_cache = kernel("page", "append_paged_mla_kv_cache")

_KV_LAYOUTS = {"NHD": 0, "HND": 1}


def _is_tensor(value) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


@aotinfer_api(trace=append_paged_kv_cache_trace)
def append_paged_kv_cache(
    append_key: torch.Tensor,
    append_value: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    paged_kv_cache: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_layout: str = "NHD",
    *,
    skip_check: bool = False,
) -> None:
    """Copy new tokens' keys and values into their slots of a paged KV cache.

    Token ``i`` goes to entry ``positions[i] % page_size`` of page
    ``kv_indices[kv_indptr[batch_indices[i]] + positions[i] // page_size]``, every head.

    Parameters
    ----------
    append_key : torch.Tensor
        ``[nnz, num_kv_heads, head_dim]``, the cache's dtype (float16, bfloat16, float32 or FP8),
        last dimension contiguous.
    append_value : torch.Tensor
        ``[nnz, num_kv_heads, head_dim]``, ``append_key``'s dtype.
    batch_indices : torch.Tensor
        ``[nnz]``, int32 or int64: each token's request (see :func:`get_batch_indices_positions`).
    positions : torch.Tensor
        ``[nnz]``, int32 or int64: each token's position in its request's KV sequence.
    paged_kv_cache : Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]
        ``(k_cache, v_cache)``, each ``[pages, page_size, num_kv_heads, head_dim]`` (NHD) or
        ``[pages, num_kv_heads, page_size, head_dim]`` (HND); or one ``[pages, 2, ...]`` tensor.
        Written in place.
    kv_indices : torch.Tensor
        ``[kv_indptr[-1]]``, int32 or int64: the pages of every request, request after request.
    kv_indptr : torch.Tensor
        ``[batch_size + 1]``, int32 or int64.
    kv_last_page_len : torch.Tensor
        ``[batch_size]``, int32 or int64 (FlashInfer's argument; the slots follow from ``positions``).
    kv_layout : str
        ``"NHD"`` or ``"HND"``.
    skip_check : bool
        Skip the Python check of ``kv_layout`` (the binding still checks every tensor).

    Returns
    -------
    None
    """
    if not skip_check and kv_layout not in _KV_LAYOUTS:
        raise ValueError(f"Expected kv_layout to be 'NHD' or 'HND', got {kv_layout!r}")
    if isinstance(paged_kv_cache, (tuple, list)) and not all(_is_tensor(t) for t in paged_kv_cache):
        raise TypeError(f"Expected paged_kv_cache to be a torch.Tensor, got {type(paged_kv_cache).__name__} of "
                        f"{', '.join(type(t).__name__ for t in paged_kv_cache)} (a (k_cache, v_cache) pair holds two tensors)")
    k_cache, v_cache = unpack_kv_cache(paged_kv_cache, kv_layout)
    _append_paged_kv_cache(k_cache, v_cache, append_key, append_value, batch_indices, positions, kv_indices,
                           kv_indptr, kv_last_page_len, _KV_LAYOUTS[kv_layout], -1)


@aotinfer_api(trace=append_paged_mla_kv_cache_trace)
def append_paged_mla_kv_cache(
    append_ckv: torch.Tensor,
    append_kpe: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    *,
    skip_check: bool = False,
) -> None:
    """MLA's append: new tokens' compressed KV and rotary key copied into their slots.

    Token ``i`` goes to entry ``positions[i] % page_size`` of page
    ``kv_indices[kv_indptr[batch_indices[i]] + positions[i] // page_size]`` of both caches.

    Parameters
    ----------
    append_ckv : torch.Tensor
        ``[nnz, ckv_dim]`` (512 for DeepSeek), float16, bfloat16, float32 or FP8, last dimension contiguous.
    append_kpe : torch.Tensor
        ``[nnz, kpe_dim]`` (64), ``append_ckv``'s dtype.
    batch_indices, positions : torch.Tensor
        ``[nnz]``, int32 or int64 (see :func:`get_batch_indices_positions`).
    ckv_cache : torch.Tensor
        ``[pages, page_size, ckv_dim]``, ``append_ckv``'s dtype; written in place.
    kpe_cache : torch.Tensor
        ``[pages, page_size, kpe_dim]``; written in place.
    kv_indices, kv_indptr, kv_last_page_len : torch.Tensor
        As for :func:`append_paged_kv_cache`.
    skip_check : bool
        No Python checks to skip (the binding checks every tensor); for a uniform signature.

    Returns
    -------
    None
    """
    _append_paged_mla_kv_cache(ckv_cache, kpe_cache, append_ckv, append_kpe, batch_indices, positions, kv_indices,
                               kv_indptr, kv_last_page_len, -1)


@aotinfer_api(trace=get_batch_indices_positions_trace)
def get_batch_indices_positions(
    append_indptr: torch.Tensor,
    seq_lens: torch.Tensor,
    nnz: int,
    batch_indices: Optional[torch.Tensor] = None,
    positions: Optional[torch.Tensor] = None,
    *,
    skip_check: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each new token's request and position, for :func:`append_paged_kv_cache`.

    Token ``append_indptr[r] <= i < append_indptr[r + 1]`` is one of the last new tokens of
    request ``r``, whose KV sequence (new tokens included) has ``seq_lens[r]`` tokens:
    ``batch_indices[i] = r``, ``positions[i] = seq_lens[r] - (append_indptr[r + 1] - i)``.

    Parameters
    ----------
    append_indptr : torch.Tensor
        ``[batch_size + 1]``, int32 or int64.
    seq_lens : torch.Tensor
        ``[batch_size]``, int32 or int64: each request's KV length after the append.
    nnz : int
        The new tokens (``append_indptr[-1]``; entries past it get batch index -1, position 0).
    batch_indices, positions : Optional[torch.Tensor]
        ``[nnz]`` int32 tensors to write to; allocated when missing.
    skip_check : bool
        Skip the Python check of ``nnz``.

    Returns
    -------
    Tuple[torch.Tensor, torch.Tensor]
        ``(batch_indices, positions)``, each ``[nnz]`` int32 on ``append_indptr``'s device.
    """
    check_tensor(append_indptr, "append_indptr")  # its device is read here, with or without skip_check
    if not skip_check:
        check_int(nnz, "nnz", 0)
        # The kernel writes up to append_indptr[-1], which only the device knows: the given
        # tensors must hold nnz entries, as the caller promises nnz >= append_indptr[-1].
        for tensor, name in ((batch_indices, "batch_indices"), (positions, "positions")):
            if tensor is not None and tuple(tensor.shape) != (nnz,):
                raise ValueError(f"Expected {name} to have shape [{nnz}] (nnz), got {list(tensor.shape)}")
    import torch

    device = append_indptr.device
    if batch_indices is None:
        batch_indices = torch.full((nnz,), -1, dtype=torch.int32, device=device)
    else:
        batch_indices.fill_(-1)
    if positions is None:
        positions = torch.zeros((nnz,), dtype=torch.int32, device=device)
    else:
        positions.zero_()
    _get_batch_indices_positions(batch_indices, positions, append_indptr, seq_lens, -1)
    return batch_indices, positions


@aotinfer_api
def get_seq_lens(
    kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int, *, skip_check: bool = False
) -> torch.Tensor:
    """Each request's KV length from its pages: ``max(pages - 1, 0) * page_size + kv_last_page_len``.

    ``kv_indptr``: ``[batch_size + 1]``, ``kv_last_page_len``: ``[batch_size]`` (integer tensors).
    Returns a ``[batch_size]`` tensor of their dtype. Torch work alone (no kernel); ``skip_check``
    skips the check of ``page_size``.
    """
    if not skip_check:
        check_int(page_size, "page_size", 1)
    return (kv_indptr[1:] - kv_indptr[:-1] - 1).clamp(min=0) * page_size + kv_last_page_len
