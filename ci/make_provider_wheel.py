"""Repackages an aotinfer wheel's shared objects as a provider wheel, installable beside aotinfer.

    python ci/make_provider_wheel.py WHEEL --out DIR

A release that outgrows its size budget can move some archs out of the main wheel: build a wheel
for those archs (AOTINFER_CUDA_ARCH_LIST="10.0f", say), then turn it into the package
aotinfer-ops-sm100f, which holds aotinfer_ops_sm100f/_ops/ (the shared objects, their manifest and
its own copy of libaotinfer_cudart.so: a process loads one of the copies, the dynamic linker
matching them by soname) and registers it in the "aotinfer.ops" entry-point group. aotinfer's
loader adds its builds for archs the main wheel lacks. It requires the same aotinfer version
(local label, and so CUDA major, included).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from wheelfile import dist_info, pack, unpack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        source = unpack(args.wheel, Path(tmp) / "source")
        manifest = json.loads((source / "aotinfer/_ops/manifest.json").read_text())
        version = manifest["package_version"]
        tags = "_".join("sm" + a.replace(".", "").replace("+PTX", "") for a in manifest["arch_list"].split())
        package = f"aotinfer_ops_{tags}"
        tag = args.wheel.name.split("-", 2)[2][: -len(".whl")]  # py3-none-<platform>
        tree = Path(tmp) / "provider"
        shutil.copytree(source / "aotinfer/_ops", tree / package / "_ops")
        (tree / package / "__init__.py").write_text(f'"""aotinfer kernels for {manifest["arch_list"]}; loaded by aotinfer."""\n')
        info = tree / f"{package}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\n"
            f"Name: {package.replace('_', '-')}\n"
            f"Version: {version}\n"
            f"Summary: aotinfer's kernels for {manifest['arch_list']}, as a separate package\n"
            f"Requires-Dist: aotinfer=={version}\n"
        )
        (info / "WHEEL").write_text(f"Wheel-Version: 1.0\nGenerator: aotinfer make_provider_wheel\nRoot-Is-Purelib: false\nTag: {tag}\n")
        (info / "entry_points.txt").write_text(f"[aotinfer.ops]\n{tags} = {package}\n")
        (info / "RECORD").write_text("")
        assert dist_info(tree) == info
        out = pack(tree, args.out / f"{package}-{version}-{tag}.whl")
    print(f"provider wheel: {out}")


if __name__ == "__main__":
    main()
