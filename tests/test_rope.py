"""The RoPE ops against a reference: angles in float32 as the kernel forms them, the rotation in
float64, rounded once."""

import math

import pytest
import torch

import aotinfer
from aotinfer import rope as rope_module

gpu = pytest.mark.gpu
DTYPES = [torch.float16, torch.bfloat16]
TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 2e-2}
LLAMA31 = dict(rope_scale=8.0, rope_theta=5e5, low_freq_factor=1.0, high_freq_factor=4.0, old_context_len=8192)


# ---- reference ------------------------------------------------------------------------------------


def inv_freq(rotary_dim, rope_theta, rope_scale, llama31=None):
    """float32 frequencies, as the kernel computes them."""
    j = torch.arange(0, rotary_dim, 2, dtype=torch.float32)
    f = 1.0 / (torch.tensor(rope_theta, dtype=torch.float32) ** (j / rotary_dim))
    if llama31 is None:
        return f / rope_scale
    low, high, old = llama31["low_freq_factor"], llama31["high_freq_factor"], llama31["old_context_len"]
    s = ((old * f / (2 * math.pi) - low) / (high - low)).clamp(0, 1)
    return (1 - s) * f / rope_scale + s * f


def cos_sin_of(pos, freqs):
    """[nnz, rotary_dim / 2] cos and sin (float64) of float32 angles pos * freq."""
    angles = pos.cpu().float()[:, None] * freqs[None, :]
    return angles.double().cos(), angles.double().sin()


def rotate(x, cos, sin, interleave):
    """x [nnz, heads, head_dim] rotated over its first 2 * cos.shape[1] dims, in float64."""
    out = x.double().cpu().clone()
    half = cos.shape[1]
    c, s = cos[:, None, :], sin[:, None, :]
    if interleave:
        even, odd = out[..., 0 : 2 * half : 2].clone(), out[..., 1 : 2 * half : 2].clone()
        out[..., 0 : 2 * half : 2] = even * c - odd * s
        out[..., 1 : 2 * half : 2] = odd * c + even * s
    else:
        a, b = out[..., :half].clone(), out[..., half : 2 * half].clone()
        out[..., :half] = a * c - b * s
        out[..., half : 2 * half] = b * c + a * s
    return out


def positions_of(indptr, offsets):
    return torch.cat([offsets[r] + torch.arange(int(indptr[r + 1] - indptr[r])) for r in range(len(offsets))])


# ---- inputs ---------------------------------------------------------------------------------------


def make_qk(nnz, num_q, num_k, head_dim, dtype, fused):
    """q and k: fresh, or slices of one fused qkv tensor (strided rows); also that tensor."""
    if fused:
        qkv = torch.randn(nnz, (num_q + 2 * num_k) * head_dim + 8, device="cuda", dtype=dtype)
        q = qkv[:, : num_q * head_dim].view(nnz, num_q, head_dim)
        k = qkv[:, num_q * head_dim : (num_q + num_k) * head_dim].view(nnz, num_k, head_dim)
        assert not q.is_contiguous() and not k.is_contiguous()
        return q, k, qkv
    return (torch.randn(nnz, num_q, head_dim, device="cuda", dtype=dtype),
            torch.randn(nnz, num_k, head_dim, device="cuda", dtype=dtype), None)


def close(got, want, dtype):
    assert not got.isnan().any(), "some outputs were not written"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.cpu().double(), want.to(dtype).double(), rtol=tol, atol=tol)


# ---- every variant x layout x rotary_dim x positions x dtype x in place --------------------------

# head_dim, rotary_dim: whole heads, half (16-byte vectors), and 40 of 64 (NeoX's halves of 20 dims
# are not whole vectors: the element-wise kernel).
DIMS = [(128, 128), (128, 64), (64, 40)]
SEQ_LENS = [3, 0, 17, 1, 9]  # an empty request among them


@gpu
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("positions", ["indptr", "pos_ids32", "pos_ids64"])
@pytest.mark.parametrize("head_dim, rotary_dim", DIMS)
@pytest.mark.parametrize("interleave", [False, True], ids=["neox", "interleave"])
@pytest.mark.parametrize("variant", ["rope", "llama31"])
def test_rope(variant, interleave, head_dim, rotary_dim, positions, dtype, inplace):
    torch.manual_seed(hash((variant, interleave, head_dim, positions, str(dtype), inplace)) % 2**31)
    nnz = sum(SEQ_LENS)
    q, k, qkv = make_qk(nnz, 5, 2, head_dim, dtype, fused=inplace)
    indptr = torch.tensor([0] + SEQ_LENS).cumsum(0)
    offsets = torch.randint(0, 5000, (len(SEQ_LENS),))
    pos = positions_of(indptr, offsets)
    llama31 = LLAMA31 if variant == "llama31" else None
    scalars = dict(LLAMA31) if llama31 else dict(rope_scale=2.0, rope_theta=1e4)
    freqs = inv_freq(rotary_dim, scalars["rope_theta"], scalars["rope_scale"], llama31)
    cos, sin = cos_sin_of(pos, freqs)
    q_ref, k_ref = rotate(q, cos, sin, interleave), rotate(k, cos, sin, interleave)

    prefix = "apply_llama31_rope" if llama31 else "apply_rope"
    if positions == "indptr":
        name, where = prefix, (indptr.int().cuda(), offsets.int().cuda())
    else:
        ids = pos.to(torch.int32 if positions == "pos_ids32" else torch.int64).cuda()
        name, where = prefix + "_pos_ids", (ids,)
    if inplace:
        before = qkv.clone()
        assert getattr(aotinfer, name + "_inplace")(q, k, *where, rotary_dim=rotary_dim, interleave=interleave,
                                                    **scalars) is None
        close(q, q_ref, dtype)
        close(k, k_ref, dtype)
        # What is not rotated stays: the dims past rotary_dim, v and the padding of the fused rows.
        rotated = qkv.clone()
        num_qk = (5 + 2) * head_dim
        heads = rotated[:, :num_qk].view(nnz, 7, head_dim)
        heads[..., :rotary_dim] = before[:, :num_qk].view(nnz, 7, head_dim)[..., :rotary_dim]
        assert torch.equal(rotated, before)
    else:
        q_rope, k_rope = getattr(aotinfer, name)(q, k, *where, rotary_dim=rotary_dim, interleave=interleave, **scalars)
        close(q_rope, q_ref, dtype)
        close(k_rope, k_ref, dtype)
        # The binding into poisoned outputs: every element (the dims past rotary_dim too) is written.
        q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
        args = [scalars["rope_scale"], scalars["rope_theta"]]
        if llama31:
            args += [LLAMA31["low_freq_factor"], LLAMA31["high_freq_factor"], float(LLAMA31["old_context_len"])]
        getattr(rope_module, "_" + name)(q_out, k_out, q, k, *where, rotary_dim, interleave, *args, -1)
        close(q_out, q_ref, dtype)
        close(k_out, k_ref, dtype)


def make_cos_sin_cache(max_position, rotary_dim, theta=1e4):
    freqs = inv_freq(rotary_dim, theta, 1.0)
    angles = torch.arange(max_position, dtype=torch.float32)[:, None] * freqs[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)  # [max_position, rotary_dim], float32


@gpu
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("positions", [torch.int32, torch.int64], ids=["pos32", "pos64"])
@pytest.mark.parametrize("head_dim, rotary_dim", DIMS)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleave"])
def test_rope_with_cos_sin_cache(is_neox, head_dim, rotary_dim, positions, dtype, inplace):
    torch.manual_seed(hash((is_neox, head_dim, str(positions), str(dtype), inplace)) % 2**31)
    nnz, num_q, num_k = 37, 6, 2
    cache = make_cos_sin_cache(4096, rotary_dim)
    pos = torch.randint(0, 4096, (nnz,))
    q, k, qkv = make_qk(nnz, num_q, num_k, head_dim, dtype, fused=True)
    query, key = q.reshape(nnz, -1), k.reshape(nnz, -1)  # vLLM's [nnz, heads * head_size]: views of qkv
    assert query.data_ptr() == q.data_ptr() and not query.is_contiguous()
    half = rotary_dim // 2
    cos, sin = cache[pos, :half].double(), cache[pos, half:].double()
    q_ref, k_ref = rotate(q, cos, sin, not is_neox), rotate(k, cos, sin, not is_neox)
    args = (pos.to(positions).cuda(), query, key, head_dim, cache.cuda(), is_neox)
    if inplace:
        before = qkv.clone()
        assert aotinfer.apply_rope_with_cos_sin_cache_inplace(*args) is None
        close(q, q_ref, dtype)
        close(k, k_ref, dtype)
        tail = (num_q + num_k) * head_dim
        assert torch.equal(qkv[:, tail:], before[:, tail:])
    else:
        query_out, key_out = aotinfer.apply_rope_with_cos_sin_cache(*args)
        assert query_out.shape == query.shape and key_out.shape == key.shape
        close(query_out.view(nnz, num_q, head_dim), q_ref, dtype)
        close(key_out.view(nnz, num_k, head_dim), k_ref, dtype)
        q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
        rope_module._apply_rope_pos_ids_cos_sin_cache(q_out, k_out, q, k, args[4], args[0], not is_neox, -1)
        close(q_out, q_ref, dtype)
        close(k_out, k_ref, dtype)


@gpu
@pytest.mark.parametrize("nnz, num_q, num_k", [(1, 32, 8), (128, 32, 8), (3000, 64, 8), (70, 1, 0), (70, 0, 1)])
def test_sizes(nnz, num_q, num_k):
    # One token and many heads, many tokens, and a side with no heads (MLA-style k alone).
    q, k, _ = make_qk(nnz, num_q, num_k, 128, torch.bfloat16, fused=False)
    pos = torch.randint(0, 20_000, (nnz,), device="cuda")
    q_rope, k_rope = aotinfer.apply_rope_pos_ids(q, k, pos)
    cos, sin = cos_sin_of(pos, inv_freq(128, 1e4, 1.0))
    close(q_rope, rotate(q, cos, sin, False), torch.bfloat16)
    close(k_rope, rotate(k, cos, sin, False), torch.bfloat16)


@gpu
def test_no_tokens():
    q = torch.empty(0, 4, 64, device="cuda", dtype=torch.float16)
    k = torch.empty(0, 2, 64, device="cuda", dtype=torch.float16)
    q_rope, k_rope = aotinfer.apply_rope_pos_ids(q, k, torch.empty(0, dtype=torch.int32, device="cuda"))
    assert q_rope.shape == q.shape and k_rope.shape == k.shape
    aotinfer.apply_rope_inplace(q, k, torch.zeros(1, dtype=torch.int32, device="cuda"),
                                torch.empty(0, dtype=torch.int32, device="cuda"))


@gpu
def test_cuda_graph_replay():
    nnz = 16
    q, k, _ = make_qk(nnz, 8, 2, 128, torch.float16, fused=False)
    pos = torch.zeros(nnz, dtype=torch.int64, device="cuda")
    q_static, k_static = q.clone(), k.clone()
    aotinfer.apply_rope_pos_ids_inplace(q_static, k_static, pos)  # loads the module outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        aotinfer.apply_rope_pos_ids_inplace(q_static, k_static, pos)
    new_pos = torch.randint(0, 4000, (nnz,), device="cuda")
    pos.copy_(new_pos)
    q_static.copy_(q)
    k_static.copy_(k)
    graph.replay()
    cos, sin = cos_sin_of(new_pos, inv_freq(128, 1e4, 1.0))
    close(q_static, rotate(q, cos, sin, False), torch.float16)
    close(k_static, rotate(k, cos, sin, False), torch.float16)


# ---- argument errors, without a GPU: the binding checks shapes and dtypes before devices ----------


def _h(*shape):
    return torch.empty(*shape, dtype=torch.float16)


def _i(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


Q, K = _h(4, 2, 8), _h(4, 1, 8)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: aotinfer.apply_rope_pos_ids(Q, K, _i(0, 1, 2)), ValueError, r"pos_ids to have shape \[4\]"),
        (lambda: aotinfer.apply_rope_pos_ids(Q, K, _i(0, 1, 2, 3).float()), TypeError, "pos_ids to have dtype int32 or int64"),
        (lambda: aotinfer.apply_rope_pos_ids(Q, K, _i(0, 1, 2, 3), rotary_dim=5), ValueError, "rotary_dim to be even"),
        (lambda: aotinfer.apply_rope_pos_ids(Q, K, _i(0, 1, 2, 3), rotary_dim=10), ValueError, r"rotary_dim to be even and in \[2, 8\]"),
        (lambda: aotinfer.apply_rope_pos_ids(Q, K, _i(0, 1, 2, 3), rotary_dim=2.0), TypeError, "rotary_dim to be an integer"),
        (lambda: aotinfer.apply_rope_pos_ids(Q, K, _i(0, 1, 2, 3), interleave=1), TypeError, "interleave to be a bool"),
        (lambda: aotinfer.apply_rope_pos_ids(Q, K, _i(0, 1, 2, 3), rope_theta=-1.0), ValueError, "rope_theta to be positive"),
        (lambda: aotinfer.apply_rope_pos_ids(Q, K, _i(0, 1, 2, 3), rope_scale="2"), TypeError, "rope_scale to be a real number"),
        (lambda: aotinfer.apply_rope_pos_ids(Q.float(), K, _i(0, 1, 2, 3)), TypeError, "q to have dtype float16 or bfloat16"),
        (lambda: aotinfer.apply_rope_pos_ids(Q, K.bfloat16(), _i(0, 1, 2, 3)), TypeError, "k and q to have the same dtype"),
        (lambda: aotinfer.apply_rope_pos_ids(Q, _h(3, 1, 8), _i(0, 1, 2, 3)), ValueError, r"k to have shape \[4, num_kv_heads, 8\]"),
        (lambda: aotinfer.apply_rope_pos_ids(Q[0], K, _i(0, 1, 2, 3)), ValueError, "q to have 3 dimensions"),
        (lambda: aotinfer.apply_rope_pos_ids(Q.transpose(1, 2), K, _i(0, 1, 2, 3)), ValueError, "last dimension of q to be contiguous"),
        (lambda: aotinfer.apply_rope(Q, K, _i(0, 4), _i(0, 0)), ValueError, r"offsets to have shape \[1\]"),
        (lambda: aotinfer.apply_rope(Q, K, _i(0, 4), _i(0, dtype=torch.int64)), TypeError, "offsets and indptr to have the same dtype"),
        (lambda: aotinfer.apply_rope(Q, K, _i(0, 4).view(1, 2), _i(0)), ValueError, "indptr to have shape"),
        (lambda: aotinfer.apply_llama31_rope(Q, K, _i(0, 4), _i(0), low_freq_factor=4.0, high_freq_factor=1.0), ValueError, "low_freq_factor < high_freq_factor"),
        (lambda: aotinfer.apply_llama31_rope_pos_ids(Q, K, _i(0, 1, 2, 3), old_context_len=0), ValueError, "old_context_len to be positive"),
        (lambda: aotinfer.apply_rope_with_cos_sin_cache(_i(0, 1, 2, 3), _h(4, 16), _h(4, 8), 8, _h(10, 8)), TypeError, "cos_sin_cache to have dtype float32"),
        (lambda: aotinfer.apply_rope_with_cos_sin_cache(_i(0, 1, 2, 3), _h(4, 16), _h(4, 8), 8, torch.empty(10, 12)), ValueError, r"rotary dim \(cos_sin_cache.shape\[1\]\) to be even and in \[2, 8\]"),
        (lambda: aotinfer.apply_rope_with_cos_sin_cache(_i(0, 1, 2, 3), _h(4, 16), _h(4, 8), 3, torch.empty(10, 8)), ValueError, "query to have shape"),
        (lambda: aotinfer.apply_rope_with_cos_sin_cache_inplace(_i(0, 1, 2, 3), _h(4, 16), _h(4, 8), 8, torch.empty(10, 8), is_neox=None), TypeError, "is_neox to be a bool"),
        (lambda: rope_module._apply_rope_pos_ids(_h(4, 2, 8), _h(4, 1, 8), Q, K, _i(0, 1, 2, 3), 8, False, 1.0, 1e4, 2), ValueError, "enable_pdl"),
        (lambda: rope_module._apply_rope_pos_ids(_h(4, 3, 8), _h(4, 1, 8), Q, K, _i(0, 1, 2, 3), 8, False, 1.0, 1e4, -1), ValueError, "q_rope and q to have the same shape"),
        (lambda: rope_module._apply_rope_pos_ids(_h(4, 2, 8), K.bfloat16(), Q, K, _i(0, 1, 2, 3), 8, False, 1.0, 1e4, -1), TypeError, "k_rope and k to have the same dtype"),
        (lambda: rope_module._apply_rope_pos_ids(Q, _h(4, 1, 8), Q, K, _i(0, 1, 2, 3), 8, False, 1.0, 1e4, -1), ValueError, "q to be a CUDA tensor"),
        (lambda: aotinfer.apply_rope_pos_ids(Q, K, _i(0, 1, 2, 3)), ValueError, "q to be a CUDA tensor, got a tensor on cpu"),
    ],
)
def test_argument_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_in_place_needs_same_strides():
    q = _h(4, 2, 8)
    with pytest.raises(ValueError, match="q_rope to be q itself"):
        rope_module._apply_rope_pos_ids(q.as_strided((4, 2, 8), (8, 32, 1)), _h(4, 1, 8), q, K, _i(0, 1, 2, 3), 8,
                                        False, 1.0, 1e4, -1)


# ---- rope_quantize_fp8 / mla_rope_quantize_fp8 ----------------------------------------------------

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def quantize_reference(x, dtype):
    """float32 values to FP8 as the kernel rounds them: to nearest even, saturated."""
    return x.float().clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)


def assert_fp8_close(got, want, exact):
    """Bit for bit where `exact` (one float32 product rounded once); otherwise at most one FP8 step
    apart, on at most 1% of the elements (the float32 rotation may round differently from the
    reference's, which flips an FP8 rounding near a tie)."""
    g, w = got.cpu().view(torch.uint8).int(), want.cpu().view(torch.uint8).int()
    if exact:
        assert torch.equal(g, w)
        return
    same_sign = (g ^ w) < 128
    both_zero = (got.cpu().float() == 0) & (want.float() == 0)
    near = (same_sign & ((g - w).abs() <= 1)) | both_zero
    assert near.all(), f"{int((~near).sum())} elements more than one FP8 step off"
    assert (g != w).float().mean() <= 0.01


@gpu
@pytest.mark.parametrize("out_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "interleave"])
@pytest.mark.parametrize("layout", ["gqa", "mla", "no_nope"])
def test_rope_quantize_fp8(layout, is_neox, dtype, out_dtype):
    torch.manual_seed(hash((layout, is_neox, str(dtype), str(out_dtype))) % 2**31)
    nnz, num_q, num_k = 37, 4, 2
    rope_dim, nope_dim = 64, 512 if layout == "mla" else 128
    # q as DeepSeek splits it: one [nnz, heads, nope + rope] tensor, nope first.
    q = torch.randn(nnz, num_q, nope_dim + rope_dim, device="cuda", dtype=dtype)
    q_nope, q_rope = q[..., :nope_dim], q[..., nope_dim:]
    if layout == "mla":
        k_rope = torch.randn(nnz, rope_dim, device="cuda", dtype=dtype)
        k_nope = torch.randn(nnz, nope_dim, device="cuda", dtype=dtype)
    else:
        k_rope = torch.randn(nnz, num_k, rope_dim, device="cuda", dtype=dtype)
        k_nope = torch.randn(nnz, num_k, nope_dim, device="cuda", dtype=dtype)
    if layout == "no_nope":
        q_nope = k_nope = None
    cache = make_cos_sin_cache(4096, rope_dim)
    pos = torch.randint(0, 4096, (nnz,), device="cuda")
    scale_q, scale_kv = (150.0, 0.5) if out_dtype == torch.float8_e4m3fn else (30000.0, 2.0)  # q saturates in part
    op = aotinfer.mla_rope_quantize_fp8 if layout == "mla" else aotinfer.rope_quantize_fp8
    outs = op(q_rope, k_rope, q_nope, k_nope, cache.cuda(), pos, is_neox=is_neox, quantize_dtype=out_dtype,
              quant_scale_q=scale_q, quant_scale_kv=scale_kv)
    assert all(o.dtype == out_dtype for o in outs)

    half = rope_dim // 2
    cos, sin = cache[pos.cpu(), :half].double(), cache[pos.cpu(), half:].double()
    k3 = k_rope if k_rope.dim() == 3 else k_rope[:, None]
    q_ref = rotate(q_rope, cos, sin, not is_neox) * scale_q
    k_ref = rotate(k3, cos, sin, not is_neox).view(k_rope.shape) * scale_kv
    assert outs[0].shape == q_rope.shape and outs[1].shape == k_rope.shape
    assert_fp8_close(outs[0], quantize_reference(q_ref, out_dtype), exact=False)
    assert_fp8_close(outs[1], quantize_reference(k_ref, out_dtype), exact=False)
    if layout == "no_nope":
        assert outs[2].shape == (nnz, num_q, 0) and outs[3].shape == (nnz, num_k, 0)
    else:
        assert outs[2].shape == q_nope.shape and outs[3].shape == k_nope.shape
        assert_fp8_close(outs[2], quantize_reference(q_nope.cpu().float() * scale_q, out_dtype), exact=True)
        assert_fp8_close(outs[3], quantize_reference(k_nope.cpu().float() * scale_kv, out_dtype), exact=True)


@gpu
def test_rope_quantize_fp8_into_given_outputs():
    nnz = 5
    q_rope = torch.randn(nnz, 2, 64, device="cuda", dtype=torch.bfloat16)
    k_rope = torch.randn(nnz, 1, 64, device="cuda", dtype=torch.bfloat16)
    q_nope = torch.randn(nnz, 2, 64, device="cuda", dtype=torch.bfloat16)
    k_nope = torch.randn(nnz, 1, 64, device="cuda", dtype=torch.bfloat16)
    outs = [torch.full(x.shape, float("nan"), device="cuda").to(torch.float8_e5m2) for x in (q_rope, k_rope, q_nope, k_nope)]
    got = aotinfer.rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, make_cos_sin_cache(16, 64).cuda(),
                                     torch.arange(nnz, device="cuda"), q_rope_out=outs[0], k_rope_out=outs[1],
                                     q_nope_out=outs[2], k_nope_out=outs[3])
    assert all(g is o for g, o in zip(got, outs))  # the dtype came from the outputs: e5m2
    assert not any(o.float().isnan().any() for o in outs)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: aotinfer.rope_quantize_fp8(_h(4, 2, 64), _h(4, 1, 64), None, None, torch.empty(9, 64), _i(0, 1, 2, 3),
                                            quantize_dtype=torch.float16), TypeError, "quantize_dtype to be"),
        (lambda: aotinfer.rope_quantize_fp8(_h(4, 2, 64), _h(4, 1, 32), None, None, torch.empty(9, 64), _i(0, 1, 2, 3)),
         ValueError, "k_rope_in to have rope dim 64"),
        (lambda: aotinfer.rope_quantize_fp8(_h(4, 2, 64), _h(4, 1, 64), None, None, torch.empty(9, 32), _i(0, 1, 2, 3)),
         ValueError, r"cos_sin_cache to have shape \[max_position, 64\]"),
        (lambda: aotinfer.rope_quantize_fp8(_h(4, 2, 64), _h(4, 1, 64), _h(4, 2, 8), _h(4, 1, 16), torch.empty(9, 64),
                                            _i(0, 1, 2, 3)), ValueError, "q_nope_in and k_nope_in"),
        (lambda: aotinfer.rope_quantize_fp8(_h(4, 2, 40), _h(4, 1, 40), None, None, torch.empty(9, 40), _i(0, 1, 2, 3)),
         ValueError, "rope dim 40 to be a multiple of 16"),
        (lambda: aotinfer.rope_quantize_fp8(_h(4, 2, 64), _h(4, 1, 64), None, None, torch.empty(9, 64), _i(0, 1, 2),
                                            ), ValueError, r"pos_ids to have shape \[4\]"),
        (lambda: aotinfer.rope_quantize_fp8(_h(4, 2, 64), _h(4, 1, 64), None, None, torch.empty(9, 64), _i(0, 1, 2, 3),
                                            q_rope_out=_h(4, 2, 64)), TypeError, "q_rope_out to have dtype float8_e4m3fn"),
        (lambda: aotinfer.rope_quantize_fp8(_h(4, 2, 64), _h(4, 1, 64), None, None, torch.empty(9, 64), _i(0, 1, 2, 3),
                                            backend="cutile"), ValueError, "backend to be 'cuda'"),
        (lambda: aotinfer.mla_rope_quantize_fp8(_h(4, 2, 64), _h(4, 64), _h(4, 2, 512), _h(4, 512), torch.empty(9, 64),
                                                _i(0, 1, 2, 3)), ValueError, "q_rope_in to be a CUDA tensor"),
    ],
)
def test_rope_quantize_argument_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()
