"""Helpers shared by the bandwidth benchmarks: one timed row, the streaming limit, and per-op latency
under graph replay.

Each row shows ours beside two baselines timed in the same run: torch's copy_ of the same bytes,
and the streaming limit, benchmarks/streaming.cu's kernel reading and writing the same bytes in
the op's read:write proportion (a gated activation reads 2 units and writes 1) at the fastest of
its configurations. copy_ is not the ceiling: two streams read and one written is friendlier to
HBM than one read and one written. The streaming kernel is compiled with nvcc at the first row
(a few seconds) and called through ctypes; without nvcc its column reads n/a.

FlashInfer's own kernels join as a third baseline when AOTINFER_BENCH_FLASHINFER_INCLUDE names its
header directory (`flashinfer/data/include` of an unpacked flashinfer-python wheel):
benchmarks/flashinfer_baseline.cu is built the same way, and each row that has a FlashInfer kernel
prints its ratio to the same copy_ and FlashInfer's time over ours ("vs FI" > 1: ours is faster).
"""

import ctypes
import os
import shutil
import subprocess
import tempfile

import torch

from aotinfer.testing import bench_gpu_time

GRAPH_CALLS = 20  # calls captured in one graph for the latency table


def gbps(nbytes, seconds):
    return nbytes / seconds / 1e9


def same_size_copy(nbytes):
    """Bandwidth of torch's device-to-device copy moving nbytes in all (nbytes / 2 read, written)."""
    src = torch.randint(-128, 127, (nbytes // 2,), dtype=torch.int8, device="cuda")
    dst = torch.empty_like(src)
    t, _ = bench_gpu_time(dst.copy_, args=(src,))
    return gbps(nbytes, t)


_libraries = {}  # benchmark source -> its ctypes library, or None once it could not be built
_limits = {}  # (nbytes, reads, writes) -> GB/s, measured once a run


def _build(source, flags=(), what=None):
    """nvcc-compile benchmarks/<source> for this GPU into a shared library, once a run; None (and a
    note saying which column reads n/a) without nvcc or when it fails."""
    if source in _libraries:
        return _libraries[source]
    lib = None
    what = what or source
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        print(f"  ({what}: no nvcc on PATH; its column reads n/a)")
    else:
        major, minor = torch.cuda.get_device_capability()
        arch = f"{major}{minor}{'a' if major >= 9 else ''}"
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), source)
        target = os.path.join(tempfile.mkdtemp(prefix="aotinfer-bench-"), source.replace(".cu", ".so"))
        command = [nvcc, "-O3", "-shared", "-Xcompiler", "-fPIC", f"-gencode=arch=compute_{arch},code=sm_{arch}",
                   *flags, path, "-o", target]
        built = subprocess.run(command, capture_output=True, text=True)
        if built.returncode != 0:
            print(f"  ({what}: nvcc failed; its column reads n/a)\n{built.stderr}")
        else:
            lib = ctypes.CDLL(target)
    _libraries[source] = lib
    return lib


def _streaming_lib():
    lib = _build("streaming.cu", what="streaming limit")
    if lib is not None:
        lib.streaming_run.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
                                      ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
        lib.streaming_config.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
        lib.streaming_warps.argtypes = [ctypes.c_int64, ctypes.c_int]
        lib.streaming_warps.restype = ctypes.c_int64
        lib.streaming_run_read_once.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                                ctypes.c_void_p]
    return lib


def flashinfer_baseline():
    """FlashInfer's kernels (benchmarks/flashinfer_baseline.cu) as a ctypes library whose functions
    return a cudaError_t, or None where AOTINFER_BENCH_FLASHINFER_INCLUDE is unset."""
    include = os.environ.get("AOTINFER_BENCH_FLASHINFER_INCLUDE")
    if not include:
        return None
    if "flashinfer_baseline.cu" not in _libraries:
        # FlashInfer's norm header includes cuBLAS and cuRAND headers that its norm kernels never
        # use; empty ones, searched after the toolkit's, stand in where the toolkit lacks them.
        stubs = tempfile.mkdtemp(prefix="aotinfer-bench-stubs-")
        for header in ("cublasLt.h", "cublas_v2.h", "curand_kernel.h"):
            open(os.path.join(stubs, header), "w").close()
        # The flags FlashInfer's JIT gives its activation and norm modules.
        flags = ["-std=c++17", "-use_fast_math", "--expt-relaxed-constexpr", "-DFLASHINFER_ENABLE_F16",
                 "-DFLASHINFER_ENABLE_BF16", "-DENABLE_BF16", "-DENABLE_FP8", f"-I{include}",
                 "-Xcompiler", "-idirafter", "-Xcompiler", stubs]
        lib = _build("flashinfer_baseline.cu", flags, what="FlashInfer baseline")
        if lib is not None:
            p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
            for act in ("silu", "gelu", "gelu_tanh"):
                getattr(lib, f"fi_{act}_and_mul").argtypes = [p, p, i64, i32, i32, p]
            lib.fi_rmsnorm.argtypes = [p, p, p, i64, i32, f32, i32, i32, p]
            lib.fi_fused_add_rmsnorm.argtypes = [p, p, p, i64, i32, f32, i32, i32, p]
            lib.fi_layernorm.argtypes = [p, p, p, p, i64, i32, f32, p]
            lib.fi_rmsnorm_quant.argtypes = [p, p, p, p, i64, i32, f32, p]
            lib.fi_fused_add_rmsnorm_quant.argtypes = [p, p, p, p, p, i64, i32, f32, p]
            lib.fi_layernorm_quant.argtypes = [p, p, p, p, p, i64, i32, f32, p]
    return _libraries["flashinfer_baseline.cu"]


def flashinfer_call(fn, *args):
    """Call a FlashInfer baseline function on the current stream; raise on a CUDA error."""
    status = fn(*args, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    if status != 0:
        raise RuntimeError(f"FlashInfer baseline {fn.__name__}: CUDA error {status}")


def _xor_fold(words):
    """The XOR of the rows of an int32 tensor [n, 4]: [4]."""
    while words.shape[0] > 1:
        if words.shape[0] % 2:
            words = torch.cat([words, torch.zeros_like(words[:1])])
        half = words.shape[0] // 2
        words = torch.bitwise_xor(words[:half], words[half:])
    return words[0]


def streaming_limit(nbytes, reads, writes, read_once=False):
    """GB/s of streaming.cu's kernel reading `reads` streams and writing `writes` streams, nbytes in
    all (each stream nbytes / (reads + writes), rounded down to 16 bytes), at its fastest
    configuration; each configuration checked once. writes 0: a kernel that only reads (each warp
    writes the XOR of what it read, 16 bytes, not counted), the limit of an op whose outputs are
    small beside its inputs; read_once (writes 0 only): the reads cached evict-first in L2, as the
    decode kernel reads its cache. None without the kernel."""
    lib = _streaming_lib()
    if lib is None:
        return None
    if (nbytes, reads, writes, read_once) in _limits:
        return _limits[nbytes, reads, writes, read_once]
    per_stream = nbytes // (reads + writes) // 16 * 16
    vecs = per_stream // 16
    src = [torch.randint(-2**31, 2**31 - 1, (per_stream // 4,), dtype=torch.int32, device="cuda") for _ in range(reads)]
    warps = max(lib.streaming_warps(vecs, c) for c in range(lib.streaming_num_configs()))
    dst = [torch.empty(warps * 4 if writes == 0 else per_stream // 4, dtype=torch.int32, device="cuda")
           for _ in range(max(writes, 1))]
    read_ptrs = (ctypes.c_void_p * reads)(*[t.data_ptr() for t in src])
    write_ptrs = (ctypes.c_void_p * len(dst))(*[t.data_ptr() for t in dst])
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    want = src[0] if reads == 1 else torch.bitwise_xor(src[0], src[1])

    def run(config):
        if read_once:
            status = lib.streaming_run_read_once(read_ptrs[0], write_ptrs[0], vecs, config, stream)
        else:
            status = lib.streaming_run(read_ptrs, reads, write_ptrs, writes, vecs, config, stream)
        if status != 0:
            raise RuntimeError(f"streaming kernel, configuration {config}: CUDA error {status}")

    def right(config):
        if writes > 0:
            return all(torch.equal(t, want) for t in dst)
        written = dst[0][: lib.streaming_warps(vecs, config) * 4].view(-1, 4)
        return torch.equal(_xor_fold(written), _xor_fold(want.view(-1, 4)))

    best = 0.0
    for config in range(lib.streaming_num_configs()):
        for t in dst:
            t.fill_(0)
        run(config)
        assert right(config), f"streaming kernel, configuration {config}, is wrong: not timing it"
        t, _ = bench_gpu_time(run, args=(config,))
        best = max(best, gbps(per_stream * (reads + writes), t))
    _limits[nbytes, reads, writes, read_once] = best
    return best


def bandwidth_row(label, ours, torch_fn, nbytes, copy_bw, streams, flashinfer=None):
    """Time ours and torch's version of one case beside a copy of the same bytes and the streaming
    limit of streams = (reads, writes), and FlashInfer's kernel where given; print GB/s and ratios:
    ours / copy, ours / limit, torch / copy (in parentheses, to copy_bw, the large copy of the run),
    FlashInfer / copy and FlashInfer's time / ours. Returns (ours / copy, ours / limit, FlashInfer's
    time / ours or None)."""
    t_ours, _ = bench_gpu_time(ours)
    t_fi = bench_gpu_time(flashinfer)[0] if flashinfer is not None else None
    t_torch, _ = bench_gpu_time(torch_fn)
    same = same_size_copy(nbytes)
    limit = streaming_limit(nbytes, *streams)
    ours_bw = gbps(nbytes, t_ours)
    ratio, torch_ratio = ours_bw / same, gbps(nbytes, t_torch) / same
    limit_ratio = ours_bw / limit if limit else float("nan")
    limit_text = f"{limit:5.0f}" if limit else "  n/a"
    fi_text = f"   FI {gbps(nbytes, t_fi) / same:6.3f} vs FI {t_fi / t_ours:5.3f}" if t_fi else ""
    print(f"  {label:<32} {t_ours * 1e6:8.1f} us {ours_bw:6.0f} GB/s  copy {same:5.0f} limit {limit_text}"
          f"  {ratio:6.3f} {limit_ratio:6.3f} ({ours_bw / copy_bw:5.3f})   torch {torch_ratio:6.3f}{fi_text}")
    return ratio, limit_ratio, (t_fi / t_ours if t_fi else None)


def graph_latency(fn):
    """GPU time of one call, from replays of a graph holding GRAPH_CALLS calls back to back."""

    def calls():
        for _ in range(GRAPH_CALLS):
            fn()

    median, _ = bench_gpu_time(calls, use_cuda_graph=True, cold_l2_cache=False)
    return median / GRAPH_CALLS


def start(dtype):
    """Print the run's header (device, versions, copy bandwidth) and the bandwidth table's title;
    return the copy bandwidth in GB/s."""
    import aotinfer
    from aotinfer.testing import copy_bandwidth

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, aotinfer {aotinfer.__version__}, {dtype}")
    bw = copy_bandwidth() / 1e9
    print(f"device-to-device copy bandwidth, this run: {bw:.0f} GB/s (bytes read + written)")
    print("\nbandwidth: ours as ratios to torch's copy_ of the same bytes, to the streaming limit (and to the 1 GiB"
          " copy); eager torch to the same copy_")
    print(f"  {'case':<32} {'time':>11} {'ours':>11}  {'copy_ GB/s':>10} {'limit GB/s':>10}  {'/copy':>6} {'/limit':>6}")
    return bw
