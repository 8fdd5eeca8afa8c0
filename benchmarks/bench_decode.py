"""Paged decode attention: bandwidth beside a copy of the same bytes, and step latency.

    python benchmarks/bench_decode.py [--quick] [--flashinfer DIR]

Shape: Llama-3-8B-like, 32 query / 8 KV heads, head_dim 128, page_size 16, bf16, each request's
pages scattered at random in a pool of twice the pages used. Bytes = the K and V rows attended +
q read + output written; each case is timed (cold L2) beside torch's device-to-device copy of the
same bytes in the same run. Each case is checked against a float32 reference on the gathered
pages before it is timed. Latency: one decode step (plan done) under CUDA-graph replay at batch
1 x 1024, beside torch's scaled_dot_product_attention on pages gathered beforehand.

With --flashinfer, FlashInfer's decode kernels join the bf16 cases as two more ratios to the same
copy ("FI plain": its CUDA-core kernel; "FI tc": use_tensor_cores=True), from modules built
beforehand (benchmarks/flashinfer_jit.py), checked and timed as ours are.
"""

import argparse

import torch
import torch.nn.functional as F

import aotinfer
from _bandwidth import gbps, same_size_copy, streaming_limit
from aotinfer.testing import bench_gpu_time
from flashinfer_jit import BatchDecode

WORKSPACE = 256 << 20


def paged_case(batch, kv_len, qo_heads, kv_heads, head_dim=128, page_size=16, kv_dtype=torch.bfloat16):
    pages_each = (kv_len + page_size - 1) // page_size
    pool = 2 * batch * pages_each
    k = torch.randn(pool, page_size, kv_heads, head_dim, device="cuda").to(kv_dtype)
    v = torch.randn(pool, page_size, kv_heads, head_dim, device="cuda").to(kv_dtype)
    indices = torch.randperm(pool, device="cuda")[: batch * pages_each].int()
    indptr = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * pages_each
    last = torch.full((batch,), kv_len - (pages_each - 1) * page_size, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, qo_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    return q, (k, v), indptr, indices, last


def gathered(cache, indptr, indices, last, b):
    pages = indices[indptr[b] : indptr[b + 1]].long()
    k, v = (c[pages].flatten(0, 1) for c in cache)  # [pages * page_size, kv_heads, head_dim]
    n = (len(pages) - 1) * cache[0].shape[1] + int(last[b])
    return k[:n], v[:n]


def reference(q, cache, indptr, indices, last, k_scale=1.0, v_scale=1.0):
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    group = q.shape[1] // cache[0].shape[2]
    for b in range(q.shape[0]):
        k, v = gathered(cache, indptr, indices, last, b)
        k = k.float().repeat_interleave(group, 1) * k_scale
        v = v.float().repeat_interleave(group, 1) * v_scale
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) / q.shape[-1] ** 0.5
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out


def run_case(label, batch, kv_len, qo_heads, kv_heads, kv_dtype=torch.bfloat16, k_scale=None, v_scale=None,
             flashinfer_dir=None):
    q, cache, indptr, indices, last = paged_case(batch, kv_len, qo_heads, kv_heads, kv_dtype=kv_dtype)
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(indptr, indices, last, qo_heads, kv_heads, 128, 16, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
    out = torch.empty_like(q)
    run = lambda: wrapper.run(q, cache, out=out, k_scale=k_scale, v_scale=v_scale)  # noqa: E731
    out.fill_(float("nan"))
    run()
    n = min(batch, 4)
    want = reference(q[:n], cache, indptr, indices, last, k_scale or 1.0, v_scale or 1.0)
    torch.testing.assert_close(out[:n].float(), want, rtol=2e-2, atol=2e-2)
    kv_bytes = 2 * batch * kv_len * kv_heads * 128 * cache[0].element_size()
    nbytes = kv_bytes + 2 * q.numel() * q.element_size()
    t, _ = bench_gpu_time(run)
    copy = same_size_copy(nbytes)
    limit, limit_once = streaming_limit(nbytes, 1, 0), streaming_limit(nbytes, 1, 0, read_once=True)
    ratio = gbps(nbytes, t) / copy
    limit_text = (f"  limit {limit / copy:6.3f} read-once {limit_once / copy:6.3f} ours/read-once"
                  f" {gbps(nbytes, t) / limit_once:6.3f}" if limit else "")
    baselines = ""
    for name, tensor_cores in (("FI plain", False), ("FI tc", True)):
        baseline = BatchDecode(flashinfer_dir, tensor_cores) if flashinfer_dir and kv_dtype == q.dtype else None
        if baseline is None or not baseline.available():
            continue
        baseline.plan(indptr, indices, last, qo_heads, kv_heads, 16, q.dtype)
        theirs = torch.full_like(q, float("nan"))
        run_theirs = lambda: baseline.run(q, cache, theirs)  # noqa: E731
        run_theirs()
        torch.testing.assert_close(theirs[:n].float(), want, rtol=2e-2, atol=2e-2)
        baselines += f"   {name} {gbps(nbytes, bench_gpu_time(run_theirs)[0]) / copy:6.3f}"
    print(f"  {label:<34} {t * 1e6:9.1f} us {gbps(nbytes, t):7.0f} GB/s  copy {copy:5.0f}  {ratio:6.3f}{limit_text}{baselines}")
    return ratio


def latency():
    batch, kv_len, qo_heads, kv_heads = 1, 1024, 32, 8
    q, cache, indptr, indices, last = paged_case(batch, kv_len, qo_heads, kv_heads)
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(indptr, indices, last, qo_heads, kv_heads, 128, 16, q_data_type=torch.bfloat16)
    out = torch.empty_like(q)
    ours, _ = bench_gpu_time(lambda: wrapper.run(q, cache, out=out), use_cuda_graph=True, cold_l2_cache=False)
    k, v = gathered(cache, indptr, indices, last, 0)
    k, v = (x.transpose(0, 1).unsqueeze(0) for x in (k, v))  # [1, kv_heads, n, d]
    qs = q.unsqueeze(2)  # [1, heads, 1, d]
    sdpa = lambda: F.scaled_dot_product_attention(qs, k, v, enable_gqa=True)  # noqa: E731
    theirs, _ = bench_gpu_time(sdpa, use_cuda_graph=True, cold_l2_cache=False)
    print(f"\ndecode step, batch 1 x 1024, CUDA-graph replay: ours {ours * 1e6:.2f} us, "
          f"torch SDPA on gathered pages {theirs * 1e6:.2f} us")


def several_tokens(batch=64, kv_len=4096, q_lens=(2, 4)):
    """Decode steps of q_len_per_req query tokens a request (MTP, speculative verification: the paged
    prefill kernel, causal) beside one token a request over the same batch (the decode kernel): us,
    and the ratio to one token (cold L2; the KV is read once either way)."""
    q, cache, indptr, indices, last = paged_case(batch, kv_len, 32, 8)
    workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
    wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    times = {}
    for q_len in (1,) + tuple(q_lens):
        wrapper.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16, q_len_per_req=q_len)
        qs = torch.randn(batch * q_len, 32, 128, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(qs)
        times[q_len], _ = bench_gpu_time(lambda: wrapper.run(qs, cache, out=out))
    print(f"\nseveral query tokens a request, bf16 32/8 heads, {batch}x{kv_len}: us (ratio to one token)")
    for q_len, t in times.items():
        print(f"  q_len_per_req {q_len}: {t * 1e6:8.1f} ({t / times[1]:.2f})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three shapes only")
    parser.add_argument("--several-tokens", action="store_true", help="only the table of q_len_per_req 1, 2, 4")
    parser.add_argument("--flashinfer", metavar="DIR", help="FlashInfer's modules (flashinfer_jit.py build)")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, aotinfer {aotinfer.__version__}")
    if args.several_tokens:
        several_tokens()
        return
    print("bandwidth: ours, then a copy of the same bytes, and ours / copy; the read-only limits / copy (plain loads,"
          " and loads evict-first in L2 as ours), and ours / the evict-first one")
    shapes = [(1, 1024), (16, 1024), (16, 2048), (16, 8192), (64, 2048), (64, 8192), (256, 2048), (256, 8192),
              (1, 32768), (4, 65536)]
    if args.quick:
        shapes = [(16, 2048), (64, 8192), (1, 32768)]
    for batch, kv_len in shapes:
        run_case(f"bf16 32/8 heads {batch}x{kv_len}", batch, kv_len, 32, 8, flashinfer_dir=args.flashinfer)
    run_case("bf16 group 1 (32/32) 64x4096", 64, 4096, 32, 32, flashinfer_dir=args.flashinfer)
    run_case("bf16 group 8 (64/8) 64x4096", 64, 4096, 64, 8, flashinfer_dir=args.flashinfer)
    for batch, kv_len in [(16, 2048), (64, 4096), (256, 8192)]:
        run_case(f"fp8 e4m3 KV 32/8 {batch}x{kv_len}", batch, kv_len, 32, 8, torch.float8_e4m3fn, k_scale=0.5, v_scale=2.0)
    run_case("fp8 e5m2 KV 32/8 64x4096", 64, 4096, 32, 8, torch.float8_e5m2, k_scale=0.5, v_scale=2.0)
    latency()
    several_tokens()


if __name__ == "__main__":
    main()
