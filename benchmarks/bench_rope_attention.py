"""RoPE inside attention: pos_encoding_mode="ROPE_LLAMA" beside the same call with "NONE".

    python benchmarks/bench_rope_attention.py [--quick]

Each case plans two wrappers over the same inputs, one a mode, and times them alternately in one
run (device events, medians; cold L2 for decode, which is memory-bound): the figure is the
ROPE_LLAMA time over the NONE time. Decode: bench_decode's shape (32 query / 8 KV heads, head_dim
128, page 16, bf16, pages scattered). Prefill: bench_prefill's (a single 8192-token sequence,
ragged, 32/8 heads, d128, bf16, on the kernel of every arch, which is the one that takes RoPE), and
its batch of 16 paged sequences of 512-4096 tokens. The RoPE output is checked first against the
NONE call over q and k turned beforehand by aotinfer.apply_rope_pos_ids.
"""

import argparse

import torch

import aotinfer
from aotinfer.testing import bench_gpu_time
from bench_decode import paged_case

WORKSPACE = 256 << 20
DECODE_CASES = [(1, 1024), (16, 4096), (64, 4096), (128, 8192), (256, 2048), (32, 32768)]
QUICK_DECODE = [(16, 4096), (128, 8192)]


def alternate(runs, rounds=3, **options):
    """Median GPU time of each run, timed in turns over `rounds` rounds (the best round's median)."""
    times = [[] for _ in runs]
    for _ in range(rounds):
        for i, run in enumerate(runs):
            times[i].append(bench_gpu_time(run, **options)[0])
    return [min(t) for t in times]


def decode(batch, kv_len, q_len=1):
    q, cache, indptr, indices, last = paged_case(batch, kv_len, 32, 8)
    if q_len > 1:
        q = torch.randn(batch * q_len, 32, 128, device="cuda", dtype=torch.bfloat16)
    runs = []
    for mode in ("NONE", "ROPE_LLAMA"):
        wrapper = aotinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"),
                                                              "NHD", use_tensor_cores=q_len > 1)  # fmt: skip
        wrapper.plan(indptr, indices, last, 32, 8, 128, 16, q_data_type=torch.bfloat16, pos_encoding_mode=mode,
                     q_len_per_req=q_len)  # fmt: skip
        out = torch.empty_like(q)
        runs.append(lambda wrapper=wrapper, out=out: wrapper.run(q, cache, out=out))
    none, rope = alternate(runs)
    label = f"decode {batch} x {kv_len}" + (f", q_len_per_req {q_len}" if q_len > 1 else "")
    print(f"  {label:<36} NONE {none * 1e6:9.1f} us   ROPE_LLAMA {rope * 1e6:9.1f} us   ratio {rope / none:6.3f}")


def single_prefill(seq, causal):
    q = torch.randn(seq, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(seq, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    indptr = torch.tensor([0, seq], dtype=torch.int32, device="cuda")
    wrappers, outs = {}, {}
    for mode in ("NONE", "ROPE_LLAMA"):
        wrapper = aotinfer.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"),
                                                                backend="fa2")  # fmt: skip
        wrapper.plan(indptr, indptr, 32, 8, 128, causal=causal, q_data_type=torch.bfloat16, pos_encoding_mode=mode)
        wrappers[mode], outs[mode] = wrapper, torch.full_like(q, float("nan"))
    wrappers["ROPE_LLAMA"].run(q, k, v, out=outs["ROPE_LLAMA"])
    positions = torch.arange(seq, dtype=torch.int32, device="cuda")
    q_turned, k_turned = aotinfer.apply_rope_pos_ids(q, k, positions)
    torch.testing.assert_close(outs["ROPE_LLAMA"], wrappers["NONE"].run(q_turned, k_turned, v), rtol=2e-2, atol=2e-2)
    none, rope = alternate([lambda mode=mode: wrappers[mode].run(q, k, v, out=outs[mode]) for mode in ("NONE", "ROPE_LLAMA")],
                           cold_l2_cache=False)  # fmt: skip
    label = f"prefill {seq}x{seq} {'causal' if causal else 'full'}"
    print(f"  {label:<36} NONE {none * 1e3:9.3f} ms   ROPE_LLAMA {rope * 1e3:9.3f} ms   ratio {rope / none:6.3f}")


def batch_prefill(page_size=16):
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(512, 4097, (16,), generator=gen).tolist()
    qo_indptr = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lengths), 32, 128, device="cuda", dtype=torch.bfloat16)
    pages = [-(-n // page_size) for n in lengths]
    pool = 2 * sum(pages)
    k_cache, v_cache = (torch.randn(pool, page_size, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    order = torch.randperm(pool, generator=gen)[: sum(pages)].to(torch.int32).cuda()
    page_indptr = torch.tensor([0] + pages, dtype=torch.int64).cumsum(0).to(torch.int32).cuda()
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(lengths, pages)], dtype=torch.int32).cuda()
    runs = []
    for mode in ("NONE", "ROPE_LLAMA"):
        wrapper = aotinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"),
                                                               backend="fa2")  # fmt: skip
        wrapper.plan(qo_indptr.cuda(), page_indptr, order, last, 32, 8, 128, page_size, causal=True,
                     q_data_type=torch.bfloat16, pos_encoding_mode=mode)  # fmt: skip
        out = torch.empty_like(q)
        runs.append(lambda wrapper=wrapper, out=out: wrapper.run(q, (k_cache, v_cache), out=out))
    none, rope = alternate(runs, cold_l2_cache=False)
    label = "prefill batch 16 x 512-4096 paged causal"
    print(f"  {label:<36} NONE {none * 1e3:9.3f} ms   ROPE_LLAMA {rope * 1e3:9.3f} ms   ratio {rope / none:6.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two decode shapes and the 8192 causal prefill")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}: ROPE_LLAMA time / NONE time, bf16, 32/8 heads, head_dim 128")
    for batch, kv_len in QUICK_DECODE if args.quick else DECODE_CASES:
        decode(batch, kv_len)
    decode(64, 4096, q_len=4)
    for causal in (True,) if args.quick else (True, False):
        single_prefill(8192, causal)
    if not args.quick:
        batch_prefill()


if __name__ == "__main__":
    main()
