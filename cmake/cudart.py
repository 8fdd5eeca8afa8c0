"""Build helper: the static CUDA runtime, made exportable for libaotinfer_cudart.so.

    python cmake/cudart.py --archive libcudart_static.a --out DIR --version-node AOTINFER_CUDART_13

Every kernel module links the CUDA runtime API from one shared library in the wheel,
libaotinfer_cudart.so, instead of carrying its own static copy. That library is libcudart_static.a
linked whole, but NVIDIA compiles the archive with its API hidden (st_other STV_HIDDEN), and a
linker cannot export a hidden symbol. This writes DIR/libcudart_exportable.a, the same archive with
the visibility of the runtime's API (every defined global named cuda* or __cuda*, the set
libcudart.so exports) set to default, byte for byte otherwise; and DIR/cudart.map, the version
script that exports exactly those symbols under a private version node. Modules linked against the
library bind each call to that node, so no other CUDA runtime in the process (torch's
libcudart.so.12, say, whose symbols carry version libcudart.so.12) can take their place.
"""

from __future__ import annotations

import argparse
import re
import struct
from pathlib import Path

API = re.compile(rb"^(cuda|__cuda)[A-Z]")
SHT_SYMTAB, STB_GLOBAL, STV_HIDDEN = 2, 1, 2


def archive_members(data: bytes):
    """(offset, size) of each member of a System V / GNU ar archive."""
    if not data.startswith(b"!<arch>\n"):
        raise SystemExit("cudart.py: not an ar archive")
    offset = 8
    while offset + 60 <= len(data):
        size = int(data[offset + 48 : offset + 58].decode().strip())
        yield offset + 60, size
        offset += 60 + size + (size & 1)


def unhide_api(data: bytearray, start: int, size: int) -> list:
    """Give the runtime API symbols of one ELF64 little-endian member default visibility, in place."""
    member = memoryview(data)[start : start + size]
    if bytes(member[:4]) != b"\x7fELF" or member[4] != 2 or member[5] != 1:
        return []  # the archive's symbol index or name table, not an object
    shoff, = struct.unpack_from("<Q", member, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", member, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", member, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _, kind, _, _, offset, length, link, _, _, entsize in sections:
        if kind != SHT_SYMTAB:
            continue
        strtab = sections[link][4]
        for sym in range(offset, offset + length, entsize):
            name_offset, info, other, shndx = struct.unpack_from("<IBBH", member, sym)
            if info >> 4 != STB_GLOBAL or shndx == 0 or other & 3 != STV_HIDDEN:
                continue
            end = bytes(member[strtab + name_offset : strtab + name_offset + 256]).split(b"\0", 1)[0]
            if API.match(end):
                member[sym + 5] = other & ~3  # STV_DEFAULT
                names.append(end.decode())
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archive", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--version-node", required=True)
    args = parser.parse_args()
    data = bytearray(args.archive.read_bytes())
    exported = [name for start, size in list(archive_members(data)) for name in unhide_api(data, start, size)]
    if not any(name == "cudaLaunchKernel" for name in exported):
        raise SystemExit(f"cudart.py: found no hidden CUDA runtime API in {args.archive}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "libcudart_exportable.a").write_bytes(data)
    (args.out / "cudart.map").write_text(
        f"{args.version_node} {{\n  global: cuda*; __cuda*;\n  local: *;\n}};\n"
    )


if __name__ == "__main__":
    main()
