"""Requirements of public ops: which GPUs and which backends, checked before the kernel runs.

    @supported_compute_capability([80, 86, 89, 90, 100, 103, 110, 120])
    def _check_scale(input, factor, out=None):        # the op's arguments; True or raise
        ...

    @backend_requirement(backend_checks={}, common_check=_check_scale)
    def scale(input, factor, out=None): ...

Three patterns: one implementation (``backend_checks={}`` and a ``common_check``); several
(``backend_checks={"cuda": check, "cudnn": check}``, chosen by the op's ``backend`` argument); and
``backend="auto"``, where every backend whose checks pass is ranked by ``heuristic_func(suitable,
*args)`` into ``op.suitable_auto_backends`` for the op to pick from.

The wrapped op takes a keyword-only ``skip_check=False`` and gains ``is_backend_supported``,
``is_compute_capability_supported``, ``has_backend`` and ``has_backend_choices``. The compute
capability checked is that of the first CUDA tensor among the arguments (cached per device), as
``major * 10 + minor``, and only where a check lists capabilities.

The wrapper is generated with the op's own signature and, for one backend, with the check call
written into it: a checked call costs the wrapper plus the check function, and ``skip_check=True``
the wrapper alone. torch.compile traces the op's body instead (``_kernels.traceable``); the
bindings validate again at run time.
"""

from __future__ import annotations

from . import _kernels, _loader

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Iterable, Optional


class BackendSupportedError(ValueError):
    """An op cannot run with this backend, on this GPU, or with these arguments."""


def check_cuda_tensor(tensor: Any, name: str) -> None:
    """For check functions: TypeError unless ``tensor`` is a tensor, ValueError unless on a GPU."""
    try:
        on_gpu = tensor.is_cuda
    except AttributeError:
        raise TypeError(f"Expected {name} to be a torch.Tensor, got {type(tensor).__name__}") from None
    if not on_gpu:
        raise ValueError(f"Expected {name} to be a CUDA tensor, got a tensor on {tensor.device}")


def _cc_int(cc: Any) -> int:
    """90 from 90, (9, 0) or "9.0"."""
    if isinstance(cc, int):
        return cc
    if isinstance(cc, str):
        major, _, minor = cc.partition(".")
        return int(major) * 10 + int(minor or 0)
    major, minor = cc
    return major * 10 + minor


def supported_compute_capability(ccs: Iterable[Any]) -> Callable:
    """Mark a check function with the compute capabilities (e.g. 80, 90, 100) it allows."""
    allowed = tuple(sorted({_cc_int(c) for c in ccs}))

    def mark(check: Callable) -> Callable:
        check.supported_compute_capabilities = allowed
        check.is_compute_capability_supported = lambda cc: _cc_int(cc) in allowed
        return check

    return mark


def _allows(check: Optional[Callable], cc: Optional[int]) -> bool:
    ccs = getattr(check, "supported_compute_capabilities", None)
    return cc is None or ccs is None or cc in ccs


_capabilities: Dict[int, int] = {}


def _device_capability(args: tuple) -> tuple:
    """(device index, compute capability as an int) of the first CUDA tensor, or (None, None)."""
    for arg in args:
        get_device = getattr(arg, "get_device", None)
        if get_device is not None and getattr(arg, "is_cuda", False):
            index = get_device()
            cc = _capabilities.get(index)
            if cc is None:
                cc = _capabilities[index] = _cc_int(_loader.device_capability(index))
            return index, cc
    return None, None


class _Requirement:
    def __init__(self, fn, backend_checks, common_check, heuristic_func):
        self.fn = fn
        self.name = f"{fn.__module__}.{fn.__qualname__}"
        self.backend_checks = dict(backend_checks)
        self.common_check = common_check
        self.heuristic_func = heuristic_func
        self.parameters = _parameters(fn)
        params = [name for name, _, _ in self.parameters]
        self.backend_index = params.index("backend") if "backend" in params else None
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

    def backend_of(self, args, kwargs):
        return kwargs["backend"] if "backend" in kwargs else args[self.backend_index]

    def check(self, *args, **kwargs):
        index, cc = _device_capability(args + tuple(kwargs.values()) if kwargs else args)
        if not self.backend_checks:
            self.run_check(self.common_check, None, index, cc, args, kwargs)
            return
        backend = self.backend_of(args, kwargs)
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

    # ---- queries ------------------------------------------------------------------------------

    def is_backend_supported(self, backend: str, cc: Any = None) -> bool:
        if backend not in self.backend_checks:
            return False
        cc = None if cc is None else _cc_int(cc)
        return _allows(self.backend_checks[backend], cc) and _allows(self.common_check, cc)

    def is_compute_capability_supported(self, cc: Any) -> bool:
        cc = _cc_int(cc)
        if not self.backend_checks:
            return _allows(self.common_check, cc)
        return any(self.is_backend_supported(b, cc) for b in self.backend_checks)

    def has_backend(self, name: str) -> bool:
        return name in self.backend_checks

    def has_backend_choices(self) -> bool:
        return bool(self.backend_checks)


# The generated wrappers: the op's parameters as they are, plus skip_check. With one backend the
# common check is called inline; with several, "auto" backends are ranked even with skip_check,
# since the op reads its choice from suitable_auto_backends.
_SINGLE_BACKEND = """
def {name}({params}):
    if not skip_check:
        {capability}
        if _common({call}) is not True:
            _rejected({call})
    return _fn({call})
"""
_NO_CHECKS = """
def {name}({params}):
    return _fn({call})
"""
_SEVERAL_BACKENDS = """
def {name}({params}):
    if not skip_check:
        _check({call})
    elif {auto}:
        _choose({call})
    return _fn({call})
"""


_NO_DEFAULT = object()


def _parameters(fn) -> list:
    """(name, keyword_only, default or _NO_DEFAULT) of fn's parameters, read from its code object
    (inspect costs milliseconds at import, for every op)."""
    code = fn.__code__
    if code.co_flags & (0x04 | 0x08):  # CO_VARARGS, CO_VARKEYWORDS
        raise TypeError(f"{fn.__module__}.{fn.__qualname__}: ops with *args or **kwargs are not supported")
    positional = code.co_varnames[: code.co_argcount]
    keyword_only = code.co_varnames[code.co_argcount : code.co_argcount + code.co_kwonlyargcount]
    defaults = fn.__defaults__ or ()
    first_default = len(positional) - len(defaults)
    result = [(n, False, defaults[i - first_default] if i >= first_default else _NO_DEFAULT) for i, n in enumerate(positional)]
    kwdefaults = fn.__kwdefaults__ or {}
    result += [(n, True, kwdefaults.get(n, _NO_DEFAULT)) for n in keyword_only]
    return result


def _wrapper_source(requirement: _Requirement) -> str:
    params, names, call = [], [], []
    star = False
    for name, keyword_only, default in requirement.parameters:
        if keyword_only and not star:
            params.append("*")
            star = True
        params.append(name if default is _NO_DEFAULT else f"{name}=_default_{name}")
        names.append(name)
        call.append(f"{name}={name}" if keyword_only else name)
    if not star:
        params.append("*")
    params.append("skip_check=False")
    fields = dict(name=requirement.fn.__name__, params=", ".join(params), call=", ".join(call))
    if not requirement.backend_checks:
        if requirement.common_check is None:
            return _NO_CHECKS.format(**fields)
        restricted = getattr(requirement.common_check, "supported_compute_capabilities", None) is not None
        capability = f"_require_capability({fields['call']})" if restricted else "pass"
        return _SINGLE_BACKEND.format(capability=capability, **fields)
    auto = f"{names[requirement.backend_index]} == 'auto'" if requirement.backend_index is not None else "False"
    return _SEVERAL_BACKENDS.format(auto=auto, **fields)


def backend_requirement(
    backend_checks: Dict[str, Callable],
    common_check: Optional[Callable] = None,
    heuristic_func: Optional[Callable] = None,
) -> Callable:
    """Check an op's arguments, GPU and backend before it runs (see the module doc)."""
    if any(b == "auto" for b in backend_checks):
        raise ValueError("'auto' is not a backend name; it asks for heuristic_func's choice")

    def decorate(fn: Callable) -> Callable:
        import functools

        requirement = _Requirement(fn, backend_checks, common_check, heuristic_func)
        namespace = {f"_default_{n}": d for n, _, d in requirement.parameters if d is not _NO_DEFAULT}
        namespace.update(
            _fn=fn,
            _common=common_check,
            _rejected=requirement.rejected,
            _require_capability=requirement.require_capability,
            _check=requirement.check,
            _choose=requirement.choose,
        )
        source = _wrapper_source(requirement)
        exec(compile(source, f"<aotinfer checks of {requirement.name}>", "exec"), namespace)
        wrapper = functools.update_wrapper(namespace[fn.__name__], fn)
        wrapper.__wrapped__ = fn
        wrapper.suitable_auto_backends = []
        wrapper.is_backend_supported = requirement.is_backend_supported
        wrapper.is_compute_capability_supported = requirement.is_compute_capability_supported
        wrapper.has_backend = requirement.has_backend
        wrapper.has_backend_choices = requirement.has_backend_choices
        requirement.wrapper = wrapper
        _kernels.traceable(wrapper, fn)
        return wrapper

    return decorate
