"""Element-wise scale: ``scale(input, factor, out=None) -> input * factor``."""

from __future__ import annotations

import numbers

from ._kernels import kernel
from .api_logging import aotinfer_api
from .trace.templates.scale import scale_trace
from .utils import backend_requirement

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    import torch

_scale = kernel("scale", "scale")


def _check_scale(input: torch.Tensor, factor: float, out: Optional[torch.Tensor] = None) -> bool:
    # Runs on every call without skip_check, so it tests only what nothing later reports by name:
    # torch names a non-tensor input, the binding a tensor off the GPU, of the wrong dtype, shape
    # or layout. The common types come first.
    if type(factor) is not float and type(factor) is not int:
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
            raise TypeError(f"Expected factor to be a real number, got {type(factor).__name__}")
    return True


@aotinfer_api(trace=scale_trace)
@backend_requirement(backend_checks={}, common_check=_check_scale)
def scale(input: torch.Tensor, factor: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
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
    skip_check : bool
        Skip the argument checks (the kernel still rejects tensors it cannot handle).

    Returns
    -------
    torch.Tensor
        ``out``, holding ``input * factor``.
    """
    if out is None:
        import torch

        out = torch.empty_like(input)
    _scale.fn(out, input, factor, -1)
    return out
