"""MLA attention (aotinfer.mla): BatchMLAPagedAttentionWrapper against a float32 reference (the
latent expanded: k = [ckv, kpe], v = ckv; plain softmax attention over the gathered pages) on the
GPU, with ragged batches, page sizes, head counts, causal query tokens, split keys, CUDA graphs and
the LSE; argument errors on the CPU."""

import math

import pytest
import torch

import aotinfer
from aotinfer import mla
from test_decode import LN2, LSE_TOLERANCE, TOLERANCE, poisoned, workspace

gpu = pytest.mark.gpu
SM_SCALE = 1 / math.sqrt(192)


class Case:
    """One batch: (q_len, kv_len) pairs, the latent cache in scattered pages, the queries."""

    def __init__(self, pairs, num_heads, page_size, dtype=torch.bfloat16, device="cuda", seed=0):
        g = torch.Generator().manual_seed(seed)
        self.pairs, self.num_heads, self.page_size, self.dtype = pairs, num_heads, page_size, dtype
        q_lens = [q for q, _ in pairs]
        self.kv_lens = torch.tensor([kv for _, kv in pairs], dtype=torch.int32)
        pages = [-(-kv // page_size) for _, kv in pairs]
        self.qo_indptr = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        self.kv_indptr = torch.tensor([0] + pages).cumsum(0).to(torch.int32)
        pool = 2 * sum(pages) + 3  # pages scattered over a pool twice the size
        self.kv_indices = torch.randperm(pool, generator=g)[: sum(pages)].to(torch.int32)
        total = int(self.qo_indptr[-1])

        def randn(*shape):
            return torch.randn(*shape, generator=g).to(dtype).to(device)

        self.q_nope, self.q_pe = randn(total, num_heads, 512), randn(total, num_heads, 64)
        self.ckv, self.kpe = randn(pool, page_size, 512), randn(pool, page_size, 64)

    def plan(self, wrapper, causal=False, sm_scale=SM_SCALE):
        device = wrapper.device
        wrapper.plan(self.qo_indptr.to(device), self.kv_indptr.to(device), self.kv_indices.to(device),
                     self.kv_lens.to(device), self.num_heads, 512, 64, self.page_size, causal, sm_scale, self.dtype,
                     self.dtype)  # fmt: skip

    def reference(self, causal=False, sm_scale=SM_SCALE):
        """(out [tokens, heads, 512], lse [tokens, heads] base 2) in float32."""
        out = torch.zeros(self.q_nope.shape, dtype=torch.float32)
        lse = torch.full(self.q_nope.shape[:2], float("-inf"))
        for b, (q_len, kv_len) in enumerate(self.pairs):
            begin = int(self.qo_indptr[b])
            pages = self.kv_indices[int(self.kv_indptr[b]) : int(self.kv_indptr[b + 1])].long()
            ckv = self.ckv.cpu().float()[pages].reshape(-1, 512)[:kv_len]
            kpe = self.kpe.cpu().float()[pages].reshape(-1, 64)[:kv_len]
            q_nope = self.q_nope[begin : begin + q_len].cpu().float()
            q_pe = self.q_pe[begin : begin + q_len].cpu().float()
            logits = (torch.einsum("qhd,kd->qhk", q_nope, ckv) + torch.einsum("qhd,kd->qhk", q_pe, kpe)) * sm_scale
            if causal:
                seen = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + kv_len - q_len
                logits = logits.masked_fill(~seen[:, None, :], float("-inf"))
            total = torch.logsumexp(logits, -1)  # -inf where no key is seen
            probs = torch.exp(logits - total[..., None]).nan_to_num(0.0)
            out[begin : begin + q_len] = torch.einsum("qhk,kd->qhd", probs, ckv)
            lse[begin : begin + q_len] = total / LN2
        return out, lse


def check(out, lse, want, want_lse, dtype):
    assert not out.isnan().any(), "some outputs were not written"
    torch.testing.assert_close(out.float().cpu(), want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    if lse is not None:
        assert not lse.isnan().any(), "some log-sum-exps were not written"
        torch.testing.assert_close(lse.cpu(), want_lse, rtol=LSE_TOLERANCE, atol=LSE_TOLERANCE)


# Ragged batches: empty and one-token caches, lengths off the tiles, several query tokens.
DECODE_PAIRS = [(1, 0), (1, 1), (1, 37), (1, 300), (1, 1000), (1, 64)]
SEVERAL_PAIRS = [(3, 3), (8, 40), (1, 1), (5, 700), (2, 129)]


@gpu
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("num_heads", [16, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pairs, causal", [(DECODE_PAIRS, False), (SEVERAL_PAIRS, True), (SEVERAL_PAIRS, False)],
                         ids=["decode", "several-causal", "several-full"])  # fmt: skip
def test_mla_matches_reference(pairs, causal, dtype, num_heads, page_size):
    case = Case(pairs, num_heads, page_size, dtype)
    wrapper = aotinfer.BatchMLAPagedAttentionWrapper(workspace("cuda", 128 << 20))
    case.plan(wrapper, causal)
    want, want_lse = case.reference(causal)
    out, lse = poisoned(case.q_nope.shape, dtype), poisoned(case.q_nope.shape[:2], torch.float32)
    result = wrapper.run(case.q_nope, case.q_pe, case.ckv, case.kpe, out=out, lse=lse, return_lse=True)
    assert result[0] is out and result[1] is lse
    check(out, lse, want, want_lse, dtype)
    check(wrapper.run(case.q_nope, case.q_pe, case.ckv, case.kpe), None, want, None, dtype)


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_long_keys_split_and_merge(causal):
    """One request of 20000 keys (and a short one) leaves the GPU idle unsplit: the plan splits its
    keys, the partials (512 wide) merge into the output."""
    case = Case([(2, 20000), (1, 50)], 128, 64)
    wrapper = aotinfer.BatchMLAPagedAttentionWrapper(workspace("cuda", 128 << 20))
    case.plan(wrapper, causal)
    assert wrapper._plan.merge_from >= 0, "the keys were not split"
    want, want_lse = case.reference(causal)
    out, lse = wrapper.run(case.q_nope, case.q_pe, case.ckv, case.kpe, out=poisoned(case.q_nope.shape, torch.bfloat16),
                           return_lse=True)  # fmt: skip
    check(out, lse, want, want_lse, torch.bfloat16)


@gpu
def test_packed_forms_and_natural_lse():
    """query= and kv_cache= as one tensor each ([..., 576], viewed apart), the LSE in base e."""
    case = Case(SEVERAL_PAIRS, 16, 16)
    wrapper = aotinfer.BatchMLAPagedAttentionWrapper(workspace("cuda", 128 << 20))
    case.plan(wrapper, True)
    want, want_lse = case.reference(True)
    query = torch.cat([case.q_nope, case.q_pe], -1)
    kv_cache = torch.cat([case.ckv, case.kpe], -1)
    out, lse = wrapper.run(query=query, kv_cache=kv_cache, return_lse=True, return_lse_base_on_e=True)
    check(out, lse / LN2, want, want_lse, torch.bfloat16)


@gpu
def test_cuda_graph_replays_after_the_page_table_changes():
    """use_cuda_graph: a run captured once replays right after each new plan (new lengths, new
    pages, the same batch size), from the wrapper's buffers."""
    batch, heads, page_size = 4, 64, 16
    buffers = dict(
        qo_indptr=torch.empty(batch + 1, dtype=torch.int32, device="cuda"),
        kv_indptr=torch.empty(batch + 1, dtype=torch.int32, device="cuda"),
        kv_indices=torch.empty(4096, dtype=torch.int32, device="cuda"),
        kv_len_arr=torch.empty(batch, dtype=torch.int32, device="cuda"),
    )
    wrapper = aotinfer.BatchMLAPagedAttentionWrapper(workspace("cuda", 128 << 20), use_cuda_graph=True, **buffers)
    first = Case([(1, 10), (1, 900), (1, 3), (1, 64)], heads, page_size, seed=1)
    first.plan(wrapper)
    q_nope, q_pe, out = first.q_nope.clone(), first.q_pe.clone(), torch.empty_like(first.q_nope)
    ckv, kpe = first.ckv.new_empty((600, page_size, 512)), first.kpe.new_empty((600, page_size, 64))
    wrapper.run(q_nope, q_pe, ckv, kpe, out=out)  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q_nope, q_pe, ckv, kpe, out=out)
    for seed, pairs in enumerate(([(1, 10), (1, 900), (1, 3), (1, 64)], [(1, 4000), (1, 1), (1, 0), (1, 333)]), 2):
        case = Case(pairs, heads, page_size, seed=seed)
        case.plan(wrapper)
        q_nope.copy_(case.q_nope)
        q_pe.copy_(case.q_pe)
        ckv[: case.ckv.shape[0]].copy_(case.ckv)
        kpe[: case.kpe.shape[0]].copy_(case.kpe)
        out.fill_(float("nan"))
        graph.replay()
        want, _ = case.reference()
        check(out, None, want, None, torch.bfloat16)


@gpu
@pytest.mark.parametrize("use_cuda_graph", [False, True])
def test_requests_without_keys_over_a_cache_without_pages(use_cuda_graph):
    """Every request with no keys, the cache of no pages (FlashInfer's own tests do this, with a
    buffer of 2^20 page ids under CUDA graphs): zero outputs and LSEs of -inf."""
    i32 = dict(dtype=torch.int32, device="cuda")
    buffers = dict(qo_indptr=torch.empty(3, **i32), kv_indptr=torch.empty(3, **i32), kv_indices=torch.empty(1 << 20, **i32),
                   kv_len_arr=torch.empty(2, **i32)) if use_cuda_graph else {}  # fmt: skip
    wrapper = aotinfer.BatchMLAPagedAttentionWrapper(workspace("cuda", 128 << 20), use_cuda_graph=use_cuda_graph, **buffers)
    wrapper.plan(torch.tensor([0, 1, 3], **i32), torch.zeros(3, **i32), torch.empty(0, **i32), torch.zeros(2, **i32), 16, 512,
                 64, 16, False, SM_SCALE, torch.bfloat16, torch.bfloat16)  # fmt: skip
    q_nope, q_pe = torch.randn(3, 16, 512, device="cuda").bfloat16(), torch.randn(3, 16, 64, device="cuda").bfloat16()
    ckv, kpe = torch.empty(0, 16, 512, device="cuda").bfloat16(), torch.empty(0, 16, 64, device="cuda").bfloat16()
    out, lse = wrapper.run(q_nope, q_pe, ckv, kpe, out=poisoned((3, 16, 512), torch.bfloat16), return_lse=True)
    assert bool((out == 0).all()) and bool((lse == float("-inf")).all())


@gpu
def test_plan_after_a_captured_run_is_refused():
    case = Case(DECODE_PAIRS, 16, 16)
    wrapper = aotinfer.BatchMLAPagedAttentionWrapper(workspace("cuda", 128 << 20))
    case.plan(wrapper)
    wrapper.run(case.q_nope, case.q_pe, case.ckv, case.kpe)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(case.q_nope, case.q_pe, case.ckv, case.kpe)
    with pytest.raises(RuntimeError, match="captured"):
        case.plan(wrapper)


@gpu
def test_run_arguments_are_checked():
    case = Case(DECODE_PAIRS, 16, 16)
    wrapper = aotinfer.BatchMLAPagedAttentionWrapper(workspace("cuda", 128 << 20))
    case.plan(wrapper)
    with pytest.raises(ValueError, match="q_pe"):
        wrapper.run(case.q_nope, case.q_pe[..., :32], case.ckv, case.kpe)
    with pytest.raises(ValueError, match="kpe_cache"):
        wrapper.run(case.q_nope, case.q_pe, case.ckv, case.kpe[:3])
    with pytest.raises(TypeError, match="ckv_cache and kpe_cache of q_nope's dtype"):
        wrapper.run(case.q_nope, case.q_pe, case.ckv.half(), case.kpe.half())
    with pytest.raises(ValueError, match="planned page_size 16"):
        wrapper.run(case.q_nope, case.q_pe, case.ckv[:, :8], case.kpe[:, :8])
    with pytest.raises(ValueError, match="out"):
        wrapper.run(case.q_nope, case.q_pe, case.ckv, case.kpe, out=torch.empty(6, 16, 256, dtype=torch.bfloat16, device="cuda"))


# ---- the CPU -----------------------------------------------------------------------------------


def cpu_plan_args(**changes):
    args = dict(qo_indptr=torch.tensor([0, 1, 2], dtype=torch.int32), kv_indptr=torch.tensor([0, 1, 3], dtype=torch.int32),
                kv_indices=torch.tensor([4, 0, 2], dtype=torch.int32), kv_len_arr=torch.tensor([5, 20], dtype=torch.int32),
                num_heads=16, head_dim_ckv=512, head_dim_kpe=64, page_size=16, causal=False, sm_scale=SM_SCALE,
                q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)  # fmt: skip
    args.update(changes)
    return args


def cpu_wrapper(**kwargs):
    return aotinfer.BatchMLAPagedAttentionWrapper(torch.empty(8 << 20, dtype=torch.uint8), **kwargs)


@pytest.mark.parametrize(
    "changes, error, match",
    [
        (dict(head_dim_ckv=256), ValueError, "head_dim_ckv 512"),
        (dict(head_dim_kpe=32), ValueError, "head_dim_kpe 64"),
        (dict(head_dim_kpe=0), NotImplementedError, "head_dim_kpe=0"),
        (dict(kv_data_type=torch.float8_e4m3fn), NotImplementedError, "float8_e4m3fn latent cache"),
        (dict(q_data_type=torch.float32), ValueError, "q_data_type"),
        (dict(kv_data_type=torch.float16), ValueError, "kv_data_type"),
        (dict(kv_indices=torch.tensor([4, 0, 2])), TypeError, "kv_indices"),
        (dict(kv_len_arr=torch.tensor([5, 40], dtype=torch.int32)), ValueError, r"request 1's pages \(kv_indptr\[1\] = 1, kv_len_arr\[1\] = 40"),
        (dict(kv_len_arr=torch.tensor([5], dtype=torch.int32)), ValueError, "kv_len_arr to have batch_size = 2"),
        (dict(kv_len_arr=torch.tensor([5, -1], dtype=torch.int32)), ValueError, "kv_len_arr >= 0"),
        (dict(qo_indptr=torch.tensor([0, 2, 1], dtype=torch.int32)), ValueError, "qo_indptr never to decrease"),
        (dict(sm_scale=0.0), ValueError, "sm_scale"),
        (dict(causal=1), TypeError, "causal"),
        (dict(use_profiler=True), NotImplementedError, "use_profiler"),
    ],
    ids=lambda x: str(x)[:40],
)
def test_plan_arguments_are_checked(changes, error, match):
    with pytest.raises(error, match=match):
        cpu_wrapper().plan(**cpu_plan_args(**changes))


def test_backends():
    with pytest.raises(NotImplementedError, match="backend='fa3' is not implemented"):
        cpu_wrapper(backend="fa3")
    with pytest.raises(ValueError, match="backend must be one of"):
        cpu_wrapper(backend="fa4")
    cpu_wrapper(backend="fa2").plan(**cpu_plan_args())


def test_kv_indptr_gives_each_requests_first_page():
    """As FlashInfer's MLA plan reads it: request i's pages from kv_indptr[i], kv_len_arr[i] tokens;
    kv_indptr's other entries (FlashInfer's tests interleave them) are not read, and only the page
    ids the requests read are copied."""
    wrapper = cpu_wrapper()
    wrapper.plan(**cpu_plan_args(kv_indptr=torch.tensor([2, 0, 77, 5], dtype=torch.int32),
                                 kv_indices=torch.arange(9, dtype=torch.int32)))  # fmt: skip
    assert wrapper._plan.requests[:, 2].tolist() == [2, 0]  # kv_offset: the first page
    assert wrapper._plan.indices.tolist() == [0, 1, 2]


def test_both_readings_of_kv_indptr_agree():
    """An indptr of the batch goes through the prefill plan's compiled reading; one entry longer,
    through FlashInfer's reading (each request's first page): the same table."""
    g = torch.Generator().manual_seed(3)
    kv_len = torch.randint(0, 300, (40,), generator=g).to(torch.int32)
    pages = (kv_len + 15) // 16
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), pages.cumsum(0)]).to(torch.int32)
    qo_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randint(0, 4, (40,), generator=g).cumsum(0)]).to(torch.int32)
    n = int(kv_indptr[-1])
    compiled = mla._request_lengths(qo_indptr, kv_indptr, kv_len, 16, n, torch.device("cpu"))
    longer = torch.cat([kv_indptr, kv_indptr[-1:]])
    flashinfers = mla._request_lengths(qo_indptr, longer, kv_len, 16, n, torch.device("cpu"))
    assert torch.equal(compiled[0], flashinfers[0]) and compiled[1] == flashinfers[1] == int(qo_indptr[-1])


def test_cuda_graph_plans_hand_the_kernel_the_ids_read():
    """Under use_cuda_graph the kernel gets the first page ids of the buffer, as many as the
    requests read (one at least, at the buffer's address: FlashInfer's tests pass a buffer of 2^20
    ids and requests of no keys)."""
    i32 = dict(dtype=torch.int32)
    buffers = dict(qo_indptr=torch.empty(3, **i32), kv_indptr=torch.empty(3, **i32), kv_indices=torch.empty(1 << 20, **i32),
                   kv_len_arr=torch.empty(2, **i32))  # fmt: skip
    wrapper = cpu_wrapper(use_cuda_graph=True, **buffers)
    wrapper.plan(**cpu_plan_args(kv_indptr=torch.zeros(3, **i32), kv_indices=torch.empty(0, **i32),
                                 kv_len_arr=torch.zeros(2, **i32)))  # fmt: skip
    assert wrapper._plan.indices.numel() == 1 and wrapper._plan.indices.data_ptr() == buffers["kv_indices"].data_ptr()
    wrapper.plan(**cpu_plan_args())
    assert wrapper._plan.indices.tolist() == [4, 0, 2] and wrapper._plan.indices.data_ptr() == buffers["kv_indices"].data_ptr()
    with pytest.raises(ValueError, match="kv_indices' buffer"):
        cpu_wrapper(use_cuda_graph=True, **dict(buffers, kv_indices=torch.empty(2, **i32))).plan(**cpu_plan_args())


def test_plan_tiles_a_tokens_heads_32_rows_at_a_time():
    """The work is the prefill plan's for one KV head, in the MLA kernel's 32-row tiles: a token's
    128 heads are 4 tiles."""
    wrapper = cpu_wrapper()
    wrapper.plan(**cpu_plan_args(num_heads=128, qo_indptr=torch.tensor([0, 1, 3], dtype=torch.int32), causal=True))
    plan = wrapper._plan
    assert plan.binding is mla._batch_mla and plan.head_dim_vo == 512 and plan.num_kv_heads == 1
    work = plan.work[1 : 1 + int(plan.work[0, 0])]
    rows = sorted((int(r), int(b)) for r, b in zip(work[:, 0], work[:, 1]))
    assert rows == [(0, 0), (0, 32), (0, 64), (0, 96)] + [(1, b) for b in range(0, 256, 32)]


def test_binding_checks_on_a_tracers_stand_ins():
    from torch._subclasses.fake_tensor import FakeTensorMode

    wrapper = cpu_wrapper()
    wrapper.plan(**cpu_plan_args())
    plan = wrapper._plan
    with FakeTensorMode():
        def cuda(*shape, dtype=torch.bfloat16):
            return torch.empty(*shape, dtype=dtype, device="cuda")

        good = dict(out=cuda(2, 16, 512), q_nope=cuda(2, 16, 512), q_pe=cuda(2, 16, 64), ckv=cuda(8, 16, 512), kpe=cuda(8, 16, 64))
        cases = [
            (dict(q_pe=cuda(2, 16, 32)), ValueError, r"Expected q_pe to have shape \[2, 16, 64\]"),
            (dict(kpe=cuda(8, 8, 64)), ValueError, "Expected kpe_cache to have ckv_cache's pages and page_size"),
            (dict(ckv=cuda(8, 16, 512, dtype=torch.float16)), TypeError, "ckv_cache and kpe_cache of q_nope's dtype"),
            (dict(out=cuda(2, 16, 256)), ValueError, r"Expected out to have shape \[2, 16, 512\]"),
            (dict(q_nope=cuda(2, 16, 512, dtype=torch.float32)), TypeError, "q_nope"),
        ]
        for change, error, match in cases:
            t = dict(good, **change)
            with pytest.raises(error, match=match):
                mla._batch_mla(t["out"], cuda(0, dtype=torch.float32), cuda(0, dtype=torch.float32), cuda(0, dtype=torch.float32),
                               t["q_nope"], t["q_pe"], t["ckv"], t["kpe"], cuda(3, dtype=torch.int32), cuda(*plan.work.shape, dtype=torch.int32),
                               cuda(*plan.requests.shape, dtype=torch.int32), 0, SM_SCALE, False, 4, -1, -1)  # fmt: skip
