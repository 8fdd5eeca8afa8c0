"""MLA decode (BatchMLAPagedAttentionWrapper): time, bandwidth and TFLOP/s beside FlashInfer's MLA
kernels, torch's copy_ of the same bytes and the GPU's dense bf16 matmul rate, all in one run.

    python benchmarks/bench_mla.py [--batches 1,16,64,128] [--contexts 4096,32768] [--heads 128]
                                   [--page-size 64] [--q-len 1] [--flashinfer DIR]

Each request has the same context, its pages scattered over the pool; bf16 q and latent cache
(512 + 64 dims a token). Bandwidth = the latent bytes read once (tokens x 1152) / time, beside
copy_ moving the same bytes (half read, half written); TFLOP/s = 2 x rows x keys x (576 + 512)
/ time, beside torch.mm's rate on 8192^3 bf16. Times are medians of CUDA-event timings after
warm-up, with the L2 flushed between calls (aotinfer.testing). With --flashinfer (modules built
by benchmarks/flashinfer_jit.py, FlashInfer's package importable), FlashInfer's own wrapper runs
its "fa2" and "fa3" kernels on the same inputs; its output is checked against ours.
"""

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import aotinfer  # noqa: E402
from _bandwidth import gbps, same_size_copy  # noqa: E402
from aotinfer.testing import bench_gpu_time  # noqa: E402

LATENT, ROPE = 512, 64
SM_SCALE = 1 / math.sqrt(192)


def dense_rate():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t, _ = bench_gpu_time(torch.mm, args=(a, b), cold_l2_cache=False)
    return 2 * 8192**3 / t / 1e12


class Inputs:
    def __init__(self, batch, context, heads, page_size, q_len):
        pages = -(-context // page_size)
        pool = batch * pages
        self.qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * q_len
        self.kv_indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pages
        self.kv_indices = torch.randperm(pool, device="cuda").to(torch.int32)
        self.kv_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        self.q_nope = torch.randn(batch * q_len, heads, LATENT, device="cuda", dtype=torch.bfloat16)
        self.q_pe = torch.randn(batch * q_len, heads, ROPE, device="cuda", dtype=torch.bfloat16)
        self.ckv = torch.randn(pool, page_size, LATENT, device="cuda", dtype=torch.bfloat16)
        self.kpe = torch.randn(pool, page_size, ROPE, device="cuda", dtype=torch.bfloat16)
        self.heads, self.page_size, self.causal = heads, page_size, q_len > 1

    def plan(self, wrapper):
        wrapper.plan(self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_lens, self.heads, LATENT, ROPE, self.page_size,
                     self.causal, SM_SCALE, torch.bfloat16, torch.bfloat16)  # fmt: skip


def flashinfer_runs(inputs, directory):
    """FlashInfer's wrapper on each of its backends that builds and plans here: name -> run."""
    import flashinfer
    import tvm_ffi
    from flashinfer.jit.attention.modules import _BatchMLAModuleProxy
    from flashinfer.mla._batch_mla._backends import fa2_backend, fa3_backend

    # Its backends load their module through get_batch_mla_module (the JIT build and its sources):
    # the prebuilt module of the backend instead, behind the proxy FlashInfer's loader puts on it.
    for backend_module, name in ((fa2_backend, "mla_fa2"), (fa3_backend, "mla_fa3")):
        path = os.path.join(directory, name + ".so")
        backend_module.get_batch_mla_module = lambda *args, path=path: _BatchMLAModuleProxy(tvm_ffi.load_module(path))
    runs = {}
    for backend in ("fa2", "fa3"):
        try:
            wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"),
                                                                   backend=backend)  # fmt: skip
            inputs.plan(wrapper)
            out = torch.empty_like(inputs.q_nope)
            run = lambda w=wrapper, o=out: w.run(inputs.q_nope, inputs.q_pe, inputs.ckv, inputs.kpe, out=o)  # noqa: E731
            run()
            runs[f"FI {backend}"] = (run, out)
        except Exception as e:  # a backend this build or GPU lacks
            print(f"  (FlashInfer {backend}: {type(e).__name__}: {str(e)[:120]})")
    return runs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,64,128")
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--q-len", type=int, default=1)
    parser.add_argument("--flashinfer", metavar="DIR", help="FlashInfer's modules (flashinfer_jit.py build)")
    args = parser.parse_args()
    dense = dense_rate()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, aotinfer {aotinfer.__version__}; "
          f"dense bf16 matmul {dense:.0f} TFLOP/s; {args.heads} heads, page {args.page_size}, q_len {args.q_len}")  # fmt: skip
    print("| batch x context | library | time us | GB/s | / copy_ | TFLOP/s | / dense | FI / ours |")
    print("|---|---|---|---|---|---|---|---|")
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            inputs = Inputs(batch, context, args.heads, args.page_size, args.q_len)
            nbytes = batch * context * (LATENT + ROPE) * 2
            flops = 2 * batch * args.q_len * args.heads * context * (LATENT + ROPE + LATENT)
            copy = same_size_copy(nbytes)
            wrapper = aotinfer.BatchMLAPagedAttentionWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
            inputs.plan(wrapper)
            out = torch.full_like(inputs.q_nope, float("nan"))
            runs = {"aotinfer": (lambda: wrapper.run(inputs.q_nope, inputs.q_pe, inputs.ckv, inputs.kpe, out=out), out)}
            if args.flashinfer:
                runs.update(flashinfer_runs(inputs, args.flashinfer))
            runs["aotinfer"][0]()
            ours = None
            for name, (run, result) in runs.items():
                if name != "aotinfer":
                    torch.testing.assert_close(result.float(), out.float(), rtol=2e-2, atol=2e-2)
                t, _ = bench_gpu_time(run)
                ours = t if name == "aotinfer" else ours
                rate = gbps(nbytes, t)
                print(f"| {batch} x {context} | {name} | {t * 1e6:.1f} | {rate:.0f} | {rate / copy:.3f} | "
                      f"{flops / t / 1e12:.1f} | {flops / t / 1e12 / dense:.3f} | "
                      f"{'' if name == 'aotinfer' else f'{t / ours:.2f}'} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
