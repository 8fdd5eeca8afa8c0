"""``python -m aotinfer info`` and ``verify``: what this install holds, what each GPU will load, and
whether the installed files are intact. ``python -m aotinfer build``: compile modules into the JIT
cache ahead of time (jit/cli.py).

GPUs are listed through the CUDA driver API (libcuda, by ctypes), not torch, so the command works
without a GPU, without torch's CUDA state, and in the same order and visibility as CUDA programs
(CUDA_VISIBLE_DEVICES applies). ``info`` checks what the driver can load, not only which file
matches the GPU: a CUDA 13 build needs a driver for CUDA 13.0 or newer (CUDA's minor-version
compatibility), and PTX needs a driver at least as new as the toolkit that wrote it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import metadata
from typing import Any, Dict, List, Optional, Tuple

from . import _device, _loader
from ._arch import NoCompatibleBuild
from ._version import __version__
from .jit import cli as jit_cli

driver_problem = _device.driver_problem  # what a driver loads: _device.py


def choices_for(cc: Tuple[int, int], driver: Optional[str] = None) -> Dict[str, Dict[str, Any]]:
    """For each module of this install, the file a GPU of compute capability ``cc`` loads.

    Each entry has "error" (None when the module loads) and "unsupported" (the module declares
    no support for this GPU: by design, not a fault of the install).
    """
    m = _loader.manifest()
    runtime = m.get("runtime") or {}
    runtime_missing = runtime.get("file") and not os.path.isfile(os.path.join(_loader.OPS_DIR, runtime["file"]))
    result = {}
    for name, entry in m["modules"].items():
        try:
            choice, path = _loader.resolve(name, cc)
        except NoCompatibleBuild as e:
            majors = entry["sm_majors"]
            # No installed build: a cached JIT build, or one the JIT can make, serves the GPU.
            result[name] = jit_cli.choice_without_installed(name, cc, str(e))
            served = result[name]["file"] is not None or result[name].get("jit_build")
            result[name]["error"] = None if served else result[name]["error"]
            result[name]["unsupported"] = majors is not None and cc[0] not in majors
            continue
        error = driver_problem(driver, m["cuda_version"], choice.jit)
        if not os.path.isfile(path):
            error = f"{path} is missing; reinstall aotinfer: {_loader.repair_command(m['arch_list'])}"
        elif runtime_missing and not error:
            error = (f"{runtime['file']} (the CUDA runtime of every module) is missing; reinstall aotinfer:"
                     f" {_loader.repair_command(m['arch_list'])}")
        result[name] = {
            "file": os.path.basename(path),
            "arch": str(choice.arch),
            "driver_compiles_ptx": choice.jit,
            "reason": choice.reason,
            "error": error,
            "unsupported": False,
        }
    return result


def info(cc: Optional[Tuple[int, int]] = None, driver: Optional[str] = None) -> Dict[str, Any]:
    """The report ``info`` prints; ``cc`` (and ``driver``) stand for a GPU instead of the real ones."""
    m = _loader.manifest()
    try:
        tvm_ffi_installed = metadata.version("apache-tvm-ffi")
    except metadata.PackageNotFoundError:
        tvm_ffi_installed = None
    report: Dict[str, Any] = {
        "version": __version__,
        "cuda_version": m["cuda_version"],
        "driver_min": m["driver_min"],
        "tvm_ffi_version": m["tvm_ffi_version"],
        "tvm_ffi_installed": tvm_ffi_installed,
        "arch_list": m["arch_list"],
        "modules": {
            name: {
                "sm_majors": entry["sm_majors"],
                "archs": [str(a) for a in sorted(_loader.module_builds(name))],
                "functions": entry["functions"],
                "missing": sorted(b["file"] for b in entry["builds"].values()
                                  if not os.path.isfile(os.path.join(b["dir"], b["file"]))),
            }
            for name, entry in m["modules"].items()
        },
    }
    if cc is not None:
        report["driver_cuda_version"] = driver
        report["gpus"] = [{"index": None, "name": "--cc", "compute_capability": cc}]
        report["no_gpu_reason"] = None
    else:
        report["driver_cuda_version"], report["gpus"], report["no_gpu_reason"] = _device.driver_gpus()
        if driver is not None:
            report["driver_cuda_version"] = driver
    report["jit"] = jit_cli.info_report()
    for gpu in report["gpus"]:
        gpu["modules"] = choices_for(gpu["compute_capability"], report["driver_cuda_version"])
        gpu["compute_capability"] = "{}.{}".format(*gpu["compute_capability"])
    return report


def failures(report: Dict[str, Any]) -> List[str]:
    """The modules a GPU of the report should load and cannot (not those it does not support)."""
    return [f"{gpu['name']} {name}" for gpu in report["gpus"] for name, choice in gpu["modules"].items()
            if choice["error"] and not choice["unsupported"]]


def format_info(report: Dict[str, Any]) -> str:
    lines = [
        f"aotinfer {report['version']}",
        f"built with CUDA {report['cuda_version']} (needs an NVIDIA driver >= {report['driver_min']},"
        f" which supports CUDA {report['cuda_version'].split('.')[0]}.0),"
        f" tvm-ffi {report['tvm_ffi_version']} (installed: {report['tvm_ffi_installed']})",
        f"arch list: {report['arch_list']}",
        "modules:",
    ]
    width = max((len(n) for n in report["modules"]), default=0)
    for name, module in report["modules"].items():
        majors = module["sm_majors"]
        where = "all SM majors" if majors is None else "SM majors " + ", ".join(map(str, majors))
        lines.append(f"  {name:<{width}}  {' '.join(module['archs'])}  ({where})")
        for file in module["missing"]:
            lines.append(f"  {'':<{width}}  MISSING: {file}")
    lines += jit_cli.format_info(report["jit"])
    if report["driver_cuda_version"]:
        lines.append(f"driver: supports CUDA {report['driver_cuda_version']}")
    if not report["gpus"]:
        lines.append(f"GPUs: none ({report['no_gpu_reason']})")
    for gpu in report["gpus"]:
        label = "--cc" if gpu["index"] is None else f"cuda:{gpu['index']} {gpu['name']}"
        lines.append(f"{label} (compute capability {gpu['compute_capability']}):")
        for name, choice in gpu["modules"].items():
            if choice.get("jit_build"):
                lines.append(f"  {name:<{width}}  {choice['jit_build']}")
            elif choice["file"] is None:
                lines.append(f"  {name:<{width}}  cannot load: {choice['error']}")
            elif choice["error"]:
                lines.append(f"  {name:<{width}}  {choice['file']}  cannot load: {choice['error']}")
            else:
                lines.append(f"  {name:<{width}}  {choice['file']}  ({choice['reason']})")
    failed = failures(report)
    if failed:
        lines.append(f"{len(failed)} module(s) cannot load where they should; see above")
    return "\n".join(lines)


def verify_command() -> int:
    results = _loader.verify()
    for path, problem in results:
        if problem:
            print(f"{path}: {problem}")
    bad = sum(1 for _, problem in results if problem)
    if bad:
        print(f"verify: {bad} of {len(results)} files are missing or differ from the manifest; reinstall"
              f" aotinfer: {_loader.repair_command(_loader.manifest()['arch_list'])}")
        return 1
    print(f"verify: all {len(results)} files match their sha256 in the manifests")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aotinfer")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, builds in this install, and what each GPU loads")
    p.add_argument("--cc", type=_device.cc_argument, help="answer for a GPU of this compute capability (e.g. 8.9)")
    p.add_argument("--driver", type=_device.driver_argument,
                   help="answer for a driver supporting this CUDA version (e.g. 12.2) instead of the installed one")
    p.add_argument("--json", action="store_true", help="print JSON")
    sub.add_parser("verify", help="check every installed kernel file against its sha256 in the manifest")
    jit_cli.add_build_arguments(sub.add_parser("build", help="compile modules into the JIT cache (needs nvcc)"))
    args = parser.parse_args(argv)
    if args.command == "build":
        return jit_cli.build(args)
    try:
        if args.command == "verify":
            return verify_command()
        report = info(args.cc, args.driver)
    except _loader.NotBuiltError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else format_info(report))
    return 1 if failures(report) else 0
