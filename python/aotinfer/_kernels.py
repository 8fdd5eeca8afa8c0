"""Kernel functions: each binding of modules.toml as a Python callable and as a torch custom op.

``kernel("scale", "scale")`` is called exactly like the binding, outputs first:
``kernel_fn(out, input, factor)``. Eagerly it runs the tvm-ffi function of the build that fits the
first argument's GPU: one dict lookup after the first call, and nothing spent on torch.compile.

For torch.compile every binding is also the custom op ``torch.ops.aotinfer.<name>``, with its
schema from modules.toml. Every binding writes into outputs the caller allocated and returns
nothing, so each op's fake implementation does nothing: the op layer above allocates outputs with
ordinary torch calls that dynamo traces itself. Dynamo is told to trace a call of the kernel
function as a call of the custom op (``torch.compiler.substitute_in_graph``), so the eager path
carries no "am I compiling?" test. That substitution is registered when torch._dynamo is imported
(a one-shot import hook, or at once if it already is), without importing dynamo ourselves.

The custom ops are defined once: at ``import aotinfer`` when torch is already imported, else at
the first kernel call. They need the manifest, never a GPU.
"""

from __future__ import annotations

import sys
import threading

from . import _loader

_register_lock = threading.Lock()
_library = None  # the torch.library.Library holding aotinfer's ops, once registered
_torch_ops: dict = {}  # binding name -> torch.ops.aotinfer.<name>, once registered
_kernel_functions: list = []  # (binding name, kernel function), for dynamo's substitutions
_dynamo_ready = False  # substitutions registered with a loaded torch._dynamo


_compiler = None  # torch.compiler, once torch is imported


def _is_compiling() -> bool:
    """torch.compiler.is_compiling, without importing torch at aotinfer's import."""
    global _compiler
    if _compiler is None:
        import torch

        _compiler = torch.compiler
    return _compiler.is_compiling()


def kernel(module: str, function: str):
    """The callable for binding ``function`` of kernel module ``module`` (see the module doc)."""
    cache: dict = {}  # device index -> tvm-ffi function

    def find(index: int):
        register_torch_ops()
        fn = cache[index] = getattr(_loader.get_module(module, index), function)
        return fn

    def call(*args):
        index = args[0].get_device()
        fn = cache.get(index)
        if fn is None:
            fn = find(index)
        fn(*args)

    call.__name__ = call.__qualname__ = function
    call.__doc__ = f"Binding {function} of kernel module {module!r} (outputs first)."
    call.find = find
    _kernel_functions.append((function, call))
    if _dynamo_ready:
        _substitute(function, call)
    else:
        _when_dynamo_loads()
    return call


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
                library.impl(function, _eager(module, function), "CUDA")
                torch.library.register_fake(f"aotinfer::{function}", _writes_outputs_only, lib=library)
                _torch_ops[function] = getattr(torch.ops.aotinfer, function)
        _library = library


def _eager(module: str, function: str):
    """The CUDA implementation of the custom op: the binding itself."""
    for name, call in _kernel_functions:
        if name == function:
            return call
    return kernel(module, function)


def _writes_outputs_only(*args) -> None:
    """Fake implementation of every binding: outputs exist already, nothing is returned."""
    return None


# ---- torch.compile: trace a kernel function as its custom op ---------------------------------------


def _substitute(function: str, call) -> None:
    import torch

    def as_custom_op(*args):
        op = _torch_ops.get(function)
        if op is None:
            raise RuntimeError(
                f"aotinfer::{function} is not defined yet: import torch before aotinfer, or run any"
                " aotinfer op once before torch.compile traces one"
            )
        return op(*args)

    torch.compiler.substitute_in_graph(call, skip_signature_check=True)(as_custom_op)


def _on_dynamo_loaded() -> None:
    global _dynamo_ready
    import torch

    if not hasattr(torch.compiler, "substitute_in_graph"):  # torch < 2.5: compile graph-breaks
        return
    _dynamo_ready = True
    for function, call in _kernel_functions:
        _substitute(function, call)


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
    global _hook
    if _hook is not None or _dynamo_ready:
        return
    if "torch._dynamo" in sys.modules:
        _on_dynamo_loaded()
        return
    _hook = _DynamoImportHook()
    sys.meta_path.insert(0, _hook)
