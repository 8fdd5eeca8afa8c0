"""``python -m aotinfer info`` and ``verify``: what this install holds, what each GPU will load, and
whether the installed files are intact. ``python -m aotinfer build``: compile modules into the JIT
cache ahead of time (jit/cli.py).

GPUs are listed through the CUDA driver API (``_device.driver_gpus``), not torch, so the command
works without a GPU and without torch's CUDA state. ``info`` checks what the driver can load, not
only which file matches the GPU: a CUDA 13 build needs a driver for CUDA 13.0 or newer (CUDA's
minor-version compatibility), JIT builds included (they link the install's CUDA runtime), and PTX
needs a driver at least as new as the toolkit that wrote it. It checks every file against the
manifest's sha256, as the loader does at first load. Exit statuses: EXIT_STATUS below (``--help``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import metadata
from typing import Any, Dict, List, Optional, Tuple

from . import _device, _loader, _manifest, overlay
from ._arch import NoCompatibleBuild
from ._version import __version__
from .jit import cli as jit_cli
from .jit import toolchain as jit_toolchain

driver_problem = _device.driver_problem  # what a driver loads: _device.py


def by_design(majors: List[int]) -> str:
    """'Hopper only (SM major 9), by design' for a module's sm_majors."""
    majors = sorted(majors)
    if majors == [9]:
        what = "Hopper only (SM major 9)"
    elif majors == list(range(majors[0], max(majors[-1], 12) + 1)):
        what = f"sm_{majors[0]}0 and newer (SM majors {', '.join(map(str, majors))})"
    else:
        what = f"SM majors {', '.join(map(str, majors))} only"
    return f"{what}, by design"


def choices_for(cc: Tuple[int, int], driver: Optional[str] = None) -> Dict[str, Dict[str, Any]]:
    """For each module of this install, the file a GPU of compute capability ``cc`` loads.

    Each entry has "error" (None when the module loads) and "unsupported" (the module declares
    no support for this GPU: by design, not a fault of the install; "error" then says so too).
    With ``driver``, what the driver cannot run is an error, JIT builds included: they link this
    install's CUDA runtime, so a driver too old for the install is too old for them.
    """
    m = _loader.manifest()
    repair = f"reinstall aotinfer: {_loader.repair_command(m['arch_list'])}"
    runtime = m.get("runtime")
    runtime_path = os.path.join(_loader.OPS_DIR, runtime["file"]) if isinstance(runtime, dict) else None
    runtime_problem = _manifest.file_problem(runtime_path, runtime) if runtime_path else None
    tools = jit_toolchain.find()
    result = {}
    for name, entry in m["modules"].items():
        majors = entry["sm_majors"]
        if majors is not None and cc[0] not in majors:
            result[name] = {"file": None, "unsupported": True,
                            "error": f"not for compute capability {cc[0]}.{cc[1]}: {by_design(majors)}"}
            continue
        try:
            choice, path = _loader.resolve(name, cc)
        except NoCompatibleBuild as e:
            # No installed build: a cached JIT build, or one the JIT can make, serves the GPU.
            choice = result[name] = jit_cli.choice_without_installed(name, cc, str(e))
            served = choice["file"] is not None or choice.get("jit_build")
            choice["error"] = None if served else choice["error"]
            choice["unsupported"] = False
            if served:
                nvcc = tools.cuda_version if tools else m["cuda_version"]
                ptx = choice.get("driver_compiles_ptx") or choice.get("jit_build_ptx", False)
                problem = (driver_problem(driver, m["cuda_version"], False)
                           or driver_problem(driver, nvcc, ptx))
                if choice["file"] is not None and not problem:
                    problem = _manifest.elf_problem(choice["path"])
                    problem = problem and f"{choice['path']}: {problem}"
                if problem:
                    why = ("; a JIT build cannot help: its objects link this install's CUDA"
                           f" {m['cuda_version']} runtime" if choice.pop("jit_build", None) else "")
                    choice["error"] = problem + why
            continue
        build = _loader.module_builds(name)[choice.arch]
        problem = _manifest.file_problem(path, build)
        if problem is None:
            problem = _manifest.elf_problem(path)  # a listed file that the dynamic loader refuses
        if problem:
            error = f"{path}: {problem}; {repair}"
        elif runtime_problem:
            error = f"{runtime_path} (the CUDA runtime of every module): {runtime_problem}; {repair}"
        else:
            error = driver_problem(driver, m["cuda_version"], choice.jit)
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
        "integrity": integrity(m),
    }
    for name, module in report["modules"].items():
        files = {os.path.join(b["dir"], b["file"]): b["file"] for b in m["modules"][name]["builds"].values()}
        module["damaged"] = {file: report["integrity"][path] for path, file in sorted(files.items())
                             if report["integrity"].get(path) not in (None, "missing")}
    if cc is not None:
        report["driver_cuda_version"] = driver
        report["gpus"] = [{"index": None, "name": "--cc", "compute_capability": cc}]
        report["no_gpu_reason"] = None
    else:
        report["driver_cuda_version"], report["gpus"], report["no_gpu_reason"] = _device.driver_gpus()
        if driver is not None:
            report["driver_cuda_version"] = driver
    report["jit"] = jit_cli.info_report()
    report["overlay"] = overlay.state()  # the flashinfer overlay (AOTINFER_FLASHINFER)
    for gpu in report["gpus"]:
        gpu["modules"] = choices_for(gpu["compute_capability"], report["driver_cuda_version"])
        gpu["compute_capability"] = "{}.{}".format(*gpu["compute_capability"])
    return report


def integrity(m: Dict[str, Any]) -> Dict[str, Optional[str]]:
    """Every file the loader may load (the builds of the merged manifest ``m``, providers' among
    them, and the CUDA runtime) against its size and sha256, as the loader and ``verify`` check
    them: path -> problem, None when intact."""
    files = [b for entry in m["modules"].values() for b in entry["builds"].values()]
    if isinstance(m.get("runtime"), dict):
        files.append(dict(m["runtime"], dir=_loader.OPS_DIR))
    return {os.path.join(b["dir"], b["file"]): _manifest.file_problem(os.path.join(b["dir"], b["file"]), b)
            for b in files}


def failures(report: Dict[str, Any]) -> List[str]:
    """What makes ``info`` exit 1: the modules a GPU of the report should load and cannot (not
    those it does not support by design), and the files of the install that are missing or
    damaged."""
    return [f"{gpu['name']} {name}" for gpu in report["gpus"] for name, choice in gpu["modules"].items()
            if choice["error"] and not choice["unsupported"]] + [
        path for path, problem in report["integrity"].items() if problem]


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
        for file, problem in module["damaged"].items():
            lines.append(f"  {'':<{width}}  DAMAGED: {file}: {problem}")
    bad = sum(1 for problem in report["integrity"].values() if problem)
    lines.append(f"files: {bad} of {len(report['integrity'])} missing or differ from the manifests' sha256"
                 if bad else f"files: all {len(report['integrity'])} match the manifests' sha256")
    lines += jit_cli.format_info(report["jit"])
    lines += overlay.format_state(report["overlay"])
    driver = report["driver_cuda_version"]
    if driver:
        too_old = driver_problem(driver, report["cuda_version"], False)
        lines.append(f"driver: supports CUDA {driver}" + (
            f"; too old for this build: {report['cuda_version']} needs an NVIDIA driver >= {report['driver_min']}."
            " Nothing loads, JIT builds included (they link this install's CUDA runtime): upgrade the"
            " driver, or install the release wheel of the driver's CUDA major" if too_old else ""))
    if not report["gpus"]:
        lines.append(f"GPUs: none ({report['no_gpu_reason']})")
    for gpu in report["gpus"]:
        label = "--cc" if gpu["index"] is None else f"cuda:{gpu['index']} {gpu['name']}"
        lines.append(f"{label} (compute capability {gpu['compute_capability']}):")
        for name, choice in gpu["modules"].items():
            if choice["unsupported"]:
                lines.append(f"  {name:<{width}}  {choice['error']}")
            elif choice.get("jit_build"):
                lines.append(f"  {name:<{width}}  {choice['jit_build']}")
            elif choice["file"] is None:
                lines.append(f"  {name:<{width}}  cannot load: {choice['error']}")
            elif choice["error"]:
                lines.append(f"  {name:<{width}}  {choice['file']}  cannot load: {choice['error']}")
            else:
                lines.append(f"  {name:<{width}}  {choice['file']}  ({choice['reason']})")
    failed = failures(report)
    if failed:
        lines.append(f"{len(failed)} module(s) or file(s) cannot load where they should; see above")
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


#: Exit statuses of ``python -m aotinfer``, as ``--help`` prints them.
EXIT_STATUS = """exit status:
  0    info: every module each GPU (or --cc) should load loads, and every listed file matches its
       sha256; modules a GPU does not support by design (e.g. prefill_sm90 off Hopper) do not count.
       verify: every file matches. build: everything asked for is built or cached.
  1    info: a module a GPU should load cannot, or a file is missing or damaged; verify: a file
       differs; build: a build failed; any command: the install is broken (the message says how
       to repair it)
  2    bad arguments
  141  the output was closed early (e.g. piped into head), as for a program killed by SIGPIPE
"""
#: 128 + SIGPIPE: the status a shell reports for a writer whose reader went away.
EXIT_BROKEN_PIPE = 141


def main(argv: Optional[List[str]] = None) -> int:
    try:
        status = _main(argv)
        sys.stdout.flush()  # inside the try: a closed pipe shows up here for buffered output
        return status
    except BrokenPipeError:
        # The reader (head, grep -q) went away: no traceback, and no second error when Python
        # flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _main(argv: Optional[List[str]]) -> int:
    parser = argparse.ArgumentParser(prog="python -m aotinfer", epilog=EXIT_STATUS,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, builds in this install, and what each GPU loads", epilog=EXIT_STATUS,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
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
