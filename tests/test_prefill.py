"""Batch prefill attention (aotinfer.prefill) against a float32 reference: the ragged and paged
wrappers' plan and run, single_prefill_with_kv_cache, split keys and their merge, CUDA graphs,
merge_state of a ragged and a paged run; on the CPU, the plan's work partition, the plan driving
a float32 model of the kernel's contract, and argument errors."""

import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import aotinfer
from aotinfer import prefill
from test_decode import LN2, LSE_TOLERANCE, TOLERANCE, gather, kv_pool, merge_into, page_table, poisoned, rope_llama, workspace

gpu = pytest.mark.gpu
HEADS = [  # (num_qo_heads, num_kv_heads, head_dim): group sizes 1, 4, 8 and 6, every head_dim
    (8, 8, 128),
    (16, 4, 64),
    (32, 4, 128),
    (12, 2, 256),
]
HEAD_IDS = [f"h{h}kv{kv}d{d}" for h, kv, d in HEADS]
# "fa2": the kernel of every arch; "fa3": Hopper's (wgmma), on compute capability 9.0 only.
BACKENDS = ["fa2", "fa3"]


def backend_or_skip(backend, head_dim):
    """The backend, or a skip where it does not run (fa3 off Hopper)."""
    if backend == "fa3" and (torch.cuda.get_device_capability() != (9, 0) or head_dim not in prefill._SM90_HEAD_DIMS):
        pytest.skip("backend='fa3' runs on compute capability 9.0")
    return backend


# (q_len, kv_len) pairs: a long prompt, appends (q_len < kv_len), an empty request, one token,
# lengths off the tile sizes, and a request with keys but no queries.
PAIRS = [(300, 300), (17, 530), (0, 0), (1, 1), (129, 200), (64, 64), (0, 40), (200, 1100)]


# ---- reference ---------------------------------------------------------------------------------


def reference(q, qo_indptr, keys, values, sm_scale, causal=False, soft_cap=0.0, window_left=-1, sinks=None, v_scale=1.0,
              masks=None, rope=None):  # fmt: skip
    """float32 prefill attention: (out [tokens, heads, dim], lse [tokens, heads] base 2); ``masks``:
    each request's bool [q_len, kv_len] (True: seen), replacing causal; ``rope``: (rope_scale,
    rope_theta) of ROPE_LLAMA, query i at kv_len - q_len + i and the keys at their positions, each
    turned in float32 and rounded to its dtype (where the kernel keeps it, as FlashInfer's does)."""
    num_heads, head_dim = q.shape[1], values[0].shape[-1] if len(values) else q.shape[2]
    out = torch.zeros(q.shape[0], num_heads, head_dim, device=q.device)
    lse = torch.full((q.shape[0], num_heads), float("-inf"), device=q.device)
    for b in range(len(keys)):
        begin, end = int(qo_indptr[b]), int(qo_indptr[b + 1])
        k, v = keys[b].float().to(q.device), values[b].float().to(q.device)
        q_len, kv_len = end - begin, k.shape[0]
        if q_len == 0:
            continue
        query = q[begin:end].float()
        if rope is not None:
            k = rope_llama(k.cpu(), torch.arange(kv_len), *rope).to(keys[b].dtype).float().to(q.device)
            query = rope_llama(query.cpu(), torch.arange(q_len) + kv_len - q_len, *rope).to(q.dtype).float().to(q.device)
        group = num_heads // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        logits = torch.einsum("qhd,khd->hqk", query, k) * sm_scale
        if soft_cap:
            logits = soft_cap * torch.tanh(logits / soft_cap)
        diagonal = torch.arange(q_len, device=q.device)[:, None] + kv_len - q_len
        j = torch.arange(kv_len, device=q.device)[None, :]
        seen = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device)
        if causal:
            seen &= j <= diagonal
        if window_left >= 0:
            seen &= j >= diagonal - window_left
        if masks is not None:
            seen &= masks[b].to(q.device)
        logits = logits.masked_fill(~seen, float("-inf"))
        terms = logits if sinks is None else torch.cat([logits, sinks.float()[:, None, None].expand(-1, q_len, 1)], -1)
        total = torch.logsumexp(terms, -1)  # [heads, q_len]; -inf where nothing is seen
        probs = torch.exp(logits - total[..., None]).nan_to_num(0.0)
        out[begin:end] = torch.einsum("hqk,khd->qhd", probs, v) * v_scale
        lse[begin:end] = (total / LN2).T
    return out, lse


def check(out, want, dtype, lse=None, want_lse=None):
    assert not out.isnan().any(), "some outputs were not written"
    torch.testing.assert_close(out.float(), want.to(out.device), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    if lse is not None:
        assert not lse.isnan().any(), "some log-sum-exps were not written"
        torch.testing.assert_close(lse, want_lse.to(lse.device), rtol=LSE_TOLERANCE, atol=LSE_TOLERANCE)


def indptr_of(lengths):
    return torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0).to(torch.int32)


class Case:
    """One batch: queries, keys and values ragged or in pages, and the reference inputs. ``heads``:
    (num_qo_heads, num_kv_heads, head_dim), or with v's head_dim fourth."""

    def __init__(self, pairs, heads, dtype, kind="paged", layout="NHD", page_size=16, form="tuple", device="cuda", kv_dtype=None):
        self.num_qo_heads, self.num_kv_heads, self.head_dim = heads[:3]
        self.head_dim_vo = heads[3] if len(heads) > 3 else self.head_dim
        self.kind, self.layout, self.dtype, self.page_size = kind, layout, dtype, page_size
        q_lens, kv_lens = [p[0] for p in pairs], [p[1] for p in pairs]
        self.qo_indptr = indptr_of(q_lens)
        self.q = torch.randn(int(self.qo_indptr[-1]), self.num_qo_heads, self.head_dim, device=device).to(dtype)
        if kind == "ragged":
            self.kv_indptr = indptr_of(kv_lens)
            total = int(self.kv_indptr[-1])
            shape = (total, self.num_kv_heads) if layout == "NHD" else (self.num_kv_heads, total)
            self.k = torch.randn(*shape, self.head_dim, device=device).to(dtype)
            self.v = torch.randn(*shape, self.head_dim_vo, device=device).to(dtype)
            k_nhd = self.k if layout == "NHD" else self.k.transpose(0, 1)
            v_nhd = self.v if layout == "NHD" else self.v.transpose(0, 1)
            self.keys = [k_nhd[int(self.kv_indptr[b]) : int(self.kv_indptr[b + 1])] for b in range(len(pairs))]
            self.values = [v_nhd[int(self.kv_indptr[b]) : int(self.kv_indptr[b + 1])] for b in range(len(pairs))]
        else:
            self.indptr, self.indices, self.last_page_len, pool = page_table(kv_lens, page_size)
            self.cache, k, v = kv_pool(pool, page_size, self.num_kv_heads, self.head_dim, kv_dtype or dtype, layout, form, device)
            if self.head_dim_vo != self.head_dim:  # V of its own width: a (k, v) pair of pools
                _, _, v = kv_pool(pool, page_size, self.num_kv_heads, self.head_dim_vo, kv_dtype or dtype, layout, "tuple", device)
                slot_axis = 1 if layout == "NHD" else 2
                self.cache = (k, v) if page_size > 1 else (k.squeeze(slot_axis), v.squeeze(slot_axis))
            self.keys, self.values = gather(k, v, self.indptr, self.indices, self.last_page_len, layout)

    def wrapper(self, device="cuda", nbytes=128 << 20, **kwargs):
        cls = aotinfer.BatchPrefillWithRaggedKVCacheWrapper if self.kind == "ragged" else aotinfer.BatchPrefillWithPagedKVCacheWrapper
        return cls(workspace(device, nbytes), self.layout, **kwargs)

    def plan(self, wrapper, **options):
        device = wrapper.device
        heads = (self.num_qo_heads, self.num_kv_heads, self.head_dim)
        if self.head_dim_vo != self.head_dim:
            options = dict(options, head_dim_vo=self.head_dim_vo)
        if self.kind == "ragged":
            wrapper.plan(self.qo_indptr.to(device), self.kv_indptr.to(device), *heads, q_data_type=self.dtype, **options)
        else:
            wrapper.plan(
                self.qo_indptr.to(device), self.indptr.to(device), self.indices.to(device), self.last_page_len.to(device),
                *heads, self.page_size, q_data_type=self.dtype, **options,
            )  # fmt: skip

    def run(self, wrapper, **kwargs):
        if self.kind == "ragged":
            return wrapper.run(self.q, self.k, self.v, **kwargs)
        return wrapper.run(self.q, self.cache, **kwargs)

    def reference(self, k_scale=1.0, **options):
        """The reference over the keys and values as float32 (an fp8 cache's dequantized: K times
        k_scale; V times v_scale, an option)."""
        options.setdefault("sm_scale", 1 / math.sqrt(self.head_dim))
        keys = self.keys if k_scale == 1.0 else [k.float() * k_scale for k in self.keys]
        return reference(self.q, self.qo_indptr, keys, self.values, **options)


# ---- the batch wrappers on a GPU ---------------------------------------------------------------


@gpu
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind", ["ragged", "paged"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_prefill(backend, kind, causal, layout, dtype, heads):
    case = Case(PAIRS, heads, dtype, kind, layout)
    wrapper = case.wrapper(backend=backend_or_skip(backend, heads[2]))
    case.plan(wrapper, causal=causal)
    want, want_lse = case.reference(causal=causal)
    out, lse = poisoned(case.q.shape, dtype), poisoned(case.q.shape[:2], torch.float32)
    result = case.run(wrapper, out=out, lse=lse, return_lse=True)
    assert result[0] is out and result[1] is lse
    check(out, want, dtype, lse, want_lse)
    check(case.run(wrapper), want, dtype)  # no lse: the kernel's other path
    out2, lse2 = wrapper.run_return_lse(case.q, *((case.k, case.v) if kind == "ragged" else (case.cache,)))
    check(out2, want, dtype, lse2, want_lse)


OPTIONS = {  # plan options, run options, reference options
    "soft_cap": (dict(logits_soft_cap=2.0), {}, dict(soft_cap=2.0)),
    "window": (dict(window_left=40), {}, dict(window_left=40)),
    "causal_window": (dict(causal=True, window_left=33), {}, dict(causal=True, window_left=33)),
    "sm_scale": (dict(sm_scale=0.3, causal=True), {}, dict(sm_scale=0.3, causal=True)),
    "sinks": (dict(causal=True), "sinks", dict(causal=True)),
    "scales": (dict(causal=True), dict(q_scale=0.8, k_scale=0.6, v_scale=1.7), dict(causal=True, sm_scale=0.48 / math.sqrt(128), v_scale=1.7)),
    "window_by_run": (dict(causal=True), dict(window_left=20), dict(causal=True, window_left=20)),
    "all": (dict(causal=True, logits_soft_cap=3.0, window_left=100, sm_scale=0.2), "sinks", dict(causal=True, soft_cap=3.0, window_left=100, sm_scale=0.2)),
}
PAGED_ONLY = ("sinks", "scales", "window_by_run", "all")


@gpu
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kind", ["ragged", "paged"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_options(backend, kind, layout, dtype, page_size, option):
    if kind == "ragged" and (option in PAGED_ONLY or page_size != 1):
        pytest.skip("a paged-wrapper option (ragged KV has no pages)")
    case = Case(PAIRS, (16, 4, 128), dtype, kind, layout, page_size)
    plan_options, run_options, reference_options = (dict(o) if isinstance(o, dict) else o for o in OPTIONS[option])
    if run_options == "sinks":
        sinks = torch.randn(16, device="cuda") * 2
        run_options, reference_options["sinks"] = dict(sinks=sinks), sinks
    wrapper = case.wrapper(backend=backend_or_skip(backend, 128))
    case.plan(wrapper, **plan_options)
    want, want_lse = case.reference(**reference_options)
    out, lse = case.run(wrapper, out=poisoned(case.q.shape, dtype), return_lse=True, **run_options)
    check(out, want, dtype, lse, want_lse)


# ---- RoPE inside the kernel (pos_encoding_mode="ROPE_LLAMA") ----------------------------------

ROPES = {"default": (None, None), "scaled": (2.0, 5e5)}  # (rope_scale, rope_theta) as plan takes them


def rope_of(name):
    """The plan options of a ROPES entry, and the reference's (rope_scale, rope_theta)."""
    scale, theta = ROPES[name]
    return dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=scale, rope_theta=theta), (scale or 1.0, theta or 1e4)


@gpu
@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_rope_llama(kind, causal, layout, dtype, heads, rope):
    """q and k turned inside the kernel, against attention over q and k turned in float32; "auto"
    runs the kernel of every arch, as FlashInfer's gives RoPE to fa2."""
    case = Case(PAIRS, heads, dtype, kind, layout)
    wrapper = case.wrapper(backend="auto")
    options, want_rope = rope_of(rope)
    case.plan(wrapper, causal=causal, **options)
    assert wrapper._plan.binding is prefill._batch_prefill
    want, want_lse = case.reference(causal=causal, rope=want_rope)
    out, lse = case.run(wrapper, out=poisoned(case.q.shape, dtype), lse=poisoned(case.q.shape[:2], torch.float32),
                        return_lse=True)  # fmt: skip
    check(out, want, dtype, lse, want_lse)


@gpu
@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("options", [dict(causal=True), dict(causal=True, window_left=300, logits_soft_cap=4.0), "mask"],
                         ids=["causal", "window-cap", "mask"])  # fmt: skip
def test_rope_llama_with_split_keys_and_options(options, page_size):
    """Long keys split over items and merged, pages off the copies' runs (5), a window and soft cap,
    a custom mask: each key is turned at its own position wherever its tile starts."""
    pairs = [(37, 5000), (300, 300), (1, 2049)]
    case = Case(pairs, (16, 4, 128), torch.float16, "paged", "NHD", page_size)
    wrapper = case.wrapper()
    reference_options = dict(rope=(1.0, 1e4))
    if options == "mask":
        masks = random_masks(pairs, seed=3)
        options = mask_forms(masks, "packed")
        reference_options["masks"] = masks
    else:
        reference_options.update(causal=True, window_left=options.get("window_left", -1), soft_cap=options.get("logits_soft_cap", 0.0))
    case.plan(wrapper, pos_encoding_mode="ROPE_LLAMA", **options)
    assert wrapper._plan.partition.num_slots > 0, "the case should split some request"
    want, want_lse = case.reference(**reference_options)
    out, lse = case.run(wrapper, out=poisoned(case.q.shape, torch.float16), return_lse=True)
    check(out, want, torch.float16, lse, want_lse)


@gpu
@pytest.mark.parametrize("heads", [(8, 8, 64), (32, 8, 128), (12, 2, 256)], ids=["g1d64", "g4d128", "g6d256"])
@pytest.mark.parametrize("lengths", [(300, 300), (37, 900), (1, 1)], ids=str)
def test_single_prefill_rope_llama(lengths, heads):
    case = Case([lengths], heads, torch.bfloat16, "ragged")
    out = aotinfer.single_prefill_with_kv_cache(case.q, case.k, case.v, causal=True, pos_encoding_mode="ROPE_LLAMA",
                                                rope_theta=5e5)  # fmt: skip
    want, _ = case.reference(causal=True, rope=(1.0, 5e5))
    check(out, want, torch.bfloat16)


@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_rope_llama_drives_the_kernel_contract(kernel_model, kind):
    """The wrappers hand the binding pos_encoding_mode 1 with rope_scale and rope_theta (its model
    turns q and k as the kernel does), and forward's options replace the planned ones."""
    torch.manual_seed(0)
    case = Case(CPU_PAIRS, (8, 2, 64), torch.float16, kind, page_size=8, device="cpu")
    wrapper = case.wrapper("cpu", 16 << 20)
    case.plan(wrapper, causal=True, pos_encoding_mode="ROPE_LLAMA", rope_scale=4.0, rope_theta=1e6)
    want, want_lse = case.reference(causal=True, rope=(4.0, 1e6))
    out, lse = case.run(wrapper, out=poisoned(case.q.shape, torch.float16, "cpu"), return_lse=True)
    check(out, want, torch.float16, lse, want_lse)
    args = (case.q, case.k, case.v) if kind == "ragged" else (case.q, case.cache)
    check(wrapper.forward(*args, causal=True), case.reference(causal=True)[0], torch.float16)  # NONE: forward's default


def test_rope_llama_refusals():
    """What RoPE inside the kernel does not take, named before anything runs."""
    with pytest.raises(NotImplementedError, match="'ROPE_LLAMA' on backend='fa3' is not implemented"):
        prefill.use_sm90("fa3", torch.device("cpu"), 128, torch.float16, torch.float16, rope=True)
    assert not prefill.use_sm90("auto", torch.device("cpu"), 128, torch.float16, torch.float16, rope=True)
    q = torch.randn(5, 8, 192, dtype=torch.float16)
    k, v = torch.randn(5, 8, 192, dtype=torch.float16), torch.randn(5, 8, 128, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="head_dim_qk 192 and head_dim_vo 128 is not implemented"):
        aotinfer.single_prefill_with_kv_cache(q, k, v, pos_encoding_mode="ROPE_LLAMA")
    with pytest.raises(ValueError, match="Expected rope_theta to be None or positive"):
        aotinfer.single_prefill_with_kv_cache(q, k, v, pos_encoding_mode="ROPE_LLAMA", rope_theta=-1.0)


@gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["positional", "keyword"])
def test_attention_sink_wrapper(form, backend):
    # gpt-oss: 64 query heads over 8, head_dim 64, a sliding window, a sink logit per head, the
    # sm_scale given to run; prefill and decode (one query token a request) batches.
    sinks = torch.randn(64, device="cuda") * 2
    for pairs in (PAIRS, [(1, 700), (1, 1), (1, 129), (1, 40)]):
        case = Case(pairs, (64, 8, 64), torch.bfloat16, "paged", "NHD", 16)
        wrapper = aotinfer.BatchAttentionWithAttentionSinkWrapper(
            workspace("cuda"), "NHD", backend=backend_or_skip(backend, 64), q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16, head_dim_qk=64, head_dim_vo=64, window_left=127)
        # positional: run's sm_scale replaces the planned default 1/8 for the call
        case.plan(wrapper, causal=True, window_left=127, **({} if form == "positional" else dict(sm_scale=0.11)))
        want, want_lse = case.reference(causal=True, window_left=127, sinks=sinks, sm_scale=0.11)
        out = poisoned(case.q.shape, torch.bfloat16)
        if form == "positional":
            out, lse = wrapper.run(case.q, case.cache, sinks, 0.11, out=out, return_lse=True)
        else:
            out, lse = wrapper.run(case.q, case.cache, sinks=sinks, out=out, return_lse=True)
        check(out, want, torch.bfloat16, lse, want_lse)


def test_attention_sink_wrapper_arguments():
    wrapper = aotinfer.BatchAttentionWithAttentionSinkWrapper(torch.empty(1 << 20, dtype=torch.uint8), head_dim_qk=64,
                                                              head_dim_vo=64)
    q, cache, sinks = torch.randn(4, 8, 64), torch.randn(3, 2, 16, 8, 64), torch.randn(8)
    with pytest.raises(TypeError, match="sinks and sm_scale after the cache, got 3"):
        wrapper.run(q, cache, sinks, 0.1, 1)
    with pytest.raises(TypeError, match="sinks both positionally and by keyword"):
        wrapper.run(q, cache, sinks, sinks=sinks)
    with pytest.raises(ValueError, match="Expected sm_scale to be a positive number, got -1"):
        wrapper.run(q, cache, sinks, -1)
    with pytest.raises(NotImplementedError, match="pos_encoding_mode='ALIBI' is not implemented"):
        aotinfer.BatchAttentionWithAttentionSinkWrapper(torch.empty(16, dtype=torch.uint8), pos_encoding_mode="ALIBI")
    with pytest.raises(ValueError, match="Expected q_data_type to be float16 or bfloat16"):
        aotinfer.BatchAttentionWithAttentionSinkWrapper(torch.empty(16, dtype=torch.uint8), q_data_type=torch.float32)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp8_paged_kv_cache(causal, layout, kv_dtype, dtype, heads, page_size):
    # Against the float32 reference over the dequantized pages: K times k_scale, V times v_scale.
    case = Case(PAIRS, heads, dtype, "paged", layout, page_size, kv_dtype=kv_dtype)
    wrapper = case.wrapper()
    case.plan(wrapper, causal=causal, kv_data_type=kv_dtype)
    want, want_lse = case.reference(causal=causal, k_scale=0.7, v_scale=1.3)
    out, lse = poisoned(case.q.shape, dtype), poisoned(case.q.shape[:2], torch.float32)
    result = case.run(wrapper, k_scale=0.7, v_scale=1.3, out=out, lse=lse, return_lse=True)
    assert result[0] is out and result[1] is lse
    check(out, want, dtype, lse, want_lse)
    want = case.reference(causal=causal)[0]  # no scales, no lse
    check(case.run(wrapper, out=poisoned(case.q.shape, dtype)), want, dtype)


@gpu
@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
@pytest.mark.parametrize("heads", [(32, 8, 128), (8, 8, 64), (16, 2, 256)], ids=["g4d128", "g1d64", "g8d256"])
def test_fp8_split_keys_options_and_page_sizes_off_the_runs(heads, kv_dtype):
    # Long keys split and merged (v_scale on the partials), sinks, soft cap and window, a page
    # size that is no multiple of a thread's run of rows, q bfloat16 (converted to half).
    pairs = [(40, 3000), (1, 900), (130, 2000), (0, 70)]
    case = Case(pairs, heads, torch.bfloat16, "paged", "HND", page_size=5, kv_dtype=kv_dtype)
    wrapper = case.wrapper()
    case.plan(wrapper, causal=True, window_left=1500, logits_soft_cap=4.0, kv_data_type=kv_dtype)
    assert wrapper._plan.partition.num_slots > 0, "the case should split some request"
    sinks = torch.randn(heads[0], device="cuda")
    want, want_lse = case.reference(causal=True, window_left=1500, soft_cap=4.0, sinks=sinks, k_scale=0.5, v_scale=0.25)
    out, lse = case.run(wrapper, out=poisoned(case.q.shape, torch.bfloat16), return_lse=True, sinks=sinks, k_scale=0.5, v_scale=0.25)
    check(out, want, torch.bfloat16, lse, want_lse)


@gpu
def test_fp8_cache_checked_against_the_plan():
    case = Case([(10, 40)], (8, 8, 64), torch.float16, "paged", kv_dtype=torch.float8_e4m3fn)
    wrapper = case.wrapper()
    case.plan(wrapper)  # kv_data_type: q's
    with pytest.raises(ValueError, match="kv_data_type"):
        case.run(wrapper)
    case.plan(wrapper, kv_data_type=torch.float8_e5m2)
    with pytest.raises(ValueError, match="kv_data_type"):
        case.run(wrapper)
    ragged = Case([(10, 40)], (8, 8, 64), torch.float16, "ragged")
    wrapper = ragged.wrapper()
    ragged.plan(wrapper)
    fp8_k, fp8_v = ragged.k.to(torch.float8_e4m3fn), ragged.v.to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="k"):  # the binding: fp8 KV is paged only
        wrapper.run(ragged.q, fp8_k, fp8_v, skip_check=True)


@gpu
@pytest.mark.parametrize("mode", ["auto", "fixed_split_size", "disable_split_kv"])
@pytest.mark.parametrize("heads", [(32, 8, 128), (8, 8, 64), (16, 2, 256)], ids=["g4d128", "g1d64", "g8d256"])
@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_long_keys_split_and_merge(kind, heads, mode):
    # Few query tiles and long keys: the plan splits the keys (unless told not to) and merges.
    pairs = [(40, 9000), (1, 3000), (130, 5000), (0, 700)]
    case = Case(pairs, heads, torch.bfloat16, kind)
    split = dict(fixed_split_size=1024 // case.page_size if kind == "paged" else 1024)  # pages, or tokens for ragged KV
    options = {"auto": {}, "fixed_split_size": split, "disable_split_kv": dict(disable_split_kv=True)}[mode]
    wrapper = case.wrapper()
    case.plan(wrapper, causal=True, **options)
    assert (wrapper._plan.partition.num_slots > 0) == (mode != "disable_split_kv")
    want, want_lse = case.reference(causal=True)
    out, lse = case.run(wrapper, out=poisoned(case.q.shape, torch.bfloat16), return_lse=True)
    check(out, want, torch.bfloat16, lse, want_lse)
    sinks = torch.randn(heads[0], device="cuda")
    if kind == "paged":  # sinks are added once, by the merge, to split requests; v_scale scales the partials
        want, want_lse = case.reference(causal=True, sinks=sinks, v_scale=0.5)
        out, lse = case.run(wrapper, return_lse=True, sinks=sinks, v_scale=0.5)
        check(out, want, torch.bfloat16, lse, want_lse)


@gpu
@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_batch_invariant_and_deterministic(kind):
    pairs = [(70, 3000), (5, 10)]
    case = Case(pairs, (32, 8, 128), torch.bfloat16, kind)
    alone = Case(pairs[:1], (32, 8, 128), torch.bfloat16, kind)
    alone.q = case.q[:70].clone()
    if kind == "ragged":
        alone.k, alone.v = case.k[:3000], case.v[:3000]
    else:
        alone.cache, alone.indices, alone.indptr, alone.last_page_len = case.cache, case.indices, case.indptr[:2], case.last_page_len[:1]
    # The last: vLLM's batch-invariant mode (its decode passes 2048 and disable_split_kv too).
    for options in (dict(fixed_split_size=32), dict(disable_split_kv=True), dict(fixed_split_size=4096, disable_split_kv=True)):
        wrapper = case.wrapper()
        case.plan(wrapper, causal=True, **options)
        first, second = case.run(wrapper), case.run(wrapper)
        assert torch.equal(first, second)
        wrapper_alone = alone.wrapper()
        alone.plan(wrapper_alone, causal=True, **options)
        assert torch.equal(alone.run(wrapper_alone), first[:70])


@gpu
@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_forward_overrides_the_planned_options(kind):
    case = Case(PAIRS, (16, 4, 64), torch.float16, kind)
    wrapper = case.wrapper()
    case.plan(wrapper)  # not causal, no cap, default scale
    options = dict(causal=True, logits_soft_cap=5.0, sm_scale=0.11, window_left=50)
    kv = (case.k, case.v) if kind == "ragged" else (case.cache,)
    want, want_lse = case.reference(causal=True, soft_cap=5.0, sm_scale=0.11, window_left=50)
    check(wrapper.forward(case.q, *kv, **options), want, torch.float16)
    out, lse = wrapper.forward_return_lse(case.q, *kv, **options)
    check(out, want, torch.float16, lse, want_lse)
    check(case.run(wrapper), want, torch.float16)  # the options stay, as FlashInfer's
    wrapper.end_forward()


@gpu
@pytest.mark.parametrize("ctas", [None, 3], ids=["a block an item", "blocks stride"])
@pytest.mark.parametrize("kind", ["ragged", "paged"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_blocks_take_the_heads_a_few_at_a_time(backend, kind, ctas):
    # The plan's count of heads that blocks share (work[0, 1]) only orders the blocks: every count,
    # dividing the heads or not, gives the same attention, with a block an item or blocks striding.
    case = Case(PAIRS, (10, 5, 64), torch.bfloat16, kind)
    wrapper = case.wrapper(backend=backend_or_skip(backend, 64))
    case.plan(wrapper, causal=True)
    want, want_lse = case.reference(causal=True)
    if ctas is not None:
        wrapper._plan.ctas = ctas
    for heads in (1, 2, 3, 5):
        wrapper._plan.work[0, 1] = heads
        out, lse = poisoned(case.q.shape, torch.bfloat16), poisoned(case.q.shape[:2], torch.float32)
        case.run(wrapper, out=out, lse=lse, return_lse=True)
        check(out, want, torch.bfloat16, lse, want_lse)


@gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_plan_after_a_captured_run_is_refused(kind, backend):
    """A wrapper made without use_cuda_graph may capture and replay a run under its plan; a new
    plan would have the replays launch the captured grid over other tables, so it is refused."""
    case = Case([(30, 200), (5, 900)], (8, 2, 128), torch.float16, kind)
    wrapper = case.wrapper(backend=backend_or_skip(backend, 128))
    case.plan(wrapper, causal=True)
    out = torch.empty_like(case.q)
    case.run(wrapper, out=out)
    torch.cuda.synchronize()
    case.plan(wrapper, causal=True)  # eager runs: planning again is fine
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.run(wrapper, out=out)
    out.fill_(float("nan"))
    graph.replay()  # the plan it was captured under: right
    torch.cuda.synchronize()
    want, _ = case.reference(causal=True)
    check(out, want, torch.float16)
    with pytest.raises(RuntimeError, match="captured into a CUDA graph.*use_cuda_graph=True"):
        case.plan(wrapper, causal=True)


# ---- custom masks --------------------------------------------------------------------------------


def random_masks(pairs, density=0.5, seed=0):
    """Each request's bool [q_len, kv_len] mask, fresh at random; a request's first query (where
    it has queries and keys) sees nothing (FlashInfer's output for such a row: zeros, LSE -inf)."""
    generator = torch.Generator().manual_seed(seed)
    masks = [torch.rand(q, kv, generator=generator) < density for q, kv in pairs]
    for mask in masks:
        if mask.numel():
            mask[0] = False
    return masks


def tree_masks(pairs, seed=0):
    """EAGLE tree verification: each request's last q_len keys are draft tokens whose parents are
    random earlier drafts (the first's: the prefix); a draft sees the whole prefix, its
    ancestors and itself."""
    generator = torch.Generator().manual_seed(seed)
    masks = []
    for q_len, kv_len in pairs:
        prefix = kv_len - q_len
        mask = torch.zeros(q_len, kv_len, dtype=torch.bool)
        mask[:, :prefix] = True
        for i in range(q_len):
            parent = int(torch.randint(0, i, (1,), generator=generator)) if i else -1
            if parent >= 0:
                mask[i, prefix : prefix + i] = mask[parent, prefix : prefix + i]
            mask[i, prefix + i] = True
        masks.append(mask)
    return masks


def causal_masks(pairs):
    return [torch.ones(q, kv, dtype=torch.bool).tril(kv - q) for q, kv in pairs]


def mask_forms(masks, form, device="cuda"):
    """plan's keyword for the masks: the bool values flattened, or packed a request at a time."""
    flat = torch.cat([m.reshape(-1) for m in masks]).to(device)
    if form == "bool":
        return dict(custom_mask=flat)
    bits = torch.tensor([0] + [m.numel() for m in masks]).cumsum(0).to(device)
    return dict(packed_custom_mask=aotinfer.segment_packbits(flat, bits, bitorder="little")[0])


MASK_PAIRS = [(300, 300), (17, 530), (0, 0), (1, 1), (129, 200), (0, 40), (200, 1100), (33, 33)]


@gpu
@pytest.mark.parametrize("form", ["bool", "packed"])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("kind", ["ragged", "paged"])
@pytest.mark.parametrize("backend", ["fa2", "auto"])
def test_custom_mask(backend, kind, heads, form):
    case = Case(MASK_PAIRS, heads, torch.bfloat16, kind)
    masks = random_masks(MASK_PAIRS, seed=heads[2])
    wrapper = case.wrapper(backend=backend)
    case.plan(wrapper, causal=True, **mask_forms(masks, form))  # the mask replaces causal
    assert wrapper._plan.binding is prefill._batch_prefill
    want, want_lse = case.reference(masks=masks)
    out, lse = case.run(wrapper, out=poisoned(case.q.shape, torch.bfloat16), return_lse=True)
    check(out, want, torch.bfloat16, lse, want_lse)
    first = int(case.qo_indptr[0])
    assert torch.equal(out[first], torch.zeros_like(out[first])) and bool((lse[first] == float("-inf")).all())


@gpu
@pytest.mark.parametrize("options", [{}, dict(window_left=50), dict(logits_soft_cap=3.0)], ids=str)
@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_custom_mask_with_options_and_split_keys(kind, options):
    # One short request over many keys: its keys are split into chunks, each reading its own bits.
    pairs = [(40, 6000), (3, 3000)]
    case = Case(pairs, (32, 8, 128), torch.float16, kind, page_size=16)
    masks = random_masks(pairs, density=0.3, seed=5)
    wrapper = case.wrapper(backend="fa2")
    case.plan(wrapper, **mask_forms(masks, "bool"), **options)
    assert wrapper._plan.partition.num_slots > 0, "the case should split its keys"
    reference_options = dict(window_left=options.get("window_left", -1), soft_cap=options.get("logits_soft_cap", 0.0))
    want, want_lse = case.reference(masks=masks, **reference_options)
    out, lse = case.run(wrapper, out=poisoned(case.q.shape, torch.float16), return_lse=True)
    check(out, want, torch.float16, lse, want_lse)


@gpu
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_causal_equivalent_mask_is_causal_bit_for_bit(kind, heads):
    case = Case(PAIRS, heads, torch.bfloat16, kind)
    wrapper = case.wrapper(backend="fa2")
    case.plan(wrapper, causal=True)
    causal, causal_lse = case.run(wrapper, return_lse=True)
    case.plan(wrapper, **mask_forms(causal_masks(PAIRS), "packed"))
    masked, masked_lse = case.run(wrapper, out=poisoned(case.q.shape, torch.bfloat16), return_lse=True)
    assert torch.equal(masked, causal) and torch.equal(masked_lse, causal_lse)


@gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_eagle_tree_verification(page_size):
    pairs = [(16, 16 + prefix) for prefix in (100, 1000, 37, 4000, 0, 513)]
    case = Case(pairs, (32, 8, 128), torch.bfloat16, "paged", page_size=page_size)
    masks = tree_masks(pairs, seed=page_size)
    wrapper = case.wrapper()
    case.plan(wrapper, **mask_forms(masks, "packed"))
    want, want_lse = case.reference(masks=masks)
    out, lse = case.run(wrapper, out=poisoned(case.q.shape, torch.bfloat16), return_lse=True)
    check(out, want, torch.bfloat16, lse, want_lse)


@gpu
def test_cuda_graph_replays_with_a_new_mask():
    # Captured under one plan and mask; plans with other lengths and masks, then replays, give
    # the new batches' attention: the mask is read from custom_mask_buf.
    batch, heads, rows = 3, (16, 4, 128), 700
    buffers = dict(
        qo_indptr_buf=torch.empty(batch + 1, dtype=torch.int32, device="cuda"),
        paged_kv_indptr_buf=torch.empty(batch + 1, dtype=torch.int32, device="cuda"),
        paged_kv_last_page_len_buf=torch.empty(batch, dtype=torch.int32, device="cuda"),
        paged_kv_indices_buf=torch.empty(4000, dtype=torch.int32, device="cuda"),
        custom_mask_buf=torch.empty(1 << 20, dtype=torch.uint8, device="cuda"),
        mask_indptr_buf=torch.empty(batch + 1, dtype=torch.int32, device="cuda"),
    )  # fmt: skip
    kv = tuple(torch.zeros(400, 16, 4, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    q = torch.zeros(rows, 16, 128, dtype=torch.bfloat16, device="cuda")
    out, lse = torch.zeros_like(q), torch.zeros(rows, 16, device="cuda")
    wrapper = graph = None
    for seed, pairs in enumerate(([(300, 300), (17, 530), (200, 1100)], [(10, 3000), (0, 0), (650, 700)],
                                  [(16, 116), (16, 1016), (16, 16)])):  # fmt: skip
        case = Case(pairs, heads, torch.bfloat16, "paged")
        masks = tree_masks(pairs, seed) if seed == 2 else random_masks(pairs, seed=seed)
        if wrapper is None:
            wrapper = case.wrapper(use_cuda_graph=True, **buffers)
        case.plan(wrapper, **mask_forms(masks, "bool"))
        q[: case.q.shape[0]].copy_(case.q)
        for dst, src in zip(kv, case.cache):
            dst[: src.shape[0]].copy_(src)
        if graph is None:
            wrapper.run(q, kv, out=out, lse=lse)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                wrapper.run(q, kv, out=out, lse=lse)
        out.fill_(float("nan"))
        graph.replay()
        want, want_lse = case.reference(masks=masks)
        n = case.q.shape[0]
        check(out[:n], want, torch.bfloat16, lse[:n], want_lse)
        segments = torch.tensor([0] + [(m.numel() + 7) // 8 for m in masks]).cumsum(0)
        assert torch.equal(buffers["mask_indptr_buf"].cpu(), segments.to(torch.int32))


@gpu
@pytest.mark.parametrize("form", ["bool", "packed"])
@pytest.mark.parametrize("heads", [(8, 8, 64), (32, 8, 128), (12, 2, 256)], ids=["g1d64", "g4d128", "g6d256"])
@pytest.mark.parametrize("lengths", [(300, 300), (37, 900), (1, 1)], ids=str)
def test_single_prefill_custom_mask(lengths, heads, form):
    qo_len, kv_len = lengths
    num_qo_heads, num_kv_heads, head_dim = heads
    q = torch.randn(qo_len, num_qo_heads, head_dim, device="cuda").half()
    k = torch.randn(kv_len, num_kv_heads, head_dim, device="cuda").half()
    v = torch.randn(kv_len, num_kv_heads, head_dim, device="cuda").half()
    mask = random_masks([lengths], seed=qo_len)[0]
    given = dict(custom_mask=mask.cuda()) if form == "bool" else dict(packed_custom_mask=aotinfer.packbits(mask.reshape(-1).cuda(), "little"))
    out, lse = aotinfer.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True, **given)
    want, want_lse = reference(q, indptr_of([qo_len]), [k], [v], 1 / math.sqrt(head_dim), masks=[mask])
    check(out, want, torch.float16, lse, want_lse)
    causal = aotinfer.single_prefill_with_kv_cache(q, k, v, causal=True, backend="fa2")
    assert torch.equal(aotinfer.single_prefill_with_kv_cache(q, k, v, custom_mask=causal_masks([lengths])[0].cuda()), causal)


@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_custom_mask_drives_the_kernel_contract(kernel_model, kind):
    torch.manual_seed(0)
    case = Case(CPU_PAIRS, (12, 2, 64), torch.float16, kind, page_size=8, device="cpu")
    masks = random_masks(CPU_PAIRS, seed=1)
    wrapper = case.wrapper("cpu", 16 << 20)
    for form in ("bool", "packed"):
        case.plan(wrapper, causal=True, **mask_forms(masks, form, "cpu"))
        assert wrapper._plan.partition.num_slots > 0, "the case should split some request"
        segments = torch.tensor([0] + [(m.numel() + 7) // 8 for m in masks]).cumsum(0)
        assert torch.equal(wrapper._plan.requests[:, 7].cpu(), segments[:-1].to(torch.int32))
        want, want_lse = case.reference(masks=masks)
        out, lse = case.run(wrapper, out=poisoned(case.q.shape, torch.float16, "cpu"), return_lse=True)
        check(out, want, torch.float16, lse, want_lse)


def test_custom_mask_arguments_are_checked():
    args = paged_plan_args()  # one request of 5 queries over 5 keys
    mask = torch.ones(25, dtype=torch.bool)
    with pytest.raises(ValueError, match="custom_mask or packed_custom_mask, got both"):
        cpu_wrapper().plan(*args, custom_mask=mask, packed_custom_mask=torch.ones(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"custom_mask to hold sum\(qo_len \* kv_len\) = 25 values"):
        cpu_wrapper().plan(*args, custom_mask=mask[:24])
    with pytest.raises(TypeError, match="custom_mask to have dtype torch.bool"):
        cpu_wrapper().plan(*args, custom_mask=mask.to(torch.uint8))
    with pytest.raises(ValueError, match="packed_custom_mask to hold the requests' packed masks, 4 bytes"):
        cpu_wrapper().plan(*args, packed_custom_mask=torch.ones(3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="packed_custom_mask to have dtype torch.uint8"):
        cpu_wrapper().plan(*args, packed_custom_mask=torch.ones(4, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="fa3"):
        cpu_wrapper(backend="fa3").plan(*args, custom_mask=mask)
    with pytest.raises(NotImplementedError, match="float8_e4m3fn KV cache"):
        cpu_wrapper().plan(*args, custom_mask=mask, kv_data_type=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="custom_mask_buf"):
        cpu_wrapper(custom_mask_buf=torch.empty(16, dtype=torch.int32))
    with pytest.raises(ValueError, match="custom_mask or packed_custom_mask, got both"):
        aotinfer.single_prefill_with_kv_cache(torch.zeros(5, 8, 64).half(), torch.zeros(5, 8, 64).half(),
                                              torch.zeros(5, 8, 64).half(), custom_mask=mask.view(5, 5),
                                              packed_custom_mask=torch.ones(4, dtype=torch.uint8))  # fmt: skip


@gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_cuda_graph_replays_after_a_new_plan(kind, layout):
    # The graph is captured after the first plan; a second plan with other lengths, other page
    # ids and a split request, then a replay, gives the second batch's attention.
    batch, heads, rows, capacity = 3, (16, 4, 128), 700, 4000
    first, second = [(300, 300), (17, 530), (200, 1100)], [(10, 3000), (0, 0), (650, 700)]
    device = "cuda"
    qo_buf = torch.empty(batch + 1, dtype=torch.int32, device=device)
    kv_buf = torch.empty(batch + 1, dtype=torch.int32, device=device)
    if kind == "ragged":
        buffers = dict(qo_indptr_buf=qo_buf, kv_indptr_buf=kv_buf)
        shape = (capacity, 4, 128) if layout == "NHD" else (4, capacity, 128)
        kv = (torch.zeros(shape, dtype=torch.bfloat16, device=device), torch.zeros(shape, dtype=torch.bfloat16, device=device))
    else:
        buffers = dict(qo_indptr_buf=qo_buf, paged_kv_indptr_buf=kv_buf, paged_kv_last_page_len_buf=torch.empty(batch, dtype=torch.int32, device=device),
                       paged_kv_indices_buf=torch.empty(capacity, dtype=torch.int32, device=device))  # fmt: skip
        page = (16, 4, 128) if layout == "NHD" else (4, 16, 128)
        kv = (torch.zeros(400, *page, dtype=torch.bfloat16, device=device), torch.zeros(400, *page, dtype=torch.bfloat16, device=device))
    q = torch.zeros(rows, 16, 128, dtype=torch.bfloat16, device=device)  # the buffers the graph reads
    out = torch.zeros(rows, 16, 128, dtype=torch.bfloat16, device=device)
    lse = torch.zeros(rows, 16, device=device)
    wrapper = graph = None
    for pairs in (first, second):
        case = Case(pairs, heads, torch.bfloat16, kind, layout)
        if wrapper is None:
            wrapper = case.wrapper(use_cuda_graph=True, **buffers)
        case.plan(wrapper, causal=True)
        q[: case.q.shape[0]].copy_(case.q)
        if kind == "ragged":
            for dst, src in zip(kv, (case.k, case.v)):
                (dst[: src.shape[0]] if layout == "NHD" else dst[:, : src.shape[1]]).copy_(src)
        else:
            for dst, src in zip(kv, case.cache):
                dst[: src.shape[0]].copy_(src)
        if graph is None:
            wrapper.run(q, *kv, out=out, lse=lse) if kind == "ragged" else wrapper.run(q, kv, out=out, lse=lse)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                wrapper.run(q, *kv, out=out, lse=lse) if kind == "ragged" else wrapper.run(q, kv, out=out, lse=lse)
        out.fill_(float("nan"))
        graph.replay()
        want, want_lse = case.reference(causal=True)
        n = case.q.shape[0]
        check(out[:n], want, torch.bfloat16, lse[:n], want_lse)
    assert wrapper._plan.partition.num_slots > 0, "the second plan should split a request"


@gpu
@pytest.mark.parametrize("heads", [(32, 8, 128), (8, 8, 64)], ids=["g4d128", "g1d64"])
def test_ragged_and_paged_runs_merge_into_attention_over_both(heads):
    # A chunked prefill: new tokens against themselves (ragged, causal) and against the cached
    # prefix (paged, all of it), merged with merge_state, equal attention over the concatenation
    # with the causal mask aligned to the end.
    num_qo_heads, num_kv_heads, head_dim = heads
    new, cached = [120, 7, 300], [500, 0, 33]
    prefix = Case([(n, c) for n, c in zip(new, cached)], heads, torch.bfloat16, "paged")
    suffix = Case([(n, n) for n in new], heads, torch.bfloat16, "ragged")
    suffix.q = prefix.q
    paged, ragged = prefix.wrapper(), suffix.wrapper()
    prefix.plan(paged)
    suffix.plan(ragged, causal=True)
    out_a, lse_a = paged.run(prefix.q, prefix.cache, return_lse=True)
    out_b, lse_b = ragged.run(suffix.q, suffix.k, suffix.v, return_lse=True)
    merged, merged_lse = aotinfer.merge_state(out_a, lse_a, out_b, lse_b)
    keys = [torch.cat([a, b.to(a.device)]) for a, b in zip(prefix.keys, suffix.keys)]
    values = [torch.cat([a, b.to(a.device)]) for a, b in zip(prefix.values, suffix.values)]
    want, want_lse = reference(prefix.q, prefix.qo_indptr, keys, values, 1 / math.sqrt(head_dim), causal=True)
    check(merged, want, torch.bfloat16, merged_lse, want_lse)


@gpu
def test_empty_batch_and_empty_sequences():
    for kind in ("ragged", "paged"):
        case = Case([], (8, 8, 64), torch.float16, kind)
        wrapper = case.wrapper()
        case.plan(wrapper, causal=True)
        out, lse = case.run(wrapper, return_lse=True)
        assert out.shape == (0, 8, 64) and lse.shape == (0, 8)
        case = Case([(0, 0), (3, 0), (0, 5)], (8, 8, 64), torch.float16, kind)
        wrapper = case.wrapper()
        case.plan(wrapper)
        out, lse = case.run(wrapper, out=poisoned(case.q.shape, torch.float16), return_lse=True)
        assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())


@gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad_ids", [[10**9, 7], [-1, -(2**31)]], ids=["beyond", "negative"])
def test_page_ids_outside_the_cache_read_inside_it(bad_ids, backend):
    # As for decode: a page id outside the cache reads the cache's last page; the other requests
    # are right and the next kernel runs.
    case = Case([(20, 40), (9, 33), (5, 17)], (8, 8, 128), torch.float16)
    first = int(case.indptr[1])
    case.indices[first : first + len(bad_ids)] = torch.tensor(bad_ids, dtype=torch.int32)
    wrapper = case.wrapper(backend=backend_or_skip(backend, 128))
    case.plan(wrapper)
    out = case.run(wrapper, out=poisoned(case.q.shape, torch.float16))
    torch.cuda.synchronize()
    want, _ = case.reference()
    rows = case.qo_indptr.tolist()
    for b in (0, 2):
        check(out[rows[b] : rows[b + 1]], want[rows[b] : rows[b + 1]], torch.float16)
    assert bool(out[rows[1] : rows[2]].isfinite().all())


@gpu
def test_causal_with_more_queries_than_keys_sees_nothing_first():
    case = Case([(10, 4), (5, 5)], (8, 8, 64), torch.float16, "paged")
    wrapper = case.wrapper()
    case.plan(wrapper, causal=True)
    want, want_lse = case.reference(causal=True)
    out, lse = case.run(wrapper, out=poisoned(case.q.shape, torch.float16), return_lse=True)
    check(out, want, torch.float16, lse, want_lse)
    assert bool((lse[:6] == float("-inf")).all())


@gpu
def test_plan_takes_cpu_tables_and_run_never_synchronizes():
    case = Case(PAIRS, (16, 4, 128), torch.bfloat16, "paged")
    wrapper = aotinfer.BatchPrefillWithPagedKVCacheWrapper(workspace("cuda"), "NHD")
    wrapper.plan(case.qo_indptr, case.indptr, case.indices, case.last_page_len, 16, 4, 128, 16, causal=True, q_data_type=torch.bfloat16)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = wrapper.run(case.q, case.cache)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check(out, case.reference(causal=True)[0], torch.bfloat16)


@gpu
def test_bad_tensors_are_named():
    case = Case(PAIRS, (16, 4, 128), torch.bfloat16, "ragged")
    wrapper = case.wrapper()
    case.plan(wrapper)
    with pytest.raises(TypeError, match="k"):
        wrapper.run(case.q, case.k.half(), case.v.half(), skip_check=True)
    with pytest.raises(ValueError, match="q"):
        wrapper.run(case.q[:, :8], case.k, case.v)
    with pytest.raises(ValueError, match="kv_indptr"):
        wrapper.run(case.q, case.k[:10], case.v[:10])
    with pytest.raises(ValueError, match="out"):
        wrapper.run(case.q, case.k, case.v, out=torch.empty(5, 16, 128, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="lse"):
        wrapper.run(case.q, case.k, case.v, lse=torch.empty(5, 16, device="cuda"))
    for bad in (-2, case.q.shape[0] + 1):  # the plan's first merged token, as the binding checks it
        wrapper._plan.merge_from = bad
        with pytest.raises(ValueError, match="merge_from"):
            wrapper.run(case.q, case.k, case.v)


@gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256, 192])
@pytest.mark.parametrize("group", [1, 2, 8, 16, 3], ids=lambda g: f"group{g}")
def test_hopper_tma_copies_take_views_and_every_group(group, head_dim):
    # fa3's TMA copies (K and V tiles, each warpgroup's Q rows, the output's store) address tensors
    # through maps of their strides: q, out, k and v here are views into larger buffers (rows
    # padded, the tokens offset), sequences end inside Q tiles (the output rows past them are the
    # threads' stores), and group 3 does not divide a warpgroup's 64 rows (Q copied by threads).
    backend_or_skip("fa3", head_dim)
    head_dim_vo = 128 if head_dim == 192 else head_dim
    kv_heads, dtype = 2, torch.bfloat16
    heads = kv_heads * group
    q_lens, kv_lens = [300, 77, 1], [700, 77, 260]
    qo_indptr, kv_indptr = indptr_of(q_lens), indptr_of(kv_lens)
    total_q, total_kv = int(qo_indptr[-1]), int(kv_indptr[-1])
    q = torch.randn(total_q + 5, heads + 1, head_dim, device="cuda").to(dtype)[5:, 1:]
    k = torch.randn(total_kv + 3, kv_heads, head_dim + head_dim_vo, device="cuda").to(dtype)[3:, :, :head_dim]
    v = torch.randn(total_kv + 3, kv_heads, head_dim + head_dim_vo, device="cuda").to(dtype)[3:, :, head_dim:]
    out_buffer = poisoned((total_q, heads + 2, head_dim_vo), dtype)
    out = out_buffer[:, 2:]
    keys = [k[int(kv_indptr[b]) : int(kv_indptr[b + 1])] for b in range(3)]
    values = [v[int(kv_indptr[b]) : int(kv_indptr[b + 1])] for b in range(3)]
    want, want_lse = reference(q, qo_indptr, keys, values, 1 / math.sqrt(head_dim), causal=True)
    wrapper = aotinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace("cuda", 128 << 20), backend="fa3")
    wrapper.plan(qo_indptr.cuda(), kv_indptr.cuda(), heads, kv_heads, head_dim, causal=True, q_data_type=dtype,
                 head_dim_vo=head_dim_vo)  # fmt: skip
    lse = poisoned((total_q, heads), torch.float32)
    wrapper.run(q, k, v, out=out, lse=lse, return_lse=True)
    check(out, want, dtype, lse, want_lse)
    assert out_buffer[:, :2].isnan().all(), "the output's view was written past its heads"


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("heads", [(8, 8, 64), (32, 8, 128), (12, 2, 256)], ids=["g1d64", "g4d128", "g6d256"])
@pytest.mark.parametrize("lengths", [(300, 300), (37, 900), (1, 1)], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_single_prefill(backend, lengths, heads, layout, causal):
    (q_len, kv_len), (num_qo_heads, num_kv_heads, head_dim) = lengths, heads
    backend_or_skip(backend, head_dim)
    q = torch.randn(q_len, num_qo_heads, head_dim, device="cuda").half()
    shape = (kv_len, num_kv_heads, head_dim) if layout == "NHD" else (num_kv_heads, kv_len, head_dim)
    k, v = torch.randn(*shape, device="cuda").half(), torch.randn(*shape, device="cuda").half()
    nhd = (k, v) if layout == "NHD" else (k.transpose(0, 1), v.transpose(0, 1))
    want, want_lse = reference(q, [0, q_len], [nhd[0]], [nhd[1]], 1 / math.sqrt(head_dim), causal=causal)
    out, lse = aotinfer.single_prefill_with_kv_cache(q, k, v, causal=causal, kv_layout=layout, return_lse=True, backend=backend)
    check(out, want, torch.float16, lse, want_lse)
    check(aotinfer.single_prefill_with_kv_cache(q, k, v, causal=causal, kv_layout=layout, backend=backend), want, torch.float16)
    out, lse = aotinfer.single_prefill_with_kv_cache_return_lse(q, k, v, causal=causal, kv_layout=layout, backend=backend)
    check(out, want, torch.float16, lse, want_lse)


# ---- DeepSeek's head dims: 192 for q and k, 128 for v and the output ----------------------------

DEEPSEEK_HEADS = [(16, 16, 192, 128), (8, 2, 192, 128)]  # MHA as DeepSeek's prefill runs it, and a group of 4
DEEPSEEK_IDS = ["h16kv16", "h8kv2"]


@gpu
@pytest.mark.parametrize("heads", DEEPSEEK_HEADS, ids=DEEPSEEK_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind", ["ragged", "paged"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_deepseek_head_dims(backend, kind, causal, layout, dtype, heads):
    case = Case(PAIRS, heads, dtype, kind, layout)
    wrapper = case.wrapper(backend=backend_or_skip(backend, 192))
    case.plan(wrapper, causal=causal)
    assert wrapper._plan.binding is (prefill._batch_prefill_sm90 if backend == "fa3" else prefill._batch_prefill)
    want, want_lse = case.reference(causal=causal)
    assert want.shape[2] == 128
    out, lse = poisoned((case.q.shape[0], heads[0], 128), dtype), poisoned(case.q.shape[:2], torch.float32)
    case.run(wrapper, out=out, lse=lse, return_lse=True)
    check(out, want, dtype, lse, want_lse)
    check(case.run(wrapper), want, dtype)


@gpu
@pytest.mark.parametrize("page_size", [1, 5, 64])
@pytest.mark.parametrize("mode", ["auto", "fixed_split_size", "disable_split_kv"])
@pytest.mark.parametrize("kind", ["ragged", "paged"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_deepseek_head_dims_split_keys_and_page_sizes(backend, kind, mode, page_size):
    """Long keys split over items (their partials 128 wide, merged), page sizes off the copy runs
    (5) and on them, with the options."""
    if kind == "ragged" and page_size != 1:
        pytest.skip("pages: the paged wrapper")
    backend_or_skip(backend, 192)
    case = Case([(1, 5000), (33, 3000), (0, 7), (300, 300)], (16, 4, 192, 128), torch.bfloat16, kind, page_size=page_size)
    options = dict(causal=True, logits_soft_cap=4.0, window_left=2000)
    if mode == "fixed_split_size":
        options["fixed_split_size"] = 512 if kind == "ragged" else -(-512 // page_size)
    elif mode == "disable_split_kv":
        options["disable_split_kv"] = True
    wrapper = case.wrapper(backend=backend)
    case.plan(wrapper, **options)
    if mode != "disable_split_kv":
        assert wrapper._plan.merge_from >= 0, "the keys were not split"
    want, want_lse = case.reference(causal=True, soft_cap=4.0, window_left=2000)
    out, lse = case.run(wrapper, out=poisoned((case.q.shape[0], 16, 128), torch.bfloat16), return_lse=True)
    check(out, want, torch.bfloat16, lse, want_lse)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [(300, 300), (37, 900), (1, 1), (2000, 2000)], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_deepseek_single_prefill(backend, lengths, causal):
    backend_or_skip(backend, 192)
    (q_len, kv_len), (num_qo_heads, num_kv_heads) = lengths, (16, 16)
    q = torch.randn(q_len, num_qo_heads, 192, device="cuda").bfloat16()
    k = torch.randn(kv_len, num_kv_heads, 192, device="cuda").bfloat16()
    v = torch.randn(kv_len, num_kv_heads, 128, device="cuda").bfloat16()
    want, want_lse = reference(q, [0, q_len], [k], [v], 1 / math.sqrt(192), causal=causal)
    out, lse = aotinfer.single_prefill_with_kv_cache(q, k, v, causal=causal, return_lse=True, backend=backend)
    assert out.shape == (q_len, num_qo_heads, 128)
    check(out, want, torch.bfloat16, lse, want_lse)


@gpu
def test_deepseek_head_dims_refusals():
    case = Case(PAIRS, (16, 16, 192, 128), torch.float16, "paged")
    with pytest.raises(NotImplementedError, match="float8_e4m3fn KV cache with head_dim_qk 192"):
        case.plan(case.wrapper(), kv_data_type=torch.float8_e4m3fn)
    wrapper = case.wrapper()
    case.plan(wrapper)
    fp8 = tuple(c.to(torch.float8_e4m3fn) for c in case.cache)
    wrapper._plan.kv_dtype = torch.float8_e4m3fn  # past the plan's refusal: the binding's own
    with pytest.raises(TypeError, match="Expected k of q's dtype float16 with head_dim 192, got float8_e4m3fn"):
        wrapper.run(case.q, fp8)


@pytest.mark.parametrize("kv_heads, grouped", [(32, False), (64, False), (128, True)])
def test_the_first_kernel_takes_many_heads_a_few_at_a_time(kv_heads, grouped):
    """Past 66 KV heads on 132 SMs (the CPU plans' count) the kernel of every arch takes the heads
    in groups that share the L2, as Hopper's does; up to there, all at once."""
    wrapper = aotinfer.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8))
    wrapper.plan(indptr_of([8192]), indptr_of([8192]), kv_heads, kv_heads, 192, head_dim_vo=128, causal=True)
    assert prefill.use_sm90("auto", wrapper.device, 192, torch.float16, torch.float16) is False
    heads, items_in_groups = wrapper._plan.work[0, 1:3].tolist()
    if grouped:
        assert heads < kv_heads and items_in_groups > 0
    else:
        assert (heads, items_in_groups) == (kv_heads, 0)


def test_deepseek_head_dims_checked():
    """The plan takes 192 with 128 and no other pair; the binding (on a tracer's stand-ins) names
    v's head_dim and the output's shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = list(paged_plan_args())
    for qk, vo, match in ((192, None, "head_dim_vo 128 with head_dim_qk 192, got None"), (192, 192, "got 192"),
                          (128, 192, "head_dim_vo equal to head_dim_qk 128"), (96, 96, "head_dim 96")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            cpu_wrapper().plan(*args[:6], qk, 16, head_dim_vo=vo)
    wrapper = cpu_wrapper("ragged")
    wrapper.plan(indptr_of([700, 5]), indptr_of([700, 900]), 16, 16, 192, head_dim_vo=128, causal=True, disable_split_kv=True)
    assert (wrapper._plan.head_dim, wrapper._plan.head_dim_vo) == (192, 128)
    work = wrapper._plan.work[1 : 1 + int(wrapper._plan.work[0, 0])]
    first = work[work[:, 0] == 0]
    assert sorted(first[:, 1].tolist()) == list(range(0, 700, 128))  # tiles of 128 rows (group 1), as d128's
    with FakeTensorMode():
        q, k = torch.empty(9, 16, 192, device="cuda").half(), torch.empty(30, 16, 192, device="cuda").half()
        out = aotinfer.single_prefill_with_kv_cache(q, k, torch.empty(30, 16, 128, device="cuda").half(), causal=True)
        assert out.shape == (9, 16, 128)
        with pytest.raises(ValueError, match=r"Expected the last dimension of v \(head_dim_vo\) to be 128"):
            aotinfer.single_prefill_with_kv_cache(q, k, torch.empty(30, 16, 64, device="cuda").half())
        with pytest.raises(ValueError, match=r"Expected the last dimension of v \(head_dim_vo\) to be 64"):
            q64, k64 = torch.empty(9, 16, 64, device="cuda").half(), torch.empty(30, 16, 64, device="cuda").half()
            aotinfer.single_prefill_with_kv_cache(q64, k64, torch.empty(30, 16, 128, device="cuda").half())
        with pytest.raises(ValueError, match="Expected k and v to have one shape but for head_dim"):
            aotinfer.single_prefill_with_kv_cache(q, k, torch.empty(31, 16, 128, device="cuda").half())


@gpu
@pytest.mark.parametrize("options", [dict(causal=True), dict(logits_soft_cap=5.0, window_left=300), "split"], ids=str)
@pytest.mark.parametrize(
    "heads", [(32, 8, 128), (8, 8, 64), (12, 2, 256), (16, 16, 192, 128)], ids=["g4d128", "g1d64", "g6d256", "g1d192"]
)
@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_backends_agree(kind, heads, options):
    """Hopper's kernel and the kernel of every arch on the same inputs: outputs within the
    rounding of one bfloat16 output, LSEs within float32 noise."""
    backend_or_skip("fa3", heads[2])
    case = Case([(700, 900), (1, 33), (256, 256), (90, 2000)], heads, torch.bfloat16, kind)
    if options == "split":  # 256-token chunks: in tokens (ragged) or 16-token pages
        options = dict(causal=True, fixed_split_size=256 if kind == "ragged" else 16)
    results = []
    for backend in BACKENDS:
        wrapper = case.wrapper(backend=backend)
        case.plan(wrapper, **options)
        assert wrapper._plan.binding is (prefill._batch_prefill_sm90 if backend == "fa3" else prefill._batch_prefill)
        results.append(case.run(wrapper, out=poisoned((*case.q.shape[:2], case.head_dim_vo), torch.bfloat16), return_lse=True))
    (out2, lse2), (out3, lse3) = results
    torch.testing.assert_close(out3.float(), out2.float(), rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(lse3, lse2, rtol=1e-4, atol=1e-4)


@gpu
@pytest.mark.parametrize("kind", ["ragged", "paged"])
@pytest.mark.parametrize("heads", [(8, 8, 128), (16, 4, 64), (8, 2, 256)], ids=["g1d128", "g4d64", "g4d256"])
def test_fa3_halves_a_lone_requests_last_tiles(kind, heads):
    """Full attention over one request whose tiles leave the last wave of blocks part full: the
    plan splits the last tiles' keys in two (tiles_to_halve) and the merge joins them; the other
    rows are written whole. Against the reference; with sinks (paged: added to the whole rows by
    the kernel, to the split ones by the merge); with forward's causal on the same plan."""
    backend_or_skip("fa3", heads[2])
    group, rows, kv_len = heads[0] // heads[1], prefill.tile_rows(heads[2], sm90=True), 4096
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # The first query length whose tiles fill the GPU (else the plan splits every tile's keys) and
    # leave its last wave part full.
    tiles = lambda q: -(-q * group // rows)  # noqa: E731
    q_len = next(q for q in range(64, kv_len) if tiles(q) * heads[1] >= sms and prefill.tiles_to_halve(tiles(q), heads[1], sms))
    case = Case([(q_len, kv_len)], heads, torch.bfloat16, kind)
    wrapper = case.wrapper(backend="fa3")
    case.plan(wrapper)
    partition = wrapper._plan.partition
    split_from = int(partition.requests[0, 6])
    assert partition.halves > 0 and 0 < split_from < q_len and int(partition.requests[0, 5]) == 2
    sinks = torch.randn(heads[0], device="cuda") if kind == "paged" else None
    want, want_lse = case.reference(sinks=sinks)
    out, lse = poisoned(case.q.shape, torch.bfloat16), poisoned(case.q.shape[:2], torch.float32)
    case.run(wrapper, out=out, lse=lse, return_lse=True, **({"sinks": sinks} if sinks is not None else {}))
    check(out, want, torch.bfloat16, lse, want_lse)
    kv = (case.k, case.v) if kind == "ragged" else (case.cache,)
    check(wrapper.forward(case.q, *kv, causal=True), case.reference(causal=True)[0], torch.bfloat16)
    if kind == "ragged":  # single_prefill_with_kv_cache halves the same tiles
        want, want_lse = case.reference()
        out, lse = aotinfer.single_prefill_with_kv_cache(case.q, case.k, case.v, backend="fa3", return_lse=True)
        check(out, want, torch.bfloat16, lse, want_lse)


@gpu
def test_auto_runs_the_hopper_kernel_where_it_applies():
    hopper = torch.cuda.get_device_capability() == (9, 0)
    for heads, kv_dtype, expected in [
        ((32, 8, 128), None, hopper),
        ((8, 8, 64), None, hopper),
        ((12, 2, 256), None, hopper),
        ((32, 8, 128), torch.float8_e4m3fn, False),
    ]:
        case = Case([(40, 80)], heads, torch.float16, "paged", kv_dtype=kv_dtype)
        wrapper = case.wrapper()
        case.plan(wrapper, **({} if kv_dtype is None else dict(kv_data_type=kv_dtype)))
        assert (wrapper._plan.binding is prefill._batch_prefill_sm90) == expected, (heads, kv_dtype)


@gpu
def test_fa3_refuses_what_it_does_not_run():
    if torch.cuda.get_device_capability() != (9, 0):
        case = Case([(40, 80)], (32, 8, 128), torch.float16, "ragged")
        with pytest.raises(ValueError, match="backend='fa3' runs on GPUs of compute capability 9.0"):
            case.plan(case.wrapper(backend="fa3"))
        return
    case = Case([(40, 80)], (32, 8, 128), torch.float16, "paged", kv_dtype=torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="K and V of q's dtype"):
        case.plan(case.wrapper(backend="fa3"), kv_data_type=torch.float8_e4m3fn)


@gpu
def test_single_prefill_refuses_causal_with_more_queries_than_keys():
    q = torch.randn(10, 8, 64, device="cuda").half()
    k = torch.randn(4, 8, 64, device="cuda").half()
    with pytest.raises(ValueError, match="qo_len"):
        aotinfer.single_prefill_with_kv_cache(q, k, k, causal=True)


@gpu
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="needs compute-sanitizer")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_sanitizer_clean(tmp_path, tool):
    script = tmp_path / "run.py"
    script.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from test_prefill import Case\n"
        "fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)\n"
        "for kind, pairs, heads, dtype, kv_dtype, backend in (\n"
        "    ('paged', [(40, 300), (3, 3)], (8, 2, 64), torch.float16, None, 'auto'), ('ragged', [(130, 130)], (4, 4, 128), torch.float16, None, 'auto'),\n"
        "    ('paged', [(20, 2000)], (4, 4, 256), torch.float16, None, 'fa2'), ('ragged', [(150, 700)], (4, 2, 256), torch.bfloat16, None, 'auto'),\n"
        "    ('paged', [(150, 400), (3, 35)], (8, 2, 128), torch.bfloat16, fp8[0], 'auto'), ('paged', [(70, 300)], (4, 2, 256), torch.float16, fp8[1], 'auto'),\n"
        "    ('ragged', [(200, 330), (70, 70)], (8, 2, 64), torch.bfloat16, None, 'auto'),\n"
        "):\n"
        "    case = Case(pairs, heads, dtype, kind, kv_dtype=kv_dtype)\n"
        "    wrapper = case.wrapper(backend=backend)\n"
        "    case.plan(wrapper, causal=True, **({} if kv_dtype is None else dict(kv_data_type=kv_dtype)))\n"
        "    case.run(wrapper, return_lse=True, **({} if kind == 'ragged' else dict(v_scale=0.5)))\n"
        "torch.cuda.synchronize()\n"
    )
    result = subprocess.run(
        ["compute-sanitizer", "--tool", tool, "--error-exitcode", "3", sys.executable, str(script)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


# ---- the plan on the CPU ------------------------------------------------------------------------


def partition(pairs, heads=(32, 8, 128), sms=132, **options):
    q_lens, kv_lens = [p[0] for p in pairs], [p[1] for p in pairs]
    q_begin = indptr_of(q_lens)[:-1].tolist()
    return prefill.partition_prefill(
        q_begin, q_lens, [0] * len(pairs), kv_lens, group=heads[0] // heads[1], head_dim=heads[2],
        num_kv_heads=heads[1], num_sms=sms, **options,
    )  # fmt: skip


def covered(p, pairs, group, rows_per_tile):
    """Each request's (packed row, key chunk) coverage: every row of every request is in exactly
    one item per chunk, and chunks tile [0, kv_len)."""
    items = p.work[1 : 1 + p.work[0, 0]].tolist()
    assert len(items) == p.num_items == int(p.work[0, 0])
    seen = {}
    for request, row_begin, kv_begin, kv_end, chunk, *_ in items:
        q_len, kv_len = pairs[request]
        assert 0 <= row_begin < q_len * group and row_begin % rows_per_tile == 0
        assert 0 <= kv_begin <= kv_end <= kv_len
        seen.setdefault(request, []).append((row_begin, kv_begin, kv_end, chunk))
    for b, (q_len, kv_len) in enumerate(pairs):
        tiles = -(-q_len * group // rows_per_tile)
        mine = seen.get(b, [])
        n, split_from = max(int(p.requests[b, 5]), 1), int(p.requests[b, 6])
        whole = -(-split_from * group // rows_per_tile)
        assert split_from * group % rows_per_tile == 0 and len(mine) == whole + (tiles - whole) * n
        for row_begin in range(0, q_len * group, rows_per_tile):
            ranges = sorted((kb, ke, c) for r, kb, ke, c in mine if r == row_begin)
            assert [c for _, _, c in ranges] == list(range(n if row_begin >= split_from * group else 1))
            assert ranges[0][0] == 0 and ranges[-1][1] == kv_len
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("heads", [(32, 8, 128), (8, 8, 64), (12, 2, 256)], ids=["g4d128", "g1d64", "g6d256"])
@pytest.mark.parametrize("options", [{}, dict(causal=True, window_left=100), dict(fixed_split_size=3, page_size=16), dict(disable_split_kv=True)], ids=str)
def test_partition_covers_every_row_and_key_once(heads, options):
    for pairs in ([(40, 9000), (1, 3000), (0, 0)], PAIRS, [(8192, 8192)], []):
        p = partition(pairs, heads, **options)
        covered(p, pairs, heads[0] // heads[1], prefill.tile_rows(heads[2]))
        slots = sum(q * int(p.requests[b, 5]) for b, (q, _) in enumerate(pairs) if int(p.requests[b, 5]) > 1)
        assert p.num_slots == slots
        if options.get("disable_split_kv"):
            assert p.num_slots == 0


def test_partition_splits_only_when_the_tiles_leave_the_gpu_idle():
    assert partition([(8192, 8192)], (32, 32, 128)).chunk == 0  # 64 tiles x 32 heads fill it
    small = partition([(40, 9000)], (32, 8, 128))
    assert small.chunk > 0 and small.num_items > 1 and small.num_slots == 40 * small.requests[0, 5]
    assert small.merge_from == 0 and partition([(0, 0), (40, 9000)], (32, 8, 128)).merge_from == 0
    assert partition([(3, 3), (40, 9000)], (32, 8, 128), fixed_split_size=1024).merge_from == 3  # 3 keys: one chunk
    costs = []
    for request, row_begin, kv_begin, kv_end, *_ in small.work[1:].tolist():
        costs.append(min(128, 40 * 4 - row_begin) * (kv_end - kv_begin))  # rows x keys
    assert costs == sorted(costs, reverse=True), "the most costly items come first"


def test_a_lone_requests_last_tiles_are_halved_where_the_last_wave_is_part_full():
    # 8192 tokens, 32 heads, 192-row tiles: 43 tiles x 32 heads = 1376 blocks on 132 SMs, 10.4
    # waves taking 11; two tiles halved, 10.5. 32/8 heads (48 tokens a tile): 171 x 8, six halved.
    assert prefill.tiles_to_halve(43, 32, 132) == 2 and prefill.tiles_to_halve(171, 8, 132) == 6
    assert prefill.tiles_to_halve(86, 32, 132) == 0  # 20.85 waves: no split ends sooner
    assert prefill.tiles_to_halve(33, 4, 132) == 0  # one wave
    for heads, halved in (((32, 32, 128), 2), ((32, 8, 128), 6)):
        options = dict(ctas_per_sm=1, rows_per_tile=192)
        p = partition([(8192, 8192)], heads, sms=132, last_wave_slots=1 << 20, **options)
        group = heads[0] // heads[1]
        covered(p, [(8192, 8192)], group, 192)
        split_from = int(p.requests[0, 6])
        assert split_from * group == (-(-8192 * group // 192) - halved) * 192 and int(p.requests[0, 5]) == 2
        assert p.num_slots == 2 * (8192 - split_from) and int(p.requests[0, 4]) + 2 * split_from == 0
        assert p.halves == 2 * halved and p.chunk == 4096 and p.merge_from == split_from
        assert all(row[1] >= split_from * group for row in p.work[-p.halves :].tolist())  # the halves go last
        # Not without room for the partials, nor under causal, nor for two requests, nor short keys,
        # nor pages too large to cut the keys in two.
        for pairs, extra in (([(8192, 8192)], dict(last_wave_slots=2 * (8192 - split_from) - 1)),
                             ([(8192, 8192)], dict(causal=True, last_wave_slots=1 << 20)),
                             ([(8192, 8192), (1, 1)], dict(last_wave_slots=1 << 20)),
                             ([(2048, 2048)], dict(last_wave_slots=1 << 20)),
                             ([(8192, 8192)], dict(page_size=8192, last_wave_slots=1 << 20))):  # fmt: skip
            q = partition(pairs, heads, sms=132, **options, **extra)
            assert q.num_slots == 0 and q.halves == 0 and int(q.requests[0, 6]) == 0 and q.merge_from == -1


@pytest.mark.parametrize(
    "shape, causal, halved",
    [((8192, 8192, 32, 32, 128), False, True), ((8192, 8192, 32, 8, 128), False, True), ((5000, 9000, 32, 8, 64), False, True),
     ((8192, 8192, 16, 16, 256), False, False), ((8192, 8192, 32, 32, 128), True, False)],
    ids=str,
)  # fmt: skip
def test_single_prefill_builds_the_tables_the_plan_writes(monkeypatch, shape, causal, halved):
    # single_prefill_with_kv_cache builds its tables by tensor ops; on Hopper (forced here, on a
    # CPU) they hold the items, request row, merge start and schedule that the wrappers' plan
    # writes: the last tiles halved where that pays (not at d256's 7.8 waves, not under causal),
    # the halves last.
    q_len, kv_len, heads, kv_heads, head_dim = shape
    seen = {}
    monkeypatch.setattr(prefill, "use_sm90", lambda *args: True)
    monkeypatch.setattr(prefill, "num_sms", lambda device: 132)
    monkeypatch.setattr(prefill, "_batch_prefill_sm90", lambda *args: seen.setdefault("args", args))
    q = torch.randn(q_len, heads, head_dim, dtype=torch.bfloat16)
    k = torch.randn(kv_len, kv_heads, head_dim, dtype=torch.bfloat16)
    prefill.single_prefill_with_kv_cache(q, k, k, causal=causal)
    partial_out, work, requests, ctas, merge_from = (seen["args"][i] for i in (2, 8, 9, 18, 19))
    rows = prefill.tile_rows(head_dim, sm90=True)
    plan = partition([(q_len, kv_len)], (heads, kv_heads, head_dim), sms=132, causal=causal, ctas_per_sm=1,
                     rows_per_tile=rows, last_wave_slots=1 << 30)  # fmt: skip
    assert sorted(map(tuple, work[1:].tolist())) == sorted(map(tuple, plan.work[1:].tolist()))
    assert requests.tolist() == plan.requests.tolist() and ctas == plan.num_items
    assert merge_from == plan.merge_from and partial_out.shape[0] == plan.num_slots
    group = heads // kv_heads
    halves = work[1 + ctas - plan.halves :].tolist() if plan.halves else []
    assert all(row[1] >= int(plan.requests[0, 6]) * group for row in halves)  # the halves go last
    assert (plan.halves > 0) == halved


def test_heads_sharing_l2_fit_a_third_of_it():
    mb = 1 << 20
    assert prefill.heads_sharing_l2(32, 4 * mb, 50 * mb) == 4  # a causal 8192-token d128 bf16 prefill on an H200
    assert prefill.heads_sharing_l2(8, 1 * mb, 50 * mb) == 8  # all of them, never more
    assert prefill.heads_sharing_l2(32, 100 * mb, 50 * mb) == 1  # at least one
    assert prefill.heads_sharing_l2(4, 0, 50 * mb) == 4  # no keys


def test_shortest_items_go_with_every_head_where_their_keys_fit():
    # Causal, 8192 tokens, 32/32 heads, d128 bf16 (512 bytes a key and head, K and V), an L2 of
    # 50 MB: a third holds 1066 keys of every head, so the 5 shortest tiles of 192 rows (the last
    # token of the fifth sees 960 keys, of the sixth 1152) go last with every head.
    mb = 1 << 20
    p = partition([(8192, 8192)], (32, 32, 128), causal=True, rows_per_tile=192)
    work = p.work[1:].tolist()
    assert [(b, hi) for b, _, hi in p.spans] == [(row[0], min(8192, row[1] + 192)) for row in work]
    assert prefill.items_in_head_groups(p.spans, 32, 512, 50 * mb) == p.num_items - 5
    assert prefill.items_in_head_groups(p.span_table, 32, 512, 50 * mb) == p.num_items - 5  # read from its end
    assert prefill.items_in_head_groups(p.span_table, 32, 512, 2000 * mb) == 0  # past the first block of 64
    # Full attention: every item reads every key, more than fit: all in head groups.
    p = partition([(8192, 8192)], (32, 32, 128), rows_per_tile=192)
    assert prefill.items_in_head_groups(p.spans, 32, 512, 50 * mb) == p.num_items
    # A batch: the keys of one request's items count once (their hull): 300 + 300, then 500 adds
    # 200, 600 adds 300 (1100 keys of 1100), 4000 does not fit.
    spans = [(0, 0, 4000), (1, 0, 600), (0, 0, 500), (0, 100, 400), (1, 0, 300)]
    assert prefill.items_in_head_groups(spans, 1, 1, 3 * 1100) == 1
    assert prefill.items_in_head_groups(spans, 1, 1, 3 * 1099) == 2
    assert prefill.items_in_head_groups([], 8, 512, 50 * mb) == 0


def test_plan_orders_heads_and_tiles_for_its_kernel():
    # The first kernel (the plan of a CPU workspace) keeps every KV head together; Hopper's takes
    # 64 query rows a consumer warpgroup: three groups at head_dim 64 and 128, two at 256.
    case = Case(PAIRS, (12, 4, 256), torch.float16, "ragged", device="cpu")
    wrapper = case.wrapper(device="cpu")
    case.plan(wrapper, causal=True)
    assert int(wrapper._plan.work[0, 1]) == 4 and int(wrapper._plan.work[0, 2]) == 0
    assert prefill.tile_rows(256) == 64 and prefill.tile_rows(256, sm90=True) == 128
    assert prefill.tile_rows(64) == 128 and prefill.tile_rows(64, sm90=True) == 192
    assert prefill.tile_rows(128) == 128 and prefill.tile_rows(128, sm90=True) == 192


def test_partition_orders_causal_tiles_by_their_keys():
    p = partition([(1024, 1024)], (8, 8, 128), causal=True, disable_split_kv=True)
    row_begins = [row[1] for row in p.work[1:].tolist()]
    assert row_begins == sorted(row_begins, reverse=True)


def model_batch_prefill(out, lse, partial_out, partial_lse, q, k, v, indices, work, requests, sinks, custom_mask, captured,
                        kv_layout, sm_scale, logits_soft_cap, window_left, pos_encoding_mode, rope_scale, rope_theta,
                        v_scale, causal, ctas, merge_from, enable_pdl):  # fmt: skip
    """The batch_prefill binding's contract (modules.toml; the table formats in aotinfer/prefill.py)
    as float32 torch code: what the CUDA kernels compute, item by item, then the merge. RoPE
    (pos_encoding_mode 1) turns q and k in float32, rounded to their dtype as the kernel does."""
    assert pos_encoding_mode in (0, 1)
    paged = k.dim() == 4
    num_heads, head_dim = q.shape[1], q.shape[2]
    nhd = kv_layout == 0
    num_kv_heads = k.shape[1] if not paged else k.shape[2 if nhd else 1]
    group = num_heads // num_kv_heads
    rows_per_tile = prefill.tile_rows(head_dim)
    assert work.shape[1] == requests.shape[1] == 8 and work.dtype == requests.dtype == torch.int32
    assert ctas >= 1 or int(work[0, 0]) == 0
    sink = sinks.float() / LN2 if sinks.numel() else None
    mask_bits = None
    if custom_mask.numel():  # packed little-endian; it replaces causal
        assert custom_mask.dtype == torch.uint8
        mask_bits = ((custom_mask.long()[:, None] >> torch.arange(8)) & 1).reshape(-1).bool()
        causal = False

    def rows_of(cache, request_row, positions):  # [positions, kv_heads, dim]
        kv_offset = request_row[2]
        if not paged:
            return cache[kv_offset + positions].float()
        page_size = cache.shape[1 if nhd else 2]
        pages = indices[kv_offset + positions // page_size].long()
        slot = positions % page_size
        bytes_ = cache.view(torch.uint8) if cache.element_size() == 1 else cache  # fp8: indexed as bytes
        return (bytes_[pages, slot] if nhd else bytes_[pages, :, slot]).view(cache.dtype).float()

    def write(token, head, o, s, final):
        if final:
            if sink is not None:
                o, s = merge_into(o[None], s[None], torch.zeros_like(o[None]), sink[head : head + 1])
                o, s = o[0], s[0]
            out[token, head] = o.to(out.dtype)
            if lse.numel():
                lse[token, head] = s

    for request, row_begin, kv_begin, kv_end, chunk, *_ in work[1 : 1 + int(work[0, 0])].tolist():
        if request < 0:
            continue
        info = requests[request].tolist()
        q_begin, q_len, _, kv_len, first, n, split_from = info[:7]
        positions = torch.arange(kv_begin, min(kv_end, kv_len))
        keys, values = rows_of(k, info, positions), rows_of(v, info, positions)
        if pos_encoding_mode:
            keys = rope_llama(keys, positions, rope_scale, rope_theta).to(k.dtype).float()
        for row in range(row_begin, min(row_begin + rows_per_tile, q_len * group)):
            for kv_head in range(num_kv_heads):
                token, head = row // group, kv_head * group + row % group
                query = q[q_begin + token, head].float()
                if pos_encoding_mode:
                    query = rope_llama(query[None, None], [token + kv_len - q_len], rope_scale, rope_theta)
                    query = query.to(q.dtype).float().reshape(-1)
                logits = (keys[:, kv_head] @ query) * sm_scale
                if logits_soft_cap > 0:
                    logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
                diagonal = token + kv_len - q_len
                seen = torch.ones_like(positions, dtype=torch.bool)
                if causal:
                    seen &= positions <= diagonal
                if window_left >= 0:
                    seen &= positions >= diagonal - window_left
                if mask_bits is not None:
                    seen &= mask_bits[info[7] * 8 + token * kv_len + positions]
                logits = logits.masked_fill(~seen, float("-inf"))
                total = torch.logsumexp(logits, 0) if positions.numel() else torch.tensor(float("-inf"))
                o = (torch.exp(logits - total).nan_to_num(0.0) @ values[:, kv_head]) if positions.numel() else torch.zeros(head_dim)
                o = o * v_scale  # the output's, final or partial (the merge is linear); not the LSE's
                if n <= 1 or token < split_from:
                    write(q_begin + token, head, o, total / LN2, True)
                else:
                    slot = first + token * n + chunk
                    partial_out[slot, head], partial_lse[slot, head] = o, total / LN2
    for b, info in enumerate(requests.tolist()):
        q_begin, q_len, _, _, first, n, split_from = info[:7]
        if n > 1:
            assert 0 <= merge_from <= q_begin + split_from, "a request was split but the merge does not reach it"
            for token in range(split_from, q_len):
                o, s = torch.zeros(num_heads, head_dim), torch.full((num_heads,), float("-inf"))
                for slot in range(first + token * n, first + (token + 1) * n):
                    o, s = merge_into(o, s, partial_out[slot], partial_lse[slot])
                for head in range(num_heads):
                    write(q_begin + token, head, o[head], s[head], True)


@pytest.fixture
def kernel_model(monkeypatch):
    """batch_prefill replaced by its float32 model: plan and run run on the CPU."""
    monkeypatch.setattr(prefill, "_batch_prefill", model_batch_prefill)
    monkeypatch.setattr(prefill, "num_sms", lambda device: 16)  # small batches split


CPU_PAIRS = [(20, 20), (3, 150), (0, 0), (1, 1), (70, 90), (0, 7)]
CPU_MODES = {
    "auto": ({}, {}),
    "causal": (dict(causal=True), {}),
    "disable_split_kv": (dict(causal=True, disable_split_kv=True), {}),
    "fixed_split_size": (dict(causal=True, fixed_split_size=2), {}),
    "window_soft_cap": (dict(causal=True, window_left=30, logits_soft_cap=2.0), {}),
    "sinks_sm_scale": (dict(causal=True, sm_scale=0.3), "sinks"),
}


@pytest.mark.parametrize("mode", list(CPU_MODES))
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_plan_and_run_drive_the_kernel_contract(kernel_model, kind, layout, mode):
    torch.manual_seed(0)
    plan_options, run_options = CPU_MODES[mode]
    if run_options == "sinks":
        if kind == "ragged":
            pytest.skip("sinks are the paged wrapper's")
        run_options = dict(sinks=torch.randn(12) * 2)
    case = Case(CPU_PAIRS, (12, 2, 64), torch.float16, kind, layout, page_size=8, form="5d", device="cpu")
    wrapper = case.wrapper("cpu", 16 << 20)
    case.plan(wrapper, **plan_options)
    if mode in ("auto", "causal", "fixed_split_size"):
        assert wrapper._plan.partition.num_slots > 0, "the case should split some request"
    reference_options = {name: plan_options[name] for name in ("causal", "window_left", "sm_scale") if name in plan_options}
    reference_options["soft_cap"] = plan_options.get("logits_soft_cap", 0.0)
    reference_options["sinks"] = run_options.get("sinks")
    want, want_lse = case.reference(**reference_options)
    out, lse = case.run(wrapper, out=poisoned(case.q.shape, torch.float16, "cpu"), return_lse=True, **run_options)
    check(out, want, torch.float16, lse, want_lse)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_fp8_plan_and_run_drive_the_kernel_contract(kernel_model, layout, kv_dtype):
    torch.manual_seed(0)
    case = Case(CPU_PAIRS, (12, 2, 64), torch.bfloat16, "paged", layout, page_size=8, device="cpu", kv_dtype=kv_dtype)
    wrapper = case.wrapper("cpu", 16 << 20)
    case.plan(wrapper, causal=True, kv_data_type=kv_dtype)
    assert wrapper._plan.partition.num_slots > 0, "the case should split some request"
    want, want_lse = case.reference(causal=True, k_scale=0.6, v_scale=1.5)
    out, lse = case.run(wrapper, out=poisoned(case.q.shape, torch.bfloat16, "cpu"), return_lse=True, k_scale=0.6, v_scale=1.5)
    check(out, want, torch.bfloat16, lse, want_lse)


def test_cuda_graph_mode_keeps_its_tables_in_place(kernel_model):
    batch = 3
    buffers = dict(qo_indptr_buf=torch.empty(batch + 1, dtype=torch.int32), kv_indptr_buf=torch.empty(batch + 1, dtype=torch.int32))
    wrapper = aotinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace("cpu", 16 << 20), "NHD", use_cuda_graph=True, **buffers)
    seen = None
    for pairs in ([(20, 20), (3, 150), (1, 1)], [(1, 200), (0, 0), (40, 60)]):
        case = Case(pairs, (12, 2, 64), torch.float16, "ragged", device="cpu")
        case.plan(wrapper, causal=True)
        plan = wrapper._plan
        views = [(t.data_ptr(), tuple(t.shape)) for t in (plan.work, plan.requests, plan.partial_out, plan.partial_lse)]
        assert seen is None or views == seen
        seen = views
        assert plan.merge_from == 0 and plan.ctas == -(-2 * 16 // 2)
        assert torch.equal(buffers["qo_indptr_buf"], case.qo_indptr)
        want, want_lse = case.reference(causal=True)
        out, lse = case.run(wrapper, return_lse=True)
        check(out, want, torch.float16, lse, want_lse)


def test_sglang_fast_prefill_plan_sequence(kernel_model):
    """SGLang's fast_prefill_plan (layers/attention/flashinfer_backend.py, EAGLE draft extend and
    DFlash verification under CUDA graphs), call by call: after a real plan at capture, each replay
    copies the page table into the wrapper's CUDA-graph buffers, sets its bookkeeping attributes
    and calls _cached_module.plan with host tables and FlashInfer's fa2 planner arguments (20),
    then runs forward with the layer's options."""
    batch, heads, page_size, scale = 3, (12, 2, 64), 8, 0.2
    buffers = dict(
        qo_indptr_buf=torch.empty(batch + 1, dtype=torch.int32), paged_kv_indptr_buf=torch.empty(batch + 1, dtype=torch.int32),
        paged_kv_indices_buf=torch.empty(4096, dtype=torch.int32), paged_kv_last_page_len_buf=torch.empty(batch, dtype=torch.int32),
    )  # fmt: skip
    wrapper = aotinfer.BatchPrefillWithPagedKVCacheWrapper(workspace("cpu", 16 << 20), "NHD", use_cuda_graph=True,
                                                           backend="fa2", **buffers)  # fmt: skip
    Case([(4, 30), (4, 9), (4, 4)], heads, torch.float16, "paged", page_size=page_size, device="cpu").plan(
        wrapper, causal=True, sm_scale=scale)
    assert wrapper._backend == "fa2" and wrapper._cached_module is not None and wrapper._max_total_num_rows is None
    for pairs in ([(4, 100), (4, 4), (4, 57)], [(4, 12), (4, 300), (4, 9)]):
        case = Case(pairs, heads, torch.float16, "paged", page_size=page_size, device="cpu")
        qo_indptr_host, kv_indptr_host = case.qo_indptr, case.indptr
        kv_lens_host = torch.tensor([kv for _, kv in pairs], dtype=torch.int32)
        total_num_rows = int(qo_indptr_host[-1])
        if wrapper._max_total_num_rows is None:
            wrapper._max_total_num_rows = total_num_rows
        wrapper._batch_size, wrapper._num_qo_heads, wrapper._num_kv_heads = batch, heads[0], heads[1]
        wrapper._qo_indptr_buf.copy_(case.qo_indptr)
        wrapper._paged_kv_indptr_buf.copy_(case.indptr)
        wrapper._paged_kv_last_page_len_buf.copy_(case.last_page_len)
        wrapper._paged_kv_indices_buf[: len(case.indices)].copy_(case.indices)
        wrapper._cached_q_data_type = wrapper._cached_kv_data_type = torch.float16
        wrapper._plan_info = wrapper._cached_module.plan(
            wrapper._float_workspace_buffer, wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer,
            qo_indptr_host, kv_indptr_host, kv_lens_host, wrapper._max_total_num_rows or total_num_rows, batch, heads[0],
            heads[1], page_size, wrapper.is_cuda_graph_enabled, heads[2], heads[2], True, -1, -1, False, 0, 0,
        )  # fmt: skip
        assert int(wrapper._plan.requests.shape[0]) == batch
        want, want_lse = case.reference(causal=True, sm_scale=scale)
        out, lse = wrapper.forward_return_lse(case.q, case.cache, causal=True, sm_scale=scale)
        check(out, want, torch.float16, lse, want_lse)


def test_sglang_fast_prefill_plan_with_a_tree_mask(kernel_model):
    """SGLang's EAGLE verification under CUDA graphs (fast_prefill_plan with custom_mask): the
    wrapper was made with custom_mask_buf and mask_indptr_buf; each replay SGLang packs the tree
    masks into them itself (pack_verify_mask_into: FlashInfer's layout, a request's segment from a
    byte of its own), then calls _cached_module.plan (page_size 1, causal False)."""
    batch, heads, width = 3, (12, 2, 64), 4
    buffers = dict(
        qo_indptr_buf=torch.empty(batch + 1, dtype=torch.int32), paged_kv_indptr_buf=torch.empty(batch + 1, dtype=torch.int32),
        paged_kv_indices_buf=torch.empty(4096, dtype=torch.int32), paged_kv_last_page_len_buf=torch.empty(batch, dtype=torch.int32),
        custom_mask_buf=torch.empty(8192, dtype=torch.uint8), mask_indptr_buf=torch.empty(batch + 1, dtype=torch.int32),
    )  # fmt: skip
    wrapper = aotinfer.BatchPrefillWithPagedKVCacheWrapper(workspace("cpu", 16 << 20), "NHD", use_cuda_graph=True,
                                                           backend="fa2", **buffers)  # fmt: skip
    capture = [(width, 30), (width, 9), (width, 4)]
    Case(capture, heads, torch.float16, "paged", page_size=1, device="cpu").plan(
        wrapper, **mask_forms(tree_masks(capture), "bool", "cpu"))
    for seed, pairs in enumerate(([(width, 100), (width, 4), (width, 57)], [(width, 12), (width, 300), (width, 9)])):
        case = Case(pairs, heads, torch.float16, "paged", page_size=1, device="cpu")
        masks = tree_masks(pairs, seed)
        kv_lens_host = torch.tensor([kv for _, kv in pairs], dtype=torch.int32)
        wrapper._qo_indptr_buf.copy_(case.qo_indptr)
        wrapper._paged_kv_indptr_buf.copy_(case.indptr)
        wrapper._paged_kv_last_page_len_buf.copy_(case.last_page_len)
        wrapper._paged_kv_indices_buf[: len(case.indices)].copy_(case.indices)
        packed_indptr = torch.zeros(batch + 1, dtype=torch.int32)
        packed_indptr[1:] = torch.cumsum((kv_lens_host * width + 7) // 8, 0)
        wrapper._mask_indptr_buf.copy_(packed_indptr)
        packed = mask_forms(masks, "packed", "cpu")["packed_custom_mask"]
        wrapper._custom_mask_buf[: packed.numel()].copy_(packed)
        wrapper._custom_mask_buf[packed.numel() :].fill_(0xFF)  # bits past the masks are never read
        wrapper._plan_info = wrapper._cached_module.plan(
            wrapper._float_workspace_buffer, wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer,
            case.qo_indptr, case.indptr, kv_lens_host, int(case.qo_indptr[-1]), batch, heads[0], heads[1], 1,
            wrapper.is_cuda_graph_enabled, heads[2], heads[2], False, -1, -1, False, 0, 0,
        )  # fmt: skip
        assert torch.equal(wrapper._mask_indptr_buf, packed_indptr)
        want, want_lse = case.reference(masks=masks)
        out, lse = wrapper.run(case.q, case.cache, return_lse=True)
        check(out, want, torch.float16, lse, want_lse)


# ---- argument errors on the CPU ----------------------------------------------------------------


def cpu_wrapper(kind="paged", **kwargs):
    cls = aotinfer.BatchPrefillWithPagedKVCacheWrapper if kind == "paged" else aotinfer.BatchPrefillWithRaggedKVCacheWrapper
    return cls(torch.empty(1 << 20, dtype=torch.uint8), **kwargs)


def paged_plan_args():
    return (indptr_of([5]), indptr_of([1]), torch.zeros(1, dtype=torch.int32), torch.tensor([5], dtype=torch.int32), 8, 8, 64, 16)


def test_fixed_split_size_of_zero_or_less_leaves_the_split_to_the_plan():
    """FlashInfer reads fixed_split_size <= 0 as none (vLLM passes -1 outside its batch-invariant
    mode): the same tables as None."""
    tables = []
    for fixed in (None, -1, 0):
        wrapper = aotinfer.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8))
        wrapper.plan(indptr_of([3000, 7]), indptr_of([9000, 20]), 8, 8, 64, causal=True, fixed_split_size=fixed)
        tables.append((wrapper._plan.work.tolist(), wrapper._plan.requests.tolist()))
    assert tables[0] == tables[1] == tables[2]


@pytest.mark.parametrize(
    "options, error, match",
    [
        (dict(pos_encoding_mode="ALIBI"), NotImplementedError, "pos_encoding_mode"),
        (dict(pos_encoding_mode="ROPE_LLAMA", kv_data_type=torch.float8_e4m3fn), NotImplementedError, "float8_e4m3fn KV cache"),
        (dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=-1.0), ValueError, "rope_scale"),
        (dict(pos_encoding_mode="XYZ"), ValueError, "pos_encoding_mode"),
        (dict(head_dim_vo=128), ValueError, "head_dim_vo equal to head_dim_qk 64"),
        (dict(use_fp16_qk_reduction=True), NotImplementedError, "use_fp16_qk_reduction"),
        (dict(kv_data_type=torch.float32), ValueError, "kv_data_type"),
        (dict(q_data_type=torch.float32), ValueError, "q_data_type"),
        (dict(o_data_type=torch.float32), NotImplementedError, "o_data_type"),
        (dict(window_left=-2), ValueError, "window_left"),
        (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
        (dict(sm_scale="x"), TypeError, "sm_scale"),
        (dict(causal=1), TypeError, "causal"),
        (dict(fixed_split_size="4096"), TypeError, "fixed_split_size"),
    ],
    ids=lambda x: str(x)[:40],
)
def test_plan_options_are_checked(options, error, match):
    with pytest.raises(error, match=match):
        cpu_wrapper().plan(*paged_plan_args(), **options)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_kv_outside_a_paged_cache_is_not_implemented(kv_dtype):
    with pytest.raises(NotImplementedError, match="kv_data_type"):
        cpu_wrapper("ragged").plan(indptr_of([5]), indptr_of([5]), 8, 8, 64, kv_data_type=kv_dtype)
    q, k = torch.zeros(5, 8, 64).half(), torch.zeros(5, 8, 64).to(kv_dtype)
    with pytest.raises(NotImplementedError, match="k of dtype"):
        aotinfer.single_prefill_with_kv_cache(q, k, k)
    cpu_wrapper().plan(*paged_plan_args(), kv_data_type=kv_dtype)  # the paged wrapper takes it


def test_plan_tables_are_checked():
    args = list(paged_plan_args())
    with pytest.raises(ValueError, match="head_dim"):
        cpu_wrapper().plan(*args[:6], 96, 16)
    with pytest.raises(ValueError, match="num_qo_heads"):
        cpu_wrapper().plan(*args[:4], 12, 8, 64, 16)
    with pytest.raises(TypeError, match="qo_indptr"):
        cpu_wrapper().plan(args[0].long(), *args[1:])
    with pytest.raises(ValueError, match="paged_kv_indptr"):
        cpu_wrapper().plan(args[0], indptr_of([1, 1]), *args[2:])
    with pytest.raises(ValueError, match="paged_kv_last_page_len"):
        cpu_wrapper().plan(*args[:3], torch.tensor([17], dtype=torch.int32), *args[4:])
    with pytest.raises(ValueError, match="qo_indptr"):
        cpu_wrapper().plan(torch.tensor([3, 1], dtype=torch.int32), *args[1:])
    with pytest.raises(ValueError, match="kv_layout"):
        cpu_wrapper(kv_layout="NDH")
    with pytest.raises(ValueError, match="backend"):
        cpu_wrapper(backend="xformers")
    with pytest.raises(ValueError, match="qo_indptr_buf"):
        cpu_wrapper("ragged", use_cuda_graph=True)
    with pytest.raises(RuntimeError, match="plan"):
        cpu_wrapper().run(torch.zeros(5, 8, 64).half(), torch.zeros(2, 2, 16, 8, 64).half())


def test_bad_table_entries_are_named():
    """The plan's compiled checks (prefill_lengths) name the first bad entry of each table."""
    q3 = indptr_of([5, 2, 4])
    pages = indptr_of([1, 1, 1])
    indices = torch.arange(3, dtype=torch.int32)
    last = torch.tensor([5, 2, 4], dtype=torch.int32)

    def paged(qo=q3, indptr=pages, ids=indices, last_page_len=last, **options):
        cpu_wrapper().plan(qo, indptr, ids, last_page_len, 8, 8, 64, 16, **options)

    with pytest.raises(ValueError, match=r"qo_indptr never to decrease, got qo_indptr\[2\] = 3 after qo_indptr\[1\] = 5"):
        paged(qo=torch.tensor([0, 5, 3, 11], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"paged_kv_indptr to start at 0, got paged_kv_indptr\[0\] = 1"):
        paged(indptr=torch.tensor([1, 2, 3, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"paged_kv_indptr\[-1\] \(4\) to be at most len\(paged_kv_indices\) = 3"):
        paged(indptr=indptr_of([1, 2, 1]))
    with pytest.raises(ValueError, match=r"paged_kv_indptr to have batch_size \+ 1 = 4 elements, got 3"):
        paged(indptr=indptr_of([1, 1]))
    with pytest.raises(ValueError, match=r"paged_kv_last_page_len\[1\] = 17 for 1 pages"):
        paged(last_page_len=torch.tensor([5, 17, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"paged_kv_last_page_len to have batch_size = 3 elements, got 2"):
        paged(last_page_len=last[:2])
    with pytest.raises(ValueError, match=r"seq_lens\[2\] = 20 for 1 pages of 16"):
        paged(seq_lens=torch.tensor([5, 2, 20]))
    paged(seq_lens=torch.tensor([5, 2, 16]))  # within the pages: planned
    with pytest.raises(ValueError, match=r"kv_indptr never to decrease, got kv_indptr\[3\] = 6 after kv_indptr\[2\] = 7"):
        cpu_wrapper("ragged").plan(q3, torch.tensor([0, 5, 7, 6], dtype=torch.int32), 8, 8, 64)
    with pytest.raises(ValueError, match=r"kv_indptr to have batch_size \+ 1 = 4 elements"):
        cpu_wrapper("ragged").plan(q3, indptr_of([5, 2]), 8, 8, 64)


def test_run_checks_against_the_plan(kernel_model):
    wrapper = cpu_wrapper()
    wrapper.plan(*paged_plan_args(), q_data_type=torch.float16)
    cache = torch.zeros(2, 2, 16, 8, 64).half()
    with pytest.raises(ValueError, match="q"):
        wrapper.run(torch.zeros(4, 8, 64).half(), cache)
    with pytest.raises(ValueError, match="q_data_type"):
        wrapper.run(torch.zeros(5, 8, 64).bfloat16(), cache)
    with pytest.raises(ValueError, match="page_size"):
        wrapper.run(torch.zeros(5, 8, 64).half(), torch.zeros(2, 2, 8, 8, 64).half())
    with pytest.raises(ValueError, match="kv_data_type"):
        wrapper.run(torch.zeros(5, 8, 64).half(), cache.bfloat16())
    with pytest.raises(ValueError, match="kv_data_type"):
        wrapper.run(torch.zeros(5, 8, 64).half(), cache.to(torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="enable_pdl"):
        wrapper.run(torch.zeros(5, 8, 64).half(), cache, enable_pdl=3)
