"""Trace templates of aotinfer.cascade's merges of attention states (torch is imported when a
reference runs). Log-sum-exp values are base 2 and float32."""

import math

from ..template import Const, Tensor, TraceTemplate, Var

_V = ["seq_len", "num_heads", "head_dim"]
_S = ["seq_len", "num_heads"]
_AXES = {"seq_len": Var(), "num_heads": Const(abbrev="h"), "head_dim": Const(abbrev="d")}


def _merge(v_a, s_a, v_b, s_b):
    """The merged state of two, in float32: natural-log weights from base-2 log-sum-exps. Rows
    where both are -inf (no keys) give v = 0, s = -inf."""
    import torch

    s_a, s_b = s_a.float() * math.log(2.0), s_b.float() * math.log(2.0)
    s_max = torch.maximum(s_a, s_b)
    s_max = torch.where(torch.isinf(s_max), torch.zeros_like(s_max), s_max)
    w_a, w_b = torch.exp(s_a - s_max), torch.exp(s_b - s_max)
    total = w_a + w_b
    v = (v_a.float() * w_a[..., None] + v_b.float() * w_b[..., None]) / torch.where(total > 0, total, 1.0)[..., None]
    return v, (s_max + torch.log(total)) / math.log(2.0)


def _merge_state_reference(v_a, s_a, v_b, s_b):
    v, s = _merge(v_a, s_a, v_b, s_b)
    return v.to(v_a.dtype), s


def _merge_state_in_place_reference(v, s, v_other, s_other, mask=None):
    import torch

    merged_v, merged_s = _merge(v, s, v_other, s_other)
    if mask is not None:
        keep = ~mask.bool()
        merged_v = torch.where(keep[:, None, None], v.float(), merged_v)
        merged_s = torch.where(keep[:, None], s.float(), merged_s)
    return merged_v.to(v.dtype), merged_s


def _merge_states_reference(v, s):
    import torch

    seq_len, num_states, num_heads, head_dim = v.shape
    merged_v = torch.zeros(seq_len, num_heads, head_dim, device=v.device)
    merged_s = torch.full((seq_len, num_heads), float("-inf"), device=v.device)
    for i in range(num_states):
        merged_v, merged_s = _merge(merged_v, merged_s, v[:, i], s[:, i])
    return merged_v.to(v.dtype), merged_s


merge_state_trace = TraceTemplate(
    op_type="cascade_merge",
    name_prefix="merge_state",
    description="Merge two attention states (v, s): s = log2(2**s_a + 2**s_b), v weighted by 2**(s_x - s).",
    axes=dict(_AXES),
    inputs={
        "v_a": Tensor(_V, description="Attention output of KV segment A."),
        "s_a": Tensor(_S, description="Log-sum-exp (base 2) of segment A.", dtype="float32"),
        "v_b": Tensor(_V, description="Attention output of KV segment B."),
        "s_b": Tensor(_S, description="Log-sum-exp (base 2) of segment B.", dtype="float32"),
    },
    outputs={
        "v_merged": Tensor(_V, dtype_from="v_a"),
        "s_merged": Tensor(_S, dtype_from="s_a"),
    },
    tags=["status:verified"],
    reference=_merge_state_reference,
)

merge_state_in_place_trace = TraceTemplate(
    op_type="cascade_merge",
    name_prefix="merge_state_in_place",
    description="Merge (v_other, s_other) into (v, s) in place, on the rows where mask is True (all without one).",
    axes=dict(_AXES),
    inputs={
        "v": Tensor(_V),
        "s": Tensor(_S, dtype="float32"),
        "v_other": Tensor(_V),
        "s_other": Tensor(_S, dtype="float32"),
        "mask": Tensor(["seq_len"], optional=True, dtype="bool", description="Rows to merge."),
    },
    outputs={
        "v": Tensor(_V, param="v", dtype_from="v", description="Written into v (in place)."),
        "s": Tensor(_S, param="s", dtype_from="s", description="Written into s (in place)."),
    },
    tags=["status:verified"],
    reference=_merge_state_in_place_reference,
)

merge_states_trace = TraceTemplate(
    op_type="cascade_merge",
    name_prefix="merge_states",
    description="Merge num_states attention states per row: s = log2(sum 2**s_i), v weighted by 2**(s_i - s).",
    axes={
        "seq_len": Var(),
        "num_states": Var(),
        "num_heads": Const(abbrev="h"),
        "head_dim": Const(abbrev="d"),
    },
    inputs={
        "v": Tensor(["seq_len", "num_states", "num_heads", "head_dim"]),
        "s": Tensor(["seq_len", "num_states", "num_heads"], dtype="float32"),
    },
    outputs={
        "v_merged": Tensor(_V, dtype_from="v"),
        "s_merged": Tensor(_S, dtype_from="s"),
    },
    tags=["status:verified"],
    reference=_merge_states_reference,
)
