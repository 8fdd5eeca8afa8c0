"""Kernel functions: each binding of modules.toml as a Python callable and as a torch custom op.

An op calls a binding through its kernel object, outputs first: ``_scale.fn(out, input, factor)``
for ``_scale = kernel("scale", "scale")``. The first call picks the build for the GPUs of this
process; when they all load the same shared object (one model of GPU, the usual server), ``fn``
becomes that tvm-ffi function itself, so later calls cost nothing on top of the binding. With GPUs
that need different builds, ``fn`` dispatches on the first argument's device.

For torch.compile every binding is also the custom op ``torch.ops.aotinfer.<name>``, its schema
taken from modules.toml. Bindings write into outputs the caller allocated and return nothing, so
every fake implementation does nothing: ops allocate outputs with torch calls dynamo traces itself.
Dynamo never traces a public op's eager code: ``traceable(op, body)`` makes it trace a copy of the
op's body whose kernel objects call the custom ops instead (``torch.compiler.substitute_in_graph``).
The eager path therefore carries no "am I compiling?" test. Substitutions are registered once
torch._dynamo is imported (a one-shot import hook; at once if it already is); we never import it.

The custom ops are defined at the first kernel call or when torch._dynamo is imported, whichever
comes first. They need the manifest, never a GPU.
"""

from __future__ import annotations

import sys
import threading

from . import _loader

_register_lock = threading.Lock()
_library = None  # the torch.library.Library holding aotinfer's ops, once defined
_kernels: dict = {}  # binding name -> Kernel
_traceable: list = []  # (public op, its body), waiting for or given dynamo substitutions
_dynamo_ready = False  # substitutions go straight to a loaded torch._dynamo


class Kernel:
    """One binding; call ``kernel.fn(*binding arguments)``."""

    __slots__ = ("module", "function", "fn", "by_device")

    def __init__(self, module: str, function: str) -> None:
        self.module = module
        self.function = function
        self.fn = self._first_call
        self.by_device: dict = {}

    def __repr__(self) -> str:
        return f"<aotinfer kernel {self.module}.{self.function}>"

    def _binding(self, index: int):
        fn = self.by_device.get(index)
        if fn is None:
            fn = self.by_device[index] = getattr(_loader.get_module(self.module, index), self.function)
        return fn

    def _first_call(self, *args):
        register_torch_ops()
        # The binding of the first argument's GPU, or of the first argument on a GPU: the
        # binding's own checks then name an argument left on the CPU.
        index = next((a.get_device() for a in args if getattr(a, "is_cuda", False)), -1)
        fn = self._binding(index)
        with _register_lock:
            if self.fn == self._first_call:
                self.fn = fn if _one_build_for_all_gpus(self.module) else self._per_device
        return fn(*args)

    def _per_device(self, *args):
        index = args[0].get_device()
        fn = self.by_device.get(index)
        if fn is None:
            fn = self._binding(next((a.get_device() for a in args if getattr(a, "is_cuda", False)), -1))
        return fn(*args)

    def __call__(self, *args) -> None:
        """The binding on the arguments' GPU (the custom op's CUDA implementation)."""
        self.fn(*args)


def kernel(module: str, function: str) -> Kernel:
    """The kernel object of binding ``function`` of kernel module ``module``."""
    k = _kernels.get(function)
    if k is None:
        k = _kernels[function] = Kernel(module, function)
    return k


def _one_build_for_all_gpus(module: str) -> bool:
    import torch

    try:
        files = {_loader.resolve(module, _loader.device_capability(i))[1] for i in range(torch.cuda.device_count())}
    except _loader.NoCompatibleBuild:  # some GPU has none: dispatch per device, fail only there
        return False
    return len(files) == 1


_compiler = None  # torch.compiler, once torch is imported


def _is_compiling() -> bool:
    """torch.compiler.is_compiling, without importing torch at aotinfer's import."""
    global _compiler
    if _compiler is None:
        import torch

        _compiler = torch.compiler
    return _compiler.is_compiling()


def register_torch_ops() -> None:
    """Define aotinfer::<function> for every binding of the manifest (once)."""
    global _library
    if _library is not None:
        return
    with _register_lock:
        if _library is not None:
            return
        import torch

        library = torch.library.Library("aotinfer", "FRAGMENT")
        for module, entry in _loader.manifest()["modules"].items():
            for function, schema in entry["functions"].items():
                library.define(function + schema)
                library.impl(function, kernel(module, function), "CUDA")
                torch.library.register_fake(f"aotinfer::{function}", _writes_outputs_only, lib=library)
        _library = library


def _writes_outputs_only(*args) -> None:
    """Fake implementation of every binding: outputs exist already, nothing is returned."""
    return None


# ---- torch.compile: trace a public op as its body with custom ops ---------------------------------


class _TracedKernel:
    """Stands in for a Kernel in the copy of an op's body that dynamo traces."""

    __slots__ = ("fn",)

    def __init__(self, function: str) -> None:
        import torch

        self.fn = getattr(torch.ops.aotinfer, function)


def _substitute(op, body) -> None:
    import types

    import torch

    register_torch_ops()
    names = {name: _TracedKernel(v.function) for name, v in body.__globals__.items() if isinstance(v, Kernel)}
    twin = types.FunctionType(body.__code__, {**body.__globals__, **names}, body.__name__,
                              body.__defaults__, body.__closure__)
    twin.__kwdefaults__ = body.__kwdefaults__

    def traced(*args, skip_check=False, **kwargs):
        return twin(*args, **kwargs)

    torch.compiler.substitute_in_graph(op, skip_signature_check=True)(traced)


def traceable(op, body) -> None:
    """Have dynamo trace calls of the public ``op`` as ``body`` calling aotinfer's custom ops.

    Kernel objects must be module globals that ``body`` itself uses (not helpers it calls).
    """
    _traceable.append((op, body))
    if _dynamo_ready:
        _substitute(op, body)
    else:
        _when_dynamo_loads()


def _on_dynamo_loaded() -> None:
    global _dynamo_ready
    import torch

    if not hasattr(torch.compiler, "substitute_in_graph"):  # torch < 2.5: compile graph-breaks
        return
    try:
        register_torch_ops()
    except _loader.NotBuiltError:
        return
    _dynamo_ready = True
    for op, body in _traceable:
        _substitute(op, body)


class _DynamoImportHook:
    """A one-shot import hook: runs _on_dynamo_loaded right after torch._dynamo is imported."""

    name = "torch._dynamo"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _on_dynamo_loaded()

        spec.loader.exec_module = exec_then_register
        return spec


_hook = None


def _when_dynamo_loads() -> None:
    """Register the substitutions now if torch._dynamo is loaded, else as soon as it is."""
    global _hook
    if _hook is not None or _dynamo_ready:
        return
    _hook = _DynamoImportHook()
    if "torch._dynamo" in sys.modules:
        _hook = "fired"
        return  # aotinfer/__init__ calls _on_dynamo_loaded once every op module is imported
    sys.meta_path.insert(0, _hook)
