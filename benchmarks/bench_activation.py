"""Gated activations: bandwidth at prefill sizes, latency at decode sizes, beside torch's eager ops.

    python benchmarks/bench_activation.py

Sizes are tokens x hidden, hidden being d: input [tokens, 2d], output [tokens, d]; bytes = input
read once + output written once. Each row gives ratios to torch's copy_ of the same bytes and to
the streaming limit (2 units read for 1 written by a kernel that does nothing else;
benchmarks/_bandwidth.py), both timed beside the case. Each op is checked against a float64
reference before it is timed. Latency:
GPU time per op from CUDA-graph replays of 20 back-to-back calls. With
AOTINFER_BENCH_FLASHINFER_INCLUDE set (benchmarks/_bandwidth.py), FlashInfer's kernels are checked
and timed beside ours in both tables.
"""

import torch
import torch.nn.functional as F

import aotinfer
from _bandwidth import bandwidth_row, flashinfer_baseline, flashinfer_call, graph_latency, start


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


def flashinfer_op(fi, name):
    """FlashInfer's kernel for op `name` as op(x, out=None), PDL on as its Python API sets it on
    sm90+; None without the baseline."""
    if fi is None:
        return None
    kernel = getattr(fi, f"fi_{name}")

    def op(x, out=None):
        out = torch.full((*x.shape[:-1], x.shape[-1] // 2), float("nan"), device=x.device, dtype=x.dtype) if out is None else out
        flashinfer_call(kernel, out.data_ptr(), x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1] // 2, 1)
        return out

    return op


def main():
    dtype = torch.bfloat16
    copy_bw = start(dtype)
    fi = flashinfer_baseline()
    fi_ops = [flashinfer_op(fi, name) for name, _, _ in OPS]
    worst = worst_limit = worst_fi = float("inf")
    for tokens in (4096, 16384):
        for d in (4096, 8192):
            x = torch.randn(tokens, 2 * d, device="cuda", dtype=dtype)
            out = torch.empty(tokens, d, device="cuda", dtype=dtype)
            nbytes = (x.numel() + out.numel()) * x.element_size()
            for (name, op, act), fi_op in zip(OPS, fi_ops):
                check(op, act, x[:64])
                if fi_op is not None:
                    check(fi_op, act, x[:64])
                ratio, limit_ratio, vs_fi = bandwidth_row(
                    f"{name} {tokens}x{d}", lambda: op(x, out=out), lambda: act(x[:, :d]) * x[:, d:], nbytes, copy_bw, (2, 1),
                    flashinfer=None if fi_op is None else lambda: fi_op(x, out=out))
                worst = min(worst, ratio)
                worst_limit = min(worst_limit, limit_ratio)
                worst_fi = min(worst_fi, vs_fi or worst_fi)
            del x, out
    print(f"lowest ratio to a same-size copy_: {worst:.3f} (target >= 0.90); to the streaming limit: {worst_limit:.3f}")
    if fi is not None:
        print(f"lowest FlashInfer time / ours: {worst_fi:.3f} (>= 1: ours as fast or faster at every row)")

    print("\nlatency under CUDA-graph replay, d = 4096 (us per op; target <= 2.5 up to 128 tokens)")
    fi_header = f" {'FI silu':>8} {'FI gelu':>8} {'FI gelu_t':>9}" if fi is not None else ""
    print(f"  {'tokens':>6} {'silu':>8} {'gelu':>8} {'gelu_tanh':>9} {'torch silu*x':>12}{fi_header}")
    slowest = 0.0
    for tokens in (1, 8, 32, 128, 256, 512, 1024):
        x = torch.randn(tokens, 8192, device="cuda", dtype=dtype)
        out = torch.empty(tokens, 4096, device="cuda", dtype=dtype)
        times = [graph_latency(lambda op=op: op(x, out=out)) for _, op, _ in OPS]
        torch_time = graph_latency(lambda: F.silu(x[:, :4096]) * x[:, 4096:])
        fi_times = [graph_latency(lambda fi_op=fi_op: fi_op(x, out=out)) for fi_op in fi_ops] if fi is not None else []
        slowest = max(slowest, *times) if tokens <= 128 else slowest
        fi_text = f" {fi_times[0] * 1e6:8.2f} {fi_times[1] * 1e6:8.2f} {fi_times[2] * 1e6:9.2f}" if fi_times else ""
        print(f"  {tokens:>6} " + f"{times[0] * 1e6:8.2f} {times[1] * 1e6:8.2f} {times[2] * 1e6:9.2f} {torch_time * 1e6:12.2f}"
              + fi_text)
    print(f"slowest up to 128 tokens: {slowest * 1e6:.2f} us")


if __name__ == "__main__":
    main()
