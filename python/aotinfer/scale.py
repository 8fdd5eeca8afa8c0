"""Element-wise scale: ``scale(input, factor, out=None) -> input * factor``."""

from __future__ import annotations

from ._kernels import kernel
from .api_logging import aotinfer_api
from .trace.templates.scale import scale_trace
from .utils import check_enable_pdl, check_real

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    import torch

_scale = kernel("scale", "scale")


@aotinfer_api(trace=scale_trace)
def scale(
    input: torch.Tensor,
    factor: float,
    out: Optional[torch.Tensor] = None,
    enable_pdl: Optional[bool] = None,
    *,
    skip_check: bool = False,
) -> torch.Tensor:
    """Multiply every element of ``input`` by ``factor``.

    Computes ``input * factor`` in float32 and rounds once to the input's dtype, as torch does.

    Parameters
    ----------
    input : torch.Tensor
        Contiguous CUDA tensor of any shape, float16, bfloat16 or float32 (any alignment).
    factor : float
        The scale factor (any real number).
    out : Optional[torch.Tensor]
        Contiguous tensor of ``input``'s shape, dtype and device to write to; may be ``input``
        itself for an in-place scale. Allocated when missing.
    enable_pdl : Optional[bool]
        Programmatic dependent launch: True on sm90+ GPUs (a no-op below), False never, None
        (default) where the GPU supports it. The kernel waits for the kernel before it; it never
        lets the next one start early (on the H200 that cost a fifth of its bandwidth).
    skip_check : bool
        Skip the argument checks (the kernel still rejects tensors it cannot handle).

    Returns
    -------
    torch.Tensor
        ``out``, holding ``input * factor``.
    """
    # What the binding cannot tell apart: a bool or another non-real factor, and enable_pdl before
    # it becomes the binding's -1/0/1. The binding checks every tensor itself.
    if not skip_check:
        check_real(factor, "factor")
        check_enable_pdl(enable_pdl)
    if out is None:
        import torch

        out = torch.empty_like(input)
    _scale(out, input, factor, -1 if enable_pdl is None else enable_pdl)
    return out
