"""Host time per decode ``run`` with and without the capture guard (docs/design/overlay.md#capture-guard).

    python benchmarks/capture_guard_probe.py --before CHECKOUT/python [--calls 200] [--rounds 200]

One decode step of batch 1 x 64 tokens, issued ``--calls`` times a batch behind a GPU sleep of
``--sleep-ms`` (torch.cuda._sleep), so that no launch waits for the GPU and the figure is the
host's time alone; the GPU is synchronized between batches. Variants, in turn within each round: this
checkout's wrapper made without ``use_cuda_graph`` (its runs pass the host byte the binding sets
under capture), the same passing no byte (the guard's cost is the difference), the same made with
``use_cuda_graph=True`` (no byte), and ``--before``'s wrapper
without ``use_cuda_graph`` (imported as a second package, as bench_overhead.py does). Prints the
median per call of each, and the medians of the per-round ratios to ``before``.
"""

import argparse
import statistics
import sys

import torch

import aotinfer

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_overhead import import_other, measure  # noqa: E402


def decode_step(lib, graph: bool, unguarded: bool = False):
    """A planned wrapper of ``lib`` and its run, over 4 pages of 16 tokens; ``unguarded``: its runs
    pass no byte (the capture guard's cost alone, beside the guarded wrapper)."""
    page_size, heads, dim = 16, (32, 8), 128
    cache = torch.randn(8, 2, page_size, heads[1], dim, device="cuda", dtype=torch.float16)
    indptr = torch.tensor([0, 4], dtype=torch.int32, device="cuda")
    indices = torch.arange(4, dtype=torch.int32, device="cuda")
    last = torch.tensor([page_size], dtype=torch.int32, device="cuda")
    workspace = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
    buffers = {}
    if graph:
        buffers = dict(paged_kv_indptr_buffer=indptr.clone(), paged_kv_indices_buffer=indices.clone(),
                       paged_kv_last_page_len_buffer=last.clone())
    wrapper = lib.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_cuda_graph=graph, **buffers)
    wrapper.plan(indptr, indices, last, *heads, dim, page_size, q_data_type=torch.float16)
    if unguarded:
        wrapper._captured_address = 0
    q = torch.randn(1, heads[0], dim, device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    return lambda: wrapper.run(q, cache, out=out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--sleep-ms", type=float, default=20.0)
    args = parser.parse_args()
    before = import_other(args.before)
    variants = {
        "guarded (no use_cuda_graph)": decode_step(aotinfer, graph=False),
        "unguarded (address 0)": decode_step(aotinfer, graph=False, unguarded=True),
        "use_cuda_graph (no byte)": decode_step(aotinfer, graph=True),
        "before (no use_cuda_graph)": decode_step(before, graph=False),
    }
    for fn in variants.values():  # warm-up
        for _ in range(50):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1 << 24)
    end.record()
    torch.cuda.synchronize()
    cycles_per_ms = (1 << 24) / start.elapsed_time(end)
    per_call = measure(variants, args.calls, args.rounds, int(args.sleep_ms * cycles_per_ms))
    print(f"{torch.cuda.get_device_name()}: host us per run, median of {args.rounds} rounds x {args.calls} calls")
    base = per_call["before (no use_cuda_graph)"]
    for name, times in per_call.items():
        ratios = [t / b for t, b in zip(times, base)]
        print(f"  {name:30s} {statistics.median(times) * 1e6:7.3f} us   / before: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
