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
    listed = set()
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
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        elf = ELFFile(f)
        dynamic = elf.get_section_by_name(".dynamic")
        needed = [tag.needed for tag in dynamic.iter_tags() if tag.entry.d_tag == "DT_NEEDED"]
        dynsym = elf.get_section_by_name(".dynsym")
        exported = {
            s.name
            for s in dynsym.iter_symbols()
            if s["st_shndx"] != "SHN_UNDEF" and s["st_info"]["bind"] == "STB_GLOBAL"
        }
    return needed, exported


def all_builds():
    return [
        (name, build)
        for name, entry in _loader.manifest()["modules"].items()
        for build in entry["builds"].values()
    ]


@pytest.mark.parametrize("name, build", all_builds(), ids=lambda v: v if isinstance(v, str) else v["file"])
def test_shared_object_links_no_torch_or_python(name, build):
    needed, exported = _dynamic_info(OPS_DIR / build["file"])
    assert not [lib for lib in needed if "torch" in lib or "python" in lib or lib.startswith("libc10")]
    assert not [lib for lib in needed if lib.startswith("libcudart")], "the CUDA runtime must be static"
    # Exactly the declared functions (and their metadata) leave the object as tvm-ffi exports.
    tvm_exports = {s for s in exported if s.startswith("__tvm_ffi_")}
    functions = _loader.module_entry(name)["functions"]
    assert tvm_exports == {f"__tvm_ffi_{f}" for f in functions} | {f"__tvm_ffi__metadata_{f}" for f in functions}


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
        assert main(["info"]) == 0
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


def test_resolve_error_names_device_archs_and_build_command():
    with pytest.raises(aotinfer.NoCompatibleBuild) as e:
        _loader.resolve("scale", (3, 5))
    message = str(e.value)
    archs = " ".join(str(a) for a in sorted(_loader.module_builds("scale")))
    assert "3.5" in message and archs in message
    assert 'AOTINFER_CUDA_ARCH_LIST="3.5" pip install' in message


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
