"""``@aotinfer_api``: marks public ops, logs their calls on request, and attaches trace templates.

    AOTINFER_LOGLEVEL  0 (default): the op's wrapper holds no logging code, so logging costs nothing;
                       1: the op's name per call; 3: also inputs and outputs (shape, dtype, device,
                       stride, scalars); 5: also tensor statistics (min, max, mean, NaN and Inf
                       counts), skipped during CUDA-graph capture, where they cannot be read.
    AOTINFER_LOGDEST   stderr (default), stdout, or a file path; %i in it becomes the process id.

The level is read when an op is decorated, i.e. when aotinfer is imported: set it before. A value
that cannot be used (a level that is not a number, a file that cannot be opened) is reported by
one warning and replaced by the default; it never breaks an import or an op. Records go through
the standard ``logging`` module, logger ``aotinfer.api``. At level 0 an op is its own function, with
no wrapper; above it a wrapper logs each call, traced calls too.

``@aotinfer_api(trace=template)`` (or ``trace=dispatch_fn`` returning a template from the op's
arguments, with the candidates in ``dispatch_fn.templates``) registers the op with its template and
gives it ``op.trace(*args, **kwargs, dump_dir=None)``; see aotinfer.trace.
"""

from __future__ import annotations

import os

from . import _loader
from ._kernels import kernels_named_by, public_code
from .utils import cc_int

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Optional

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
    if not 0 <= level <= 5:
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


def _logged(fn: Callable, level: int) -> Callable:
    """``fn`` with its calls logged at ``level`` (1, 3 or 5); a method logs as Class.method."""
    import functools
    import inspect

    name = f"aotinfer.{fn.__qualname__.rpartition('<locals>.')[2]}"
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def logged(*args: Any, **kwargs: Any) -> Any:
        logger = _get_logger()
        if level < 3:
            logger.info(name)
        else:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            lines = [name] + [f"  {n}: {_describe(v, level)}" for n, v in bound.arguments.items()]
            logger.info("\n".join(lines))
        result = fn(*args, **kwargs)
        if level >= 3:
            logger.info(f"{name} -> {_describe(result, level)}")
        return result

    return logged


def aotinfer_api(fn: Optional[Callable] = None, *, trace: Any = None) -> Callable:
    """Mark a public op (see the module doc). Use as ``@aotinfer_api`` or ``@aotinfer_api(trace=...)``.

    At level 0 the op is returned as it is, with ``is_compute_capability_supported(cc)`` and, given
    a template, ``trace(...)`` attached: the eager call runs the op's own code and nothing else.
    """

    def decorate(f: Callable) -> Callable:
        level = log_level()
        op = _logged(f, level) if level > 0 else f
        public_code.add(f.__code__)
        op.is_compute_capability_supported = lambda cc: builds_run_on(f, cc)
        if trace is not None:
            from .trace import register

            register(op, trace)
        return op

    return decorate(fn) if fn is not None else decorate


def builds_run_on(fn: Callable, cc: Any) -> bool:
    """Whether this install has a build, for compute capability ``cc`` (90, (9, 0) or "9.0"), of
    every kernel module that ``fn`` calls, as ``python -m aotinfer info --cc`` would answer."""
    cc = cc_int(cc)
    try:
        for k in kernels_named_by(fn):
            _loader.resolve(k.module, (cc // 10, cc % 10))
    except (_loader.NoCompatibleBuild, _loader.NotBuiltError):
        return False
    return True
