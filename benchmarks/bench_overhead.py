"""Host time per call of aotinfer.scale on a 256-element tensor, against torch and the raw binding.

    python benchmarks/bench_overhead.py [--calls 200] [--rounds 300]

Four calls, timed in the same run: torch's eager ``torch.mul(x, f, out=y)``; the public
``aotinfer.scale(x, f, out=y)`` with its checks; the same with ``skip_check=True``; and the raw
tvm-ffi function of the loaded module, ``fn(y, x, f)``, fetched once beforehand. Each round times
a batch of calls of each variant in turn (host perf_counter, the GPU synchronized between batches
so the launch queue never fills); the figure is the median over rounds of the time per call.
Budgets: checks on <= 0.7x torch.mul, skip_check <= 1.05x raw. The whole table is measured twice:
before torch._dynamo is imported and after (when aotinfer registers its torch.compile
substitutions), showing that the eager path does not pay for torch.compile support.
"""

import argparse
import importlib
import statistics
import sys
import time

import torch

import aotinfer
from aotinfer import _loader
from aotinfer.testing import copy_bandwidth


def measure(variants, calls, rounds):
    per_call = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            per_call[name].append((time.perf_counter() - start) / calls)
    torch.cuda.synchronize()
    return {name: statistics.median(times) for name, times in per_call.items()}


def table(label, medians):
    torch_t, checked, skipped, raw = (medians[k] for k in ("torch.mul", "checked", "skip_check", "raw"))
    print(f"\n{label}")
    print(f"  torch.mul(x, f, out=y)                      {torch_t * 1e6:7.3f} us")
    print(f"  aotinfer.scale(x, f, out=y)                 {checked * 1e6:7.3f} us   {checked / torch_t:.3f}x torch.mul  (budget <= 0.70)")
    print(f"  aotinfer.scale(x, f, out=y, skip_check=True) {skipped * 1e6:6.3f} us   {skipped / raw:.3f}x raw        (budget <= 1.05)")
    print(f"  raw tvm-ffi fn(y, x, f)                     {raw * 1e6:7.3f} us")
    return checked / torch_t <= 0.70 and skipped / raw <= 1.05


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--dtype", default="float16")
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    x = torch.randn(256, device="cuda", dtype=dtype)
    y = torch.full_like(x, float("nan"))
    f = 1.5
    aotinfer.scale(x, f, out=y)
    assert torch.equal(y, x * f), "scale is wrong: not timing it"
    raw = getattr(_loader.get_module("scale", x.get_device()), "scale")
    variants = {
        "torch.mul": lambda: torch.mul(x, f, out=y),
        "checked": lambda: aotinfer.scale(x, f, out=y),
        "skip_check": lambda: aotinfer.scale(x, f, out=y, skip_check=True),
        "raw": lambda: raw(y, x, f),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}[256], "
          f"{args.calls} calls x {args.rounds} rounds per variant, medians")
    print(f"device-to-device copy bandwidth (this run): {copy_bandwidth() / 1e9:.0f} GB/s")
    for name in variants:  # warm every path
        variants[name]()
    assert "torch._dynamo" not in sys.modules, "run this benchmark in a fresh process"
    ok = table("torch._dynamo not imported:", measure(variants, args.calls, args.rounds))
    importlib.import_module("torch._dynamo")  # aotinfer registers its torch.compile substitutions now

    assert aotinfer._kernels._dynamo_ready or not hasattr(torch.compiler, "substitute_in_graph")
    ok &= table("torch._dynamo imported, substitutions registered:", measure(variants, args.calls, args.rounds))
    print("\nwithin budget" if ok else "\nOVER BUDGET")


if __name__ == "__main__":
    main()
