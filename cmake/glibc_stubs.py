"""Link-time stand-ins for glibc that hold only what an older glibc exported, for manylinux builds.

    python cmake/glibc_stubs.py --glibc 2.28 --out DIR

A shared object linked on a new distribution binds each glibc function to the newest version the
build machine has (pthread_create@GLIBC_2.34, say), so it will not load where glibc is older.
This writes, for libc, libm, libpthread, libdl, librt and the dynamic loader, a stub library with
the same soname whose every symbol carries the newest version no newer than --glibc among those
the build machine's glibc still exports (the version a build on that older glibc binds), and
leaves out symbols that glibc did not have yet. Linking against the stubs (-L DIR
ahead of the system paths, -z defs) binds every reference to a version the older glibc has, or
fails at link time when the code needs something newer. At run time the real glibc is used; it
keeps every old version. The stubs are never shipped.

Which library a symbol lived in before glibc 2.34 folded libpthread, libdl and part of librt into
libc decides the library it is recorded against; sonames are matched by name prefix (PRE_2_34).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

SYSTEM_LIBS = {
    "libc.so.6": "libc.so",
    "libm.so.6": "libm.so",
    "ld-linux-x86-64.so.2": None,
}
# Where symbols lived before glibc 2.34 moved them into libc.so.6.
PRE_2_34 = {
    "libpthread.so.0": re.compile(r"^(__)?(pthread_|sem_)"),
    "libdl.so.2": re.compile(r"^(dlopen|dlclose|dlsym|dlvsym|dlerror|dladdr1?|dlinfo|dlmopen)$"),
    "librt.so.1": re.compile(r"^(shm_|mq_|timer_|aio_|lio_)"),
}
DEV_NAMES = {"libpthread.so.0": "libpthread.so", "libdl.so.2": "libdl.so", "librt.so.1": "librt.so"}

SYMBOL_LINE = re.compile(
    r"^\s*\d+:\s+[0-9a-f]+\s+(\d+|0x[0-9a-f]+)\s+(FUNC|OBJECT|TLS|IFUNC|NOTYPE)\s+(GLOBAL|WEAK)\s+\S+\s+(\d+)\s+(\S+?)@@?(GLIBC_[\d.]+)"
)


def version_key(version: str):
    return tuple(int(p) for p in version[len("GLIBC_"):].split("."))


def find_system_lib(soname: str) -> Path:
    out = subprocess.run(["gcc", f"-print-file-name={soname}"], capture_output=True, text=True).stdout.strip()
    path = Path(out)
    if not path.is_absolute() or not path.exists():
        for d in ("/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64", "/lib/aarch64-linux-gnu"):
            if (Path(d) / soname).exists():
                return Path(d) / soname
        sys.exit(f"glibc_stubs: cannot find {soname}")
    return path


def exported(path: Path) -> dict:
    """name -> (type, size, [versions]) of the versioned dynamic symbols of a library."""
    text = subprocess.run(["readelf", "--dyn-syms", "--wide", str(path)], capture_output=True, text=True, check=True).stdout
    symbols: dict = {}
    for line in text.splitlines():
        m = SYMBOL_LINE.match(line)
        if m is None or m.group(4) == "UND":
            continue
        size, kind, _, _, name, version = m.groups()
        entry = symbols.setdefault(name, [kind, int(size, 0), []])
        entry[2].append(version)
    return symbols


def stub_library(out: Path, soname: str, symbols: dict) -> None:
    """Assemble a shared object `soname` defining `symbols` (name -> (kind, size, version))."""
    asm, nodes = [], {}
    for name, (kind, size, version) in sorted(symbols.items()):
        nodes.setdefault(version, []).append(name)
        if kind == "OBJECT":
            asm += [".data", f".globl {name}", f".type {name},@object", f".size {name},{max(size, 1)}",
                    f"{name}:", f".zero {max(size, 1)}"]
        elif kind == "TLS":
            asm += [".section .tbss,\"awT\",@nobits", f".globl {name}", f".type {name},@tls_object",
                    f".size {name},{max(size, 1)}", f"{name}:", f".zero {max(size, 1)}"]
        else:
            asm += [".text", f".globl {name}", f".type {name},@function", f"{name}:", "ret"]
    script = []
    previous = None
    for version in sorted(nodes, key=version_key):
        body = " ".join(f"{n};" for n in nodes[version])
        script.append(f"{version} {{ global: {body} }}{' ' + previous if previous else ''};")
        previous = version
    src, vers = out / f"{soname}.s", out / f"{soname}.map"
    src.write_text("\n".join(asm) + "\n")
    vers.write_text("\n".join(script) + "\n")
    subprocess.run(
        ["gcc", "-shared", "-nostdlib", "-o", str(out / soname), str(src),
         f"-Wl,--version-script={vers}", f"-Wl,-soname,{soname}"],
        check=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--glibc", required=True, help="oldest glibc to run on, e.g. 2.28")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    limit = version_key("GLIBC_" + args.glibc)
    args.out.mkdir(parents=True, exist_ok=True)

    libraries: dict = {soname: {} for soname in list(SYSTEM_LIBS) + list(PRE_2_34)}
    for soname in SYSTEM_LIBS:
        for name, (kind, size, versions) in exported(find_system_lib(soname)).items():
            old_enough = [v for v in versions if version_key(v) <= limit]
            if not old_enough:
                continue  # did not exist yet: references must fail to link
            version = max(old_enough, key=version_key)
            home = soname
            if soname == "libc.so.6":
                home = next((lib for lib, pattern in PRE_2_34.items() if pattern.match(name)), soname)
            libraries[home][name] = (kind, size, version)
    for soname, symbols in libraries.items():
        stub_library(args.out, soname, symbols)
    # What -lc, -lm, -lpthread, -ldl and -lrt find: the stubs, plus libc's static part.
    nonshared = find_system_lib("libc_nonshared.a")
    (args.out / "libc.so").write_text(
        f"GROUP ( {args.out / 'libc.so.6'} {nonshared} AS_NEEDED ( {args.out / 'ld-linux-x86-64.so.2'} ) )\n"
    )
    for soname, dev in {"libm.so.6": "libm.so", **DEV_NAMES}.items():
        link = args.out / dev
        if link.exists() or link.is_symlink():
            link.unlink()
        link.symlink_to(soname)


if __name__ == "__main__":
    main()
