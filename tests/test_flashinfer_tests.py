"""ci/flashinfer_tests.py, on a stand-in checkout: the name flashinfer resolves to aotinfer (in the
processes the tests start too), names aotinfer lacks are placeholders, and each test lands in its bin;
with --overlay, beside a stand-in FlashInfer, each passed test is binned by who served it."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STAND_IN_TESTS = '''
import pytest
import flashinfer
from flashinfer.utils import has_flashinfer_jit_cache
from flashinfer.quantization.fp4 import some_helper  # a module aotinfer lacks: importable, a placeholder


def test_same_function():
    assert flashinfer.sampling.softmax is __import__("aotinfer").sampling.softmax
    assert flashinfer.norm.rmsnorm_quant is __import__("aotinfer").rmsnorm_quant
    assert has_flashinfer_jit_cache()


def test_child_process():  # FlashInfer's torch.compile tests run their script in a subprocess
    import subprocess, sys
    code = "import flashinfer, aotinfer; assert flashinfer.sampling.softmax is aotinfer.sampling.softmax"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_not_shipped_name():
    flashinfer.sampling.get_seed_and_offset(None, None, None)


def test_not_shipped_keyword():
    flashinfer.single_prefill_with_kv_cache(None, None, None, not_an_argument=1)


def test_declined():
    flashinfer.decode.check_pos_encoding_mode("ALIBI")


def test_limit_test_not_named():
    raise AssertionError("stands for a FlashInfer limit test")


def test_layernorm_quant_invalid_inputs():
    raise AssertionError("did not raise")


def test_failed():
    assert flashinfer.sampling.softmax is None
'''


def test_bins(tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / "tests").mkdir(parents=True)
    (checkout / "tests" / "__init__.py").write_text("")
    (checkout / "tests" / "test_stand_in.py").write_text(STAND_IN_TESTS)
    report = tmp_path / "report.json"
    run = subprocess.run([sys.executable, str(ROOT / "ci" / "flashinfer_tests.py"), str(checkout), "--report", str(report),
                          "tests/test_stand_in.py"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr  # one test failed
    data = json.loads(report.read_text())
    counts = {name.split("::")[-1]: bins for name, bins in data["counts"].items()}
    assert counts == {
        "test_same_function": {"passed": 1},
        "test_child_process": {"passed": 1},
        "test_not_shipped_name": {"not shipped": 1},
        "test_not_shipped_keyword": {"not shipped": 1},
        "test_declined": {"declined": 1},
        "test_limit_test_not_named": {"failed": 1},  # only the functions _DIFFERS names are binned "differs"
        "test_layernorm_quant_invalid_inputs": {"differs": 1},
        "test_failed": {"failed": 1},
    }, run.stdout
    assert sorted(data["failed_ids"]) == ["tests/test_stand_in.py::test_failed",
                                          "tests/test_stand_in.py::test_limit_test_not_named"]
    assert "NotShipped: flashinfer.sampling.get_seed_and_offset" in run.stdout


STAND_IN_FLASHINFER = {
    "flashinfer/__init__.py": "",
    "flashinfer/gemm.py": "def mm_fp4(*args):\n    return 'real mm_fp4'\n",
    "flashinfer/utils.py": "def capability():\n    return 'real capability'\n",
}

OVERLAY_TESTS = '''
import torch
import flashinfer
from flashinfer.gemm import mm_fp4  # FlashInfer's: the overlay does not serve gemm
from flashinfer.utils import capability


def test_served():
    assert capability() == "real capability"  # a helper of FlashInfer's: still aotinfer's test
    packed = flashinfer.quantization.packbits(torch.tensor([True, False, True]), bitorder="little")
    assert packed.tolist() == [5]


def test_fell_through():
    assert mm_fp4() == "real mm_fp4"


def test_failed():
    assert flashinfer.quantization.packbits is None
'''


def test_overlay_bins(tmp_path):
    checkout, real = tmp_path / "checkout", tmp_path / "real"
    (checkout / "tests").mkdir(parents=True)
    (checkout / "tests" / "__init__.py").write_text("")
    (checkout / "tests" / "test_overlay_stand_in.py").write_text(OVERLAY_TESTS)
    for name, text in STAND_IN_FLASHINFER.items():
        (real / name).parent.mkdir(parents=True, exist_ok=True)
        (real / name).write_text(text)
    report = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(real), str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(ROOT / "ci" / "flashinfer_tests.py"), str(checkout), "--overlay", "--report",
                          str(report), "tests/test_overlay_stand_in.py"], capture_output=True, text=True, timeout=300,
                         env=env)  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr  # one test failed
    counts = {name.split("::")[-1]: bins for name, bins in json.loads(report.read_text())["counts"].items()}
    assert counts == {
        "test_served": {"passed on aotinfer": 1},
        "test_fell_through": {"passed on FlashInfer": 1},
        "test_failed": {"failed": 1},
    }, run.stdout
    assert "passed on FlashInfer x1: ran flashinfer/gemm.py" in run.stdout


def test_overlay_needs_a_real_flashinfer(tmp_path):
    (tmp_path / "tests").mkdir()
    run = subprocess.run([sys.executable, str(ROOT / "ci" / "flashinfer_tests.py"), str(tmp_path), "--overlay"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 2 and "beside a real FlashInfer" in run.stderr
