"""Trace template of aotinfer.prefill's single-request prefill (torch is imported when the
reference runs). The batch wrappers have none: their lengths and page table come from ``plan``,
not from ``run``'s arguments.

``q``, ``k`` and ``v`` take float16 or bfloat16: the kernels have no float32 path."""

import math

from ..template import Const, Tensor, TraceTemplate, Var

_HALF = ("float16", "bfloat16")


def _single_prefill_reference(q, k, v):
    """Softmax attention of qo_len query tokens over kv_len keys (NHD, no mask), in float32; query
    head h reads KV head h // (num_qo_heads // num_kv_heads)."""
    import torch

    head_dim = q.shape[-1]
    group = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1)  # [kv_len, num_qo_heads, head_dim]
    values = v.float().repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.float(), keys) / math.sqrt(head_dim)
    return torch.einsum("hqk,khd->qhd", torch.softmax(logits, dim=-1), values).to(q.dtype)


single_prefill_with_kv_cache_trace = TraceTemplate(
    op_type="single_prefill",
    name_prefix="single_prefill",
    description="Prefill attention of one request: softmax(q.k / sqrt(head_dim)) v for each query token and head, "
    "grouped-query heads sharing KV heads; K and V contiguous [kv_len, num_kv_heads, head_dim] (NHD); no mask.",
    axes={
        "qo_len": Var(),
        "num_qo_heads": Const(abbrev="h"),
        "num_kv_heads": Const(abbrev="kv"),
        "head_dim": Const(abbrev="d"),
        "kv_len": Var(),
    },
    inputs={
        "q": Tensor(["qo_len", "num_qo_heads", "head_dim"], dtypes=_HALF),
        "k": Tensor(["kv_len", "num_kv_heads", "head_dim"], description="Keys (NHD, the default kv_layout).", dtypes=_HALF),
        "v": Tensor(["kv_len", "num_kv_heads", "head_dim"], description="Values (NHD, the default kv_layout).", dtypes=_HALF),
    },
    outputs={"output": Tensor(["qo_len", "num_qo_heads", "head_dim"], dtype_from="q")},
    tags=["status:verified", "stage:prefill"],
    reference=_single_prefill_reference,
)
