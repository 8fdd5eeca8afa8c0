"""Host time of the decode plan a serving loop makes every step, against FlashInfer's, in one process.

    python benchmarks/bench_plan.py [--rounds 30] [--before CHECKOUT/python] [--flashinfer DIR]

Shapes: Llama-3-8B's attention (32 query / 8 KV heads, head_dim 128, bf16, page_size 16), batches
of 1, 64 and 256 requests of 2048 tokens and 64 of 16384, the page table (int32 indptr, indices,
last_page_len) on the host (pinned) or on the GPU. Variants:

* aotinfer: ``BatchDecodeWithPagedKVCacheWrapper.plan`` with ``use_cuda_graph=True`` buffers, as
  vLLM and SGLang plan; ``--before``: the same of another checkout's aotinfer (its python/ folder
  with kernels in aotinfer/_ops), imported as a second package.
* flashinfer (``--flashinfer DIR``: the decode module of benchmarks/flashinfer_jit.py): what its
  wrapper's plan does under ``use_cuda_graph`` on the CUDA-core path, its Python checks left
  out: ``indptr`` to the host, the three copies into the graph buffers, then its compiled plan.
  A lower bound of its wrapper's time.
* flashinfer wrapper (``--flashinfer DIR`` where ``import flashinfer`` works): its own
  ``BatchDecodeWithPagedKVCacheWrapper.plan`` with the same buffers, its JIT handed the module in
  DIR (the machine that times it need not compile).

Then the paged prefill plan of a ragged batch (64 prompts of 650-1950 tokens, causal): aotinfer's
with ``backend="fa2"`` and ``"auto"``, and FlashInfer's fa2 wrapper where DIR holds its prefill
module (``prefill_fa2_d128``).

The machine that times it needs FlashInfer's Python package but not its compiler: the package
without ``data/``, ``experimental/b12x`` and ``experimental/cake_vsa_sm90_cute`` (whose imports are
lazy) imports, and its JIT reads only the templates and sources of the two modules from
``data/csrc`` (``batch_decode*``, ``batch_prefill*``) before it is handed the built ones: about
11 MB compressed, with its pure-Python dependencies (nvidia-ml-py, tqdm).

Each round plans every variant once, the order rotating between rounds; a sample is the host
time of one plan after a synchronize (the GPU idle, as between serving steps). The table gives
medians over rounds, and each variant's ratio to flashinfer's (or to aotinfer's).
"""

import argparse
import os
import statistics
import sys
import time

import torch

import aotinfer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flashinfer_jit import serve_prebuilt  # noqa: E402

QO_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
CASES = [(1, 2048), (64, 2048), (256, 2048), (64, 16384)]


def page_table(batch, tokens, on_gpu):
    pages = -(-tokens // PAGE)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages
    indices = torch.randperm(batch * pages, dtype=torch.int32)
    last = torch.full((batch,), tokens - (pages - 1) * PAGE, dtype=torch.int32)
    if on_gpu:
        return [t.cuda() for t in (indptr, indices, last)]
    return [t.pin_memory() for t in (indptr, indices, last)]


def graph_buffers(batch, num_indices):
    return dict(
        use_cuda_graph=True,
        paged_kv_indptr_buffer=torch.empty(batch + 1, dtype=torch.int32, device="cuda"),
        paged_kv_indices_buffer=torch.empty(num_indices, dtype=torch.int32, device="cuda"),
        paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32, device="cuda"),
    )


def aotinfer_plan(package, batch, tables):
    indptr, indices, last = tables
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = package.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", **graph_buffers(batch, indices.numel()))
    return lambda: wrapper.plan(indptr, indices, last, QO_HEADS, KV_HEADS, HEAD_DIM, PAGE, q_data_type=torch.bfloat16)


def flashinfer_plan(module, batch, tables):
    indptr, indices, last = tables
    buffers = graph_buffers(batch, indices.numel())
    indptr_buf, indices_buf, last_buf = (buffers[k] for k in ("paged_kv_indptr_buffer", "paged_kv_indices_buffer",
                                                                "paged_kv_last_page_len_buffer"))
    float_ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    int_ws = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
    pinned_ws = torch.empty(8 << 20, dtype=torch.uint8, pin_memory=True)
    empty = torch.empty(0, dtype=torch.bfloat16)

    def plan():
        indptr_host = indptr.to("cpu")
        indptr_buf.copy_(indptr, non_blocking=True)
        last_buf.copy_(last, non_blocking=True)
        indices_buf[: indices.numel()].copy_(indices, non_blocking=True)
        module.plan(float_ws, int_ws, pinned_ws, indptr_host, batch, QO_HEADS, KV_HEADS, PAGE, True, -1, 0.0,
                    HEAD_DIM, HEAD_DIM, empty, empty)  # fmt: skip

    return plan


def flashinfer_wrapper_plan(directory, batch, tables):
    import flashinfer

    serve_prebuilt(directory)
    indptr, indices, last = tables
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", **graph_buffers(batch, indices.numel()))
    return lambda: wrapper.plan(indptr, indices, last, QO_HEADS, KV_HEADS, HEAD_DIM, PAGE, q_data_type=torch.bfloat16,
                                kv_data_type=torch.bfloat16)


def prefill_tables(batch=64, mean=1300):
    """A ragged prefill batch as the issue measured it: prompts of mean/2..3*mean/2 tokens, pages of
    PAGE, the tables pinned on the host."""
    generator = torch.Generator().manual_seed(0)
    q_len = torch.randint(mean // 2, mean * 3 // 2 + 1, (batch,), generator=generator, dtype=torch.int32)
    qo_indptr = torch.cat([torch.zeros(1, dtype=torch.int32), q_len.cumsum(0).to(torch.int32)])
    pages = (q_len + PAGE - 1) // PAGE
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int32), pages.cumsum(0).to(torch.int32)])
    indices = torch.randperm(int(kv_indptr[-1]), dtype=torch.int32)
    last = (q_len - (pages - 1) * PAGE).to(torch.int32)
    return [t.pin_memory() for t in (qo_indptr, kv_indptr, indices, last)]


def prefill_plan(package, tables, backend, flashinfer_dir=None):
    """The paged prefill wrapper's plan, causal (aotinfer's, or FlashInfer's own with its JIT
    handed the module in flashinfer_dir)."""
    if flashinfer_dir is not None:
        serve_prebuilt(flashinfer_dir)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = package.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
    return lambda: wrapper.plan(*tables, QO_HEADS, KV_HEADS, HEAD_DIM, PAGE, causal=True, q_data_type=torch.bfloat16,
                                kv_data_type=torch.bfloat16)


def time_rounds(variants, rounds):
    samples = {name: [] for name in variants}
    names = list(variants)
    for fn in variants.values():  # warm-up: loads, device properties, first allocations
        for _ in range(3):
            fn()
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            torch.cuda.synchronize()
            begin = time.perf_counter()
            variants[name]()
            samples[name].append(time.perf_counter() - begin)
    torch.cuda.synchronize()
    return {name: statistics.median(s) * 1e6 for name, s in samples.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--before", help="another checkout's python/ folder, timed beside this one")
    parser.add_argument("--flashinfer", metavar="DIR", help="FlashInfer's decode module (flashinfer_jit.py build)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    packages = {"aotinfer": aotinfer}
    if args.before:
        from bench_overhead import import_other

        packages["before"] = import_other(args.before)
    module = None
    if args.flashinfer:
        from flashinfer_jit import _load

        module = _load(args.flashinfer, "decode_d128")
        if module is None:
            raise SystemExit(f"no FlashInfer decode module in {args.flashinfer}")

    import importlib.util

    wrapper = module is not None and importlib.util.find_spec("flashinfer") is not None

    print(f"# Decode plan host time, us (median of {args.rounds}), {torch.cuda.get_device_name()}")
    names = list(packages) + (["flashinfer"] if module is not None else []) + (["flashinfer wrapper"] if wrapper else [])
    base = "flashinfer wrapper" if wrapper else "flashinfer" if module is not None else "aotinfer"
    print("| tables | batch x tokens | " + " | ".join(names) + " | " + " | ".join(f"{n} / {base}" for n in names if n != base) + " |")
    print("| --- | --- |" + " --- |" * (2 * len(names) - 1))
    for on_gpu in (False, True):
        for batch, tokens in CASES:
            tables = page_table(batch, tokens, on_gpu)
            variants = {name: aotinfer_plan(package, batch, tables) for name, package in packages.items()}
            if module is not None:
                variants["flashinfer"] = flashinfer_plan(module, batch, tables)
            if wrapper:
                variants["flashinfer wrapper"] = flashinfer_wrapper_plan(args.flashinfer, batch, tables)
            us = time_rounds(variants, args.rounds)
            cells = [f"{us[n]:.0f}" for n in names] + [f"{us[n] / us[base]:.2f}" for n in names if n != base]
            print(f"| {'GPU' if on_gpu else 'host'} | {batch} x {tokens} | " + " | ".join(cells) + " |", flush=True)

    # The paged prefill plan: 64 prompts of 650-1950 tokens, causal.
    tables = prefill_tables()
    variants = {f"aotinfer {backend}": prefill_plan(aotinfer, tables, backend) for backend in ("fa2", "auto")}
    if wrapper and os.path.exists(os.path.join(args.flashinfer, "prefill_fa2_d128.so")):
        import flashinfer

        variants["flashinfer wrapper fa2"] = prefill_plan(flashinfer, tables, "fa2", args.flashinfer)
    us = time_rounds(variants, max(args.rounds // 3, 5))
    base = "flashinfer wrapper fa2" if "flashinfer wrapper fa2" in us else "aotinfer fa2"
    print(f"\n# Paged prefill plan host time, us, {len(tables[3])} x {int(tables[0][-1])} tokens, causal")
    print("| variant | us | / " + base + " |\n| --- | --- | --- |")
    for name, value in us.items():
        print(f"| {name} | {value:.0f} | {value / us[base]:.2f} |")


if __name__ == "__main__":
    main()
