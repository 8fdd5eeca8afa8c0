"""Trace templates of aotinfer.norm's ops. The references import torch when run: aotinfer's import does not."""

from ..template import Const, Scalar, Tensor, TraceTemplate, Var

_AXES = {"batch_size": Var(), "hidden_size": Const(abbrev="h")}
_ROWS = ["batch_size", "hidden_size"]
_ROW_RANKS = (2, 3)  # [tokens, hidden] or [tokens, heads, hidden]: batch_size = tokens * heads


def _rms(x, weight, eps, weight_offset):
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (weight.float() + weight_offset)


def _rmsnorm_reference(hidden_states, weight, eps):
    return _rms(hidden_states.float(), weight, eps, 0.0).to(hidden_states.dtype)


def _gemma_rmsnorm_reference(hidden_states, weight, eps):
    return _rms(hidden_states.float(), weight, eps, 1.0).to(hidden_states.dtype)


def _fused_add_rmsnorm_reference(hidden_states, residual, weight, eps):
    x = hidden_states.float() + residual.float()
    return _rms(x, weight, eps, 0.0).to(hidden_states.dtype), x.to(residual.dtype)


def _gemma_fused_add_rmsnorm_reference(hidden_states, residual, weight, eps):
    x = hidden_states.float() + residual.float()
    return _rms(x, weight, eps, 1.0).to(hidden_states.dtype), x.to(residual.dtype)


def _layernorm_reference(hidden_states, gemma, beta, eps):
    import torch

    x = hidden_states.float()
    y = torch.nn.functional.layer_norm(x, x.shape[-1:], gemma.float(), beta.float(), eps)
    return y.to(hidden_states.dtype)


def _rmsnorm_like(prefix, description, reference, tags):
    return TraceTemplate(
        op_type="rmsnorm",
        name_prefix=prefix,
        description=description,
        axes=dict(_AXES),
        inputs={
            "hidden_states": Tensor(_ROWS, param="input", ranks=_ROW_RANKS),
            "weight": Tensor(["hidden_size"]),
            "eps": Scalar("float32"),
        },
        outputs={"output": Tensor(_ROWS, dtype_from="hidden_states", ranks=_ROW_RANKS)},
        tags=tags,
        reference=reference,
    )


def _fused_like(prefix, description, reference, tags):
    return TraceTemplate(
        op_type="rmsnorm",
        name_prefix=prefix,
        description=description,
        axes=dict(_AXES),
        inputs={
            "hidden_states": Tensor(_ROWS, param="input", ranks=_ROW_RANKS),
            "residual": Tensor(_ROWS, ranks=_ROW_RANKS),
            "weight": Tensor(["hidden_size"]),
            "eps": Scalar("float32"),
        },
        outputs={
            "output": Tensor(_ROWS, param="input", dtype_from="hidden_states", ranks=_ROW_RANKS,
                             description="Written into hidden_states (in place)."),
            "residual": Tensor(_ROWS, param="residual", dtype_from="hidden_states", ranks=_ROW_RANKS,
                               description="residual + hidden_states (in place)."),
        },
        tags=tags,
        reference=reference,
    )


rmsnorm_trace = _rmsnorm_like(
    "rmsnorm", "Root mean square normalization over the last dimension, times weight.",
    _rmsnorm_reference, ["status:verified"])
gemma_rmsnorm_trace = _rmsnorm_like(
    "gemma_rmsnorm", "Gemma's RMSNorm: the weight is applied as 1 + weight.",
    _gemma_rmsnorm_reference, ["status:verified", "gemma"])
fused_add_rmsnorm_trace = _fused_like(
    "fused_add_rmsnorm", "residual += hidden_states, then hidden_states = rmsnorm(residual) * weight, in place.",
    _fused_add_rmsnorm_reference, ["status:verified", "fused"])
gemma_fused_add_rmsnorm_trace = _fused_like(
    "gemma_fused_add_rmsnorm", "Gemma's fused add + RMSNorm: the weight is applied as 1 + weight.",
    _gemma_fused_add_rmsnorm_reference, ["status:verified", "fused", "gemma"])
layernorm_trace = TraceTemplate(
    op_type="layernorm",
    name_prefix="layernorm",
    description="Layer normalization over the last dimension: (x - mean) / sqrt(var + eps) * gemma + beta.",
    axes=dict(_AXES),
    inputs={
        "hidden_states": Tensor(_ROWS, param="input", ranks=_ROW_RANKS),
        "gemma": Tensor(["hidden_size"]),
        "beta": Tensor(["hidden_size"]),
        "eps": Scalar("float32"),
    },
    outputs={"output": Tensor(_ROWS, dtype_from="hidden_states", ranks=_ROW_RANKS)},
    tags=["status:verified"],
    reference=_layernorm_reference,
)
