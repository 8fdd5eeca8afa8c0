"""Rotary position embedding (RoPE) of queries and keys, at FlashInfer's API.

Each op rotates the first ``rotary_dim`` dims of every head of ``q`` and ``k`` by angles
``pos * inv_freq_j`` and leaves the rest as they are. Positions come from ``pos_ids`` (one per
token) or from ``indptr``/``offsets`` (token ``indptr[r] + i`` of request ``r`` sits at
``offsets[r] + i``). Frequencies are ``inv_freq_j = rope_theta ** (-2j / rotary_dim) / rope_scale``,
Llama 3.1's blend of that with the unscaled frequency, or read from a float32 cos/sin cache. Layouts:
NeoX (``interleave=False``: dim ``j`` turns with dim ``j + rotary_dim / 2``) or interleaved
(``interleave=True``: dims ``2j`` and ``2j + 1`` turn together).

Tensors are float16 or bfloat16 ``[nnz, num_heads, head_dim]`` with the last dimension
contiguous; the other strides are free, so ``q`` and ``k`` may be slices of a fused qkv tensor.
cos/sin are computed in float32 with accurate ``powf``/``sincosf``; each output is rounded once.
"""

from __future__ import annotations

from ._kernels import kernel
from .api_logging import aotinfer_api
from .trace.templates.rope import (
    apply_llama31_rope_inplace_trace,
    apply_llama31_rope_pos_ids_inplace_trace,
    apply_llama31_rope_pos_ids_trace,
    apply_llama31_rope_trace,
    apply_rope_inplace_trace,
    apply_rope_pos_ids_inplace_trace,
    apply_rope_pos_ids_trace,
    apply_rope_trace,
    apply_rope_with_cos_sin_cache_inplace_trace,
    apply_rope_with_cos_sin_cache_trace,
    rope_quantize_fp8_trace,
)
from .utils import check_enable_pdl, check_int, check_real, check_tensor

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional, Tuple

    import torch

_apply_rope = kernel("rope", "apply_rope")
_apply_llama31_rope = kernel("rope", "apply_llama31_rope")
_apply_rope_pos_ids = kernel("rope", "apply_rope_pos_ids")
_apply_llama31_rope_pos_ids = kernel("rope", "apply_llama31_rope_pos_ids")
_apply_rope_pos_ids_cos_sin_cache = kernel("rope", "apply_rope_pos_ids_cos_sin_cache")
_rope_quantize = kernel("rope", "rope_quantize")


def _check_bool(value, name: str) -> None:
    if type(value) is not bool:
        raise TypeError(f"Expected {name} to be a bool, got {type(value).__name__}")


def _check_rope_scalars(q, rotary_dim, interleave, rope_scale, rope_theta) -> None:
    """What the bindings cannot name: the scalars' types (their values and every tensor are the
    binding's to check)."""
    if rotary_dim is not None:
        check_int(rotary_dim, "rotary_dim", 1)
    _check_bool(interleave, "interleave")
    check_real(rope_scale, "rope_scale")
    check_real(rope_theta, "rope_theta")


def _check_q_k(q, k) -> None:
    """q and k are read here (their shapes, torch.empty_like) before a binding sees them: named
    with or without skip_check."""
    check_tensor(q, "q")
    check_tensor(k, "k")


def _check_llama31_scalars(low_freq_factor, high_freq_factor, old_context_len) -> None:
    check_real(low_freq_factor, "low_freq_factor")
    check_real(high_freq_factor, "high_freq_factor")
    check_real(old_context_len, "old_context_len")


# ---- RoPE with indptr/offsets ---------------------------------------------------------------------


@aotinfer_api(trace=apply_rope_trace)
def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    indptr: torch.Tensor,
    offsets: torch.Tensor,
    rotary_dim: Optional[int] = None,
    interleave: bool = False,
    rope_scale: float = 1,
    rope_theta: float = 1e4,
    *,
    skip_check: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys of a ragged batch; token ``indptr[r] + i`` at ``offsets[r] + i``.

    Parameters
    ----------
    q : torch.Tensor
        ``[nnz, num_qo_heads, head_dim]``, float16 or bfloat16, ``nnz = indptr[-1]``.
    k : torch.Tensor
        ``[nnz, num_kv_heads, head_dim]``, ``q``'s dtype.
    indptr : torch.Tensor
        ``[batch_size + 1]``, int32 or int64: each request's first token.
    offsets : torch.Tensor
        ``[batch_size]``, ``indptr``'s dtype: the position of each request's first token.
    rotary_dim : Optional[int]
        Dims of each head to rotate (the first ones); even (a multiple of 4 unless interleaved),
        at most ``head_dim``. Default: ``head_dim``.
    interleave : bool
        True: dims ``(2j, 2j + 1)`` turn together; False (NeoX): dims ``j`` and ``j + rotary_dim / 2``.
    rope_scale : float
        Positions are divided by it (frequencies scaled by ``1 / rope_scale``).
    rope_theta : float
        Base of the frequencies ``rope_theta ** (-2j / rotary_dim)``.
    skip_check : bool
        Skip the Python checks of the scalars (the binding still checks every tensor).

    Returns
    -------
    Tuple[torch.Tensor, torch.Tensor]
        ``(q_rope, k_rope)``, new contiguous tensors of ``q``'s and ``k``'s shapes and dtype.
    """
    _check_q_k(q, k)
    if not skip_check:
        _check_rope_scalars(q, rotary_dim, interleave, rope_scale, rope_theta)
    import torch

    q_rope = torch.empty_like(q)
    k_rope = torch.empty_like(k)
    _apply_rope(q_rope, k_rope, q, k, indptr, offsets, q.shape[-1] if rotary_dim is None else rotary_dim,
                interleave, rope_scale, rope_theta, -1)
    return q_rope, k_rope


@aotinfer_api(trace=apply_rope_inplace_trace)
def apply_rope_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    indptr: torch.Tensor,
    offsets: torch.Tensor,
    rotary_dim: Optional[int] = None,
    interleave: bool = False,
    rope_scale: float = 1,
    rope_theta: float = 1e4,
    *,
    skip_check: bool = False,
) -> None:
    """:func:`apply_rope` written into ``q`` and ``k`` themselves (dims past ``rotary_dim`` are
    neither read nor written). Same arguments; returns None."""
    _check_q_k(q, k)
    if not skip_check:
        _check_rope_scalars(q, rotary_dim, interleave, rope_scale, rope_theta)
    _apply_rope(q, k, q, k, indptr, offsets, q.shape[-1] if rotary_dim is None else rotary_dim, interleave,
                rope_scale, rope_theta, -1)


@aotinfer_api(trace=apply_llama31_rope_trace)
def apply_llama31_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    indptr: torch.Tensor,
    offsets: torch.Tensor,
    rotary_dim: Optional[int] = None,
    interleave: bool = False,
    rope_scale: float = 8,
    rope_theta: float = 5e5,
    low_freq_factor: float = 1,
    high_freq_factor: float = 4,
    old_context_len: int = 8192,
    *,
    skip_check: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rope` with Llama 3.1's frequencies: each ``f = rope_theta ** (-2j / rotary_dim)``
    becomes ``(1 - s) * f / rope_scale + s * f`` with
    ``s = clamp((old_context_len * f / (2 pi) - low_freq_factor) / (high_freq_factor - low_freq_factor), 0, 1)``
    (wavelengths shorter than ``old_context_len / high_freq_factor`` keep ``f``, longer than
    ``old_context_len / low_freq_factor`` get ``f / rope_scale``).

    Shapes and dtypes as :func:`apply_rope`; ``0 < low_freq_factor < high_freq_factor``,
    ``old_context_len > 0``. Returns ``(q_rope, k_rope)``, new tensors of ``q``'s and ``k``'s
    shapes and dtype.
    """
    _check_q_k(q, k)
    if not skip_check:
        _check_rope_scalars(q, rotary_dim, interleave, rope_scale, rope_theta)
        _check_llama31_scalars(low_freq_factor, high_freq_factor, old_context_len)
    import torch

    q_rope = torch.empty_like(q)
    k_rope = torch.empty_like(k)
    _apply_llama31_rope(q_rope, k_rope, q, k, indptr, offsets, q.shape[-1] if rotary_dim is None else rotary_dim,
                        interleave, rope_scale, rope_theta, low_freq_factor, high_freq_factor,
                        float(old_context_len), -1)
    return q_rope, k_rope


@aotinfer_api(trace=apply_llama31_rope_inplace_trace)
def apply_llama31_rope_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    indptr: torch.Tensor,
    offsets: torch.Tensor,
    rotary_dim: Optional[int] = None,
    interleave: bool = False,
    rope_scale: float = 8,
    rope_theta: float = 5e5,
    low_freq_factor: float = 1,
    high_freq_factor: float = 4,
    old_context_len: int = 8192,
    *,
    skip_check: bool = False,
) -> None:
    """:func:`apply_llama31_rope` written into ``q`` and ``k`` themselves. Returns None."""
    _check_q_k(q, k)
    if not skip_check:
        _check_rope_scalars(q, rotary_dim, interleave, rope_scale, rope_theta)
        _check_llama31_scalars(low_freq_factor, high_freq_factor, old_context_len)
    _apply_llama31_rope(q, k, q, k, indptr, offsets, q.shape[-1] if rotary_dim is None else rotary_dim,
                        interleave, rope_scale, rope_theta, low_freq_factor, high_freq_factor,
                        float(old_context_len), -1)


# ---- RoPE with pos_ids ----------------------------------------------------------------------------


@aotinfer_api(trace=apply_rope_pos_ids_trace)
def apply_rope_pos_ids(
    q: torch.Tensor,
    k: torch.Tensor,
    pos_ids: torch.Tensor,
    rotary_dim: Optional[int] = None,
    interleave: bool = False,
    rope_scale: float = 1,
    rope_theta: float = 1e4,
    *,
    skip_check: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rope` with one position per token: ``pos_ids`` is ``[nnz]``, int32 or int64.

    ``q``: ``[nnz, num_qo_heads, head_dim]``, ``k``: ``[nnz, num_kv_heads, head_dim]``, float16 or
    bfloat16. Returns ``(q_rope, k_rope)``, new tensors of ``q``'s and ``k``'s shapes and dtype.
    """
    _check_q_k(q, k)
    if not skip_check:
        _check_rope_scalars(q, rotary_dim, interleave, rope_scale, rope_theta)
    import torch

    q_rope = torch.empty_like(q)
    k_rope = torch.empty_like(k)
    _apply_rope_pos_ids(q_rope, k_rope, q, k, pos_ids, q.shape[-1] if rotary_dim is None else rotary_dim,
                        interleave, rope_scale, rope_theta, -1)
    return q_rope, k_rope


@aotinfer_api(trace=apply_rope_pos_ids_inplace_trace)
def apply_rope_pos_ids_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    pos_ids: torch.Tensor,
    rotary_dim: Optional[int] = None,
    interleave: bool = False,
    rope_scale: float = 1,
    rope_theta: float = 1e4,
    *,
    skip_check: bool = False,
) -> None:
    """:func:`apply_rope_pos_ids` written into ``q`` and ``k`` themselves. Returns None."""
    _check_q_k(q, k)
    if not skip_check:
        _check_rope_scalars(q, rotary_dim, interleave, rope_scale, rope_theta)
    _apply_rope_pos_ids(q, k, q, k, pos_ids, q.shape[-1] if rotary_dim is None else rotary_dim, interleave,
                        rope_scale, rope_theta, -1)


@aotinfer_api(trace=apply_llama31_rope_pos_ids_trace)
def apply_llama31_rope_pos_ids(
    q: torch.Tensor,
    k: torch.Tensor,
    pos_ids: torch.Tensor,
    rotary_dim: Optional[int] = None,
    interleave: bool = False,
    rope_scale: float = 8,
    rope_theta: float = 5e5,
    low_freq_factor: float = 1,
    high_freq_factor: float = 4,
    old_context_len: int = 8192,
    *,
    skip_check: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_llama31_rope` with one position per token (``pos_ids``: ``[nnz]``, int32 or
    int64). Returns ``(q_rope, k_rope)``, new tensors of ``q``'s and ``k``'s shapes and dtype."""
    _check_q_k(q, k)
    if not skip_check:
        _check_rope_scalars(q, rotary_dim, interleave, rope_scale, rope_theta)
        _check_llama31_scalars(low_freq_factor, high_freq_factor, old_context_len)
    import torch

    q_rope = torch.empty_like(q)
    k_rope = torch.empty_like(k)
    _apply_llama31_rope_pos_ids(q_rope, k_rope, q, k, pos_ids, q.shape[-1] if rotary_dim is None else rotary_dim,
                                interleave, rope_scale, rope_theta, low_freq_factor, high_freq_factor,
                                float(old_context_len), -1)
    return q_rope, k_rope


@aotinfer_api(trace=apply_llama31_rope_pos_ids_inplace_trace)
def apply_llama31_rope_pos_ids_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    pos_ids: torch.Tensor,
    rotary_dim: Optional[int] = None,
    interleave: bool = False,
    rope_scale: float = 8,
    rope_theta: float = 5e5,
    low_freq_factor: float = 1,
    high_freq_factor: float = 4,
    old_context_len: int = 8192,
    *,
    skip_check: bool = False,
) -> None:
    """:func:`apply_llama31_rope_pos_ids` written into ``q`` and ``k`` themselves. Returns None."""
    _check_q_k(q, k)
    if not skip_check:
        _check_rope_scalars(q, rotary_dim, interleave, rope_scale, rope_theta)
        _check_llama31_scalars(low_freq_factor, high_freq_factor, old_context_len)
    _apply_llama31_rope_pos_ids(q, k, q, k, pos_ids, q.shape[-1] if rotary_dim is None else rotary_dim,
                                interleave, rope_scale, rope_theta, low_freq_factor, high_freq_factor,
                                float(old_context_len), -1)


# ---- RoPE with a cos/sin cache (vLLM's and SGLang's call) -----------------------------------------


def _check_cos_sin_cache_call(query, key, head_size, is_neox) -> None:
    check_int(head_size, "head_size", 1)
    _check_bool(is_neox, "is_neox")
    for tensor, name in ((query, "query"), (key, "key")):
        if tensor.dim() < 2 or tensor.shape[-1] % head_size != 0:
            raise ValueError(
                f"Expected {name} to have shape [nnz, num_heads * head_size] with head_size {head_size},"
                f" got {list(tensor.shape)}"
            )


def _heads(x, head_size):
    """[nnz, heads * head_size] as [nnz, heads, head_size]; a 3-D tensor as it is (the caller's own
    tensor, so that an error of the binding names it as the caller did)."""
    return x if x.dim() == 3 and x.shape[-1] == head_size else x.view(x.shape[0], -1, head_size)


@aotinfer_api(trace=apply_rope_with_cos_sin_cache_trace)
def apply_rope_with_cos_sin_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    *,
    skip_check: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys with precomputed cos/sin (vLLM's and SGLang's interface).

    Parameters
    ----------
    positions : torch.Tensor
        ``[nnz]``, int32 or int64: each token's position, below ``cos_sin_cache.shape[0]``.
    query : torch.Tensor
        ``[nnz, num_q_heads * head_size]`` (or ``[nnz, num_q_heads, head_size]``), float16 or
        bfloat16, the last dimension contiguous.
    key : torch.Tensor
        ``[nnz, num_k_heads * head_size]``, ``query``'s dtype.
    head_size : int
        Dims of a head.
    cos_sin_cache : torch.Tensor
        ``[max_position, rotary_dim]``, float32, contiguous: ``cos`` of frequency ``j`` at column
        ``j``, ``sin`` at ``rotary_dim / 2 + j``. Rotates the first ``rotary_dim`` dims of each head.
    is_neox : bool
        True: dims ``j`` and ``j + rotary_dim / 2`` turn together; False: ``(2j, 2j + 1)``.
    skip_check : bool
        Skip the Python checks of the scalars and of the shapes of ``query``/``key``.

    Returns
    -------
    Tuple[torch.Tensor, torch.Tensor]
        ``(query_out, key_out)``: new contiguous tensors of ``query``'s and ``key``'s shapes and dtype.
    """
    check_tensor(query, "query")  # read here, with or without skip_check
    check_tensor(key, "key")
    if not skip_check:
        _check_cos_sin_cache_call(query, key, head_size, is_neox)
    import torch

    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    _apply_rope_pos_ids_cos_sin_cache(_heads(query_out, head_size), _heads(key_out, head_size),
                                      _heads(query, head_size), _heads(key, head_size), cos_sin_cache, positions,
                                      not is_neox, -1)
    return query_out, key_out


@aotinfer_api(trace=apply_rope_with_cos_sin_cache_inplace_trace)
def apply_rope_with_cos_sin_cache_inplace(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    *,
    skip_check: bool = False,
) -> None:
    """:func:`apply_rope_with_cos_sin_cache` written into ``query`` and ``key`` themselves (dims
    past the cache's rotary dim are neither read nor written). Returns None."""
    check_tensor(query, "query")  # read here, with or without skip_check
    check_tensor(key, "key")
    if not skip_check:
        _check_cos_sin_cache_call(query, key, head_size, is_neox)
    q = _heads(query, head_size)
    k = _heads(key, head_size)
    _apply_rope_pos_ids_cos_sin_cache(q, k, q, k, cos_sin_cache, positions, not is_neox, -1)


# ---- RoPE and FP8 quantization (SGLang's DeepSeek path) -------------------------------------------


def _heads_3d(x):
    """MLA's one K head [nnz, dims] as [nnz, 1, dims] (a view); 3-D tensors as they are."""
    return x.unsqueeze(1) if x is not None and x.dim() == 2 else x


@aotinfer_api(trace=rope_quantize_fp8_trace)
def rope_quantize_fp8(
    q_rope: torch.Tensor,
    k_rope: torch.Tensor,
    q_nope: Optional[torch.Tensor],
    k_nope: Optional[torch.Tensor],
    cos_sin_cache: torch.Tensor,
    pos_ids: torch.Tensor,
    is_neox: bool = True,
    quantize_dtype: Optional[torch.dtype] = None,
    quant_scale_q: float = 1.0,
    quant_scale_kv: float = 1.0,
    q_rope_out: Optional[torch.Tensor] = None,
    k_rope_out: Optional[torch.Tensor] = None,
    q_nope_out: Optional[torch.Tensor] = None,
    k_nope_out: Optional[torch.Tensor] = None,
    enable_pdl: Optional[bool] = False,
    backend: str = "cuda",
    *,
    skip_check: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotate the rotary parts of q and k with a cos/sin cache and quantize every part to FP8.

    ``q_rope_out = fp8(rope(q_rope) * quant_scale_q)``, ``q_nope_out = fp8(q_nope * quant_scale_q)``,
    and the same for k with ``quant_scale_kv``: the rotation and the scale in float32, one rounding
    to nearest even, saturated to the FP8 type's largest finite value.

    Parameters
    ----------
    q_rope : torch.Tensor
        ``[nnz, num_qo_heads, rope_dim]``, float16 or bfloat16, the last dimension contiguous.
    k_rope : torch.Tensor
        ``[nnz, num_kv_heads, rope_dim]``, or ``[nnz, rope_dim]`` (MLA's one shared head).
    q_nope, k_nope : Optional[torch.Tensor]
        ``[nnz, num_qo_heads, no_rope_dim]`` and ``[nnz, num_kv_heads, no_rope_dim]`` (MLA:
        ``[nnz, no_rope_dim]``), or None for none.
    cos_sin_cache : torch.Tensor
        ``[max_position, rope_dim]``, float32: cos of frequency ``j`` at ``j``, sin at ``rope_dim / 2 + j``.
    pos_ids : torch.Tensor
        ``[nnz]``, int32 or int64.
    is_neox : bool
        True: dims ``j`` and ``j + rope_dim / 2`` turn together; False: ``(2j, 2j + 1)``.
    quantize_dtype : Optional[torch.dtype]
        ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``; default: the given outputs' dtype, else e4m3.
    quant_scale_q, quant_scale_kv : float
        Multipliers applied before the rounding.
    q_rope_out, k_rope_out, q_nope_out, k_nope_out : Optional[torch.Tensor]
        FP8 tensors of the inputs' shapes to write to; allocated (contiguous) when missing.
    enable_pdl : Optional[bool]
        Programmatic dependent launch (sm90+): True, False (FlashInfer's default) or None (where supported).
    backend : str
        ``"cuda"`` only.
    skip_check : bool
        Skip the Python checks of the scalars and options.

    The rope dim must be a multiple of 16 (NeoX) or 8 (interleaved), no_rope_dim one of 8, and every
    head 16-byte aligned in the inputs and 8-byte aligned in the outputs.

    Returns
    -------
    Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
        ``(q_rope_out, k_rope_out, q_nope_out, k_nope_out)`` in the FP8 dtype, of the inputs' shapes.
    """
    import torch

    # Read here (shapes, torch.empty) before the binding sees them: named with or without skip_check.
    check_tensor(q_rope, "q_rope")
    check_tensor(k_rope, "k_rope")
    for tensor, name in ((q_nope, "q_nope"), (k_nope, "k_nope")):
        if tensor is not None:
            check_tensor(tensor, name)
    if not skip_check:
        _check_bool(is_neox, "is_neox")
        check_real(quant_scale_q, "quant_scale_q")
        check_real(quant_scale_kv, "quant_scale_kv")
        check_enable_pdl(enable_pdl)
        if backend != "cuda":
            raise ValueError(f"Expected backend to be 'cuda', got {backend!r}")
        if quantize_dtype is not None and quantize_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise TypeError(f"Expected quantize_dtype to be torch.float8_e4m3fn or torch.float8_e5m2, got {quantize_dtype}")
    nnz, device = q_rope.shape[0], q_rope.device
    mla = k_rope.dim() == 2
    if q_nope is None:
        q_nope = torch.empty(nnz, q_rope.shape[1], 0, dtype=q_rope.dtype, device=device)
    if k_nope is None:
        k_nope = torch.empty((nnz, 0) if mla else (nnz, k_rope.shape[1], 0), dtype=k_rope.dtype, device=device)
    if quantize_dtype is None:
        given = [x for x in (q_rope_out, k_rope_out, q_nope_out, k_nope_out) if x is not None]
        quantize_dtype = given[0].dtype if given else torch.float8_e4m3fn
    outs = []
    for out, like in ((q_rope_out, q_rope), (k_rope_out, k_rope), (q_nope_out, q_nope), (k_nope_out, k_nope)):
        outs.append(out if out is not None else torch.empty(like.shape, dtype=quantize_dtype, device=device))
    _rope_quantize(*(_heads_3d(x) for x in outs), q_rope, _heads_3d(k_rope), q_nope, _heads_3d(k_nope), cos_sin_cache,
                   pos_ids, quant_scale_q, quant_scale_kv, not is_neox, -1 if enable_pdl is None else enable_pdl)
    return tuple(outs)


@aotinfer_api
def mla_rope_quantize_fp8(
    q_rope: torch.Tensor,
    k_rope: torch.Tensor,
    q_nope: torch.Tensor,
    k_nope: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    pos_ids: torch.Tensor,
    is_neox: bool = True,
    quantize_dtype: Optional[torch.dtype] = None,
    quant_scale_q: float = 1.0,
    quant_scale_kv: float = 1.0,
    q_rope_out: Optional[torch.Tensor] = None,
    k_rope_out: Optional[torch.Tensor] = None,
    q_nope_out: Optional[torch.Tensor] = None,
    k_nope_out: Optional[torch.Tensor] = None,
    enable_pdl: Optional[bool] = False,
    *,
    skip_check: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rope_quantize_fp8` with MLA's layout: ``k_rope`` ``[nnz, rope_dim]`` and ``k_nope``
    ``[nnz, no_rope_dim]`` (one K head shared by every query head); ``q_rope``
    ``[nnz, num_qo_heads, rope_dim]``, ``q_nope`` ``[nnz, num_qo_heads, no_rope_dim]``.
    Returns ``(q_rope_out, k_rope_out, q_nope_out, k_nope_out)`` in the FP8 dtype, of the inputs' shapes."""
    return rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox, quantize_dtype,
                             quant_scale_q, quant_scale_kv, q_rope_out, k_rope_out, q_nope_out, k_nope_out,
                             enable_pdl, skip_check=skip_check)
