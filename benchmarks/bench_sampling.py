"""Sampling: time and passes over the probabilities per op, beside torch's sort-based sampler.

    python benchmarks/bench_sampling.py [--batch 1 64] [--vocab 128256] [--ops top_k_top_p ...] [--scale 3]

Inputs: probs = softmax(randn) rows (float32), logits = randn; --scale S takes S * randn instead
(3 or 4: peaked rows, nearer a language model's). The rows come from --seed (default 0), so that
two builds timed in turn see the same rows (on unseeded rows, min_p at 256 x 32000 ranged
29.5-34.5 us between processes of one build; H100, docs/design/sampling.md). "passes" = time / the time to read the input
once at the bandwidth of torch's copy_ of the same bytes, measured beside each shape (a copy reads
and writes, so reading once takes half its time); an op that reads its row twice and writes
nothing scores at least 2, softmax and the renorms (one read, one write) at least 2.
Times are medians of CUDA-graph replays with a cold L2 (aotinfer.testing.bench_gpu_time); seeds
and offsets are fixed ints so that the calls capture. torch's sampler: sort, cumsum, top-k / top-p
masks, renormalize, multinomial (the eager path servers fall back to), on the same probs.
Each op's draw is checked against its kept set before it is timed.
"""

import argparse

import torch

import aotinfer
from aotinfer.testing import bench_gpu_time, copy_bandwidth

TOP_K, TOP_P, MIN_P = 50, 0.9, 0.05


def torch_top_k_top_p(probs, top_k, top_p):
    values, order = probs.sort(dim=-1, descending=True)
    cumulative = values.cumsum(-1)
    ranks = torch.arange(probs.shape[1], device=probs.device)
    top_k_mass = cumulative.gather(-1, (top_k.clamp(1, probs.shape[1]) - 1)[:, None])  # top-p over the top-k set
    keep = (ranks[None] < top_k[:, None]) & (cumulative - values < top_p[:, None] * top_k_mass)
    kept = torch.where(keep, values, 0.0)
    choice = torch.multinomial(kept, 1)
    return order.gather(-1, choice)[:, 0]


def kept_by_top_k_top_p(probs, k, p):
    values = probs.sort(dim=-1, descending=True).values
    kth = values[:, k - 1 : k]
    base = torch.where(probs >= kth, probs, 0.0).double()
    sorted_base = base.sort(-1, descending=True).values
    cumulative = sorted_base.cumsum(-1)
    first = (cumulative < p * cumulative[:, -1:]).sum(-1, keepdim=True)
    return base >= sorted_base.gather(-1, first)


def ops(probs, logits, batch):
    k_rows = torch.full((batch,), TOP_K, device="cuda", dtype=torch.int32)
    p_rows = torch.full((batch,), TOP_P, device="cuda")
    min_p_rows = torch.full((batch,), MIN_P, device="cuda")
    r = dict(seed=1, offset=0)
    return {
        "top_k_top_p": lambda: aotinfer.top_k_top_p_sampling_from_probs(probs, TOP_K, TOP_P, **r),
        "top_k_top_p rows": lambda: aotinfer.top_k_top_p_sampling_from_probs(probs, k_rows, p_rows, **r),
        # vLLM's default call (top-k first from float32 logits: one kernel from the logits).
        "top_k_top_p logits rows": lambda: aotinfer.top_k_top_p_sampling_from_logits(logits, k_rows, p_rows, **r),
        "joint": lambda: aotinfer.top_k_top_p_sampling_from_probs(probs, TOP_K, TOP_P, filter_apply_order="joint", **r),
        "joint rows": lambda: aotinfer.top_k_top_p_sampling_from_probs(probs, k_rows, p_rows, filter_apply_order="joint", **r),
        "top_p": lambda: aotinfer.top_p_sampling_from_probs(probs, TOP_P, **r),
        "top_p rows": lambda: aotinfer.top_p_sampling_from_probs(probs, p_rows, **r),
        "top_k": lambda: aotinfer.top_k_sampling_from_probs(probs, TOP_K, **r),
        "min_p": lambda: aotinfer.min_p_sampling_from_probs(probs, MIN_P, **r),
        "min_p rows": lambda: aotinfer.min_p_sampling_from_probs(probs, min_p_rows, **r),
        "from_probs": lambda: aotinfer.sampling_from_probs(probs, **r),
        "from_logits": lambda: aotinfer.sampling_from_logits(logits, **r),
        "top_k_renorm": lambda: aotinfer.top_k_renorm_probs(probs, TOP_K),
        "top_p_renorm": lambda: aotinfer.top_p_renorm_probs(probs, TOP_P),
        "top_k_mask_logits": lambda: aotinfer.top_k_mask_logits(logits, TOP_K),
        "softmax": lambda: aotinfer.softmax(logits, 0.8),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 16, 64, 256, 1024])
    parser.add_argument("--vocab", type=int, nargs="*", default=[32000, 128256, 151936, 262144])
    parser.add_argument("--ops", nargs="*", default=None)
    parser.add_argument("--scale", type=float, default=1.0, help="logits = scale * randn (probs their softmax)")
    parser.add_argument("--seed", type=int, default=0, help="the rows' random seed")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, aotinfer {aotinfer.__version__}")
    print(f"device-to-device copy bandwidth, this run: {copy_bandwidth() / 1e9:.0f} GB/s (read + written)")
    print(f"top_k {TOP_K}, top_p {TOP_P}, min_p {MIN_P}; probs = softmax({args.scale:g} * randn), float32\n")
    print(f"{'batch':>5} {'vocab':>7} {'op':<18} {'time us':>9} {'passes':>7}   {'torch us':>9} {'torch/ours':>10}")
    for vocab in args.vocab:
        for batch in args.batch:
            g = torch.Generator(device="cuda").manual_seed(args.seed)
            logits = torch.randn(batch, vocab, device="cuda", generator=g) * args.scale
            probs = torch.softmax(logits, -1)
            dst = torch.empty_like(probs)
            t_copy, _ = bench_gpu_time(dst.copy_, args=(probs,), use_cuda_graph=True, dry_run_time_ms=10, repeat_time_ms=50)
            read_once = t_copy / 2
            # Check before timing: the draws lie in the kept set.
            keep = kept_by_top_k_top_p(probs, TOP_K, TOP_P)
            for name in ("top_k_top_p", "top_k_top_p rows", "top_k_top_p logits rows"):
                drawn = ops(probs, logits, batch)[name]().long()
                assert keep[torch.arange(batch, device="cuda"), drawn].all(), f"{name}: a filtered token"
            k_rows = torch.full((batch,), TOP_K, device="cuda")
            p_rows = torch.full((batch,), TOP_P, device="cuda")
            drawn = torch_top_k_top_p(probs, k_rows, p_rows)
            assert keep[torch.arange(batch, device="cuda"), drawn].all(), "torch's sampler: a filtered token"
            t_torch, _ = bench_gpu_time(torch_top_k_top_p, args=(probs, k_rows, p_rows), use_cuda_graph=True,
                                        dry_run_time_ms=10, repeat_time_ms=50)
            for name, fn in ops(probs, logits, batch).items():
                if args.ops and name not in args.ops:
                    continue
                t, _ = bench_gpu_time(fn, use_cuda_graph=True, dry_run_time_ms=10, repeat_time_ms=50)
                torch_cols = f"{t_torch * 1e6:9.1f} {t_torch / t:10.1f}" if name.startswith("top_k_top_p") else ""
                print(f"{batch:5d} {vocab:7d} {name:<18} {t * 1e6:9.1f} {t / read_once:7.2f}   {torch_cols}", flush=True)
            del logits, probs, dst, keep


if __name__ == "__main__":
    main()
