"""Checks of scalar arguments shared by the ops, and small helpers servers call.

A check tests what no binding can name: scalars and options, never a tensor's device, dtype or
shape, which the binding reports itself (naming the argument). Ops run them under
``if not skip_check:``.
"""

from __future__ import annotations

import numbers

from . import _loader

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class BackendSupportedError(ValueError):
    """An op cannot run with this backend, on this GPU, or with these arguments (FlashInfer's
    name, for code that catches it; a ValueError, as every refusal of an argument is)."""


# ---- checks of scalars, shared by the ops ---------------------------------------------------------


def check_real(value: Any, name: str) -> None:
    """TypeError unless ``value`` is a real number (bool is not)."""
    if type(value) is not float and type(value) is not int:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"Expected {name} to be a real number, got {type(value).__name__}")


def check_int(value: Any, name: str, minimum: int) -> None:
    """TypeError unless ``value`` is an integer (bool is not), ValueError below ``minimum``."""
    if type(value) is not int and (isinstance(value, bool) or not hasattr(value, "__index__")):
        raise TypeError(f"Expected {name} to be an integer, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"Expected {name} to be at least {minimum}, got {value}")


def check_tensor(value: Any, name: str) -> None:
    """TypeError naming ``name`` unless ``value`` is a tensor: for arguments an op reads before a
    binding sees them (the binding names the others itself)."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"Expected {name} to be a torch.Tensor, got {type(value).__name__}")


def check_enable_pdl(enable_pdl: Any) -> None:
    """enable_pdl: None (where the GPU supports it), True or False. Ops pass a binding
    ``-1 if enable_pdl is None else enable_pdl`` (a bool is the binding's 1 or 0): an expression,
    not a call, on the hot path."""
    if enable_pdl is not None and type(enable_pdl) is not bool:
        raise TypeError(f"Expected enable_pdl to be None, True or False, got {enable_pdl!r}")


# ---- queries ------------------------------------------------------------------------------------


def device_support_pdl(device: Any) -> bool:
    """Whether ops launch with programmatic dependent launch on ``device`` when their ``enable_pdl`` is
    None: CUDA devices of compute capability 9.0 and up (FlashInfer's utility of the same name)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return False
    return _loader.device_capability(torch.cuda.current_device() if device.index is None else device.index)[0] >= 9


def cc_int(cc: Any) -> int:
    """90 from 90, (9, 0) or "9.0"."""
    if isinstance(cc, int):
        return cc
    if isinstance(cc, str):
        major, _, minor = cc.partition(".")
        return int(major) * 10 + int(minor or 0)
    major, minor = cc
    return major * 10 + minor
