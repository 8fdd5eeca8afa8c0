"""append_paged_kv_cache into scattered pages, checked slot by slot against a copy made in Python;
get_batch_indices_positions and get_seq_lens against their definitions."""

import math

import pytest
import torch

import aotinfer
from aotinfer import page as page_module

gpu = pytest.mark.gpu

# (KV length before, new tokens) per request: an empty request, a last page of 1 entry and one of
# page_size entries (for page_size 16), and appends that cross page boundaries.
REQUESTS = [(0, 5), (7, 1), (16, 1), (3, 29), (30, 0)]


def reference_batch_positions(append_indptr, seq_lens, nnz):
    batch = torch.full((nnz,), -1, dtype=torch.int32)
    pos = torch.zeros(nnz, dtype=torch.int32)
    for r in range(len(seq_lens)):
        begin, end = int(append_indptr[r]), int(append_indptr[r + 1])
        for i in range(begin, end):
            batch[i] = r
            pos[i] = int(seq_lens[r]) - (end - i)
    return batch, pos


def make_case(page_size, num_heads, head_dim, dtype, layout, fused_rows):
    before = torch.tensor([b for b, _ in REQUESTS])
    new = torch.tensor([n for _, n in REQUESTS])
    seq_lens = before + new
    nnz = int(new.sum())
    pages_per_request = [max(math.ceil(int(s) / page_size), 1) for s in seq_lens]
    num_pages = sum(pages_per_request) + 7  # pages no request owns stay untouched
    kv_indices = torch.randperm(num_pages)[: sum(pages_per_request)]  # scattered pages
    kv_indptr = torch.tensor([0] + pages_per_request).cumsum(0)
    last_page_len = seq_lens - (kv_indptr[1:] - kv_indptr[:-1] - 1) * page_size
    assert int(last_page_len.min()) >= 0
    page = (page_size, num_heads, head_dim) if layout == "NHD" else (num_heads, page_size, head_dim)
    k_cache = torch.randn(num_pages, *page).to(dtype)
    v_cache = torch.randn(num_pages, *page).to(dtype)
    if fused_rows:  # new K and V as slices of one [nnz, 2 * heads * head_dim + 8] tensor
        kv = torch.randn(nnz, 2 * num_heads * head_dim + 8).to(dtype)
        key = kv[:, : num_heads * head_dim].view(nnz, num_heads, head_dim)
        value = kv[:, num_heads * head_dim : 2 * num_heads * head_dim].view(nnz, num_heads, head_dim)
        assert not key.is_contiguous()
    else:
        key = torch.randn(nnz, num_heads, head_dim).to(dtype)
        value = torch.randn(nnz, num_heads, head_dim).to(dtype)
    return dict(seq_lens=seq_lens, new=new, nnz=nnz, kv_indices=kv_indices, kv_indptr=kv_indptr,
                last_page_len=last_page_len, k_cache=k_cache, v_cache=v_cache, key=key, value=value)


def expected_caches(case, batch, pos, page_size, layout):
    k_want, v_want = case["k_cache"].clone(), case["v_cache"].clone()
    for i in range(case["nnz"]):
        r, p = int(batch[i]), int(pos[i])
        page = int(case["kv_indices"][int(case["kv_indptr"][r]) + p // page_size])
        entry = p % page_size
        if layout == "NHD":
            k_want[page, entry], v_want[page, entry] = case["key"][i], case["value"][i]
        else:
            k_want[page, :, entry], v_want[page, :, entry] = case["key"][i], case["value"][i]
    return k_want, v_want


def same_bits(a, b):
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


@gpu
@pytest.mark.parametrize("fused_rows", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("cache_form", ["tuple", "5d"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("page_size, num_heads, head_dim", [(16, 8, 128), (5, 3, 64), (1, 2, 128), (16, 1, 6)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_append_paged_kv_cache(page_size, num_heads, head_dim, dtype, layout, cache_form, fused_rows, index_dtype):
    torch.manual_seed(page_size * 1000 + num_heads * 10 + head_dim)
    case = make_case(page_size, num_heads, head_dim, dtype, layout, fused_rows)
    append_indptr = torch.tensor([0] + case["new"].tolist()).cumsum(0)
    batch, pos = aotinfer.get_batch_indices_positions(append_indptr.to(index_dtype).cuda(),
                                                      case["seq_lens"].to(index_dtype).cuda(), case["nnz"])
    want_batch, want_pos = reference_batch_positions(append_indptr, case["seq_lens"], case["nnz"])
    assert torch.equal(batch.cpu(), want_batch) and torch.equal(pos.cpu(), want_pos)
    k_want, v_want = expected_caches(case, want_batch, want_pos, page_size, layout)

    k_cache, v_cache = case["k_cache"].cuda(), case["v_cache"].cuda()
    if cache_form == "tuple":
        paged = (k_cache, v_cache)
    else:
        paged = torch.stack([k_cache.view(torch.uint8), v_cache.view(torch.uint8)], dim=1).view(dtype)
    key, value = case["key"].cuda(), case["value"].cuda()
    if fused_rows:
        key, value = case["key"], case["value"]
        kv = torch.empty(case["nnz"], 2 * num_heads * head_dim + 8, dtype=dtype, device="cuda")
        rows = [x.reshape(case["nnz"], -1).view(torch.uint8) for x in (key, value)]
        kv.view(torch.uint8)[:, : 2 * num_heads * head_dim * dtype.itemsize].copy_(torch.cat(rows, dim=1))
        key = kv[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
        value = kv[:, num_heads * head_dim : 2 * num_heads * head_dim].view(-1, num_heads, head_dim)
    assert aotinfer.append_paged_kv_cache(
        key, value, batch.to(index_dtype), pos.to(index_dtype), paged, case["kv_indices"].to(index_dtype).cuda(),
        case["kv_indptr"].to(index_dtype).cuda(), case["last_page_len"].to(index_dtype).cuda(), kv_layout=layout,
    ) is None
    if cache_form == "5d":
        k_cache, v_cache = paged[:, 0], paged[:, 1]
    assert same_bits(k_cache, k_want)
    assert same_bits(v_cache, v_want)


@gpu
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_tokens_whose_slot_is_outside_the_cache_are_not_written(layout):
    # Ids out of range are the caller's error (FlashInfer leaves them undefined): a token whose
    # request, position or page is outside what the tables and the cache hold is dropped, the
    # others land, and nothing outside the cache changes.
    page_size, num_heads, head_dim = 16, 2, 64
    torch.manual_seed(7)
    case = make_case(page_size, num_heads, head_dim, torch.float16, layout, False)
    append_indptr = torch.tensor([0] + case["new"].tolist()).cumsum(0)
    batch, pos = reference_batch_positions(append_indptr, case["seq_lens"], case["nnz"])
    kv_indices, kv_indptr = case["kv_indices"].clone(), case["kv_indptr"]
    kv_indices[int(kv_indptr[batch[0]])] = 10**9  # a page beyond the cache
    kv_indices[int(kv_indptr[batch[5]])] = -3  # a negative page
    batch[6] = len(REQUESTS) + 100  # a request beyond the batch
    pos[7], pos[8] = -1, 10**6  # a negative position; one past the request's pages
    num_pages = case["k_cache"].shape[0]
    k_want, v_want = case["k_cache"].clone(), case["v_cache"].clone()
    for i in range(case["nnz"]):
        r, p = int(batch[i]), int(pos[i])
        if p < 0 or not 0 <= r < len(REQUESTS):
            continue
        index = int(kv_indptr[r]) + p // page_size
        if not 0 <= index < kv_indices.numel() or not 0 <= int(kv_indices[index]) < num_pages:
            continue
        page, entry = int(kv_indices[index]), p % page_size
        for want, new in ((k_want, case["key"][i]), (v_want, case["value"][i])):
            if layout == "NHD":
                want[page, entry] = new
            else:
                want[page, :, entry] = new
    # The cache between guard pages: a write outside it would show there.
    k_all = torch.randn(num_pages + 2, *case["k_cache"].shape[1:], device="cuda").half()
    v_all = torch.randn_like(k_all)
    k_all[1:-1], v_all[1:-1] = case["k_cache"], case["v_cache"]
    guards = [x[[0, -1]].clone() for x in (k_all, v_all)]
    aotinfer.append_paged_kv_cache(case["key"].cuda(), case["value"].cuda(), batch.cuda(), pos.cuda(),
                                   (k_all[1:-1], v_all[1:-1]), kv_indices.int().cuda(), kv_indptr.int().cuda(),
                                   case["last_page_len"].int().cuda(), kv_layout=layout)
    torch.cuda.synchronize()
    assert torch.equal(k_all[[0, -1]], guards[0]) and torch.equal(v_all[[0, -1]], guards[1])
    assert same_bits(k_all[1:-1], k_want) and same_bits(v_all[1:-1], v_want)


@gpu
def test_append_nothing():
    k_cache = torch.randn(4, 16, 2, 64, device="cuda", dtype=torch.float16)
    before = k_cache.clone()
    empty = torch.empty(0, 2, 64, device="cuda", dtype=torch.float16)
    none = torch.empty(0, dtype=torch.int32, device="cuda")
    aotinfer.append_paged_kv_cache(empty, empty, none, none, (k_cache, k_cache), none,
                                   torch.zeros(1, dtype=torch.int32, device="cuda"), none)
    assert torch.equal(k_cache, before)


@gpu
def test_get_batch_indices_positions_into_given_tensors():
    append_indptr = torch.tensor([0, 3, 3, 7], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([10, 4, 7], dtype=torch.int32, device="cuda")
    batch = torch.full((9,), 123, dtype=torch.int32, device="cuda")
    pos = torch.full((9,), 123, dtype=torch.int32, device="cuda")
    got = aotinfer.get_batch_indices_positions(append_indptr, seq_lens, 9, batch, pos)
    assert got[0] is batch and got[1] is pos
    assert batch.tolist() == [0, 0, 0, 2, 2, 2, 2, -1, -1]
    assert pos.tolist() == [7, 8, 9, 3, 4, 5, 6, 0, 0]


@gpu
def test_cuda_graph_replay():
    k_cache = torch.zeros(8, 4, 2, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(3, 2, 128, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    batch = torch.zeros(3, dtype=torch.int32, device="cuda")
    pos = torch.zeros(3, dtype=torch.int32, device="cuda")
    kv_indices = torch.arange(8, dtype=torch.int32, device="cuda")
    kv_indptr = torch.tensor([0, 8], dtype=torch.int32, device="cuda")
    last = torch.tensor([4], dtype=torch.int32, device="cuda")
    args = (key, value, batch, pos, (k_cache, v_cache), kv_indices, kv_indptr, last)
    aotinfer.append_paged_kv_cache(*args)  # loads the module outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        aotinfer.append_paged_kv_cache(*args)
    pos.copy_(torch.tensor([13, 14, 30], dtype=torch.int32))
    graph.replay()
    for i, p in enumerate([13, 14, 30]):
        assert torch.equal(k_cache[p // 4, p % 4], key[i]) and torch.equal(v_cache[p // 4, p % 4], value[i])


def test_get_seq_lens():
    kv_indptr = torch.tensor([0, 3, 3, 4, 9])
    last = torch.tensor([5, 0, 1, 16])
    assert aotinfer.get_seq_lens(kv_indptr, last, 16).tolist() == [2 * 16 + 5, 0, 1, 4 * 16 + 16]
    with pytest.raises(ValueError, match="page_size to be at least 1"):
        aotinfer.get_seq_lens(kv_indptr, last, 0)


# ---- argument errors, without a GPU: the binding checks shapes and dtypes before devices ----------


def _h(*shape, dtype=torch.float16):
    return torch.empty(*shape, dtype=dtype)


def _i(n, dtype=torch.int32):
    return torch.zeros(n, dtype=dtype)


KEY = _h(5, 2, 64)


def _append(key=KEY, value=KEY, batch=_i(5), pos=_i(5), cache=(_h(9, 16, 2, 64), _h(9, 16, 2, 64)), indices=_i(9),
            indptr=_i(3), last=_i(2), layout="NHD"):
    return aotinfer.append_paged_kv_cache(key, value, batch, pos, cache, indices, indptr, last, kv_layout=layout)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: _append(batch=_i(4)), ValueError, r"batch_indices to have shape \[5\]"),
        (lambda: _append(pos=_i(6)), ValueError, r"positions to have shape \[5\]"),
        (lambda: _append(pos=_i(5, torch.float32)), TypeError, "positions to have dtype int32 or int64"),
        (lambda: _append(last=_i(3)), ValueError, r"kv_last_page_len to have shape \[2\]"),
        (lambda: _append(value=_h(5, 3, 64)), ValueError, "append_value and append_key to have the same shape"),
        (lambda: _append(value=KEY.bfloat16()), TypeError, "append_value and append_key to have the same dtype"),
        (lambda: _append(key=_h(5, 2, 64, dtype=torch.int8), value=_h(5, 2, 64, dtype=torch.int8)), TypeError, "append_key to have dtype float16"),
        (lambda: _append(cache=(_h(9, 16, 3, 64), _h(9, 16, 3, 64))), ValueError, r"k_cache to have shape \[pages, page_size, 2, 64\]"),
        (lambda: _append(cache=(_h(9, 16, 2, 64), _h(9, 16, 2, 64)), layout="HND"), ValueError, r"k_cache to have shape \[pages, 2, page_size, 64\]"),
        (lambda: _append(cache=(_h(9, 16, 2, 64), _h(9, 8, 2, 64))), ValueError, "v_cache to have shape .* page_size 16"),
        (lambda: _append(cache=(_h(9, 16, 2, 64, dtype=torch.bfloat16), _h(9, 16, 2, 64))), TypeError, "k_cache and append_key to have the same dtype"),
        (lambda: _append(cache=_h(9, 3, 16, 2, 64)), ValueError, "paged_kv_cache to have shape"),
        (lambda: _append(layout="NDH"), ValueError, "kv_layout to be 'NHD' or 'HND'"),
        (lambda: _append(), ValueError, "append_key to be a CUDA tensor, got a tensor on cpu"),
        (lambda: aotinfer.get_batch_indices_positions(_i(3), _i(3), 4), ValueError, r"seq_lens to have shape \[2\]"),
        (lambda: aotinfer.get_batch_indices_positions(_i(3), _i(2), 4, batch_indices=_i(3)), ValueError, r"batch_indices to have shape \[4\]"),
        (lambda: aotinfer.get_batch_indices_positions(_i(3), _i(2), -1), ValueError, "nnz to be at least 0"),
        (lambda: page_module._get_batch_indices_positions(_i(4, torch.int64), _i(4), _i(3), _i(2), -1), TypeError, "batch_indices to have dtype int32"),
        (lambda: aotinfer.get_batch_indices_positions(_i(3), _i(2), 4), ValueError, "append_indptr to be a CUDA tensor"),
    ],
)
def test_argument_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


# ---- append_paged_mla_kv_cache ------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_append_paged_mla_kv_cache(page_size, dtype):
    torch.manual_seed(page_size)
    ckv_dim, kpe_dim = 512, 64
    case = make_case(page_size, 1, 8, dtype, "NHD", False)  # for its requests and pages
    nnz, num_pages = case["nnz"], case["k_cache"].shape[0]
    ckv_cache = torch.randn(num_pages, page_size, ckv_dim).to(dtype)
    kpe_cache = torch.randn(num_pages, page_size, kpe_dim).to(dtype)
    # The new rows as slices of one [nnz, ckv_dim + kpe_dim] tensor, as DeepSeek's projection gives them.
    latent = torch.randn(nnz, ckv_dim + kpe_dim).to(dtype)
    append_indptr = torch.tensor([0] + case["new"].tolist()).cumsum(0)
    batch, pos = reference_batch_positions(append_indptr, case["seq_lens"], nnz)
    ckv_want, kpe_want = ckv_cache.clone(), kpe_cache.clone()
    for i in range(nnz):
        r, p = int(batch[i]), int(pos[i])
        page = int(case["kv_indices"][int(case["kv_indptr"][r]) + p // page_size])
        ckv_want[page, p % page_size] = latent[i, :ckv_dim]
        kpe_want[page, p % page_size] = latent[i, ckv_dim:]
    ckv_gpu, kpe_gpu, latent_gpu = ckv_cache.cuda(), kpe_cache.cuda(), latent.cuda()
    aotinfer.append_paged_mla_kv_cache(latent_gpu[:, :ckv_dim], latent_gpu[:, ckv_dim:], batch.cuda(), pos.cuda(),
                                       ckv_gpu, kpe_gpu, case["kv_indices"].int().cuda(), case["kv_indptr"].int().cuda(),
                                       case["last_page_len"].int().cuda())
    assert same_bits(ckv_gpu, ckv_want)
    assert same_bits(kpe_gpu, kpe_want)


def _mla(ckv=_h(5, 512), kpe=_h(5, 64), ckv_cache=_h(9, 16, 512), kpe_cache=_h(9, 16, 64), batch=_i(5)):
    return aotinfer.append_paged_mla_kv_cache(ckv, kpe, batch, _i(5), ckv_cache, kpe_cache, _i(9), _i(3), _i(2))


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: _mla(kpe=_h(4, 64)), ValueError, "append_kpe to have 5 rows"),
        (lambda: _mla(kpe=_h(5, 64, dtype=torch.bfloat16)), TypeError, "append_kpe and append_ckv to have the same dtype"),
        (lambda: _mla(ckv_cache=_h(9, 16, 256)), ValueError, r"ckv_cache to have shape \[pages, page_size, 512\]"),
        (lambda: _mla(kpe_cache=_h(9, 8, 64)), ValueError, "kpe_cache to have shape .*page_size 16"),
        (lambda: _mla(batch=_i(4)), ValueError, r"batch_indices to have shape \[5\]"),
        (lambda: _mla(), ValueError, "append_ckv to be a CUDA tensor"),
    ],
)
def test_mla_argument_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()
