"""Trace templates of aotinfer.page's writes into a paged KV cache (torch is imported when a
reference runs). The tests' page tables come from ``example``: one page a request, each token its
own request at a position below the page size (so every slot is written at most once)."""

from ..template import Const, Scalar, Tensor, TraceTemplate, Var


def _one_each(shape, device, dtype):
    import torch

    return torch.arange(shape[0], device=device, dtype=torch.int32)


def _pages(shape, device, dtype):
    import torch

    return torch.rand(shape[0], device=device).argsort().to(torch.int32)  # a permutation


def _slots(shape, device, dtype):
    """Positions below the tests' page size (16, a Const axis's size)."""
    import torch

    return torch.randint(0, 16, shape, device=device, dtype=torch.int32)


def _last_page_len(shape, device, dtype):
    import torch

    return torch.randint(1, 17, shape, device=device, dtype=torch.int32)


def _slot_of(batch_indices, positions, kv_indices, kv_indptr, page_size):
    """(page, entry) of each token."""
    b, p = batch_indices.long(), positions.long()
    return kv_indices.long()[kv_indptr.long()[b] + p // page_size], p % page_size


def _append_paged_kv_cache_reference(append_key, append_value, batch_indices, positions, paged_kv_cache,
                                     kv_indices, kv_indptr, kv_last_page_len):
    """The 5-D NHD cache [pages, 2, page_size, heads, head_dim] with the tokens written in."""
    cache = paged_kv_cache.clone()
    page, entry = _slot_of(batch_indices, positions, kv_indices, kv_indptr, cache.shape[2])
    cache[page, 0, entry] = append_key
    cache[page, 1, entry] = append_value
    return cache


def _append_paged_mla_kv_cache_reference(append_ckv, append_kpe, batch_indices, positions, ckv_cache, kpe_cache,
                                         kv_indices, kv_indptr, kv_last_page_len):
    ckv, kpe = ckv_cache.clone(), kpe_cache.clone()
    page, entry = _slot_of(batch_indices, positions, kv_indices, kv_indptr, ckv.shape[1])
    ckv[page, entry] = append_ckv
    kpe[page, entry] = append_kpe
    return ckv, kpe


def _get_batch_indices_positions_reference(append_indptr, seq_lens, nnz):
    import torch

    counts = (append_indptr[1:] - append_indptr[:-1]).long()
    batch = torch.arange(len(counts), device=append_indptr.device)
    request = torch.repeat_interleave(batch, counts)
    token = torch.arange(len(request), device=append_indptr.device)
    positions = seq_lens.long()[request] - (append_indptr.long()[request + 1] - token)
    batch_indices = torch.full((nnz,), -1, dtype=torch.int32, device=append_indptr.device)
    out_positions = torch.zeros((nnz,), dtype=torch.int32, device=append_indptr.device)
    batch_indices[: len(request)] = request.int()
    out_positions[: len(request)] = positions.int()
    return batch_indices, out_positions


_TABLE_AXES = {"nnz": Var(), "batch_size": Var(), "indptr_len": Const(derive=lambda sizes: sizes["batch_size"] + 1),
               "num_pages": Var(), "page_size": Const(abbrev="p")}
_TABLE = {
    "batch_indices": Tensor(["nnz"], dtype="int32", example=_one_each, description="Each token's request."),
    "positions": Tensor(["nnz"], dtype="int32", example=_slots, description="Each token's position in its request."),
    "kv_indices": Tensor(["num_pages"], dtype="int32", example=_pages, description="The pages of every request."),
    "kv_indptr": Tensor(["indptr_len"], dtype="int32", example=_one_each, description="[batch_size + 1]."),
    "kv_last_page_len": Tensor(["batch_size"], dtype="int32", example=_last_page_len),
}
_CACHE = ["num_pages", "two", "page_size", "num_kv_heads", "head_dim"]
_TOKENS = ["nnz", "num_kv_heads", "head_dim"]

append_paged_kv_cache_trace = TraceTemplate(
    op_type="append_paged_kv_cache",
    name_prefix="append_paged_kv_cache",
    description="Write each new token's K and V (every head) into entry positions % page_size of page "
    "kv_indices[kv_indptr[batch_indices] + positions // page_size]; the cache as one NHD tensor, K at [:, 0].",
    axes=dict(_TABLE_AXES, two=Const(derive=lambda sizes: 2), num_kv_heads=Const(abbrev="kv"),
              head_dim=Const(abbrev="d")),
    inputs=dict({"append_key": Tensor(_TOKENS), "append_value": Tensor(_TOKENS),
                 "paged_kv_cache": Tensor(_CACHE, description="[pages, 2, page_size, heads, head_dim] (NHD).")},
                **_TABLE),
    outputs={"paged_kv_cache": Tensor(_CACHE, param="paged_kv_cache", dtype_from="append_key",
                                      description="Written in place.")},
    tags=["status:verified", "page"],
    reference=_append_paged_kv_cache_reference,
)

append_paged_mla_kv_cache_trace = TraceTemplate(
    op_type="append_paged_kv_cache",
    name_prefix="append_paged_mla_kv_cache",
    description="MLA's append: each new token's compressed KV and rotary key into their slots of ckv_cache and "
    "kpe_cache, found as for append_paged_kv_cache.",
    axes=dict(_TABLE_AXES, ckv_dim=Const(abbrev="c"), kpe_dim=Const(abbrev="k")),
    inputs=dict({"append_ckv": Tensor(["nnz", "ckv_dim"]), "append_kpe": Tensor(["nnz", "kpe_dim"]),
                 "ckv_cache": Tensor(["num_pages", "page_size", "ckv_dim"]),
                 "kpe_cache": Tensor(["num_pages", "page_size", "kpe_dim"])}, **_TABLE),
    outputs={
        "ckv_cache": Tensor(["num_pages", "page_size", "ckv_dim"], param="ckv_cache", dtype_from="append_ckv",
                            description="Written in place."),
        "kpe_cache": Tensor(["num_pages", "page_size", "kpe_dim"], param="kpe_cache", dtype_from="append_kpe",
                            description="Written in place."),
    },
    tags=["status:verified", "page"],
    reference=_append_paged_mla_kv_cache_reference,
)

get_batch_indices_positions_trace = TraceTemplate(
    op_type="get_batch_indices_positions",
    name_prefix="get_batch_indices_positions",
    description="Each new token's request and position: token append_indptr[r] <= i < append_indptr[r + 1] "
    "gets batch index r and position seq_lens[r] - (append_indptr[r + 1] - i); entries past append_indptr[-1] "
    "get -1 and 0.",
    axes={"batch_size": Var(), "indptr_len": Const(derive=lambda sizes: sizes["batch_size"] + 1), "nnz": Var()},
    inputs={
        "append_indptr": Tensor(["indptr_len"], dtype="int32", example=_one_each, description="[batch_size + 1]."),
        "seq_lens": Tensor(["batch_size"], dtype="int32", example=_last_page_len,
                           description="Each request's KV length after the append."),
        "nnz": Scalar("int32", example=6, description="Entries of the outputs, at least append_indptr[-1]."),
    },
    outputs={"batch_indices": Tensor(["nnz"], dtype="int32"), "positions": Tensor(["nnz"], dtype="int32")},
    tags=["status:verified", "page"],
    reference=_get_batch_indices_positions_reference,
)
