"""Trace template of aotinfer.decode's single-request decode (torch is imported when the reference
runs). The paged wrapper has none: its page table comes from ``plan``, not from ``run``'s arguments.

``q``, ``k`` and ``v`` take float16 or bfloat16: the kernels have no float32 path."""

import math

from ..template import Const, Tensor, TraceTemplate, Var

_HALF = ("float16", "bfloat16")


def _single_decode_reference(q, k, v):
    """Softmax attention of one query token per head over kv_len keys (NHD), in float32; query
    head h reads KV head h // (num_qo_heads // num_kv_heads)."""
    import torch

    num_qo_heads, head_dim = q.shape
    group = num_qo_heads // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1)  # [kv_len, num_qo_heads, head_dim]
    values = v.float().repeat_interleave(group, dim=1)
    logits = torch.einsum("hd,nhd->hn", q.float(), keys) / math.sqrt(head_dim)
    return torch.einsum("hn,nhd->hd", torch.softmax(logits, dim=-1), values).to(q.dtype)


single_decode_with_kv_cache_trace = TraceTemplate(
    op_type="single_decode",
    name_prefix="single_decode",
    description="Decode attention of one request: softmax(q.k / sqrt(head_dim)) v per query head, grouped-query "
    "heads sharing KV heads; K and V contiguous [kv_len, num_kv_heads, head_dim] (NHD).",
    axes={
        "num_qo_heads": Const(abbrev="h"),
        "num_kv_heads": Const(abbrev="kv"),
        "head_dim": Const(abbrev="d"),
        "kv_len": Var(),
    },
    inputs={
        "q": Tensor(["num_qo_heads", "head_dim"], dtypes=_HALF),
        "k": Tensor(["kv_len", "num_kv_heads", "head_dim"], description="Keys (NHD, the default kv_layout).", dtypes=_HALF),
        "v": Tensor(["kv_len", "num_kv_heads", "head_dim"], description="Values (NHD, the default kv_layout).", dtypes=_HALF),
    },
    outputs={"output": Tensor(["num_qo_heads", "head_dim"], dtype_from="q")},
    tags=["status:verified", "stage:decode"],
    reference=_single_decode_reference,
)
