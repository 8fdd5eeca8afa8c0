"""RoPE and append_paged_kv_cache: bandwidth at prefill size, latency at decode sizes.

    python benchmarks/bench_rope.py [--dtype bfloat16] [--tokens 16384]

Bandwidth at tokens x (32 q + 8 k heads) x head_dim 128: bytes = q and k read once + written once
(the rotated dims only, in place with rotary_dim < head_dim); append: the new K and V read once +
written once into scattered pages of 16 entries; mla_rope_quantize_fp8 and append_paged_mla_kv_cache at
DeepSeek's sizes (bytes: 16-bit inputs read, FP8 outputs written). Each row gives ratios to torch's copy_ of the same
bytes and to the streaming limit (benchmarks/_bandwidth.py), timed beside the case, and eager
torch's ratio (vLLM's native RoPE; advanced-index stores for the append). Every op is checked
against a float32 reference before it is timed. Latency: GPU time per call from CUDA-graph replays
of 20 back-to-back calls at 1-128 tokens, beside a copy_ of the same bytes.
"""

import argparse
import math

import torch

import aotinfer
from _bandwidth import bandwidth_row, graph_latency, start

Q_HEADS, K_HEADS, HEAD_DIM = 32, 8, 128


def cos_sin_cache(max_position, rotary_dim, theta=1e4, llama31=False):
    """[max_position, rotary_dim] float32: cos, then sin; llama31: Llama 3.1's frequencies at the
    ops' defaults (rope_scale 8, theta 5e5, factors 1 and 4, old context 8192)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cuda") / rotary_dim)
    if llama31:
        smooth = ((8192 * inv_freq / (2 * math.pi) - 1) / (4 - 1)).clamp(0, 1)
        inv_freq = (1 - smooth) * inv_freq / 8 + smooth * inv_freq
    angles = torch.arange(max_position, dtype=torch.float32, device="cuda")[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def torch_rope(q, k, pos, cache, rotary_dim, neox=True):
    """vLLM's native RoPE in eager torch (float32 math), out of place."""
    cos, sin = cache[pos].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def one(x):
        rot, rest = x[..., :rotary_dim].float(), x[..., rotary_dim:]
        if neox:
            a, b = rot.chunk(2, dim=-1)
            out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
        else:
            a, b = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
        return torch.cat([out.to(x.dtype), rest], dim=-1)

    return one(q), one(k)


def check(got, want):
    for g, w in zip(got, want):
        assert not g.isnan().any(), "some outputs were not written: not timing it"
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)


def rope_cases(tokens, dtype):
    """(label, ours, torch's, nbytes, check) for each RoPE op at `tokens` tokens."""
    qkv = torch.randn(tokens, (Q_HEADS + 2 * K_HEADS) * HEAD_DIM, device="cuda", dtype=dtype)
    q = qkv[:, : Q_HEADS * HEAD_DIM].view(tokens, Q_HEADS, HEAD_DIM)  # slices of a fused qkv, as servers pass them
    k = qkv[:, Q_HEADS * HEAD_DIM : (Q_HEADS + K_HEADS) * HEAD_DIM].view(tokens, K_HEADS, HEAD_DIM)
    qc, kc = q.contiguous(), k.contiguous()
    pos = torch.randint(0, 8192, (tokens,), device="cuda")
    cache = cos_sin_cache(8192, HEAD_DIM)
    half_cache = cos_sin_cache(8192, HEAD_DIM // 2)
    llama_cache = cos_sin_cache(8192, HEAD_DIM, theta=5e5, llama31=True)
    requests = max(tokens // 1024, 1)
    indptr = torch.linspace(0, tokens, requests + 1, device="cuda").int()
    offsets = torch.randint(0, 4096, (requests,), device="cuda", dtype=torch.int32)
    seg = torch.searchsorted(indptr, torch.arange(tokens, device="cuda", dtype=torch.int32), right=True) - 1
    ragged_pos = offsets[seg] + torch.arange(tokens, device="cuda") - indptr[seg]
    full = 2 * (q.numel() + k.numel()) * q.element_size()
    # Views of the fused qkv, timed in place; the checks read the contiguous copies qc and kc, which
    # the in-place timings (rotating q and k many times over) leave alone.
    query, key = q.reshape(tokens, -1), k.reshape(tokens, -1)

    def inplace(fn, *args, **kwargs):
        def run():
            fn(*args, **kwargs)
        return run

    def rotated_copy(fn, *args, **kwargs):
        """fn applied in place to fresh copies of q and k (for the check)."""
        q2, k2 = qc.clone(), kc.clone()
        fn(q2, k2, *args, **kwargs)
        return q2, k2

    def rotated_copy_cache(cache_, neox=True):
        q2, k2 = qc.clone().view(tokens, -1), kc.clone().view(tokens, -1)
        aotinfer.apply_rope_with_cos_sin_cache_inplace(pos, q2, k2, HEAD_DIM, cache_, neox)
        return q2.view_as(qc), k2.view_as(kc)

    ref = torch_rope(qc, kc, pos, cache, HEAD_DIM)
    cases = [
        ("pos_ids", lambda: aotinfer.apply_rope_pos_ids(qc, kc, pos), lambda: torch_rope(qc, kc, pos, cache, HEAD_DIM),
         full, lambda: check(aotinfer.apply_rope_pos_ids(qc, kc, pos), ref)),
        ("pos_ids inplace (fused qkv)", inplace(aotinfer.apply_rope_pos_ids_inplace, q, k, pos),
         lambda: torch_rope(q, k, pos, cache, HEAD_DIM), full,
         lambda: check(rotated_copy(aotinfer.apply_rope_pos_ids_inplace, pos), ref)),
        ("pos_ids interleave", lambda: aotinfer.apply_rope_pos_ids(qc, kc, pos, interleave=True),
         lambda: torch_rope(qc, kc, pos, cache, HEAD_DIM, neox=False), full,
         lambda: check(aotinfer.apply_rope_pos_ids(qc, kc, pos, interleave=True),
                       torch_rope(qc, kc, pos, cache, HEAD_DIM, neox=False))),
        ("indptr/offsets", lambda: aotinfer.apply_rope(qc, kc, indptr, offsets),
         lambda: torch_rope(qc, kc, ragged_pos, cache, HEAD_DIM), full,
         lambda: check(aotinfer.apply_rope(qc, kc, indptr, offsets), torch_rope(qc, kc, ragged_pos, cache, HEAD_DIM))),
        ("llama31 pos_ids", lambda: aotinfer.apply_llama31_rope_pos_ids(qc, kc, pos),
         lambda: torch_rope(qc, kc, pos, llama_cache, HEAD_DIM), full,
         lambda: check(aotinfer.apply_llama31_rope_pos_ids(qc, kc, pos), torch_rope(qc, kc, pos, llama_cache, HEAD_DIM))),
        ("cos_sin_cache (fused qkv)", lambda: aotinfer.apply_rope_with_cos_sin_cache(pos, query, key, HEAD_DIM, cache),
         lambda: torch_rope(q, k, pos, cache, HEAD_DIM), full,
         lambda: check([x.view_as(y) for x, y in zip(aotinfer.apply_rope_with_cos_sin_cache(
             pos, qc.view(tokens, -1), kc.view(tokens, -1), HEAD_DIM, cache), ref)], ref)),
        ("cos_sin_cache inplace (fused qkv)",
         inplace(aotinfer.apply_rope_with_cos_sin_cache_inplace, pos, query, key, HEAD_DIM, cache),
         lambda: torch_rope(q, k, pos, cache, HEAD_DIM), full, lambda: check(rotated_copy_cache(cache), ref)),
        ("cos_sin_cache inplace rotary 64",
         inplace(aotinfer.apply_rope_with_cos_sin_cache_inplace, pos, query, key, HEAD_DIM, half_cache),
         lambda: torch_rope(q, k, pos, half_cache, HEAD_DIM // 2), full // 2,
         lambda: check(rotated_copy_cache(half_cache), torch_rope(qc, kc, pos, half_cache, HEAD_DIM // 2))),
    ]
    return cases


def append_case(tokens, heads, dtype, page_size=16):
    """append_paged_kv_cache of `tokens` new tokens of `heads` heads into scattered pages."""
    key = torch.randn(tokens, heads, HEAD_DIM, device="cuda", dtype=dtype)
    value = torch.randn_like(key)
    requests = max(tokens // 1024, 1)
    per_request = -(-tokens // requests)
    seq_lens = torch.full((requests,), per_request, dtype=torch.int32, device="cuda")
    append_indptr = torch.arange(requests + 1, device="cuda", dtype=torch.int32) * per_request
    append_indptr[-1] = tokens
    seq_lens[-1] = tokens - per_request * (requests - 1)
    pages_each = -(-per_request // page_size)
    num_pages = pages_each * requests
    kv_indices = torch.randperm(num_pages, device="cuda", dtype=torch.int32)
    kv_indptr = torch.arange(requests + 1, device="cuda", dtype=torch.int32) * pages_each
    last = torch.full((requests,), page_size, dtype=torch.int32, device="cuda")
    k_cache = torch.zeros(num_pages, page_size, heads, HEAD_DIM, device="cuda", dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    batch, pos = aotinfer.get_batch_indices_positions(append_indptr, seq_lens, tokens)
    page = kv_indices[kv_indptr[batch] + pos // page_size].long()
    entry = (pos % page_size).long()

    def ours():
        aotinfer.append_paged_kv_cache(key, value, batch, pos, (k_cache, v_cache), kv_indices, kv_indptr, last)

    def torch_append():
        k_cache[page, entry] = key
        v_cache[page, entry] = value

    def check_append():
        k_cache.zero_()
        v_cache.zero_()
        ours()
        assert torch.equal(k_cache[page, entry], key) and torch.equal(v_cache[page, entry], value)

    return ours, torch_append, 2 * (key.numel() + value.numel()) * key.element_size(), check_append


def mla_cases(tokens, dtype):
    """mla_rope_quantize_fp8 and append_paged_mla_kv_cache at DeepSeek's sizes: 128 q heads of
    nope 512 (after absorption) + rope 64, one K head of 512 + 64."""
    heads, nope, rope = 128, 512, 64
    q = torch.randn(tokens, heads, nope + rope, device="cuda", dtype=dtype)
    q_nope, q_rope = q[..., :nope], q[..., nope:]
    latent = torch.randn(tokens, nope + rope, device="cuda", dtype=dtype)
    k_nope, k_rope = latent[:, :nope], latent[:, nope:]
    pos = torch.randint(0, 8192, (tokens,), device="cuda")
    cache = cos_sin_cache(8192, rope)
    outs = [torch.empty(x.shape, device="cuda", dtype=torch.float8_e4m3fn) for x in (q_rope, k_rope, q_nope, k_nope)]

    def quantize():
        aotinfer.mla_rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cache, pos, q_rope_out=outs[0],
                                       k_rope_out=outs[1], q_nope_out=outs[2], k_nope_out=outs[3])

    def torch_quantize():
        qr, kr = torch_rope(q_rope, k_rope[:, None], pos, cache, rope)
        for out, x in zip(outs, (qr, kr[:, 0], q_nope, k_nope)):
            out.copy_(x)

    def check_quantize():
        quantize()
        qr, kr = torch_rope(q_rope, k_rope[:, None], pos, cache, rope)
        for out, x in zip(outs, (qr, kr[:, 0], q_nope, k_nope)):
            torch.testing.assert_close(out.float(), x.float().clamp(-448, 448).to(torch.float8_e4m3fn).float(),
                                       rtol=0.13, atol=2e-2)  # one FP8 step

    read = (q.numel() + latent.numel()) * q.element_size()
    quant = ("mla_rope_quantize_fp8 128 heads", quantize, torch_quantize, read + read // q.element_size(), check_quantize,
             (2, 1))

    page_size = 64
    num_pages = -(-tokens // page_size)
    ckv_cache = torch.zeros(num_pages, page_size, nope, device="cuda", dtype=dtype)
    kpe_cache = torch.zeros(num_pages, page_size, rope, device="cuda", dtype=dtype)
    kv_indices = torch.randperm(num_pages, device="cuda", dtype=torch.int32)
    kv_indptr = torch.tensor([0, num_pages], device="cuda", dtype=torch.int32)
    last = torch.tensor([tokens - (num_pages - 1) * page_size], device="cuda", dtype=torch.int32)
    batch = torch.zeros(tokens, device="cuda", dtype=torch.int32)
    positions = torch.arange(tokens, device="cuda", dtype=torch.int32)
    page = kv_indices[positions // page_size].long()
    entry = (positions % page_size).long()

    def append():
        aotinfer.append_paged_mla_kv_cache(k_nope, k_rope, batch, positions, ckv_cache, kpe_cache, kv_indices,
                                           kv_indptr, last)

    def torch_append():
        ckv_cache[page, entry] = k_nope
        kpe_cache[page, entry] = k_rope

    def check_append():
        append()
        assert torch.equal(ckv_cache[page, entry], k_nope) and torch.equal(kpe_cache[page, entry], k_rope)

    mla_append = ("append_paged_mla_kv_cache", append, torch_append, 2 * latent.numel() * latent.element_size(),
                  check_append, (1, 1))
    return [quant, mla_append]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    copy_bw = start(dtype)
    ratios = {}
    print(f"\n{args.tokens} tokens x ({Q_HEADS} + {K_HEADS}) heads x {HEAD_DIM}")
    for label, ours, torch_fn, nbytes, check_fn in rope_cases(args.tokens, dtype):
        if check_fn is not None:
            check_fn()
        ratios[label], _, _ = bandwidth_row(label, ours, torch_fn, nbytes, copy_bw, (1, 1))
    for heads in (K_HEADS, Q_HEADS + K_HEADS):
        ours, torch_fn, nbytes, check_fn = append_case(args.tokens, heads, dtype)
        check_fn()
        label = f"append_paged_kv_cache {heads} heads"
        ratios[label], _, _ = bandwidth_row(label, ours, torch_fn, nbytes, copy_bw, (1, 1))
    for label, ours, torch_fn, nbytes, check_fn, streams in mla_cases(args.tokens, dtype):
        check_fn()
        ratios[label], _, _ = bandwidth_row(label, ours, torch_fn, nbytes, copy_bw, streams)
    print(f"lowest ratio to copy_: {min(ratios.values()):.3f} ({min(ratios, key=ratios.get)})")

    print("\nlatency under CUDA-graph replay (us per call), beside a copy_ of the same bytes")
    print(f"  {'tokens':>6} {'pos_ids':>8} {'inplace':>8} {'cos_sin':>8} {'indptr':>8} {'append8':>8} {'copy_':>8}")
    for tokens in (1, 8, 32, 128):
        cases = {label: ours for label, ours, _, _, _ in rope_cases(tokens, dtype)}
        append, _, nbytes_append, _ = append_case(tokens, K_HEADS, dtype)
        src = torch.empty(tokens * (Q_HEADS + K_HEADS) * HEAD_DIM, device="cuda", dtype=dtype)
        dst = torch.empty_like(src)
        times = [graph_latency(cases[name]) for name in
                 ("pos_ids", "pos_ids inplace (fused qkv)", "cos_sin_cache inplace (fused qkv)", "indptr/offsets")]
        times += [graph_latency(append), graph_latency(lambda: dst.copy_(src))]
        print(f"  {tokens:>6} " + " ".join(f"{t * 1e6:8.2f}" for t in times))


if __name__ == "__main__":
    main()
