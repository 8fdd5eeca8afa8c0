"""Element-wise scale: ``scale(input, factor, out=None) -> input * factor``."""

from __future__ import annotations

import numbers

from ._loader import get_module

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

    import torch


def scale(input: "torch.Tensor", factor: float, out: Optional["torch.Tensor"] = None) -> "torch.Tensor":
    """Multiply every element of ``input`` by ``factor``.

    Computes ``input * factor`` in float32 and rounds once to the input's dtype, as torch does.

    Parameters
    ----------
    input : torch.Tensor
        CUDA tensor of any shape, float16, bfloat16 or float32. A non-contiguous input is copied
        to a contiguous one first.
    factor : float
        The scale factor (any real number).
    out : Optional[torch.Tensor]
        Contiguous tensor of ``input``'s shape, dtype and device to write to; may be ``input``
        itself for an in-place scale. Allocated when missing.

    Returns
    -------
    torch.Tensor
        ``out``, holding ``input * factor``.
    """
    import torch

    if not isinstance(input, torch.Tensor):
        raise TypeError(f"Expected input to be a torch.Tensor, got {type(input).__name__}")
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
        raise TypeError(f"Expected factor to be a real number, got {type(factor).__name__}")
    if input.device.type != "cuda":
        raise ValueError(f"Expected input to be a CUDA tensor, got a tensor on {input.device}")
    if not input.is_contiguous():
        input = input.contiguous()
    if out is None:
        out = torch.empty_like(input)
    get_module("scale", input.device).scale(out, input, float(factor))
    return out
