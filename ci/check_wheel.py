"""Checks a release wheel before it ships; prints a report and exits 1 on any problem.

    python ci/check_wheel.py WHEEL [--arch-list "7.5 8.0 ... 12.0+PTX"] [--max-mb 100]

- the file is tagged py3-none-manylinux_2_28_<arch>;
- auditwheel accepts its symbol versions for manylinux_2_28 and finds no external library but
  libtvm_ffi.so (from apache-tvm-ffi) and libcuda.so.1 (the driver);
- no shared object needs libtorch, libc10 or libpython;
- every (module, arch) that modules.toml and the arch list call for is there, its sha256 matches
  the manifest, nothing else is; each object holds SASS for its arch, and PTX exactly where the
  list says +PTX (read from the fatbin's entry headers);
- the wheel is at most --max-mb megabytes; the size of every shared object is printed.
The arch list checked is --arch-list, else the one the manifest records.
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
FATBIN_MAGIC = 0xBA55ED50
FATBIN_PTX, FATBIN_ELF = 1, 2


def fatbin_entries(path: Path) -> set:
    """(kind, sm) of every entry of the fatbins in a shared object's .nv_fatbin section."""
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
            entries.add((kind, struct.unpack_from("<I", data, entry + 28)[0]))
            entry += entry_size + payload
        offset = end
    return entries


def needed(path: Path) -> list:
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        dynamic = ELFFile(f).get_section_by_name(".dynamic")
        return [t.needed for t in dynamic.iter_tags() if t.entry.d_tag == "DT_NEEDED"]


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
        archs = modules._arch.parse_arch_list(arch_list or manifest["arch_list"])
        if modules._arch.parse_arch_list(manifest["arch_list"]) != archs:
            problems.append(f"manifest: arch list {manifest['arch_list']!r}, expected {' '.join(map(str, archs))!r}")
        if match and manifest["package_version"] != match.group("version"):
            problems.append(f"manifest: version {manifest['package_version']} but the file says {match.group('version')}")
        declarations = modules.load_declarations(ROOT / "modules.toml")
        expected_files = set()
        print(f"{'shared object':<28} {'MB':>7}  contents")
        for name, decl in declarations.items():
            entry = manifest["modules"].get(name)
            if entry is None:
                problems.append(f"manifest: module {name} missing")
                continue
            for arch in modules.module_archs(decl, archs):
                build = entry["builds"].get(arch.name)
                file = f"{name}_sm{arch.tag}.so"
                expected_files.add(file)
                path = ops / file
                if build is None or not path.is_file():
                    problems.append(f"{file}: missing (module {name}, arch {arch})")
                    continue
                if hashlib.sha256(path.read_bytes()).hexdigest() != build["sha256"]:
                    problems.append(f"{file}: sha256 differs from the manifest")
                sm = arch.major * 10 + arch.minor
                entries = fatbin_entries(path)
                if (FATBIN_ELF, sm) not in entries:
                    problems.append(f"{file}: no SASS for sm_{arch.tag}")
                if ((FATBIN_PTX, sm) in entries) != arch.ptx:
                    problems.append(f"{file}: PTX {'missing' if arch.ptx else 'present'} for {arch}")
                if any(kind == FATBIN_ELF and s != sm for kind, s in entries):
                    problems.append(f"{file}: SASS for other archs: {sorted(entries)}")
                bad = [lib for lib in needed(path) if lib.startswith(FORBIDDEN_NEEDED)]
                if bad:
                    problems.append(f"{file}: needs {bad}")
                kinds = ", ".join(f"{'PTX' if k == FATBIN_PTX else 'SASS'} {s}" for k, s in sorted(entries))
                print(f"{file:<28} {path.stat().st_size / 1e6:7.2f}  {kinds}")
        extra = {p.name for p in ops.glob("*.so")} - expected_files
        if extra:
            problems.append(f"shared objects nobody declared: {sorted(extra)}")

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
