"""Normalizations: bandwidth at prefill sizes, latency at decode sizes, beside torch's eager ops.

    python benchmarks/bench_norm.py

Bytes = every input read once + every output written once (the weights once). Each row gives
ratios to torch's copy_ of the same bytes and to the streaming limit (the same bytes read and
written in the op's proportion by a kernel that does nothing else; benchmarks/_bandwidth.py), both
timed beside the case. Each op is checked against a float64 reference before it is timed. Latency: GPU time per op from CUDA-graph replays of 20
back-to-back calls, PDL as by default (on, on sm90+). With AOTINFER_BENCH_FLASHINFER_INCLUDE set
(benchmarks/_bandwidth.py), FlashInfer's kernels are checked and timed beside ours in both tables.
"""

import torch
import torch.nn.functional as F

import aotinfer
from _bandwidth import bandwidth_row, flashinfer_baseline, flashinfer_call, graph_latency, start

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


def flashinfer_ops(fi):
    """FlashInfer's kernels with our ops' signatures (PDL on, as its Python API sets it on sm90+),
    by our op's name; empty without the baseline."""
    if fi is None:
        return {}

    def rmsnorm(gemma):
        def op(x, w, eps=EPS, out=None):
            out = torch.full_like(x, float("nan")) if out is None else out
            flashinfer_call(fi.fi_rmsnorm, out.data_ptr(), x.data_ptr(), w.data_ptr(), x.shape[0], x.shape[1], eps, gemma, 1)
            return out
        return op

    def fused_add_rmsnorm(gemma):
        def op(x, r, w, eps=EPS):
            flashinfer_call(fi.fi_fused_add_rmsnorm, x.data_ptr(), r.data_ptr(), w.data_ptr(), x.shape[0], x.shape[1], eps, gemma, 1)
        return op

    def layernorm(x, gamma, beta, eps=EPS, out=None):
        out = torch.full_like(x, float("nan")) if out is None else out
        flashinfer_call(fi.fi_layernorm, out.data_ptr(), x.data_ptr(), gamma.data_ptr(), beta.data_ptr(), x.shape[0], x.shape[1], eps)
        return out

    return {"rmsnorm": rmsnorm(0), "gemma_rmsnorm": rmsnorm(1), "fused_add_rmsnorm": fused_add_rmsnorm(0),
            "gemma_fused_add_rmsnorm": fused_add_rmsnorm(1), "layernorm": layernorm}


def check_flashinfer(ops, x, w):
    """FlashInfer's kernels against the same float64 references as ours, before they are timed."""
    if not ops:
        return
    ref = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + EPS) * w.double()).to(x.dtype)
    torch.testing.assert_close(ops["rmsnorm"](x, w), ref, rtol=2e-2, atol=2e-2)
    gamma, beta = torch.randn_like(w, dtype=torch.float32), torch.randn_like(w, dtype=torch.float32)
    torch.testing.assert_close(ops["layernorm"](x, gamma, beta), F.layer_norm(x.float(), w.shape, gamma, beta, EPS).to(x.dtype), rtol=2e-2, atol=2e-2)
    r = torch.randn_like(x)
    total = x.double() + r.double()
    ref = (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + EPS) * w.double()).to(x.dtype)
    y = x.clone()
    ops["fused_add_rmsnorm"](y, r, w)
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)


def torch_fused_add_rmsnorm(x, r, w):
    r.add_(x)
    x.copy_(F.rms_norm(r, w.shape, w, EPS))


def main():
    dtype = torch.bfloat16
    copy_bw = start(dtype)
    fi = flashinfer_ops(flashinfer_baseline())
    worst = worst_limit = worst_fi = float("inf")
    for tokens in (4096, 16384):
        for hidden in (4096, 8192):
            x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
            r = torch.randn_like(x)
            w = torch.randn(hidden, device="cuda", dtype=dtype)
            gamma, beta = w.float(), torch.randn(hidden, device="cuda")
            out = torch.empty_like(x)
            check(x[:64], w)
            check_flashinfer(fi, x[:64], w)
            row = x.numel() * x.element_size()
            size = f"{tokens}x{hidden}"
            # (name, ours, torch's, FlashInfer's or None, bytes, (streams read, streams written))
            cases = [
                ("rmsnorm", lambda: aotinfer.rmsnorm(x, w, out=out), lambda: F.rms_norm(x, (hidden,), w, EPS),
                 fi and (lambda: fi["rmsnorm"](x, w, out=out)), 2 * row, (1, 1)),
                ("gemma_rmsnorm", lambda: aotinfer.gemma_rmsnorm(x, w, out=out), lambda: F.rms_norm(x, (hidden,), w + 1, EPS),
                 fi and (lambda: fi["gemma_rmsnorm"](x, w, out=out)), 2 * row, (1, 1)),
                ("fused_add_rmsnorm", lambda: aotinfer.fused_add_rmsnorm(x, r, w), lambda: torch_fused_add_rmsnorm(x, r, w),
                 fi and (lambda: fi["fused_add_rmsnorm"](x, r, w)), 4 * row, (2, 2)),
                ("gemma_fused_add_rmsnorm", lambda: aotinfer.gemma_fused_add_rmsnorm(x, r, w), lambda: torch_fused_add_rmsnorm(x, r, w + 1),
                 fi and (lambda: fi["gemma_fused_add_rmsnorm"](x, r, w)), 4 * row, (2, 2)),
                ("layernorm (fp32 gemma/beta)", lambda: aotinfer.layernorm(x, gamma, beta, EPS), lambda: F.layer_norm(x, (hidden,), w, w, EPS),
                 fi and (lambda: fi["layernorm"](x, gamma, beta, out=out)), 2 * row, (1, 1)),
                ("layernorm (bf16 gemma/beta)", lambda: aotinfer.layernorm(x, w, w, EPS), lambda: F.layer_norm(x, (hidden,), w, w, EPS),
                 None, 2 * row, (1, 1)),
            ]
            for name, ours, theirs, flashinfer, nbytes, streams in cases:
                ratio, limit_ratio, vs_fi = bandwidth_row(f"{name} {size}", ours, theirs, nbytes, copy_bw, streams, flashinfer or None)
                worst = min(worst, ratio)
                worst_limit = min(worst_limit, limit_ratio)
                worst_fi = min(worst_fi, vs_fi or worst_fi)
            del x, r, out
    print(f"lowest ratio to a same-size copy_: {worst:.3f} (target >= 0.90); to the streaming limit: {worst_limit:.3f}")
    if fi:
        print(f"lowest FlashInfer time / ours: {worst_fi:.3f} (>= 1: ours as fast or faster at every row)")

    print("\nlatency under CUDA-graph replay, hidden 4096 (us per op; target <= 2.5 up to 128 tokens)")
    fi_header = "  FlashInfer: " + " ".join(f"{n:>8}" for n in ("rmsnorm", "gemma", "fused", "gemma_f", "layernrm")) if fi else ""
    print(f"  {'tokens':>6} {'rmsnorm':>8} {'gemma':>8} {'fused':>8} {'gemma_f':>8} {'layernrm':>8} {'torch rms':>9}{fi_header}")
    slowest = 0.0
    for tokens in (1, 8, 32, 128, 256, 512, 1024):
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
        fi_times = [
            graph_latency(lambda: fi["rmsnorm"](x, w, out=out)),
            graph_latency(lambda: fi["gemma_rmsnorm"](x, w, out=out)),
            graph_latency(lambda: fi["fused_add_rmsnorm"](x, r, w)),
            graph_latency(lambda: fi["gemma_fused_add_rmsnorm"](x, r, w)),
            graph_latency(lambda: fi["layernorm"](x, gamma, beta, out=out)),
        ] if fi else []
        fi_text = "              " + " ".join(f"{t * 1e6:8.2f}" for t in fi_times) if fi_times else ""
        slowest = max(slowest, *times) if tokens <= 128 else slowest
        print(f"  {tokens:>6} " + " ".join(f"{t * 1e6:8.2f}" for t in times) + f" {torch_time * 1e6:9.2f}{fi_text}")
    print(f"slowest up to 128 tokens: {slowest * 1e6:.2f} us")


if __name__ == "__main__":
    main()
