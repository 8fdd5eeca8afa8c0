"""GPU check of the JIT path: every module's op runs from a JIT-built object, first-call compile time printed.

Run it where the installed wheel has no build for the GPU, e.g. on an H200 (9.0) after installing
with an arch list that leaves 9.0 out, and with an empty cache::

    AOTINFER_CUDA_ARCH_LIST="8.0" pip install --no-build-isolation . -Cbuild-dir=/tmp/build-nojit
    AOTINFER_CACHE_DIR=$(mktemp -d)/aotinfer python ci/jit_gpu_check.py

Cold: the first call of one op per module of modules.toml compiles that module through the
loader's fallback (aotinfer.jit.resolve); the table shows the compile time the build recorded,
the first call's time (compile and load included) and a second call's. Each result is checked
against a float32 reference, and /proc/self/maps must show the cache's objects loaded and none of
the wheel's. Warm: a fresh process does the same with the cache filled and must compile nothing.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import torch

import aotinfer
from aotinfer import _loader, jit
from aotinfer._arch import choose_arch


def _silu_and_mul(x):
    d = x.shape[-1] // 2
    x = x.float()
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def _rmsnorm(x, w, eps=1e-6):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def _cases(device):
    """One op per module: (op call, float32 reference), on odd-sized bf16 inputs."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(257, 4096, device=device, dtype=torch.bfloat16, generator=g)
    w = torch.randn(4096, device=device, dtype=torch.bfloat16, generator=g)
    x2 = torch.randn(257, 2 * 2880, device=device, dtype=torch.bfloat16, generator=g)
    q = torch.randn(32, 128, device=device, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1000, 8, 128, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    va, vb = (torch.randn(57, 8, 128, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    sa, sb = (torch.randn(57, 8, device=device, generator=g) for _ in range(2))
    qp = torch.randn(300, 32, 128, device=device, dtype=torch.bfloat16, generator=g)
    return {
        "scale": (lambda: aotinfer.scale(x, 1.5), lambda: x.float() * 1.5),
        "norm": (lambda: aotinfer.rmsnorm(x, w, 1e-6), lambda: _rmsnorm(x, w)),
        "activation": (lambda: aotinfer.silu_and_mul(x2), lambda: _silu_and_mul(x2)),
        "decode": (lambda: aotinfer.single_decode_with_kv_cache(q, k, v), lambda: _decode(q, k, v)),
        "cascade": (lambda: aotinfer.merge_state(va, sa, vb, sb)[0], lambda: _merge(va, sa, vb, sb)),
        "prefill": (lambda: aotinfer.single_prefill_with_kv_cache(qp, k, v, causal=True), lambda: _prefill(qp, k, v)),
    }


def _decode(q, k, v):
    """Softmax attention of one token (32 query heads) over 1000 keys of 8 KV heads, in float32."""
    keys, values = (t.float().repeat_interleave(4, dim=1) for t in (k, v))
    logits = torch.einsum("hd,nhd->hn", q.float(), keys) / q.shape[-1] ** 0.5
    return torch.einsum("hn,nhd->hd", logits.softmax(-1), values)


def _prefill(q, k, v):
    """Causal attention (aligned to the end) of 300 tokens (32 query heads) over 1000 keys of 8 KV
    heads, in float32."""
    keys, values = (t.float().repeat_interleave(4, dim=1) for t in (k, v))
    logits = torch.einsum("qhd,khd->hqk", q.float(), keys) / q.shape[-1] ** 0.5
    seen = torch.arange(k.shape[0], device=q.device)[None, :] <= torch.arange(q.shape[0], device=q.device)[:, None] + k.shape[0] - q.shape[0]
    return torch.einsum("hqk,khd->qhd", logits.masked_fill(~seen, float("-inf")).softmax(-1), values)


def _merge(va, sa, vb, sb):
    """The merged value of two states (base-2 log-sum-exps), in float32."""
    w = torch.softmax(torch.stack([sa, sb]) * 0.6931471805599453, 0)
    return w[0, ..., None] * va.float() + w[1, ..., None] * vb.float()


class _Compiles(logging.Handler):
    """Prints aotinfer.jit's lines (as Python's last-resort handler would) and keeps them."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())
        print(record.getMessage(), file=sys.stderr, flush=True)


def _timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def _mapped_objects():
    with open("/proc/self/maps") as f:
        return {os.path.realpath(line.split()[-1]) for line in f if line.rstrip().endswith(".so")}


def run(phase: str) -> int:
    device = torch.device("cuda", 0)
    cc = torch.cuda.get_device_capability(device)
    modules = list(jit.declarations())
    cases = _cases(device)
    missing = [m for m in modules if m not in cases]
    if missing:
        print(f"no op for modules {missing}: add one to _cases", file=sys.stderr)
        return 1
    for module in modules:  # the installed builds alone, whether or not the loader falls back to the JIT
        try:
            choice = choose_arch(cc, _loader.module_builds(module), _loader.module_entry(module)["sm_majors"])
        except aotinfer.NoCompatibleBuild:
            continue
        print(f"the installed {module} build {choice.arch} runs on {cc[0]}.{cc[1]}: reinstall with an arch list"
              f" that leaves {cc[0]}.{cc[1]} out to force the JIT path", file=sys.stderr)
        return 1
    compiles = _Compiles()
    logging.getLogger("aotinfer.jit").addHandler(compiles)
    print(f"== {phase}: {torch.cuda.get_device_name(device)} (compute capability {cc[0]}.{cc[1]}),"
          f" cache {jit.cache_root()}")
    print(f"{'module':<11} {'arch':<8} {'compile s':>9} {'first call s':>12} {'second call ms':>14}  max |err|")
    failed = False
    for module in modules:
        call, reference = cases[module]
        try:
            out, first = _timed(call)
        except aotinfer.NoCompatibleBuild as e:
            print(f"{module}: {e}\n(is _loader wired to aotinfer.jit.resolve?)", file=sys.stderr)
            return 1
        _, second = _timed(call)
        err = (out.float() - reference()).abs().max().item()
        ok = torch.allclose(out.float(), reference(), atol=2e-2, rtol=2e-2)
        failed |= not ok
        entry = next(iter(jit.cached_builds(module).values()), None)
        record = entry.read_sidecar() if entry else {}
        print(f"{module:<11} {' '.join(record.get('archs', ['?'])):<8} {record.get('seconds', '-'):>9}"
              f" {first:>12.2f} {second * 1e3:>14.3f}  {err:.3g}{'' if ok else '  MISMATCH'}")
    loaded = _mapped_objects()
    ops_dir, cache_dir = os.path.realpath(_loader.OPS_DIR), os.path.realpath(jit.cache_root())
    # The wheel's CUDA runtime library is every module's, JIT-built ones too: count kernel modules.
    runtime = os.path.join(ops_dir, _loader.manifest()["runtime"]["file"])
    from_wheel = sorted(p for p in loaded if os.path.dirname(p) == ops_dir and p != runtime)
    from_cache = sorted(p for p in loaded if p.startswith(cache_dir + os.sep))
    print(f"kernel modules loaded from the JIT cache: {len(from_cache)}, from the wheel: {len(from_wheel)}")
    built = sum("compiling" in line for line in compiles.lines)
    print(f"compiles in this process: {built}")
    expect_built = len(modules) if phase == "cold" else 0
    if failed or from_wheel or len(from_cache) != len(modules) or built != expect_built:
        print(f"FAILED: expected {len(modules)} objects from the cache, none from the wheel,"
              f" {expect_built} compiles, and results matching the reference", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    phase = sys.argv[1] if len(sys.argv) > 1 else "cold"
    if phase != "cold":
        return run(phase)
    if any(jit.cached_builds(m) for m in jit.declarations()):
        print(f"the JIT cache {jit.cache_root()} has builds already; point AOTINFER_CACHE_DIR at an empty"
              " directory for a cold start", file=sys.stderr)
        return 1
    status = run("cold")
    start = time.perf_counter()
    warm = subprocess.run([sys.executable, __file__, "warm"])
    took = time.perf_counter() - start
    print(f"warm process: exit {warm.returncode} in {took:.1f} s (interpreter and imports included)")
    info = subprocess.run([sys.executable, "-m", "aotinfer", "info"], capture_output=True, text=True)
    print(info.stdout)
    print(json.dumps({"cold": status, "warm": warm.returncode}))
    return status or warm.returncode


if __name__ == "__main__":
    sys.exit(main())
