"""Arguments for any registered op, made from its trace template: the tests that cover every op
(test_trace.py, test_op.py) take their inputs from here, at every rank the op accepts."""

import math

import pytest
import torch

from aotinfer.trace import Const, Scalar, Var, registry

PAIRS = registry()
IDS = [f"{op.__name__}-{template.name_prefix}" for op, template in PAIRS]
SIZES = {Var: 6, Const: 16}
AXIS_SIZES = {"head_dim": 64}  # axes whose sizes kernels restrict (decode takes head_dim 64, 128, 256)
SCALARS = {"float32": 1.25, "float64": 1.25, "int32": 3, "int64": 3, "bool": True}
MAX_RANK = 4  # "any rank" is tried from 0 up to this


def _ranked(template):
    """The tensor specs whose rank may vary (rows flattened into their first axis)."""
    specs = list(template.inputs.values()) + list(template.outputs.values())
    return [s for s in specs if not isinstance(s, Scalar) and s.ranks != (len(s.dim_names),)]


def ranks(template):
    """Every rank the op takes for its variable-rank tensors (one rank when there are none)."""
    ranked = _ranked(template)
    if not ranked:
        return [None]
    return [r for r in range(MAX_RANK + 1) if all(s.takes_rank(r) for s in ranked)]


def _leading(rank, spec):
    """The dimensions that stand for the spec's first axis at ``rank``."""
    extra = rank - len(spec.dim_names)
    return [] if extra < 0 else [2, 3, 1, 2][: extra + 1]


def axis_sizes(template, rank=None):
    sizes = {axis: AXIS_SIZES.get(axis, SIZES[type(kind)]) for axis, kind in template.axes.items()}
    for spec in _ranked(template):
        if rank is not None and spec.dim_names:
            lead = _leading(rank, spec)
            sizes[spec.dim_names[0]] = math.prod(lead)
    for axis, kind in template.axes.items():
        if getattr(kind, "derive", None) is not None:
            sizes[axis] = kind.derive(sizes)
    return sizes


def shape_of(spec, sizes, rank=None):
    """A tensor shape for ``spec``: its axes, or at ``rank`` its first axis as leading dimensions."""
    dims = [sizes[d] for d in spec.dim_names]
    if rank is None or spec.ranks == (len(spec.dim_names),):
        return dims
    if rank >= len(dims):
        return _leading(rank, spec) + dims[1:]
    return dims[len(dims) - rank :]  # fewer dimensions: the missing leading axes are 1


def tensor_dtype(spec, dtype):
    """The dtype of an input: ``spec.dtype`` where the template fixes it (a float32 log-sum-exp, a
    bool mask), else ``dtype``; skips the test when ``spec.dtypes`` (what the op takes) lacks it."""
    fixed = spec.dtype
    if fixed is not None:
        return getattr(torch, fixed)
    taken = spec.dtypes
    if taken is not None and str(dtype).replace("torch.", "") not in taken:
        pytest.skip(f"the op takes no {dtype} (it takes {', '.join(taken)})")
    return dtype


def make_arguments(template, device, dtype=torch.bfloat16, rank=None):
    """Op arguments by parameter name, and reference inputs by key, from the template."""
    sizes = axis_sizes(template, rank)
    by_param, by_key = {}, {}
    for key, spec in template.inputs.items():
        if isinstance(spec, Scalar):
            value = SCALARS[spec.dtype] if spec.example is None else spec.example
        elif spec.example is not None:  # values the op restricts (probabilities)
            value = spec.example(shape_of(spec, sizes, rank), device, tensor_dtype(spec, dtype))
        else:
            value = torch.randn(shape_of(spec, sizes, rank), device=device).to(tensor_dtype(spec, dtype))
        by_param[spec.param or key] = value
        by_key[key] = value
    return by_param, by_key


def output_shapes(template, rank=None):
    sizes = axis_sizes(template, rank)
    return {key: shape_of(spec, sizes, rank) for key, spec in template.outputs.items()}
