"""Build helper: turns modules.toml and the arch list into CMake targets, and writes the manifest.

    python cmake/modules.py plan --declarations modules.toml --arch-list "8.0 9.0a" --cuda-version 13.0
                                 --machine x86_64 --out plan.cmake
        Validates the declarations and the arch list (empty: the release list of that CUDA major
        and machine; every arch must be one that CUDA's nvcc builds) and writes a CMake file that
        sets the resolved list and, for each module, its sources and the archs it is built for
        (see CMakeLists.txt for the names).

    python cmake/modules.py manifest --declarations modules.toml --arch-list ... --ops-dir DIR
                                     --package-version V --cuda-version V --tvm-ffi-version V
                                     --runtime libaotinfer_cudart.so
        Run at install time: hashes every shared object in DIR (the modules' and the CUDA
        runtime library they share) and writes DIR/manifest.json.

Arch parsing lives in python/aotinfer/_arch.py, loaded by path, so that the
build and the loader read an arch list the same way without importing the package.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("_aotinfer_arch", ROOT / "python/aotinfer/_arch.py")
_arch = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _arch  # dataclasses look their module up by name
_spec.loader.exec_module(_arch)

DECLARATION_KEYS = {"sources", "functions", "sm_majors", "cutedsl"}
# The DSL that compiles a module's CuTeDSL kernel file at build time (never needed at run time).
CUTEDSL_REQUIREMENT = "nvidia-cutlass-dsl>=4.8,<4.9"
# Bindings write into caller-allocated outputs and return nothing.
SCHEMA = re.compile(r"^\(.*\) -> \(\)$")

# Oldest Linux driver that runs binaries of each CUDA major (CUDA's minor-version compatibility).
# PTX in a wheel is compiled by the driver, which for that needs one at least as new as the
# toolkit that wrote it.
DRIVER_MIN_FOR_CUDA_MAJOR = {12: "525.60.13", 13: "580.65.06"}


def load_declarations(path: Path) -> dict:
    with open(path, "rb") as f:
        modules = tomllib.load(f)
    for name, decl in modules.items():
        where = f"{path.name} [{name}]"
        if not name.isidentifier():
            sys.exit(f"{where}: a module name must be an identifier")
        unknown = set(decl) - DECLARATION_KEYS
        if unknown:
            sys.exit(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(DECLARATION_KEYS)}")
        if not decl.get("sources") or not all(isinstance(s, str) for s in decl["sources"]):
            sys.exit(f"{where}: 'sources' must be a non-empty list of strings")
        functions = decl.get("functions")
        if not isinstance(functions, dict) or not functions:
            sys.exit(f"{where}: 'functions' must map each export to its schema")
        for function, schema in functions.items():
            if not (function.isidentifier() and isinstance(schema, str) and SCHEMA.match(schema)):
                sys.exit(f"{where}: '{function}' needs a schema like \"(Tensor(a!) out, Tensor input) -> ()\"")
        if decl["sources"] != sorted(decl["sources"]):
            sys.exit(f"{where}: list the sources sorted")
        for source in decl["sources"]:
            if not (ROOT / source).is_file():
                sys.exit(f"{where}: source {source} does not exist")
        majors = decl.get("sm_majors")
        if majors is not None and not (majors and all(isinstance(m, int) for m in majors)):
            sys.exit(f"{where}: 'sm_majors' must be a non-empty list of integers")
        kernels = decl.get("cutedsl")
        if kernels is not None:
            if not (isinstance(kernels, str) and kernels.endswith(".py") and (ROOT / kernels).is_file()):
                sys.exit(f"{where}: 'cutedsl' must name the module's CuTeDSL kernel file (a .py file that exists)")
            if majors is None:
                sys.exit(f"{where}: a CuTeDSL module lists its 'sm_majors' (the DSL builds for sm_80 and newer)")
    return modules


def check_cutedsl(modules: dict, archs) -> None:
    """Exits with what to install when a module to build needs the DSL and it is missing."""
    needed = [name for name, decl in modules.items() if decl.get("cutedsl") and module_archs(decl, archs)]
    if not needed:
        return
    from importlib import metadata

    try:
        version = metadata.version("nvidia-cutlass-dsl")
        import cutlass.cute  # noqa: F401  (the DSL's compiler loads)
    except Exception as e:  # not installed, or it does not import
        sys.exit(
            f"modules.toml: {', '.join(needed)} {'is' if len(needed) == 1 else 'are'} written in CuTeDSL and compiled"
            f" when aotinfer is built, which needs {CUTEDSL_REQUIREMENT} in the build environment ({e!r})."
            f" An isolated build ('pip install .') installs it; with --no-build-isolation, first run:"
            f" pip install '{CUTEDSL_REQUIREMENT}'"
        )
    if not version.startswith("4.8."):
        sys.exit(f"modules.toml: the CuTeDSL modules are written for {CUTEDSL_REQUIREMENT}, found {version}")


def module_archs(decl: dict, archs) -> tuple:
    return _arch.supported_archs(archs, decl.get("sm_majors"))


def cuda_architectures(arch) -> str:
    """The CMake CUDA_ARCHITECTURES value for one arch: SASS only, or SASS plus PTX."""
    return f"{arch.tag}-real;{arch.tag}-virtual" if arch.ptx else f"{arch.tag}-real"


def plan(args) -> None:
    modules = load_declarations(args.declarations)
    cuda_major = int(args.cuda_version.split(".")[0])
    try:
        archs = _arch.parse_arch_list(args.arch_list or _arch.release_arch_list(cuda_major, args.machine))
    except (ValueError, KeyError) as e:
        sys.exit(f"AOTINFER_CUDA_ARCH_LIST: {e}")
    refused = _arch.unbuildable(archs, cuda_major)
    if refused:
        known = " ".join("{}.{}".format(*cc) for cc in _arch.TOOLKIT_ARCHS[cuda_major])
        sys.exit(
            f"AOTINFER_CUDA_ARCH_LIST: CUDA {args.cuda_version}'s nvcc does not build for"
            f" {' '.join(map(str, refused))}; it builds for {known}"
        )
    check_cutedsl(modules, archs)
    lines = [
        "# Generated by cmake/modules.py from modules.toml; do not edit.",
        f'set(AOTINFER_CUDA_ARCH_LIST "{" ".join(str(a) for a in archs)}")',
        f"set(AOTINFER_MODULES {' '.join(modules)})",
    ]
    for name, decl in modules.items():
        built = module_archs(decl, archs)
        lines.append(f"set(AOTINFER_{name}_SOURCES {' '.join(decl['sources'])})")
        lines.append(f"set(AOTINFER_{name}_ARCHS {' '.join(a.tag for a in built)})")
        lines.append(f'set(AOTINFER_{name}_CUTEDSL "{decl.get("cutedsl", "")}")')
        for a in built:
            lines.append(f'set(AOTINFER_ARCH_{a.tag}_CUDA_ARCHITECTURES "{cuda_architectures(a)}")')
            lines.append(f'set(AOTINFER_ARCH_{a.tag}_NAME "{a}")')
    args.out.write_text("\n".join(lines) + "\n")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest(args) -> None:
    modules = load_declarations(args.declarations)
    archs = _arch.parse_arch_list(args.arch_list)
    cuda_major = int(args.cuda_version.split(".")[0])
    entries = {}
    for name, decl in modules.items():
        builds = {}
        for a in module_archs(decl, archs):
            path = args.ops_dir / f"{name}_sm{a.tag}.so"
            if not path.is_file():
                sys.exit(f"manifest: {path} was not built")
            builds[a.name] = {
                "file": path.name,
                "sha256": sha256(path),
                "size": path.stat().st_size,
                "sass": a.sass,
                "ptx": f"compute_{a.tag}" if a.ptx else None,
            }
        entries[name] = {
            "sources": decl["sources"],
            "cutedsl": decl.get("cutedsl"),
            "functions": decl["functions"],
            "sm_majors": decl.get("sm_majors"),
            "builds": builds,
        }
    runtime = args.ops_dir / args.runtime
    if not runtime.is_file():
        sys.exit(f"manifest: {runtime} was not built")
    data = {
        "package_version": args.package_version,
        "cuda_version": args.cuda_version,
        "driver_min": DRIVER_MIN_FOR_CUDA_MAJOR.get(cuda_major),
        "tvm_ffi_version": args.tvm_ffi_version,
        "arch_list": " ".join(str(a) for a in archs),
        # The CUDA runtime every module links (CMakeLists.txt: libaotinfer_cudart.so).
        "runtime": {"file": runtime.name, "sha256": sha256(runtime), "size": runtime.stat().st_size},
        "modules": entries,
    }
    (args.ops_dir / "manifest.json").write_text(json.dumps(data, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in ("plan", "manifest"):
        p = sub.add_parser(command)
        p.add_argument("--declarations", type=Path, required=True)
        p.add_argument("--arch-list", required=True)
        p.add_argument("--cuda-version", required=True)
    sub.choices["plan"].add_argument("--out", type=Path, required=True)
    sub.choices["plan"].add_argument("--machine", default="x86_64")
    m = sub.choices["manifest"]
    m.add_argument("--ops-dir", type=Path, required=True)
    m.add_argument("--package-version", required=True)
    m.add_argument("--tvm-ffi-version", required=True)
    m.add_argument("--runtime", default="libaotinfer_cudart.so")
    args = parser.parse_args()
    {"plan": plan, "manifest": manifest}[args.command](args)


if __name__ == "__main__":
    main()
