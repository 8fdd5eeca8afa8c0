"""The host cost of ``plan`` (issue 46): decode and both prefill wrappers planned on the CPU, with
ceilings about 5x what a quiet 2-core machine measures, so that a per-request Python loop or an
extra pass over the batch creeping back fails here while a loaded CI machine still passes. The
figures and where the time goes: docs/design/decode.md and prefill.md, "Plan host cost"."""

import statistics
from typing import List, Optional
import time

import pytest
import torch

import aotinfer
from aotinfer import prefill

PAGE_SIZE = 16


def page_table(batch, tokens):
    pages = -(-tokens // PAGE_SIZE)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    indices = torch.randperm(batch * pages, dtype=torch.int32) if batch * pages else torch.zeros(0, dtype=torch.int32)
    last = torch.full((batch,), tokens - (pages - 1) * PAGE_SIZE, dtype=torch.int32)
    return indptr, indices, last


def median_us(fn, repeat=15):
    fn()  # first call: lazy imports, device properties
    times = []
    for _ in range(repeat):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return statistics.median(times) * 1e6


@pytest.fixture(autouse=True)
def one_thread():
    # Host tables are small: intra-op threads only add wake-ups on a loaded machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# (batch, tokens, ceiling us): ceilings about 5x the quiet figure of docs/design/decode.md.
DECODE_CASES = [(1, 2048, 600), (64, 2048, 600), (256, 2048, 700), (64, 16384, 700)]


@pytest.mark.parametrize("use_cuda_graph", [False, True])
@pytest.mark.parametrize("batch,tokens,ceiling_us", DECODE_CASES)
def test_decode_plan_cost(batch, tokens, ceiling_us, use_cuda_graph):
    indptr, indices, last = page_table(batch, tokens)
    workspace = torch.empty(128 << 20, dtype=torch.uint8)
    buffers = {}
    if use_cuda_graph:
        buffers = dict(
            use_cuda_graph=True,
            paged_kv_indptr_buffer=torch.empty(batch + 1, dtype=torch.int32),
            paged_kv_indices_buffer=torch.empty(indices.numel(), dtype=torch.int32),
            paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32),
        )
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", **buffers)
    us = median_us(lambda: wrapper.plan(indptr, indices, last, 32, 8, 128, PAGE_SIZE, q_data_type=torch.bfloat16))
    assert wrapper._plan.batch_size == batch  # the plan is the one measured
    assert us < ceiling_us, f"decode plan of {batch} x {tokens} tokens took {us:.0f} us on the host (ceiling {ceiling_us})"


def ragged_lengths(batch, mean, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(mean // 2, mean * 3 // 2 + 1, (batch,), generator=generator, dtype=torch.int32)


PREFILL_CEILING_US = 2500  # 64 requests x ~1300 tokens: about 6x what the quiet CPU machine measures


def test_paged_prefill_plan_cost():
    q_len = ragged_lengths(64, 1300)
    qo_indptr = torch.cat([torch.zeros(1, dtype=torch.int32), q_len.cumsum(0).to(torch.int32)])
    pages = (q_len + PAGE_SIZE - 1) // PAGE_SIZE
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int32), pages.cumsum(0).to(torch.int32)])
    indices = torch.arange(int(kv_indptr[-1]), dtype=torch.int32)
    last = (q_len - (pages - 1) * PAGE_SIZE).to(torch.int32)
    wrapper = aotinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8), "NHD")
    us = median_us(
        lambda: wrapper.plan(qo_indptr, kv_indptr, indices, last, 32, 8, 128, PAGE_SIZE, causal=True, q_data_type=torch.bfloat16),
        repeat=7,
    )
    assert wrapper._plan.batch_size == 64
    assert us < PREFILL_CEILING_US, f"paged prefill plan took {us:.0f} us on the host (ceiling {PREFILL_CEILING_US})"


def test_ragged_prefill_plan_cost():
    q_len = ragged_lengths(64, 1300, seed=1)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int32), q_len.cumsum(0).to(torch.int32)])
    wrapper = aotinfer.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8), "NHD")
    us = median_us(lambda: wrapper.plan(indptr, indptr, 32, 8, 128, causal=True, q_data_type=torch.bfloat16), repeat=7)
    assert wrapper._plan.batch_size == 64
    assert us < PREFILL_CEILING_US, f"ragged prefill plan took {us:.0f} us on the host (ceiling {PREFILL_CEILING_US})"


@pytest.mark.parametrize("wrapper_name", ["decode", "paged", "ragged"])
def test_huge_batch_refused_at_once(wrapper_name):
    """10^7 requests: refused from the sizes alone, in milliseconds, naming the bytes needed."""
    n = 10**7
    indptr = torch.zeros(n + 1, dtype=torch.int32)
    last = torch.zeros(n, dtype=torch.int32)
    none = torch.zeros(0, dtype=torch.int32)
    workspace = torch.empty(1 << 20, dtype=torch.uint8)
    if wrapper_name == "decode":
        wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace)
        call = lambda: wrapper.plan(indptr, none, last, 32, 8, 128, PAGE_SIZE)  # noqa: E731
    elif wrapper_name == "paged":
        wrapper = aotinfer.BatchPrefillWithPagedKVCacheWrapper(workspace)
        call = lambda: wrapper.plan(indptr, indptr, none, last, 32, 8, 128, PAGE_SIZE)  # noqa: E731
    else:
        wrapper = aotinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace)
        call = lambda: wrapper.plan(indptr, indptr, 32, 8, 128)  # noqa: E731
    begin = time.perf_counter()
    with pytest.raises(ValueError, match=r"a plan of 10000000 requests needs at least \d+"):
        call()
    assert time.perf_counter() - begin < 0.5
    assert wrapper._plan is None  # nothing half-planned


@pytest.mark.gpu
@pytest.mark.parametrize("wrapper_name", ["decode", "paged", "ragged"])
def test_cpu_workspace_refused_at_run(wrapper_name):
    """A 10-byte CPU workspace plans (planning is host work); run on the GPU names the device it needs."""
    workspace = torch.empty(10, dtype=torch.uint8)
    one = torch.tensor([0, 1], dtype=torch.int32)
    page = torch.zeros(1, dtype=torch.int32)
    q = torch.zeros(1, 32, 128, dtype=torch.float16, device="cuda")
    cache = torch.zeros(1, 2, PAGE_SIZE, 8, 128, dtype=torch.float16, device="cuda")
    if wrapper_name == "decode":
        wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace)
        wrapper.plan(one, page, torch.ones(1, dtype=torch.int32), 32, 8, 128, PAGE_SIZE)
        call = lambda: wrapper.run(q, cache)  # noqa: E731
    elif wrapper_name == "paged":
        wrapper = aotinfer.BatchPrefillWithPagedKVCacheWrapper(workspace)
        wrapper.plan(one, one, page, torch.ones(1, dtype=torch.int32), 32, 8, 128, PAGE_SIZE)
        call = lambda: wrapper.run(q, cache)  # noqa: E731
    else:
        wrapper = aotinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace)
        wrapper.plan(one, one, 32, 8, 128)
        k = torch.zeros(1, 8, 128, dtype=torch.float16, device="cuda")
        call = lambda: wrapper.run(q, k, k)  # noqa: E731
    with pytest.raises(ValueError, match="float_workspace_buffer is on cpu, q on cuda:0: run needs the workspace on q's device"):
        call()


# ---- the partitions stay what they were -------------------------------------------------------
# The per-item Python loop that partition_prefill replaced with tensor ops (kept as the reference:
# plan's tables must stay bit-identical).


def partition_prefill_reference(
    q_begin: List[int],
    q_len: List[int],
    kv_offset: List[int],
    kv_len: List[int],
    *,
    group: int,
    head_dim: int,
    num_kv_heads: int,
    num_sms: int,
    page_size: int = 1,
    causal: bool = False,
    window_left: int = -1,
    disable_split_kv: bool = False,
    fixed_split_size: Optional[int] = None,
    ctas_per_sm: int = prefill._CTAS_PER_SM,
    rows_per_tile: Optional[int] = None,
    last_wave_slots: int = 0,
):

    rows_per_tile = rows_per_tile or prefill.tile_rows(head_dim)
    tiles = [-(-q * group // rows_per_tile) for q in q_len]
    fill = max(1, -(-ctas_per_sm * num_sms // max(num_kv_heads, 1)))
    if disable_split_kv or (fixed_split_size is None and sum(tiles) >= fill):
        chunk = 0
    elif fixed_split_size is not None:
        chunk = fixed_split_size * page_size
    else:
        longest = max(kv_len) if kv_len else 0

        def count(c):
            return sum(t * prefill.num_chunks(0, k, c) for t, k in zip(tiles, kv_len))

        chunk = prefill.smallest_chunk(longest, longest, fill, page_size, count)
    split_from = [0] * len(q_len)  # a request's first token whose keys are split (those before are whole)
    if chunk == 0 and len(q_len) == 1 and not disable_split_kv and fixed_split_size is None:
        split_from[0], chunk = prefill.halving(q_len[0], kv_len[0], group, rows_per_tile, num_kv_heads, ctas_per_sm * num_sms,
                                       causal, window_left, page_size, last_wave_slots)

    items, request_rows, num_slots, merge_from = [], [], 0, -1
    for b, (ql, kl) in enumerate(zip(q_len, kv_len)):
        n = prefill.num_chunks(0, kl, chunk) if chunk else 1
        delta = kl - ql
        first = num_slots - split_from[b] * n if n > 1 else 0  # token t's slots: first + t * n + i
        if n > 1:
            num_slots += (ql - split_from[b]) * n
            merge_from = q_begin[b] + split_from[b] if merge_from < 0 else merge_from
        request_rows.append((q_begin[b], ql, kv_offset[b], kl, first, n if n > 1 else 0, split_from[b], 0))
        for j in range(tiles[b]):
            r0, r1 = j * rows_per_tile, min((j + 1) * rows_per_tile, ql * group) - 1
            chunks = n if r0 >= split_from[b] * group else 1  # a whole tile of a split request: one item
            for i in range(chunks):
                kv_begin, kv_end = (i * chunk, min((i + 1) * chunk, kl)) if chunks > 1 else (0, kl)
                lo, hi = prefill.keys_attended(r0 // group, r1 // group, kv_begin, kv_end, delta, causal, window_left)
                items.append(((r1 - r0 + 1) * max(hi - lo, 0), (b, r0, kv_begin, kv_end, i, 0, 0, 0), (b, lo, hi)))
    items.sort(key=lambda item: -item[0])  # stable
    work = torch.tensor([(len(items), 0, 0, 0, 0, 0, 0, 0)] + [row for _, row, _ in items], dtype=torch.int32)
    requests = torch.tensor(request_rows, dtype=torch.int32).view(-1, prefill._WORK_WIDTH)
    halves = sum(1 for _, row, _ in items if row[1] >= split_from[row[0]] * group) if any(split_from) else 0
    spans = [span for _, _, span in items]
    return work, requests, len(items), num_slots, chunk, spans, halves, merge_from



@pytest.mark.parametrize("seed", range(40))
def test_prefill_partition_matches_the_loop(seed):
    generator = torch.Generator().manual_seed(seed)

    def pick(*values):
        return values[int(torch.randint(len(values), (1,), generator=generator))]

    batch = pick(1, 1, 2, 7, 64)
    q_len = torch.randint(0, pick(8, 300, 3000), (batch,), generator=generator).tolist()
    extra = torch.randint(0, pick(1, 50, 4000), (batch,), generator=generator).tolist()
    kv_len = [q + e for q, e in zip(q_len, extra)] if pick(True, False) else [pick(0, 1, 9000)] * batch
    q_begin = [sum(q_len[:b]) for b in range(batch)]
    kv_offset = [sum(kv_len[:b]) for b in range(batch)]
    options = dict(
        group=pick(1, 4, 8), head_dim=pick(64, 128, 256), num_kv_heads=pick(1, 8, 32), num_sms=pick(132, 78, 8),
        page_size=pick(1, 16, 256), causal=pick(True, False), window_left=pick(-1, -1, 0, 100, 5000),
        disable_split_kv=pick(False, False, True), fixed_split_size=pick(None, None, None, 3),
        ctas_per_sm=pick(1, 2), rows_per_tile=pick(None, 128, 192), last_wave_slots=pick(0, 0, 100000),
    )
    got = prefill.partition_prefill(q_begin, q_len, kv_offset, kv_len, **options)
    work, requests, num_items, num_slots, chunk, spans, halves, merge_from = partition_prefill_reference(
        q_begin, q_len, kv_offset, kv_len, **options
    )
    assert torch.equal(got.work, work) and got.work.dtype == torch.int32
    assert torch.equal(got.requests, requests) and got.requests.dtype == torch.int32
    assert (got.num_items, got.num_slots, got.chunk, got.halves, got.merge_from) == (num_items, num_slots, chunk, halves, merge_from)
    assert got.spans == spans


@pytest.mark.parametrize("q_len,group,heads", [(8192, 1, 32), (8192, 4, 8)])
def test_prefill_partition_matches_the_loop_with_halved_tiles(q_len, group, heads):
    # A lone request under full attention whose last tiles' keys are halved (tiles_to_halve).
    options = dict(group=group, head_dim=128, num_kv_heads=heads, num_sms=132, ctas_per_sm=1, rows_per_tile=192,
                   last_wave_slots=10**6)  # fmt: skip
    got = prefill.partition_prefill([0], [q_len], [0], [q_len], **options)
    work, requests, num_items, num_slots, chunk, spans, halves, merge_from = partition_prefill_reference(
        [0], [q_len], [0], [q_len], **options
    )
    assert got.halves == halves > 0
    assert torch.equal(got.work, work) and torch.equal(got.requests, requests)
    assert (got.num_items, got.num_slots, got.chunk, got.merge_from) == (num_items, num_slots, chunk, merge_from)
    assert got.spans == spans
