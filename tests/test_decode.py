"""Paged decode attention (aotinfer.decode) against a float32 reference: the wrapper's plan and run,
single_decode_with_kv_cache, CUDA graphs, determinism; on the CPU, the plan's work partition, the
plan driving a float32 model of the kernel's contract, and argument errors."""

import functools
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import aotinfer
from aotinfer import _attention, decode

gpu = pytest.mark.gpu
LN2 = math.log(2.0)
# Output against the float32 reference, by the dtype of q (and out); log-sum-exp (float32) of
# logits computed in float32 from the same inputs.
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 2e-2}
LSE_TOLERANCE = 4e-3
HEADS = [  # (num_qo_heads, num_kv_heads, head_dim): group sizes 1, 4, 8 and 6, every head_dim
    (8, 8, 128),
    (16, 4, 64),
    (32, 4, 128),
    (12, 2, 128),
    (4, 4, 256),
    (32, 8, 256),
]
HEAD_IDS = [f"h{h}kv{kv}d{d}" for h, kv, d in HEADS]


def lengths_for(page_size):
    """Ragged lengths: empty, one token, a last page of 1 and of page_size tokens, sequences long
    enough to be split (batch 8 leaves the GPU idle)."""
    return [1, page_size, 0, page_size + 1, 5 * page_size - 1, 300, 2 * page_size, 1031]


# ---- inputs ------------------------------------------------------------------------------------


def page_table(lengths, page_size, extra_pages=5):
    """int32 (indptr, indices, last_page_len) on the CPU for requests of ``lengths`` tokens, their
    pages scattered over a pool of ``pages + extra_pages``; and the pool size."""
    pages = [-(-n // page_size) for n in lengths]
    pool = sum(pages) + extra_pages
    indices = torch.randperm(pool)[: sum(pages)].to(torch.int32)
    indptr = torch.tensor([0] + pages, dtype=torch.int64).cumsum(0).to(torch.int32)
    last = [n - (p - 1) * page_size if p else 0 for n, p in zip(lengths, pages)]
    return indptr, indices, torch.tensor(last, dtype=torch.int32), pool


def kv_pool(pool, page_size, num_kv_heads, head_dim, dtype, layout, form, device):
    """A KV cache of ``pool`` pages in one of the forms run takes, and its K and V as 4-D views.

    form: "tuple" (k, v), 3-D when page_size is 1 (SGLang's token pools); "5d" one tensor
    [pages, 2, ...], 4-D when page_size is 1."""
    page = [page_size, num_kv_heads, head_dim] if layout == "NHD" else [num_kv_heads, page_size, head_dim]

    def randn(*shape):
        return torch.randn(*shape, device=device).to(dtype)

    if form == "tuple":
        k, v = randn(pool, *page), randn(pool, *page)
        cache = (k, v) if page_size > 1 else (k.squeeze(1 if layout == "NHD" else 2), v.squeeze(1 if layout == "NHD" else 2))
    else:
        both = randn(pool, 2, *page)
        k, v = both[:, 0], both[:, 1]
        cache = both if page_size > 1 else both.squeeze(2 if layout == "NHD" else 3)
    return cache, k, v


def gather(k, v, indptr, indices, last_page_len, layout):
    """Each request's keys and values, [kv_len, num_kv_heads, head_dim], from 4-D K and V."""
    page_size = k.shape[1] if layout == "NHD" else k.shape[2]
    keys, values = [], []
    for b in range(last_page_len.numel()):
        pages = indices[indptr[b] : indptr[b + 1]].long().to(k.device)
        length = max(pages.numel() - 1, 0) * page_size + int(last_page_len[b])
        for cache, out in ((k, keys), (v, values)):
            bytes_ = cache.view(torch.uint8) if cache.element_size() == 1 else cache  # fp8: indexed as bytes
            rows = bytes_[pages] if layout == "NHD" else bytes_[pages].transpose(1, 2)
            rows = rows.reshape(-1, cache.shape[2] if layout == "NHD" else cache.shape[1], cache.shape[-1])[:length]
            out.append(rows.view(cache.dtype))
    return keys, values


def reference(q, keys, values, sm_scale, soft_cap=0.0, window_left=-1, sinks=None, v_scale=1.0, rope=None):
    """float32 decode attention: (out [batch, heads, dim], lse [batch, heads] base 2); ``rope``:
    (rope_scale, rope_theta) of ROPE_LLAMA, q at position kv_len - 1 and the keys at theirs, each
    turned in float32 and rounded to its dtype (where the kernel keeps it, as FlashInfer's does)."""
    batch, num_heads, head_dim = q.shape
    out = torch.zeros(batch, num_heads, head_dim, device=q.device)
    lse = torch.empty(batch, num_heads, device=q.device)
    for b in range(batch):
        k, v, query = keys[b].float(), values[b].float(), q[b].float()
        if rope is not None:
            k = rope_llama(k.cpu(), torch.arange(k.shape[0]), *rope).to(keys[b].dtype).float().to(q.device)
            query = rope_llama(query[None].cpu(), [k.shape[0] - 1], *rope)[0].to(q.dtype).float().to(q.device)
        group = num_heads // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        logits = torch.einsum("hd,nhd->hn", query, k) * sm_scale
        if soft_cap:
            logits = soft_cap * torch.tanh(logits / soft_cap)
        if window_left >= 0:
            logits[:, : max(k.shape[0] - 1 - window_left, 0)] = float("-inf")
        terms = logits if sinks is None else torch.cat([logits, sinks.float()[:, None]], 1)
        total = torch.logsumexp(terms, -1)  # -inf with no keys and no sink
        probs = torch.exp(logits - total[:, None])
        out[b] = torch.einsum("hn,nhd->hd", probs, v) * v_scale
        lse[b] = total / LN2
    return out, lse


def check(out, want, dtype, lse=None, want_lse=None):
    assert not out.isnan().any(), "some outputs were not written"
    torch.testing.assert_close(out.float(), want.to(out.device), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    if lse is not None:
        assert not lse.isnan().any(), "some log-sum-exps were not written"
        torch.testing.assert_close(lse, want_lse.to(lse.device), rtol=LSE_TOLERANCE, atol=LSE_TOLERANCE)


def workspace(device, nbytes=128 << 20):
    # NaN everywhere: a partial result read before it is written shows.
    return torch.full((nbytes // 4,), float("nan"), dtype=torch.float32, device=device)


def poisoned(shape, dtype, device="cuda"):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


class Case:
    """One batch: page table, cache, queries and the reference inputs."""

    def __init__(self, lengths, page_size, heads, dtype, layout="NHD", form="tuple", kv_dtype=None, device="cuda"):
        self.num_qo_heads, self.num_kv_heads, self.head_dim = heads
        self.page_size, self.layout, self.dtype = page_size, layout, dtype
        self.indptr, self.indices, self.last_page_len, pool = page_table(lengths, page_size)
        self.cache, k, v = kv_pool(pool, page_size, self.num_kv_heads, self.head_dim, kv_dtype or dtype, layout, form, device)
        self.q = torch.randn(len(lengths), self.num_qo_heads, self.head_dim, device=device).to(dtype)
        self.keys, self.values = gather(k, v, self.indptr, self.indices, self.last_page_len, layout)
        self.kv_dtype = kv_dtype or dtype

    def plan(self, wrapper, **options):
        wrapper.plan(
            self.indptr.to(wrapper.device), self.indices.to(wrapper.device), self.last_page_len.to(wrapper.device),
            self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
            q_data_type=self.dtype, kv_data_type=self.kv_dtype, **options,
        )  # fmt: skip

    def reference(self, **options):
        options.setdefault("sm_scale", 1 / math.sqrt(self.head_dim))
        return reference(self.q, self.keys, self.values, **options)


# ---- the batched wrapper on a GPU ---------------------------------------------------------------


@gpu
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("form", ["tuple", "5d"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_batch_decode(layout, form, page_size, dtype, heads):
    case = Case(lengths_for(page_size), page_size, heads, dtype, layout, form)
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cuda"), layout)
    case.plan(wrapper)
    assert wrapper._plan.partition.num_slots > 0, "the case should split some sequence"
    want, want_lse = case.reference()
    out, lse = poisoned(case.q.shape, dtype), poisoned(case.q.shape[:2], torch.float32)
    result = wrapper.run(case.q, case.cache, out=out, lse=lse, return_lse=True)
    assert result[0] is out and result[1] is lse
    check(out, want, dtype, lse, want_lse)
    check(wrapper.run(case.q, case.cache), want, dtype)  # no lse: the kernel's other path
    out2, lse2 = wrapper.run_return_lse(case.q, case.cache)
    check(out2, want, dtype, lse2, want_lse)


OPTIONS = {
    "soft_cap": (dict(logits_soft_cap=2.0), {}, dict(soft_cap=2.0)),
    "window": (dict(window_left=40), {}, dict(window_left=40)),
    "window_narrowed_by_run": (dict(window_left=200), dict(window_left=7), dict(window_left=7)),
    "sinks": (None, "sinks", "sinks"),
    "sm_scale": (dict(sm_scale=0.3), {}, dict(sm_scale=0.3)),
    "scales": ({}, dict(q_scale=0.8, k_scale=0.6, v_scale=1.7), dict(sm_scale=0.48 / math.sqrt(128), v_scale=1.7)),
    "all": (dict(logits_soft_cap=3.0, window_left=100, sm_scale=0.2), "sinks+scales", dict(soft_cap=3.0, window_left=100)),
}


@gpu
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_attention_options(layout, dtype, page_size, option):
    case = Case(lengths_for(page_size), page_size, (16, 4, 128), dtype, layout)
    plan_options, run_options, reference_options = (dict(o) if isinstance(o, dict) else o for o in OPTIONS[option])
    sinks = torch.randn(16, device="cuda") * 2
    if run_options == "sinks":
        plan_options, run_options, reference_options = {}, dict(sinks=sinks), dict(sinks=sinks)
    elif run_options == "sinks+scales":
        run_options = dict(sinks=sinks, q_scale=0.8, k_scale=0.6, v_scale=1.7)
        reference_options.update(sinks=sinks, sm_scale=0.2 * 0.48, v_scale=1.7)
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cuda"), layout)
    case.plan(wrapper, **plan_options)
    want, want_lse = case.reference(**reference_options)
    out, lse = wrapper.run(case.q, case.cache, return_lse=True, **run_options)
    check(out, want, dtype, lse, want_lse)


@gpu
@pytest.mark.parametrize("rope", [(None, None), (2.0, 5e5)], ids=["default", "scaled"])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_rope_llama(layout, page_size, dtype, heads, rope):
    """q (at kv_len - 1) and the keys turned inside the kernel, against attention over them turned
    in float32; split requests too (their items turn keys from other positions)."""
    case = Case(lengths_for(page_size), page_size, heads, dtype, layout)
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cuda"), layout)
    case.plan(wrapper, pos_encoding_mode="ROPE_LLAMA", rope_scale=rope[0], rope_theta=rope[1])
    assert wrapper._plan.partition.num_slots > 0, "the case should split some sequence"
    want, want_lse = case.reference(rope=(rope[0] or 1.0, rope[1] or 1e4))
    out, lse = wrapper.run(case.q, case.cache, out=poisoned(case.q.shape, dtype), return_lse=True)
    check(out, want, dtype, lse, want_lse)


@gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_single_decode_rope_llama(head_dim):
    q = torch.randn(16, head_dim, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(3000, 4, head_dim, device="cuda", dtype=torch.float16) for _ in range(2))
    out = aotinfer.single_decode_with_kv_cache(q, k, v, pos_encoding_mode="ROPE_LLAMA", window_left=2000)
    want, _ = reference(q[None], [k], [v], 1 / math.sqrt(head_dim), window_left=2000, rope=(1.0, 1e4))
    check(out[None], want, torch.float16)


@gpu
@pytest.mark.parametrize("q_len", [1, 4])
def test_rope_llama_on_tensor_cores_and_several_tokens(q_len):
    """use_tensor_cores with q_len_per_req: the prefill kernel's RoPE, each query token at its own
    position among the request's last ones."""
    import test_prefill

    lengths = [9, 300, 1031, 4096]
    case, q, _, _ = several_tokens_case(lengths, q_len, (32, 8, 128), torch.bfloat16, "cuda")
    qo_indptr = torch.arange(len(lengths) + 1) * q_len
    want, want_lse = test_prefill.reference(q, qo_indptr, case.keys, case.values, 1 / math.sqrt(128), causal=True,
                                            rope=(1.0, 1e4))  # fmt: skip
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cuda"), "NHD", use_tensor_cores=True)
    wrapper.plan(case.indptr.cuda(), case.indices.cuda(), case.last_page_len.cuda(), 32, 8, 128, 16,
                 q_data_type=torch.bfloat16, q_len_per_req=q_len, pos_encoding_mode="ROPE_LLAMA")  # fmt: skip
    out, lse = wrapper.run(q, case.cache, out=poisoned(q.shape, torch.bfloat16), return_lse=True)
    check(out, want, torch.bfloat16, lse, want_lse)


def test_rope_llama_drives_the_kernel_contract(kernel_model):
    """plan's ROPE_LLAMA reaches the binding (its model turns q and k as the kernel does); forward
    replaces it."""
    torch.manual_seed(0)
    case = Case([40, 3, 129], 16, (8, 2, 64), torch.float16, device="cpu")
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cpu"), "NHD")
    case.plan(wrapper, pos_encoding_mode="ROPE_LLAMA", rope_theta=5e5)
    want, want_lse = case.reference(rope=(1.0, 5e5))
    out, lse = wrapper.run(case.q, case.cache, return_lse=True)
    check(out, want, torch.float16, lse, want_lse)
    check(wrapper.forward(case.q, case.cache), case.reference()[0], torch.float16)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("heads", [(16, 4), (8, 8), (40, 2)], ids=["group4", "group1", "group20"])
def test_fp8_kv_cache(heads, layout, kv_dtype, head_dim, dtype):
    case = Case(lengths_for(16), 16, (*heads, head_dim), dtype, layout, kv_dtype=kv_dtype)
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cuda"), layout)
    case.plan(wrapper)
    scales = dict(q_scale=0.9, k_scale=0.7, v_scale=1.3)
    want, want_lse = case.reference(sm_scale=0.9 * 0.7 / math.sqrt(head_dim), v_scale=1.3)
    out, lse = wrapper.run(case.q, case.cache, return_lse=True, **scales)
    check(out, want, dtype, lse, want_lse)


@gpu
@pytest.mark.parametrize("batch", [8, 64, 200])
def test_fp8_kv_cache_every_grid_size(batch):
    # fp8 at head_dim 128 launches a 3-blocks-an-SM form or a 2-blocks-an-SM one by the grid's size
    # (on a 132-SM GPU: batch 8 and 200 the first, 64 x 8 KV heads = 512 blocks the second).
    lengths = torch.randint(1, 400, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
    case = Case(lengths, 16, (32, 8, 128), torch.bfloat16, "NHD", kv_dtype=torch.float8_e4m3fn)
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cuda"), "NHD")
    case.plan(wrapper)
    want, want_lse = case.reference(sm_scale=0.6 / math.sqrt(128), v_scale=1.5)
    out, lse = wrapper.run(case.q, case.cache, return_lse=True, k_scale=0.6, v_scale=1.5)
    check(out, want, torch.bfloat16, lse, want_lse)


@gpu
@pytest.mark.parametrize("parts", [2, 4, 5, 9])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_split_requests_merged_in_the_launch_or_after(parts, kv_dtype):
    # A request split into at most 4 items is merged by its last item inside the decode launch,
    # one of more by the merge kernel after it; every run must find the counters zero again.
    lengths = [parts * 64 - 5, 2 * 64, 1, 0]
    case = Case(lengths, 16, (32, 8, 128), torch.bfloat16, "NHD", kv_dtype=kv_dtype)
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cuda"), "NHD")
    case.plan(wrapper, fixed_split_size=4)  # 64-token items
    assert int(wrapper._plan.partition.requests[0, 3]) == parts
    assert wrapper._plan.max_partials == parts
    sinks = torch.randn(32, device="cuda")
    want, want_lse = case.reference(sinks=sinks, v_scale=0.7)
    for _ in range(3):
        out, lse = torch.full_like(case.q, float("nan")), torch.full(case.q.shape[:2], float("nan"), device="cuda")
        wrapper.run(case.q, case.cache, out=out, lse=lse, return_lse=True, sinks=sinks, v_scale=0.7)
        check(out, want, torch.bfloat16, lse, want_lse)
    assert not wrapper._plan.counters.any()


@gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_forward_overrides_the_planned_options(layout):
    # SGLang plans without attention options and passes them to forward at each layer; forward's
    # options stay for the calls after it (FlashInfer's behaviour).
    case = Case(lengths_for(16), 16, (16, 4, 128), torch.bfloat16, layout)
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cuda"), layout)
    case.plan(wrapper, sm_scale=1.0, logits_soft_cap=50.0)
    want, _ = case.reference(sm_scale=0.25, soft_cap=1.5, v_scale=0.5)
    check(wrapper.forward(case.q, case.cache, sm_scale=0.25, logits_soft_cap=1.5, v_scale=0.5), want, torch.bfloat16)
    want, want_lse = case.reference(sm_scale=0.25, soft_cap=1.5, window_left=9)
    out, lse = wrapper.forward_return_lse(case.q, case.cache, sm_scale=0.25, logits_soft_cap=1.5, window_left=9)
    check(out, want, torch.bfloat16, lse, want_lse)
    want, _ = case.reference(sm_scale=0.25, soft_cap=1.5, window_left=9)
    check(wrapper.run(case.q, case.cache), want, torch.bfloat16)  # forward's options stayed
    wrapper.begin_forward(  # begin_forward is plan: the options are planned again
        case.indptr, case.indices, case.last_page_len, 16, 4, 128, 16, q_data_type=torch.bfloat16
    )
    want, _ = case.reference()
    check(wrapper.run(case.q, case.cache), want, torch.bfloat16)
    wrapper.end_forward()


@gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("form", ["wrapper", "cuda_graph_class", "fast_decode_plan"])
def test_cuda_graph_replays_after_a_new_plan(form, layout, page_size):
    """FlashInfer's three ways to the same: the wrapper with use_cuda_graph, its CUDA-graph subclass,
    and fast_decode_plan bound as the wrapper's plan (as multi-step draft decoding does)."""
    batch, heads = 6, (32, 8, 128)
    max_pages = 8192 // page_size + 64
    indptr_buf = torch.empty(batch + 1, dtype=torch.int32, device="cuda")
    indices_buf = torch.empty(max_pages, dtype=torch.int32, device="cuda")
    last_buf = torch.empty(batch, dtype=torch.int32, device="cuda")
    if form == "cuda_graph_class":
        wrapper = aotinfer.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(workspace("cuda"), indptr_buf, indices_buf,
                                                                      last_buf, layout)
    else:
        wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace("cuda"), layout, use_cuda_graph=True, paged_kv_indptr_buffer=indptr_buf,
            paged_kv_indices_buffer=indices_buf, paged_kv_last_page_len_buffer=last_buf,
        )  # fmt: skip
    if form == "fast_decode_plan":
        wrapper.plan = functools.partial(aotinfer.fast_decode_plan, wrapper)
    # Three steps over one cache: short sequences (no split), then one long sequence (split),
    # then other lengths; the graph is captured at the first.
    steps = [[3, 17, 1, 40, 2, 9], [4000, 5, 0, 33, 700, 1], [60, 61, 2047, 2, 1500, 300]]
    pool = max_pages
    cache, k, v = kv_pool(pool, page_size, heads[1], heads[2], torch.bfloat16, layout, "5d", "cuda")
    q = torch.randn(batch, heads[0], heads[2], device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads[0], device="cuda")
    graph = None
    for step, lengths in enumerate(steps):
        indptr, indices, last, _ = page_table(lengths, page_size)
        indices = torch.randperm(pool)[: indices.numel()].to(torch.int32)  # any pages of the pool
        wrapper.plan(indptr.cuda(), indices.cuda(), last.cuda(), *heads, page_size, q_data_type=torch.bfloat16)
        q.copy_(torch.randn_like(q))
        if graph is None:
            wrapper.run(q, cache, out=out, lse=lse)  # warm-up before capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                wrapper.run(q, cache, out=out, lse=lse)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        keys, values = gather(k, v, indptr, indices, last, layout)
        want, want_lse = reference(q, keys, values, 1 / math.sqrt(heads[2]))
        check(out, want, torch.bfloat16, lse, want_lse)
        if step == 1:
            assert wrapper._plan.partition.num_slots > 0, "the second step should split the long sequence"


@gpu
@pytest.mark.parametrize("lengths", [[40, 3000, 7], []], ids=["batch", "empty"])
def test_plan_after_a_captured_run_is_refused(lengths):
    """A wrapper made without use_cuda_graph may capture and replay a run under its plan; a new
    plan would have the replays launch the captured grid over other tables, so it is refused.
    An empty batch (whose replay launches nothing) counts as captured too."""
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cuda"), "NHD")
    case = Case(lengths, 16, (32, 8, 128), torch.float16)
    case.plan(wrapper)
    out = torch.empty_like(case.q)
    wrapper.run(case.q, case.cache, out=out)
    torch.cuda.synchronize()
    case.plan(wrapper)  # eager runs: planning again is fine
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(case.q, case.cache, out=out)
    out.fill_(float("nan"))
    graph.replay()  # the plan it was captured under: right
    torch.cuda.synchronize()
    if lengths:
        want, _ = case.reference()
        check(out, want, torch.float16)
    with pytest.raises(RuntimeError, match="captured into a CUDA graph.*use_cuda_graph=True"):
        case.plan(wrapper)
    with pytest.raises(RuntimeError, match="captured into a CUDA graph"):
        aotinfer.fast_decode_plan(wrapper, case.indptr, case.indices, case.last_page_len, 32, 8, 128, 16,
                                  q_data_type=torch.float16)


@gpu
@pytest.mark.parametrize("q_len", [2, 4, 8])
@pytest.mark.parametrize("use_cuda_graph", [False, True], ids=["eager", "cuda_graph"])
def test_several_query_tokens_a_request(q_len, use_cuda_graph):
    """q_len_per_req 2-8 (MTP and speculative verification) against the float32 reference: each
    request's query tokens are its last positions, causal among themselves."""
    lengths = [9, 300, 17, 1031, 4096, 64]
    case, q, want, want_lse = several_tokens_case(lengths, q_len, (32, 8, 128), torch.bfloat16, "cuda")
    buffers = {}
    if use_cuda_graph:
        buffers = dict(paged_kv_indptr_buffer=torch.empty(len(lengths) + 1, dtype=torch.int32, device="cuda"),
                       paged_kv_indices_buffer=torch.empty(2000, dtype=torch.int32, device="cuda"),
                       paged_kv_last_page_len_buffer=torch.empty(len(lengths), dtype=torch.int32, device="cuda"))
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cuda"), "NHD", use_cuda_graph=use_cuda_graph,
                                                          use_tensor_cores=True, **buffers)  # fmt: skip
    wrapper.plan(case.indptr.cuda(), case.indices.cuda(), case.last_page_len.cuda(), 32, 8, 128, 16,
                 q_data_type=torch.bfloat16, q_len_per_req=q_len)  # fmt: skip
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device="cuda")
    wrapper.run(q, case.cache, out=out, lse=lse, return_lse=True)
    check(out, want, torch.bfloat16, lse, want_lse)


def test_captured_byte_is_read_by_plan():
    """The host byte the binding sets under capture (what the GPU test above has it do): plan reads
    it; a use_cuda_graph wrapper passes no byte and plans after any capture."""
    lengths = [5, 40]
    case = Case(lengths, 16, (32, 8, 128), torch.float16, device="cpu")
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cpu"), "NHD")
    case.plan(wrapper)
    wrapper._captured[0] = 1
    with pytest.raises(RuntimeError, match="captured into a CUDA graph"):
        case.plan(wrapper)
    buffers = dict(paged_kv_indptr_buffer=torch.empty(3, dtype=torch.int32), paged_kv_indices_buffer=torch.empty(8, dtype=torch.int32),
                   paged_kv_last_page_len_buffer=torch.empty(2, dtype=torch.int32))
    graph_wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cpu"), "NHD", use_cuda_graph=True, **buffers)
    assert graph_wrapper._captured_address == 0  # its runs pass no byte
    case.plan(graph_wrapper)


def test_fixed_split_size_of_zero_or_less_leaves_the_split_to_the_plan(kernel_model):
    """FlashInfer reads fixed_split_size <= 0 as none (vLLM passes -1 outside its batch-invariant
    mode): the same tables as None."""
    case = Case([4000, 5, 900, 33], 16, (32, 8, 128), torch.float16, device="cpu")
    tables = []
    for fixed in (None, -1, 0):
        wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cpu"), "NHD")
        case.plan(wrapper, fixed_split_size=fixed)
        tables.append((wrapper._plan.work.tolist(), wrapper._plan.requests.tolist()))
    assert tables[0] == tables[1] == tables[2]
    assert len(tables[0][0]) > 4, "the plan should split the long request"


def test_q_len_per_req_is_checked(kernel_model):
    """FlashInfer's refusals: q_len_per_req < 1, requests shorter than it (an empty KV range),
    a wrapper without tensor cores, a CUDA-graph wrapper's q_len_per_req changed after its first plan,
    q of other than batch_size * q_len_per_req rows."""
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cpu"), "NHD", use_tensor_cores=True)
    case = Case([5, 40], 16, (32, 8, 128), torch.float16, device="cpu")
    with pytest.raises(ValueError, match="Expected q_len_per_req to be at least 1"):
        aotinfer.fast_decode_plan(wrapper, case.indptr, case.indices, case.last_page_len, 32, 8, 128, 16, q_len_per_req=0)
    with pytest.raises(ValueError, match="q_len_per_req=8 needs every request .* empty KV range"):
        case.plan(wrapper, q_len_per_req=8)
    case.plan(wrapper, q_len_per_req=2)
    with pytest.raises(ValueError, match=r"Expected q to have batch_size \* q_len_per_req = 4 rows"):
        wrapper.run(torch.zeros(6, 32, 128).half(), case.cache)
    cuda_cores = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cpu"), "NHD")
    with pytest.raises(ValueError, match="use_tensor_cores=True"):
        case.plan(cuda_cores, q_len_per_req=2)
    buffers = dict(paged_kv_indptr_buffer=torch.empty(3, dtype=torch.int32), paged_kv_indices_buffer=torch.empty(8, dtype=torch.int32),
                   paged_kv_last_page_len_buffer=torch.empty(2, dtype=torch.int32))
    graph = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cpu"), "NHD", use_cuda_graph=True, use_tensor_cores=True,
                                                        **buffers)  # fmt: skip
    case.plan(graph, q_len_per_req=2)
    case.plan(graph, q_len_per_req=2)
    for q_len in (3, 1):
        with pytest.raises(ValueError, match=f"q_len_per_req is frozen at 2 .* got {q_len}"):
            case.plan(graph, q_len_per_req=q_len)


def several_tokens_case(lengths, q_len, heads, dtype, device):
    """A decode batch whose requests each have ``q_len`` query tokens, the last of their positions:
    the case, q [batch * q_len, heads, dim] and the float32 reference (prefill's, causal)."""
    import test_prefill

    case = Case(lengths, 16, heads, dtype, device=device)
    q = torch.randn(len(lengths) * q_len, heads[0], heads[2], device=device).to(dtype)
    qo_indptr = torch.arange(len(lengths) + 1) * q_len
    want, want_lse = test_prefill.reference(q, qo_indptr, case.keys, case.values, 1 / math.sqrt(heads[2]), causal=True)
    return case, q, want, want_lse


@pytest.mark.parametrize("q_len", [2, 3, 8])
def test_several_query_tokens_a_request_on_the_prefill_model(monkeypatch, q_len):
    """q_len_per_req > 1 runs the paged prefill plan, causal among a request's new tokens (its
    kernel replaced by its float32 model: on the CPU), through plan and through fast_decode_plan."""
    import test_prefill
    from aotinfer import prefill

    monkeypatch.setattr(prefill, "_batch_prefill", test_prefill.model_batch_prefill)
    case, q, want, want_lse = several_tokens_case([9, 300, 17, 1031], q_len, (16, 4, 64), torch.float16, "cpu")
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cpu", 64 << 20), "NHD", use_tensor_cores=True)
    for plan in (wrapper.plan, functools.partial(aotinfer.fast_decode_plan, wrapper)):
        plan(case.indptr, case.indices, case.last_page_len, 16, 4, 64, 16, q_data_type=torch.float16, q_len_per_req=q_len)
        out, lse = wrapper.run(q, case.cache, return_lse=True)
        check(out, want, torch.float16, lse, want_lse)
    case.plan(wrapper)  # one token a request again
    assert wrapper._q_len_per_req == 1 and wrapper._plan is not None


@gpu
@pytest.mark.parametrize("mode", [dict(disable_split_kv=True), dict(fixed_split_size=8),
                                  dict(fixed_split_size=2048, disable_split_kv=True)],
                         ids=["disable_split_kv", "fixed_split_size", "vllm_batch_invariant"])
def test_batch_invariant_and_deterministic(mode):
    # A request's output is bit for bit the same alone, in a large batch and again.
    heads, page_size = (32, 8, 128), 16
    lengths = [5000, 3, 900, 16, 2500] + [100 + 37 * i for i in range(40)]
    case = Case(lengths, page_size, heads, torch.bfloat16)
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cuda"))
    case.plan(wrapper, **mode)
    batched = wrapper.run(case.q, case.cache)
    assert torch.equal(wrapper.run(case.q, case.cache), batched)
    for b in (0, 2, 4):
        pages = case.indices[case.indptr[b] : case.indptr[b + 1]]
        alone = torch.tensor([0, pages.numel()], dtype=torch.int32)
        wrapper.plan(alone, pages, case.last_page_len[b : b + 1], *heads, page_size, q_data_type=torch.bfloat16, **mode)
        assert torch.equal(wrapper.run(case.q[b : b + 1], case.cache)[0], batched[b])
    want, _ = case.reference()
    check(batched, want, torch.bfloat16)


@gpu
@pytest.mark.parametrize("batch, length", [(1, 32768), (4, 8192)])
def test_long_sequences_split_and_merge(batch, length):
    case = Case([length] * batch, 16, (32, 8, 128), torch.bfloat16)
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cuda"))
    case.plan(wrapper)
    assert wrapper._plan.partition.chunk < length
    want, want_lse = case.reference()
    out, lse = wrapper.run(case.q, case.cache, return_lse=True)
    check(out, want, torch.bfloat16, lse, want_lse)


@gpu
@pytest.mark.parametrize("form", ["tuple", "5d", "tuple, unequal strides"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_strided_pages(layout, form):
    # K and V as views into a wider pool: more heads, padded head_dim, every other page.
    heads, page_size = (16, 4, 128), 16
    lengths = lengths_for(page_size)
    indptr, indices, last, pool = page_table(lengths, page_size)
    if layout == "NHD":
        view = torch.randn(2 * pool, 2, page_size, 7, 160, device="cuda").half()[::2, :, :, 2:6, 16:144]
    else:
        view = torch.randn(2 * pool, 2, 7, page_size, 160, device="cuda").half()[::2, :, 2:6, :, 16:144]
    assert not view.is_contiguous() and view.shape[-1] == 128 and view.stride(-1) == 1
    k, v = view[:, 0], view[:, 1]
    if form == "tuple, unequal strides":  # V from a pool padded otherwise: its own strides throughout
        if layout == "NHD":
            v = torch.randn(3 * pool, page_size + 1, 9, 192, device="cuda").half()[::3, 1:, 3:7, 40:168]
        else:
            v = torch.randn(3 * pool, 9, page_size + 1, 192, device="cuda").half()[::3, 3:7, 1:, 40:168]
        assert v.shape == k.shape and v.stride() != k.stride()
    cache = view if form == "5d" else (k, v)
    q = torch.randn(len(lengths), 16, 128, device="cuda").to(torch.float16)
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cuda"), layout)
    wrapper.plan(indptr, indices, last, *heads, page_size)
    keys, values = gather(k, v, indptr, indices, last, layout)
    want, want_lse = reference(q, keys, values, 1 / math.sqrt(128))
    out, lse = wrapper.run(q, cache, return_lse=True)
    check(out, want, torch.float16, lse, want_lse)


@gpu
def test_empty_batch_and_empty_sequences():
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cuda"))
    empty = torch.zeros(1, dtype=torch.int32)
    wrapper.plan(empty, torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 8, 8, 128, 16)
    q = torch.randn(0, 8, 128, device="cuda", dtype=torch.float16)
    cache = torch.randn(4, 2, 16, 8, 128, device="cuda", dtype=torch.float16)
    out, lse = wrapper.run(q, cache, return_lse=True)
    assert out.shape == (0, 8, 128) and lse.shape == (0, 8)
    # Requests without tokens: zeros and -inf (with a sink: the sink's log-sum-exp).
    case = Case([0, 0, 0], 16, (8, 8, 128), torch.float16)
    case.plan(wrapper)
    out, lse = wrapper.run(case.q, case.cache, out=poisoned(case.q.shape, torch.float16), return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())
    sinks = torch.randn(8, device="cuda")
    out, lse = wrapper.run(case.q, case.cache, return_lse=True, sinks=sinks)
    assert torch.equal(out, torch.zeros_like(out))
    torch.testing.assert_close(lse, (sinks / LN2).expand(3, 8))


@gpu
@pytest.mark.parametrize("bad_ids", [[10**9, 7], [-1, -(2**31)]], ids=["beyond", "negative"])
def test_page_ids_outside_the_cache_read_inside_it(bad_ids):
    # A page id outside the cache is the caller's error (FlashInfer leaves it undefined): its
    # request's output is whatever the cache's last page gives, and nothing outside the cache is
    # read, so the other requests are right and the next kernel runs.
    case = Case([40, 33, 17], 16, (8, 8, 128), torch.float16)
    good = case.indices.clone()
    first = int(case.indptr[1])
    case.indices[first : first + len(bad_ids)] = torch.tensor(bad_ids, dtype=torch.int32)
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cuda"))
    case.plan(wrapper)
    out = wrapper.run(case.q, case.cache, out=poisoned(case.q.shape, torch.float16))
    torch.cuda.synchronize()
    want, _ = case.reference()
    check(out[0::2], want[0::2], torch.float16)
    assert bool(out[1].isfinite().all())
    case.indices = good
    case.plan(wrapper)
    check(wrapper.run(case.q, case.cache), want, torch.float16)


@gpu
def test_large_batch_is_not_split():
    heads = (32, 8, 128)
    lengths = [1 + (97 * i) % 3000 for i in range(300)]
    case = Case(lengths, 16, heads, torch.float16)
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cuda"))
    case.plan(wrapper)
    assert wrapper._plan.partition.num_slots == 0 and wrapper._plan.max_partials == 0
    want, want_lse = case.reference()
    out, lse = wrapper.run(case.q, case.cache, return_lse=True)
    check(out, want, torch.float16, lse, want_lse)


@gpu
def test_plan_takes_gpu_or_cpu_page_tables_and_run_never_synchronizes():
    case = Case(lengths_for(16), 16, (16, 4, 128), torch.float16)
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cuda"))
    want, _ = case.reference()
    for device in ("cuda", "cpu"):
        wrapper.plan(case.indptr.to(device), case.indices.to(device), case.last_page_len.to(device), 16, 4, 128, 16)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs = [wrapper.run(case.q, case.cache) for _ in range(3)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for out in outs:
            check(out, want, torch.float16)


@gpu
def test_bad_tensors_are_named():
    case = Case(lengths_for(16), 16, (16, 4, 128), torch.float16)
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cuda"))
    case.plan(wrapper)
    # q off the workspace's GPU: run names both (the workspace's device is checked before the binding's).
    with pytest.raises(ValueError, match=r"float_workspace_buffer is on cuda:\d+, q on cpu"):
        wrapper.run(case.q.cpu(), case.cache)
    with pytest.raises(ValueError, match="Expected q to have the planned shape"):
        wrapper.run(case.q[:, :8], case.cache)
    with pytest.raises(ValueError, match="Expected paged_kv_cache to have shape"):
        wrapper.run(case.q, torch.stack(case.cache + case.cache[:1], 1))  # [pages, 3, ...]
    with pytest.raises(ValueError, match="planned page_size 16"):
        wrapper.run(case.q, (case.cache[0][:4].reshape(8, 8, 4, 128), case.cache[1][:4].reshape(8, 8, 4, 128)))


# ---- single request -----------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("kv_len", [0, 37, 9000])
@pytest.mark.parametrize("heads", [(8, 8, 64), (32, 8, 128), (12, 2, 256)], ids=["g1d64", "g4d128", "g6d256"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_decode(layout, heads, kv_len):
    num_qo_heads, num_kv_heads, head_dim = heads
    dtype = torch.bfloat16
    shape = (kv_len, num_kv_heads, head_dim) if layout == "NHD" else (num_kv_heads, kv_len, head_dim)
    k, v = torch.randn(shape, device="cuda").to(dtype), torch.randn(shape, device="cuda").to(dtype)
    q = torch.randn(num_qo_heads, head_dim, device="cuda").to(dtype)
    nhd = (k, v) if layout == "NHD" else (k.transpose(0, 1), v.transpose(0, 1))
    want, want_lse = reference(q[None], [nhd[0]], [nhd[1]], 1 / math.sqrt(head_dim))
    out = aotinfer.single_decode_with_kv_cache(q, k, v, kv_layout=layout)
    check(out[None], want, dtype)
    out, lse = aotinfer.single_decode_with_kv_cache(q, k, v, kv_layout=layout, return_lse=True)
    check(out[None], want, dtype, lse[None], want_lse)
    options = dict(window_left=20, logits_soft_cap=2.0, sm_scale=0.1, q_scale=0.5, k_scale=2.0, v_scale=3.0)
    want, want_lse = reference(q[None], [nhd[0]], [nhd[1]], 0.1, soft_cap=2.0, window_left=20, v_scale=3.0)
    out, lse = aotinfer.single_decode_with_kv_cache(q, k, v, kv_layout=layout, return_lse=True, **options)
    check(out[None], want, dtype, lse[None], want_lse)


@gpu
def test_single_decode_is_capturable():
    q = torch.randn(32, 128, device="cuda", dtype=torch.float16)
    k = torch.randn(5000, 8, 128, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    aotinfer.single_decode_with_kv_cache(q, k, v)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = aotinfer.single_decode_with_kv_cache(q, k, v)
    q.copy_(torch.randn_like(q))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want, _ = reference(q[None], [k], [v], 1 / math.sqrt(128))
    check(out[None], want, torch.float16)


# ---- compute-sanitizer --------------------------------------------------------------------------

MEMCHECK_SCRIPT = """
import math, torch, aotinfer
torch.manual_seed(0)
f16, e4m3, e5m2 = torch.float16, torch.float8_e4m3fn, torch.float8_e5m2
for layout, page_size, lengths, kv_dtype, head_dim in (
    ("NHD", 1, [0, 1, 700, 5], f16, 128), ("HND", 16, [33, 0, 2000, 16], f16, 128), ("NHD", 64, [4096], f16, 128),
    ("NHD", 16, [33, 0, 2000, 16], e4m3, 64), ("HND", 16, [1031, 7], e5m2, 256), ("NHD", 1, [900], e4m3, 128),
):
    heads = (16, 4, head_dim)
    pages = [-(-n // page_size) for n in lengths]
    indptr = torch.tensor([0] + pages).cumsum(0).int()
    indices = torch.randperm(sum(pages) + 3)[: sum(pages)].int()
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(lengths, pages)]).int()
    page = [page_size, 4, head_dim] if layout == "NHD" else [4, page_size, head_dim]
    cache = torch.randn(sum(pages) + 3, 2, *page, device="cuda").to(kv_dtype)
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), layout)
    wrapper.plan(indptr, indices, last, *heads, page_size, logits_soft_cap=5.0, window_left=300, kv_data_type=kv_dtype)
    q = torch.randn(len(lengths), 16, head_dim, device="cuda", dtype=torch.float16)
    wrapper.run(q, cache, return_lse=True, sinks=torch.randn(16, device="cuda"))
    if kv_dtype == f16:
        aotinfer.single_decode_with_kv_cache(q[0], cache[:50, 0, 0], cache[:50, 1, 0], return_lse=True)
torch.cuda.synchronize()
print("done")
"""


@gpu
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="needs compute-sanitizer")
def test_memcheck_clean(tmp_path):
    script = tmp_path / "memcheck_decode.py"
    script.write_text(MEMCHECK_SCRIPT)
    out = subprocess.run(
        ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "3", sys.executable, str(script)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1"),
    )  # fmt: skip
    assert out.returncode == 0 and "done" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    assert "ERROR SUMMARY: 0 errors" in out.stdout + out.stderr


# ---- the work partition (CPU) -------------------------------------------------------------------


def page_table_of(lengths, page_size):
    pages = [-(-n // page_size) for n in lengths]
    indptr = torch.tensor([0] + pages, dtype=torch.int32).cumsum(0).to(torch.int32)
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(lengths, pages)], dtype=torch.int32)
    return indptr, last


def partition(lengths, page_size=16, heads=(32, 8, 128), sms=132, **options):
    indptr, last = page_table_of(lengths, page_size)
    return decode.partition_work(
        indptr, last, num_indices=int(indptr[-1]), page_size=page_size, num_qo_heads=heads[0], num_kv_heads=heads[1],
        num_sms=sms, **options
    )


def partition_reference(lengths, page_size, heads, sms, window_left=-1, disable_split_kv=False, fixed_split_size=None,
                        capacity=None):
    """The partition as plan made it in Python before plan_decode (the reference its tables must
    equal bit for bit): (work, requests) int32 and the chunk."""
    kv_len = torch.tensor(lengths, dtype=torch.int64)
    batch = kv_len.numel()
    page_begin = torch.tensor([0] + [-(-n // page_size) for n in lengths], dtype=torch.int64).cumsum(0)[:-1]
    lo = (kv_len - 1 - window_left).clamp(min=0) if window_left >= 0 else torch.zeros_like(kv_len)
    fill = decode.target_items(sms, *heads[:2])
    if disable_split_kv or (fixed_split_size is None and batch >= fill):
        chunk = 0
    elif fixed_split_size is not None:
        chunk = fixed_split_size * page_size
    else:
        bounds = list(zip(lo.tolist(), kv_len.tolist()))
        longest = max(h - l for l, h in bounds) if batch else 0
        if longest <= decode._SHORT_REQUEST:
            fill = decode.target_items(sms, *heads[:2], ctas_per_sm=1)

        def count(c):
            return sum(decode.num_chunks(l, h, c) for l, h in bounds)

        end = max(kv_len.tolist()) if batch else 0
        chunk = 0 if batch >= fill else decode.smallest_chunk(longest, end, fill, page_size, count)
    rows, request_rows, num_slots = [], [], 0
    for b, (l, h, begin) in enumerate(zip(lo.tolist(), kv_len.tolist(), page_begin.tolist())):
        n = decode.num_chunks(l, h, chunk) if chunk else 1
        if n == 1:
            rows.append((b, l, h, -1))
            request_rows.append((begin, h, -1, 0))
            continue
        first = l // chunk
        for i in range(n):
            rows.append((b, max(l, (first + i) * chunk), min(h, (first + i + 1) * chunk), num_slots + i))
        request_rows.append((begin, h, num_slots, n))
        num_slots += n
    rows.sort(key=lambda row: row[1] - row[2])  # longest first; sort is stable
    if capacity is not None:
        rows += [(-1, 0, 0, -1)] * (capacity - len(rows))
    work = torch.tensor(rows, dtype=torch.int32).view(-1, 4)
    return work, torch.tensor(request_rows, dtype=torch.int32).view(-1, 4), chunk


@pytest.mark.parametrize("seed", range(6))
def test_compiled_partition_equals_the_python_one(seed):
    """plan_decode's tables equal the Python partition's bit for bit: ragged batches of 0-300
    requests, page sizes 1-64, windows, fixed splits, CUDA-graph capacities."""
    generator = torch.Generator().manual_seed(seed)
    for case in range(40):
        batch = [0, 1, 3, 16, 40, 300][int(torch.randint(6, (), generator=generator))]
        longest = [40, 2048, 3000, 40000][int(torch.randint(4, (), generator=generator))]
        lengths = torch.randint(0, longest + 1, (batch,), generator=generator).tolist()
        page_size = [1, 16, 48, 64][case % 4]
        heads = [(32, 8, 128), (64, 4, 128), (8, 8, 64)][case % 3]
        options = [{}, dict(window_left=300), dict(fixed_split_size=5), dict(disable_split_kv=True)][case // 4 % 4]
        sms = [132, 78, 20][case % 3]
        work, requests, chunk = partition_reference(lengths, page_size, heads, sms, **options)
        p = partition(lengths, page_size, heads, sms, **options)
        assert p.chunk == chunk and torch.equal(p.work, work) and torch.equal(p.requests, requests), (lengths, options)
        assert p.max_partials == (int(requests[:, 3].max()) if batch else 0)
        capacity = work.shape[0] + case % 3
        p = partition(lengths, page_size, heads, sms, capacity=capacity, **options)
        assert torch.equal(p.work, partition_reference(lengths, page_size, heads, sms, capacity=capacity, **options)[0])
        assert not p.counters.any() and p.counters.numel() == batch * decode.heads_ctas(*heads[:2])


def check_partition(p, lengths, page_size=16, window_left=-1):
    """Every attended position of every request in exactly one item; slots and tables consistent."""
    work, requests = p.work.tolist(), p.requests.tolist()
    assert p.work.dtype == p.requests.dtype == torch.int32 and len(requests) == len(lengths)
    items = [w for w in work if w[0] >= 0]
    assert len(items) == p.num_items and all(w == [-1, 0, 0, -1] for w in work[len(items) :])
    slots = sorted(w[3] for w in items if w[3] >= 0)
    assert slots == list(range(p.num_slots))
    for b, length in enumerate(lengths):
        lo = max(length - 1 - window_left, 0) if window_left >= 0 else 0
        mine = sorted((w[1], w[2], w[3]) for w in items if w[0] == b)
        assert mine, f"request {b} has no item"
        covered = [pos for begin, end, _ in mine for pos in range(begin, end)]
        assert covered == list(range(lo, length)), f"request {b}: items {mine} do not cover [{lo}, {length}) once"
        page_begin, kv_len, first_partial, num_partials = requests[b]
        assert kv_len == length
        if len(mine) == 1:
            assert mine[0][2] == -1 and (first_partial, num_partials) == (-1, 0)
        else:
            assert [s for _, _, s in mine] == list(range(first_partial, first_partial + num_partials))
            assert num_partials == len(mine)
            for begin, end, _ in mine:  # chunk boundaries at multiples of the chunk size
                assert begin == lo or begin % p.chunk == 0
                assert end == length or end % p.chunk == 0
    sizes = [w[2] - w[1] for w in items]
    assert sizes == sorted(sizes, reverse=True), "items are ordered longest first"


RAGGED = [0, 1, 16, 17, 300, 1031, 5000, 2, 65, 4096]


@pytest.mark.parametrize("page_size", [1, 16, 64, 48])
@pytest.mark.parametrize("window_left", [-1, 0, 100, 2000])
def test_partition_covers_every_position_once(page_size, window_left):
    p = partition(RAGGED, page_size, window_left=window_left)
    check_partition(p, RAGGED, page_size, window_left)
    short = window_left in (0, 100, 2000)  # no request attends more than _SHORT_REQUEST positions
    target = decode.target_items(132, 32, 8, ctas_per_sm=1 if short else 2)
    assert p.num_items <= target
    if window_left in (0, 100):  # no request attends more than the smallest chunk
        assert p.chunk == 0 and p.num_slots == 0
        return
    assert p.num_slots > 0
    unit = _attention.chunk_unit(page_size)
    assert p.chunk % 64 == 0 and p.chunk % unit == 0 and p.chunk >= _attention.MIN_CHUNK and p.chunk % page_size == 0
    # The smallest such chunk: one unit less makes too many items.
    if p.chunk > _attention.MIN_CHUNK:
        bounds = [(max(n - 1 - window_left, 0) if window_left >= 0 else 0, n) for n in RAGGED]
        assert sum(decode.num_chunks(lo, hi, p.chunk - unit) for lo, hi in bounds) > target


def test_partition_modes():
    # The GPU is filled by the batch: no split, one item a request.
    many = [3000] * 40
    p = partition(many)
    assert p.chunk == 0 and p.num_items == 40 and p.num_slots == 0
    check_partition(p, many)
    # disable_split_kv: one item a request at any batch size.
    p = partition(RAGGED, disable_split_kv=True)
    assert p.num_items == len(RAGGED) and p.num_slots == 0
    check_partition(p, RAGGED)
    # fixed_split_size is in pages: chunks of 8 * 16 tokens.
    p = partition(RAGGED, fixed_split_size=8)
    assert p.chunk == 128
    check_partition(p, RAGGED)
    # Group sizes above 16 take several CTAs a KV head: fewer items fill the GPU.
    assert decode.heads_ctas(64, 2) == 4 and decode.heads_ctas(32, 8) == 8 and decode.heads_ctas(12, 2) == 2
    assert decode.target_items(132, 32, 8) == 33 and decode.target_items(132, 64, 64) == 5
    # Sequences shorter than the smallest chunk are never split.
    assert partition([100, 30, 127]).num_slots == 0
    # Short requests (up to 2048 positions) aim at 1 CTA an SM (17 items of 8 CTAs), longer ones at
    # 2 (33 items): 16 of 2048 stay whole, 16 of 2049 are split, 4 of 1024 take 16 items of 256.
    assert partition([2048] * 16).num_slots == 0
    assert partition([2049] * 16).num_items == 32
    p = partition([1024] * 4)
    assert p.chunk == 256 and p.num_items == 16
    # Empty batch.
    p = partition([])
    assert p.num_items == 0 and p.work.shape == (0, 4) and p.requests.shape == (0, 4)


def test_partition_depends_on_the_request_alone_with_a_fixed_split():
    # A request's items (positions and count) are the same in any batch: batch invariance.
    alone = partition([5000], fixed_split_size=8)
    batched = partition([7, 5000, 12000, 3], fixed_split_size=8)
    items_alone = sorted((w[1], w[2]) for w in alone.work.tolist())
    items_batched = sorted((w[1], w[2]) for w in batched.work.tolist() if w[0] == 1)
    assert items_alone == items_batched
    assert torch.equal(partition(RAGGED).work, partition(RAGGED).work)  # and the plan is a function of its inputs


def test_partition_with_a_fixed_capacity():
    # Under CUDA graphs the work table always has `capacity` rows; the idle ones come last.
    target = decode.target_items(132, 32, 8)
    for lengths in ([5, 6, 7], [32768], RAGGED, [0] * 10):
        p = partition(lengths, capacity=max(len(lengths), target))
        assert p.work.shape == (max(len(lengths), target), 4)
        check_partition(p, lengths)
    with pytest.raises(ValueError, match="more than the 33 a CUDA graph.s fixed grid holds"):
        partition([32768], fixed_split_size=1, capacity=33)


# ---- plan and run against the kernel's contract (CPU) -------------------------------------------


def merge_into(o, s, o_other, s_other):
    """Merge a state (o, s base 2) into another, float32."""
    s_max = torch.maximum(s, s_other)
    s_max = torch.where(torch.isinf(s_max), torch.zeros_like(s_max), s_max)
    w, w_other = torch.exp2(s - s_max), torch.exp2(s_other - s_max)
    total = w + w_other
    o = (o * w[:, None] + o_other * w_other[:, None]) / torch.where(total > 0, total, 1.0)[:, None]
    return o, s_max + torch.log2(total)


def rope_llama(x, positions, rope_scale=1.0, rope_theta=1e4):
    """FlashInfer's ROPE_LLAMA in float32: x [..., n, heads, head_dim] (n positions, or n = 1 for one
    position), dims j and j + head_dim / 2 turned by position / rope_scale * rope_theta^(-2j / head_dim)."""
    head_dim = x.shape[-1]
    half = head_dim // 2
    freq = rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2 / head_dim) / rope_scale
    angle = (torch.as_tensor(positions, dtype=torch.float64).reshape(-1, 1) * freq).float()  # [n, half]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x = x.float()
    lo, hi = x[..., :half], x[..., half:]
    return torch.cat((lo * cos - hi * sin, hi * cos + lo * sin), -1)


def model_batch_decode(out, lse, partial_out, partial_lse, q, k_cache, v_cache, indices, work, requests, counters,
                       sinks, captured, kv_layout, sm_scale, logits_soft_cap, window_left, pos_encoding_mode, rope_scale,
                       rope_theta, v_scale, max_partials, kv_read_once, enable_pdl):  # fmt: skip
    """The batch_decode binding's contract (modules.toml; the table formats in aotinfer/decode.py)
    as float32 torch code: what the CUDA kernels compute, item by item, then the merge. RoPE
    (pos_encoding_mode 1): q at kv_len - 1 and each key at its position, rounded to their dtype."""
    assert pos_encoding_mode in (0, 1)
    nhd = kv_layout == 0
    page_size = k_cache.shape[1 if nhd else 2]
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[2 if nhd else 1]
    assert work.dtype == requests.dtype == torch.int32 and work.shape[1] == requests.shape[1] == 4
    assert requests.shape[0] == q.shape[0] == out.shape[0] and lse.numel() in (0, q.shape[0] * num_heads)
    assert partial_out.shape[1:] == (num_heads, head_dim) and partial_lse.shape == partial_out.shape[:2]
    assert kv_read_once in (0, 1)  # a cache policy: no effect on the result
    assert counters.dtype == torch.int32 and counters.numel() >= q.shape[0] * decode.heads_ctas(num_heads, num_heads // group)
    assert not counters.any(), "counters must be zero between launches"
    sink = sinks.float() / LN2 if sinks.numel() else None  # base 2

    def state(request, begin, end):
        page_begin, kv_len = requests[request, 0].item(), requests[request, 1].item()
        assert 0 <= begin <= end <= kv_len
        assert page_begin + -(-kv_len // page_size) <= indices.numel(), "pages past the page table"
        positions = torch.arange(begin, end)
        if window_left >= 0:
            positions = positions[positions >= kv_len - 1 - window_left]
        pages = indices[page_begin + positions // page_size].long()
        slot = positions % page_size

        def rows(cache):  # [positions, kv_heads, head_dim] in float32 (fp8 indexed as bytes)
            raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache
            picked = raw[pages, slot] if nhd else raw[pages, :, slot]
            return picked.view(cache.dtype).float().repeat_interleave(group, 1)

        k, v = rows(k_cache), rows(v_cache)
        query = q[request].float()
        if pos_encoding_mode:
            k = rope_llama(k, positions, rope_scale, rope_theta).to(k_cache.dtype).float()
            query = rope_llama(query[None], [kv_len - 1], rope_scale, rope_theta)[0].to(q.dtype).float()
        logits = torch.einsum("hd,nhd->hn", query, k) * sm_scale
        if logits_soft_cap > 0:
            logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
        total = torch.logsumexp(logits, -1)
        o = torch.einsum("hn,nhd->hd", torch.exp(logits - total[:, None]), v) if positions.numel() else torch.zeros(num_heads, head_dim)
        return o, total / LN2

    def write(request, o, s):
        if sink is not None:
            o, s = merge_into(o, s, torch.zeros_like(o), sink)
        out[request] = (o * v_scale).to(out.dtype)
        if lse.numel():
            lse[request] = s

    for request, begin, end, slot in work.tolist():
        if request < 0:
            continue  # idle
        o, s = state(request, begin, end)
        if slot < 0:
            write(request, o, s)
        else:
            partial_out[slot], partial_lse[slot] = o, s
    for request, (_, _, first_partial, num_partials) in enumerate(requests.tolist()):
        if num_partials > 1:
            assert num_partials <= max_partials, "a request has more items than max_partials says"
            o, s = torch.zeros(num_heads, head_dim), torch.full((num_heads,), float("-inf"))
            for slot in range(first_partial, first_partial + num_partials):
                o, s = merge_into(o, s, partial_out[slot], partial_lse[slot])
            write(request, o, s)


@pytest.fixture
def kernel_model(monkeypatch):
    """batch_decode replaced by its float32 model: plan and run run on the CPU."""
    monkeypatch.setattr(decode, "_batch_decode", model_batch_decode)


CPU_MODES = {
    "auto": ({}, {}),
    "disable_split_kv": (dict(disable_split_kv=True), {}),
    "fixed_split_size": (dict(fixed_split_size=3), {}),
    "window_sinks_soft_cap": (dict(window_left=70, logits_soft_cap=2.0), "sinks"),
    "scales_window_narrowed": (dict(window_left=400, sm_scale=0.2), dict(q_scale=0.5, k_scale=3.0, v_scale=0.5, window_left=30)),
}


@pytest.mark.parametrize("mode", list(CPU_MODES))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_plan_and_run_drive_the_kernel_contract(kernel_model, layout, page_size, mode):
    torch.manual_seed(0)
    heads = (12, 2, 64)
    case = Case(lengths_for(page_size), page_size, heads, torch.float16, layout, "5d", device="cpu")
    plan_options, run_options = CPU_MODES[mode]
    run_options = dict(sinks=torch.randn(12) * 2) if run_options == "sinks" else dict(run_options)
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cpu", 16 << 20), layout)
    case.plan(wrapper, **plan_options)
    reference_options = dict(
        sm_scale=plan_options.get("sm_scale", 1 / math.sqrt(64)) * run_options.get("q_scale", 1) * run_options.get("k_scale", 1),
        soft_cap=plan_options.get("logits_soft_cap", 0.0),
        window_left=run_options.get("window_left", plan_options.get("window_left", -1)),
        sinks=run_options.get("sinks"),
        v_scale=run_options.get("v_scale", 1.0),
    )
    want, want_lse = reference(case.q, case.keys, case.values, **reference_options)
    out, lse = wrapper.run(case.q, case.cache, out=poisoned(case.q.shape, torch.float16, "cpu"), return_lse=True, **run_options)
    check(out, want, torch.float16, lse, want_lse)


def test_vllm_fast_plan_decode_sequence(kernel_model):
    """vLLM's flashinfer backend (v1/attention/backends/flashinfer.py, 0.33), call by call: a decode
    wrapper made with use_cuda_graph and use_tensor_cores; its first step planned by plan() with
    FlashInfer's 22 positional arguments; later steps by its fast_plan_decode, which fills the
    wrapper's buffers, calls _cached_module.plan with FlashInfer's tensor-core planner arguments and
    sets the options on the wrapper; after each plan it asserts _window_left, _logits_soft_cap and
    _sm_scale, then runs with k_scale and v_scale into its output."""
    heads, page_size, batch, scale, window_left = (16, 4, 64), 16, 4, 0.125, -1
    indptr_buf = torch.zeros(batch + 1, dtype=torch.int32)
    indices_buf = torch.zeros(1000, dtype=torch.int32)
    last_buf = torch.zeros(batch, dtype=torch.int32)
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace("cpu", 16 << 20), "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=indptr_buf,
        paged_kv_indices_buffer=indices_buf, paged_kv_last_page_len_buffer=last_buf, use_tensor_cores=True,
    )  # fmt: skip
    pool = 900
    cache, k, v = kv_pool(pool, page_size, 4, 64, torch.float16, "NHD", "5d", "cpu")
    for step, lengths in enumerate(([3, 17, 40, 2], [4000, 5, 0, 700], [16, 1, 2, 3])):
        indptr, indices, last, _ = page_table(lengths, page_size)
        indices = torch.randperm(pool)[: indices.numel()].int()
        seq_lens = torch.tensor(lengths, dtype=torch.int32)
        indices_buf[: indices.numel()] = indices  # vLLM writes the page ids into the buffer itself
        if step == 0:
            wrapper.plan(indptr, indices_buf[: indices.numel()], last, *heads, page_size, "NONE", window_left, None,
                         torch.float16, torch.float16, torch.float16, None, scale, None, None, True, None, None, -1,
                         False)  # fmt: skip
        else:
            indptr_buf.copy_(indptr)
            last_buf.copy_(last)
            qo_indptr_host = decode._get_range_buf(batch + 1, "cpu")
            wrapper._plan_info = wrapper._cached_module.plan(
                wrapper._float_workspace_buffer, wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer,
                qo_indptr_host, indptr, seq_lens, batch, batch, heads[0], heads[1], page_size,
                wrapper.is_cuda_graph_enabled, heads[2], heads[2], False, window_left,
            )  # fmt: skip
            wrapper._pos_encoding_mode, wrapper._window_left, wrapper._logits_soft_cap = "NONE", window_left, 0.0
            wrapper._sm_scale, wrapper._rope_scale, wrapper._rope_theta = scale, None, None
        assert wrapper._window_left == window_left and wrapper._logits_soft_cap == 0.0 and wrapper._sm_scale == scale
        q = torch.randn(batch, 16, 64).half()
        out = torch.full_like(q, float("nan"))
        wrapper.run(q, cache, k_scale=1.0, v_scale=1.0, out=out)
        keys, values = gather(k, v, indptr, indices, last, "NHD")
        want, _ = reference(q, keys, values, scale)
        check(out, want, torch.float16)


@pytest.mark.parametrize("use_tensor_cores", [True, False])
def test_sglang_fast_decode_plan_sequence(kernel_model, use_tensor_cores):
    """SGLang's fast_decode_plan (layers/attention/flashinfer_backend.py), call by call, on a wrapper
    without CUDA graphs: it sets the wrapper's _paged_kv_*_buf to its tensors and calls
    _cached_module.plan with FlashInfer's tensor-core planner arguments (15 of them) or its CUDA-core
    planner's (with empty tensors of the dtypes), then sets the options on the wrapper."""
    heads, page_size, scale = (16, 4, 64), 16, 0.125
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cpu", 16 << 20), "NHD", use_tensor_cores=use_tensor_cores)
    pool = 900
    cache, k, v = kv_pool(pool, page_size, 4, 64, torch.float16, "NHD", "5d", "cpu")
    wrapper.plan(*page_table([3, 2], page_size)[:3], *heads, page_size, q_data_type=torch.float16, sm_scale=scale)
    for lengths in ([3, 17, 40, 2], [4000, 5, 0, 700]):
        indptr, indices, last, _ = page_table(lengths, page_size)
        indices = torch.randperm(pool)[: indices.numel()].int()
        wrapper._paged_kv_indptr_buf, wrapper._paged_kv_indices_buf, wrapper._paged_kv_last_page_len_buf = indptr, indices, last
        batch = len(lengths)
        if use_tensor_cores:
            qo_indptr_host = decode._get_range_buf(batch + 1, "cpu")
            kv_lens = aotinfer.get_seq_lens(indptr, last, page_size)
            wrapper._plan_info = wrapper._cached_module.plan(
                wrapper._float_workspace_buffer, wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer,
                qo_indptr_host, indptr, kv_lens, batch, batch, heads[0], heads[1], page_size,
                wrapper.is_cuda_graph_enabled, heads[2], heads[2], False,
            )  # fmt: skip
        else:
            wrapper._plan_info = wrapper._cached_module.plan(
                wrapper._float_workspace_buffer, wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer,
                indptr, batch, heads[0], heads[1], page_size, wrapper.is_cuda_graph_enabled, -1, 0.0, heads[2], heads[2],
                torch.empty(0, dtype=torch.float16), torch.empty(0, dtype=torch.float16),
            )  # fmt: skip
        wrapper._window_left, wrapper._logits_soft_cap, wrapper._sm_scale = -1, 0.0, scale
        q = torch.randn(batch, 16, 64).half()
        keys, values = gather(k, v, indptr, indices, last, "NHD")
        want, _ = reference(q, keys, values, scale)
        check(wrapper.run(q, cache), want, torch.float16)


def test_cuda_graph_mode_keeps_its_tables_in_place(kernel_model):
    # The tables, the page ids and the partial results keep their addresses and shapes between
    # plans, and a run captured once (here: the same arguments) stays right after a new plan.
    heads, page_size, batch = (16, 4, 64), 16, 4
    buffers = dict(
        paged_kv_indptr_buffer=torch.empty(batch + 1, dtype=torch.int32),
        paged_kv_indices_buffer=torch.empty(1000, dtype=torch.int32),
        paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32),
    )
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cpu", 16 << 20), "NHD", use_cuda_graph=True, **buffers)
    pool = 900
    cache, k, v = kv_pool(pool, page_size, 4, 64, torch.float16, "NHD", "tuple", "cpu")
    q = torch.randn(batch, 16, 64).half()
    seen = None
    for lengths in ([3, 17, 40, 2], [4000, 5, 0, 700], [16, 1, 2, 3]):
        indptr, indices, last, _ = page_table(lengths, page_size)
        indices = torch.randperm(pool)[: indices.numel()].int()
        wrapper.plan(indptr, indices, last, *heads, page_size)
        plan = wrapper._plan
        layout = [(t.data_ptr(), tuple(t.shape)) for t in (plan.work, plan.requests, plan.indices, plan.partial_out, plan.partial_lse)]
        assert seen is None or layout == seen
        seen = layout
        assert plan.max_partials == plan.work.shape[0] == decode.target_items(132, 16, 4)
        assert torch.equal(buffers["paged_kv_indices_buffer"][: indices.numel()], indices)
        assert torch.equal(buffers["paged_kv_indptr_buffer"], indptr)
        keys, values = gather(k, v, indptr, indices, last, "NHD")
        want, want_lse = reference(q, keys, values, 1 / 8)
        out, lse = wrapper.run(q, cache, return_lse=True)
        check(out, want, torch.float16, lse, want_lse)


def test_steps_that_read_a_few_l2s_cache_k_and_v_evict_first(kernel_model):
    # The plan's cache policy for K and V (decode._READ_ONCE_L2S): evict-first while a step reads
    # at most 4 L2s (the CPU plan assumes 50 MiB) of K and V, counting the window and the dtype,
    # and one CTA reads each KV head's lines (groups of up to 16 query heads).
    def plan(lengths, kv_data_type=torch.float16, window_left=-1, qo_heads=32):
        wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cpu", 64 << 20))
        indptr, indices, last, _ = page_table(lengths, 16)
        wrapper.plan(indptr, indices, last, qo_heads, 8, 128, 16, kv_data_type=kv_data_type, window_left=window_left)
        return wrapper._plan.kv_read_once

    per_token = 8 * 128 * 2 * 2  # bytes of K and V a token: 8 KV heads, head_dim 128, fp16
    most = 4 * (50 << 20) // per_token  # 51200 tokens
    assert plan([most // 2, most - most // 2]) == 1
    assert plan([most // 2, most - most // 2 + 1]) == 0
    assert plan([most + 1, 7], kv_data_type=torch.float8_e4m3fn) == 1  # a byte an element
    assert plan([3 * most, most], window_left=1000) == 1  # 2002 positions attended
    assert plan([100, 200], qo_heads=128) == 1 and plan([100, 200], qo_heads=136) == 0  # groups of 16 and 17
    assert decode.reads_once(most, 32, 8, 128, 2, 50 << 20) and not decode.reads_once(most + 1, 32, 8, 128, 2, 50 << 20)


# ---- argument errors (CPU) ----------------------------------------------------------------------


def planned_wrapper(**options):
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cpu", 1 << 20))
    indptr, indices, last, _ = page_table([5, 40], 16)
    wrapper.plan(indptr, indices, last, 8, 8, 128, 16, **options)
    return wrapper


def plan_call(**changes):
    indptr, indices, last, _ = page_table([5, 40, 0], 16)
    arguments = dict(indptr=indptr, indices=indices, last_page_len=last, num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16)
    arguments.update(changes)
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cpu", 1 << 20))
    return lambda: wrapper.plan(**arguments)


PLAN_ERRORS = [
    (dict(indptr=torch.tensor([0, 1, 3, 3])), TypeError, "Expected indptr to have dtype int32, got int64"),
    (dict(indices=torch.arange(3)), TypeError, "Expected indices to have dtype int32, got int64"),
    (dict(last_page_len=torch.tensor([5, 8, 0])), TypeError, "Expected last_page_len to have dtype int32, got int64"),
    (dict(indptr=[0, 1, 3, 3]), TypeError, "Expected indptr to be a torch.Tensor"),
    (dict(num_qo_heads=6, num_kv_heads=4), ValueError, r"num_qo_heads \(6\) to be a multiple of num_kv_heads \(4\)"),
    (dict(head_dim=96), ValueError, "head_dim 96 is not supported: supported head dims are 64, 128, 256"),
    (dict(page_size=0), ValueError, "page_size to be at least 1"),
    (dict(pos_encoding_mode="ALIBI"), NotImplementedError, "pos_encoding_mode='ALIBI' is not implemented"),
    (dict(pos_encoding_mode="ROPE_LLAMA", kv_data_type=torch.float8_e4m3fn), NotImplementedError,
     "'ROPE_LLAMA' with a float8_e4m3fn KV cache is not implemented"),
    (dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=0.0), ValueError, "Expected rope_theta to be None or positive"),
    (dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=float("inf")), ValueError, "Expected rope_scale to be None or positive"),
    (dict(pos_encoding_mode="rope"), ValueError, "Expected pos_encoding_mode to be one of"),
    (dict(window_left=-2), ValueError, "window_left to be at least -1"),
    (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
    (dict(sm_scale="0.1"), TypeError, "Expected sm_scale to be a real number"),
    (dict(q_data_type=torch.float32), ValueError, "Expected q_data_type to be float16 or bfloat16, got float32"),
    (dict(q_data_type="half_float"), TypeError, "Expected q_data_type to be a torch.dtype"),
    (dict(kv_data_type=torch.bfloat16), ValueError, "Expected kv_data_type to be q_data_type \\(float16\\)"),
    (dict(o_data_type=torch.float32), NotImplementedError, "o_data_type=float32 is not implemented"),
    (dict(fixed_split_size=1.5), TypeError, "Expected fixed_split_size to be an integer"),
    (dict(indptr=torch.tensor([0, 1, 3], dtype=torch.int32)), ValueError, "indptr to have batch_size \\+ 1 = 4 elements"),
    (dict(indptr=torch.tensor([0, 1, 9, 9], dtype=torch.int32)), ValueError, "up to len\\(indices\\) = 4"),
    (dict(last_page_len=torch.tensor([5, 17, 0], dtype=torch.int32)), ValueError, "last_page_len in 0..page_size \\(16\\)"),
    (dict(last_page_len=torch.tensor([5, 8, 3], dtype=torch.int32)), ValueError, "0 for requests without pages"),
    (dict(seq_lens=torch.tensor([5, 40, 1])), ValueError, "seq_lens to hold 3 lengths, each at most"),
]


@pytest.mark.parametrize("changes, error, message", PLAN_ERRORS, ids=[m[:40] for _, _, m in PLAN_ERRORS])
def test_plan_errors(changes, error, message):
    with pytest.raises(error, match=message):
        plan_call(**changes)()


def test_wrapper_errors():
    with pytest.raises(ValueError, match="Expected kv_layout to be 'NHD' or 'HND', got 'NDH'"):
        aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cpu", 1024), "NDH")
    with pytest.raises(ValueError, match="Expected backend to be one of"):
        aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cpu", 1024), backend="flash")
    with pytest.raises(ValueError, match="paged_kv_indptr_buffer must be a torch.Tensor when use_cuda_graph=True"):
        aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cpu", 1024), use_cuda_graph=True)
    with pytest.raises(TypeError, match="Expected paged_kv_indices_buffer to have dtype int32, got int64"):
        aotinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace("cpu", 1024), use_cuda_graph=True, paged_kv_indptr_buffer=torch.zeros(3, dtype=torch.int32),
            paged_kv_indices_buffer=torch.zeros(3, dtype=torch.int64), paged_kv_last_page_len_buffer=torch.zeros(2, dtype=torch.int32),
        )  # fmt: skip
    with pytest.raises(ValueError, match="paged_kv_indptr_buffer to have batch_size \\+ 1 = 3 elements"):
        aotinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace("cpu", 1024), use_cuda_graph=True, paged_kv_indptr_buffer=torch.zeros(2, dtype=torch.int32),
            paged_kv_indices_buffer=torch.zeros(3, dtype=torch.int32), paged_kv_last_page_len_buffer=torch.zeros(2, dtype=torch.int32),
        )  # fmt: skip
    with pytest.raises(ValueError, match="float_workspace_buffer must be 16-byte aligned"):
        aotinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1024, dtype=torch.uint8)[1:])
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("cpu", 1024))
    with pytest.raises(RuntimeError, match="call plan\\(\\) first"):
        wrapper.run(torch.randn(2, 8, 128).half(), torch.randn(4, 2, 16, 8, 128).half())
    with pytest.raises(ValueError, match="float_workspace_buffer holds 1024 bytes, this plan needs"):
        wrapper.plan(torch.tensor([0, 300], dtype=torch.int32), torch.arange(300, dtype=torch.int32),
                     torch.tensor([1], dtype=torch.int32), 8, 8, 128, 16)  # fmt: skip
    # With CUDA graphs the batch size is that of the buffers.
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace("cpu", 1 << 20), use_cuda_graph=True, paged_kv_indptr_buffer=torch.zeros(3, dtype=torch.int32),
        paged_kv_indices_buffer=torch.zeros(3, dtype=torch.int32), paged_kv_last_page_len_buffer=torch.zeros(2, dtype=torch.int32),
    )  # fmt: skip
    with pytest.raises(ValueError, match="The batch size is fixed under use_cuda_graph: got 1"):
        wrapper.plan(torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32), 8, 8, 128, 16)
    with pytest.raises(ValueError, match="at most 3 indices"):
        wrapper.plan(torch.tensor([0, 1, 4], dtype=torch.int32), torch.zeros(4, dtype=torch.int32), torch.tensor([3, 3], dtype=torch.int32), 8, 8, 128, 16)


def test_run_errors():
    q, cache = torch.randn(2, 8, 128).half(), torch.randn(4, 2, 16, 8, 128).half()
    wrapper = planned_wrapper(window_left=50)
    with pytest.raises(ValueError, match="The dtype of q torch.bfloat16 does not match the q_data_type torch.float16"):
        wrapper.run(q.bfloat16(), cache)
    with pytest.raises(ValueError, match="The dtype of k torch.bfloat16 does not match the kv_data_type torch.float16"):
        wrapper.run(q, cache.bfloat16())
    with pytest.raises(ValueError, match=r"Expected q to have the planned shape .* = \[2, 8, 128\], got \[3, 8, 128\]"):
        wrapper.run(torch.randn(3, 8, 128).half(), cache)
    with pytest.raises(ValueError, match="Expected paged_kv_cache to have shape"):
        wrapper.run(q, torch.randn(4, 3, 16, 8, 128).half())
    with pytest.raises(ValueError, match="pair, got 3 tensors"):
        wrapper.run(q, (cache[:, 0], cache[:, 1], cache[:, 1]))
    with pytest.raises(TypeError, match="Expected paged_kv_cache to be a torch.Tensor or a \\(k_cache, v_cache\\) tuple, got dict"):
        wrapper.run(q, {})
    with pytest.raises(ValueError, match="planned page_size 16, got 8"):
        wrapper.run(q, torch.randn(8, 2, 8, 8, 128).half())
    with pytest.raises(ValueError, match="window_left=60 attends positions that plan \\(window_left=50\\) did not assign"):
        wrapper.run(q, cache, window_left=60)
    with pytest.raises(ValueError, match="window_left=-1 attends positions"):
        wrapper.forward(q, cache)  # forward's default window is the whole sequence
    with pytest.raises(TypeError, match="Expected k_scale to be a real number, got str"):
        wrapper.run(q, cache, k_scale="1")
    with pytest.raises(TypeError, match="Expected enable_pdl to be None, True or False"):
        wrapper.run(q, cache, enable_pdl=1)
    with pytest.raises(NotImplementedError, match="pos_encoding_mode='ALIBI' is not implemented"):
        wrapper.forward(q, cache, pos_encoding_mode="ALIBI")
    # What passes the checks reaches the binding, which refuses CPU tensors by name.
    with pytest.raises(ValueError, match="to be a CUDA tensor, got a tensor on cpu"):
        wrapper.run(q, cache, window_left=50)
    with pytest.raises(ValueError, match="to be a CUDA tensor, got a tensor on cpu"):
        wrapper.run(q, cache, window_left=3, skip_check=True)


def test_single_decode_errors():
    q, k = torch.randn(8, 128).half(), torch.randn(30, 8, 128).half()
    with pytest.raises(ValueError, match="Expected kv_layout to be 'NHD' or 'HND'"):
        aotinfer.single_decode_with_kv_cache(q, k, k, kv_layout="NDH")
    with pytest.raises(NotImplementedError, match="pos_encoding_mode='ALIBI' is not implemented"):
        aotinfer.single_decode_with_kv_cache(q, k, k, pos_encoding_mode="ALIBI")
    with pytest.raises(NotImplementedError, match="'ROPE_LLAMA' with a float8_e5m2 KV cache is not implemented"):
        aotinfer.single_decode_with_kv_cache(q, k.to(torch.float8_e5m2), k.to(torch.float8_e5m2), pos_encoding_mode="ROPE_LLAMA")
    with pytest.raises(ValueError, match="Expected q to have shape \\[num_qo_heads, head_dim\\], got \\[1, 8, 128\\]"):
        aotinfer.single_decode_with_kv_cache(q[None], k, k)
    with pytest.raises(ValueError, match="Expected k and v to have one shape"):
        aotinfer.single_decode_with_kv_cache(q, k, k[:20])
    with pytest.raises(TypeError, match="Expected v to be a torch.Tensor, got list"):
        aotinfer.single_decode_with_kv_cache(q, k, [1.0], skip_check=True)
    with pytest.raises(ValueError, match="Expected logits_soft_cap to be None, 0 \\(off\\) or positive"):
        aotinfer.single_decode_with_kv_cache(q, k, k, logits_soft_cap=-2.0)
    with pytest.raises(ValueError, match="to be a CUDA tensor, got a tensor on cpu"):
        aotinfer.single_decode_with_kv_cache(q, k, k)


def test_single_decode_plans_like_the_wrapper():
    # One request split as partition_work splits it for 132 SMs, built on the device by tensor
    # ops (here on the CPU).
    for kv_len, window_left in ((9000, -1), (9000, 300), (37, -1), (0, -1), (32768, 2000)):
        lo = max(kv_len - 1 - window_left, 0) if window_left >= 0 else 0
        fill = decode.target_items(decode._SINGLE_DECODE_SMS, 32, 8)
        chunk = decode.smallest_chunk(kv_len - lo, kv_len, fill, 1, lambda c: decode.num_chunks(lo, kv_len, c))
        work, requests, slots = decode._single_request_tables(kv_len, lo, chunk, torch.device("cpu"))
        p = partition([kv_len], 1, (32, 8, 128), decode._SINGLE_DECODE_SMS, window_left=window_left)
        assert sorted(work.tolist()) == sorted(p.work.tolist()) and torch.equal(requests, p.requests) and slots == p.num_slots


def test_single_decode_traces_without_a_gpu():
    # make_fx records the one binding and the table-building ops.
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(q, k, v):
        return aotinfer.single_decode_with_kv_cache(q, k, v, kv_layout="HND", window_left=100, return_lse=True)

    meta = dict(device="meta", dtype=torch.float16)  # no device to check: the checks run, nothing else
    gm = make_fx(f, tracing_mode="fake")(torch.empty(32, 128, **meta), torch.empty(8, 5000, 128, **meta), torch.empty(8, 5000, 128, **meta))
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("aotinfer.batch_decode.default") == 1


def test_import_stays_free_of_torch():
    out = subprocess.run(
        [sys.executable, "-c", "import sys, aotinfer.decode, aotinfer.cascade; print('torch' in sys.modules)"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.stdout.strip() == "False", out.stderr


def test_run_is_one_custom_op_under_torch_compile():
    # dynamo traces run's Python (views, allocations) and records the binding as the custom op.
    # Meta tensors: the binding's checks pass on their shapes (CPU ones are refused by name while
    # tracing, as eagerly), and the graph runs the checks only.
    case = Case([5, 300, 40], 16, (16, 4, 128), torch.float16, device="meta")
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace("meta", 16 << 20))
    wrapper.plan(case.indptr, case.indices, case.last_page_len, 16, 4, 128, 16, q_data_type=torch.float16)  # CPU tables
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: wrapper.run(q, (k, v), return_lse=True), fullgraph=True, backend=backend)
    out, lse = compiled(case.q, *case.cache)
    assert out.shape == case.q.shape and lse.shape == case.q.shape[:2]
    (graph,) = graphs
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aotinfer.batch_decode) + targets.count(torch.ops.aotinfer.batch_decode.default) == 1


def test_single_decode_template_reference_agrees_with_the_tests():
    from aotinfer.trace.templates.decode import _single_decode_reference

    q, k, v = torch.randn(12, 64), torch.randn(40, 2, 64), torch.randn(40, 2, 64)
    want, _ = reference(q[None], [k], [v], 1 / 8)
    torch.testing.assert_close(_single_decode_reference(q, k, v), want[0], rtol=1e-5, atol=1e-5)
