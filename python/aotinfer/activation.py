"""Gated activations with FlashInfer's signatures: ``input[..., 2d] -> act(input[..., :d]) *
input[..., d:]`` for act SiLU, GELU (erf) and GELU (tanh approximation), computed in float32.

``input``'s last dimension must be contiguous; 2-D and 3-D inputs may have strided rows, inputs of
more dimensions must be contiguous. ``enable_pdl``: True launches with programmatic dependent
launch on sm90+ GPUs (a no-op below), False never does, None (default) does where supported.
The keyword ``skip_check=True`` skips the Python-side check of ``enable_pdl`` (the kernels check
every tensor).

Each op takes ``input`` ``[..., 2d]`` (float16, bfloat16 or float32) and ``out`` ``[..., d]`` of
input's dtype (allocated when None), and returns ``out``.
"""

from __future__ import annotations

from ._kernels import kernel
from .api_logging import aotinfer_api
from .trace.templates.activation import gelu_and_mul_trace, gelu_tanh_and_mul_trace, silu_and_mul_trace
from .utils import check_enable_pdl

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    import torch

_silu_and_mul = kernel("activation", "silu_and_mul")
_gelu_and_mul = kernel("activation", "gelu_and_mul")
_gelu_tanh_and_mul = kernel("activation", "gelu_tanh_and_mul")


def _act_and_mul(kernel_, input, out, enable_pdl, skip_check):
    if not skip_check:  # what the bindings cannot name; they check every tensor themselves
        check_enable_pdl(enable_pdl)
    if out is None:
        import torch

        try:
            shape, dtype, device = input.shape, input.dtype, input.device
        except AttributeError:
            raise TypeError(f"Expected input to be a torch.Tensor, got {type(input).__name__}") from None
        # [..., 2d] -> [..., d]; a 0-d input gets a 0-d out, which the binding refuses by name.
        out = torch.empty(shape[:-1] + (shape[-1] // 2,) if shape else (), dtype=dtype, device=device)
    kernel_(out, input, -1 if enable_pdl is None else enable_pdl)
    return out


@aotinfer_api(trace=silu_and_mul_trace)
def silu_and_mul(
    input: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    enable_pdl: Optional[bool] = None,
    *,
    skip_check: bool = False,
) -> torch.Tensor:
    r"""``silu(input[..., :d]) * input[..., d:]`` with ``silu(x) = x / (1 + exp(-x))``.

    ``input``: ``[..., 2d]``, float16, bfloat16 or float32. ``out``: ``[..., d]`` of input's dtype;
    allocated when missing. Returns ``out``.
    """
    return _act_and_mul(_silu_and_mul, input, out, enable_pdl, skip_check)


@aotinfer_api(trace=gelu_and_mul_trace)
def gelu_and_mul(
    input: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    enable_pdl: Optional[bool] = None,
    *,
    skip_check: bool = False,
) -> torch.Tensor:
    r"""``gelu(input[..., :d]) * input[..., d:]`` with the exact ``gelu(x) = x / 2 * (1 + erf(x / sqrt(2)))``.

    ``input``: ``[..., 2d]``, float16, bfloat16 or float32. Returns ``out``, ``[..., d]`` of input's dtype.
    """
    return _act_and_mul(_gelu_and_mul, input, out, enable_pdl, skip_check)


@aotinfer_api(trace=gelu_tanh_and_mul_trace)
def gelu_tanh_and_mul(
    input: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    enable_pdl: Optional[bool] = None,
    *,
    skip_check: bool = False,
) -> torch.Tensor:
    r"""``gelu_tanh(input[..., :d]) * input[..., d:]`` with
    ``gelu_tanh(x) = x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3)))``.

    ``input``: ``[..., 2d]``, float16, bfloat16 or float32. Returns ``out``, ``[..., d]`` of input's dtype.
    """
    return _act_and_mul(_gelu_tanh_and_mul, input, out, enable_pdl, skip_check)
