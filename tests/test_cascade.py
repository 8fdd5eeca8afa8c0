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


# ---- MultiLevelCascadeAttentionWrapper -----------------------------------------------------------


def cascade_case(levels, q_lens, page_size=16, heads=(16, 4, 128), dtype=torch.float16, layout="NHD"):
    """A cache of scattered pages and the page tables of a cascade: ``levels[l]`` lists level l's
    segments as (first request, last request + 1, keys); every request's keys are its segments'
    keys, level by level. Returns the plan's lists, q, the cache and each request's K and V."""
    num_qo, num_kv, dim = heads
    q_rows = [0] + torch.tensor(q_lens).cumsum(0).tolist()
    pages_of = [[-(-n // page_size) for _, _, n in segments] for segments in levels]
    pool = sum(map(sum, pages_of)) + 3
    order = torch.randperm(pool).to(torch.int32)
    shape = (pool, page_size, num_kv, dim) if layout == "NHD" else (pool, num_kv, page_size, dim)
    k, v = (torch.randn(shape, device="cuda").to(dtype) for _ in range(2))
    plan = ([], [], [], [])
    keys = [[] for _ in q_lens]
    values = [[] for _ in q_lens]
    used = 0
    for segments, pages in zip(levels, pages_of):
        qo, kv_indptr, indices, last = [0], [0], [], []
        for (first, end, n), p in zip(segments, pages):
            ids = order[used : used + p]
            used += p
            qo.append(q_rows[end])
            kv_indptr.append(kv_indptr[-1] + p)
            indices.append(ids)
            last.append(n - (p - 1) * page_size if p else 0)
            for cache, out in ((k, keys), (v, values)):
                rows = cache[ids.long()] if layout == "NHD" else cache[ids.long()].transpose(1, 2)
                for r in range(first, end):
                    out[r].append(rows.reshape(-1, num_kv, dim)[:n])
        assert qo[-1] == q_rows[-1] and [s[0] for s in segments] == [q_rows.index(x) for x in qo[:-1]]
        for lst, values_ in zip(plan, (qo, kv_indptr, torch.cat(indices), last)):
            lst.append(torch.as_tensor(values_, dtype=torch.int32, device="cuda"))
    q = torch.randn(q_rows[-1], num_qo, dim, device="cuda").to(dtype)
    return plan, q, (k, v), [torch.cat(x) for x in keys], [torch.cat(x) for x in values], q_rows


def cascade_reference(q, keys, values, q_rows, unique_lens, causal):
    """float32 attention of each request's queries over all its keys; causal over its last
    level's keys (the query at the end of the keys, as the paged prefill aligns them)."""
    out = torch.empty(q.shape, device=q.device)
    for b, (k, v) in enumerate(zip(keys, values)):
        rows = q[q_rows[b] : q_rows[b + 1]].float()
        group = rows.shape[1] // k.shape[1]
        kk, vv = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
        logits = torch.einsum("qhd,khd->hqk", rows, kk) / math.sqrt(q.shape[-1])
        if causal:
            n, q_len, shared = k.shape[0], rows.shape[0], k.shape[0] - unique_lens[b]
            for j in range(q_len):  # unique key u is seen by query j when u <= unique - q_len + j
                logits[:, j, shared + unique_lens[b] - q_len + j + 1 : n] = float("-inf")
        out[q_rows[b] : q_rows[b + 1]] = torch.einsum("hqk,khd->qhd", logits.softmax(-1), vv)
    return out


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("num_levels", [1, 2, 3])
def test_multi_level_cascade(num_levels, causal):
    q_lens = [1, 3, 1, 5]  # decode steps and short appends
    unique = [20, 40, 1, 70]
    levels = [[(0, 4, 37)], [(0, 2, 50), (2, 4, 16)]][: num_levels - 1] + [[(b, b + 1, n) for b, n in enumerate(unique)]]
    plan, q, cache, keys, values, q_rows = cascade_case(levels, q_lens)
    wrapper = aotinfer.MultiLevelCascadeAttentionWrapper(num_levels, torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    wrapper.plan(*plan, 16, 4, 128, 16, causal=causal, q_data_type=torch.float16)
    want = cascade_reference(q, keys, values, q_rows, unique, causal)
    for run in (wrapper.run, wrapper.forward):  # one plan, every layer
        out = run(q, cache)
        assert out.shape == q.shape and out.dtype == q.dtype
        torch.testing.assert_close(out.float(), want, rtol=5e-3, atol=5e-3)


def test_multi_level_cascade_arguments():
    workspace = torch.empty(1 << 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="Expected num_levels to be at least 1, got 0"):
        aotinfer.MultiLevelCascadeAttentionWrapper(0, workspace)
    with pytest.raises(ValueError, match="Expected qo_indptr_buf_arr to be a list of num_levels = 2 entries, got NoneType"):
        aotinfer.MultiLevelCascadeAttentionWrapper(2, workspace, use_cuda_graph=True)
    wrapper = aotinfer.MultiLevelCascadeAttentionWrapper(2, workspace)
    one = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="Expected paged_kv_indices_arr to be a list of num_levels = 2 entries, got a list of 1"):
        wrapper.plan([one, one], [one, one], [one], [one, one], 8, 8, 64, 16)
    assert not wrapper.is_cuda_graph_enabled
