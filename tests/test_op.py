"""Every public op, through the bridge to its kernels (aotinfer/_kernels.py): tracers record the
custom op, bad arguments are named, skip_check keeps the error classes, capability queries match
the builds."""

import inspect

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.fake_tensor import FakeTensorMode

import aotinfer
from aotinfer import _loader
from aotinfer._kernels import kernels_named_by
from aotinfer.utils import cc_int
from aotinfer.cli import choices_for
from op_arguments import IDS, PAIRS, make_arguments, ranks

CASES = [(op, template, rank) for op, template in PAIRS for rank in ranks(template)]
CASE_IDS = [f"{op.__name__}-rank{rank}" for op, template, rank in CASES]


def bindings_of(op):
    return {f"aotinfer.{k.function}" for k in kernels_named_by(op)}


def positional(op, args):
    """(f(*tensors), tensors): the op as a function of its tensor arguments alone."""
    tensors = {k: v for k, v in args.items() if isinstance(v, torch.Tensor)}
    scalars = {k: v for k, v in args.items() if k not in tensors}

    def f(*values):
        return op(**dict(zip(tensors, values)), **scalars)

    return f, tuple(tensors.values())


def records_its_bindings(graph, op):
    """The graph calls some of the op's bindings and nothing else of aotinfer's (an op that
    chooses among kernels, such as a prefill backend, records the one it chose)."""
    names = recorded(graph)
    return bool(names) and names <= bindings_of(op)


def recorded(graph):
    """The aotinfer custom ops a graph calls, by name."""
    names = set()
    for node in graph.nodes:
        if node.op == "call_function":
            name = str(getattr(node.target, "_name", node.target)).replace("::", ".")
            if name.startswith("aotinfer."):
                names.add(name.split(".default")[0])
    return names


# ---- tracers record aotinfer::<binding>, never run a kernel on fake tensors -------------------


@pytest.mark.parametrize("op, template, rank", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_make_fx(op, template, rank, mode):
    # Meta tensors: no device to check, so the binding's checks pass on their shapes (CPU tensors
    # would be refused by name while tracing, as eagerly).
    f, tensors = positional(op, make_arguments(template, "meta", rank=rank)[0])
    gm = make_fx(f, tracing_mode=mode)(*tensors)
    assert records_its_bindings(gm.graph, op), (recorded(gm.graph), bindings_of(op))


@pytest.mark.parametrize("op, template, rank", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("strict", [False, True])
def test_export(op, template, rank, strict):
    f, tensors = positional(op, make_arguments(template, "meta", rank=rank)[0])

    class Model(torch.nn.Module):
        def forward(self, *values):
            return f(*values)

    exported = torch.export.export(Model(), tensors, strict=strict)
    assert records_its_bindings(exported.graph, op), (recorded(exported.graph), bindings_of(op))


@pytest.mark.parametrize("op, template", PAIRS, ids=IDS)
def test_dynamo_fullgraph(op, template):
    f, tensors = positional(op, make_arguments(template, "meta", rank=ranks(template)[-1])[0])
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    compiled(*tensors)  # the graph runs on meta tensors: the bindings' checks only
    (graph,) = graphs
    assert records_its_bindings(graph.graph, op), (recorded(graph.graph), bindings_of(op))


@pytest.mark.parametrize("op, template", PAIRS, ids=IDS)
def test_fake_cuda_tensors(op, template):
    # What torch.compile does with fake inputs: the fake (Meta) implementation, no kernel.
    with FakeTensorMode():
        args, _ = make_arguments(template, "cuda", rank=ranks(template)[-1])
        result = op(**args)
    for value in (result if isinstance(result, tuple) else (result,)):
        assert value is None or value.device.type == "cuda"


def test_a_dispatch_mode_sees_the_op():
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record(), pytest.raises(ValueError, match="Expected input to be a CUDA tensor, got a tensor on cpu"):
        aotinfer.rmsnorm(torch.randn(4, 8), torch.randn(8))
    assert "aotinfer.rmsnorm.default" in seen


# ---- bad arguments are named, with or without skip_check --------------------------------------


@pytest.mark.parametrize("skip_check", [False, True])
@pytest.mark.parametrize("op, template", PAIRS, ids=IDS)
def test_non_tensor_arguments(op, template, skip_check):
    args, _ = make_arguments(template, "cpu", rank=ranks(template)[-1])
    for name in [n for n, v in args.items() if isinstance(v, torch.Tensor)]:
        bad = dict(args, **{name: [1.0, 2.0]})
        with pytest.raises(TypeError, match=f"(Expected {name} to be a torch.Tensor|argument '{name}'.* must be Tensor), (got|not) list"):
            op(**bad, skip_check=skip_check)


@pytest.mark.parametrize("op, template", PAIRS, ids=IDS)
def test_meta_tensors(op, template):
    args, _ = make_arguments(template, "meta", rank=ranks(template)[-1])
    names = "|".join(n for n, v in args.items() if isinstance(v, torch.Tensor))  # each is on meta
    with pytest.raises(ValueError, match=f"Expected ({names}) to be a CUDA tensor, got a tensor on meta"):
        op(**args)


@pytest.mark.parametrize("op, template", PAIRS, ids=IDS)
def test_cpu_tensors(op, template):
    args, _ = make_arguments(template, "cpu", rank=ranks(template)[-1])
    with pytest.raises(ValueError, match="to be a CUDA tensor, got a tensor on cpu"):
        op(**args)


def test_scalar_arguments():
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(TypeError, match="Expected eps to be a real number, got str"):
        aotinfer.rmsnorm(x, w, eps="abc")
    with pytest.raises(TypeError, match="Expected eps to be a real number, got str"):
        aotinfer.rmsnorm(x, w, eps="abc", skip_check=True)  # the binding's type check, named
    for eps in (float("nan"), -1e-6, float("inf")):
        with pytest.raises(ValueError, match="Expected eps to be finite and non-negative"):
            aotinfer.layernorm(x, w, w, eps=eps)
    with pytest.raises(TypeError, match="Expected eps to be a real number, got bool"):
        aotinfer.fused_add_rmsnorm(x, x, w, eps=True)
    for op in (aotinfer.silu_and_mul, lambda x, **kw: aotinfer.gemma_rmsnorm(x, w, **kw)):
        with pytest.raises(TypeError, match="Expected enable_pdl to be None, True or False, got 'no'"):
            op(x, enable_pdl="no")
    with pytest.raises(TypeError, match="Expected factor to be a real number, got str"):
        aotinfer.scale(x, "2")


# ---- capability queries agree with the builds installed and with `info` -------------------------


@pytest.mark.parametrize("op, template", PAIRS, ids=IDS)
def test_capability_queries_match_the_builds(op, template):
    for cc in (35, 70, 75, 80, 86, 89, 90, 100, 103, 110, 120, 121, 999):
        modules = {k.module for k in kernels_named_by(op)}
        loadable = all(choices_for((cc // 10, cc % 10))[m]["file"] is not None for m in modules)
        assert op.is_compute_capability_supported(cc) == loadable, cc
        assert op.is_compute_capability_supported(f"{cc // 10}.{cc % 10}") == loadable
    built = next(iter(_loader.module_builds(kernels_named_by(op)[0].module)))
    assert op.is_compute_capability_supported((built.major, built.minor))


def test_capability_queries_without_a_build(monkeypatch):
    def not_built(*args):
        raise _loader.NotBuiltError("no kernels")

    monkeypatch.setattr(_loader, "resolve", not_built)
    assert not aotinfer.rmsnorm.is_compute_capability_supported(90)
    assert cc_int("9.0") == 90 and cc_int((10, 3)) == 103


# ---- the op is its own function: tracebacks show its code ----------------------------------------

def frames_of(error):
    import traceback

    return [(f.name, f.filename, f.lineno) for f in traceback.extract_tb(error.__traceback__)]


@pytest.mark.parametrize("op, template", PAIRS, ids=IDS)
def test_binding_errors_show_the_op_frame(op, template):
    args, _ = make_arguments(template, "cpu", rank=ranks(template)[-1])
    with pytest.raises(ValueError, match="to be a CUDA tensor, got a tensor on cpu") as error:
        op(**args)
    frames = [f for f in frames_of(error.value) if f[0] == op.__name__]
    # One frame of the op, in its own file, at a line of its body: no wrapper around it.
    assert len(frames) == 1 and frames[0][1] == op.__code__.co_filename, frames
    lines, first = inspect.getsourcelines(op)
    assert first < frames[0][2] < first + len(lines)


def test_check_errors_point_at_the_op():
    with pytest.raises(TypeError, match="Expected factor to be a real number, got bool") as error:
        aotinfer.scale(torch.randn(4), True)
    name, filename, line = frames_of(error.value)[1]
    lines, first = inspect.getsourcelines(aotinfer.scale)
    assert (name, filename) == ("scale", aotinfer.scale.__code__.co_filename) and first < line < first + len(lines)


def test_a_kernel_function_is_the_custom_op_under_dynamo():
    # torch.compile traces an op's body and records each kernel call as the custom op.
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: aotinfer.rmsnorm(x, w) * 2, fullgraph=True, backend=record)
    compiled(torch.randn(4, 8, device="meta"), torch.randn(8, device="meta"))
    assert recorded(graphs[0].graph) == {"aotinfer.rmsnorm"}


def test_registration_when_torch_is_imported_later(tmp_path):
    # register_torch_ops() with torch not yet imported: its import runs aotinfer's hook, which
    # registers (re-entering must not deadlock); a fork afterwards works.
    import subprocess
    import sys

    script = """
import os, sys
import aotinfer
from aotinfer import _kernels
assert "torch" not in sys.modules
_kernels.register_torch_ops()
import torch
assert hasattr(torch.ops.aotinfer, "rmsnorm")
pid = os.fork()
if pid == 0:
    import torch.ops
    os._exit(0 if hasattr(torch.ops.aotinfer, "scale") else 1)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0 and "child 0" in out.stdout, out.stdout + out.stderr
