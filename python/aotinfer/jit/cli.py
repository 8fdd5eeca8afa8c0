"""The JIT's part of ``python -m aotinfer``: the ``build`` command, and what ``info`` says of the cache.

    python -m aotinfer build [MODULE ...] [--cc X.Y | --arch-list "..."]

compiles modules (default: all of modules.toml) into the JIT cache ahead of time, e.g. in a
container image's build step, so that no server start compiles. ``--cc`` builds what a GPU of
that compute capability would compile on first use, skipping modules an installed build already
covers; ``--arch-list`` builds exactly the archs given (the wheel build's grammar); with neither,
the archs of AOTINFER_CUDA_ARCH_LIST if set, else of the visible GPUs, as for ``--cc``.
"""

from __future__ import annotations

import os
import sys
import time

from .. import _manifest
from .._arch import Arch, NoCompatibleBuild, parse_arch_list
from . import cache, toolchain
from .core import JitUnavailable
from .modules import (cached_builds, cached_choice, declarations, gen_module_spec, jit_builds_off, kernel_source_dir,
                      module_builds_off)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Tuple


def add_build_arguments(parser) -> None:
    from .._device import cc_argument

    parser.add_argument("modules", nargs="*", metavar="MODULE", help="modules of modules.toml (default: all)")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--cc", type=cc_argument,
                        help="build what a GPU of this compute capability (e.g. 10.3) needs and the install lacks")
    target.add_argument("--arch-list", help='build these archs, e.g. "10.0f 12.0+PTX" (as AOTINFER_CUDA_ARCH_LIST)')


def build(args) -> int:
    """Run ``python -m aotinfer build``; prints one line per (module, arch)."""
    try:
        targets = _targets(args)
        decls = declarations()
        for name in args.modules:
            if name not in decls:
                raise KeyError(f"modules.toml has no module {name!r}; it has: {', '.join(decls)}")
        for name in args.modules or decls:
            majors = decls[name].get("sm_majors")
            for cc, arch in targets:
                if majors is not None and arch.major not in majors:
                    print(f"{name}: skipped {arch}, the module runs only on SM majors {majors}")
                    continue
                covered = _installed_for(name, cc) if cc is not None else None
                if covered:
                    print(f"{name}: the installed {covered}; nothing to build")
                    continue
                spec = gen_module_spec(name, arch)
                start = time.monotonic()
                try:
                    path, outcome = spec.ensure_built()
                except JitUnavailable as e:
                    if args.modules:  # asked for by name: an error
                        raise
                    print(f"{name}: skipped {arch}: {e}")
                    continue
                seconds = time.monotonic() - start
                how = {"built": f"built in {seconds:.1f} s", "cached": "cached",
                       "waited": f"built by another process (waited {seconds:.1f} s for it)"}[outcome]
                print(f"{name}: {arch.sass}{'+PTX' if arch.ptx else ''} {how}: {path}")
    except KeyError as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 1
    except (RuntimeError, ValueError, OSError) as e:  # build and lock errors, bad arch lists, bad caches
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _targets(args) -> List[Tuple[Optional[Tuple[int, int]], Arch]]:
    """(compute capability or None, arch) pairs to build; None: the arch was asked for by name."""
    if args.arch_list:
        return [(None, a) for a in parse_arch_list(args.arch_list)]
    if args.cc is None and os.environ.get("AOTINFER_CUDA_ARCH_LIST", "").strip():
        return [(None, a) for a in parse_arch_list(os.environ["AOTINFER_CUDA_ARCH_LIST"])]
    tools = toolchain.find()
    if tools is None:
        raise JitUnavailable(toolchain.why_not_found())
    if args.cc is not None:
        ccs = [args.cc]
    else:
        from .._device import driver_gpus

        _, gpus, why_none = driver_gpus()
        if not gpus:
            raise JitUnavailable(f"no GPU visible ({why_none}); name one with --cc or --arch-list")
        ccs = sorted({g["compute_capability"] for g in gpus})
    targets = []
    for cc in ccs:
        arch = tools.arch_for(cc)
        if arch is None:
            raise JitUnavailable(f"nvcc {tools.cuda_version} ({tools.nvcc}) cannot build for {cc[0]}.{cc[1]}")
        targets.append((cc, arch))
    return targets


def _installed_for(name: str, cc: Tuple[int, int]) -> Optional[str]:
    """'scale_sm90a.so runs on 9.0 (...)' if an installed build serves ``cc``, else None."""
    try:
        choice, path = _manifest.resolve(name, cc)
    except (NoCompatibleBuild, _manifest.NotBuiltError, KeyError):
        return None
    return f"{os.path.basename(path)} runs on {cc[0]}.{cc[1]} ({choice.reason})"


# ---- info -------------------------------------------------------------------------------------


def info_report() -> Dict[str, Any]:
    """The JIT's state for ``python -m aotinfer info``; reads only, creates nothing."""
    tools = toolchain.find()
    source = kernel_source_dir()
    report: Dict[str, Any] = {
        "sources": str(source) if source else None,
        "nvcc": {"path": tools.nvcc, "cuda_version": tools.cuda_version} if tools else None,
        "builds": jit_builds_off() or "on first use",
        "cache_dir": str(cache.cache_root()),
        "cache_problem": None,
        "cached": [],
    }
    try:
        root = cache.open_root(create=False)
    except (cache.CacheDirError, OSError) as e:
        report["cache_problem"] = str(e)
        return report
    if root is None:
        return report
    for entry in cache.entries(root):
        record = entry.read_sidecar() or {}
        report["cached"].append({
            "file": entry.library.name,
            "dir": str(entry.dir),
            "module": record.get("module"),
            "archs": record.get("archs"),
            "size": record.get("size"),
            "seconds": record.get("seconds"),
            "state": _state(entry, record),
        })
    return report


def _state(entry: cache.Entry, record: Dict[str, Any]) -> str:
    problem = entry.problem()
    if problem is not None:
        return f"damaged ({problem}); rebuilt when next needed"
    module, archs = record.get("module"), record.get("archs") or []
    if module is None or len(archs) != 1:
        return "a gen_jit_spec build"
    try:
        current = gen_module_spec(module, archs[0])
    except (JitUnavailable, KeyError, ValueError):
        return "stale: its module is gone from modules.toml"
    if record.get("inputs_key") != current.inputs_key():
        return "stale: built from other sources or flags"
    if entry.library in [e.library for e in cached_builds(module).values()]:
        return "current"
    return "stale: built by another toolchain"


def choice_without_installed(name: str, cc: Tuple[int, int], error: str) -> Dict[str, Any]:
    """What ``info`` shows for a module no installed build of which runs on ``cc``."""
    cached = cached_choice(name, cc)
    if cached is not None:
        choice, path = cached
        return {"file": os.path.basename(path), "arch": str(choice.arch), "driver_compiles_ptx": choice.jit,
                "reason": choice.reason, "path": path}
    off = module_builds_off(name)
    tools = toolchain.find()
    arch = tools.arch_for(cc) if off is None else None
    majors = declarations().get(name, {}).get("sm_majors") if off is None else None
    if arch is not None and (majors is None or cc[0] in majors):
        what = f"{arch.sass}{'+PTX' if arch.ptx else ''}"
        return {"file": None, "error": error, "jit_build_ptx": arch.ptx,
                "jit_build": f"JIT-compiles {what} on first use (nvcc {tools.cuda_version});"
                             f" prebuild: python -m aotinfer build {name} --cc {cc[0]}.{cc[1]}"}
    return {"file": None, "error": f"{error}; JIT build: {off or 'not possible for this GPU'}"}


def format_info(report: Dict[str, Any]) -> List[str]:
    nvcc = report["nvcc"]
    lines = [
        f"JIT builds: {report['builds']}"
        + (f", nvcc {nvcc['cuda_version']} ({nvcc['path']})" if nvcc else "")
        + (f"; sources {report['sources']}" if report["sources"] else ""),
    ]
    if report["cache_problem"]:
        lines.append(f"JIT cache: unusable: {report['cache_problem']}")
        return lines
    cached = report["cached"]
    size = sum(c["size"] or 0 for c in cached) / 1e6
    lines.append(f"JIT cache {report['cache_dir']}: {len(cached)} object{'s' * (len(cached) != 1)}, {size:.1f} MB")
    width = max((len(c["file"]) for c in cached), default=0)
    for c in cached:
        took = f"built in {c['seconds']} s, " if c["seconds"] is not None else ""
        lines.append(f"  {c['file']:<{width}}  {' '.join(c['archs'] or [])}  {took}{c['state']}")
    return lines
