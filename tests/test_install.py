"""What servers and packagers do to an install: broken provider packages, a corrupted manifest,
missing or damaged kernel files, and a driver too old for the build. All on the CPU: provider
packages and copies of the installed package are made in temporary directories, and a stand-in
libcuda answers for the driver."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

import aotinfer
from aotinfer import _device, _loader, _manifest, cli

PACKAGE = Path(aotinfer.__file__).resolve().parent
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def fresh_manifest():
    """Clear the loader's cached manifests around a test that changes what they read."""
    _manifest._main_manifest.cache_clear()
    _loader.manifest.cache_clear()
    yield
    _manifest._main_manifest.cache_clear()
    _loader.manifest.cache_clear()


def installed_arch():
    """An arch this install has for every module, and its compute capability."""
    arch = sorted(_loader.module_builds("scale"))[0]
    return arch, (arch.major, arch.minor)


# ---- provider packages ------------------------------------------------------------------------


def make_provider(site: Path, name: str, manifest, files=()) -> None:
    """An installed provider package `name` in `site`: its _ops/ with `manifest` and `files`."""
    ops = site / name / "_ops"
    ops.mkdir(parents=True)
    (site / name / "__init__.py").write_text("")
    (ops / "manifest.json").write_text(manifest if isinstance(manifest, str) else json.dumps(manifest))
    for file in files:
        (ops / file).write_bytes(b"\0")
    info = site / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[aotinfer.ops]\n{name} = {name}\n")


def provider_manifest(arch="7.5", file="scale_sm75.so", **changes):
    main = _manifest._main_manifest()
    data = {
        "package_version": main["package_version"],
        "cuda_version": main["cuda_version"],
        "arch_list": arch,
        "modules": {"scale": {"sources": [], "functions": {}, "sm_majors": None,
                              "builds": {arch: {"file": file, "sha256": "0" * 64, "ptx": None}}}},
    }
    data.update(changes)
    return data


BROKEN_PROVIDERS = {
    "not_json": "{ this is not json",
    "no_modules": {"package_version": "x"},
    "modules_not_a_table": lambda: provider_manifest(modules=["scale"]),
    "build_not_a_table": lambda: provider_manifest(modules={"scale": {"functions": {}, "builds": {"7.5": "x.so"}}}),
    "bad_arch_name": lambda: provider_manifest(arch="sm75"),
    "file_outside_ops": lambda: provider_manifest(file="../../evil.so"),
    "other_version": lambda: provider_manifest(package_version="0.0.1"),
    "other_cuda": lambda: provider_manifest(cuda_version="11.8"),
}


@pytest.mark.parametrize("kind", sorted(BROKEN_PROVIDERS))
def test_broken_provider_is_skipped_with_one_warning(kind, tmp_path, monkeypatch, fresh_manifest):
    if (7, 5) in {(a.major, a.minor) for a in _loader.module_builds("scale")}:
        pytest.skip("this install has 7.5 itself")
    manifest = BROKEN_PROVIDERS[kind]
    make_provider(tmp_path, "aotinfer_ops_broken", manifest() if callable(manifest) else manifest)
    make_provider(tmp_path, "aotinfer_ops_good", provider_manifest(), ["scale_sm75.so"])
    monkeypatch.syspath_prepend(str(tmp_path))
    _loader.manifest.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        merged = _loader.manifest()
        cli.info(cc=(7, 5))  # info works too
    messages = [str(w.message) for w in caught if "aotinfer_ops" in str(w.message)]
    assert len(messages) == 1 and "'aotinfer_ops_broken'" in messages[0] and "skipped" in messages[0], messages
    # The good provider still counts; the main install is untouched.
    assert merged["modules"]["scale"]["builds"]["7.5"]["provider"] == "aotinfer_ops_good"
    assert _loader.resolve("scale", (7, 5))[1].endswith(os.path.join("aotinfer_ops_good", "_ops", "scale_sm75.so"))


def test_provider_naming_a_missing_package_is_skipped(tmp_path, monkeypatch, fresh_manifest):
    info = tmp_path / "ghost-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ghost\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[aotinfer.ops]\nghost = no_such_package.sub\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(RuntimeWarning, match="'ghost'.*skipped"):
        assert _loader.manifest()["modules"]


# ---- the main manifest --------------------------------------------------------------------------


def copy_of_package(tmp_path: Path) -> Path:
    """A copy of the installed package under tmp_path/site, importable with PYTHONPATH."""
    site = tmp_path / "site"
    shutil.copytree(PACKAGE, site / "aotinfer", ignore=shutil.ignore_patterns("__pycache__"))
    return site


def run_with(site: Path, *args, **kwargs):
    # The copy first; what the interpreter had on PYTHONPATH (tvm-ffi, where it is installed there) after.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=site, **kwargs)


CORRUPT_MANIFESTS = {
    "missing": None,
    "not_json": "{\"package_version\": ",
    "no_modules": json.dumps({"package_version": "0", "cuda_version": "13.0", "arch_list": "9.0a"}),
    "bad_module": json.dumps({"package_version": "0", "cuda_version": "13.0", "arch_list": "9.0a",
                              "modules": {"scale": {"builds": 3}}}),
    "unreadable": "directory",
}


@pytest.mark.parametrize("kind", sorted(CORRUPT_MANIFESTS))
def test_corrupt_main_manifest_gives_one_error_line(kind, tmp_path):
    site = copy_of_package(tmp_path)
    manifest = site / "aotinfer/_ops/manifest.json"
    manifest.unlink()
    content = CORRUPT_MANIFESTS[kind]
    if content == "directory":
        manifest.mkdir()
    elif content is not None:
        manifest.write_text(content)
    out = run_with(site, "-m", "aotinfer", "info")
    assert out.returncode == 1, out
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("error: aotinfer") and "pip install" in out.stderr
    # Every op raises the same error, naming the repair; import itself works.
    script = textwrap.dedent(
        """
        import torch, aotinfer
        from aotinfer import _loader
        x = torch.ones(2, 8); w = torch.ones(8)
        calls = {
            "rmsnorm": lambda: aotinfer.rmsnorm(x, w, skip_check=True),
            "fused_add_rmsnorm": lambda: aotinfer.fused_add_rmsnorm(x, x.clone(), w, skip_check=True),
            "gemma_rmsnorm": lambda: aotinfer.gemma_rmsnorm(x, w, skip_check=True),
            "gemma_fused_add_rmsnorm": lambda: aotinfer.gemma_fused_add_rmsnorm(x, x.clone(), w, skip_check=True),
            "layernorm": lambda: aotinfer.layernorm(x, w, w, skip_check=True),
            "silu_and_mul": lambda: aotinfer.silu_and_mul(x, skip_check=True),
            "gelu_and_mul": lambda: aotinfer.gelu_and_mul(x, skip_check=True),
            "gelu_tanh_and_mul": lambda: aotinfer.gelu_tanh_and_mul(x, skip_check=True),
            "scale": lambda: aotinfer.scale(x, 2.0, skip_check=True),
            "declared_functions": _loader.declared_functions,
        }
        for name, call in calls.items():
            try:
                call()
            except _loader.NotBuiltError as e:
                assert "pip install" in str(e), (name, e)
            else:
                raise AssertionError(name + " did not raise")
        print("all-raised")
        """
    )
    out = run_with(site, "-c", script)
    assert out.returncode == 0 and "all-raised" in out.stdout, out.stderr[-2000:]


def test_declared_functions_reads_only_the_main_manifest(monkeypatch, fresh_manifest):
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        import tomli as tomllib
    with open(ROOT / "modules.toml", "rb") as f:
        declared = {name: decl["functions"] for name, decl in tomllib.load(f).items()}

    def no_providers(*args):
        raise AssertionError("declared_functions must not look for providers")

    monkeypatch.setattr(_manifest, "provider_manifests", no_providers)
    assert _loader.declared_functions() == declared
    times = []
    for _ in range(21):
        _manifest._main_manifest.cache_clear()
        start = time.perf_counter()
        _loader.declared_functions()
        times.append(time.perf_counter() - start)
    assert sorted(times)[10] < 1e-3, f"median {sorted(times)[10] * 1e6:.0f} us"


# ---- kernel files: load failures and verify -------------------------------------------------------

LOAD = textwrap.dedent(
    """
    import sys
    from aotinfer import _loader
    _loader.device_capability = lambda index: {cc}
    try:
        _loader._load("scale", 0)
    except _loader.NotBuiltError as e:
        print(e)
        sys.exit(3)
    print("loaded")
    """
)


def _flip_one_byte(data):
    data = bytearray(data)
    data[len(data) // 2] ^= 0xFF
    return bytes(data)


# What the loader says of each, after the module's name and the file's path: verify's words.
DAMAGE = {
    "missing": (lambda data: None, ": missing;"),
    "truncated": (lambda data: data[:4096], ": has 4096 bytes, the manifest says"),  # dlopen: SIGBUS
    "not_elf": (lambda data: b"NOPE" + data[4:], ": sha256 differs from the manifest;"),
    "one_byte_flipped": (_flip_one_byte, ": sha256 differs from the manifest;"),  # loaded before
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_load_failure_names_file_and_repair(damage, tmp_path):
    arch, cc = installed_arch()
    site = copy_of_package(tmp_path)
    path = site / "aotinfer/_ops" / f"scale_sm{arch.tag}.so"
    change, message = DAMAGE[damage]
    data = change(path.read_bytes())
    if data is None:
        path.unlink()
    else:
        path.write_bytes(data)
    out = run_with(site, "-c", LOAD.format(cc=cc))
    assert out.returncode == 3, out
    assert f"{path}{message}" in out.stdout and "pip install --force-reinstall" in out.stdout
    # verify says the same of the file; info says it of the object, and fails for a GPU that loads it.
    out = run_with(site, "-m", "aotinfer", "verify")
    assert out.returncode == 1 and f"{path}{message.rstrip(';')}" in out.stdout, out
    out = run_with(site, "-m", "aotinfer", "info", "--cc", "{}.{}".format(*cc), "--json")
    assert out.returncode == 1, out
    report = json.loads(out.stdout)
    assert report["integrity"][str(path)].startswith(message.strip(": ;"))
    assert all(problem is None for p, problem in report["integrity"].items() if p != str(path))
    choice = report["gpus"][0]["modules"]["scale"]
    assert choice["error"].startswith(f"{path}{message}"), choice


def test_a_listed_object_the_dynamic_loader_refuses(tmp_path):
    """A file whose sha256 matches a manifest that lists a bad object (a broken build or provider):
    the loader refuses it at dlopen; info says so from its ELF header, without loading it."""
    arch, cc = installed_arch()
    site = copy_of_package(tmp_path)
    path = site / "aotinfer/_ops" / f"scale_sm{arch.tag}.so"
    data = b"NOPE" + path.read_bytes()[4:]
    path.write_bytes(data)
    manifest_path = site / "aotinfer/_ops/manifest.json"
    manifest = json.loads(manifest_path.read_text())
    import hashlib

    manifest["modules"]["scale"]["builds"][arch.name].update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    manifest_path.write_text(json.dumps(manifest))
    out = run_with(site, "-c", LOAD.format(cc=cc))
    assert out.returncode == 3 and f"{path} does not load" in out.stdout, out
    out = run_with(site, "-m", "aotinfer", "info", "--cc", "{}.{}".format(*cc))
    assert out.returncode == 1, out
    assert f"{path}: not an ELF file, which the dynamic loader refuses" in out.stdout, out.stdout


def test_load_without_the_cuda_runtime_library_names_it(tmp_path):
    arch, cc = installed_arch()
    site = copy_of_package(tmp_path)
    (site / "aotinfer/_ops" / _loader.manifest()["runtime"]["file"]).unlink()
    out = run_with(site, "-c", LOAD.format(cc=cc))
    assert out.returncode == 3 and "libaotinfer_cudart.so" in out.stdout, out


def test_verify_names_changed_and_missing_files(tmp_path):
    arch, cc = installed_arch()
    site = copy_of_package(tmp_path)
    out = run_with(site, "-m", "aotinfer", "verify")
    assert out.returncode == 0 and "match their sha256" in out.stdout, out
    changed = site / "aotinfer/_ops" / f"norm_sm{arch.tag}.so"
    data = bytearray(changed.read_bytes())
    data[len(data) // 2] ^= 0xFF
    changed.write_bytes(bytes(data))
    missing = site / "aotinfer/_ops" / f"scale_sm{arch.tag}.so"
    missing.unlink()
    out = run_with(site, "-m", "aotinfer", "verify")
    assert out.returncode == 1, out
    assert f"{changed}: sha256 differs" in out.stdout and f"{missing}: missing" in out.stdout
    assert "pip install --force-reinstall" in out.stdout
    # info shows the missing file and fails for a GPU that needs it.
    out = run_with(site, "-m", "aotinfer", "info", "--cc", "{}.{}".format(*cc))
    assert out.returncode == 1 and f"MISSING: {missing.name}" in out.stdout and f"{missing}: missing" in out.stdout, out
    assert f"DAMAGED: {changed.name}: sha256 differs from the manifest" in out.stdout
    assert "files: 2 of " in out.stdout


def test_verify_checks_providers(tmp_path, monkeypatch, fresh_manifest):
    manifest = provider_manifest()
    make_provider(tmp_path, "aotinfer_ops_sm75", manifest, ["scale_sm75.so"])
    monkeypatch.syspath_prepend(str(tmp_path))
    results = dict(_loader.verify())
    assert results[str(tmp_path / "aotinfer_ops_sm75/_ops/scale_sm75.so")] == "sha256 differs from the manifest"
    assert all(problem is None for path, problem in results.items() if "aotinfer_ops_sm75" not in path)


# ---- what the driver can load ------------------------------------------------------------------

STAND_IN_LIBCUDA = textwrap.dedent(
    """
    #include <string.h>
    int cuDriverGetVersion(int* v) { *v = DRIVER; return 0; }
    int cuInit(unsigned flags) { return 0; }
    int cuDeviceGetCount(int* n) { *n = 1; return 0; }
    int cuDeviceGet(int* d, int i) { *d = i; return 0; }
    int cuDeviceGetName(char* name, int len, int d) { strncpy(name, "Stand-in GPU", len); return 0; }
    int cuDeviceGetAttribute(int* v, int attr, int d) { *v = attr == 75 ? MAJOR : MINOR; return 0; }
    """
)


def stand_in_libcuda(tmp_path: Path, driver: int, cc) -> str:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    source = tmp_path / "libcuda.c"
    source.write_text(STAND_IN_LIBCUDA)
    out = tmp_path / f"libcuda-{driver}.so"
    subprocess.run(["gcc", "-shared", "-fPIC", f"-DDRIVER={driver}", f"-DMAJOR={cc[0]}", f"-DMINOR={cc[1]}",
                    "-o", str(out), str(source)], check=True)
    return str(out)


def test_info_refuses_a_driver_older_than_the_build(tmp_path, monkeypatch, capsys):
    arch, cc = installed_arch()
    built = tuple(map(int, _loader.manifest()["cuda_version"].split(".")))
    old = (built[0] - 1) * 1000 + 20  # e.g. 12.2 for a CUDA 13 build
    monkeypatch.setattr(_device, "LIBCUDA", stand_in_libcuda(tmp_path, old, cc))
    assert cli.main(["info"]) == 1
    text = capsys.readouterr().out
    assert f"driver: supports CUDA {built[0] - 1}.2" in text and "Stand-in GPU" in text
    assert f"needs a driver for CUDA {built[0]}.0 or newer" in text and "exact match" not in text
    # A driver of the build's major loads it.
    monkeypatch.setattr(_device, "LIBCUDA", stand_in_libcuda(tmp_path, built[0] * 1000, cc))
    assert cli.main(["info"]) == 0
    assert "cannot load" not in capsys.readouterr().out


def test_info_cc_with_simulated_driver(capsys):
    arch, cc = installed_arch()
    major = int(_loader.manifest()["cuda_version"].split(".")[0])
    cc_text = "{}.{}".format(*cc)
    assert cli.main(["info", "--cc", cc_text, "--driver", f"{major - 1}.2"]) == 1
    assert "cannot load: the driver supports CUDA" in capsys.readouterr().out
    assert cli.main(["info", "--cc", cc_text, "--driver", f"{major}.0"]) == 0


def test_driver_rules():
    # Minor-version compatibility for SASS, not for PTX.
    assert cli.driver_problem("12.2", "12.9", jit=False) is None
    assert "compile PTX written by CUDA 12.9" in cli.driver_problem("12.2", "12.9", jit=True)
    assert "needs a driver for CUDA 13.0" in cli.driver_problem("12.9", "13.0", jit=False)
    assert cli.driver_problem("13.0", "13.0", jit=True) is None
    assert cli.driver_problem(None, "13.0", jit=True) is None


class _FakeDistribution:
    def __init__(self, direct_url):
        self.version, self._direct = "0.1.0+cu130", direct_url

    def read_text(self, name):
        return self._direct if name == "direct_url.json" else None


@pytest.mark.parametrize("direct_url, command", [
    ('{"url": "file:///w/aotinfer-0.1.0%2Bcu130-py3-none-manylinux_2_28_x86_64.whl", "archive_info": {}}',
     "pip install --force-reinstall --no-deps /w/aotinfer-0.1.0+cu130-py3-none-manylinux_2_28_x86_64.whl"),
    ('{"url": "file:///src/aotinfer", "dir_info": {}}',
     'AOTINFER_CUDA_ARCH_LIST="9.0a" pip install --force-reinstall --no-deps /src/aotinfer'),
    (None, "pip install --force-reinstall --no-deps 'aotinfer==0.1.0+cu130' (with the --find-links folder"),
])
def test_repair_command_reinstalls_from_where_it_came(direct_url, command, monkeypatch):
    from importlib import metadata

    monkeypatch.setattr(metadata, "distribution", lambda name: _FakeDistribution(direct_url))
    assert _loader.repair_command("9.0a").startswith(command)
