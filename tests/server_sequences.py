"""vLLM's and SGLang's FlashInfer call sequences, replayed on a GPU through the flashinfer overlay.

Each function replays one sequence that tests/test_decode.py, test_prefill.py and test_sampling.py
replay against aotinfer directly (their docstrings name the server files and calls), here with every
FlashInfer name taken from ``flashinfer`` at the path the server imports it from, checked to be
aotinfer's own object, and each step's output checked against those modules' float32 references.
tests/test_overlay.py runs them in a fresh interpreter with AOTINFER_FLASHINFER=1, where ``import
flashinfer`` is the overlay: not a test module, and never imported in the pytest process (the
overlay, once installed, stays for the life of the process).
"""

import types

import torch

import aotinfer
from aotinfer import decode, overlay
from test_decode import check as check_decode
from test_decode import gather, kv_pool, page_table, reference, workspace
from test_prefill import Case, mask_forms, tree_masks
from test_prefill import check as check_prefill
from test_sampling import kept_mask

DEVICE = "cuda"
NAN = float("nan")


# ---- each server's imports, as its module makes them ---------------------------------------------


def served_by_aotinfer(**names):
    """``names``, after checking that each is aotinfer's own object (the overlay served it, not a
    real FlashInfer nor a placeholder); FlashInfer's private helpers are aotinfer.decode's."""
    assert overlay.state()["in_this_process"] == "installed", overlay.state()["in_this_process"]
    for name, obj in names.items():
        ours = getattr(aotinfer, name) if name in aotinfer.__all__ else getattr(decode, name)
        assert obj is ours, f"flashinfer's {name} is {obj!r}, not aotinfer's"
    return types.SimpleNamespace(**names)


def vllm_attention_names():
    """The FlashInfer imports at the top of vLLM's v1/attention/backends/flashinfer.py (0.33); the
    trtllm_* and FP4Tensor names are FlashInfer's or placeholders, and only need to import."""
    from flashinfer import (
        BatchDecodeWithPagedKVCacheWrapper,
        BatchPrefillWithPagedKVCacheWrapper,
        BatchPrefillWithRaggedKVCacheWrapper,
        MultiLevelCascadeAttentionWrapper,
    )
    from flashinfer.decode import _get_range_buf, trtllm_batch_decode_with_kv_cache
    from flashinfer.prefill import trtllm_batch_context_with_kv_cache
    from flashinfer.utils import FP4Tensor

    assert all(map(callable, (trtllm_batch_decode_with_kv_cache, trtllm_batch_context_with_kv_cache, FP4Tensor)))
    return served_by_aotinfer(
        BatchDecodeWithPagedKVCacheWrapper=BatchDecodeWithPagedKVCacheWrapper,
        BatchPrefillWithPagedKVCacheWrapper=BatchPrefillWithPagedKVCacheWrapper,
        BatchPrefillWithRaggedKVCacheWrapper=BatchPrefillWithRaggedKVCacheWrapper,
        MultiLevelCascadeAttentionWrapper=MultiLevelCascadeAttentionWrapper,
        _get_range_buf=_get_range_buf,
    )


def sglang_attention_names():
    """The FlashInfer imports at the top of SGLang's srt/layers/attention/flashinfer_backend.py
    (0.5.23). Its own fast_decode_plan calls get_seq_lens, imported from flashinfer.decode (which
    re-exports FlashInfer's page module's): returned as imported, checked by
    sglang_get_seq_lens_is_served (the overlay does not serve it at that path)."""
    from flashinfer import (
        BatchDecodeWithPagedKVCacheWrapper,
        BatchPrefillWithPagedKVCacheWrapper,
        BatchPrefillWithRaggedKVCacheWrapper,
    )
    from flashinfer.cascade import merge_state
    from flashinfer.decode import _get_range_buf, get_seq_lens

    names = served_by_aotinfer(
        BatchDecodeWithPagedKVCacheWrapper=BatchDecodeWithPagedKVCacheWrapper,
        BatchPrefillWithPagedKVCacheWrapper=BatchPrefillWithPagedKVCacheWrapper,
        BatchPrefillWithRaggedKVCacheWrapper=BatchPrefillWithRaggedKVCacheWrapper,
        merge_state=merge_state,
        _get_range_buf=_get_range_buf,
    )
    names.get_seq_lens = get_seq_lens
    return names


def sglang_get_seq_lens_is_served():
    served_by_aotinfer(get_seq_lens=sglang_attention_names().get_seq_lens)


def vllm_sampler_names():
    """vLLM's v1/sample/ops/topk_topp_sampler.py: ``import flashinfer.sampling``, then each op read
    from that module at the call."""
    import flashinfer.sampling

    return served_by_aotinfer(
        top_p_sampling_from_probs=flashinfer.sampling.top_p_sampling_from_probs,
        top_k_sampling_from_probs=flashinfer.sampling.top_k_sampling_from_probs,
        top_k_top_p_sampling_from_logits=flashinfer.sampling.top_k_top_p_sampling_from_logits,
    )


def sglang_sampler_names():
    """SGLang's srt/layers/sampler.py (its renorms come from sgl_kernel, not FlashInfer)."""
    from flashinfer.sampling import min_p_sampling_from_probs, top_k_top_p_sampling_from_probs

    return served_by_aotinfer(min_p_sampling_from_probs=min_p_sampling_from_probs,
                              top_k_top_p_sampling_from_probs=top_k_top_p_sampling_from_probs)  # fmt: skip


def every_servers_names():
    vllm_attention_names()
    sglang_attention_names()
    vllm_sampler_names()
    sglang_sampler_names()


# ---- helpers -------------------------------------------------------------------------------------


def capture(run):
    """A CUDA graph of ``run()`` (warmed up eagerly by the caller) and what ``run()`` returned in
    the capture: the tensors each replay writes."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = run()
    return graph, result


def load(case, q, kv):
    """A prefill case's queries and cache into the graph's fixed inputs (the same page ids)."""
    q.copy_(case.q)
    for dst, src in zip(kv, case.cache):
        dst[: src.shape[0]].copy_(src)


# ---- attention -----------------------------------------------------------------------------------


def vllm_fast_plan_decode():
    """test_decode.py::test_vllm_fast_plan_decode_sequence, as vLLM runs it: its decode wrapper is made
    with use_cuda_graph, so its run is captured into a CUDA graph after the first plan (eager first,
    as vLLM's warm-up) and the graph replayed after each fast_plan_decode, reading the tables that
    plan rewrote in place."""
    torch.manual_seed(0)
    fi = vllm_attention_names()
    heads, page_size, batch, scale, window_left, logits_soft_cap = (16, 4, 64), 16, 4, 0.125, -1, None
    indptr_buf = torch.zeros(batch + 1, dtype=torch.int32, device=DEVICE)
    indices_buf = torch.zeros(1000, dtype=torch.int32, device=DEVICE)
    last_buf = torch.zeros(batch, dtype=torch.int32, device=DEVICE)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        workspace(DEVICE), "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=indptr_buf,
        paged_kv_indices_buffer=indices_buf, paged_kv_last_page_len_buffer=last_buf, use_tensor_cores=True,
    )  # fmt: skip
    pool = 900
    cache, k, v = kv_pool(pool, page_size, heads[1], heads[2], torch.float16, "NHD", "5d", DEVICE)
    q = torch.empty(batch, heads[0], heads[2], dtype=torch.float16, device=DEVICE)  # the graph's input
    out = torch.empty_like(q)  # and its output
    graph = None
    # Short sequences, then a long one the plan splits (the replay merges what the capture did
    # not need to), then others.
    for step, lengths in enumerate(([3, 17, 40, 2], [4000, 5, 0, 700], [16, 1, 2, 3])):
        indptr, indices, last, _ = page_table(lengths, page_size)  # vLLM's host tables
        indices = torch.randperm(pool)[: indices.numel()].int()
        seq_lens = torch.tensor(lengths, dtype=torch.int32)
        indices_buf[: indices.numel()].copy_(indices)  # vLLM's kernel writes the page ids into the buffer
        if step == 0:
            wrapper.plan(indptr, indices_buf[: indices.numel()], last, *heads, page_size, "NONE", window_left,
                         logits_soft_cap, torch.float16, torch.float16, torch.float16, None, scale, None, None, True,
                         None, None, -1, False)  # fmt: skip
        else:  # fast_plan_decode
            indptr_buf.copy_(indptr, non_blocking=True)
            last_buf.copy_(last, non_blocking=True)
            qo_indptr_host = fi._get_range_buf(batch + 1, "cpu")
            wrapper._plan_info = wrapper._cached_module.plan(
                wrapper._float_workspace_buffer, wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer,
                qo_indptr_host, indptr, seq_lens, batch, batch, heads[0], heads[1], page_size,
                wrapper.is_cuda_graph_enabled, heads[2], heads[2], False, window_left,
            )  # fmt: skip
            wrapper._pos_encoding_mode, wrapper._window_left, wrapper._logits_soft_cap = "NONE", window_left, 0.0
            wrapper._sm_scale, wrapper._rope_scale, wrapper._rope_theta = scale, None, None
        assert wrapper._window_left == window_left and wrapper._logits_soft_cap == (logits_soft_cap or 0.0)
        assert wrapper._sm_scale == scale
        if step == 1:
            assert wrapper._plan.partition.num_slots > 0, "the second step should split the long sequence"
        q.copy_(torch.randn(q.shape).half())
        keys, values = gather(k, v, indptr, indices, last, "NHD")
        want, _ = reference(q, keys, values, scale)
        if graph is None:
            out.fill_(NAN)
            wrapper.run(q, cache, k_scale=1.0, v_scale=1.0, out=out)
            check_decode(out, want, torch.float16)
            graph, _ = capture(lambda: wrapper.run(q, cache, k_scale=1.0, v_scale=1.0, out=out))
        out.fill_(NAN)
        graph.replay()
        check_decode(out, want, torch.float16)


def sglang_fast_decode_plan(use_tensor_cores):
    """test_decode.py::test_sglang_fast_decode_plan_sequence: SGLang's fast_decode_plan on a decode
    wrapper without CUDA graphs, its page table in GPU tensors it sets as the wrapper's buffers, the
    host copies it plans from."""
    torch.manual_seed(0)
    fi = sglang_attention_names()
    heads, page_size, scale = (16, 4, 64), 16, 0.125
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace(DEVICE), "NHD", use_tensor_cores=use_tensor_cores)
    pool = 900
    cache, k, v = kv_pool(pool, page_size, heads[1], heads[2], torch.float16, "NHD", "5d", DEVICE)
    wrapper.plan(*page_table([3, 2], page_size)[:3], *heads, page_size, q_data_type=torch.float16, sm_scale=scale)
    for lengths in ([3, 17, 40, 2], [4000, 5, 0, 700]):
        indptr, indices, last, _ = page_table(lengths, page_size)
        indices = torch.randperm(pool)[: indices.numel()].int()
        batch = len(lengths)
        indptr_gpu, indices_gpu, last_gpu = indptr.to(DEVICE), indices.to(DEVICE), last.to(DEVICE)
        wrapper._paged_kv_indptr_buf, wrapper._paged_kv_indices_buf = indptr_gpu, indices_gpu
        wrapper._paged_kv_last_page_len_buf = last_gpu
        indptr_host = indptr_gpu.cpu()
        if use_tensor_cores:
            qo_indptr_host = fi._get_range_buf(batch + 1, "cpu")
            wrapper._qo_indptr_buf = qo_indptr_host.to(DEVICE, non_blocking=True)
            kv_lens_host = fi.get_seq_lens(indptr_host, last_gpu.cpu(), page_size)
            wrapper._plan_info = wrapper._cached_module.plan(
                wrapper._float_workspace_buffer, wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer,
                qo_indptr_host, indptr_host, kv_lens_host, batch, batch, heads[0], heads[1], page_size,
                wrapper.is_cuda_graph_enabled, heads[2], heads[2], False,
            )  # fmt: skip
        else:
            wrapper._plan_info = wrapper._cached_module.plan(
                wrapper._float_workspace_buffer, wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer,
                indptr_host, batch, heads[0], heads[1], page_size, wrapper.is_cuda_graph_enabled, -1, 0.0, heads[2],
                heads[2], torch.empty(0, dtype=torch.float16, device=DEVICE),
                torch.empty(0, dtype=torch.float16, device=DEVICE),
            )  # fmt: skip
        wrapper._pos_encoding_mode, wrapper._window_left, wrapper._logits_soft_cap = "NONE", -1, 0.0
        wrapper._sm_scale, wrapper._rope_scale, wrapper._rope_theta = scale, None, None
        q = torch.randn(batch, heads[0], heads[2], device=DEVICE).half()
        keys, values = gather(k, v, indptr, indices, last, "NHD")
        want, _ = reference(q, keys, values, scale)
        out = torch.full_like(q, NAN)
        assert wrapper.run(q, cache, out=out) is out
        check_decode(out, want, torch.float16)


def sglang_fast_prefill_plan():
    """test_prefill.py::test_sglang_fast_prefill_plan_sequence under CUDA graphs, as SGLang runs its
    EAGLE draft extend: a real plan and the forward captured, then each replay after
    fast_prefill_plan, which copies the page table into the wrapper's graph buffers and plans
    through _cached_module from the host tables."""
    torch.manual_seed(0)
    fi = sglang_attention_names()
    batch, heads, page_size, scale, q_len = 3, (12, 2, 64), 8, 0.2, 4
    buffers = dict(
        qo_indptr_buf=torch.empty(batch + 1, dtype=torch.int32, device=DEVICE),
        paged_kv_indptr_buf=torch.empty(batch + 1, dtype=torch.int32, device=DEVICE),
        paged_kv_indices_buf=torch.empty(4096, dtype=torch.int32, device=DEVICE),
        paged_kv_last_page_len_buf=torch.empty(batch, dtype=torch.int32, device=DEVICE),
    )  # fmt: skip
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace(DEVICE), "NHD", use_cuda_graph=True, backend="fa2",
                                                     **buffers)  # fmt: skip
    q = torch.zeros(batch * q_len, heads[0], heads[2], dtype=torch.float16, device=DEVICE)  # the graph's inputs
    kv = tuple(torch.zeros(64, page_size, heads[1], heads[2], dtype=torch.float16, device=DEVICE) for _ in range(2))
    graph = None
    for pairs in ([(q_len, 30), (q_len, 9), (q_len, 4)], [(q_len, 100), (q_len, 4), (q_len, 57)],
                  [(q_len, 12), (q_len, 300), (q_len, 9)]):  # fmt: skip
        case = Case(pairs, heads, torch.float16, "paged", page_size=page_size, device=DEVICE)
        load(case, q, kv)
        want, want_lse = case.reference(causal=True, sm_scale=scale)
        if graph is None:  # the capture: a real plan, the forward eagerly, then captured
            case.plan(wrapper, causal=True, sm_scale=scale)
            assert wrapper._backend == "fa2" and wrapper._cached_module is not None and wrapper._max_total_num_rows is None
            eager_out, eager_lse = wrapper.forward_return_lse(q, kv, causal=True, sm_scale=scale)
            check_prefill(eager_out, want, torch.float16, eager_lse, want_lse)
            graph, (out, lse) = capture(lambda: wrapper.forward_return_lse(q, kv, causal=True, sm_scale=scale))
        else:  # fast_prefill_plan
            qo_indptr_host, kv_indptr_host = case.qo_indptr, case.indptr
            kv_lens_host = torch.tensor([kv_len for _, kv_len in pairs], dtype=torch.int32)
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
                qo_indptr_host, kv_indptr_host, kv_lens_host, wrapper._max_total_num_rows or total_num_rows, batch,
                heads[0], heads[1], page_size, wrapper.is_cuda_graph_enabled, heads[2], heads[2], True, -1, -1, False, 0, 0,
            )  # fmt: skip
            assert int(wrapper._plan.requests.shape[0]) == batch
        out.fill_(NAN)
        lse.fill_(NAN)
        graph.replay()
        check_prefill(out, want, torch.float16, lse, want_lse)


def sglang_fast_prefill_plan_with_a_tree_mask():
    """test_prefill.py::test_sglang_fast_prefill_plan_with_a_tree_mask under CUDA graphs, as SGLang
    runs EAGLE verification: the wrapper made with custom_mask_buf and mask_indptr_buf, a real plan
    with the capture's tree masks and the run captured; before each replay SGLang packs the step's
    tree masks into custom_mask_buf itself (a request's segment from a byte of its own) and plans
    through _cached_module (page_size 1, causal False)."""
    torch.manual_seed(0)
    fi = sglang_attention_names()
    batch, heads, width = 3, (12, 2, 64), 4
    buffers = dict(
        qo_indptr_buf=torch.empty(batch + 1, dtype=torch.int32, device=DEVICE),
        paged_kv_indptr_buf=torch.empty(batch + 1, dtype=torch.int32, device=DEVICE),
        paged_kv_indices_buf=torch.empty(4096, dtype=torch.int32, device=DEVICE),
        paged_kv_last_page_len_buf=torch.empty(batch, dtype=torch.int32, device=DEVICE),
        custom_mask_buf=torch.empty(8192, dtype=torch.uint8, device=DEVICE),
        mask_indptr_buf=torch.empty(batch + 1, dtype=torch.int32, device=DEVICE),
    )  # fmt: skip
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace(DEVICE), "NHD", use_cuda_graph=True, backend="fa2",
                                                     **buffers)  # fmt: skip
    q = torch.zeros(batch * width, heads[0], heads[2], dtype=torch.float16, device=DEVICE)  # the graph's inputs
    kv = tuple(torch.zeros(400, heads[1], heads[2], dtype=torch.float16, device=DEVICE) for _ in range(2))  # page_size 1
    graph = None
    for seed, pairs in enumerate(([(width, 30), (width, 9), (width, 4)], [(width, 100), (width, 4), (width, 57)],
                                  [(width, 12), (width, 300), (width, 9)])):  # fmt: skip
        case = Case(pairs, heads, torch.float16, "paged", page_size=1, device=DEVICE)
        masks = tree_masks(pairs, seed)
        load(case, q, kv)
        want, want_lse = case.reference(masks=masks)
        if graph is None:  # the capture: a real plan with the masks, the run eagerly, then captured
            case.plan(wrapper, **mask_forms(masks, "bool", DEVICE))
            eager_out, eager_lse = wrapper.run(q, kv, return_lse=True)
            check_prefill(eager_out, want, torch.float16, eager_lse, want_lse)
            graph, (out, lse) = capture(lambda: wrapper.run(q, kv, return_lse=True))
        else:  # fast_prefill_plan with SGLang's packed masks
            kv_lens_host = torch.tensor([kv_len for _, kv_len in pairs], dtype=torch.int32)
            wrapper._qo_indptr_buf.copy_(case.qo_indptr)
            wrapper._paged_kv_indptr_buf.copy_(case.indptr)
            wrapper._paged_kv_last_page_len_buf.copy_(case.last_page_len)
            wrapper._paged_kv_indices_buf[: len(case.indices)].copy_(case.indices)
            packed_indptr = torch.zeros(batch + 1, dtype=torch.int32)
            packed_indptr[1:] = torch.cumsum((kv_lens_host * width + 7) // 8, 0)
            wrapper._mask_indptr_buf.copy_(packed_indptr)
            packed = mask_forms(masks, "packed", DEVICE)["packed_custom_mask"]
            wrapper._custom_mask_buf[: packed.numel()].copy_(packed)
            wrapper._custom_mask_buf[packed.numel() :].fill_(0xFF)  # bits past the masks are never read
            wrapper._plan_info = wrapper._cached_module.plan(
                wrapper._float_workspace_buffer, wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer,
                case.qo_indptr, case.indptr, kv_lens_host, int(case.qo_indptr[-1]), batch, heads[0], heads[1], 1,
                wrapper.is_cuda_graph_enabled, heads[2], heads[2], False, -1, -1, False, 0, 0,
            )  # fmt: skip
            assert torch.equal(wrapper._mask_indptr_buf.cpu(), packed_indptr)
        out.fill_(NAN)
        lse.fill_(NAN)
        graph.replay()
        check_prefill(out, want, torch.float16, lse, want_lse)


# ---- sampling ------------------------------------------------------------------------------------


def vllm_flashinfer_sample():
    """test_sampling.py::test_vllm_flashinfer_sample_calls: vLLM's flashinfer_sample, its three
    branches as it calls them through flashinfer.sampling."""
    fi = vllm_sampler_names()
    batch, vocab = 64, 32000
    g = torch.Generator(device=DEVICE).manual_seed(4)
    logits = torch.randn(batch, vocab, device=DEVICE, generator=g) * 4
    k = torch.randint(1, 200, (batch,), device=DEVICE, generator=g)  # int64, as vLLM holds it
    p = torch.rand(batch, device=DEVICE, generator=g) * 0.9 + 0.05
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    calls = {
        "top_p": (fi.top_p_sampling_from_probs(probs, p, deterministic=True), dict(top_p=p)),
        "top_k": (fi.top_k_sampling_from_probs(probs, k, deterministic=True), dict(top_k=k)),
        "top_k_top_p": (fi.top_k_top_p_sampling_from_logits(logits, k, p, deterministic=True), dict(top_k=k, top_p=p)),
    }
    for name, (tokens, filters) in calls.items():
        tokens = tokens.view(-1)
        assert tokens.shape == (batch,), name
        if "top_p" in filters:  # the boundary token's mass, computed in float32 by the kernel: a margin
            filters = dict(filters, top_p=(filters["top_p"] + 1e-4).clamp(max=1.0))
        keep = kept_mask(probs, **filters)
        assert bool(keep.gather(1, tokens.long()[:, None]).all()), f"{name}: a token outside its row's kept set"


def sglang_sampler():
    """test_sampling.py::test_sglang_sampler_calls: SGLang's Sampler with the flashinfer backend, the
    joint top-k/top-p draw (int32 k, 1 << 30 for none) and the min-p draw."""
    fi = sglang_sampler_names()
    batch, vocab, no_top_k = 64, 32000, 1 << 30
    g = torch.Generator(device=DEVICE).manual_seed(6)
    probs = (torch.randn(batch, vocab, device=DEVICE, generator=g) * 4).softmax(-1)
    top_ks = torch.randint(1, 200, (batch,), device=DEVICE, generator=g).to(torch.int32)
    top_ks[::4] = no_top_k
    top_ps = torch.rand(batch, device=DEVICE, generator=g) * 0.9 + 0.05
    top_ps[1::4] = 1.0
    min_ps = torch.rand(batch, device=DEVICE, generator=g) * 0.3
    joint = fi.top_k_top_p_sampling_from_probs(probs.contiguous(), top_ks, top_ps, filter_apply_order="joint")
    min_p = fi.min_p_sampling_from_probs(probs, min_ps)
    calls = {
        "joint": (joint, dict(top_k=top_ks.long(), top_p=(top_ps + 1e-4).clamp(max=1.0), order="joint")),
        "min_p": (min_p, dict(min_p=min_ps * (1 - 1e-5))),  # the threshold computed in float32: a margin
    }
    for name, (tokens, filters) in calls.items():
        assert tokens.shape == (batch,) and tokens.dtype == torch.int32, name
        keep = kept_mask(probs, **filters)
        assert bool(keep.gather(1, tokens.long()[:, None]).all()), f"{name}: a token outside its row's kept set"

