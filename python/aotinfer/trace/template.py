"""Trace templates: an op's call written down as a JSON definition for benchmark suites.

A template names the op's axes, inputs and outputs. ``op.trace(<the op's own arguments>)`` reads
the shapes and dtypes off those arguments and returns the definition:

    {"name": "rmsnorm_h4096", "op_type": "rmsnorm", "description": ..., "tags": [...,
     "aotinfer_api:aotinfer.norm.rmsnorm"], "axes": {"batch_size": {"type": "var"},
     "hidden_size": {"type": "const", "value": 4096}}, "inputs": {"hidden_states": {"shape":
     ["batch_size", "hidden_size"], "dtype": "bfloat16"}, ...}, "outputs": {...}, "reference": "<source>"}

- ``Var()``: an axis whose size varies at run time; its value is neither in the name nor the JSON.
- ``Const(abbrev="h")``: an axis fixed per definition; its value goes into the JSON and, as
  ``h4096``, into the name (``abbrev=""``: JSON only). Its value comes from a tensor dimension,
  an op parameter of the same name, or ``derive`` from other axes.
- ``Tensor(dim_names, param=, dtype_from=, optional=, ranks=)``: ``param`` is the op parameter it
  reads (default: its key); outputs take their dtype from an input's key through ``dtype_from``.
  ``ranks``: the ranks the op takes for it when they differ from ``len(dim_names)``, a tuple or
  ``"any"``; a tensor of another rank is read as if its leading dimensions were flattened into
  the first axis (or, with fewer dimensions, as if they were 1): rmsnorm's ``[tokens, heads,
  hidden]`` is ``batch_size = tokens * heads`` rows of ``hidden_size``. ``dtype``: the one dtype
  the op takes for it whatever the others' (a float32 log-sum-exp, a bool mask); ``dtypes``: the
  dtypes it takes, when not all of float16, bfloat16 and float32. ``example(shape, device,
  dtype)``: a valid input where the op restricts its values (probabilities), for tests.
- ``Scalar(dtype, example=)``: a scalar parameter; ``example``: a valid value where the op
  restricts its range (top_p in (0, 1]), for tests.
The reference is a plain torch function taking the inputs by key and returning the outputs in
order; its source is written into the definition.
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Sequence


class Var:
    """An axis whose size varies between calls."""

    def __repr__(self) -> str:
        return "Var()"


class Const:
    """An axis whose size is part of the definition; ``abbrev`` + value goes into its name.

    ``derive``: for an axis no tensor shows directly, a function of the other axes' sizes, e.g.
    ``lambda sizes: sizes["input_size"] // 2``.
    """

    def __init__(self, abbrev: str = "", derive: Optional[Callable[[Dict[str, int]], int]] = None) -> None:
        self.abbrev = abbrev
        self.derive = derive

    def __repr__(self) -> str:
        return f"Const(abbrev={self.abbrev!r})"


class Tensor:
    def __init__(
        self,
        dim_names: Sequence[str],
        param: Optional[str] = None,
        dtype_from: Optional[str] = None,
        optional: bool = False,
        description: Optional[str] = None,
        ranks: Any = None,
        dtype: Optional[str] = None,
        dtypes: Optional[Sequence[str]] = None,
        example: Optional[Callable] = None,
    ) -> None:
        self.dim_names = list(dim_names)
        self.example = example
        self.dtype = dtype
        self.dtypes = tuple(dtypes) if dtypes is not None else None
        self.param = param
        self.dtype_from = dtype_from
        self.optional = optional
        self.description = description
        self.ranks = (len(self.dim_names),) if ranks is None else ranks

    def takes_rank(self, rank: int) -> bool:
        return self.ranks == "any" or rank in self.ranks

    def sizes(self, shape: Sequence[int]) -> List[int]:
        """The template's axis sizes of a tensor of ``shape`` (see ``ranks``)."""
        n = len(self.dim_names)
        if len(shape) < n:
            return [1] * (n - len(shape)) + [int(s) for s in shape]
        merged = 1
        for s in shape[: len(shape) - n + 1]:
            merged *= int(s)
        return [merged] + [int(s) for s in shape[len(shape) - n + 1 :]] if n else []


class Scalar:
    def __init__(self, dtype: str, param: Optional[str] = None, optional: bool = False,
                 description: Optional[str] = None, example: Any = None) -> None:
        self.dtype = dtype
        self.example = example
        self.param = param
        self.optional = optional
        self.description = description


def dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


class TraceTemplate:
    def __init__(
        self,
        op_type: str,
        name_prefix: str,
        description: str,
        axes: Dict[str, Any],
        inputs: Dict[str, Any],
        outputs: Dict[str, Tensor],
        tags: Sequence[str] = (),
        reference: Optional[Callable] = None,
    ) -> None:
        self.op_type = op_type
        self.name_prefix = name_prefix
        self.description = description
        self.axes = dict(axes)
        self.inputs = dict(inputs)
        self.outputs = dict(outputs)
        self.tags = list(tags)
        self.reference = reference

    def __repr__(self) -> str:
        return f"TraceTemplate({self.name_prefix!r})"

    @staticmethod
    def param_of(key: str, spec: Any) -> str:
        return spec.param or key

    def definition(self, op: Callable, arguments: Dict[str, Any]) -> Dict[str, Any]:
        """The JSON-ready definition of a call of ``op`` with bound ``arguments``."""
        values: Dict[str, Optional[int]] = {axis: None for axis in self.axes}

        def bind_axis(axis: str, size: int, where: str) -> None:
            if axis not in self.axes:
                raise ValueError(f"{self.name_prefix}: {where} uses axis {axis!r}, which the template does not declare")
            if values[axis] is not None and values[axis] != size:
                raise ValueError(f"{self.name_prefix}: axis {axis!r} is {values[axis]} elsewhere but {size} in {where}")
            values[axis] = size

        inputs: Dict[str, Dict[str, Any]] = {}
        for key, spec in self.inputs.items():
            value = arguments.get(self.param_of(key, spec))
            if isinstance(spec, Scalar):
                inputs[key] = {"shape": None, "dtype": spec.dtype if value is not None or not spec.optional else None}
                continue
            if value is None:
                inputs[key] = {"shape": spec.dim_names, "dtype": None if spec.optional else "unknown"}
                continue
            shape = list(value.shape)
            if not spec.takes_rank(len(shape)):
                ranks = "any rank" if spec.ranks == "any" else " or ".join(map(str, spec.ranks)) + " dimensions"
                raise ValueError(
                    f"{self.name_prefix}: input {key!r} has {len(shape)} dimensions {shape}, "
                    f"the template takes {ranks} for {spec.dim_names}"
                )
            for axis, size in zip(spec.dim_names, spec.sizes(shape)):
                bind_axis(axis, size, f"input {key!r}")
            inputs[key] = {"shape": spec.dim_names, "dtype": dtype_name(value.dtype)}
        for axis, kind in self.axes.items():
            if values[axis] is None and isinstance(arguments.get(axis), int):
                values[axis] = arguments[axis]
        for axis, kind in self.axes.items():
            if values[axis] is None and isinstance(kind, Const) and kind.derive is not None:
                try:
                    values[axis] = int(kind.derive(values))
                except TypeError:  # an axis it depends on is unknown
                    pass

        outputs = {}
        for key, spec in self.outputs.items():
            if spec.dtype is not None:  # a fixed dtype (int32 token ids)
                dtype = spec.dtype
            elif spec.dtype_from is not None:
                dtype = inputs.get(spec.dtype_from, {}).get("dtype") or "unknown"
            else:
                value = arguments.get(self.param_of(key, spec))
                dtype = dtype_name(value.dtype) if value is not None else "unknown"
            outputs[key] = {"shape": spec.dim_names, "dtype": dtype}

        axes = {}
        for axis, kind in self.axes.items():
            axes[axis] = {"type": "var"} if isinstance(kind, Var) else {"type": "const", "value": values[axis]}
        parts = [self.name_prefix] + [
            f"{kind.abbrev}{values[axis]}" for axis, kind in self.axes.items() if isinstance(kind, Const) and kind.abbrev
        ]
        for key, entry in list(inputs.items()) + list(outputs.items()):
            spec = self.inputs.get(key) if key in inputs else self.outputs[key]
            if spec is not None and spec.description:
                entry["description"] = spec.description
        return {
            "name": "_".join(parts),
            "op_type": self.op_type,
            "description": self.description,
            "tags": self.tags + [f"aotinfer_api:{op.__module__}.{op.__qualname__}"],
            "axes": axes,
            "inputs": inputs,
            "outputs": outputs,
            "reference": _source(self.reference),
        }


def _source(fn: Optional[Callable]) -> Optional[str]:
    if fn is None:
        return None
    import inspect
    import textwrap

    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None


def templates_of(trace: Any) -> List[TraceTemplate]:
    """The templates a ``trace=`` argument stands for: itself, or a dispatch function's list."""
    if isinstance(trace, TraceTemplate):
        return [trace]
    return list(getattr(trace, "templates", []))


def attach_trace(op: Callable, trace: Any) -> None:
    """Give ``op`` its ``.trace(...)`` and ``.templates`` (called by @aotinfer_api(trace=...))."""

    def trace_call(*args: Any, dump_dir: Optional[str] = None, **kwargs: Any) -> Dict[str, Any]:
        import inspect

        kwargs.pop("skip_check", None)
        bound = inspect.signature(op).bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        arguments.pop("skip_check", None)
        template = trace if isinstance(trace, TraceTemplate) else trace(**arguments)
        definition = template.definition(op, arguments)
        directory = dump_dir or os.environ.get("AOTINFER_TRACE_DUMP_DIR")
        if directory:
            import json

            path = os.path.join(directory, definition["name"] + ".json")
            try:
                os.makedirs(directory, exist_ok=True)
                with open(path, "w") as f:
                    json.dump(definition, f, indent=2)
            except OSError as e:
                # Say which setting named the directory: a bare FileNotFoundError does not.
                where = "dump_dir" if dump_dir else "AOTINFER_TRACE_DUMP_DIR"
                raise type(e)(e.errno, f"{op.__name__}.trace cannot write {path} ({e.strerror}): {where}={directory!r}"
                                       " must name a directory this process can create or write") from None
        return definition

    trace_call.__doc__ = f"The trace definition of a call of {op.__name__} with these arguments."
    op.trace = trace_call
    op.templates = templates_of(trace)
