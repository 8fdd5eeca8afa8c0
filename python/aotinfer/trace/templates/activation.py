"""Trace templates of aotinfer.activation's gated activations (torch is imported when a reference runs)."""

import math

from ..template import Const, Tensor, TraceTemplate, Var


def _halves(x):
    d = x.shape[-1] // 2
    return x[..., :d].float(), x[..., d:].float()


def _silu_and_mul_reference(input):
    import torch

    gate, up = _halves(input)
    return (torch.nn.functional.silu(gate) * up).to(input.dtype)


def _gelu_and_mul_reference(input):
    import torch

    gate, up = _halves(input)
    return (torch.nn.functional.gelu(gate) * up).to(input.dtype)


def _gelu_tanh_and_mul_reference(input):
    import torch

    gate, up = _halves(input)
    inner = math.sqrt(2 / math.pi) * (gate + 0.044715 * gate.pow(3))
    return (0.5 * gate * (1 + torch.tanh(inner)) * up).to(input.dtype)


_LEADING_ANY = range(1, 65)  # every rank torch has, from 1-D


def _gated(prefix, act, reference):
    return TraceTemplate(
        op_type="activation",
        name_prefix=prefix,
        description=f"{act}(input[..., :d]) * input[..., d:], computed in float32.",
        axes={
            "num_tokens": Var(),
            "input_size": Const(abbrev=""),
            "hidden_size": Const(abbrev="h", derive=lambda sizes: sizes["input_size"] // 2),
        },
        # [..., 2d]: any leading dimensions, flattened into num_tokens.
        inputs={"input": Tensor(["num_tokens", "input_size"], ranks=_LEADING_ANY)},
        outputs={"output": Tensor(["num_tokens", "hidden_size"], dtype_from="input", ranks=_LEADING_ANY)},
        tags=["status:verified", "gated"],
        reference=reference,
    )


silu_and_mul_trace = _gated("silu_and_mul", "silu", _silu_and_mul_reference)
gelu_and_mul_trace = _gated("gelu_and_mul", "gelu", _gelu_and_mul_reference)
gelu_tanh_and_mul_trace = _gated("gelu_tanh_and_mul", "gelu_tanh", _gelu_tanh_and_mul_reference)
