"""Gated activations with FlashInfer's signatures: ``input[..., 2d] -> act(input[..., :d]) *
input[..., d:]`` for act SiLU, GELU (erf) and GELU (tanh approximation), computed in float32.

``input``'s last dimension must be contiguous; 2-D and 3-D inputs may have strided rows, inputs of
more dimensions must be contiguous. ``enable_pdl``: True launches with programmatic dependent
launch on sm90+ GPUs (a no-op below), False never does, None (default) does where supported.
"""

from __future__ import annotations

from ._kernels import kernel
from .api_logging import aotinfer_api
from .trace.templates.activation import gelu_and_mul_trace, gelu_tanh_and_mul_trace, silu_and_mul_trace
from .utils import backend_requirement, check_cuda_tensor

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    import torch

_silu_and_mul = kernel("activation", "silu_and_mul")
_gelu_and_mul = kernel("activation", "gelu_and_mul")
_gelu_tanh_and_mul = kernel("activation", "gelu_tanh_and_mul")


def _check_act_and_mul(input, out=None, enable_pdl=None) -> bool:
    check_cuda_tensor(input, "input")
    if input.dim() == 0 or input.shape[-1] % 2:
        raise ValueError(f"Expected the last dimension of input to be even (gate and up halves), got shape {list(input.shape)}")
    if out is not None:
        expected = list(input.shape[:-1]) + [input.shape[-1] // 2]
        try:
            shape, dtype, device = list(out.shape), out.dtype, out.device
        except AttributeError:
            raise TypeError(f"Expected out to be a torch.Tensor or None, got {type(out).__name__}") from None
        if shape != expected or dtype != input.dtype or device != input.device:
            raise ValueError(
                f"Expected out of shape {expected}, dtype {input.dtype} on {input.device}, got {shape}, {dtype} on {device}"
            )
    return True


def _act_and_mul(kernel_, input, out, enable_pdl):
    if out is None:
        import torch

        out = torch.empty(input.shape[:-1] + (input.shape[-1] // 2,), dtype=input.dtype, device=input.device)
    kernel_.fn(out, input, -1 if enable_pdl is None else int(bool(enable_pdl)))
    return out


@aotinfer_api(trace=silu_and_mul_trace)
@backend_requirement(backend_checks={}, common_check=_check_act_and_mul)
def silu_and_mul(input: torch.Tensor, out: Optional[torch.Tensor] = None, enable_pdl: Optional[bool] = None) -> torch.Tensor:
    r"""``silu(input[..., :d]) * input[..., d:]`` with ``silu(x) = x / (1 + exp(-x))``.

    ``input``: ``[..., 2d]``, float16, bfloat16 or float32. ``out``: ``[..., d]``; allocated when missing.
    """
    return _act_and_mul(_silu_and_mul, input, out, enable_pdl)


@aotinfer_api(trace=gelu_and_mul_trace)
@backend_requirement(backend_checks={}, common_check=_check_act_and_mul)
def gelu_and_mul(input: torch.Tensor, out: Optional[torch.Tensor] = None, enable_pdl: Optional[bool] = None) -> torch.Tensor:
    r"""``gelu(input[..., :d]) * input[..., d:]`` with the exact ``gelu(x) = x / 2 * (1 + erf(x / sqrt(2)))``."""
    return _act_and_mul(_gelu_and_mul, input, out, enable_pdl)


@aotinfer_api(trace=gelu_tanh_and_mul_trace)
@backend_requirement(backend_checks={}, common_check=_check_act_and_mul)
def gelu_tanh_and_mul(input: torch.Tensor, out: Optional[torch.Tensor] = None, enable_pdl: Optional[bool] = None) -> torch.Tensor:
    r"""``gelu_tanh(input[..., :d]) * input[..., d:]`` with
    ``gelu_tanh(x) = x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3)))``."""
    return _act_and_mul(_gelu_tanh_and_mul, input, out, enable_pdl)
