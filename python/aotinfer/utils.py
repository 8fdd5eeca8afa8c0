"""Requirements of public ops: which GPUs and which backends, checked before the kernel runs.

    @supported_compute_capability([80, 86, 89, 90, 100, 103, 110, 120])
    def _check_op(input, eps=1e-6):          # the op's arguments; True or raise
        check_real(eps, "eps")
        return True

    @backend_requirement(backend_checks={}, common_check=_check_op)
    def op(input, eps=1e-6): ...

Three patterns: one implementation (``backend_checks={}`` and a ``common_check``); several
(``backend_checks={"cuda": check, "cudnn": check}``, chosen by the op's ``backend`` argument); and
``backend="auto"``, where every backend whose checks pass is ranked by ``heuristic_func(suitable,
*args)`` into ``op.suitable_auto_backends`` for the op to pick from.

A check tests what no binding can name: scalars and options, never a tensor's device, dtype or
shape, which the binding reports itself. The compute capability checked is that of the first CUDA
tensor among the arguments, as ``major * 10 + minor``, and only where a check lists capabilities.
The op's wrapper (built in _op.py with the other decorators' parts) takes a keyword-only
``skip_check=False`` and answers ``is_backend_supported``, ``is_compute_capability_supported``,
``has_backend`` and ``has_backend_choices``.
"""

from __future__ import annotations

import numbers

from . import _loader, _op

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Iterable, Optional


class BackendSupportedError(ValueError):
    """An op cannot run with this backend, on this GPU, or with these arguments."""


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


# ---- requirements -------------------------------------------------------------------------------


def device_support_pdl(device: Any) -> bool:
    """Whether ops launch with programmatic dependent launch on ``device`` when their ``enable_pdl`` is
    None: CUDA devices of compute capability 9.0 and up (FlashInfer's utility of the same name)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return False
    return _loader.device_capability(torch.cuda.current_device() if device.index is None else device.index)[0] >= 9


def supported_compute_capability(ccs: Iterable[Any]) -> Callable:
    """Mark a check function with the compute capabilities (e.g. 80, 90, 100) it allows."""
    allowed = tuple(sorted({_op.cc_int(c) for c in ccs}))

    def mark(check: Callable) -> Callable:
        check.supported_compute_capabilities = allowed
        check.is_compute_capability_supported = lambda cc: _op.cc_int(cc) in allowed
        return check

    return mark


def _allows(check: Optional[Callable], cc: Optional[int]) -> bool:
    ccs = getattr(check, "supported_compute_capabilities", None)
    return cc is None or ccs is None or cc in ccs


def _device_capability(args: tuple) -> tuple:
    """(device index, compute capability as an int) of the first CUDA tensor, or (None, None)."""
    for arg in args:
        if getattr(arg, "is_cuda", False):
            index = arg.get_device()
            return index, _op.cc_int(_loader.device_capability(index))
    return None, None


class _Requirement:
    def __init__(self, spec, backend_checks, common_check, heuristic_func):
        self.name = spec.name
        self.backend_checks = dict(backend_checks)
        self.common_check = common_check
        self.heuristic_func = heuristic_func
        names = spec.names
        self.backend_index = names.index("backend") if "backend" in names else None
        if self.backend_checks and self.backend_index is None:
            raise TypeError(f"{self.name}: backend_checks need a 'backend' parameter")
        self.wrapper = None

    # ---- checks, called with the op's arguments as the op gets them -----------------------------

    def fail(self, backend, index, cc, why):
        where = f"cuda:{index} (compute capability {cc // 10}.{cc % 10})" if cc is not None else "this input"
        label = f" backend {backend!r}" if backend is not None else ""
        return BackendSupportedError(f"{self.name}{label} on {where}: {why}")

    def run_check(self, check, backend, index, cc, args, kwargs):
        if check is None:
            return
        if not _allows(check, cc):
            supported = ", ".join(str(c) for c in check.supported_compute_capabilities)
            raise self.fail(backend, index, cc, f"supported compute capabilities are {supported}")
        if check(*args, **kwargs) is not True:
            raise self.fail(backend, index, cc, f"{check.__name__} rejected the arguments")

    def suitable(self, backend, index, cc, args, kwargs) -> bool:
        try:
            self.run_check(self.common_check, backend, index, cc, args, kwargs)
            self.run_check(self.backend_checks[backend], backend, index, cc, args, kwargs)
        except ValueError:
            return False
        return True

    def rejected(self, *args, **kwargs):
        index, cc = _device_capability(args + tuple(kwargs.values()))
        raise self.fail(None, index, cc, f"{self.common_check.__name__} rejected the arguments")

    def require_capability(self, *args, **kwargs):
        index, cc = _device_capability(args + tuple(kwargs.values()))
        if not _allows(self.common_check, cc):
            supported = ", ".join(str(c) for c in self.common_check.supported_compute_capabilities)
            raise self.fail(None, index, cc, f"supported compute capabilities are {supported}")

    def choose(self, *args, **kwargs):
        index, cc = _device_capability(args + tuple(kwargs.values()))
        self.choose_auto(index, cc, args, kwargs)

    def check(self, *args, **kwargs):
        index, cc = _device_capability(args + tuple(kwargs.values()) if kwargs else args)
        backend = kwargs["backend"] if "backend" in kwargs else args[self.backend_index]
        if backend == "auto":
            self.choose_auto(index, cc, args, kwargs)
            return
        if backend not in self.backend_checks:
            known = ", ".join(repr(b) for b in self.backend_checks)
            raise self.fail(backend, index, cc, f"unknown backend; choose one of {known} or 'auto'")
        self.run_check(self.common_check, backend, index, cc, args, kwargs)
        self.run_check(self.backend_checks[backend], backend, index, cc, args, kwargs)

    def choose_auto(self, index, cc, args, kwargs):
        suitable = [b for b in self.backend_checks if self.suitable(b, index, cc, args, kwargs)]
        ranked = list(self.heuristic_func(suitable, *args, **kwargs)) if self.heuristic_func else suitable
        if not ranked:
            raise self.fail("auto", index, cc, f"no backend of {list(self.backend_checks)} accepts these arguments")
        self.wrapper.suitable_auto_backends = ranked

    def allows_capability(self, cc: int, backend: Optional[str] = None) -> bool:
        """Whether the checks allow compute capability ``cc``: those of ``backend``, or of any."""
        if not _allows(self.common_check, cc):
            return False
        if backend is not None:
            return _allows(self.backend_checks[backend], cc)
        return not self.backend_checks or any(_allows(c, cc) for c in self.backend_checks.values())


def backend_requirement(
    backend_checks: Dict[str, Callable],
    common_check: Optional[Callable] = None,
    heuristic_func: Optional[Callable] = None,
) -> Callable:
    """Check an op's arguments, GPU and backend before it runs (see the module doc)."""
    if any(b == "auto" for b in backend_checks):
        raise ValueError("'auto' is not a backend name; it asks for heuristic_func's choice")

    def decorate(fn: Callable) -> Callable:
        spec = _op.spec_of(fn)
        spec.requirement = _Requirement(spec, backend_checks, common_check, heuristic_func)
        return _op.build(spec)

    return decorate
