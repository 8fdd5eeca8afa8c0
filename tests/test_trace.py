"""Every (op, trace template) pair in the registry: structure, trace() on CPU, the reference."""

import inspect
import json

import pytest
import torch

import aotinfer
from aotinfer.trace import Const, Tensor, Var
from op_arguments import IDS, PAIRS, axis_sizes, make_arguments, output_shapes, ranks

TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}
FP8_STEP = {torch.float8_e4m3fn: 2.0**-3, torch.float8_e5m2: 2.0**-2}  # relative size of one step
CASES = [(op, template, rank) for op, template in PAIRS for rank in ranks(template)]
CASE_IDS = [f"{op.__name__}-{template.name_prefix}-rank{rank}" for op, template, rank in CASES]


def test_registry_holds_every_public_op():
    # The functions of aotinfer's API marked @aotinfer_api that call a kernel.
    from aotinfer._kernels import kernels_named_by, public_code

    ops = [getattr(aotinfer, name) for name in aotinfer.__all__]
    public = {op.__name__ for op in ops if getattr(op, "__code__", None) in public_code and kernels_named_by(op)}
    assert public and {op.__name__ for op, _ in PAIRS} == public


@pytest.mark.parametrize("op, template", PAIRS, ids=IDS)
def test_params_exist(op, template):
    params = inspect.signature(op).parameters
    for key, spec in list(template.inputs.items()) + list(template.outputs.items()):
        if key in template.inputs or spec.param is not None:
            name = spec.param or key
            assert name in params, f"{template.name_prefix}: {key!r} reads parameter {name!r}, not in {list(params)}"


@pytest.mark.parametrize("op, template", PAIRS, ids=IDS)
def test_axes_are_declared_and_bound(op, template):
    params = inspect.signature(op).parameters
    tensors = [s for s in list(template.inputs.values()) + list(template.outputs.values()) if isinstance(s, Tensor)]
    used = {d for s in tensors for d in s.dim_names}
    assert used <= set(template.axes), f"undeclared axes: {used - set(template.axes)}"
    for axis, kind in template.axes.items():
        assert isinstance(kind, (Var, Const))
        if isinstance(kind, Const):
            assert axis in used or axis in params, f"Const axis {axis!r} appears in no tensor and no parameter"
    for key, spec in template.outputs.items():
        assert spec.dtype_from is None or spec.dtype_from in template.inputs, f"output {key!r}: dtype_from"


@pytest.mark.parametrize("op, template, rank", CASES, ids=CASE_IDS)
def test_trace_on_cpu(op, template, rank):
    by_param, _ = make_arguments(template, "cpu", rank=rank)
    definition = op.trace(**by_param)
    json.dumps(definition)
    assert definition["name"].startswith(template.name_prefix)
    assert definition["op_type"] == template.op_type
    assert f"aotinfer_api:{op.__module__}.{op.__qualname__}" in definition["tags"]
    for key, entry in definition["inputs"].items():
        if not getattr(template.inputs[key], "optional", False):
            assert entry["dtype"] not in (None, "unknown"), f"input {key!r} has no dtype"
    for key, entry in definition["outputs"].items():
        assert entry["dtype"] not in (None, "unknown"), f"output {key!r} has no dtype"
    sizes = axis_sizes(template, rank)
    for axis, entry in definition["axes"].items():
        if entry["type"] == "const":
            assert entry["value"] == sizes[axis], f"Const axis {axis!r}: {entry['value']}, expected {sizes[axis]}"
    assert definition["reference"] and "def " in definition["reference"]


@pytest.mark.parametrize("op, template, rank", CASES, ids=CASE_IDS)
def test_reference_runs_on_cpu(op, template, rank):
    _, by_key = make_arguments(template, "cpu", rank=rank)
    outputs = template.reference(**by_key)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    assert len(outputs) == len(template.outputs)
    for out, (key, shape) in zip(outputs, output_shapes(template, rank).items()):
        assert list(out.shape) == shape, f"reference output {key!r}"


@pytest.mark.parametrize("op, template", PAIRS, ids=IDS)
def test_trace_refuses_other_ranks(op, template):
    varying = [(k, s) for k, s in template.inputs.items() if isinstance(s, Tensor) and s.ranks != (len(s.dim_names),)]
    if not varying:
        pytest.skip("no input of varying rank")
    key, spec = varying[0]
    refused = [r for r in range(0, 6) if not spec.takes_rank(r)]
    if not refused:
        pytest.skip("takes every rank")
    by_param, _ = make_arguments(template, "cpu", rank=ranks(template)[-1])
    by_param[spec.param or key] = torch.zeros([2] * refused[0])
    with pytest.raises(ValueError, match="dimensions"):
        op.trace(**by_param)


def test_trace_writes_json(tmp_path, monkeypatch):
    op, template = PAIRS[0]
    by_param, _ = make_arguments(template, "cpu", rank=ranks(template)[-1])
    definition = op.trace(**by_param, dump_dir=str(tmp_path / "given"))
    assert json.loads((tmp_path / "given" / f"{definition['name']}.json").read_text()) == definition
    monkeypatch.setenv("AOTINFER_TRACE_DUMP_DIR", str(tmp_path / "env"))
    op.trace(**by_param)
    assert (tmp_path / "env" / f"{definition['name']}.json").is_file()


def test_trace_names_const_axes():
    from aotinfer.trace import TraceTemplate

    template = TraceTemplate(
        op_type="rmsnorm", name_prefix="rmsnorm", description="",
        axes={"batch_size": Var(), "hidden_size": Const(abbrev="h")},
        inputs={"hidden_states": Tensor(["batch_size", "hidden_size"], param="input"), "weight": Tensor(["hidden_size"])},
        outputs={"output": Tensor(["batch_size", "hidden_size"], dtype_from="hidden_states")},
    )

    def rmsnorm(input, weight, eps=1e-6):
        return input

    definition = template.definition(rmsnorm, {"input": torch.zeros(3, 4096, dtype=torch.float16), "weight": torch.zeros(4096)})
    assert definition["name"] == "rmsnorm_h4096"
    assert definition["axes"] == {"batch_size": {"type": "var"}, "hidden_size": {"type": "const", "value": 4096}}
    assert definition["outputs"]["output"]["dtype"] == "float16"
    with pytest.raises(ValueError, match="axis 'hidden_size' is 4096 elsewhere but 2048"):
        template.definition(rmsnorm, {"input": torch.zeros(3, 4096), "weight": torch.zeros(2048)})


@pytest.mark.gpu
@pytest.mark.parametrize("op, template, rank", CASES, ids=CASE_IDS)
def test_op_matches_reference_on_gpu(op, template, rank):
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        by_param, by_key = make_arguments(template, "cuda", dtype, rank=rank)
        expected = template.reference(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in by_key.items()})
        expected = expected if isinstance(expected, tuple) else (expected,)
        result = op(**by_param)
        # Outputs naming a parameter are written into that argument (in place); the others are returned.
        returned = iter(result if isinstance(result, tuple) else (result,))
        results = [by_param[spec.param] if spec.param else next(returned) for spec in template.outputs.values()]
        for got, want in zip(results, expected):
            if got.dtype in FP8_STEP:  # a rounding either side of an FP8 boundary is one step of the format
                torch.testing.assert_close(got.float(), want.float(), rtol=FP8_STEP[got.dtype], atol=1e-6)
            else:
                torch.testing.assert_close(got, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
