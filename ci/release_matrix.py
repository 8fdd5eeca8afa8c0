"""The release build's job matrices, from the release arch lists in python/aotinfer/_arch.py.

    python ci/release_matrix.py     # prints shards=<json> and wheels=<json> for $GITHUB_OUTPUT

One shard job per (CUDA version, platform, arch of that CUDA major's release list for that
platform), one merge job per (CUDA version, platform). _arch.py is the one place that says what a
release is built for; the workflow (.github/workflows/wheels.yml) and ci/check_wheel.py read it.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("_aotinfer_arch", ROOT / "python/aotinfer/_arch.py")
_arch = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _arch
_spec.loader.exec_module(_arch)

PLATFORMS = [{"arch": "x86_64", "runner": "ubuntu-24.04"}, {"arch": "aarch64", "runner": "ubuntu-24.04-arm"}]


def matrices() -> dict:
    wheels, shards = [], []
    for major, cuda in sorted(_arch.RELEASE_CUDA.items()):
        for platform in PLATFORMS:
            wheels.append({"cuda": cuda, "platform": platform})
            for sm in _arch.release_arch_list(major, platform["arch"]).split():
                shards.append({"cuda": cuda, "platform": platform, "sm": sm})
    return {"shards": {"include": shards}, "wheels": {"include": wheels}}


def main() -> None:
    for name, matrix in matrices().items():
        print(f"{name}={json.dumps(matrix, separators=(',', ':'))}")


if __name__ == "__main__":
    main()
