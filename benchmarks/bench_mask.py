"""Prefill with a custom mask: EAGLE tree verification and a randomly masked prefill, beside the
same kernel's causal prefill and FlashInfer's fa2 with its custom mask, in one process.

    python benchmarks/bench_mask.py [--flashinfer DIR]

* tree: 64 requests x 16 draft tokens, each draft seeing the prefix, its ancestors and itself (a
  random tree), over 4k and 16k keys a request; GQA 32/8, head_dim 128, bf16, pages of 16.
* random: one request of 8192 queries over 8192 keys, each pair seen with probability 1/2, against
  the causal prefill of the same shape on the same kernel: time per attended pair (the masked
  kernel visits every key tile, the causal one only those on or below the diagonal).

Both through BatchPrefillWithPagedKVCacheWrapper, backend "fa2" (the kernel that applies masks).
FlashInfer (``--flashinfer DIR`` and its package importable): its own wrapper, backend "fa2", its
JIT handed the prebuilt module (flashinfer_jit.serve_prebuilt); its ``segment_packbits`` is
aotinfer's (the same bits: FlashInfer's needs a module that is not built), outside the timing.
Outputs are compared with FlashInfer's, and with float32 attention on a few queries. GPU time:
median of CUDA-event timings (aotinfer.testing.bench_gpu_time), warm L2 (the pages are larger
than it).
"""

import argparse
import os
import sys

import torch

import aotinfer
from aotinfer.testing import bench_gpu_time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

QO_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def tree_mask(q_len, kv_len, generator):
    """Draft i sees the prefix, its parent's ancestors, its parent and itself."""
    prefix = kv_len - q_len
    mask = torch.zeros(q_len, kv_len, dtype=torch.bool)
    mask[:, :prefix] = True
    for i in range(q_len):
        if i:
            parent = int(torch.randint(0, i, (1,), generator=generator))
            mask[i, prefix : prefix + i] = mask[parent, prefix : prefix + i]
        mask[i, prefix + i] = True
    return mask


class Batch:
    """A paged batch of requests (q_len, kv_len) with random q, K and V and scattered pages."""

    def __init__(self, pairs, generator):
        self.pairs = pairs
        q_lens, kv_lens = torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])
        pages = (kv_lens + PAGE - 1) // PAGE
        self.qo_indptr = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).int()
        self.kv_indptr = torch.cat([torch.zeros(1, dtype=torch.long), pages.cumsum(0)]).int()
        total = int(self.kv_indptr[-1])
        self.indices = torch.randperm(total, generator=generator).int()
        self.last = (kv_lens - (pages - 1) * PAGE).int()
        self.q = torch.randn(int(q_lens.sum()), QO_HEADS, HEAD_DIM, device="cuda").bfloat16()
        self.cache = (torch.randn(total, PAGE, KV_HEADS, HEAD_DIM, device="cuda").bfloat16(),
                      torch.randn(total, PAGE, KV_HEADS, HEAD_DIM, device="cuda").bfloat16())  # fmt: skip

    def plan(self, wrapper, **options):
        wrapper.plan(self.qo_indptr.cuda(), self.kv_indptr.cuda(), self.indices.cuda(), self.last.cuda(), QO_HEADS, KV_HEADS,
                     HEAD_DIM, PAGE, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, **options)  # fmt: skip

    def reference_rows(self, request, rows, mask):
        """float32 attention of some queries of one request (under its [q_len, kv_len] mask)."""
        q_begin, kv_len = int(self.qo_indptr[request]), self.pairs[request][1]
        ids = self.indices[int(self.kv_indptr[request]) : int(self.kv_indptr[request + 1])].long().cuda()
        k, v = (c[ids].reshape(-1, KV_HEADS, HEAD_DIM)[:kv_len].float().repeat_interleave(QO_HEADS // KV_HEADS, 1) for c in self.cache)
        logits = torch.einsum("qhd,khd->hqk", self.q[q_begin + rows].float(), k) / HEAD_DIM**0.5
        logits = logits.masked_fill(~mask[rows].cuda(), float("-inf"))
        return torch.einsum("hqk,khd->qhd", torch.softmax(logits, -1).nan_to_num(0.0), v)


def timed(batch, wrapper):
    return bench_gpu_time(lambda: wrapper.run(batch.q, batch.cache), cold_l2_cache=False)[0]


def flashinfer_wrapper(directory):
    import flashinfer
    import flashinfer.prefill
    from flashinfer_jit import serve_prebuilt

    serve_prebuilt(directory)
    flashinfer.prefill.segment_packbits = aotinfer.segment_packbits
    return flashinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), "NHD",
                                                          backend="fa2")  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flashinfer", metavar="DIR", help="FlashInfer's prefill module (flashinfer_jit.py build)")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    ours = aotinfer.BatchPrefillWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), "NHD",
                                                        backend="fa2")  # fmt: skip
    theirs = flashinfer_wrapper(args.flashinfer) if args.flashinfer else None
    print(f"# Custom-mask prefill, {torch.cuda.get_device_name()}, GQA {QO_HEADS}/{KV_HEADS}, head_dim {HEAD_DIM}, bf16, page {PAGE}\n")
    print("| case | aotinfer us | TFLOP/s | FlashInfer fa2 us | TFLOP/s | FlashInfer / aotinfer time | max diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")

    def row(name, batch, masks, options):
        flat = torch.cat([m.reshape(-1) for m in masks]).cuda()
        attended = int(flat.sum())
        batch.plan(ours, custom_mask=flat, **options)
        out = ours.run(batch.q, batch.cache)
        for request in (0, len(masks) - 1):  # a few queries against float32 attention
            rows = torch.arange(0, batch.pairs[request][0], max(1, batch.pairs[request][0] // 8))
            got = out[int(batch.qo_indptr[request]) + rows].float()
            err = (got - batch.reference_rows(request, rows, masks[request])).abs().max().item()
            assert err < 0.05, f"{name}: {err} from float32 attention"
        t = timed(batch, ours)
        flops = 4 * QO_HEADS * HEAD_DIM * attended
        cells = [f"{t * 1e6:.1f}", f"{flops / t / 1e12:.0f}"]
        if theirs is not None:
            batch.plan(theirs, custom_mask=flat, **options)
            diff = (theirs.run(batch.q, batch.cache).float() - out.float()).abs().max().item()
            t_fi = timed(batch, theirs)
            cells += [f"{t_fi * 1e6:.1f}", f"{flops / t_fi / 1e12:.0f}", f"{t_fi / t:.2f}", f"{diff:.3g}"]
        else:
            cells += ["-"] * 4
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
        return t, attended

    for context in (4096, 16384):
        pairs = [(16, context)] * 64
        batch = Batch(pairs, generator)
        row(f"tree, 64 x 16 drafts over {context} keys", batch, [tree_mask(16, context, generator) for _ in pairs], {})
        del batch

    n = 8192
    batch = Batch([(n, n)], generator)
    masked_t, masked_pairs = row(f"random 1/2, {n} x {n}", batch, [torch.rand(n, n, generator=generator) < 0.5], {})
    batch.plan(ours, causal=True)
    causal_t = timed(batch, ours)
    causal_pairs = n * (n + 1) // 2
    per_masked, per_causal = masked_t / masked_pairs, causal_t / causal_pairs
    print(f"\ncausal {n} x {n} on the same kernel: {causal_t * 1e6:.1f} us, "
          f"{4 * QO_HEADS * HEAD_DIM * causal_pairs / causal_t / 1e12:.0f} TFLOP/s; time per attended pair, masked / causal: "
          f"{per_masked / per_causal:.2f}; per pair computed (every tile masked, half of them causal): "
          f"{masked_t / (n * n) / (causal_t / causal_pairs):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
