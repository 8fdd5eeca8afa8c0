"""Merges per-arch shard wheels into one release wheel, rebuilding its manifest from the files.

    python ci/merge_wheels.py --out DIR SHARD.whl [SHARD.whl ...]

Each shard is the wheel one CI job built for one arch (AOTINFER_CUDA_ARCH_LIST="9.0a", say). The
shards must share the version, the platform tag, the CUDA version and the tvm-ffi version. The
merged wheel holds every shard's shared objects; its manifest is written anew by the build's own
helper (cmake/modules.py manifest) from modules.toml, the union of the arch lists and the files
themselves, so it hashes what was merged rather than trusting the shards' records.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from wheelfile import pack, unpack

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("shards", type=Path, nargs="+")
    args = parser.parse_args()

    names = {s.name for s in args.shards}
    if len(names) != 1:
        sys.exit(f"merge_wheels: shards differ in name or tag: {sorted(names)}")
    with tempfile.TemporaryDirectory() as tmp:
        trees = [unpack(s, Path(tmp) / f"shard{i}") for i, s in enumerate(args.shards)]
        manifests = [json.loads((t / "aotinfer/_ops/manifest.json").read_text()) for t in trees]
        for key in ("package_version", "cuda_version", "tvm_ffi_version"):
            values = {m[key] for m in manifests}
            if len(values) != 1:
                sys.exit(f"merge_wheels: shards differ in {key}: {sorted(values)}")
        merged, ops = trees[0], trees[0] / "aotinfer/_ops"
        for tree in trees[1:]:
            for so in sorted((tree / "aotinfer/_ops").glob("*.so")):
                target = ops / so.name
                if target.exists():
                    if target.read_bytes() != so.read_bytes():
                        sys.exit(f"merge_wheels: two shards built {so.name} differently")
                    continue
                shutil.copy2(so, target)
        arch_list = " ".join(sorted({a for m in manifests for a in m["arch_list"].split()}))
        first = manifests[0]
        subprocess.run(
            [sys.executable, str(ROOT / "cmake/modules.py"), "manifest",
             "--declarations", str(ROOT / "modules.toml"), "--arch-list", arch_list, "--ops-dir", str(ops),
             "--package-version", first["package_version"], "--cuda-version", first["cuda_version"],
             "--tvm-ffi-version", first["tvm_ffi_version"]],
            check=True,
        )
        out = pack(merged, args.out / args.shards[0].name)
    rebuilt = json.loads(subprocess.run(["unzip", "-p", str(out), "aotinfer/_ops/manifest.json"],
                                        capture_output=True, text=True, check=True).stdout)
    print(f"merged {len(args.shards)} shards into {out} for {rebuilt['arch_list']}")


if __name__ == "__main__":
    main()
