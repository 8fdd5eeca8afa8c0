"""``python -m aotinfer info``: what this install holds and which build each GPU would load.
``python -m aotinfer build``: compile modules into the JIT cache ahead of time (jit/cli.py).

GPUs are listed through the CUDA driver API (libcuda, by ctypes), not torch, so the command works
without a GPU, without torch's CUDA state, and in the same order and visibility as CUDA programs
(CUDA_VISIBLE_DEVICES applies).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import sys
from importlib import metadata
from typing import Any, Dict, List, Optional, Tuple

from . import _loader
from ._arch import NoCompatibleBuild
from ._version import __version__
from .jit import cli as jit_cli

_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


def driver_gpus() -> Tuple[Optional[str], List[Dict[str, Any]], Optional[str]]:
    """(driver's CUDA version, [{index, name, cc}], why no GPU is listed) from libcuda."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None, [], "no NVIDIA driver found (libcuda.so.1 does not load)"
    version = ctypes.c_int()
    if cuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None, [], "cuDriverGetVersion failed"
    driver = f"{version.value // 1000}.{version.value % 1000 // 10}"
    status = cuda.cuInit(0)
    if status != 0:
        return driver, [], f"cuInit failed with CUDA driver error {status}"
    count = ctypes.c_int()
    cuda.cuDeviceGetCount(ctypes.byref(count))
    gpus = []
    for index in range(count.value):
        device = ctypes.c_int()
        cuda.cuDeviceGet(ctypes.byref(device), index)
        name = ctypes.create_string_buffer(256)
        cuda.cuDeviceGetName(name, 256, device)
        cc = []
        for attr in (_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR):
            value = ctypes.c_int()
            cuda.cuDeviceGetAttribute(ctypes.byref(value), attr, device)
            cc.append(value.value)
        gpus.append({"index": index, "name": name.value.decode(), "compute_capability": tuple(cc)})
    return driver, gpus, None if gpus else "the driver reports no GPU"


def choices_for(cc: Tuple[int, int]) -> Dict[str, Dict[str, Any]]:
    """For each module of this install, the file a GPU of compute capability ``cc`` loads."""
    result = {}
    for name in _loader.manifest()["modules"]:
        try:
            choice, path = _loader.resolve(name, cc)
        except NoCompatibleBuild as e:
            result[name] = jit_cli.choice_without_installed(name, cc, str(e))
        else:
            result[name] = {
                "file": os.path.basename(path),
                "arch": str(choice.arch),
                "driver_compiles_ptx": choice.jit,
                "reason": choice.reason,
            }
    return result


def info(cc: Optional[Tuple[int, int]] = None) -> Dict[str, Any]:
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
            }
            for name, entry in m["modules"].items()
        },
    }
    if cc is not None:
        report["driver_cuda_version"] = None
        report["gpus"] = [{"index": None, "name": "--cc", "compute_capability": cc}]
        report["no_gpu_reason"] = None
    else:
        report["driver_cuda_version"], report["gpus"], report["no_gpu_reason"] = driver_gpus()
    report["jit"] = jit_cli.info_report()
    for gpu in report["gpus"]:
        gpu["compute_capability"] = "{}.{}".format(*gpu["compute_capability"])
        gpu["modules"] = choices_for(_parse_cc(gpu["compute_capability"]))
    return report


def _parse_cc(text: str) -> Tuple[int, int]:
    m = re.fullmatch(r"(\d+)\.(\d+)", text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a compute capability like 8.9, got {text!r}")
    return int(m.group(1)), int(m.group(2))


def format_info(report: Dict[str, Any]) -> str:
    lines = [
        f"aotinfer {report['version']}",
        f"built with CUDA {report['cuda_version']} (needs an NVIDIA driver >= {report['driver_min']}),"
        f" tvm-ffi {report['tvm_ffi_version']} (installed: {report['tvm_ffi_installed']})",
        f"arch list: {report['arch_list']}",
        "modules:",
    ]
    width = max((len(n) for n in report["modules"]), default=0)
    for name, module in report["modules"].items():
        majors = module["sm_majors"]
        where = "all SM majors" if majors is None else "SM majors " + ", ".join(map(str, majors))
        lines.append(f"  {name:<{width}}  {' '.join(module['archs'])}  ({where})")
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
            else:
                lines.append(f"  {name:<{width}}  {choice['file']}  ({choice['reason']})")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aotinfer")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, builds in this install, and what each GPU loads")
    p.add_argument("--cc", type=_parse_cc, help="answer for a GPU of this compute capability (e.g. 8.9)")
    p.add_argument("--json", action="store_true", help="print JSON")
    jit_cli.add_build_arguments(sub.add_parser("build", help="compile modules into the JIT cache (needs nvcc)"))
    args = parser.parse_args(argv)
    if args.command == "build":
        return jit_cli.build(args)
    try:
        report = info(args.cc)
    except _loader.NotBuiltError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else format_info(report))
    return 0
