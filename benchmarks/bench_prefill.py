"""Batch prefill attention: TFLOP/s of each backend beside torch's scaled_dot_product_attention
(flash and cuDNN backends), and paged beside ragged KV.

    python benchmarks/bench_prefill.py [--quick] [--backends fa2,fa3] [--seqs 8192,16384]
                                       [--flashinfer DIR] [--deepseek]

Backends: "fa2", the kernel of every arch (mma.sync), and "fa3", Hopper's (wgmma; compute
capability 9.0), each where it runs.

FLOPs = 2 x query heads x (head_dim of q and k + head_dim of v) x (query, key) pairs attended,
causal pairs counted exactly.
Each case is checked against torch SDPA (float32 math on the same inputs, for a few heads)
before it is timed; times are medians of CUDA-event timings after warm-up (aotinfer.testing).
Single sequences run through the ragged wrapper (planned once); SDPA gets K and V with every
query head's copy (made before timing), as its flash backend has no GQA. The batch case: 16
sequences of 512-4096 tokens (causal prefill), once against a paged cache (page 16, pages
scattered over a pool of twice the pages used) and once against the same keys contiguous; then
against the same pages in fp8 (e4m3 and e5m2, checked against the ragged run over the keys and
values dequantized).

With --flashinfer, FlashInfer's Hopper kernel joins the single sequences as a column ("FI fa3"),
from modules built beforehand (benchmarks/flashinfer_jit.py), checked and timed as ours are.
--deepseek: the single sequences at DeepSeek's head dims instead (128 heads, 192 for q and k, 128
for v, causal), with FlashInfer's fa2 and fa3 kernels of those dims as columns.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import aotinfer
from aotinfer.testing import bench_gpu_time
from flashinfer_jit import SinglePrefill

WORKSPACE = 256 << 20


def flops(heads, head_dim, pairs, head_dim_vo=None):
    return 2 * heads * (head_dim + (head_dim_vo or head_dim)) * pairs


def pairs_of(q_len, kv_len, causal):
    if not causal:
        return q_len * kv_len
    # query t sees keys 0 .. t + kv_len - q_len
    return sum(max(0, min(kv_len, t + kv_len - q_len + 1)) for t in range(q_len))


def check_against_sdpa(out, q, k, v, causal, heads_checked=2):
    group = q.shape[1] // k.shape[1]
    qs = q[:, :heads_checked].float().transpose(0, 1)
    ks = k.float().repeat_interleave(group, 1)[:, :heads_checked].transpose(0, 1)
    vs = v.float().repeat_interleave(group, 1)[:, :heads_checked].transpose(0, 1)
    want = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).transpose(0, 1)
    torch.testing.assert_close(out[:, :heads_checked].float(), want, rtol=2e-2, atol=2e-2)


def runs(backend):
    """Whether a backend runs on this GPU (fa3: compute capability 9.0)."""
    return backend != "fa3" or torch.cuda.get_device_capability() == (9, 0)


def sdpa_time(q, k, v, causal, backend):
    group = q.shape[1] // k.shape[1]
    qs = q.transpose(0, 1).unsqueeze(0)  # [1, heads, seq, dim]
    ks = k.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0)
    vs = v.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0)
    try:
        with sdpa_kernel(backend):
            return bench_gpu_time(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal), cold_l2_cache=False)[0]
    except RuntimeError:  # this backend does not take the shape here
        return float("nan")


def single(seq, heads, kv_heads, head_dim, causal, backends, flashinfer_dir=None, dtype=torch.bfloat16, head_dim_vo=None):
    head_dim_vo = head_dim_vo or head_dim
    q = torch.randn(seq, heads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(seq, kv_heads, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(seq, kv_heads, head_dim_vo, device="cuda", dtype=dtype)
    indptr = torch.tensor([0, seq], dtype=torch.int32, device="cuda")
    n = flops(heads, head_dim, pairs_of(seq, seq, causal), head_dim_vo)
    columns = []
    for backend in backends:
        if not runs(backend):
            continue
        wrapper = aotinfer.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"), backend=backend)
        wrapper.plan(indptr, indptr, heads, kv_heads, head_dim, causal=causal, q_data_type=dtype, head_dim_vo=head_dim_vo)
        out = torch.empty(seq, heads, head_dim_vo, device="cuda", dtype=dtype)
        run = lambda: wrapper.run(q, k, v, out=out)  # noqa: E731
        out.fill_(float("nan"))
        run()
        check_against_sdpa(out, q, k, v, causal)
        columns.append(f"{backend} {n / bench_gpu_time(run, cold_l2_cache=False)[0] / 1e12:6.1f}")
    for fi_backend in ("fa2", "fa3") if head_dim != head_dim_vo else ("fa3",):
        baseline = SinglePrefill(flashinfer_dir, head_dim, fi_backend) if flashinfer_dir else None
        if baseline is not None and baseline.available() and dtype == torch.bfloat16:
            out = torch.full((seq, heads, head_dim_vo), float("nan"), device="cuda", dtype=dtype)
            run = lambda: baseline(q, k, v, out, causal)  # noqa: E731
            run()
            check_against_sdpa(out, q, k, v, causal)
            columns.append(f"FI {fi_backend} {n / bench_gpu_time(run, cold_l2_cache=False)[0] / 1e12:6.1f}")
    for name, backend in (("SDPA flash", SDPBackend.FLASH_ATTENTION), ("cuDNN", SDPBackend.CUDNN_ATTENTION)):
        columns.append(f"{name} {n / sdpa_time(q, k, v, causal, backend) / 1e12:6.1f}")
    dims = f"d{head_dim}" if head_dim == head_dim_vo else f"d{head_dim}/{head_dim_vo}"
    label = f"{seq}x{seq} {heads}/{kv_heads} heads {dims} {'causal' if causal else 'full'}"
    print(f"  {label:<40} TFLOP/s: {'   '.join(columns)}")


def batch_paged_vs_ragged(backend, heads=32, kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(512, 4097, (16,), generator=gen).tolist()
    total = sum(lengths)
    qo_indptr = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    q = torch.randn(total, heads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(total, kv_heads, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(total, kv_heads, head_dim, device="cuda", dtype=dtype)
    # The same keys in scattered pages.
    pages = [-(-n // page_size) for n in lengths]
    pool = 2 * sum(pages)
    order = torch.randperm(pool, generator=gen)[: sum(pages)].to(torch.int32)
    k_cache = torch.zeros(pool, page_size, kv_heads, head_dim, device="cuda", dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    page_indptr = torch.tensor([0] + pages, dtype=torch.int64).cumsum(0).to(torch.int32)
    for b, n in enumerate(lengths):
        ids = order[page_indptr[b] : page_indptr[b + 1]].long().cuda()
        for cache, src in ((k_cache, k), (v_cache, v)):
            rows = torch.zeros(pages[b] * page_size, kv_heads, head_dim, device="cuda", dtype=dtype)
            rows[:n] = src[qo_indptr[b] : qo_indptr[b + 1]]
            cache[ids] = rows.view(pages[b], page_size, kv_heads, head_dim)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(lengths, pages)], dtype=torch.int32)

    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
    ragged = aotinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, backend=backend)
    ragged.plan(qo_indptr.cuda(), qo_indptr.cuda(), heads, kv_heads, head_dim, causal=True, q_data_type=dtype)
    paged = aotinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"), backend=backend)
    paged.plan(qo_indptr.cuda(), page_indptr.cuda(), order.cuda(), last.cuda(), heads, kv_heads, head_dim, page_size,
               causal=True, q_data_type=dtype)  # fmt: skip
    out_r, out_p = torch.empty_like(q), torch.empty_like(q)
    run_r = lambda: ragged.run(q, k, v, out=out_r)  # noqa: E731
    run_p = lambda: paged.run(q, (k_cache, v_cache), out=out_p)  # noqa: E731
    run_r(), run_p()
    b0 = slice(0, lengths[0])
    check_against_sdpa(out_r[b0], q[b0], k[b0], v[b0], True)
    # The paged kernel may cut the keys into other tiles than the ragged one (fa3 at head_dim 64),
    # and its sums then round apart: the two are compared at the reference check's tolerance.
    torch.testing.assert_close(out_p, out_r, rtol=2e-2, atol=2e-2)
    t_r, _ = bench_gpu_time(run_r, cold_l2_cache=False)
    t_p, _ = bench_gpu_time(run_p, cold_l2_cache=False)
    n = sum(flops(heads, head_dim, pairs_of(x, x, True)) for x in lengths)
    print(f"  {backend}: 16 sequences of 512-4096 (total {total}), {heads}/{kv_heads} heads d{head_dim} causal, page {page_size}:")
    print(f"    ragged {n / t_r / 1e12:6.1f} TFLOP/s ({t_r * 1e3:.3f} ms)   paged {n / t_p / 1e12:6.1f} TFLOP/s "
          f"({t_p * 1e3:.3f} ms)   paged/ragged throughput {t_r / t_p:5.3f}")

    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2) if backend == "fa2" else ():  # fp8 caches: fa2 only
        paged8 = aotinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"))
        try:
            paged8.plan(qo_indptr.cuda(), page_indptr.cuda(), order.cuda(), last.cuda(), heads, kv_heads, head_dim,
                        page_size, causal=True, q_data_type=dtype, kv_data_type=fp8)  # fmt: skip
        except NotImplementedError:
            print(f"    paged {str(fp8)[6:]}: not in this build")
            continue
        caches8 = (k_cache.to(fp8), v_cache.to(fp8))
        out_8 = torch.full_like(q, float("nan"))
        run_8 = lambda: paged8.run(q, caches8, out=out_8)  # noqa: E731
        run_8()
        ragged.run(q, k.to(fp8).to(dtype), v.to(fp8).to(dtype), out=out_r)  # the same keys and values, dequantized
        torch.testing.assert_close(out_8, out_r, rtol=2e-2, atol=2e-2)
        t_8, _ = bench_gpu_time(run_8, cold_l2_cache=False)
        print(f"    paged {str(fp8)[6:]} {n / t_8 / 1e12:6.1f} TFLOP/s ({t_8 * 1e3:.3f} ms)   /paged bf16 {t_p / t_8:5.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the d128 8192 cases and the batch only")
    parser.add_argument("--backends", default="fa2,fa3", help="comma-separated: fa2, fa3 (each where it runs)")
    parser.add_argument("--seqs", default="8192", help="comma-separated single-sequence lengths")
    parser.add_argument("--flashinfer", metavar="DIR", help="FlashInfer's modules (flashinfer_jit.py build)")
    parser.add_argument("--deepseek", action="store_true", help="128 heads at head dims 192 (q, k) and 128 (v), causal")
    args = parser.parse_args()
    backends = args.backends.split(",")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, aotinfer {aotinfer.__version__}")
    if args.deepseek:
        for seq in (int(n) for n in args.seqs.split(",")):
            single(seq, 128, 128, 192, True, backends, args.flashinfer, head_dim_vo=128)
            single(seq, 128, 128, 128, True, backends, args.flashinfer)  # the d128 bar of the same heads
        return
    cases = [(32, 32, 128), (32, 8, 128)] + ([] if args.quick else [(32, 32, 64), (16, 16, 256)])
    for seq in (int(n) for n in args.seqs.split(",")):
        for heads, kv_heads, head_dim in cases:
            for causal in (True, False):
                single(seq, heads, kv_heads, head_dim, causal, backends, args.flashinfer)
    for backend in backends:
        if runs(backend):
            batch_paged_vs_ragged(backend)


if __name__ == "__main__":
    main()
