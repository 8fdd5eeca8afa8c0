"""Trace templates of aotinfer.rope (torch is imported when a reference runs).

q and k take float16 or bfloat16: the kernel has no float32 path. The references rotate in float64
and round once, as the kernel does in float32. Index inputs come from ``example``: ``indptr``
gives each of the batch's requests one token (so that ``indptr[-1]`` is the token count of the
tests' inputs, where both axes are of one size), positions lie below the cos/sin cache's rows."""

import math

from ..template import Const, Scalar, Tensor, TraceTemplate, Var

_HALF = ("float16", "bfloat16")
_Q = ["nnz", "num_qo_heads", "head_dim"]
_K = ["nnz", "num_kv_heads", "head_dim"]


def _one_token_each(shape, device, dtype):
    import torch

    return torch.arange(shape[0], device=device, dtype=torch.int32)


def _offsets(shape, device, dtype):
    import torch

    return torch.randint(0, 1000, shape, device=device, dtype=torch.int32)


def _positions(shape, device, dtype):
    import torch

    return torch.randint(0, 1000, shape, device=device, dtype=torch.int32)


def _cache_positions(shape, device, dtype):
    """Positions below the cache's rows (the tests' token count, no larger than them)."""
    import torch

    return torch.rand(shape[0], device=device).argsort().to(torch.int32)  # a permutation


def _cos_sin_cache(shape, device, dtype):
    """cos of frequency j at column j, sin at rotary_dim / 2 + j, for positions 0..rows-1."""
    import torch

    rows, rotary_dim = shape
    inv_freq = torch.exp(torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float64) * (-math.log(1e4) / rotary_dim))
    angles = torch.arange(rows, device=device, dtype=torch.float64).unsqueeze(1) * inv_freq
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def _inv_freq(rotary_dim, rope_scale, rope_theta, device):
    import torch

    return rope_theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim) / rope_scale


def _llama31_inv_freq(rotary_dim, rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len, device):
    f = _inv_freq(rotary_dim, 1.0, rope_theta, device)
    smooth = ((old_context_len * f / (2 * math.pi) - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0, 1)
    return (1 - smooth) * f / rope_scale + smooth * f


def _rotate(x, cos, sin, interleave):
    """x's first 2 * cos.shape[-1] dims turned by (cos, sin) [nnz, rotary_dim / 2], in float64."""
    import torch

    half = cos.shape[-1]
    y = x.double()
    rot = y[..., : 2 * half]
    c, s = cos[:, None, :], sin[:, None, :]
    if interleave:
        a, b = rot[..., 0::2], rot[..., 1::2]
        turned = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    else:
        a, b = rot[..., :half], rot[..., half:]
        turned = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    return torch.cat([turned, y[..., 2 * half :]], dim=-1).to(x.dtype)


def _token_positions(indptr, offsets, nnz):
    import torch

    counts = (indptr[1:] - indptr[:-1]).long()
    request = torch.repeat_interleave(torch.arange(len(counts), device=indptr.device), counts, output_size=nnz)
    return offsets.long()[request] + torch.arange(nnz, device=indptr.device) - indptr.long()[request]


def _rope_at(q, k, positions, inv_freq, interleave):
    angles = positions.double()[:, None] * inv_freq
    return _rotate(q, angles.cos(), angles.sin(), interleave), _rotate(k, angles.cos(), angles.sin(), interleave)


def _apply_rope_reference(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta):
    return _rope_at(q, k, _token_positions(indptr, offsets, q.shape[0]),
                    _inv_freq(rotary_dim, rope_scale, rope_theta, q.device), interleave)


def _apply_llama31_rope_reference(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta,
                                  low_freq_factor, high_freq_factor, old_context_len):
    inv_freq = _llama31_inv_freq(rotary_dim, rope_scale, rope_theta, low_freq_factor, high_freq_factor,
                                 old_context_len, q.device)
    return _rope_at(q, k, _token_positions(indptr, offsets, q.shape[0]), inv_freq, interleave)


def _apply_rope_pos_ids_reference(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta):
    return _rope_at(q, k, pos_ids, _inv_freq(rotary_dim, rope_scale, rope_theta, q.device), interleave)


def _apply_llama31_rope_pos_ids_reference(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta,
                                          low_freq_factor, high_freq_factor, old_context_len):
    inv_freq = _llama31_inv_freq(rotary_dim, rope_scale, rope_theta, low_freq_factor, high_freq_factor,
                                 old_context_len, q.device)
    return _rope_at(q, k, pos_ids, inv_freq, interleave)


def _cached(x, cos_sin_cache, positions, interleave):
    half = cos_sin_cache.shape[-1] // 2
    rows = cos_sin_cache.double()[positions.long()]
    return _rotate(x, rows[:, :half], rows[:, half:], interleave)


def _cos_sin_cache_reference(positions, query, key, head_size, cos_sin_cache, is_neox):
    """query, key [nnz, heads, head_size] (the template's 3-D form)."""
    return (_cached(query, cos_sin_cache, positions, not is_neox),
            _cached(key, cos_sin_cache, positions, not is_neox))


def _fp8(x, scale):
    import torch

    return (x.double() * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def _rope_quantize_fp8_reference(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox,
                                 quant_scale_q, quant_scale_kv):
    """To float8_e4m3fn (the default quantize_dtype): rotated, scaled, rounded once, saturated.
    A 2-D k (MLA's one head) is rotated as one head."""
    k3 = k_rope[:, None] if k_rope.dim() == 2 else k_rope
    # Rotated in float64 without a rounding to the input dtype: the kernel rounds only to FP8.
    q_turned = _cached(q_rope.double(), cos_sin_cache, pos_ids, not is_neox)
    k_turned = _cached(k3.double(), cos_sin_cache, pos_ids, not is_neox).reshape(k_rope.shape)
    return (_fp8(q_turned, quant_scale_q), _fp8(k_turned, quant_scale_kv),
            _fp8(q_nope, quant_scale_q), _fp8(k_nope, quant_scale_kv))


# ---- templates ----------------------------------------------------------------------------------

_HEAD_AXES = {"nnz": Var(), "num_qo_heads": Const(abbrev="h"), "num_kv_heads": Const(abbrev="kv"),
              "head_dim": Const(abbrev="d"), "rotary_dim": Const(abbrev="r")}
_RAGGED_AXES = dict(_HEAD_AXES, batch_size=Var(), indptr_len=Const(derive=lambda sizes: sizes["batch_size"] + 1))
_ROPE_SCALARS = {
    "rotary_dim": Scalar("int32", example=16, description="Dims of each head rotated (the first ones)."),
    "interleave": Scalar("bool", example=False, description="(2j, 2j + 1) turn together; False: NeoX."),
    "rope_scale": Scalar("float32", example=1.0),
    "rope_theta": Scalar("float32", example=1e4),
}
_LLAMA31_SCALARS = dict(
    _ROPE_SCALARS,
    rope_scale=Scalar("float32", example=8.0),
    rope_theta=Scalar("float32", example=5e5),
    low_freq_factor=Scalar("float32", example=1.0),
    high_freq_factor=Scalar("float32", example=4.0),
    old_context_len=Scalar("int32", example=8192),
)
_RAGGED = {
    "indptr": Tensor(["indptr_len"], dtype="int32", example=_one_token_each,
                     description="[batch_size + 1]: each request's first token."),
    "offsets": Tensor(["batch_size"], dtype="int32", example=_offsets,
                      description="The position of each request's first token."),
}
_POS_IDS = {"pos_ids": Tensor(["nnz"], dtype="int32", example=_positions, description="Each token's position.")}
_QK = {"q": Tensor(_Q, dtypes=_HALF), "k": Tensor(_K, dtypes=_HALF)}
_NEW = {"q_rope": Tensor(_Q, dtype_from="q"), "k_rope": Tensor(_K, dtype_from="k")}
_IN_PLACE = {
    "q": Tensor(_Q, param="q", dtype_from="q", description="Written into q (in place)."),
    "k": Tensor(_K, param="k", dtype_from="k", description="Written into k (in place)."),
}
_TAGS = ["status:verified", "rope"]


def _template(name, description, axes, inputs, outputs, reference):
    return TraceTemplate(op_type="rope", name_prefix=name, description=description, axes=dict(axes),
                         inputs=inputs, outputs=outputs, tags=_TAGS, reference=reference)


_ROPE = "Rotate the first rotary_dim dims of every head of q and k by pos * rope_theta ** (-2j / rotary_dim) / rope_scale"
_LLAMA = _ROPE + ", the frequencies blended as Llama 3.1's"
apply_rope_trace = _template(
    "apply_rope", _ROPE + "; token indptr[r] + i at offsets[r] + i.", _RAGGED_AXES,
    dict(_QK, **_RAGGED, **_ROPE_SCALARS), _NEW, _apply_rope_reference)
apply_rope_inplace_trace = _template(
    "apply_rope_inplace", _ROPE + "; token indptr[r] + i at offsets[r] + i; in place.", _RAGGED_AXES,
    dict(_QK, **_RAGGED, **_ROPE_SCALARS), _IN_PLACE, _apply_rope_reference)
apply_llama31_rope_trace = _template(
    "apply_llama31_rope", _LLAMA + "; token indptr[r] + i at offsets[r] + i.", _RAGGED_AXES,
    dict(_QK, **_RAGGED, **_LLAMA31_SCALARS), _NEW, _apply_llama31_rope_reference)
apply_llama31_rope_inplace_trace = _template(
    "apply_llama31_rope_inplace", _LLAMA + "; token indptr[r] + i at offsets[r] + i; in place.", _RAGGED_AXES,
    dict(_QK, **_RAGGED, **_LLAMA31_SCALARS), _IN_PLACE, _apply_llama31_rope_reference)
apply_rope_pos_ids_trace = _template(
    "apply_rope_pos_ids", _ROPE + " at pos_ids.", _HEAD_AXES,
    dict(_QK, **_POS_IDS, **_ROPE_SCALARS), _NEW, _apply_rope_pos_ids_reference)
apply_rope_pos_ids_inplace_trace = _template(
    "apply_rope_pos_ids_inplace", _ROPE + " at pos_ids; in place.", _HEAD_AXES,
    dict(_QK, **_POS_IDS, **_ROPE_SCALARS), _IN_PLACE, _apply_rope_pos_ids_reference)
apply_llama31_rope_pos_ids_trace = _template(
    "apply_llama31_rope_pos_ids", _LLAMA + " at pos_ids.", _HEAD_AXES,
    dict(_QK, **_POS_IDS, **_LLAMA31_SCALARS), _NEW, _apply_llama31_rope_pos_ids_reference)
apply_llama31_rope_pos_ids_inplace_trace = _template(
    "apply_llama31_rope_pos_ids_inplace", _LLAMA + " at pos_ids; in place.", _HEAD_AXES,
    dict(_QK, **_POS_IDS, **_LLAMA31_SCALARS), _IN_PLACE, _apply_llama31_rope_pos_ids_reference)

_CACHE_AXES = {"nnz": Var(), "num_q_heads": Const(abbrev="h"), "num_k_heads": Const(abbrev="kv"),
               "head_dim": Const(abbrev="d"), "max_position": Const(abbrev=""), "rotary_dim": Const(abbrev="r")}
_CACHE_INPUTS = {
    "positions": Tensor(["nnz"], dtype="int32", example=_cache_positions, description="Each token's row of the cache."),
    "query": Tensor(["nnz", "num_q_heads", "head_dim"], dtypes=_HALF,
                    description="[nnz, num_q_heads, head_size] or [nnz, num_q_heads * head_size]."),
    "key": Tensor(["nnz", "num_k_heads", "head_dim"], dtypes=_HALF),
    "head_size": Scalar("int32", example=64, description="head_dim, the dims of a head."),
    "cos_sin_cache": Tensor(["max_position", "rotary_dim"], dtype="float32", example=_cos_sin_cache,
                            description="cos of frequency j at column j, sin at rotary_dim / 2 + j."),
    "is_neox": Scalar("bool", example=True),
}
_CACHE = "Rotate the first rotary_dim dims of every head of query and key by the cos/sin cache's row at positions"
apply_rope_with_cos_sin_cache_trace = _template(
    "apply_rope_with_cos_sin_cache", _CACHE + ".", _CACHE_AXES, _CACHE_INPUTS,
    {"query_out": Tensor(["nnz", "num_q_heads", "head_dim"], dtype_from="query"),
     "key_out": Tensor(["nnz", "num_k_heads", "head_dim"], dtype_from="key")},
    _cos_sin_cache_reference)
apply_rope_with_cos_sin_cache_inplace_trace = _template(
    "apply_rope_with_cos_sin_cache_inplace", _CACHE + "; in place.", _CACHE_AXES, _CACHE_INPUTS,
    {"query": Tensor(["nnz", "num_q_heads", "head_dim"], param="query", dtype_from="query",
                     description="Written into query (in place)."),
     "key": Tensor(["nnz", "num_k_heads", "head_dim"], param="key", dtype_from="key",
                   description="Written into key (in place).")},
    _cos_sin_cache_reference)

_QUANT_AXES = {"nnz": Var(), "num_qo_heads": Const(abbrev="h"), "num_kv_heads": Const(abbrev="kv"),
               "rope_dim": Const(abbrev="r"), "no_rope_dim": Const(abbrev="n"), "max_position": Const(abbrev="")}
rope_quantize_fp8_trace = _template(
    "rope_quantize_fp8",
    "Rotate q_rope and k_rope by the cos/sin cache's row at pos_ids; every part times its scale to FP8 (e4m3).",
    _QUANT_AXES,
    {
        "q_rope": Tensor(["nnz", "num_qo_heads", "rope_dim"], dtypes=_HALF),
        "k_rope": Tensor(["nnz", "num_kv_heads", "rope_dim"], dtypes=_HALF,
                         description="Or [nnz, rope_dim] (MLA's one head)."),
        "q_nope": Tensor(["nnz", "num_qo_heads", "no_rope_dim"], dtypes=_HALF),
        "k_nope": Tensor(["nnz", "num_kv_heads", "no_rope_dim"], dtypes=_HALF),
        "cos_sin_cache": Tensor(["max_position", "rope_dim"], dtype="float32", example=_cos_sin_cache),
        "pos_ids": Tensor(["nnz"], dtype="int32", example=_cache_positions),
        "is_neox": Scalar("bool", example=True),
        "quant_scale_q": Scalar("float32", example=0.5),
        "quant_scale_kv": Scalar("float32", example=2.0),
    },
    {
        "q_rope_out": Tensor(["nnz", "num_qo_heads", "rope_dim"], dtype="float8_e4m3fn"),
        "k_rope_out": Tensor(["nnz", "num_kv_heads", "rope_dim"], dtype="float8_e4m3fn"),
        "q_nope_out": Tensor(["nnz", "num_qo_heads", "no_rope_dim"], dtype="float8_e4m3fn"),
        "k_nope_out": Tensor(["nnz", "num_kv_heads", "no_rope_dim"], dtype="float8_e4m3fn"),
    },
    _rope_quantize_fp8_reference,
)
