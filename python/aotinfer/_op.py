"""The one wrapper every public op gets, built from what its decorators declare.

    @aotinfer_api(trace=rmsnorm_trace)                                   # logging, op.trace
    @backend_requirement(backend_checks={}, common_check=_check_rmsnorm)  # checks, queries
    def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):      # the body
        ...

Each decorator adds its part to the body's OpSpec and builds the wrapper again from the whole
spec, so the outermost one publishes the only wrapper. Its source is generated with the body's own
parameters plus a keyword-only ``skip_check=False``, and does, in order:

1. Under a torch dispatch mode (make_fx, non-strict torch.export, AOTAutograd, FakeTensorMode, a
   user's mode: one C call), runs the body's twin, whose kernel objects call aotinfer's torch
   custom ops, so the tracer records ``aotinfer::<binding>`` instead of running a kernel on fake
   tensors. Dynamo never traces a function op's wrapper: once torch._dynamo is imported, each is
   substituted (``torch.compiler.substitute_in_graph``) by a function that runs the twin. A test
   of ``torch.compiler.is_dynamo_compiling()`` in the wrapper would do the same for dynamo, but its
   Python call cost 1-3% of a small op's host time and broke the overhead budget
   (benchmarks/bench_overhead.py shows both). Dynamo does not substitute methods (a wrapper's
   ``run``), so their wrappers do test it: they are not small ops.
2. Logs the call (only generated at AOTINFER_LOGLEVEL >= 1, see api_logging).
3. Unless ``skip_check``, runs the checks (utils.backend_requirement): Python checks only what the
   bindings cannot name (scalars, backend choices); the bindings validate tensors.
4. Runs the body. A binding's type mismatch or a tensor it cannot take (a meta tensor) reaches the
   caller as TypeError or ValueError naming the argument, like every other check.

The wrapper also answers ``is_compute_capability_supported(cc)``, ``is_backend_supported(backend,
cc=None)``, ``has_backend(name)`` and ``has_backend_choices()``, against the builds installed.
"""

from __future__ import annotations

import types

from . import _kernels, _loader

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, List, Optional

_NO_DEFAULT = object()
_specs: List["OpSpec"] = []  # every op built, for binding the tracer tests once torch is imported


def _untraced() -> bool:
    """The tracer tests until torch is imported: without torch there is nothing to trace."""
    return False


class OpSpec:
    """What the decorators of one public op declared about it."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.name = f"{fn.__module__}.{fn.__qualname__}"
        self.parameters = _parameters(fn)
        self.requirement = None  # utils._Requirement, from @backend_requirement
        self.logging = None  # api_logging's (log_call, log_result), from @aotinfer_api at level >= 1
        self.namespace: dict = {}  # the wrapper's globals
        self.wrapper: Optional[Callable] = None

    @property
    def is_method(self) -> bool:
        """Defined in a class body (a wrapper's ``run``): dynamo substitutes no methods."""
        return "." in self.fn.__qualname__.rpartition("<locals>.")[2]

    @property
    def names(self) -> List[str]:
        return [name for name, _, _ in self.parameters]

    def kernels(self) -> List[_kernels.Kernel]:
        """The kernel objects the body names."""
        g = self.fn.__globals__
        return [g[n] for n in self.fn.__code__.co_names if isinstance(g.get(n), _kernels.Kernel)]


def spec_of(fn: Callable) -> OpSpec:
    """The spec of a body, or of a wrapper built here (a decorator below ours built it)."""
    spec = getattr(fn, "__aotinfer_spec__", None)
    return spec if spec is not None else OpSpec(fn)


# ---- the wrapper ------------------------------------------------------------------------------

_TEMPLATE = """
def {name}({params}):
    if {tracing}:
        return _traced({call})
{log_call}{checks}    try:
        {result}_fn({call})
    except (TypeError, RuntimeError) as e:
        _explain(e, ({values},))
        raise
{log_result}"""
_SINGLE_BACKEND = """    if not skip_check:
{capability}        if _common({call}) is not True:
            _rejected({call})
"""
_SEVERAL_BACKENDS = """    if not skip_check:
        _check({call})
    elif {auto}:
        _choose({call})
"""


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


def _source(spec: OpSpec) -> str:
    params, call = [], []
    star = False
    for name, keyword_only, default in spec.parameters:
        if keyword_only and not star:
            params.append("*")
            star = True
        params.append(name if default is _NO_DEFAULT else f"{name}=_default_{name}")
        call.append(f"{name}={name}" if keyword_only else name)
    if not star:
        params.append("*")
    params.append("skip_check=False")
    fields = dict(call=", ".join(call))
    requirement = spec.requirement
    checks = ""
    if requirement is not None and requirement.backend_checks:
        auto = f"{spec.names[requirement.backend_index]} == 'auto'"
        checks = _SEVERAL_BACKENDS.format(auto=auto, **fields)
    elif requirement is not None and requirement.common_check is not None:
        restricted = getattr(requirement.common_check, "supported_compute_capabilities", None) is not None
        capability = f"        _require_capability({fields['call']})\n" if restricted else ""
        checks = _SINGLE_BACKEND.format(capability=capability, **fields)
    logged = spec.logging is not None
    return _TEMPLATE.format(
        name=spec.fn.__name__,
        tracing="_dynamo() or _modes()" if spec.is_method else "_modes()",
        params=", ".join(params),
        values=", ".join(spec.names),
        log_call=f"    _log_call(({', '.join(spec.names)},))\n" if logged else "",
        checks=checks,
        result="result = " if logged else "return ",
        log_result="    _log_result(result)\n    return result\n" if logged else "",
        **fields,
    )


def build(spec: OpSpec) -> Callable:
    """Generate the op's wrapper from its spec (see the module doc) and return it."""
    import functools

    fn, requirement = spec.fn, spec.requirement
    namespace = {f"_default_{n}": d for n, _, d in spec.parameters if d is not _NO_DEFAULT}
    namespace.update(
        _fn=fn,
        _dynamo=_untraced,
        _modes=_untraced,
        _traced=None,
        _explain=lambda error, values: _explain(spec, error, values),
    )
    if requirement is not None:
        namespace.update(
            _common=requirement.common_check,
            _rejected=requirement.rejected,
            _require_capability=requirement.require_capability,
            _check=requirement.check,
            _choose=requirement.choose,
        )
    if spec.logging is not None:
        namespace["_log_call"], namespace["_log_result"] = spec.logging
    exec(compile(_source(spec), f"<aotinfer op {spec.name}>", "exec"), namespace)
    wrapper = functools.update_wrapper(namespace[fn.__name__], fn)
    wrapper.__wrapped__ = fn
    wrapper.__aotinfer_spec__ = spec
    wrapper.suitable_auto_backends = []
    wrapper.is_compute_capability_supported = lambda cc: is_compute_capability_supported(spec, cc)
    wrapper.is_backend_supported = lambda backend, cc=None: is_backend_supported(spec, backend, cc)
    wrapper.has_backend = lambda name: requirement is not None and name in requirement.backend_checks
    wrapper.has_backend_choices = lambda: requirement is not None and bool(requirement.backend_checks)
    if requirement is not None:
        requirement.wrapper = wrapper
    if spec.wrapper is None:
        _specs.append(spec)
    spec.namespace, spec.wrapper = namespace, wrapper
    if _torch is not None:
        _bind_tracers(spec, _torch)
    if _dynamo_loaded:
        _substitute_for_dynamo(spec, _torch)
    return wrapper


# ---- tracing ----------------------------------------------------------------------------------

_torch = None  # the torch module, once imported
_dynamo_loaded = False  # torch._dynamo is imported: ops built from now on are substituted at once


def _bind_tracers(spec: OpSpec, torch) -> None:
    """Give one op's wrapper its dispatch-mode test and the twin of its body that tracers run."""
    fn = spec.fn
    twins = {n: v.traced for n, v in fn.__globals__.items() if isinstance(v, _kernels.Kernel)}
    twin = types.FunctionType(fn.__code__, {**fn.__globals__, **twins}, fn.__name__, fn.__defaults__, fn.__closure__)
    twin.__kwdefaults__ = fn.__kwdefaults__
    dynamo = getattr(torch.compiler, "is_dynamo_compiling", None) or torch.compiler.is_compiling  # torch < 2.3
    spec.namespace.update(_dynamo=dynamo, _modes=torch._C._len_torch_dispatch_stack, _traced=twin)


def _substitute_for_dynamo(spec: OpSpec, torch) -> None:
    """Have dynamo trace calls of the op as its twin (torch 2.5 or newer; older ones graph-break)."""
    if spec.is_method or not hasattr(torch.compiler, "substitute_in_graph"):
        return
    twin = spec.namespace["_traced"]

    def traced(*args, skip_check=False, **kwargs):
        return twin(*args, **kwargs)

    torch.compiler.substitute_in_graph(spec.wrapper, skip_signature_check=True)(traced)


def _on_torch(torch) -> None:
    global _torch
    _torch = torch
    for spec in _specs:
        _bind_tracers(spec, torch)


def _on_dynamo(torch) -> None:
    global _dynamo_loaded
    _dynamo_loaded = True
    for spec in _specs:
        _substitute_for_dynamo(spec, torch)


_kernels.when_torch_is_imported(_on_torch, _on_dynamo)


# ---- errors from a binding, named -------------------------------------------------------------

# tvm-ffi's words for an argument of the wrong type, torch's for a tensor it cannot hand over, and a
# schema parameter: read with the re module, imported on the error path only (it costs milliseconds).
_MISMATCH = r"Mismatched type on argument #(\d+) when calling: `(\w+)\(.*Expected `([^`]*)` but got `([^`]*)`"
_NOT_PACKABLE = r"Cannot pack tensors on (\w+)"
_SCHEMA_PARAM = r"(\w+)(?:\(\w!\))? (\w+)"
_EXPECTED = {"Tensor": "a torch.Tensor", "float": "a real number", "int": "an integer", "bool": "a bool"}


def _binding_params(function: str) -> list:
    """[(type, name)] of a binding's parameters, from its schema in the manifest."""
    import re

    for functions in _loader.declared_functions().values():
        if function in functions:
            return re.findall(_SCHEMA_PARAM, functions[function].partition(") ->")[0])
    return []


def _explain(spec: OpSpec, error: BaseException, values: tuple) -> None:
    """Raise ``error`` again as the TypeError or ValueError that names the argument, if it is one
    a binding raised before its own checks could (the argument could not be converted); else
    return, and the caller re-raises it as it is."""
    import re

    message = str(error)
    arguments = dict(zip(spec.names, values))
    mismatch = re.search(_MISMATCH, message, re.S)
    if mismatch is not None:
        index, function, _, got = int(mismatch[1]), mismatch[2], mismatch[3], mismatch[4]
        params = _binding_params(function)
        if index < len(params):
            kind, name = params[index]
            if name in arguments:
                got = type(arguments[name]).__name__
            raise TypeError(f"Expected {name} to be {_EXPECTED.get(kind, kind)}, got {got}") from None
    unpackable = re.search(_NOT_PACKABLE, message)
    if unpackable is not None:
        for name, value in arguments.items():
            device = getattr(value, "device", None)
            if getattr(device, "type", None) == unpackable[1]:
                raise ValueError(f"Expected {name} to be a CUDA tensor, got a tensor on {device}") from None


# ---- queries ----------------------------------------------------------------------------------


def cc_int(cc: Any) -> int:
    """90 from 90, (9, 0) or "9.0"."""
    if isinstance(cc, int):
        return cc
    if isinstance(cc, str):
        major, _, minor = cc.partition(".")
        return int(major) * 10 + int(minor or 0)
    major, minor = cc
    return major * 10 + minor


def builds_run_on(spec: OpSpec, cc: int) -> bool:
    """Whether this install has a build of every kernel module the op uses for compute capability
    ``cc`` (as an int), as ``python -m aotinfer info --cc`` would answer."""
    try:
        for k in spec.kernels():
            _loader.resolve(k.module, (cc // 10, cc % 10))
    except (_loader.NoCompatibleBuild, _loader.NotBuiltError):
        return False
    return True


def is_compute_capability_supported(spec: OpSpec, cc: Any) -> bool:
    cc = cc_int(cc)
    requirement = spec.requirement
    if requirement is not None and not requirement.allows_capability(cc):
        return False
    return builds_run_on(spec, cc)


def is_backend_supported(spec: OpSpec, backend: str, cc: Any = None) -> bool:
    requirement = spec.requirement
    if requirement is None or backend not in requirement.backend_checks:
        return False
    if cc is None:
        return True
    cc = cc_int(cc)
    return requirement.allows_capability(cc, backend) and builds_run_on(spec, cc)
