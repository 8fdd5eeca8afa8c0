"""Decode experiments for one device run (not a shipped benchmark; docs/design/decode.md; benchmarks/log/NOTES.md, "Paged
decode attention", has what they showed).

    python benchmarks/decode_probe.py sweep [CTAS ...]   the split policy: ratio to copy (and us)
                                                         with the plan aiming at CTAS blocks an SM
    python benchmarks/decode_probe.py latency            warm-L2 step time, graph replay and plain
                                                         launches, with and without PDL
    python benchmarks/decode_probe.py once BATCH KV_LEN  one plan and a few runs (for ncu)
    python benchmarks/decode_probe.py parts [MIN_CHUNK ...]  short requests at small batches: cold-L2
                                                         and warm graph-replay us with the plan's
                                                         smallest chunk at each MIN_CHUNK (the
                                                         parts a request: over 4 take a merge launch)
    python benchmarks/decode_probe.py readonce           the K and V copies' L2 policy: ratio to copy (and
                                                         us) with the plan's kv_read_once forced to 0 and 1,
                                                         steps of 34 MB to 1 GB, and the plan's own choice

PROBE_SHAPES=split|main|all picks the sweep's shapes; PROBE_FLUSH=read makes the cold-L2 flush a
read of the flush buffer instead of bench_gpu_time's fill, so that no dirty lines are left for the
timed kernel to write back (a read-only kernel otherwise pays for the fill's write-back; a copy
hides part of it behind its own writes).
"""
import os
import sys

import torch

import aotinfer
from aotinfer import _attention, decode
from bench_decode import paged_case, reference, WORKSPACE
from _bandwidth import gbps, same_size_copy
from aotinfer.testing import bench_gpu_time


def case(batch, kv_len, qo=32, kv=8, kv_dtype=torch.bfloat16, k_scale=None, v_scale=None, check=True):
    q, cache, indptr, indices, last = paged_case(batch, kv_len, qo, kv, kv_dtype=kv_dtype)
    ws = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
    w = aotinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(indptr, indices, last, qo, kv, 128, 16, q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
    out = torch.empty_like(q)
    run = lambda: w.run(q, cache, out=out, k_scale=k_scale, v_scale=v_scale)  # noqa: E731
    w._probe_args, w._probe_cache = (q, out), cache
    out.fill_(float("nan"))
    run()
    if check:
        n = min(batch, 2)
        want = reference(q[:n], cache, indptr, indices, last, k_scale or 1.0, v_scale or 1.0)
        torch.testing.assert_close(out[:n].float(), want, rtol=2e-2, atol=2e-2)
    nbytes = 2 * batch * kv_len * kv * 128 * cache[0].element_size() + 2 * q.numel() * q.element_size()
    return run, nbytes, w


SHAPES = {
    "split": [(1, 1024), (16, 1024), (16, 2048), (16, 8192), (64, 2048), (1, 32768), (4, 65536)],
    "main": [(1, 1024), (16, 1024), (16, 2048), (16, 8192), (64, 2048), (64, 8192), (256, 2048), (1, 32768), (4, 65536),
             "fp8"],
    "all": [(1, 1024), (16, 1024), (16, 2048), (16, 8192), (64, 2048), (64, 8192), (256, 2048), (256, 8192), (1, 32768),
            (4, 65536), "fp8"],
}
if os.environ.get("PROBE_FLUSH") == "read":  # a cold L2 that leaves no dirty lines behind: read the buffer, write nothing
    from aotinfer import testing

    def _read_flush(self):
        if self.buffer is not None:
            self.buffer.view(torch.int64).sum()

    testing._L2Flush.__call__ = _read_flush


if os.environ.get("PROBE_MIN_CHUNK"):
    _attention.MIN_CHUNK = int(os.environ["PROBE_MIN_CHUNK"])


def sweep(ctas_list):
    shapes = SHAPES[os.environ.get("PROBE_SHAPES", "split")]
    print("ratio to copy; columns: plan's blocks-an-SM target")
    print(f"{'shape':>10} " + " ".join(f"{c:>12}" for c in ctas_list))
    for shape in shapes:
        batch, kv_len = (64, 4096) if shape == "fp8" else shape
        fp8 = dict(kv_dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=2.0) if shape == "fp8" else {}
        cells = []
        for ctas in ctas_list:
            if ctas != "d":  # "d": the plan's own policy
                decode.target_items.__defaults__ = (ctas,)
            run, nbytes, w = case(batch, kv_len, **fp8)
            t, _ = bench_gpu_time(run)
            copy = same_size_copy(nbytes)
            cells.append(f"{gbps(nbytes, t) / copy:6.3f}({t * 1e6:4.1f})")
        print(f"{'fp8 ' if fp8 else ''}{batch:>4}x{kv_len:<6}" + " ".join(f"{c:>12}" for c in cells), flush=True)
    decode.target_items.__defaults__ = (decode._CTAS_PER_SM,)


def latency_probe():
    """Warm-L2 step latency (graph replay and plain back-to-back launches), with and without PDL."""
    for batch, kv_len in [(1, 1024), (16, 2048), (1, 32768)]:
        run, _, w = case(batch, kv_len, check=False)
        cells = []
        for pdl in (None, False):
            q, out = w._probe_args
            fn = lambda: w.run(q, w._probe_cache, out=out, enable_pdl=pdl)  # noqa: E731
            g, _ = bench_gpu_time(fn, use_cuda_graph=True, cold_l2_cache=False)
            e, _ = bench_gpu_time(fn, cold_l2_cache=False)
            cells.append(f"pdl={pdl}: graph {g * 1e6:6.2f} events {e * 1e6:6.2f}")
        print(f"{batch:>4}x{kv_len:<6} " + " | ".join(cells), flush=True)


def parts_probe(min_chunks):
    default_min_chunk = _attention.MIN_CHUNK
    print("us, cold L2 / warm graph replay (parts a request); columns: the plan's smallest chunk")
    print(f"{'shape':>10} " + " ".join(f"{c:>22}" for c in min_chunks))
    for batch, kv_len in [(1, 512), (1, 1024), (1, 2048), (1, 4096), (2, 1024), (4, 1024), (4, 2048), (8, 1024),
                          (8, 2048), (16, 1024)]:
        cells = []
        for min_chunk in min_chunks:
            _attention.MIN_CHUNK = min_chunk
            run, _, w = case(batch, kv_len)
            cold, _ = bench_gpu_time(run)
            warm, _ = bench_gpu_time(run, use_cuda_graph=True, cold_l2_cache=False)
            parts = int(w._plan.partition.requests[0, 3])
            cells.append(f"{cold * 1e6:6.2f} / {warm * 1e6:6.2f} ({parts})")
        print(f"{batch:>4}x{kv_len:<6}" + " ".join(f"{c:>22}" for c in cells), flush=True)
    _attention.MIN_CHUNK = default_min_chunk


def read_once_probe():
    print("ratio to copy (us); columns: the K and V copies evict-normal, evict-first; the plan's choice")
    for batch, kv_len in [(16, 512), (16, 1024), (16, 2048), (1, 32768), (16, 3072), (16, 4096), (24, 4096),
                          (32, 4096), (16, 8192), (64, 2048), (4, 65536), (64, 8192)]:
        run, nbytes, w = case(batch, kv_len)
        chosen, cells = w._plan.kv_read_once, []
        for read_once in (0, 1):
            w._plan.kv_read_once = read_once
            t, _ = bench_gpu_time(run)
            cells.append(f"{gbps(nbytes, t) / same_size_copy(nbytes):6.3f} ({t * 1e6:6.1f})")
        print(f"{batch:>4}x{kv_len:<6} {nbytes / 1e6:6.0f} MB " + " ".join(f"{c:>16}" for c in cells) + f"   {chosen}",
              flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "readonce":
        read_once_probe()
    elif sys.argv[1] == "parts":
        parts_probe([int(c) for c in sys.argv[2:]] or [128, 256, 512, 1024])
    elif sys.argv[1] == "latency":
        latency_probe()
    elif sys.argv[1] == "sweep":
        sweep([c if c == "d" else int(c) for c in sys.argv[2:]] or [1, 2, 3, 4])
    else:
        batch, kv_len = int(sys.argv[2]), int(sys.argv[3])
        run, _, _ = case(batch, kv_len, check=False)
        for _ in range(5):
            run()
        torch.cuda.synchronize()

