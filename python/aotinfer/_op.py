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
4. Runs the body: from the second call on, its statements in the wrapper's own frame (see "the
   body inlined" below). A binding's type mismatch or a tensor it cannot take (a meta tensor)
   reaches the caller as TypeError or ValueError naming the argument, like every other check.

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

# The wrapper is generated inside a factory whose parameters are its helpers, so that it reads them
# from its closure (set again by _set_helpers once torch is imported) and the op's own module's
# globals. Its variants differ only in calling the body (_fn) and in the first-call hook (_inline);
# the `if False:` line names both in every variant, so all share one closure and a variant can
# replace another in the published function object (_inline).
_TEMPLATE = """
def _make({helpers}):
    def {name}({params}):
{first_call}        if {tracing}:
            return _traced({call})
{log_call}{checks}        try:
            {result}_fn({call})
        except (TypeError, RuntimeError) as _error:
            _explain(_error, ({values},))
            raise
{log_result}        if False:
            _fn, _inline
    return {name}
"""
_SINGLE_BACKEND = """        if not skip_check:
{capability}            if _common({call}) is not True:
                _rejected({call})
"""
_SEVERAL_BACKENDS = """        if not skip_check:
            _check({call})
        elif {auto}:
            _choose({call})
"""
# What a wrapper's code may name besides the body's parameters: the helpers, and the names the
# template itself binds. A body that uses any of them is never inlined.
_TEMPLATE_NAMES = frozenset(("skip_check", "_error", "result", "_make"))


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


def _source(spec: OpSpec, helpers: List[str], tracing: Optional[str] = None, first_call: bool = False) -> str:
    """The factory of the op's wrapper (see _TEMPLATE); ``tracing`` replaces the tracer test."""
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
        capability = f"            _require_capability({fields['call']})\n" if restricted else ""
        checks = _SINGLE_BACKEND.format(capability=capability, **fields)
    logged = spec.logging is not None
    return _TEMPLATE.format(
        helpers=", ".join(helpers),
        name=spec.fn.__name__,
        first_call="        _inline()\n" if first_call else "",
        tracing=tracing or ("_dynamo() or _modes()" if spec.is_method else "_modes()"),
        params=", ".join(params),
        values=", ".join(spec.names),
        log_call=f"        _log_call(({', '.join(spec.names)},))\n" if logged else "",
        checks=checks,
        result="result = " if logged else "return ",
        log_result="        _log_result(result)\n        return result\n" if logged else "",
        **fields,
    )


def make_wrapper(spec: OpSpec, tracing: Optional[str] = None, inline: bool = False, **extra: Any) -> Callable:
    """A new wrapper function of the op, from its spec and current helpers (``extra`` adds some);
    ``tracing`` replaces the tracer test; ``inline``: the body's statements run in the wrapper's
    own frame where they can (see _inlined_code). Not published: build() does that."""
    helpers = dict(spec.namespace, **extra)
    names = sorted(helpers)
    make = types.FunctionType(_factory_code(spec, _source(spec, names, tracing), inline), spec.fn.__globals__)
    return make(*(helpers[n] for n in names))


def _factory_code(spec: OpSpec, source: str, inline: bool) -> types.CodeType:
    """The code of ``source``'s factory; with the body inlined where ``inline`` and it can be."""
    code = None
    if inline:
        try:
            code = _inlined_code(spec, source)
        except (OSError, SyntaxError, ValueError, TypeError, UnicodeDecodeError):
            pass  # the plain variant below
    if code is None:
        code = compile(source, f"<aotinfer op {spec.name}>", "exec")
    return next(c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == "_make")


def build(spec: OpSpec) -> Callable:
    """Generate the op's wrapper (see the module doc), publish it and return it."""
    import functools

    fn, requirement = spec.fn, spec.requirement
    namespace = {f"_default_{n}": d for n, _, d in spec.parameters if d is not _NO_DEFAULT}
    namespace.update(
        _fn=fn,
        _dynamo=_untraced,
        _modes=_untraced,
        _traced=None,
        _explain=lambda error, values: _explain(spec, error, values),
        _inline=lambda: _inline(spec),
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
    spec.namespace = namespace
    names = sorted(namespace)
    make = types.FunctionType(_factory_code(spec, _source(spec, names, first_call=_inlinable(spec)), False), fn.__globals__)
    wrapper = functools.update_wrapper(make(*(namespace[n] for n in names)), fn)
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
    spec.wrapper = wrapper
    if _torch is not None:
        _bind_tracers(spec, _torch)
    if _dynamo_loaded:
        _substitute_for_dynamo(spec, _torch)
    return wrapper


def _set_helpers(spec: OpSpec, **values: Any) -> None:
    """Give the op's wrapper new helper values (its closure's cells)."""
    spec.namespace.update(values)
    wrapper = spec.wrapper
    for name, cell in zip(wrapper.__code__.co_freevars, wrapper.__closure__ or ()):
        if name in values:
            cell.cell_contents = values[name]


# ---- the body inlined ---------------------------------------------------------------------------
#
# A small op's host time is mostly the binding's; the wrapper's Python frame and the body's add
# to it (benchmarks/bench_overhead.py: a budget of 5% over the bare binding with skip_check). So
# on the first call a wrapper's code is replaced by a variant that runs the body's statements in
# its own frame: one Python call fewer. That is done then and not at import because it parses and
# compiles the body's source file (once a file: 45 ms for all 28 public ops on this project's CPU
# machine, against 15 ms for the whole import). The statements keep the body's file and line
# numbers, so tracebacks show the real source; the wrapper's own lines show the op's first
# decorator line. Where the source cannot be read or no longer compiles to the body that runs, the
# wrapper keeps calling the body.


def _inlinable(spec: OpSpec) -> bool:
    """Whether the body can run in the wrapper's frame: a module-level function without logging,
    a closure or generators, naming none of the wrapper's own names (nor do functions defined in
    it)."""
    code = spec.fn.__code__
    if spec.is_method or spec.logging is not None or code.co_freevars:
        return False
    if code.co_flags & (0x20 | 0x80 | 0x100 | 0x200):
        return False  # generators and coroutines
    return _TEMPLATE_NAMES.union(spec.namespace).isdisjoint(_names(code))


def _names(code: types.CodeType) -> set:
    """Every name ``code`` and the functions defined in it use."""
    names = set(code.co_varnames + code.co_names + code.co_freevars + code.co_cellvars)
    for inner in code.co_consts:
        if isinstance(inner, types.CodeType):
            names |= _names(inner)
    return names


def _inline(spec: OpSpec) -> None:
    """Replace the published wrapper's code by the inlined variant, or by the plain one (without
    this first-call hook) where inlining fails."""
    factory = _factory_code(spec, _source(spec, sorted(spec.namespace)), inline=True)
    code = next(c for c in factory.co_consts if isinstance(c, types.CodeType) and c.co_name == spec.fn.__name__)
    if code.co_freevars == spec.wrapper.__code__.co_freevars:
        spec.wrapper.__code__ = code


def _inlined_code(spec: OpSpec, source: str) -> Optional[types.CodeType]:
    """``source`` (a wrapper factory calling the body) compiled with the body's statements in
    place of the call, or None where that cannot be done (see _inlinable)."""
    import _ast  # the parser's node types: 50 us to import, where the ast module takes ms

    if not _inlinable(spec):
        return None
    code, name = spec.fn.__code__, spec.fn.__name__
    parsed = _parsed_file(code.co_filename)
    if parsed is None:
        return None
    # The body's statements from its file, only if the file still compiles to the body that runs
    # (it may have changed since it was imported).
    tree, compiled = parsed
    definition = next((n for n in tree.body if isinstance(n, _ast.FunctionDef) and n.name == name and _first_line(n) == code.co_firstlineno), None)
    if definition is None or not any(c == code for c in compiled.co_consts if isinstance(c, types.CodeType)):
        return None
    body = definition.body
    if isinstance(body[0], _ast.Expr) and isinstance(body[0].value, _ast.Constant) and isinstance(body[0].value.value, str):
        body = body[1:]  # the docstring
    if not body:
        return None
    futures = code.co_flags & _future_flags()  # the body's module's __future__ imports, not ours
    factory = compile(source, code.co_filename, "exec", _ast.PyCF_ONLY_AST | futures, dont_inherit=True)
    decorator = definition.decorator_list[0] if definition.decorator_list else definition
    _place(factory, code.co_firstlineno, decorator.end_col_offset if decorator.end_lineno == decorator.lineno else 0)
    wrapper = factory.body[0].body[0]
    calls = [n for n in wrapper.body if isinstance(n, _ast.Try)]
    if len(calls) != 1:
        return None
    calls[0].body = body
    return compile(factory, code.co_filename, "exec", futures, dont_inherit=True)


_parsed_files: dict = {}


def _parsed_file(path: str) -> Optional[tuple]:
    """(syntax tree, module code) of a source file, made once (None where it cannot be read): the
    whole file, since what it imports at module level changes how a function in it compiles."""
    import _ast

    if path not in _parsed_files:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            tree = compile(text, path, "exec", _ast.PyCF_ONLY_AST, dont_inherit=True)
            _parsed_files[path] = (tree, compile(tree, path, "exec", dont_inherit=True))
        except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
            _parsed_files[path] = None
    return _parsed_files[path]


def _first_line(definition: Any) -> int:
    """The line of a def's first decorator, or of the def: its code object's co_firstlineno."""
    return definition.decorator_list[0].lineno if definition.decorator_list else definition.lineno


def _future_flags() -> int:
    import __future__

    return sum(getattr(__future__, name).compiler_flag for name in __future__.all_feature_names)


def _place(tree: Any, line: int, length: int) -> None:
    """Give every node of ``tree`` the position (line, 0) to (line, length)."""
    import _ast

    stack = [tree]
    while stack:
        node = stack.pop()
        if hasattr(node, "lineno"):
            node.lineno = node.end_lineno = line
            node.col_offset, node.end_col_offset = 0, length
        for field in node._fields:
            value = getattr(node, field, None)
            if isinstance(value, list):
                stack.extend(v for v in value if isinstance(v, _ast.AST))
            elif isinstance(value, _ast.AST):
                stack.append(value)


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
    _set_helpers(spec, _dynamo=dynamo, _modes=torch._C._len_torch_dispatch_stack, _traced=twin)


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
