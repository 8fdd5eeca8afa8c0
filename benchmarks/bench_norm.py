"""Normalizations: bandwidth at prefill sizes, latency at decode sizes, beside torch's eager ops.

    python benchmarks/bench_norm.py

Bytes = every input read once + every output written once (the weights once). Each row gives
ratios to torch's copy_ of the same bytes and to the streaming limit (the same bytes read and
written in the op's proportion by a kernel that does nothing else; benchmarks/_bandwidth.py), both
timed beside the case. Each op is checked against a float64 reference before it is timed. Latency: GPU time per op from CUDA-graph replays of 20
back-to-back calls, PDL as by default (on, on sm90+).
"""

import torch
import torch.nn.functional as F

import aotinfer
from _bandwidth import bandwidth_row, graph_latency, start

EPS = 1e-6


def check(x, w):
    ref = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + EPS) * w.double()).to(x.dtype)
    torch.testing.assert_close(aotinfer.rmsnorm(x, w), ref, rtol=2e-2, atol=2e-2)
    gamma, beta = torch.randn_like(w, dtype=torch.float32), torch.randn_like(w, dtype=torch.float32)
    torch.testing.assert_close(aotinfer.layernorm(x, gamma, beta, EPS), F.layer_norm(x.float(), w.shape, gamma, beta, EPS).to(x.dtype), rtol=2e-2, atol=2e-2)
    r = torch.randn_like(x)
    total = x.double() + r.double()
    ref = (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + EPS) * w.double()).to(x.dtype)
    y = x.clone()  # the fused add normalizes the float sum: one rounding, within 1 bf16 ulp of the rounded reference
    aotinfer.fused_add_rmsnorm(y, r, w)
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)


def torch_fused_add_rmsnorm(x, r, w):
    r.add_(x)
    x.copy_(F.rms_norm(r, w.shape, w, EPS))


def main():
    dtype = torch.bfloat16
    copy_bw = start(dtype)
    worst = worst_limit = float("inf")
    for tokens in (4096, 16384):
        for hidden in (4096, 8192):
            x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
            r = torch.randn_like(x)
            w = torch.randn(hidden, device="cuda", dtype=dtype)
            gamma, beta = w.float(), torch.randn(hidden, device="cuda")
            out = torch.empty_like(x)
            check(x[:64], w)
            row = x.numel() * x.element_size()
            size = f"{tokens}x{hidden}"
            # (name, ours, torch's, bytes, (streams read, streams written))
            cases = [
                ("rmsnorm", lambda: aotinfer.rmsnorm(x, w, out=out), lambda: F.rms_norm(x, (hidden,), w, EPS), 2 * row, (1, 1)),
                ("gemma_rmsnorm", lambda: aotinfer.gemma_rmsnorm(x, w, out=out), lambda: F.rms_norm(x, (hidden,), w + 1, EPS), 2 * row, (1, 1)),
                ("fused_add_rmsnorm", lambda: aotinfer.fused_add_rmsnorm(x, r, w), lambda: torch_fused_add_rmsnorm(x, r, w), 4 * row, (2, 2)),
                ("gemma_fused_add_rmsnorm", lambda: aotinfer.gemma_fused_add_rmsnorm(x, r, w), lambda: torch_fused_add_rmsnorm(x, r, w + 1), 4 * row, (2, 2)),
                ("layernorm (fp32 gemma/beta)", lambda: aotinfer.layernorm(x, gamma, beta, EPS), lambda: F.layer_norm(x, (hidden,), w, w, EPS), 2 * row, (1, 1)),
                ("layernorm (bf16 gemma/beta)", lambda: aotinfer.layernorm(x, w, w, EPS), lambda: F.layer_norm(x, (hidden,), w, w, EPS), 2 * row, (1, 1)),
            ]
            for name, ours, theirs, nbytes, streams in cases:
                ratio, limit_ratio = bandwidth_row(f"{name} {size}", ours, theirs, nbytes, copy_bw, streams)
                worst = min(worst, ratio)
                worst_limit = min(worst_limit, limit_ratio)
            del x, r, out
    print(f"lowest ratio to a same-size copy_: {worst:.3f} (target >= 0.90); to the streaming limit: {worst_limit:.3f}")

    print("\nlatency under CUDA-graph replay, hidden 4096 (us per op; target <= 2.5)")
    print(f"  {'tokens':>6} {'rmsnorm':>8} {'gemma':>8} {'fused':>8} {'gemma_f':>8} {'layernrm':>8} {'torch rms':>9}")
    slowest = 0.0
    for tokens in (1, 8, 32, 128):
        x = torch.randn(tokens, 4096, device="cuda", dtype=dtype)
        r, out = torch.randn_like(x), torch.empty_like(x)
        w = torch.randn(4096, device="cuda", dtype=dtype)
        gamma, beta = w.float(), w.float()
        times = [
            graph_latency(lambda: aotinfer.rmsnorm(x, w, out=out)),
            graph_latency(lambda: aotinfer.gemma_rmsnorm(x, w, out=out)),
            graph_latency(lambda: aotinfer.fused_add_rmsnorm(x, r, w)),
            graph_latency(lambda: aotinfer.gemma_fused_add_rmsnorm(x, r, w)),
            graph_latency(lambda: aotinfer.layernorm(x, gamma, beta)),
        ]
        torch_time = graph_latency(lambda: F.rms_norm(x, (4096,), w, EPS))
        slowest = max(slowest, *times)
        print(f"  {tokens:>6} " + " ".join(f"{t * 1e6:8.2f}" for t in times) + f" {torch_time * 1e6:9.2f}")
    print(f"slowest: {slowest * 1e6:.2f} us")


if __name__ == "__main__":
    main()
