"""The installed package: manifest against files and declarations, linkage, import hygiene."""

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import aotinfer
from aotinfer import _loader
from aotinfer._arch import parse_arch_list, supported_archs

ROOT = Path(__file__).resolve().parent.parent
OPS_DIR = Path(_loader.OPS_DIR)

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib


def declarations():
    with open(ROOT / "modules.toml", "rb") as f:
        return tomllib.load(f)


def test_manifest_matches_files():
    manifest = _loader.manifest()
    runtime = OPS_DIR / manifest["runtime"]["file"]
    assert hashlib.sha256(runtime.read_bytes()).hexdigest() == manifest["runtime"]["sha256"]
    listed = {runtime.name}
    for name, entry in manifest["modules"].items():
        for build in entry["builds"].values():
            path = OPS_DIR / build["file"]
            assert path.is_file(), path
            assert hashlib.sha256(path.read_bytes()).hexdigest() == build["sha256"], path
            assert path.stat().st_size == build["size"]
            listed.add(path.name)
    on_disk = {p.name for p in OPS_DIR.glob("*.so")}
    assert on_disk == listed, "shared objects not in the manifest, or missing"


def test_manifest_matches_declarations():
    manifest = _loader.manifest()
    decls = declarations()
    assert set(manifest["modules"]) == set(decls)
    archs = parse_arch_list(manifest["arch_list"])
    for name, decl in decls.items():
        entry = manifest["modules"][name]
        assert entry["functions"] == decl["functions"]
        assert entry["sources"] == decl["sources"]
        assert entry["sm_majors"] == decl.get("sm_majors")
        expected = supported_archs(archs, decl.get("sm_majors"))
        assert sorted(_loader.module_builds(name)) == sorted(expected)
        for arch, build in zip(sorted(expected), (_loader.module_builds(name)[a] for a in sorted(expected))):
            assert build["file"] == f"{name}_sm{arch.tag}.so"
            assert build["ptx"] == (f"compute_{arch.tag}" if arch.ptx else None)


def test_manifest_versions():
    manifest = _loader.manifest()
    assert manifest["package_version"] == aotinfer.__version__
    assert manifest["cuda_version"].split(".")[0] in {"12", "13"}
    assert manifest["driver_min"]
    from importlib.metadata import version

    assert manifest["tvm_ffi_version"].split(".")[:2] == version("apache-tvm-ffi").split(".")[:2]


def _dynamic_info(path):
    """(DT_NEEDED, exported names, {imported name: version node or None}): the wheel check's reading."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_aotinfer_check_wheel", ROOT / "ci/check_wheel.py")
    check_wheel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_wheel)
    return check_wheel.linkage(path)


def all_builds():
    return [
        (name, build)
        for name, entry in _loader.manifest()["modules"].items()
        for build in entry["builds"].values()
    ]


@pytest.mark.parametrize("name, build", all_builds(), ids=lambda v: v if isinstance(v, str) else v["file"])
def test_shared_object_links_no_torch_or_python(name, build):
    needed, exported, imported = _dynamic_info(OPS_DIR / build["file"])
    assert not [lib for lib in needed if "torch" in lib or "python" in lib or lib.startswith("libc10")]
    # The CUDA runtime: the wheel's own, every call bound to its private version node.
    assert not [lib for lib in needed if lib.startswith("libcudart")]
    assert _loader.manifest()["runtime"]["file"] in needed
    cuda_calls = {sym: version for sym, version in imported.items() if sym.startswith(("cuda", "__cuda"))}
    assert cuda_calls and set(cuda_calls.values()) == {CUDART_NODE}, cuda_calls
    # Exactly the declared functions (and their metadata) leave the object as tvm-ffi exports.
    tvm_exports = {s for s in exported if s.startswith("__tvm_ffi_")}
    functions = _loader.module_entry(name)["functions"]
    assert tvm_exports == {f"__tvm_ffi_{f}" for f in functions} | {f"__tvm_ffi__metadata_{f}" for f in functions}


CUDART_NODE = "AOTINFER_CUDART_" + _loader.manifest()["cuda_version"].split(".")[0]


def test_cuda_runtime_library_exports_only_the_runtime_api():
    needed, exported, imported = _dynamic_info(OPS_DIR / _loader.manifest()["runtime"]["file"])
    assert set(needed) <= {"libc.so.6", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1", "libdl.so.2",
                           "libpthread.so.0", "librt.so.1", "libm.so.6"}, needed
    api = {sym for sym in exported if sym.startswith(("cuda", "__cuda"))}
    assert {"cudaLaunchKernel", "__cudaRegisterFatBinary", "cudaGetErrorString"} <= api
    assert exported - api == {CUDART_NODE}, sorted(exported - api)[:10]


def _cc(tmp_path, name, source, *args):
    import shutil

    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    (tmp_path / f"{name}.c").write_text(source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / f"{name}.so"), str(tmp_path / f"{name}.c"), *args],
                   check=True)
    return tmp_path / f"{name}.so"


def test_other_cuda_runtimes_cannot_interpose(tmp_path):
    # A CUDA runtime of the same major already loaded with RTLD_GLOBAL (torch's libcudart.so.13,
    # whose symbols carry version libcudart.so.13) must not capture calls bound to ours. The
    # probe binds cudaRuntimeGetVersion exactly as the modules bind their CUDA calls.
    decoy_map = tmp_path / "decoy.map"
    decoy_map.write_text("libcudart.so.13 { global: cudaRuntimeGetVersion; local: *; };\n")
    decoy = _cc(tmp_path, "libcudart.so.13", "int cudaRuntimeGetVersion(int* v) { *v = 1; return 0; }\n",
                f"-Wl,--version-script={decoy_map}", "-Wl,-soname,libcudart.so.13")
    probe = _cc(tmp_path, "probe", "int cudaRuntimeGetVersion(int*);\n"
                "int probe(void) { int v = -1; return cudaRuntimeGetVersion(&v) ? -1 : v; }\n",
                f"-L{OPS_DIR}", "-laotinfer_cudart", f"-Wl,-rpath,{OPS_DIR}")
    script = (f"import ctypes; ctypes.CDLL({str(decoy)!r}, mode=ctypes.RTLD_GLOBAL);"
              f"print(ctypes.CDLL({str(probe)!r}).probe())")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    major, minor = map(int, _loader.manifest()["cuda_version"].split("."))
    assert int(out.stdout) == major * 1000 + minor * 10


def test_one_cuda_runtime_per_process():
    import tvm_ffi

    for name, build in all_builds():
        tvm_ffi.load_module(str(OPS_DIR / build["file"]))
    maps = open("/proc/self/maps").read()
    # Torch's own runtime may be there too (a CUDA build of torch): aotinfer brings one, its own.
    runtimes = {line.split()[-1] for line in maps.splitlines() if "cudart" in line and "torch" not in line.split()[-1]}
    runtimes = {r for r in runtimes if "nvidia" not in r}
    assert runtimes == {str(OPS_DIR / _loader.manifest()["runtime"]["file"])}


def test_bindings_raise_typed_errors():
    # C++ exceptions inside each module (a wrong argument count) still become Python errors.
    import tvm_ffi

    for name, build in all_builds():
        module = tvm_ffi.load_module(str(OPS_DIR / build["file"]))
        for function in _loader.module_entry(name)["functions"]:
            with pytest.raises(TypeError, match=function):
                getattr(module, function)()


def test_import_is_lazy(tmp_path):
    # A fresh interpreter: import aotinfer must not import torch or tvm_ffi, touch CUDA, load a
    # shared object or create files; info must not initialize torch's CUDA either.
    script = textwrap.dedent(
        f"""
        import os, sys
        before = set(os.listdir({str(_loader.OPS_DIR)!r}))
        import aotinfer
        assert "torch" not in sys.modules and "tvm_ffi" not in sys.modules, sorted(sys.modules)
        maps = open("/proc/self/maps").read()
        assert "_ops/" not in maps and "libcuda" not in maps
        assert set(os.listdir({str(_loader.OPS_DIR)!r})) == before
        import torch
        from aotinfer.cli import main
        assert main(["info"]) in (0, 1)  # 1: a GPU here that this install cannot serve
        assert not torch.cuda.is_initialized()
        print("lazy-ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "lazy-ok" in out.stdout
    assert list(tmp_path.iterdir()) == []


def test_loader_loads_once_under_threads(monkeypatch):
    import threading
    import time

    calls = []

    def slow_load(name, index):
        calls.append((name, index))
        time.sleep(0.05)
        return object()

    monkeypatch.setattr(_loader, "_load", slow_load)
    monkeypatch.setattr(_loader, "_modules", {})

    results = []
    threads = [threading.Thread(target=lambda: results.append(_loader.get_module("scale", 7))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [("scale", 7)]
    assert len(results) == 8 and all(r is results[0] for r in results)


@pytest.mark.parametrize("cc, command", [
    ((10, 3), 'AOTINFER_CUDA_ARCH_LIST="10.0f" pip install .'),  # B300: the release list's 10.0f
    ((3, 5), "no aotinfer release supports it"),  # no toolkit of ours builds for Kepler
])
def test_resolve_error_names_device_archs_and_advice(cc, command):
    if any(a.runs_sass_on(cc) for a in _loader.module_builds("scale")):
        pytest.skip("this install runs there")
    with pytest.raises(aotinfer.NoCompatibleBuild) as e:
        _loader.resolve("scale", cc)
    message = str(e.value)
    archs = " ".join(str(a) for a in sorted(_loader.module_builds("scale")))
    assert "{}.{}".format(*cc) in message and archs in message
    assert command in message


def test_built_schema_matches_binding():
    # tvm-ffi embeds each export's type schema in the object; scale takes (out, input, factor, enable_pdl).
    import tvm_ffi

    for name, build in all_builds():
        module = tvm_ffi.load_module(str(OPS_DIR / build["file"]))
        for function in _loader.module_entry(name)["functions"]:
            schema = json.loads(module.get_function_metadata(function)["type_schema"])
            assert schema["type"] == "ffi.Function"
            if function == "scale":
                params = [p["type"] for p in schema["named_args"]["params"]]
                assert params == ["DLTensor*", "DLTensor*", "float", "int"]
