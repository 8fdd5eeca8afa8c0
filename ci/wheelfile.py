"""Unpacking and packing wheels, for the scripts that merge shards and make provider wheels."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def unpack(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(into)
    return into


def dist_info(root: Path) -> Path:
    (found,) = root.glob("*.dist-info")
    return found


def pack(root: Path, wheel: Path) -> Path:
    """Zip the tree at root into wheel, writing its dist-info RECORD (sha256 of every file)."""
    record = dist_info(root) / "RECORD"
    files = sorted(p for p in root.rglob("*") if p.is_file() and p != record)
    lines = []
    for path in files:
        digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()
        lines.append(f"{path.relative_to(root).as_posix()},sha256={digest},{path.stat().st_size}")
    lines.append(f"{record.relative_to(root).as_posix()},,")
    record.write_text("\n".join(lines) + "\n")
    wheel.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for path in files + [record]:  # RECORD last, as wheel tools write it
            z.write(path, path.relative_to(root).as_posix())
    return wheel
