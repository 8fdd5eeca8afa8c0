"""Checks a release wheel before it ships; prints a report and exits 1 on any problem.

    python ci/check_wheel.py WHEEL [--arch-list "7.5 8.0 ... 12.0+PTX" | --arch-list release] [--max-mb 100]

- the file is tagged py3-none-manylinux_2_28_<arch>;
- auditwheel accepts its symbol versions for manylinux_2_28 and finds no external library but
  libtvm_ffi.so (from apache-tvm-ffi) and libcuda.so.1 (the driver);
- no shared object needs libtorch, libc10, libpython or a libcudart: the modules' CUDA calls all
  bind to the wheel's libaotinfer_cudart.so under its private version node, and that library
  exports the CUDA runtime API and nothing else;
- every (module, arch) that modules.toml and the arch list call for is there, its sha256 matches
  the manifest, nothing else is; each object holds SASS for its arch ('a' and 'f' variants
  included), and PTX exactly where the list says +PTX (read from the fatbin's entry headers);
- the flashinfer overlay's hook (aotinfer_overlay.pth and its module) sits at the wheel's root;
- the wheel is at most --max-mb megabytes. A table prints the bytes of every module at every arch,
  so growth shows in CI logs.
The arch list checked is --arch-list ("release": the release list of the wheel's CUDA major and
platform, python/aotinfer/_arch.py), else the one the manifest records.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import re
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("_aotinfer_modules", ROOT / "cmake/modules.py")
modules = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(modules)

TAG = re.compile(r"^aotinfer-(?P<version>[^-]+)-py3-none-manylinux_2_28_(?P<arch>x86_64|aarch64)\.whl$")
ALLOWED_EXTERNAL = {"libtvm_ffi.so", "libcuda.so.1"}
FORBIDDEN_NEEDED = ("libtorch", "libc10", "libpython")
# Libraries of NVIDIA's CuTeDSL: a build dependency only, never needed by or shipped in a wheel.
CUTEDSL_LIBRARIES = ("libcute_dsl_runtime", "libcuda_dialect_runtime", "libCuteDSL", "_cutlass_ir")
EM_CUDA = 190
FATBIN_MAGIC = 0xBA55ED50
FATBIN_PTX, FATBIN_ELF = 1, 2
# Flags of a fatbin entry (offset 40): the target's variant, as nvcc 13.0 writes them.
FATBIN_VARIANTS = {0x100000: "a", 0x200000: "f"}


def fatbin_entries(path: Path) -> set:
    """(kind, sm, variant suffix) of every entry of the fatbins in an object's .nv_fatbin section."""
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        section = ELFFile(f).get_section_by_name(".nv_fatbin")
        data = section.data() if section is not None else b""
    entries, offset = set(), 0
    while offset + 16 <= len(data):
        magic, _, header_size, size = struct.unpack_from("<IHHQ", data, offset)
        if magic != FATBIN_MAGIC:
            offset += 8  # containers are 8-byte aligned
            continue
        end, entry = offset + header_size + size, offset + header_size
        while entry + 64 <= end:
            kind, _, entry_size, payload = struct.unpack_from("<HHIQ", data, entry)
            if entry_size == 0:
                break
            sm, flags = struct.unpack_from("<I", data, entry + 28)[0], struct.unpack_from("<I", data, entry + 40)[0]
            entries.add((kind, sm, "".join(v for bit, v in FATBIN_VARIANTS.items() if flags & bit)))
            entry += entry_size + payload
        offset = end
    return entries


def linkage(path: Path):
    """(DT_NEEDED, exported names, {imported name: version node or None}) of a shared object."""
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        elf = ELFFile(f)
        needed = [t.needed for t in elf.get_section_by_name(".dynamic").iter_tags() if t.entry.d_tag == "DT_NEEDED"]
        versym, verneed = elf.get_section_by_name(".gnu.version"), elf.get_section_by_name(".gnu.version_r")
        nodes = {aux.entry.vna_other: aux.name for _, auxes in (verneed.iter_versions() if verneed else [])
                 for aux in auxes}
        exported, imported = set(), {}
        for i, sym in enumerate(elf.get_section_by_name(".dynsym").iter_symbols()):
            if sym["st_shndx"] == "SHN_UNDEF":
                if sym.name:
                    ndx = versym.get_symbol(i)["ndx"] if versym else 0
                    imported[sym.name] = nodes.get(ndx) if isinstance(ndx, int) else None
            elif sym["st_info"]["bind"] in ("STB_GLOBAL", "STB_WEAK"):
                exported.add(sym.name)
    return needed, exported, imported


def is_cuda_api(name: str) -> bool:
    return name.startswith(("cuda", "__cuda"))


def size_table(sizes: dict, archs) -> list:
    """Lines of a table: one row per module, one column per arch, bytes in each cell."""
    names = [a.name for a in archs]
    width = max(len(m) for m in sizes) if sizes else 6
    lines = [f"{'module':<{width}} " + " ".join(f"{n:>9}" for n in names) + f" {'total':>10}"]
    for module, by_arch in sizes.items():
        cells = " ".join(f"{by_arch[n]:>9}" if n in by_arch else f"{'-':>9}" for n in names)
        lines.append(f"{module:<{width}} {cells} {sum(by_arch.values()):>10}")
    return lines


def embedded_cubins(path: Path) -> list:
    """The SM (from e_flags) of every CUDA ELF image embedded in an object's .rodata: the kernels a
    CuTeDSL module carries (cmake/cutedsl.py) outside the .nv_fatbin of nvcc-compiled code."""
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        section = ELFFile(f).get_section_by_name(".rodata")
        data = section.data() if section is not None else b""
    sms, offset = [], data.find(b"\x7fELF\x02\x01")
    while offset >= 0:
        if struct.unpack_from("<H", data, offset + 18)[0] == EM_CUDA:
            flags = struct.unpack_from("<I", data, offset + 48)[0]
            # The SM sits in e_flags' low byte in the older CUDA ELF ABI (OS ABI 0x33, as sm_90a's
            # cubins have it), in its second byte in the newer one (0x41: sm_100f, sm_120).
            sms.append((flags >> 8) & 0xFF if data[offset + 7] == 0x41 else flags & 0xFF)
        offset = data.find(b"\x7fELF\x02\x01", offset + 1)
    return sms


def check(wheel: Path, arch_list: str | None, max_mb: float) -> list:
    problems = []
    match = TAG.match(wheel.name)
    if match is None:
        problems.append(f"tag: {wheel.name} is not aotinfer-<version>-py3-none-manylinux_2_28_<arch>.whl")

    report = subprocess.run([sys.executable, "-m", "auditwheel", "show", "--json", str(wheel)], capture_output=True, text=True)
    if report.returncode != 0:
        problems.append(f"auditwheel show failed: {report.stderr.strip()[-300:]}")
    else:
        shown = json.loads(report.stdout)
        sym = re.fullmatch(r"manylinux_2_(\d+)_\w+", shown.get("sym_tag", ""))
        print(f"auditwheel: symbol versions fit {shown.get('sym_tag')}; external libraries: {sorted(shown.get('external_libs', {}))}")
        if sym is None or int(sym.group(1)) > 28:
            problems.append(f"auditwheel: symbol versions need {shown.get('sym_tag')}, newer than manylinux_2_28")
        extra = set(shown.get("external_libs", {})) - ALLOWED_EXTERNAL
        if extra:
            problems.append(f"auditwheel: external libraries beyond {sorted(ALLOWED_EXTERNAL)}: {sorted(extra)}")

    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tmp)
        ops = Path(tmp) / "aotinfer" / "_ops"
        manifest = json.loads((ops / "manifest.json").read_text())
        if arch_list == "release":
            platform = match.group("arch") if match else "x86_64"
            arch_list = modules._arch.release_arch_list(int(manifest["cuda_version"].split(".")[0]), platform)
        archs = modules._arch.parse_arch_list(arch_list or manifest["arch_list"])
        if modules._arch.parse_arch_list(manifest["arch_list"]) != archs:
            problems.append(f"manifest: arch list {manifest['arch_list']!r}, expected {' '.join(map(str, archs))!r}")
        if match and manifest["package_version"] != match.group("version"):
            problems.append(f"manifest: version {manifest['package_version']} but the file says {match.group('version')}")
        node = "AOTINFER_CUDART_" + manifest["cuda_version"].split(".")[0]
        runtime = manifest.get("runtime") or {}
        runtime_path = ops / runtime.get("file", "libaotinfer_cudart.so")
        if not runtime_path.is_file():
            problems.append(f"{runtime_path.name}: missing (the CUDA runtime the modules link)")
        else:
            if hashlib.sha256(runtime_path.read_bytes()).hexdigest() != runtime.get("sha256"):
                problems.append(f"{runtime_path.name}: sha256 differs from the manifest")
            libs, exported, _ = linkage(runtime_path)
            stray = sorted(s for s in exported if not is_cuda_api(s) and s != node)
            if stray or not {"cudaLaunchKernel", "__cudaRegisterFatBinary"} <= exported:
                problems.append(f"{runtime_path.name}: exports {stray[:5]} beyond the CUDA runtime API, or lacks it")
            if any(lib.startswith(FORBIDDEN_NEEDED + ("libcudart", "libstdc++")) for lib in libs):
                problems.append(f"{runtime_path.name}: needs {libs}")
        declarations = modules.load_declarations(ROOT / "modules.toml")
        expected_files, sizes = {runtime_path.name}, {}
        for name, decl in declarations.items():
            entry = manifest["modules"].get(name)
            if entry is None:
                problems.append(f"manifest: module {name} missing")
                continue
            sizes[name] = {}  # a row even where no arch of the list is one the module builds for
            for arch in modules.module_archs(decl, archs):
                build = entry["builds"].get(arch.name)
                file = f"{name}_sm{arch.tag}.so"
                expected_files.add(file)
                path = ops / file
                if build is None or not path.is_file():
                    problems.append(f"{file}: missing (module {name}, arch {arch})")
                    continue
                sizes[name][arch.name] = path.stat().st_size
                if hashlib.sha256(path.read_bytes()).hexdigest() != build["sha256"]:
                    problems.append(f"{file}: sha256 differs from the manifest")
                sm = arch.major * 10 + arch.minor
                entries = fatbin_entries(path)
                if decl.get("cutedsl"):  # kernels embedded as cubins, the binding has no device code
                    cubins = embedded_cubins(path)
                    if not cubins or set(cubins) != {sm}:
                        problems.append(f"{file}: embedded CuTeDSL kernels for SMs {sorted(set(cubins))}, expected {sm}")
                    if (f".target sm_{arch.tag}".encode() in path.read_bytes()) != arch.ptx:
                        problems.append(f"{file}: PTX {'missing' if arch.ptx else 'present'} for {arch}")
                elif (FATBIN_ELF, sm, arch.suffix) not in entries:
                    problems.append(f"{file}: no SASS for sm_{arch.tag}: {sorted(entries)}")
                if not decl.get("cutedsl") and ((FATBIN_PTX, sm, "") in entries) != arch.ptx:
                    problems.append(f"{file}: PTX {'missing' if arch.ptx else 'present'} for {arch}")
                if any(e != (FATBIN_ELF, sm, arch.suffix) and e != (FATBIN_PTX, sm, "") for e in entries):
                    problems.append(f"{file}: code for other targets: {sorted(entries)}")
                libs, _, imported = linkage(path)
                bad = [lib for lib in libs if lib.startswith(FORBIDDEN_NEEDED + ("libcudart",) + CUTEDSL_LIBRARIES)]
                if bad or runtime_path.name not in libs:
                    problems.append(f"{file}: needs {libs}; expected {runtime_path.name} and none of {bad}")
                unbound = sorted(s for s, v in imported.items() if is_cuda_api(s) and v != node)
                if unbound:
                    problems.append(f"{file}: CUDA calls not bound to {node}: {unbound[:5]}")
        shipped_dsl = [str(p.relative_to(tmp)) for p in Path(tmp).rglob("*") if p.name.startswith(CUTEDSL_LIBRARIES)
                       or p.name in ("cutlass", "nvidia_cutlass_dsl")]
        if shipped_dsl:
            problems.append(f"parts of NVIDIA's CuTeDSL in the wheel (a build dependency only): {shipped_dsl[:5]}")
        for hook in ("aotinfer_overlay.pth", "_aotinfer_overlay_hook.py"):  # the flashinfer overlay's hook
            shipped = Path(tmp) / hook
            if not shipped.is_file() or shipped.read_bytes() != (ROOT / "python" / hook).read_bytes():
                problems.append(f"{hook}: missing from the wheel's root or differs from python/{hook}")
        extra = {p.name for p in ops.glob("*.so")} - expected_files
        if extra:
            problems.append(f"shared objects nobody declared: {sorted(extra)}")
        print("bytes per module and arch:")
        for line in size_table(sizes, archs):
            print("  " + line)
        if runtime_path.is_file():
            print(f"  + {runtime_path.name}: {runtime_path.stat().st_size} bytes, shared by every module")

    size_mb = wheel.stat().st_size / 1e6
    print(f"wheel: {wheel.name}, {size_mb:.2f} MB (limit {max_mb:g} MB)")
    if size_mb > max_mb:
        problems.append(f"size: {size_mb:.1f} MB is over {max_mb:g} MB")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--arch-list")
    parser.add_argument("--max-mb", type=float, default=100)
    args = parser.parse_args()
    problems = check(args.wheel, args.arch_list, args.max_mb)
    for p in problems:
        print(f"PROBLEM: {p}")
    print("check_wheel: OK" if not problems else f"check_wheel: {len(problems)} problem(s)")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
