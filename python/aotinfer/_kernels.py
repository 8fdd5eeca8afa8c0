"""Kernel functions: each binding of modules.toml as a Python function and as a torch custom op.

An op calls a binding through its kernel function, outputs first:

    _scale = kernel("scale", "scale")
    _scale(out, input, factor, enable_pdl)

Eagerly that is the tvm-ffi function of the loaded module: the first call picks the build for the
GPUs of this process, and when they all load the same shared object (one model of GPU, the usual
server) later calls go straight to it. With GPUs that need different builds it dispatches on the
first argument on a GPU. A first call with no argument on a GPU runs the binding of any build: its
checks name the argument that is not where it should be, before anything touches a device.

Tracers see the custom op ``torch.ops.aotinfer.<binding>`` instead, so a traced op's graph records
the kernel call and no kernel runs on fake tensors:
- under a torch dispatch mode (make_fx, non-strict torch.export, AOTAutograd, FakeTensorMode),
  tested on every call: one C call, ``torch._C._len_torch_dispatch_stack()``;
- under dynamo (torch.compile, strict export), which traces Python and never calls that test:
  each kernel function is substituted by the custom op once torch._dynamo is imported.
The custom ops are defined, from the schemas of modules.toml, as soon as torch and aotinfer are
both imported (whichever comes second defines them; no shared object is loaded and no GPU is
touched). Bindings write into outputs the caller allocated and return nothing: ops allocate their
outputs with torch calls that tracers record, and the fake (Meta) implementation only checks. It
calls the binding on stand-ins for the tracer's tensors (their shapes, strides, dtypes and devices,
no data), so the binding's own checks raise while tracing what they raise eagerly, and the binding
returns after them.

A binding that cannot convert an argument (a list for a tensor, a tensor on the CPU) raises
tvm-ffi's or torch's words; the kernel function raises them again as the TypeError or ValueError
that names the argument (its name in the binding's schema).
"""

from __future__ import annotations

import os
import sys

from . import _loader

_register_lock = _loader.fork_safe_lock()
_library = None  # the torch.library.Library holding aotinfer's ops, once defined
_kernels: dict = {}  # binding name -> kernel function
public_code: set = set()  # the code objects of the public ops (api_logging adds them): errors name their arguments
_dynamo_substituted = False  # the kernel functions are substituted for dynamo (torch._dynamo imported)


def _dispatch_modes() -> int:
    """How many torch dispatch modes are active (torch is imported once a tensor reaches a kernel:
    from then on the test is torch's own C function)."""
    global _dispatch_modes
    import torch

    _dispatch_modes = torch._C._len_torch_dispatch_stack
    return _dispatch_modes()


def kernel(module: str, function: str):
    """The kernel function of binding ``function`` of kernel module ``module`` (see the module doc);
    ``.module``, ``.function`` name it."""
    found = _kernels.get(function)
    if found is not None:
        return found
    by_device: dict = {}  # device index -> the tvm-ffi function of the build for it
    custom_op = None  # torch.ops.aotinfer.<function>, once defined

    def binding_for(index: int):
        fn = by_device.get(index)
        if fn is None:
            fn = by_device[index] = getattr(_loader.get_module(module, index), function)
        return fn

    def first_call(*args):
        # The binding of the first argument on a GPU; with none there, of any build.
        nonlocal binding
        index = next((a.get_device() for a in args if getattr(a, "is_cuda", False)), -1)
        fn = binding_for(index)
        if index >= 0 and binding is first_call:
            binding = fn if _one_build_for_all_gpus(module) else per_device
        return fn(*args)

    def per_device(*args):
        index = next((a.get_device() for a in args if getattr(a, "is_cuda", False)), -1)
        return binding_for(index)(*args)

    binding = first_call

    def call(*args):
        if _dispatch_modes():
            return traced(*args)
        try:  # the body of eager() below, written out: one Python call fewer on every eager call
            return binding(*args)
        except (TypeError, RuntimeError) as error:
            _raise_named(function, error, args)
            raise

    def eager(*args):
        """The binding, whatever tracer is active: the custom op's implementation."""
        try:
            return binding(*args)
        except (TypeError, RuntimeError) as error:
            _raise_named(function, error, args)
            raise

    def check_traced(*args):
        """The fake implementation: the binding's checks on stand-ins for a tracer's tensors, so
        tracing raises what the eager call would; nothing where no build is installed to check with."""
        prepared = _stand_ins(args)
        if prepared is None:
            return
        stand_ins, _producers = prepared  # kept through the call: they own what the stand-ins point to
        try:
            fn = binding_for(-1)
        except _loader.NotBuiltError:
            return
        try:
            fn(*stand_ins)
        except (TypeError, RuntimeError) as error:
            _raise_named(function, error, args)
            raise

    def traced(*args):
        if custom_op is None:
            register_torch_ops()
            if custom_op is None:
                raise RuntimeError(f"aotinfer's custom op aotinfer::{function} is not defined")
        try:
            return custom_op(*args)
        except RuntimeError as error:  # torch's schema check, in the words of an eager call
            _raise_named(function, error, args)
            raise

    def bind_custom_op(op) -> None:
        nonlocal custom_op
        custom_op = op

    def forget() -> None:
        """Drop the bindings found so far: the next call picks a build again (the loader's tests)."""
        nonlocal binding
        by_device.clear()
        binding = first_call

    call.__name__ = call.__qualname__ = function
    call.module, call.function = module, function
    call.eager, call.check_traced, call.bind_custom_op, call.forget = eager, check_traced, bind_custom_op, forget
    _kernels[function] = call
    if _dynamo_substituted:
        _substitute_for_dynamo(call)
    return call


def kernels_named_by(fn) -> list:
    """The kernel functions a function's code names as globals (what an op calls)."""
    g = fn.__globals__
    named = (g.get(n) for n in fn.__code__.co_names)
    return [k for k in named if callable(k) and _kernels.get(getattr(k, "function", None)) is k]


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


# ---- errors from a binding, named -------------------------------------------------------------

# tvm-ffi's words for an argument of the wrong type, torch's for a tensor it cannot hand over, and a
# schema parameter: read with the re module, imported on the error path only (it costs milliseconds).
_MISMATCH = r"Mismatched type on argument #(\d+) when calling: `(\w+)\(.*Expected `([^`]*)` but got `([^`]*)`"
# torch's words for the same, when a tracer calls the custom op
_SCHEMA_MISMATCH = r"Expected a value of type '([^']*)' for argument '\w+' but instead found type '([^']*)'.\s*Position: (\d+)"
_NOT_PACKABLE = r"Cannot pack tensors on (\w+)"
_SCHEMA_PARAM = r"(\w+)(\(\w!\))? (\w+)"  # type, "(a!)" where written, name
_EXPECTED = {"Tensor": "a torch.Tensor", "float": "a real number", "int": "an integer", "bool": "a bool", "str": "a str"}


def _caller_name(value, default: str) -> str:
    """The name the public op calling a kernel gives ``value`` (``logits`` where the binding says
    ``probs``), found among the locals of the nearest public op's frame; else ``default``."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code not in public_code:
        frame = frame.f_back
    if frame is not None:
        for name, local in frame.f_locals.items():
            if local is value:
                return name
    return default


def _raise_named(function: str, error: BaseException, args: tuple) -> None:
    """Raise ``error`` again as the TypeError or ValueError that names the argument, if it is one
    the binding raised before its own checks could (the argument could not be converted); else
    return, and the caller re-raises it as it is."""
    import re

    params = []
    for functions in _loader.declared_functions().values():
        if function in functions:
            params = re.findall(_SCHEMA_PARAM, functions[function].partition(") ->")[0])
    message = str(error)
    mismatch = re.search(_MISMATCH, message, re.S)
    index, got = (int(mismatch[1]), mismatch[4]) if mismatch is not None else (-1, "")
    if mismatch is None:
        mismatch = re.search(_SCHEMA_MISMATCH, message)
        index, got = (int(mismatch[3]), mismatch[2]) if mismatch is not None else (-1, "")
    if 0 <= index < len(params):
        kind, _, name = params[index]
        if index < len(args):
            got, name = type(args[index]).__name__, _caller_name(args[index], name)
        raise TypeError(f"Expected {name} to be {_EXPECTED.get(kind, kind)}, got {got}") from None
    unpackable = re.search(_NOT_PACKABLE, message)
    if unpackable is not None:
        # Inputs first: an output the op allocated beside an input is on the input's device, and
        # the input is what the caller passed.
        named = sorted(zip(params, args), key=lambda p: bool(p[0][1]))
        for (_, _, name), value in named:
            device = getattr(value, "device", None)
            if getattr(device, "type", None) == unpackable[1]:
                name = _caller_name(value, name)
                raise ValueError(f"Expected {name} to be a CUDA tensor, got a tensor on {device}") from None


# ---- a tracer's call: the binding's checks on stand-ins ------------------------------------------

# A stand-in is a DLPack tensor with the shape, strides, dtype and device of a tracer's tensor and
# its data where no device has memory: at _STAND_IN_BASE and above (csrc/tvm_ffi_utils.h,
# IsStandIn), each storage of the call in its own stretch, so that the binding's overlap and
# alignment checks see the tracer's aliasing and offsets. Bindings return right after their checks
# on stand-ins.
_STAND_IN_BASE = 1 << 60
_STAND_IN_STRETCH = 1 << 40
# DLPack's device types by torch's name: a meta tensor has no device to check, so it stands in on
# a GPU; a CPU tensor stays one, for the binding to name.
_DLPACK_DEVICES = {"cuda": 2, "meta": 2, "cpu": 1}


def _dlpack_structs():
    """ctypes declarations of DLPack's DLManagedTensor (built on first use: tracing only)."""
    import ctypes

    class Device(ctypes.Structure):
        _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]

    class DataType(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]

    class Tensor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_void_p), ("device", Device), ("ndim", ctypes.c_int32), ("dtype", DataType),
                    ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                    ("byte_offset", ctypes.c_uint64)]

    class ManagedTensor(ctypes.Structure):
        _fields_ = [("dl_tensor", Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]

    capsule_new = ctypes.pythonapi.PyCapsule_New
    capsule_new.restype, capsule_new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return ManagedTensor, capsule_new


class _StandIn:
    """A DLPack producer of one stand-in (it owns the arrays its DLTensor points to)."""

    _structs = None

    def __init__(self, shape, strides, dtype, device_type: int, device_index: int, address: int) -> None:
        import ctypes

        import tvm_ffi

        if _StandIn._structs is None:
            _StandIn._structs = _dlpack_structs()
        managed_type = _StandIn._structs[0]
        code = tvm_ffi.dtype(str(dtype).split(".")[-1])  # torch.float16 -> DLPack's (2, 16, 1)
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.strides = (ctypes.c_int64 * len(shape))(*strides)
        self.managed = managed_type()  # no deleter: nothing to free but this object's own arrays
        t = self.managed.dl_tensor
        t.data, t.device.device_type, t.device.device_id, t.ndim = address, device_type, device_index, len(shape)
        t.dtype.code, t.dtype.bits, t.dtype.lanes = code.type_code, code.bits, code.lanes
        t.shape, t.strides = self.shape, self.strides

    def __dlpack__(self, stream=None):
        import ctypes

        return _StandIn._structs[1](ctypes.addressof(self.managed), b"dltensor", None)


def _concrete(value):
    """A traced value as a Python number: a symbolic one's hint, or None where it has none."""
    import torch

    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return getattr(value.node, "hint", None)
    return value


def _stand_ins(args: tuple):
    """The arguments of a traced call with stand-ins for its tensors, and the producers to keep
    alive through the call; None where a size has no value to check."""
    import torch
    import tvm_ffi

    storages: dict = {}
    producers, converted = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            shape = [_concrete(s) for s in a.shape]
            strides = [_concrete(s) for s in a.stride()]
            offset = _concrete(a.storage_offset())
            if None in shape or None in strides or offset is None:
                return None
            try:
                storage = a.untyped_storage()._cdata
            except (RuntimeError, NotImplementedError):  # a tensor without one: a storage of its own
                storage = id(a)
            base = _STAND_IN_BASE + _STAND_IN_STRETCH * storages.setdefault(storage, len(storages))
            device = getattr(a, "fake_device", a.device)
            if device.type not in _DLPACK_DEVICES:
                return None
            producer = _StandIn(shape, strides, a.dtype, _DLPACK_DEVICES[device.type], device.index or 0,
                                base + offset * a.element_size())
            producers.append(producer)
            converted.append(tvm_ffi.from_dlpack(producer))
        else:
            value = _concrete(a)
            if value is None:
                return None
            converted.append(value)
    return converted, producers


# ---- torch custom ops ---------------------------------------------------------------------------


def register_torch_ops() -> None:
    """Define aotinfer::<function> for every binding of the manifest (once).

    torch is imported before the lock is taken: importing it runs aotinfer's import hook, which
    calls this function again, and that call must find the lock free (it returns at once, since
    the outer call then defines the ops)."""
    global _library
    if _library is not None:
        return
    import torch

    with _register_lock:
        if _library is not None:
            return
        declared = _loader.declared_functions()
        library = torch.library.Library("aotinfer", "FRAGMENT")
        for module, functions in declared.items():
            for function, schema in functions.items():
                library.define(function + schema)
                eager = kernel(module, function).eager
                # CPU too: there the binding's own check names the tensor that is not on a GPU.
                library.impl(function, eager, "CUDA")
                library.impl(function, eager, "CPU")
                torch.library.register_fake(f"aotinfer::{function}", kernel(module, function).check_traced, lib=library)
                library.impl(function, _below_autograd(function), "Autograd")
        for k in _kernels.values():
            if any(k.function in functions for functions in declared.values()):
                k.bind_custom_op(getattr(torch.ops.aotinfer, k.function))
        _library = library


def _below_autograd(function: str):
    """The autograd implementation of a binding: none (the ops are not differentiable, as
    FlashInfer's are not), the call goes on below autograd. Without it torch's fallback handles a
    tensor that requires grad, and for a fake CUDA tensor on a CPU-only torch that aborts the
    process."""
    import torch

    op = None

    def below_autograd(*args):
        nonlocal op
        if op is None:
            op = getattr(torch.ops.aotinfer, function)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    return below_autograd


def _substitute_for_dynamo(k) -> None:
    """Have dynamo trace calls of kernel function ``k`` as its custom op (torch 2.5 or newer; older
    ones graph-break there)."""
    import torch

    if not hasattr(torch.compiler, "substitute_in_graph"):
        return
    op = getattr(torch.ops.aotinfer, k.function)

    def as_custom_op(*args):
        return op(*args)

    torch.compiler.substitute_in_graph(k, skip_signature_check=True)(as_custom_op)


# ---- when torch (and torch._dynamo) are imported --------------------------------------------------


def _torch_imported() -> None:
    """torch and aotinfer are both imported: define the custom ops, then wait for torch._dynamo.
    Inside someone's import nothing may make that import fail: a failure is one warning, and the
    ops say what is wrong when called."""
    try:
        register_torch_ops()
    except _loader.NotBuiltError as e:
        if os.path.exists(_loader.MANIFEST):  # a source tree without kernels: ops say so when called
            _warn(f"aotinfer's torch custom ops are not defined: {e}")
        return
    except Exception as e:  # noqa: BLE001 - see the docstring
        _warn(f"aotinfer's torch custom ops are not defined: {type(e).__name__}: {e}")
        return
    if "torch._dynamo" in sys.modules:
        _dynamo_imported()
    else:
        sys.meta_path.insert(0, _ImportHook("torch._dynamo", _dynamo_imported))


def _dynamo_imported() -> None:
    global _dynamo_substituted
    try:
        for k in list(_kernels.values()):
            _substitute_for_dynamo(k)
        _dynamo_substituted = True
    except Exception as e:  # noqa: BLE001 - as in _torch_imported
        _warn(f"aotinfer's ops are not substituted for torch.compile: {type(e).__name__}: {e}")


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
