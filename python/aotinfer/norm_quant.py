"""Row norms with an FP8 output, with FlashInfer's signatures: rmsnorm_quant,
fused_add_rmsnorm_quant and layernorm_quant. ``out`` comes first and sets the format
(float8_e4m3fn or float8_e5m2); the normalized rows are divided by ``scale``, clamped to the
format's finite range and rounded to it. Inputs are 2-D ``[tokens, hidden]`` float16 or bfloat16
with a contiguous last dimension; rows may be slices of wider tensors. Statistics are float32.

``scale`` is a float, or a float32 tensor of one element (shape ``()`` or ``(1,)``) that the kernel
reads on the GPU (no host synchronization: the op stays capturable in a CUDA graph while the scale
changes).

The kernels are written in CuTeDSL (``cutedsl/norm_quant.py`` in the source tree) and were
compiled when this wheel was built: running them needs neither the DSL nor a compile. They run on
sm90 and newer GPUs (FP8 conversions in hardware); for one the wheel has no build, the JIT compiles
the module where the DSL (nvidia-cutlass-dsl) and nvcc are installed, else the error says so.

``enable_pdl``: True launches with programmatic dependent launch, False never does, None
(default) does where the GPU supports it. The keyword ``skip_check=True`` skips the Python-side
checks of ``scale``, ``eps`` and ``enable_pdl`` (the kernels check every tensor and value).

Every op writes ``out`` and returns None.
"""

from __future__ import annotations

from ._kernels import kernel
from .api_logging import aotinfer_api
from .trace.templates.norm_quant import (
    fused_add_rmsnorm_quant_trace,
    layernorm_quant_trace,
    rmsnorm_quant_trace,
)
from .utils import check_enable_pdl, check_real

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional, Union

    import torch

_rmsnorm_quant = kernel("norm_quant", "rmsnorm_quant")
_fused_add_rmsnorm_quant = kernel("norm_quant", "fused_add_rmsnorm_quant")
_layernorm_quant = kernel("norm_quant", "layernorm_quant")


def _scale_arguments(scale):
    """The bindings' (scale tensor, scale value): the tensor itself (the binding checks its dtype,
    shape and device), or a tensor of no elements (never read, on no device) and the number."""
    if hasattr(scale, "data_ptr"):
        return scale, 1.0
    import torch

    return torch.empty((0,), dtype=torch.float32), float(scale)


def _check_scalars(scale, eps, enable_pdl) -> None:
    """What the bindings cannot see: scale's kind (a real number or a tensor), eps before it becomes
    a number, enable_pdl before it becomes -1/0/1. The bindings check every tensor and value."""
    if not hasattr(scale, "data_ptr"):
        check_real(scale, "scale")
    check_real(eps, "eps")
    check_enable_pdl(enable_pdl)


@aotinfer_api(trace=rmsnorm_quant_trace)
def rmsnorm_quant(
    out: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    scale: Union[float, torch.Tensor],
    eps: float = 1e-6,
    enable_pdl: Optional[bool] = None,
    *,
    skip_check: bool = False,
) -> None:
    r"""RMSNorm quantized to FP8:
    ``out[i] = fp8(clamp(input[i] / sqrt(mean(input[i]**2) + eps) * weight / scale))``.

    Parameters
    ----------
    out : torch.Tensor
        ``[tokens, hidden]``, float8_e4m3fn or float8_e5m2: written, in its dtype.
    input : torch.Tensor
        ``[tokens, hidden]``, float16 or bfloat16.
    weight : torch.Tensor
        ``[hidden]``, input's dtype.
    scale : float or torch.Tensor
        The quantization scale: a float, or a float32 tensor of one element read on the GPU.
    eps : float
        Added to the mean square.
    enable_pdl : Optional[bool]
        Programmatic dependent launch (see the module doc).

    Returns
    -------
    None
        The result is in ``out``.
    """
    if not skip_check:
        _check_scalars(scale, eps, enable_pdl)
    scale_tensor, scale_value = _scale_arguments(scale)
    _rmsnorm_quant(out, input, weight, scale_tensor, scale_value, eps, -1 if enable_pdl is None else enable_pdl)


@aotinfer_api(trace=fused_add_rmsnorm_quant_trace)
def fused_add_rmsnorm_quant(
    out: torch.Tensor,
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    scale: Union[float, torch.Tensor],
    eps: float = 1e-6,
    enable_pdl: Optional[bool] = None,
    *,
    skip_check: bool = False,
) -> None:
    r"""Residual add, then RMSNorm quantized to FP8: with ``s = input + residual`` in float32,
    ``residual = s`` (rounded to its dtype) and ``out = fp8(clamp(s / sqrt(mean(s**2) + eps) *
    weight / scale))``. The norm is of the float32 sum, not of the rounded residual.

    ``out``, ``input`` and ``residual`` are ``[tokens, hidden]``; ``input`` and ``residual``
    float16 or bfloat16 of one dtype, ``weight`` ``[hidden]`` of that dtype; ``out`` and ``scale``
    as in :func:`rmsnorm_quant`. Returns None: the results are in ``out`` and ``residual``.
    """
    if not skip_check:
        _check_scalars(scale, eps, enable_pdl)
    scale_tensor, scale_value = _scale_arguments(scale)
    _fused_add_rmsnorm_quant(
        out, input, residual, weight, scale_tensor, scale_value, eps, -1 if enable_pdl is None else enable_pdl
    )


@aotinfer_api(trace=layernorm_quant_trace)
def layernorm_quant(
    out: torch.Tensor,
    input: torch.Tensor,
    gemma: torch.Tensor,
    beta: torch.Tensor,
    scale: Union[float, torch.Tensor],
    eps: float = 1e-6,
    *,
    skip_check: bool = False,
) -> None:
    r"""LayerNorm quantized to FP8:
    ``out = fp8(clamp(((input - mean) / sqrt(var + eps) * gemma + beta) / scale))`` per row.

    ``input``: ``[tokens, hidden]`` float16 or bfloat16; ``gemma`` (the scale, FlashInfer's name)
    and ``beta``: ``[hidden]`` float32; ``out`` and ``scale`` as in :func:`rmsnorm_quant`. Returns
    None: the result is in ``out``.
    """
    if not skip_check:
        _check_scalars(scale, eps, None)
    scale_tensor, scale_value = _scale_arguments(scale)
    _layernorm_quant(out, input, gemma, beta, scale_tensor, scale_value, eps, -1)
