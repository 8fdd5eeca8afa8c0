"""Normalizations with FlashInfer's signatures: rmsnorm, fused_add_rmsnorm, their Gemma variants
(weight applied as ``1 + weight``) and layernorm. Inputs are 2-D ``[tokens, hidden]`` or 3-D
``[tokens, heads, hidden]``, normalized over the last dimension, which must be contiguous; rows may
be slices of wider tensors. Statistics are accumulated in float32.

``enable_pdl``: True launches with programmatic dependent launch on sm90+ GPUs (a no-op below),
False never does, None (default) does where the GPU supports it. The keyword ``skip_check=True``
skips the Python-side checks of ``eps`` and ``enable_pdl`` (the kernels check every tensor).
"""

from __future__ import annotations

from ._kernels import kernel
from .api_logging import aotinfer_api
from .trace.templates.norm import (
    fused_add_rmsnorm_trace,
    gemma_fused_add_rmsnorm_trace,
    gemma_rmsnorm_trace,
    layernorm_trace,
    rmsnorm_trace,
)
from .utils import check_enable_pdl, check_real

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    import torch

_rmsnorm = kernel("norm", "rmsnorm")
_fused_add_rmsnorm = kernel("norm", "fused_add_rmsnorm")
_layernorm = kernel("norm", "layernorm")


def _check_eps_and_pdl(eps, enable_pdl) -> None:
    """What the bindings cannot tell apart: a bool or another non-real eps (a binding takes it as a
    number, and checks its value), and enable_pdl before it becomes the binding's -1/0/1. The
    bindings check every tensor."""
    check_real(eps, "eps")
    check_enable_pdl(enable_pdl)


@aotinfer_api(trace=rmsnorm_trace)
def rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: Optional[torch.Tensor] = None,
    enable_pdl: Optional[bool] = None,
    *,
    skip_check: bool = False,
) -> torch.Tensor:
    r"""Root mean square normalization: ``out[i] = input[i] / sqrt(mean(input[i]**2) + eps) * weight``.

    Parameters
    ----------
    input : torch.Tensor
        ``[tokens, hidden]`` or ``[tokens, heads, hidden]``; float16, bfloat16 or float32.
    weight : torch.Tensor
        ``[hidden]``, input's dtype.
    eps : float
        Added to the mean square.
    out : Optional[torch.Tensor]
        Output of input's shape and dtype; allocated when missing.
    enable_pdl : Optional[bool]
        Programmatic dependent launch (see the module doc).

    Returns
    -------
    torch.Tensor
        ``out``.
    """
    if not skip_check:
        _check_eps_and_pdl(eps, enable_pdl)
    if out is None:
        import torch

        out = torch.empty_like(input)
    _rmsnorm(out, input, weight, eps, False, -1 if enable_pdl is None else enable_pdl)
    return out


@aotinfer_api(trace=fused_add_rmsnorm_trace)
def fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: Optional[bool] = None,
    *,
    skip_check: bool = False,
) -> None:
    r"""Residual add then RMSNorm, in place: with ``s = input + residual`` in float32,
    ``residual = s`` (rounded to its dtype) and ``input = s / sqrt(mean(s**2) + eps) * weight``.
    The norm is of the float32 sum, not of the rounded residual.

    ``input`` and ``residual``: the same shape, ``[tokens, hidden]`` or ``[tokens, heads, hidden]``,
    and dtype (float16, bfloat16 or float32); ``weight``: ``[hidden]``, their dtype. Returns None:
    the results are in ``input`` and ``residual``.
    """
    if not skip_check:
        _check_eps_and_pdl(eps, enable_pdl)
    _fused_add_rmsnorm(input, residual, weight, eps, False, -1 if enable_pdl is None else enable_pdl)


@aotinfer_api(trace=gemma_rmsnorm_trace)
def gemma_rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: Optional[torch.Tensor] = None,
    enable_pdl: Optional[bool] = None,
    *,
    skip_check: bool = False,
) -> torch.Tensor:
    r"""Gemma's RMSNorm: as :func:`rmsnorm` with the weight applied as ``1 + weight``:
    ``out[i] = input[i] / sqrt(mean(input[i]**2) + eps) * (1 + weight)``. Same shapes and dtypes;
    returns ``out`` (input's shape and dtype)."""
    if not skip_check:
        _check_eps_and_pdl(eps, enable_pdl)
    if out is None:
        import torch

        out = torch.empty_like(input)
    _rmsnorm(out, input, weight, eps, True, -1 if enable_pdl is None else enable_pdl)
    return out


@aotinfer_api(trace=gemma_fused_add_rmsnorm_trace)
def gemma_fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: Optional[bool] = None,
    *,
    skip_check: bool = False,
) -> None:
    r"""Gemma's fused add + RMSNorm: as :func:`fused_add_rmsnorm` with the weight applied as
    ``1 + weight``. In place; returns None."""
    if not skip_check:
        _check_eps_and_pdl(eps, enable_pdl)
    _fused_add_rmsnorm(input, residual, weight, eps, True, -1 if enable_pdl is None else enable_pdl)


@aotinfer_api(trace=layernorm_trace)
def layernorm(
    input: torch.Tensor, gemma: torch.Tensor, beta: torch.Tensor, eps: float = 1e-6, *, skip_check: bool = False
) -> torch.Tensor:
    r"""Layer normalization: ``(input - mean) / sqrt(var + eps) * gemma + beta`` per row.

    ``input``: 2-D or 3-D, float16, bfloat16 or float32; ``gemma`` (the scale, FlashInfer's name)
    and ``beta``: ``[hidden]``, both float32 or both input's dtype. Mean and variance over the
    last dimension, in float32. Returns a new tensor of input's shape and dtype.
    """
    import torch

    if not skip_check:
        check_real(eps, "eps")
    out = torch.empty_like(input)
    _layernorm(out, input, gemma, beta, eps, -1)
    return out


# FlashInfer's module flashinfer.norm holds the FP8-output norms too (aotinfer's build them from
# CuTeDSL, in their own module).
from .norm_quant import fused_add_rmsnorm_quant, layernorm_quant, rmsnorm_quant  # noqa: E402,F401
