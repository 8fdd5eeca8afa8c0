"""Host time per call of aotinfer.scale on a 256-element tensor, against torch and the raw binding.

    python benchmarks/bench_overhead.py [--calls 200] [--rounds 300] [--before CHECKOUT/python]

Variants, timed in the same run: torch's eager ``torch.mul(x, f, out=y)``; the public
``aotinfer.scale(x, f, out=y)`` with its checks; the same with ``skip_check=True``; and the raw
tvm-ffi function of the loaded module, ``fn(y, x, f, -1)``, fetched once beforehand. ``--before``
adds the checked and skip_check calls of another checkout's aotinfer (its python/ folder, with
kernels built or copied into its aotinfer/_ops), imported as a second package, so that a change
of the op layer is measured before and after in one process.

Each round times a batch of calls of each variant in turn (host perf_counter, the GPU synchronized
between batches so the launch queue never fills), on one CPU core; ratios are taken within each
round and the figure is their median over rounds. Budgets: checks on <= 0.7x torch.mul,
skip_check <= 1.05x raw.
"""

import argparse
import os
import statistics
import time

import torch

import aotinfer
from aotinfer import _loader
from aotinfer.testing import copy_bandwidth


def measure(variants, calls, rounds, sleep_cycles=0):
    """{name: [host seconds per call, a round]}; with ``sleep_cycles``, each batch is issued behind
    a GPU sleep of that many cycles, so that no launch waits for the GPU (calls that launch work)."""
    per_call = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            torch.cuda.synchronize()
            if sleep_cycles:
                torch.cuda._sleep(sleep_cycles)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            per_call[name].append((time.perf_counter() - start) / calls)
    torch.cuda.synchronize()
    return per_call


def import_other(python_dir):
    """The aotinfer package of another checkout, as module ``aotinfer_before``."""
    import importlib.util
    import sys

    path = os.path.join(python_dir, "aotinfer")
    spec = importlib.util.spec_from_file_location("aotinfer_before", os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    module = importlib.util.module_from_spec(spec)
    sys.modules["aotinfer_before"] = module
    spec.loader.exec_module(module)
    return module


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--before", help="another checkout's python/ folder, timed beside this one")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

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
        "raw": lambda: raw(y, x, f, -1),
    }
    if args.before:
        before = import_other(args.before)
        before.scale(x, f, out=y)
        assert torch.equal(y, x * f), "the other checkout's scale is wrong: not timing it"
        variants["before: checked"] = lambda: before.scale(x, f, out=y)
        variants["before: skip_check"] = lambda: before.scale(x, f, out=y, skip_check=True)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}[256], "
          f"{args.calls} calls x {args.rounds} rounds per variant, medians of per-round ratios")
    print(f"device-to-device copy bandwidth (this run): {copy_bandwidth() / 1e9:.0f} GB/s")
    for fn in variants.values():  # warm every path
        fn()
    times = measure(variants, args.calls, args.rounds)

    def ratio(a, b):
        return statistics.median(ta / tb for ta, tb in zip(times[a], times[b]))

    def us(name):
        return statistics.median(times[name]) * 1e6

    checked, skipped = ratio("checked", "torch.mul"), ratio("skip_check", "raw")
    print(f"  torch.mul(x, f, out=y)                        {us('torch.mul'):7.3f} us")
    print(f"  aotinfer.scale(x, f, out=y)                   {us('checked'):7.3f} us   {checked:.3f}x torch.mul  (budget <= 0.70)")
    print(f"  aotinfer.scale(x, f, out=y, skip_check=True)  {us('skip_check'):7.3f} us   {skipped:.3f}x raw        (budget <= 1.05)")
    if args.before:
        print(f"    before: checked                             {us('before: checked'):7.3f} us   "
              f"{ratio('before: checked', 'torch.mul'):.3f}x torch.mul")
        print(f"    before: skip_check                          {us('before: skip_check'):7.3f} us   "
              f"{ratio('before: skip_check', 'raw'):.3f}x raw")
    print(f"  raw tvm-ffi fn(y, x, f, -1)                   {us('raw'):7.3f} us")
    print("\nwithin budget" if checked <= 0.70 and skipped <= 1.05 else "\nOVER BUDGET")


if __name__ == "__main__":
    main()
