"""``python -m aotinfer info``, with and without a GPU."""

import json
import re
import subprocess
import sys

import pytest

from aotinfer import _loader, cli


def test_info_text_runs_without_gpu():
    out = subprocess.run([sys.executable, "-m", "aotinfer", "info"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    manifest = _loader.manifest()
    assert f"aotinfer {manifest['package_version']}" in out.stdout
    assert f"CUDA {manifest['cuda_version']}" in out.stdout and manifest["driver_min"] in out.stdout
    assert f"tvm-ffi {manifest['tvm_ffi_version']}" in out.stdout
    for name in manifest["modules"]:
        assert name in out.stdout


@pytest.mark.parametrize("arch", sorted(_loader.module_builds("scale")), ids=str)
def test_info_cc_json_picks_each_build(arch, capsys):
    assert cli.main(["info", "--cc", f"{arch.major}.{arch.minor}", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (gpu,) = report["gpus"]
    assert gpu["compute_capability"] == f"{arch.major}.{arch.minor}"
    choice = gpu["modules"]["scale"]
    assert choice["file"] == f"scale_sm{arch.tag}.so"
    assert choice["driver_compiles_ptx"] is False and choice["error"] is None
    assert report["modules"]["scale"]["archs"] == [str(a) for a in sorted(_loader.module_builds("scale"))]


def test_info_cc_without_build_explains(capsys):
    # A GPU that can load nothing: exit 1, and say why and what would serve it.
    assert cli.main(["info", "--cc", "3.5"]) == 1
    text = capsys.readouterr().out
    assert "cannot load" in text and "3.5" in text and "no aotinfer release supports it" in text


def test_info_cc_names_a_buildable_arch(capsys):
    # The README's example: a B300 (10.3). The command printed must name an arch nvcc builds.
    if cli.info(cc=(10, 3))["gpus"][0]["modules"]["scale"]["error"] is None:
        pytest.skip("this install loads 10.3")
    assert cli.main(["info", "--cc", "10.3"]) == 1
    text = capsys.readouterr().out
    assert 'AOTINFER_CUDA_ARCH_LIST="10.0f" pip install .' in text


def test_info_bad_cc():
    out = subprocess.run([sys.executable, "-m", "aotinfer", "info", "--cc", "sm90"], capture_output=True, text=True)
    assert out.returncode == 2 and "compute capability like 8.9" in out.stderr


@pytest.mark.parametrize("text", ["08.9", "8.10", "99.0", "1000.0", "0.9", "8", "8.9.1", "-8.9"])
def test_info_and_build_reject_what_cuda_never_prints_as_a_compute_capability(text):
    for command in (["info"], ["build", "scale"]):
        out = subprocess.run([sys.executable, "-m", "aotinfer", *command, "--cc", text], capture_output=True, text=True)
        assert out.returncode == 2 and f"expected a compute capability like 8.9" in out.stderr, out.stderr
        assert repr(text) in out.stderr and "Traceback" not in out.stderr


def test_parse_cc_takes_what_cuda_prints():
    from aotinfer._device import MAX_CC_MAJOR, parse_cc

    assert parse_cc("8.9") == (8, 9) and parse_cc(" 12.1 ") == (12, 1) and parse_cc("10.3") == (10, 3)
    assert parse_cc(f"{MAX_CC_MAJOR}.0") == (MAX_CC_MAJOR, 0)
    with pytest.raises(ValueError):
        parse_cc(f"{MAX_CC_MAJOR + 1}.0")


def _imports(path, package):
    """The aotinfer modules that ``path`` imports, at its top or inside functions."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            base = (base + "." + node.module if node.module else base) if node.level else node.module
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_no_import_circles():
    """No aotinfer module imports, even lazily, one that imports it back (the package's own
    __init__, which every submodule's import runs first, aside): each can be read without the
    others, and the CLI, the JIT and the loader are layered (_device, _manifest < jit < _loader)."""
    from pathlib import Path

    root = Path(_loader.__file__).resolve().parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if "_ops" in parts or "_src" in parts:
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = (path, name if parts[-1] == "__init__" else name.rpartition(".")[0])
    graph = {}
    for name, (path, package) in modules.items():
        targets = _imports(path, package)
        # 'from . import x' of a submodule imports x, not the package's __init__ as a dependency.
        graph[name] = {t for t in targets if t in modules and t != name
                       and not any(o.startswith(t + ".") for o in targets if o in modules)}

    def reaches(start, goal, seen):
        return any(n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen)) for n in graph[start])

    circles = sorted(name for name in graph if reaches(name, name, set()))
    assert circles == [], circles


def test_info_says_which_modules_a_gpu_lacks_by_design(capsys):
    """On an Ampere part, prefill_sm90 (Hopper only) and norm_quant (sm_90 and newer) are not a
    fault of the install: info says so, and they do not make it exit 1."""
    status = cli.main(["info", "--cc", "8.6"])
    text = capsys.readouterr().out
    assert re.search(r"^\s*prefill_sm90 +not for compute capability 8\.6: Hopper only \(SM major 9\), by design$",
                     text, re.M), text
    assert re.search(r"^\s*norm_quant +not for compute capability 8\.6: sm_90 and newer \(SM majors 9, 10, 11, 12\),"
                     r" by design$", text, re.M), text
    report = cli.info(cc=(8, 6))
    assert all(report["gpus"][0]["modules"][m]["unsupported"] for m in ("prefill_sm90", "norm_quant"))
    assert status == (1 if cli.failures(report) else 0)
    assert not any("prefill_sm90" in f or "norm_quant" in f for f in cli.failures(report))


def test_info_agrees_about_a_driver_older_than_the_build(capsys):
    """A driver of the CUDA major below the build's runs nothing of it: neither the installed
    objects (a GPU they cover) nor JIT builds (a GPU they do not), which link the same runtime."""
    built = int(_loader.manifest()["cuda_version"].split(".")[0])
    old = f"{built - 1}.8"
    covered = "{}.{}".format(*sorted((a.major, a.minor) for a in _loader.module_builds("scale"))[0])
    for cc in (covered, "10.3", "8.6"):
        assert cli.main(["info", "--cc", cc, "--driver", old]) == 1, cc
        text = capsys.readouterr().out
        assert f"driver: supports CUDA {old}; too old for this build" in text and "Nothing loads" in text
        assert "JIT-compiles" not in text, text
        line = [line for line in text.splitlines() if line.strip().startswith("scale ")][-1]  # the GPU's
        assert f"cannot load: the driver supports CUDA {old}, and this CUDA" in line, line
        report = cli.info(cc=tuple(map(int, cc.split("."))), driver=old)
        assert all(c["error"] for c in report["gpus"][0]["modules"].values()), cc
    # A driver of the build's own major: the same GPUs load (or JIT-build) what they did.
    assert "too old" not in cli.format_info(cli.info(cc=(10, 3), driver=f"{built}.0"))


def test_info_into_a_closed_pipe_exits_quietly():
    for args in (["info", "--json"], ["info"], ["verify"]):
        out = subprocess.run(f"{sys.executable} -m aotinfer {' '.join(args)} | head -c 10 >/dev/null;"
                             " echo ${PIPESTATUS[0]}", shell=True, executable="/bin/bash", capture_output=True,
                             text=True)
        assert out.stderr == "", out.stderr
        assert out.stdout.strip() in ("0", "1", "141"), out.stdout  # 141 when the pipe closed first


def test_info_help_documents_the_exit_status():
    out = subprocess.run([sys.executable, "-m", "aotinfer", "info", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "exit status:" in out.stdout and "by design" in out.stdout
    assert "141" in out.stdout and "2    bad arguments" in out.stdout
