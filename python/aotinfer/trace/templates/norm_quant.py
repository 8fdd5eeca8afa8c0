"""Trace templates of aotinfer.norm_quant's ops. The references import torch when run: aotinfer's import does not."""

from ..template import Const, Scalar, Tensor, TraceTemplate, Var

_AXES = {"batch_size": Var(), "hidden_size": Const(abbrev="h")}
_ROWS = ["batch_size", "hidden_size"]
_INPUT_DTYPES = ("float16", "bfloat16")
_FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def _quantize(y, out, scale):
    """y / scale (as a multiplication by float32 1 / scale), clamped to out's finite range, rounded to out's dtype."""
    import torch

    scale = scale.float().reshape(()) if isinstance(scale, torch.Tensor) else torch.tensor(scale, dtype=torch.float32)
    limit = _FP8_MAX[str(out.dtype).replace("torch.", "")]
    return (y * (1.0 / scale).to(y.device)).clamp(-limit, limit).to(out.dtype)


def _rms(x, weight, eps):
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def _rmsnorm_quant_reference(out, hidden_states, weight, scale, eps):
    return _quantize(_rms(hidden_states.float(), weight, eps), out, scale)


def _fused_add_rmsnorm_quant_reference(out, hidden_states, residual, weight, scale, eps):
    x = hidden_states.float() + residual.float()
    return _quantize(_rms(x, weight, eps), out, scale), x.to(residual.dtype)


def _layernorm_quant_reference(out, hidden_states, gemma, beta, scale, eps):
    import torch

    x = hidden_states.float()
    y = torch.nn.functional.layer_norm(x, x.shape[-1:], gemma.float(), beta.float(), eps)
    return _quantize(y, out, scale)


def _out():
    # The op takes float8_e5m2 too; tests that build arguments from the template use e4m3fn.
    return Tensor(_ROWS, dtype="float8_e4m3fn")


_OUTPUT = Tensor(_ROWS, param="out", dtype_from="out", description="Written into out, quantized to its dtype.")

rmsnorm_quant_trace = TraceTemplate(
    op_type="rmsnorm",
    name_prefix="rmsnorm_quant",
    description="RMSNorm over the last dimension times weight, divided by scale, clamped and rounded to out's FP8 dtype.",
    axes=dict(_AXES),
    inputs={
        "out": _out(),
        "hidden_states": Tensor(_ROWS, param="input", dtypes=_INPUT_DTYPES),
        "weight": Tensor(["hidden_size"], dtypes=_INPUT_DTYPES),
        "scale": Scalar("float32"),
        "eps": Scalar("float32"),
    },
    outputs={"output": _OUTPUT},
    tags=["status:verified", "quantize"],
    reference=_rmsnorm_quant_reference,
)
fused_add_rmsnorm_quant_trace = TraceTemplate(
    op_type="rmsnorm",
    name_prefix="fused_add_rmsnorm_quant",
    description="residual += hidden_states, then out = FP8 of rmsnorm(the float32 sum) * weight / scale.",
    axes=dict(_AXES),
    inputs={
        "out": _out(),
        "hidden_states": Tensor(_ROWS, param="input", dtypes=_INPUT_DTYPES),
        "residual": Tensor(_ROWS, dtypes=_INPUT_DTYPES),
        "weight": Tensor(["hidden_size"], dtypes=_INPUT_DTYPES),
        "scale": Scalar("float32"),
        "eps": Scalar("float32"),
    },
    outputs={
        "output": _OUTPUT,
        "residual": Tensor(_ROWS, param="residual", dtype_from="hidden_states",
                           description="residual + hidden_states (in place)."),
    },
    tags=["status:verified", "fused", "quantize"],
    reference=_fused_add_rmsnorm_quant_reference,
)
layernorm_quant_trace = TraceTemplate(
    op_type="layernorm",
    name_prefix="layernorm_quant",
    description="Layer normalization times gemma plus beta, divided by scale, clamped and rounded to out's FP8 dtype.",
    axes=dict(_AXES),
    inputs={
        "out": _out(),
        "hidden_states": Tensor(_ROWS, param="input", dtypes=_INPUT_DTYPES),
        "gemma": Tensor(["hidden_size"], dtype="float32"),
        "beta": Tensor(["hidden_size"], dtype="float32"),
        "scale": Scalar("float32"),
        "eps": Scalar("float32"),
    },
    outputs={"output": _OUTPUT},
    tags=["status:verified", "quantize"],
    reference=_layernorm_quant_reference,
)
