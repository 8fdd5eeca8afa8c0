"""Gated activations: bandwidth at prefill sizes, latency at decode sizes, beside torch's eager ops.

    python benchmarks/bench_activation.py

Sizes are tokens x hidden, hidden being d: input [tokens, 2d], output [tokens, d]; bytes = input
read once + output written once. Each row gives ratios to torch's copy_ of the same bytes and to
the streaming limit (2 units read for 1 written by a kernel that does nothing else;
benchmarks/_bandwidth.py), both timed beside the case. Each op is checked against a float64
reference before it is timed. Latency:
GPU time per op from CUDA-graph replays of 20 back-to-back calls.
"""

import torch
import torch.nn.functional as F

import aotinfer
from _bandwidth import bandwidth_row, graph_latency, start


def torch_gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


OPS = [
    ("silu_and_mul", aotinfer.silu_and_mul, F.silu),
    ("gelu_and_mul", aotinfer.gelu_and_mul, F.gelu),
    ("gelu_tanh_and_mul", aotinfer.gelu_tanh_and_mul, torch_gelu_tanh),
]


def check(op, act, x):
    d = x.shape[-1] // 2
    ref = (act(x[:, :d].double()) * x[:, d:].double()).to(x.dtype)
    torch.testing.assert_close(op(x), ref, rtol=2e-2, atol=2e-2)


def main():
    dtype = torch.bfloat16
    copy_bw = start(dtype)
    worst = worst_limit = float("inf")
    for tokens in (4096, 16384):
        for d in (4096, 8192):
            x = torch.randn(tokens, 2 * d, device="cuda", dtype=dtype)
            out = torch.empty(tokens, d, device="cuda", dtype=dtype)
            nbytes = (x.numel() + out.numel()) * x.element_size()
            for name, op, act in OPS:
                check(op, act, x[:64])
                ratio, limit_ratio = bandwidth_row(
                    f"{name} {tokens}x{d}", lambda: op(x, out=out), lambda: act(x[:, :d]) * x[:, d:], nbytes, copy_bw, (2, 1))
                worst = min(worst, ratio)
                worst_limit = min(worst_limit, limit_ratio)
            del x, out
    print(f"lowest ratio to a same-size copy_: {worst:.3f} (target >= 0.90); to the streaming limit: {worst_limit:.3f}")

    print("\nlatency under CUDA-graph replay, d = 4096 (us per op; target <= 2.5)")
    print(f"  {'tokens':>6} {'silu':>8} {'gelu':>8} {'gelu_tanh':>9} {'torch silu*x':>12}")
    slowest = 0.0
    for tokens in (1, 8, 32, 128):
        x = torch.randn(tokens, 8192, device="cuda", dtype=dtype)
        out = torch.empty(tokens, 4096, device="cuda", dtype=dtype)
        times = [graph_latency(lambda op=op: op(x, out=out)) for _, op, _ in OPS]
        torch_time = graph_latency(lambda: F.silu(x[:, :4096]) * x[:, 4096:])
        slowest = max(slowest, *times)
        print(f"  {tokens:>6} " + f"{times[0] * 1e6:8.2f} {times[1] * 1e6:8.2f} {times[2] * 1e6:9.2f} {torch_time * 1e6:12.2f}")
    print(f"slowest: {slowest * 1e6:.2f} us")


if __name__ == "__main__":
    main()
