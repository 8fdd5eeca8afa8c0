"""``@aotinfer_api``: marks public ops, logs their calls on request, and attaches trace templates.

    AOTINFER_LOGLEVEL  0 (default): the op is returned unchanged, so logging costs nothing;
                       1: the op's name per call; 3: also inputs and outputs (shape, dtype, device,
                       stride, scalars); 5: also tensor statistics (min, max, mean, NaN and Inf
                       counts), skipped during CUDA-graph capture, where they cannot be read.
    AOTINFER_LOGDEST   stderr (default), stdout, or a file path; %i in it becomes the process id.

The level is read when an op is decorated, i.e. when aotinfer is imported: set it before. Records
go through the standard ``logging`` module, logger ``aotinfer.api``.

``@aotinfer_api(trace=template)`` (or ``trace=dispatch_fn`` returning a template from the op's
arguments, with the candidates in ``dispatch_fn.templates``) registers the op with its template and
gives it ``op.trace(*args, **kwargs, dump_dir=None)``; see aotinfer.trace.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, List, Optional, Tuple

#: Every (op, template or dispatch function) registered by @aotinfer_api(trace=...).
TRACE_REGISTRY: List[Tuple[Callable, Any]] = []

_logger = None


def log_level() -> int:
    text = os.environ.get("AOTINFER_LOGLEVEL", "0").strip() or "0"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"AOTINFER_LOGLEVEL must be an integer (0, 1, 3 or 5), got {text!r}") from None


def _get_logger():
    """The aotinfer.api logger, with a handler for AOTINFER_LOGDEST (set up once)."""
    global _logger
    if _logger is None:
        import logging
        import sys

        dest = os.environ.get("AOTINFER_LOGDEST", "stderr")
        if dest == "stdout":
            handler = logging.StreamHandler(sys.stdout)
        elif dest == "stderr":
            handler = logging.StreamHandler(sys.stderr)
        else:
            handler = logging.FileHandler(dest.replace("%i", str(os.getpid())))
        handler.setFormatter(logging.Formatter("[aotinfer %(asctime)s] %(message)s"))
        logger = logging.getLogger("aotinfer.api")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        _logger = logger
    return _logger


def _describe(value: Any, level: int) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        text = (
            f"Tensor(shape={list(value.shape)}, dtype={str(value.dtype).replace('torch.', '')},"
            f" device={value.device}, stride={list(value.stride())})"
        )
        if level >= 5:
            text += " " + _statistics(value)
        return text
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_describe(v, level) for v in value) + "]"
    return repr(value)


def _statistics(t: Any) -> str:
    import torch

    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return "(statistics skipped: CUDA graph capture)"
    if t.numel() == 0:
        return "(empty)"
    if t.dtype == torch.bool or t.is_complex():
        return "(no statistics for this dtype)"
    f = t.detach().float()
    finite = f[torch.isfinite(f)]
    nan, inf = int(torch.isnan(f).sum()), int(torch.isinf(f).sum())
    if finite.numel() == 0:
        return f"min=- max=- mean=- nan={nan} inf={inf}"
    return f"min={finite.min().item():.6g} max={finite.max().item():.6g} mean={finite.mean().item():.6g} nan={nan} inf={inf}"


def _logged(fn: Callable, level: int) -> Callable:
    import functools
    import inspect

    name = f"aotinfer.{fn.__name__}"
    signature = inspect.signature(getattr(fn, "__wrapped__", fn))

    @functools.wraps(fn)
    def logged(*args, **kwargs):
        from . import _kernels

        if _kernels._is_compiling():
            return fn(*args, **kwargs)
        logger = _get_logger()
        if level < 3:
            logger.info(name)
            return fn(*args, **kwargs)
        call_kwargs = {k: v for k, v in kwargs.items() if k != "skip_check"}
        try:
            bound = signature.bind(*args, **call_kwargs)
            bound.apply_defaults()
            items = list(bound.arguments.items())
        except TypeError:
            items = [(f"arg{i}", a) for i, a in enumerate(args)] + list(call_kwargs.items())
        lines = [f"{name}"] + [f"  {k}: {_describe(v, level)}" for k, v in items]
        logger.info("\n".join(lines))
        result = fn(*args, **kwargs)
        logger.info(f"{name} -> {_describe(result, level)}")
        return result

    # One namespace for both: attributes set on the op later (suitable_auto_backends) are seen
    # through either object.
    logged.__dict__ = fn.__dict__
    return logged


def aotinfer_api(fn: Optional[Callable] = None, *, trace: Any = None) -> Callable:
    """Mark a public op (see the module doc). Use as ``@aotinfer_api`` or ``@aotinfer_api(trace=...)``."""

    def decorate(f: Callable) -> Callable:
        if trace is not None:
            from .trace.template import attach_trace

            attach_trace(f, trace)
            TRACE_REGISTRY.append((f, trace))
        level = log_level()
        return f if level == 0 else _logged(f, level)

    return decorate(fn) if fn is not None else decorate
