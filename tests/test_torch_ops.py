"""aotinfer's ops as torch custom ops: schemas, fake implementations, torch.compile, opcheck."""

import json
import os

import pytest
import torch

import aotinfer
from aotinfer import _kernels, _loader

# aotinfer defines its custom ops at the first kernel call or when torch._dynamo is imported;
# these tests read them before either may have happened.
_kernels.register_torch_ops()

BINDINGS = [
    (module, function, schema)
    for module, entry in _loader.manifest()["modules"].items()
    for function, schema in entry["functions"].items()
]
# torch schema types -> the types tvm-ffi records for the binding's C++ parameters
TVM_TYPES = {"Tensor": "DLTensor*", "float": "float", "int": "int", "bool": "bool"}


@pytest.mark.parametrize("module, function, schema", BINDINGS, ids=[b[1] for b in BINDINGS])
def test_registered_from_the_declaration(module, function, schema):
    registered = str(getattr(torch.ops.aotinfer, function).default._schema)
    assert registered.replace(" ", "") == f"aotinfer::{function}{schema}".replace(" ", "")


@pytest.mark.parametrize("module, function, schema", BINDINGS, ids=[b[1] for b in BINDINGS])
def test_declaration_matches_the_compiled_binding(module, function, schema):
    import tvm_ffi

    build = next(iter(_loader.module_entry(module)["builds"].values()))
    binding = tvm_ffi.load_module(os.path.join(_loader.OPS_DIR, build["file"]))
    params = json.loads(binding.get_function_metadata(function)["type_schema"])["named_args"]["params"]
    arguments = getattr(torch.ops.aotinfer, function).default._schema.arguments
    assert [TVM_TYPES[str(a.type)] for a in arguments] == [p["type"] for p in params]
    assert [a.name for a in arguments if a.alias_info and a.alias_info.is_write], "a binding must write an output"


def test_fake_implementation():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(8, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        assert torch.ops.aotinfer.scale(out, x, 2.0, -1) is None


def test_compile_fullgraph_traces_the_custom_op():
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(x):
        y = aotinfer.scale(x, 2.0)
        return aotinfer.scale(y, 3.0, skip_check=True) + 1

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=record)
    try:
        compiled(torch.randn(8))
    except NotImplementedError as e:  # the graph runs on CPU tensors; the op has a CUDA kernel only
        assert "aotinfer::scale" in str(e)
    (graph,) = graphs
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aotinfer.scale) + targets.count(torch.ops.aotinfer.scale.default) == 2
    assert _kernels._dynamo_ready


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compile_fullgraph_on_gpu(mode):
    def f(x, w):
        h = aotinfer.scale(x, 0.5) * w
        return aotinfer.scale(h, 4.0, skip_check=True) + x

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, mode=mode)
    for _ in range(3):  # reduce-overhead records, then replays CUDA graphs
        x = torch.randn(1000, 64, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(64, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(compiled(x, w), f(x, w), rtol=0, atol=0)


@pytest.mark.gpu
def test_opcheck():
    x = torch.randn(1001, device="cuda", dtype=torch.float16)
    torch.library.opcheck(torch.ops.aotinfer.scale.default, (torch.empty_like(x), x, 2.0, -1))
