"""Every (op, trace template) pair in the registry: structure, trace() on CPU, the reference."""

import inspect
import json

import pytest
import torch

import aotinfer  # noqa: F401  (decorating the ops fills the registry)
from aotinfer.trace import Const, Scalar, Tensor, Var, registry

PAIRS = registry()
IDS = [f"{op.__name__}-{template.name_prefix}" for op, template in PAIRS]
SIZES = {Var: 5, Const: 16}
SCALARS = {"float32": 1.25, "float64": 1.25, "int32": 3, "int64": 3, "bool": True}
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}


def test_registry_holds_every_public_op():
    assert {op.__name__ for op, _ in PAIRS} >= {"scale"}


def axis_sizes(template):
    sizes = {axis: SIZES[type(kind)] for axis, kind in template.axes.items()}
    for axis, kind in template.axes.items():
        if getattr(kind, "derive", None) is not None:
            sizes[axis] = kind.derive(sizes)
    return sizes


def make_arguments(template, device, dtype=torch.bfloat16):
    """Op arguments by parameter name, and reference inputs by key, from the template."""
    sizes = axis_sizes(template)
    by_param, by_key = {}, {}
    for key, spec in template.inputs.items():
        if isinstance(spec, Scalar):
            value = SCALARS[spec.dtype]
        else:
            value = torch.randn([sizes[d] for d in spec.dim_names], device=device).to(dtype)
        by_param[spec.param or key] = value
        by_key[key] = value
    return by_param, by_key


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


@pytest.mark.parametrize("op, template", PAIRS, ids=IDS)
def test_trace_on_cpu(op, template):
    by_param, _ = make_arguments(template, "cpu")
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
    sizes = axis_sizes(template)
    for axis, entry in definition["axes"].items():
        if entry["type"] == "const":
            assert entry["value"] == sizes[axis], f"Const axis {axis!r}: {entry['value']}, expected {sizes[axis]}"
    assert definition["reference"] and "def " in definition["reference"]


@pytest.mark.parametrize("op, template", PAIRS, ids=IDS)
def test_reference_runs_on_cpu(op, template):
    _, by_key = make_arguments(template, "cpu")
    outputs = template.reference(**by_key)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    sizes = axis_sizes(template)
    assert len(outputs) == len(template.outputs)
    for out, (key, spec) in zip(outputs, template.outputs.items()):
        assert list(out.shape) == [sizes[d] for d in spec.dim_names], f"reference output {key!r}"


def test_trace_writes_json(tmp_path, monkeypatch):
    op, template = PAIRS[0]
    by_param, _ = make_arguments(template, "cpu")
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
@pytest.mark.parametrize("op, template", PAIRS, ids=IDS)
def test_op_matches_reference_on_gpu(op, template):
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        by_param, by_key = make_arguments(template, "cuda", dtype)
        expected = template.reference(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in by_key.items()})
        expected = expected if isinstance(expected, tuple) else (expected,)
        result = op(**by_param)
        # Outputs naming a parameter are written into that argument (in place); the others are returned.
        returned = iter(result if isinstance(result, tuple) else (result,))
        results = [by_param[spec.param] if spec.param else next(returned) for spec in template.outputs.values()]
        for got, want in zip(results, expected):
            torch.testing.assert_close(got, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
