"""Merging attention states (aotinfer.cascade) against a float32 reference, states of empty segments
(-inf) included; argument errors and the trace templates' references on the CPU."""

import math

import pytest
import torch

import aotinfer
from aotinfer.trace.templates import cascade as templates

gpu = pytest.mark.gpu
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}
LSE_TOLERANCE = 1e-5


def reference(vs, ss):
    """The merge of states ``vs[i]`` ([seq, heads, dim]) with base-2 log-sum-exps ``ss[i]``
    ([seq, heads]): (v, s) in float32; no state, or only -inf ones, gives zeros and -inf."""
    if not vs:
        raise ValueError("reference needs a state; the zero-state case is checked directly")
    s = torch.stack([x.double() * math.log(2) for x in ss])  # [states, seq, heads]
    total = torch.logsumexp(s, 0)
    weights = torch.where(torch.isinf(total), 0.0, torch.exp(s - total))
    v = (weights[..., None] * torch.stack([x.double() for x in vs])).sum(0)
    return v.float(), (total / math.log(2)).float()


def states(seq_len, num_heads, head_dim, dtype, strided=False, count=2):
    """``count`` random states; row 1 of the first is empty (-inf), row 2 of all of them; with
    ``strided``, v is a view with strides of its own (last dimension contiguous)."""
    vs, ss = [], []
    for i in range(count):
        if strided:  # v: rows of a wider tensor (s stays contiguous, as attention writes it)
            v = torch.randn(seq_len, num_heads + 2, head_dim + 8, device="cuda").to(dtype)[:, 1:-1, :head_dim]
            assert not v.is_contiguous()
        else:
            v = torch.randn(seq_len, num_heads, head_dim, device="cuda").to(dtype)
        s = torch.randn(seq_len, num_heads, device="cuda") * 4
        if seq_len > 2:
            s[2] = float("-inf")
            if i == 0:
                s[1] = float("-inf")
        vs.append(v)
        ss.append(s)
    return vs, ss


def check(v, s, want_v, want_s, dtype):
    assert not v.isnan().any() and not s.isnan().any()
    torch.testing.assert_close(v.float(), want_v, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    torch.testing.assert_close(s, want_s, rtol=LSE_TOLERANCE, atol=LSE_TOLERANCE)


@gpu
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_state(dtype, head_dim, strided):
    (v_a, v_b), (s_a, s_b) = states(37, 8, head_dim, dtype, strided)
    want_v, want_s = reference([v_a, v_b], [s_a, s_b])
    v, s = aotinfer.merge_state(v_a, s_a, v_b, s_b)
    assert v.shape == v_a.shape and v.dtype == dtype and s.shape == s_a.shape and s.dtype == torch.float32
    check(v, s, want_v, want_s, dtype)
    assert torch.equal(v[2], torch.zeros_like(v[2])) and bool((s[2] == float("-inf")).all())


@gpu
@pytest.mark.parametrize("mask", ["none", "mask"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_state_in_place(dtype, strided, mask):
    (v, v_other), (s, s_other) = states(29, 4, 128, dtype, strided)
    keep = torch.rand(29, device="cuda") < 0.5 if mask == "mask" else None
    want_v, want_s = reference([v, v_other], [s, s_other])
    if keep is not None:
        want_v = torch.where(keep[:, None, None], want_v, v.float())
        want_s = torch.where(keep[:, None], want_s, s)
    assert aotinfer.merge_state_in_place(v, s, v_other, s_other, keep) is None
    check(v, s, want_v, want_s, dtype)


@gpu
@pytest.mark.parametrize("num_states", [1, 2, 7])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_states(dtype, head_dim, num_states):
    vs, ss = states(19, 8, head_dim, dtype, count=num_states)
    want_v, want_s = reference(vs, ss)
    v, s = aotinfer.merge_states(torch.stack(vs, 1), torch.stack(ss, 1))
    assert v.shape == (19, 8, head_dim) and s.shape == (19, 8) and v.dtype == dtype
    check(v, s, want_v, want_s, dtype)


@gpu
def test_merge_states_of_none_and_of_an_empty_batch():
    v, s = aotinfer.merge_states(torch.randn(5, 0, 4, 64, device="cuda").half(), torch.randn(5, 0, 4, device="cuda"))
    assert torch.equal(v, torch.zeros_like(v)) and bool((s == float("-inf")).all())
    v, s = aotinfer.merge_state(*(torch.randn(0, 4, 64, device="cuda").half(), torch.randn(0, 4, device="cuda")) * 2)
    assert v.shape == (0, 4, 64) and s.shape == (0, 4)


@gpu
def test_merge_state_converts_lse_to_float32():
    # FlashInfer converts s to float32; so does aotinfer (merge_state and merge_states).
    (v_a, v_b), (s_a, s_b) = states(16, 4, 64, torch.bfloat16)
    s_a, s_b = s_a.half(), s_b.half()
    want_v, want_s = reference([v_a, v_b], [s_a.float(), s_b.float()])
    v, s = aotinfer.merge_state(v_a, s_a, v_b, s_b)
    check(v, s, want_v, want_s, torch.bfloat16)


# ---- CPU ----------------------------------------------------------------------------------------


def test_errors():
    v, s = torch.randn(3, 4, 64), torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"Expected v to have 4 dimensions \[seq_len, num_states, num_heads, head_dim\], got shape \[3, 4, 64\]"):
        aotinfer.merge_states(v, s)
    with pytest.raises(TypeError, match="Expected s_b to be a torch.Tensor, got list"):
        aotinfer.merge_state(v, s, v, [1.0])
    with pytest.raises(TypeError, match="Expected s_other to be a torch.Tensor, got list"):
        aotinfer.merge_state_in_place(v, s, v, [1.0])  # named by the binding's schema
    for call in (
        lambda: aotinfer.merge_state(v, s, v, s),
        lambda: aotinfer.merge_state_in_place(v, s, v, s),
        lambda: aotinfer.merge_states(v[:, None], s[:, None]),
    ):
        with pytest.raises(ValueError, match="to be a CUDA tensor, got a tensor on cpu"):
            call()


def test_template_references_agree_with_the_tests():
    torch.manual_seed(0)
    v = torch.randn(5, 3, 2, 8)
    s = torch.randn(5, 3, 2) * 3
    s[1, :] = float("-inf")  # a row of empty segments
    s[2, 0] = float("-inf")
    want_v, want_s = reference(list(v.unbind(1)), list(s.unbind(1)))
    got_v, got_s = templates._merge_states_reference(v, s)
    torch.testing.assert_close(got_v, want_v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_s, want_s, rtol=1e-5, atol=1e-5)
    want_v, want_s = reference([v[:, 0], v[:, 1]], [s[:, 0], s[:, 1]])
    got_v, got_s = templates._merge_state_reference(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    torch.testing.assert_close(got_v, want_v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_s, want_s, rtol=1e-5, atol=1e-5)
    mask = torch.tensor([True, False, True, True, False])
    got_v, got_s = templates._merge_state_in_place_reference(v[:, 0], s[:, 0], v[:, 1], s[:, 1], mask)
    torch.testing.assert_close(got_v, torch.where(mask[:, None, None], want_v, v[:, 0]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_s, torch.where(mask[:, None], want_s, s[:, 0]), rtol=1e-5, atol=1e-5)
    v, s = templates._merge_states_reference(torch.randn(4, 0, 2, 8), torch.randn(4, 0, 2))
    assert torch.equal(v, torch.zeros(4, 2, 8)) and bool((s == float("-inf")).all())
