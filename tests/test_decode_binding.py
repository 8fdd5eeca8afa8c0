"""The batch_decode binding against a float32 reference, with work partitions written by hand: one
item per request, sequences split over items (merged), idle items, soft cap, window, sinks, fp8."""

import math

import pytest
import torch

from aotinfer import _loader

pytestmark = pytest.mark.gpu


def binding(name, module="decode"):
    return getattr(_loader.get_module(module, torch.cuda.current_device()), name)


def make(batch, lens, qo_heads, kv_heads, head_dim, page_size, dtype, kv_dtype, layout):
    pages_each = [max(1, math.ceil(n / page_size)) if n else 0 for n in lens]
    pool = 2 * sum(pages_each) + 3
    shape = (pool, page_size, kv_heads, head_dim) if layout == 0 else (pool, kv_heads, page_size, head_dim)
    k = torch.randn(shape, device="cuda").to(kv_dtype)
    v = torch.randn(shape, device="cuda").to(kv_dtype)
    indices = torch.randperm(pool, device="cuda")[: sum(pages_each)].int()
    page_begin = [0]
    for p in pages_each:
        page_begin.append(page_begin[-1] + p)
    q = torch.randn(batch, qo_heads, head_dim, device="cuda", dtype=dtype)
    return q, k, v, indices, page_begin


def reference(q, k, v, indices, page_begin, lens, layout, sm_scale, cap, window, sinks, k_scale, v_scale):
    batch, qo_heads, d = q.shape
    kv_heads = k.shape[2] if layout == 0 else k.shape[1]
    group = qo_heads // kv_heads
    out = torch.zeros(batch, qo_heads, d, device="cuda")
    lse = torch.full((batch, qo_heads), -math.inf, device="cuda")
    for b, n in enumerate(lens):
        pages = indices[page_begin[b] : page_begin[b + 1]].long()
        kk, vv = k[pages].float(), v[pages].float()
        if layout == 1:
            kk, vv = kk.transpose(1, 2), vv.transpose(1, 2)
        kk, vv = kk.flatten(0, 1)[:n] * k_scale, vv.flatten(0, 1)[:n] * v_scale
        start = max(0, n - 1 - window) if window >= 0 else 0
        kk, vv = kk[start:], vv[start:]
        if kk.shape[0] == 0 and sinks is None:
            continue
        kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)
        s = torch.einsum("hd,nhd->hn", q[b].float(), kk) * sm_scale
        if cap > 0:
            s = cap * torch.tanh(s / cap)
        if sinks is not None:
            s = torch.cat([s, sinks[:, None]], 1)
        p = s.softmax(-1)
        lse[b] = torch.logsumexp(s, -1) / math.log(2)
        out[b] = torch.einsum("hn,nhd->hd", p[:, : kk.shape[0]], vv)
    return out, lse


def plan(lens, page_begin, chunk, capacity=None):
    work, requests, slot = [], [], 0
    for b, n in enumerate(lens):
        chunks = max(1, math.ceil(n / chunk))
        first = slot
        for c in range(chunks):
            work.append((b, c * chunk, min(n, (c + 1) * chunk), -1 if chunks == 1 else slot))
            slot += chunks > 1
        requests.append((page_begin[b], n, first, chunks if chunks > 1 else 0))
    while capacity and len(work) < capacity:
        work.append((-1, 0, 0, 0))
    as_gpu = lambda rows: torch.tensor(rows, dtype=torch.int32, device="cuda").reshape(-1, 4)  # noqa: E731
    return as_gpu(work), as_gpu(requests), slot



CASES = [
    # head_dim, qo, kv, page, dtype, kv dtype, layout, lens, chunk
    (128, 32, 8, 16, torch.bfloat16, torch.bfloat16, 0, [1, 17, 300, 1024, 0], 1 << 30),
    (128, 32, 8, 16, torch.float16, torch.float16, 1, [1, 17, 300, 1024, 0], 128),
    (64, 8, 8, 1, torch.bfloat16, torch.bfloat16, 0, [5, 129, 700], 64),
    (256, 16, 2, 64, torch.float16, torch.float16, 0, [63, 64, 65, 2000], 256),
    (128, 64, 2, 16, torch.bfloat16, torch.bfloat16, 1, [33, 1000], 192),  # group 32: two row blocks
    (128, 32, 8, 16, torch.bfloat16, torch.float8_e4m3fn, 0, [1, 300, 1500], 512),
    (64, 12, 2, 16, torch.float16, torch.float8_e5m2, 1, [100, 40], 1 << 30),  # group 6
    (256, 8, 8, 16, torch.bfloat16, torch.float8_e4m3fn, 0, [257, 3], 128),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("options", ["plain", "cap-window-sinks", "idle", "read-once"])
def test_batch_decode(case, options):
    torch.manual_seed(0)
    d, qo, kv, page, dtype, kv_dtype, layout, lens, chunk = case
    q, k, v, indices, page_begin = make(len(lens), lens, qo, kv, d, page, dtype, kv_dtype, layout)
    fp8 = kv_dtype.itemsize == 1
    k_scale, v_scale = (0.5, 1.5) if fp8 else (1.0, 1.0)
    cap, window, sinks = (30.0, 77, torch.randn(qo, device="cuda")) if options == "cap-window-sinks" else (0.0, -1, None)
    work, requests, slots = plan(lens, page_begin, chunk, capacity=len(lens) * 40 if options == "idle" else None)
    sm_scale = 1 / math.sqrt(d)
    out = torch.full_like(q, math.nan)
    lse = torch.full((len(lens), qo), math.nan, device="cuda")
    partial_out = torch.full((slots, qo, d), math.nan, device="cuda")
    partial_lse = torch.full((slots, qo), math.nan, device="cuda")
    empty = torch.empty(0, device="cuda")
    counters = torch.zeros(len(lens) * kv * -(-qo // kv // 16), dtype=torch.int32, device="cuda")
    most_parts = int(requests[:, 3].max())
    binding("batch_decode")(out, lse, partial_out, partial_lse, q, k, v, indices, work, requests, counters,
                            empty if sinks is None else sinks, 0, layout, sm_scale * k_scale, cap, window, 0, 1.0, 1e4, v_scale,
                            most_parts, int(options == "read-once"), -1)
    # Every merge in the launch (requests of few items) zeroed its counter again.
    assert not counters.any()
    want, want_lse = reference(q, k, v, indices, page_begin, lens, layout, sm_scale, cap, window, sinks, k_scale, v_scale)
    assert not out.isnan().any() and not lse.isnan().any()
    tol = 3e-2 if fp8 or dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, want_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_merge_states(dtype):
    seq, states, heads, d = 37, 3, 5, 96
    v = torch.randn(seq, states, heads, d, device="cuda").to(dtype)
    s = torch.randn(seq, states, heads, device="cuda") * 4
    s[0, :, 0] = -math.inf  # all empty: zeros and -inf
    out = torch.full((seq, heads, d), math.nan, device="cuda").to(dtype)
    s_out = torch.full((seq, heads), math.nan, device="cuda")
    binding("merge_states", "cascade")(out, s_out, v, s, -1)
    w = torch.softmax(s * math.log(2), 1).nan_to_num(0.0)
    want = (w[..., None] * v.float()).sum(1)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    want_s = torch.logsumexp(s * math.log(2), 1) / math.log(2)
    torch.testing.assert_close(s_out, want_s)
    a, sa, b, sb = v[:, 0].contiguous(), s[:, 0].contiguous(), v[:, 1].contiguous(), s[:, 1].contiguous()
    out2, s2 = torch.empty_like(a), torch.empty_like(sa)
    binding("merge_state", "cascade")(out2, s2, a, sa, b, sb, -1)
    two = merge_ref(a, sa, b, sb)
    torch.testing.assert_close(out2.float(), two[0], rtol=2e-2, atol=2e-2)
    mask = torch.rand(seq, device="cuda") > 0.5
    binding("merge_state_in_place", "cascade")(a, sa, b, sb, mask, -1)
    torch.testing.assert_close(a[mask].float(), two[0][mask], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(a[~mask], v[:, 0][~mask])


def merge_ref(a, sa, b, sb):
    s = torch.stack([sa, sb], 1) * math.log(2)
    w = torch.softmax(s, 1).nan_to_num(0.0)
    return (w[..., None] * torch.stack([a, b], 1).float()).sum(1), torch.logsumexp(s, 1) / math.log(2)
