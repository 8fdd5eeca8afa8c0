"""aotinfer.jit: builds as the wheel's, the cache's safety rules, the CLI, and the arch context.

Builds run on the CPU (nvcc is all they need) and compile the smallest module, scale, for one
arch: about five compiles in all. Processes that race or die are real subprocesses.
"""

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from aotinfer import _loader, jit
from aotinfer._arch import NoCompatibleBuild, choose_arch
from aotinfer.compilation_context import CompilationContext, arch_for_gpu
from aotinfer.jit import cache, toolchain
from aotinfer.jit import core as jit_core

needs_nvcc = pytest.mark.skipif(toolchain.find() is None, reason="needs nvcc")


def _uncovered_cc():
    """A GPU no installed build runs on (8.9 for a wheel built for 9.0a), or None."""
    for cc in [(8, 9), (8, 6), (8, 0), (7, 5), (9, 0), (12, 0)]:
        try:
            choose_arch(cc, _loader.module_builds("scale"), _loader.module_entry("scale")["sm_majors"])
        except NoCompatibleBuild:
            return cc
    return None


#: The GPU these tests JIT-build for: one the installed wheel has no build for where there is one.
CC = _uncovered_cc() or (8, 9)
CC_TEXT, ARCH = "{}.{}".format(*CC), arch_for_gpu(CC)
SM, STEM = ARCH.sass, f"scale_sm{ARCH.tag}"  # sm_89, scale_sm89
needs_gap = pytest.mark.skipif(_uncovered_cc() is None, reason="the installed builds run on every GPU tried")


def wheel_arch(module="scale"):
    return sorted(_loader.module_builds(module))[0]


@pytest.fixture(autouse=True)
def _no_user_cache(tmp_path, monkeypatch):
    # Never touch the user's cache; each test names its own.
    monkeypatch.setenv("AOTINFER_CACHE_DIR", str(tmp_path / "default-cache"))
    monkeypatch.delenv("AOTINFER_JIT", raising=False)
    monkeypatch.delenv("AOTINFER_CUDA_ARCH_LIST", raising=False)


def run_py(code, cache_dir, **env):
    full = dict(os.environ, AOTINFER_CACHE_DIR=str(cache_dir), PYTHONWARNINGS="ignore", **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True,
                          text=True, timeout=600)


def package_files():
    root = Path(_loader.OPS_DIR).parent
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if "__pycache__" not in p.parts)


# ---- eight processes, one compile ------------------------------------------------------------

RACER = """
    import json, os, sys, time
    import tvm_ffi
    from aotinfer import jit
    go = sys.argv[1]
    while not os.path.exists(go):
        time.sleep(0.005)
    start = time.monotonic()
    choice, path = jit.resolve("scale", (int(sys.argv[2]), int(sys.argv[3])), "test: no installed build")
    module = tvm_ffi.load_module(path)
    print(json.dumps({"path": path, "reason": choice.reason, "scale": module.scale is not None,
                      "seconds": round(time.monotonic() - start, 1)}))
"""


@pytest.fixture(scope="module")
def raced(tmp_path_factory):
    """Eight processes resolving scale for CC on a cold cache at the same instant."""
    if toolchain.find() is None:
        pytest.skip("needs nvcc")
    tmp = tmp_path_factory.mktemp("race")
    cache_dir, go = tmp / "cache", tmp / "go"
    before = package_files()
    env = dict(os.environ, AOTINFER_CACHE_DIR=str(cache_dir), PYTHONWARNINGS="ignore")
    env.pop("AOTINFER_JIT", None)
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(RACER), str(go), *map(str, CC)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(8)]
    time.sleep(3)  # let every racer import torch and tvm-ffi and wait at the line
    go.touch()
    results = [(p.wait(timeout=600), *p.communicate()) for p in procs]
    return {"cache": cache_dir, "results": results, "package_before": before, "package_after": package_files()}


def test_eight_processes_one_compile(raced):
    codes = [r[0] for r in raced["results"]]
    assert codes == [0] * 8, "\n".join(r[2] for r in raced["results"])
    reports = [json.loads(r[1].strip().splitlines()[-1]) for r in raced["results"]]
    stderr = "".join(r[2] for r in raced["results"])
    print("\n".join(json.dumps(r) for r in reports))
    print(stderr)
    assert stderr.count(f"compiling scale for {SM}") == 1
    assert stderr.count(f"compiled scale for {SM}") == 1
    assert len({r["path"] for r in reports}) == 1 and all(r["scale"] for r in reports)
    entries = list((raced["cache"] / "jit").iterdir())
    assert len(entries) == 1 and list((raced["cache"] / "tmp").iterdir()) == []
    # The JIT writes into its cache only, never into the installed package.
    assert raced["package_after"] == raced["package_before"]


def test_cache_layout_and_modes(raced):
    root = raced["cache"]
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    (entry,) = (root / "jit").iterdir()
    record = json.loads((entry / "build.json").read_text())
    assert entry.name.startswith(f"{STEM}-") and record["file"] == f"{STEM}.so"
    assert record["sha256"] == cache.sha256(entry / f"{STEM}.so") and record["archs"] == [str(ARCH)]
    assert "include/aotinfer/scale.cuh" in record["inputs"]["files"]
    link = record["commands"][-2]
    assert any(arg.endswith("libaotinfer_cudart.so") for arg in link)  # the runtime every module shares
    assert "-static-libstdc++" in link and "-Wl,--exclude-libs,ALL" in link


def test_cached_build_serves_later_processes_without_nvcc_or_jit(raced):
    # Prebuilt caches work where nvcc is missing and where JIT builds are off.
    code = f"""
        from aotinfer import jit
        print(jit.resolve("scale", {CC}, "no installed build")[1])
    """
    path = str(next((raced["cache"] / "jit").iterdir()) / f"{STEM}.so")
    for env in ({"AOTINFER_JIT": "0"}, {"CUDA_HOME": "/nonexistent", "PATH": "/usr/bin:/bin"}):
        out = run_py(code, raced["cache"], **env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == path and "compiling" not in out.stderr


@needs_gap
def test_loader_fallback_order(raced, monkeypatch):
    # What _loader does once wired: its own builds first, then jit.resolve with what it tried.
    monkeypatch.setenv("AOTINFER_CACHE_DIR", str(raced["cache"]))
    with pytest.raises(NoCompatibleBuild) as e:
        _loader.resolve("scale", CC)
    choice, path = jit.resolve("scale", CC, str(e.value))
    assert choice.arch == ARCH and not choice.jit and "JIT cache" in choice.reason
    assert jit.find_or_build("scale", CC) == path
    assert jit.resolve("scale", CC, str(e.value), build=False)[1] == path
    with pytest.raises(NoCompatibleBuild, match=r"a JIT build \(not attempted: build=False\)"):
        jit.resolve("scale", (7, 5) if CC != (7, 5) else (8, 0), build=False)  # uncached: never compiles
    assert jit.cached_choice("scale", CC)[1] == path


def _loader_falls_back_to_jit():
    import inspect
    import re

    return re.search(r"from \.jit import|from \. import jit|aotinfer\.jit", inspect.getsource(_loader)) is not None


@needs_gap
@pytest.mark.skipif(not _loader_falls_back_to_jit(), reason="the loader does not fall back to aotinfer.jit yet")
def test_loader_loads_jit_builds(raced, monkeypatch):
    monkeypatch.setenv("AOTINFER_CACHE_DIR", str(raced["cache"]))
    monkeypatch.setattr(_loader, "device_capability", lambda index: CC)
    monkeypatch.setattr(_loader, "_modules", {})
    assert _loader.get_module("scale", 0).scale is not None
    with open("/proc/self/maps") as f:
        assert str(raced["cache"]) in f.read()
    monkeypatch.setattr(_loader, "_modules", {})
    monkeypatch.setenv("AOTINFER_JIT", "0")
    with pytest.raises(NoCompatibleBuild, match=r"Also tried the JIT cache .* and a JIT build \(turned off"):
        _loader.get_module("norm", 0)


@needs_gap
def test_cli_build_for_an_arch_the_wheel_lacks(raced):
    cmd = [sys.executable, "-m", "aotinfer"]
    env = dict(os.environ, AOTINFER_CACHE_DIR=str(raced["cache"]), PYTHONWARNINGS="ignore")
    out = subprocess.run(cmd + ["build", "scale", "--cc", CC_TEXT], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"scale: {SM} cached:" in out.stdout and "compiling" not in out.stderr
    cc = "{}.{}".format(wheel_arch().major, wheel_arch().minor)
    out = subprocess.run(cmd + ["build", "scale", "--cc", cc], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "nothing to build" in out.stdout, out.stdout + out.stderr
    out = subprocess.run(cmd + ["info", "--cc", CC_TEXT], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"JIT cache {raced['cache']}: 1 object" in out.stdout
    assert f"{STEM}.so  {ARCH}" in out.stdout and "current" in out.stdout
    assert f"{STEM}.so  (JIT cache: exact match: {SM})" in out.stdout
    assert re.search(rf"^\s*norm +JIT-compiles {SM} on first use", out.stdout, re.M), out.stdout
    report = json.loads(subprocess.run(cmd + ["info", "--json"], env=env, capture_output=True, text=True).stdout)
    assert [c["file"] for c in report["jit"]["cached"]] == [f"{STEM}.so"]


# ---- damage, death and waiting ---------------------------------------------------------------


@needs_nvcc
def test_corrupted_object_is_rebuilt(raced, tmp_path):
    cache_dir = tmp_path / "cache"
    shutil.copytree(raced["cache"], cache_dir)
    (entry,) = (cache_dir / "jit").iterdir()
    library = entry / f"{STEM}.so"
    data = bytearray(library.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one bit flipped
    library.write_bytes(bytes(data))
    assert "sha256" in cache.Entry(cache_dir, STEM, entry.name.split("-")[1]).problem()
    library.write_bytes(bytes(data[: len(data) // 3]))  # truncated
    abandoned = cache_dir / "tmp" / "norm_sm89-0123456789abcdef.99999.x"  # a build killed long ago
    (abandoned / "out").mkdir(parents=True)
    out = run_py(f"""
        from aotinfer import jit
        print(jit.resolve("scale", {CC}, "no installed build")[1])
    """, cache_dir)
    assert out.returncode == 0, out.stderr
    assert "fails its check" in out.stderr and out.stderr.count("compiling scale") == 1
    assert out.stdout.strip() == str(library) and not abandoned.exists()
    record = json.loads((entry / "build.json").read_text())
    assert cache.sha256(library) == record["sha256"]


ADD_ONE = """
#include <tvm/ffi/function.h>

int AddOne(int x) { return x + ADD_WHAT; }
TVM_FFI_DLL_EXPORT_TYPED_FUNC(add_one, AddOne);
"""

BUILD_ADD_ONE = """
    import sys
    from aotinfer.jit import gen_jit_spec
    spec = gen_jit_spec("add_one", [sys.argv[1]], extra_cuda_cflags=["-DADD_WHAT=1"], arch_list="8.9")
    print(spec.build_and_load().add_one(41))
"""


@needs_nvcc
def test_killed_builder_blocks_no_one(tmp_path):
    source = tmp_path / "add_one.cu"
    source.write_text(ADD_ONE)
    cache_dir = tmp_path / "cache"
    env = dict(os.environ, AOTINFER_CACHE_DIR=str(cache_dir), PYTHONWARNINGS="ignore")
    builder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(BUILD_ADD_ONE), str(source)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not list((cache_dir / "tmp").glob(f"add_one_sm89-*.{builder.pid}.*")):
            assert builder.poll() is None and time.monotonic() < deadline, "the builder never started building"
            time.sleep(0.02)
        time.sleep(0.5)  # nvcc is running
        os.kill(builder.pid, signal.SIGKILL)  # the builder only: its nvcc lives on, orphaned
        builder.wait()
        assert not (cache_dir / "jit").exists() or list((cache_dir / "jit").iterdir()) == []
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(BUILD_ADD_ONE), str(source)], env=env,
                             capture_output=True, text=True, timeout=600)
        print(f"next process: exit {out.returncode} after {time.monotonic() - start:.1f} s\n{out.stderr}")
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "42"
        assert "waiting" not in out.stderr and out.stderr.count("compiling add_one for sm_89") == 1
        assert list((cache_dir / "tmp").iterdir()) == []  # the killed build's directory is gone
    finally:
        try:  # the killed builder's orphaned nvcc, by the session it started
            os.killpg(builder.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_lock_timeout_names_the_lock_file_and_holder(tmp_path, monkeypatch):
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("AOTINFER_CACHE_DIR", str(cache_dir))
    if toolchain.find() is None:
        pytest.skip("needs nvcc")
    entry = jit.gen_module_spec("scale", "8.9").entry(cache.open_root())
    with cache.locked(entry, "scale for sm_89 (a test)"):
        out = run_py("""
            from aotinfer import jit
            jit.gen_module_spec("scale", "8.9").build()
        """, cache_dir, AOTINFER_JIT_LOCK_TIMEOUT="1")
    assert out.returncode != 0
    lock = cache_dir / "locks" / f"{entry.name}.lock"
    assert "LockTimeout" in out.stderr and f"gave up after 1 s waiting for the JIT build lock {lock}" in out.stderr
    assert f"process {os.getpid()}" in out.stderr and "scale for sm_89 (a test)" in out.stderr
    assert out.stderr.count("aotinfer: waiting for process") == 1


# ---- the same object as the wheel's ----------------------------------------------------------


def _elf(path):
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        elf = ELFFile(f)
        needed = [t.needed for t in elf.get_section_by_name(".dynamic").iter_tags() if t.entry.d_tag == "DT_NEEDED"]
        exported = sorted(s.name for s in elf.get_section_by_name(".dynsym").iter_symbols()
                          if s["st_shndx"] != "SHN_UNDEF" and s["st_info"]["bind"] == "STB_GLOBAL")
        fatbin = elf.get_section_by_name(".nv_fatbin")
        return needed, exported, fatbin.data() if fatbin else None


def _jit_build_beside_the_wheels(module, arch, tmp_path):
    """(the wheel's object, the same module JIT-built for ``arch`` by the CLI into a new cache),
    after checking that both have the same libraries, exports and bindings."""
    build = _loader.module_builds(module)[arch]
    wheel = Path(build["dir"], build["file"])
    env = dict(os.environ, AOTINFER_CACHE_DIR=str(tmp_path / "cache"), PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-m", "aotinfer", "build", module, "--arch-list", str(arch)],
                         env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    built = Path(out.stdout.strip().rsplit(": ", 1)[1])
    assert built.name == wheel.name and built.is_file()
    (w_needed, w_exported, _), (j_needed, j_exported, _) = _elf(wheel), _elf(built)
    assert j_needed == w_needed and j_exported == w_exported
    import tvm_ffi

    w_module, j_module = tvm_ffi.load_module(str(wheel)), tvm_ffi.load_module(str(built))
    for function in _loader.module_entry(module)["functions"]:
        assert j_module.get_function_metadata(function) == w_module.get_function_metadata(function)
    return wheel, built


@needs_nvcc
@pytest.mark.skipif(not jit_core.dsl_available(), reason="needs nvidia-cutlass-dsl")
def test_cutedsl_jit_build_is_the_wheels_build(tmp_path):
    """A CuTeDSL module built by the JIT (the DSL's compile of its kernel file, then nvcc) is the
    wheel's object: the same libraries, exports and bindings, and the same kernel images, one for
    every variant, for the arch (byte for byte: the DSL that built the wheel is the one here, as the
    README's set-up installs it)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ci"))
    try:
        import check_wheel
    finally:
        sys.path.pop(0)
    builds = _loader.module_builds("norm_quant")
    if not builds:
        pytest.skip("no norm_quant build installed")
    arch = sorted(builds)[0]
    wheel, built = _jit_build_beside_the_wheels("norm_quant", arch, tmp_path)
    assert check_wheel.embedded_cubins(built) == check_wheel.embedded_cubins(wheel)
    assert set(check_wheel.embedded_cubins(built)) == {arch.major * 10 + arch.minor}
    assert _section(built, ".rodata") == _section(wheel, ".rodata")  # where the cubins are embedded
    record = json.loads(next((tmp_path / "cache").rglob("*.json")).read_text())
    assert record["module"] == "norm_quant" and record["nvidia_cutlass_dsl"]
    assert "cutedsl/norm_quant.py" in record["inputs"]["cutedsl"]


def test_cutedsl_module_without_the_dsl_says_what_to_install(monkeypatch):
    builds = _loader.module_builds("norm_quant")
    cc = next((c for c in [(10, 0), (12, 0), (9, 0)] if not any(a.major == c[0] for a in builds)), None)
    if cc is None:
        pytest.skip("the installed norm_quant builds cover every major tried")
    monkeypatch.setattr(jit_core, "dsl_available", lambda: False)
    with pytest.raises(NoCompatibleBuild) as e:
        jit.resolve("norm_quant", cc)
    message = str(e.value)
    if toolchain.find() is not None:
        assert "written in CuTeDSL, and nvidia-cutlass-dsl is not installed here" in message, message
        assert "pip install 'nvidia-cutlass-dsl>=4.8,<4.9'" in message
    assert message.endswith(f"python -m aotinfer build norm_quant --cc {cc[0]}.{cc[1]}")


@needs_nvcc
def test_cli_build_without_the_dsl(monkeypatch, capsys):
    """`build` names the missing DSL for a CuTeDSL module asked for by name, and skips it (saying
    so) among all modules."""
    from types import SimpleNamespace

    from aotinfer.jit import cli as jit_cli

    monkeypatch.setattr(jit_core, "dsl_available", lambda: False)
    assert jit_cli.build(SimpleNamespace(modules=["norm_quant"], cc=None, arch_list="9.0a")) == 1
    assert "cannot build norm_quant_sm90a: it is written in CuTeDSL" in capsys.readouterr().err
    real_build = jit_core.JitSpec.ensure_built

    def build_only_cutedsl(spec, *args, **kwargs):  # the other modules' compiles are not the point here
        return real_build(spec, *args, **kwargs) if spec.cutedsl is not None else (Path(f"{spec.stem}.so"), "built")

    monkeypatch.setattr(jit_core.JitSpec, "ensure_built", build_only_cutedsl)
    assert jit_cli.build(SimpleNamespace(modules=[], cc=None, arch_list="9.0a")) == 0
    out = capsys.readouterr().out
    assert "norm_quant: skipped 9.0a: cannot build norm_quant_sm90a: it is written in CuTeDSL" in out
    assert "scale: sm_90a" in out


def _section(path, name):
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        return ELFFile(f).get_section_by_name(name).data()


@needs_nvcc
def test_jit_build_is_the_wheels_build(tmp_path):
    wheel, built = _jit_build_beside_the_wheels("scale", wheel_arch(), tmp_path)
    if _loader.manifest()["cuda_version"] == toolchain.find().cuda_version:
        # Same nvcc: the same flags must give the same device code, byte for byte.
        assert _elf(built)[2] == _elf(wheel)[2]


def test_spec_of_the_wheels_own_build_is_aot():
    arch = wheel_arch()
    spec = jit.gen_module_spec("scale", arch)
    build = _loader.module_builds("scale")[arch]
    assert spec.is_aot and spec.library_path == Path(build["dir"], build["file"])
    assert spec.stem == f"scale_sm{arch.tag}"
    if _uncovered_cc() is not None:
        assert not jit.gen_module_spec("scale", ARCH).is_aot


# ---- the key ---------------------------------------------------------------------------------


@pytest.fixture
def sources(tmp_path):
    root = tmp_path / "src"
    shutil.copytree(jit.kernel_source_dir(), root, ignore=shutil.ignore_patterns("_ops", "*.so"))
    return root


def test_header_edit_changes_the_key_file_times_do_not(sources):
    spec = jit.gen_module_spec("scale", "8.9", source_dir=sources)
    key = spec.inputs_key()
    for path in spec.files():
        os.utime(path, (1, 1))  # file times are no part of the key
    assert spec.inputs_key() == key
    unrelated = sources / "include/aotinfer/norm.cuh"
    assert unrelated not in spec.files()
    unrelated.write_text(unrelated.read_text() + "\n// edited\n")
    assert spec.inputs_key() == key
    header = sources / "include/aotinfer/vec.cuh"  # included by scale.cuh, not by scale.cu
    assert header in spec.files()
    header.write_text(header.read_text() + "\n// edited\n")
    assert spec.inputs_key() != key
    if toolchain.find() is not None:  # and so does the key of the object
        assert spec.entry(sources).key != jit.gen_module_spec("scale", "8.9").entry(sources).key


@needs_nvcc
def test_headers_hashed_are_those_nvcc_reads(sources):
    # The #include scan finds every header of ours the compiler opens (nvcc -M lists them).
    spec = jit.gen_module_spec("norm", "9.0a", source_dir=sources)
    include, _ = toolchain.tvm_ffi_paths()
    out = subprocess.run([toolchain.find().nvcc, "-M", "-x", "cu", *[f"-I{d}" for d in spec.include_dirs],
                          "-isystem", include, str(spec.sources[0])], capture_output=True, text=True, check=True)
    deps = {Path(p).resolve() for p in out.stdout.replace("\\\n", " ").split()[1:]}
    ours = {p for p in deps if sources.resolve() in p.parents}
    assert ours == set(spec.files())


def test_gen_jit_spec_archs(tmp_path, monkeypatch):
    source = tmp_path / "k.cu"
    source.write_text(ADD_ONE)
    monkeypatch.setenv("AOTINFER_CUDA_ARCH_LIST", "8.9 10.0f 12.0+PTX")
    import aotinfer.compilation_context as cc_module

    monkeypatch.setattr(cc_module, "_current", None)
    spec = jit.gen_jit_spec("k", [source])
    assert [str(a) for a in spec.arch_list] == ["8.9", "10.0f", "12.0+PTX"] and spec.stem == "k_sm89_sm100f_sm120"
    assert "--generate-code=arch=compute_120,code=[compute_120,sm_120]" in spec.cuda_flags
    flags = cc_module.current_compilation_context.get_nvcc_flags_list([10])
    spec = jit.gen_jit_spec("k", [source], extra_cuda_cflags=flags)
    assert spec.arch_list == () and spec.stem == "k" and flags[0] in spec.cuda_flags
    assert spec.source_dir == jit.kernel_source_dir()
    with pytest.raises(ValueError, match="identifier"):
        jit.gen_jit_spec("not a name", [source])


# ---- CompilationContext ------------------------------------------------------------------------


def test_compilation_context(monkeypatch):
    monkeypatch.setenv("AOTINFER_CUDA_ARCH_LIST", "8.9 9.0a 12.0+PTX")
    ctx = CompilationContext()
    assert [str(a) for a in ctx.TARGET_CUDA_ARCHS] == ["8.9", "9.0a", "12.0+PTX"]
    assert ctx.get_nvcc_flags_list([9]) == ["--generate-code=arch=compute_90a,code=[sm_90a]"]
    assert len(ctx.get_nvcc_flags_list()) == 3
    with pytest.raises(RuntimeError, match=r"^No supported CUDA architectures found for major versions \[10, 11\]"):
        ctx.get_nvcc_flags_list(supported_major_versions=[10, 11])
    monkeypatch.setenv("AOTINFER_CUDA_ARCH_LIST", "9.0x")
    with pytest.raises(ValueError, match="AOTINFER_CUDA_ARCH_LIST: bad CUDA arch '9.0x'"):
        CompilationContext()
    assert [str(arch_for_gpu(cc)) for cc in [(8, 9), (9, 0), (10, 3), (12, 1)]] == ["8.9", "9.0a", "10.3a", "12.1a"]


def test_no_gpu_and_no_list_says_so(monkeypatch):
    from aotinfer import _device

    monkeypatch.setattr(_device, "driver_gpus", lambda: (None, [], "no NVIDIA driver found"))
    ctx = CompilationContext()
    assert ctx.TARGET_CUDA_ARCHS == ()
    with pytest.raises(RuntimeError, match="No CUDA architectures to build for: the visible GPUs: none"):
        ctx.get_nvcc_flags_list()


def test_import_does_nothing(tmp_path):
    out = run_py("""
        import sys
        import aotinfer.jit, aotinfer.compilation_context as c
        assert c._current is None
        assert "torch" not in sys.modules and "tvm_ffi" not in sys.modules, sorted(sys.modules)
        print("ok")
    """, tmp_path / "never")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert not (tmp_path / "never").exists()


# ---- when the JIT does not apply ---------------------------------------------------------------


def test_jit_off_turns_a_missing_build_into_no_compatible_build(monkeypatch):
    monkeypatch.setenv("AOTINFER_JIT", "0")
    with pytest.raises(NoCompatibleBuild) as e:
        jit.resolve("scale", CC, f"aotinfer module 'scale': no build runs on compute capability {CC_TEXT}")
    message = str(e.value)
    assert message.startswith(
        f"aotinfer module 'scale': no build runs on compute capability {CC_TEXT}. Also tried the JIT cache"
        f" {cache.cache_root()} (nothing for {CC_TEXT}) and a JIT build (turned off by AOTINFER_JIT=0)"
    )
    assert message.endswith(f"python -m aotinfer build scale --cc {CC_TEXT}")
    assert jit.find_or_build("scale", CC) is None


def test_no_nvcc_turns_a_missing_build_into_no_compatible_build(monkeypatch):
    monkeypatch.setenv("CUDA_HOME", "/nonexistent/cuda")
    with pytest.raises(NoCompatibleBuild, match="no nvcc in CUDA_HOME=/nonexistent/cuda"):
        jit.resolve("scale", CC)


def test_bad_cache_dirs_are_refused(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("AOTINFER_CACHE_DIR", str(root))
    umask = os.umask(0o022)
    try:
        assert cache.open_root() == root and stat.S_IMODE(root.stat().st_mode) == 0o700
    finally:
        os.umask(umask)
    for mode, who in ((0o777, "others"), (0o770, "its group")):
        root.chmod(mode)
        with pytest.raises(cache.CacheDirError, match=f"writable by {who}"):
            cache.open_root()
        with pytest.raises(NoCompatibleBuild, match=f"writable by {who}"):
            jit.resolve("scale", CC)  # refused loudly, not skipped
    root.chmod(0o755)  # readable by others is fine
    assert cache.open_root() == root
    if os.geteuid() == 0:
        os.chown(root, 65534, 65534)
        with pytest.raises(cache.CacheDirError, match="owned by uid 65534"):
            cache.open_root()
    file = tmp_path / "file"
    file.write_text("")
    monkeypatch.setenv("AOTINFER_CACHE_DIR", str(file))
    with pytest.raises(cache.CacheDirError, match="not a directory"):
        cache.open_root()


def test_info_creates_no_cache_dir(tmp_path):
    out = run_py("""
        from aotinfer.cli import main
        assert main(["info"]) == 0
    """, tmp_path / "never")
    assert out.returncode == 0, out.stderr
    assert "JIT cache" in out.stdout and not (tmp_path / "never").exists()


CLI_BUILD = """
    import sys
    import jit_fakes
    from aotinfer import cli
    jit_fakes.install(float(sys.argv[1]), sys.argv[2])
    sys.exit(cli.main(["build", "scale", "--arch-list", "8.9"]))
"""


def test_a_second_concurrent_build_says_it_waited(tmp_path):
    """Two `build` commands for one object at once: one compiles (faked, 4 s) and says "built in";
    the other waits for its lock and says so, not "built in"."""
    build = next(iter(_loader.module_builds("scale").values()))
    stand_in = os.path.join(build["dir"], build["file"])
    tests = str(Path(__file__).resolve().parent)
    env = dict(os.environ, AOTINFER_CACHE_DIR=str(tmp_path / "cache"), PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([tests, *filter(None, [os.environ.get("PYTHONPATH")])]))
    first = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CLI_BUILD), "4", stand_in], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not list((tmp_path / "cache" / "tmp").glob("scale_sm89-*")):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        second = subprocess.run([sys.executable, "-c", textwrap.dedent(CLI_BUILD), "4", stand_in], env=env,
                                capture_output=True, text=True, timeout=120)
        out, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0 and second.returncode == 0, err + second.stderr
    assert re.search(r"^scale: sm_89 built in \d+\.\d s: ", out, re.M), out
    assert re.search(r"^scale: sm_89 built by another process \(waited \d+\.\d s for it\): ", second.stdout,
                     re.M), second.stdout
    assert "built in" not in second.stdout and "fake build" not in second.stdout
    assert "waiting for process" in second.stderr
    third = subprocess.run([sys.executable, "-c", textwrap.dedent(CLI_BUILD), "4", stand_in], env=env,
                           capture_output=True, text=True, timeout=120)
    assert re.search(r"^scale: sm_89 cached: ", third.stdout, re.M), third.stdout
