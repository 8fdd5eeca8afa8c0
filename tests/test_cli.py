"""``python -m aotinfer info``, with and without a GPU."""

import json
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
