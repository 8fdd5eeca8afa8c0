"""Trace template of aotinfer.scale."""

from ..template import Scalar, Tensor, TraceTemplate, Var


def _scale_reference(input, factor):
    return (input.float() * factor).to(input.dtype)


scale_trace = TraceTemplate(
    op_type="scale",
    name_prefix="scale",
    description="out = input * factor, computed in float32 and rounded once to input's dtype.",
    axes={"num_elements": Var()},
    inputs={
        "input": Tensor(["num_elements"], ranks="any"),  # any shape, as num_elements
        "factor": Scalar("float32"),
    },
    outputs={"output": Tensor(["num_elements"], dtype_from="input", ranks="any")},
    tags=["status:verified", "elementwise"],
    reference=_scale_reference,
)
