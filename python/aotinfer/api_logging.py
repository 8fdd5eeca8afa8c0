"""``@aotinfer_api``: marks public ops, logs their calls on request, and attaches trace templates.

    AOTINFER_LOGLEVEL  0 (default): the op's wrapper holds no logging code, so logging costs nothing;
                       1: the op's name per call; 3: also inputs and outputs (shape, dtype, device,
                       stride, scalars); 5: also tensor statistics (min, max, mean, NaN and Inf
                       counts), skipped during CUDA-graph capture, where they cannot be read.
    AOTINFER_LOGDEST   stderr (default), stdout, or a file path; %i in it becomes the process id.

The level is read when an op is decorated, i.e. when aotinfer is imported: set it before. A value
that cannot be used (a level that is not a number, a file that cannot be opened) is reported by
one warning and replaced by the default; it never breaks an import or an op. Records go through
the standard ``logging`` module, logger ``aotinfer.api``. Tracers (torch.compile, export) see no
logging: the wrapper hands them the op's body first (see _op.py).

``@aotinfer_api(trace=template)`` (or ``trace=dispatch_fn`` returning a template from the op's
arguments, with the candidates in ``dispatch_fn.templates``) registers the op with its template and
gives it ``op.trace(*args, **kwargs, dump_dir=None)``; see aotinfer.trace.
"""

from __future__ import annotations

import os

from . import _op

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Optional, Tuple

_LEVELS = (0, 1, 3, 5)
_logger = None
_warned: set = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        import warnings

        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def log_level() -> int:
    """AOTINFER_LOGLEVEL as a level; anything else warns once and means 0."""
    text = os.environ.get("AOTINFER_LOGLEVEL", "0").strip() or "0"
    try:
        level = int(text)
    except ValueError:
        level = -1
    if level < 0:
        _warn_once(f"AOTINFER_LOGLEVEL={text!r} is not a level (0, 1, 3 or 5): logging stays off")
        return 0
    return level


def _handler():
    """A handler for AOTINFER_LOGDEST; stderr, with one warning, where it names no usable file."""
    import logging
    import sys

    dest = os.environ.get("AOTINFER_LOGDEST", "stderr").strip() or "stderr"
    if dest.lower() in ("stdout", "stderr"):
        return logging.StreamHandler(getattr(sys, dest.lower()))
    path = dest.replace("%i", str(os.getpid()))
    try:
        return logging.FileHandler(path)
    except OSError as e:
        _warn_once(f"AOTINFER_LOGDEST={dest!r}: cannot open {path!r} ({e.strerror}); logging to stderr")
        return logging.StreamHandler(sys.stderr)


def _get_logger():
    """The aotinfer.api logger, with a handler for AOTINFER_LOGDEST (set up once)."""
    global _logger
    if _logger is None:
        import logging

        handler = _handler()
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


def _log_functions(spec: _op.OpSpec, level: int) -> Tuple[Callable, Callable]:
    """(log_call(values), log_result(result)) for the op's wrapper at ``level``."""
    name = f"aotinfer.{spec.fn.__qualname__.rpartition('<locals>.')[2]}"  # a method: Class.method
    names = spec.names

    def log_call(values: tuple) -> None:
        logger = _get_logger()
        if level < 3:
            logger.info(name)
            return
        lines = [name] + [f"  {n}: {_describe(v, level)}" for n, v in zip(names, values)]
        logger.info("\n".join(lines))

    def log_result(result: Any) -> None:
        if level >= 3:
            _get_logger().info(f"{name} -> {_describe(result, level)}")

    return log_call, log_result


def aotinfer_api(fn: Optional[Callable] = None, *, trace: Any = None) -> Callable:
    """Mark a public op (see the module doc). Use as ``@aotinfer_api`` or ``@aotinfer_api(trace=...)``.

    A plain function (no kernels, no checks, no template) at level 0 is returned as it is.
    """

    def decorate(f: Callable) -> Callable:
        spec = _op.spec_of(f)
        level = log_level()
        if level > 0:
            spec.logging = _log_functions(spec, level)
        if spec.logging is None and trace is None and spec.requirement is None and not spec.kernels():
            return f
        # With nothing of ours to add to a wrapper built below, that one stays the op.
        wrapper = spec.wrapper if spec.wrapper is not None and spec.logging is None else _op.build(spec)
        if trace is not None:
            from .trace import register

            register(wrapper, trace)
        return wrapper

    return decorate(fn) if fn is not None else decorate
