"""The source distribution holds the sources, never build leftovers, even when built from a
checkout that has been built in (build/, objects, installed kernels)."""

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LEFTOVERS = [
    "build/cp311-abi3-linux_x86_64/CMakeFiles/scale_sm90a.dir/csrc/scale.cu.o",
    "build/cp311-abi3-linux_x86_64/include/aotinfer/generated.h",
    "build/cp311-abi3-linux_x86_64/cmake/modules.cmake",
    "python/aotinfer/_ops/scale_sm90a.so",
    "csrc/scale.cu.o",
]


def test_sdist_has_sources_and_no_build_leftovers(tmp_path):
    pytest.importorskip("scikit_build_core")
    tree = tmp_path / "tree"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("needs a git checkout")
    for name in tracked.stdout.split():
        if (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    for name in LEFTOVERS:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_bytes(b"\0")
    script = "import sys, scikit_build_core.build as b; print(b.build_sdist(sys.argv[1]))"
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "dist")], cwd=tree, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    with tarfile.open(tmp_path / "dist" / out.stdout.split()[-1]) as sdist:
        names = [n.split("/", 1)[1] for n in sdist.getnames() if "/" in n]
    assert not [n for n in names if n.startswith(("build/", "dist/")) or n.endswith((".o", ".so"))], names
    for needed in ["modules.toml", "CMakeLists.txt", "cmake/modules.py", "cmake/cudart.py", "csrc/scale.cu",
                   "include/aotinfer/scale.cuh", "python/aotinfer/_loader.py", "pyproject.toml"]:
        assert needed in names
