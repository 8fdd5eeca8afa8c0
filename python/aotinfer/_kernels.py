"""Kernel functions: each binding of modules.toml as a Python callable and as a torch custom op.

An op calls a binding through its kernel object, outputs first: ``_scale.fn(out, input, factor,
pdl)`` for ``_scale = kernel("scale", "scale")``. The first call picks the build for the GPUs of
this process; when they all load the same shared object (one model of GPU, the usual server),
``fn`` becomes that tvm-ffi function itself, so later calls cost nothing on top of the binding.
With GPUs that need different builds, ``fn`` dispatches on the first argument's device. A first
call with no argument on a GPU runs the binding of any build: its checks name the argument that
is not where it should be, before anything touches a device.

Every binding is also the custom op ``torch.ops.aotinfer.<name>``, its schema taken from
modules.toml, defined as soon as torch and aotinfer are both imported (whichever comes second
defines them; no shared object is loaded and no GPU is touched). Bindings write into outputs the
caller allocated and return nothing, so the fake (Meta) implementation does nothing: ops allocate
their outputs with torch calls that tracers record themselves. Tracers see an op's body run
with each kernel object swapped for its ``traced`` twin, which calls the custom op (_op.py decides
when); the eager path never goes through torch's dispatcher.
"""

from __future__ import annotations

import os
import sys

from . import _loader

_register_lock = _loader.fork_safe_lock()
_library = None  # the torch.library.Library holding aotinfer's ops, once defined
_kernels: dict = {}  # binding name -> Kernel
_on_torch: list = []  # callbacks run once torch and aotinfer are both imported (_op.py binds its gates)
_on_dynamo: list = []  # callbacks run once torch._dynamo is imported too (_op.py's substitutions)


class TracedKernel:
    """A kernel object's twin for tracers: ``fn`` is the custom op aotinfer::<function>."""

    __slots__ = ("function", "fn")

    def __init__(self, function: str) -> None:
        self.function = function
        self.fn = self._unregistered

    def _unregistered(self, *args):
        # Only reachable when the ops could not be defined: say why, as an op call would.
        _loader.declared_functions()
        raise RuntimeError(f"aotinfer's custom op aotinfer::{self.function} is not defined")


class Kernel:
    """One binding; call ``kernel.fn(*binding arguments)``."""

    __slots__ = ("module", "function", "fn", "by_device", "traced")

    def __init__(self, module: str, function: str) -> None:
        self.module = module
        self.function = function
        self.fn = self._first_call
        self.by_device: dict = {}
        self.traced = TracedKernel(function)

    def __repr__(self) -> str:
        return f"<aotinfer kernel {self.module}.{self.function}>"

    def _binding(self, index: int):
        fn = self.by_device.get(index)
        if fn is None:
            fn = self.by_device[index] = getattr(_loader.get_module(self.module, index), self.function)
        return fn

    def _first_call(self, *args):
        # The binding of the first argument on a GPU; with none there, of any build, whose checks
        # then name the argument that is not on a GPU.
        index = next((a.get_device() for a in args if getattr(a, "is_cuda", False)), -1)
        fn = self._binding(index)
        if index >= 0:
            with _register_lock:
                if self.fn == self._first_call:
                    self.fn = fn if _one_build_for_all_gpus(self.module) else self._per_device
        return fn(*args)

    def _per_device(self, *args):
        fn = self.by_device.get(args[0].get_device())
        if fn is None:
            fn = self._binding(next((a.get_device() for a in args if getattr(a, "is_cuda", False)), -1))
        return fn(*args)

    def __call__(self, *args) -> None:
        """The binding on the arguments' GPU (the custom op's implementation)."""
        self.fn(*args)


def kernel(module: str, function: str) -> Kernel:
    """The kernel object of binding ``function`` of kernel module ``module``."""
    k = _kernels.get(function)
    if k is None:
        k = _kernels[function] = Kernel(module, function)
    return k


def _one_build_for_all_gpus(module: str) -> bool:
    import torch

    files = set()
    try:
        for i in range(torch.cuda.device_count()):
            cc = _loader.device_capability(i)
            try:
                files.add(_loader.resolve(module, cc)[1])
            except _loader.NoCompatibleBuild as e:  # a JIT build, if one is cached (never compiles here)
                from . import jit

                files.add(jit.resolve(module, cc, str(e), build=False)[1])
    except (_loader.NoCompatibleBuild, _loader.NotBuiltError):  # some GPU has none: per device, fail only there
        return False
    return len(files) == 1


# ---- torch custom ops ---------------------------------------------------------------------------


def register_torch_ops() -> None:
    """Define aotinfer::<function> for every binding of the manifest (once; torch imported)."""
    global _library
    if _library is not None:
        return
    with _register_lock:
        if _library is not None:
            return
        import torch

        declared = _loader.declared_functions()
        library = torch.library.Library("aotinfer", "FRAGMENT")
        for module, functions in declared.items():
            for function, schema in functions.items():
                library.define(function + schema)
                # CPU too: there the binding's own check names the tensor that is not on a GPU.
                library.impl(function, kernel(module, function), "CUDA")
                library.impl(function, kernel(module, function), "CPU")
                library.impl(function, _writes_outputs_only, "Meta")
        for k in _kernels.values():
            if any(k.function in functions for functions in declared.values()):
                k.traced.fn = getattr(torch.ops.aotinfer, k.function)
        _library = library


def _writes_outputs_only(*args) -> None:
    """Fake (Meta) implementation of every binding: outputs exist already, nothing is returned."""
    return None


def when_torch_is_imported(callback, dynamo_callback) -> None:
    """Run ``callback(torch)`` once torch and aotinfer are both imported, and
    ``dynamo_callback(torch)`` once torch._dynamo is imported too (see on_aotinfer_imported)."""
    _on_torch.append(callback)
    _on_dynamo.append(dynamo_callback)


def _run_callbacks(callbacks, also=None) -> None:
    """Run callbacks inside someone's ``import``: nothing here may make that import fail, so a
    failure is one warning, and the ops say what is wrong when called."""
    torch = sys.modules["torch"]
    try:
        for callback in callbacks:
            callback(torch)
        if also is not None:
            also()
    except _loader.NotBuiltError as e:
        if not os.path.exists(_loader.MANIFEST):  # a source tree without kernels: ops say so when called
            return
        _warn(f"aotinfer's torch custom ops are not defined: {e}")
    except Exception as e:  # noqa: BLE001 - see the docstring
        _warn(f"aotinfer's torch custom ops are not defined: {type(e).__name__}: {e}")


def _torch_imported() -> None:
    """torch and aotinfer are both imported: define the custom ops, run the callbacks, and wait
    for torch._dynamo."""
    _run_callbacks(_on_torch, register_torch_ops)
    if "torch._dynamo" in sys.modules:
        _dynamo_imported()
    else:
        sys.meta_path.insert(0, _ImportHook("torch._dynamo", _dynamo_imported))


def _dynamo_imported() -> None:
    _run_callbacks(_on_dynamo)


def _warn(message: str) -> None:
    import warnings

    warnings.warn(message, RuntimeWarning, stacklevel=2)


class _ImportHook:
    """A one-shot import hook that calls ``then()`` right after module ``name`` is imported."""

    def __init__(self, name: str, then) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then(module):
            exec_module(module)
            self.then()

        spec.loader.exec_module = exec_then
        return spec


def on_aotinfer_imported() -> None:
    """Called once every op module is imported: define the ops now if torch is already imported,
    else right after it is."""
    if "torch" in sys.modules:
        _torch_imported()
    else:
        sys.meta_path.insert(0, _ImportHook("torch", _torch_imported))
