"""The flashinfer overlay (aotinfer/overlay.py): each case runs a fresh interpreter that processes
the wheel's aotinfer_overlay.pth as site-packages would (site.addsitedir), with AOTINFER_FLASHINFER
set or not, and with or without a small fake FlashInfer on sys.path. On the CPU, what it serves
where; on a GPU, vLLM's and SGLang's call sequences replayed through it (server_sequences.py)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import aotinfer
from aotinfer import cli, overlay

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
gpu = pytest.mark.gpu
PTH = ROOT / "python" / "aotinfer_overlay.pth"

# A fake FlashInfer: each module records its import in fake_log.imported under the name it was
# imported as. Its __init__ imports every module eagerly, as FlashInfer's does.
FAKE = {
    "fake_log.py": "imported = []\n",
    "flashinfer/__init__.py": """
        from .version import __version__ as __version__
        from . import jit as jit
        from .sampling import softmax as softmax
        from .sampling import get_seed_and_offset as get_seed_and_offset
        from .gemm import mm_fp4 as mm_fp4
        from .decode import BatchDecodeWithPagedKVCacheWrapper as BatchDecodeWithPagedKVCacheWrapper
        from .prefill import BatchPrefillWithPagedKVCacheWrapper as BatchPrefillWithPagedKVCacheWrapper
        from .norm import rmsnorm as rmsnorm
        from . import comm as comm
        try:
            from .optional_part import fancy as fancy
        except ImportError:
            pass
        def defined_here():
            return "real defined_here"
        """,
    "flashinfer/version.py": "from . import _build_meta\n__version__ = _build_meta.__version__\n",
    "flashinfer/_build_meta.py": "__version__ = '9.9.9.post1'\n",
    "flashinfer/jit/__init__.py": "",
    "flashinfer/jit/core.py": "def check_cuda_arch():\n    return 'real check_cuda_arch'\n",
    "flashinfer/sampling.py": """
        def softmax(*args):
            return "real softmax"
        def get_seed_and_offset(*args):
            return "real get_seed_and_offset"
        """,
    "flashinfer/gemm.py": "def mm_fp4(*args):\n    return 'real mm_fp4'\n",
    "flashinfer/prefill.py": "class BatchPrefillWithPagedKVCacheWrapper:\n    pass\n",
    "flashinfer/decode.py": """
        from .prefill import BatchPrefillWithPagedKVCacheWrapper as PrefillItUses
        class BatchDecodeWithPagedKVCacheWrapper:
            pass
        def trtllm_batch_decode_with_kv_cache(*args):
            return "real trtllm_batch_decode_with_kv_cache"
        """,
    "flashinfer/norm/__init__.py": "def rmsnorm(*args):\n    return 'real rmsnorm'\n",
    "flashinfer/norm/kernels.py": "class RMSNormKernel:\n    pass\n",
    "flashinfer/comm.py": "",
    "flashinfer/utils.py": "def device_support_pdl(device):\n    return 'real device_support_pdl'\n",
}
LOG = "import fake_log; fake_log.imported.append(__name__.rpartition('.')[2])\n"


@pytest.fixture
def fake(tmp_path):
    root = tmp_path / "fake"
    for name, text in FAKE.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text((LOG if name.startswith("flashinfer/") else "") + textwrap.dedent(text))
    return root


def run(tmp_path, script, variable=None, fake=None, hook=True, paths=()):
    """Runs ``script`` in a fresh interpreter after the .pth hook (``hook``), with
    AOTINFER_FLASHINFER=``variable`` (None: unset), the fake FlashInfer first on sys.path, then
    ``paths``."""
    site_dir = tmp_path / "site-packages"
    site_dir.mkdir(exist_ok=True)
    (site_dir / PTH.name).write_text(PTH.read_text())
    env = {k: v for k, v in os.environ.items() if k != overlay.ENV}
    if variable is not None:
        env[overlay.ENV] = variable
    first = [str(fake)] * (fake is not None) + [str(p) for p in paths]
    env["PYTHONPATH"] = os.pathsep.join(first + [str(ROOT / "python"), env.get("PYTHONPATH", "")])
    # Without the hook: as if it never ran (an installed aotinfer's own .pth may have run it).
    no_hook = "import sys\nsys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, 'aotinfer_overlay_hook', False)]\n"
    prologue = f"import site, sys\nsite.addsitedir({str(site_dir)!r})\n" if hook else no_hook
    out = subprocess.run([sys.executable, "-c", prologue + textwrap.dedent(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok"), out.stdout
    return out


def test_pth_is_one_line_that_only_reads_the_variable():
    (line,) = PTH.read_text().splitlines()
    assert line == 'import os; os.environ.get("AOTINFER_FLASHINFER") and __import__("_aotinfer_overlay_hook").register()'
    import _aotinfer_overlay_hook

    assert set(_aotinfer_overlay_hook.OFF) == overlay._FALSE


@pytest.mark.parametrize("variable", [None, "", "0", "off"])
def test_unset_or_off_changes_nothing(tmp_path, fake, variable):
    run(tmp_path, """
        import importlib.util
        assert "aotinfer" not in sys.modules
        assert importlib.util.find_spec("flashinfer") is None
        try:
            import flashinfer
        except ModuleNotFoundError:
            pass
        else:
            raise AssertionError(flashinfer)
        assert "flashinfer" not in sys.modules and "aotinfer" not in sys.modules
        print("ok")
        """, variable)
    # With a FlashInfer installed, it is FlashInfer's own import, whole.
    run(tmp_path, f"""
        import flashinfer, fake_log
        assert flashinfer.__file__ == {str(fake / "flashinfer" / "__init__.py")!r}
        assert flashinfer.softmax() == "real softmax" and "sampling" in fake_log.imported
        assert "aotinfer" not in sys.modules and "aotinfer._real_flashinfer" not in sys.modules
        print("ok")
        """, variable, fake)


def test_serves_every_shipped_name_at_flashinfers_paths(tmp_path):
    served = overlay.served(overlay.DEFAULT_FAMILIES)
    assert set(served) == {"flashinfer"} | {f"flashinfer.{f}" for f in overlay.DEFAULT_FAMILIES}
    assert all(served.values())
    assert {"top_k_top_p_sampling_from_logits", "softmax"} <= set(served["flashinfer.sampling"])
    assert {"rmsnorm", "rmsnorm_quant", "fused_add_rmsnorm_quant"} <= set(served["flashinfer.norm"])
    assert {"BatchDecodeWithPagedKVCacheWrapper", "fast_decode_plan"} <= set(served["flashinfer.decode"])
    assert "_get_range_buf" in served["flashinfer.decode"] and "_get_range_buf" not in served["flashinfer"]
    assert "rope_quantize_fp8" in served["flashinfer.rope"] and "rope_quantize_fp8" not in served["flashinfer"]
    paths = {path: sorted(names) for path, names in served.items()}
    out = run(tmp_path, f"""
        import importlib, importlib.util, logging
        logging.basicConfig(level=logging.INFO)
        assert "aotinfer" not in sys.modules  # the hook waits for the first import of flashinfer
        assert importlib.util.find_spec("flashinfer") is not None
        import flashinfer, aotinfer
        for path, names in {paths!r}.items():
            module = importlib.import_module(path)
            for name in names:  # FlashInfer's private helpers: from aotinfer's module of their family
                ours = getattr(aotinfer, name) if hasattr(aotinfer, name) else getattr(
                    importlib.import_module("aotinfer." + path.rpartition(".")[2]), name)
                assert getattr(module, name) is ours, (path, name)
        from flashinfer.decode import fast_decode_plan
        from flashinfer.sampling import top_p_sampling_from_probs
        assert fast_decode_plan is aotinfer.fast_decode_plan
        assert top_p_sampling_from_probs is aotinfer.top_p_sampling_from_probs
        assert flashinfer.sampling is sys.modules["flashinfer.sampling"]
        assert flashinfer.__version__ == {overlay.STANDIN_VERSION!r}
        try:
            flashinfer.rope_quantize_fp8()
        except ImportError as e:
            assert "flashinfer.rope" in str(e), e
        print("ok")
        """, "1")
    assert f"aotinfer serves flashinfer's {', '.join(sorted(overlay.DEFAULT_FAMILIES))}" in out.stderr
    assert "FlashInfer is not installed" in out.stderr


def test_unshipped_names_import_and_raise_when_used(tmp_path):
    run(tmp_path, """
        import torch
        from flashinfer import mm_fp4, BatchPODWithPagedKVCacheWrapper
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache
        from flashinfer.utils import FP4Tensor, device_support_pdl, get_compute_capability, is_sm90a_supported
        import flashinfer
        assert flashinfer.mm_fp4 is mm_fp4  # one placeholder per name
        for thing, name in [(mm_fp4, "flashinfer.mm_fp4"), (BatchPODWithPagedKVCacheWrapper, "flashinfer.BatchPODWithPagedKVCacheWrapper"),
                            (trtllm_batch_decode_with_kv_cache, "flashinfer.decode.trtllm_batch_decode_with_kv_cache")]:
            try:
                thing(1, x=2)
            except ImportError as e:
                assert type(e).__name__ == "NotServedError" and name in str(e) and "not installed" in str(e), e
            else:
                raise AssertionError(name)
        class Mine(FP4Tensor):  # a server's subclass at its module top still imports
            pass
        try:
            Mine()
        except ImportError as e:
            assert "flashinfer.utils.FP4Tensor" in str(e), e
        else:
            raise AssertionError("Mine()")
        # probes answer no
        assert getattr(mm_fp4, "is_backend_supported", None) is None and not hasattr(flashinfer, "__wrapped__")
        for name in ["flashinfer.comm", "flashinfer.jit", "flashinfer.fused_moe"]:
            try:
                __import__(name)
            except ModuleNotFoundError:
                pass
            else:
                raise AssertionError(name)
        # the flashinfer.utils helpers servers call
        assert device_support_pdl(torch.device("cpu")) is False
        try:
            get_compute_capability(torch.device("cpu"))
        except ValueError as e:
            assert "device" in str(e)
        else:
            raise AssertionError("get_compute_capability(cpu)")
        assert is_sm90a_supported.__name__ == "is_sm90a_supported"
        print("ok")
        """, "1")


def test_families_limit_what_is_served(tmp_path):
    run(tmp_path, """
        import aotinfer, flashinfer
        assert flashinfer.softmax is aotinfer.softmax and flashinfer.decode.fast_decode_plan is aotinfer.fast_decode_plan
        try:
            flashinfer.rmsnorm(1)
        except ImportError as e:
            assert "family 'norm'" in str(e) and "AOTINFER_FLASHINFER='sampling, decode'" in str(e), e
        else:
            raise AssertionError("rmsnorm")
        try:
            import flashinfer.norm
        except ModuleNotFoundError:
            pass
        else:
            raise AssertionError("flashinfer.norm")
        print("ok")
        """, "sampling, decode")


def test_unknown_family_warns_and_stays_off(tmp_path):
    out = run(tmp_path, """
        try:
            import flashinfer
        except ModuleNotFoundError:
            print("ok")
        """, "sampling,bogus")
    assert "bogus" in out.stderr and "stays off" in out.stderr
    with pytest.raises(ValueError, match=r"unknown families \['bogus'\].*sampling"):
        overlay.install(["sampling", "bogus"])
    with pytest.raises(ValueError, match="no family"):
        overlay.install("")
    with pytest.raises(TypeError, match="families"):
        overlay.install(3)
    assert overlay.parse_families("ALL") == overlay.DEFAULT_FAMILIES and overlay.parse_families("0") is None
    # MLA only where named: servers' MLA backends reach further into FlashInfer's wrapper
    assert "mla" not in overlay.DEFAULT_FAMILIES and overlay.parse_families("mla,decode") == ("decode", "mla")
    assert overlay.served(("mla",))["flashinfer.mla"] == {"BatchMLAPagedAttentionWrapper": aotinfer.BatchMLAPagedAttentionWrapper}


def test_real_flashinfer_serves_the_rest_lazily(tmp_path, fake):
    run(tmp_path, f"""
        import importlib.util
        import aotinfer, fake_log
        import flashinfer
        assert fake_log.imported == [], fake_log.imported  # FlashInfer's __init__ did not run
        assert flashinfer.__file__ == {str(fake / "flashinfer" / "__init__.py")!r}
        assert flashinfer.softmax is aotinfer.softmax and flashinfer.sampling.softmax is aotinfer.softmax
        assert flashinfer.BatchPrefillWithPagedKVCacheWrapper is aotinfer.BatchPrefillWithPagedKVCacheWrapper
        assert fake_log.imported == [], fake_log.imported
        assert flashinfer.__version__ == "9.9.9.post1"
        assert flashinfer.sampling.get_seed_and_offset() == "real get_seed_and_offset"
        from flashinfer import mm_fp4
        assert mm_fp4() == "real mm_fp4"
        assert flashinfer.utils.device_support_pdl(None) == "real device_support_pdl"  # no stand-in
        from flashinfer.jit.core import check_cuda_arch
        assert check_cuda_arch() == "real check_cuda_arch"
        assert sorted(fake_log.imported) == ["_build_meta", "core", "gemm", "jit", "sampling", "utils", "version"], fake_log.imported
        assert not hasattr(flashinfer, "fancy")  # FlashInfer's __init__ would have skipped it too
        assert importlib.util.find_spec("flashinfer.nonexistent") is None
        # FlashInfer's own modules see FlashInfer's classes, the server sees aotinfer's
        from flashinfer.decode import trtllm_batch_decode_with_kv_cache
        assert trtllm_batch_decode_with_kv_cache() == "real trtllm_batch_decode_with_kv_cache"
        real = sys.modules["aotinfer._real_flashinfer.prefill"].BatchPrefillWithPagedKVCacheWrapper
        assert sys.modules["aotinfer._real_flashinfer.decode"].PrefillItUses is real
        assert flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper is aotinfer.BatchDecodeWithPagedKVCacheWrapper
        # a served family that is a package in FlashInfer: its real submodules import
        import flashinfer.norm.kernels
        assert flashinfer.norm.rmsnorm is aotinfer.rmsnorm and flashinfer.norm.kernels.RMSNormKernel.__name__ == "RMSNormKernel"
        assert "comm" not in fake_log.imported
        import flashinfer.comm
        assert fake_log.imported[-1] == "comm"
        # a name FlashInfer's __init__ defines itself runs that __init__, once
        assert flashinfer.defined_here() == "real defined_here"
        print("ok")
        """, "1", fake)


def test_real_flashinfer_serves_disabled_families(tmp_path, fake):
    run(tmp_path, """
        import aotinfer, flashinfer
        assert flashinfer.softmax is aotinfer.softmax
        assert flashinfer.rmsnorm() == "real rmsnorm" and flashinfer.norm.__name__ == "aotinfer._real_flashinfer.norm"
        assert flashinfer.norm.rmsnorm() == "real rmsnorm"
        print("ok")
        """, "sampling", fake)


def test_install_explicitly(tmp_path, fake):
    run(tmp_path, """
        import aotinfer
        from aotinfer import overlay
        overlay.install("sampling")
        overlay.install(["sampling"])  # the same again: nothing to do
        overlay.install("decode")  # another, before flashinfer is imported: replaces it
        import flashinfer
        assert flashinfer.fast_decode_plan is aotinfer.fast_decode_plan and flashinfer.softmax() == "real softmax"
        try:
            overlay.install("sampling")
        except RuntimeError as e:
            assert "imported already" in str(e), e
        else:
            raise AssertionError("install after import")
        print("ok")
        """, None, fake, hook=False)
    run(tmp_path, """
        import flashinfer
        from aotinfer import overlay
        try:
            overlay.install()
        except RuntimeError as e:
            assert "imported already" in str(e) and "AOTINFER_FLASHINFER" in str(e), e
        else:
            raise AssertionError("install after FlashInfer's import")
        print("ok")
        """, None, fake, hook=False)


def test_started_processes_get_it_and_the_vllm_plugin(tmp_path):
    child = "import aotinfer, flashinfer; assert flashinfer.softmax is aotinfer.softmax; print('child ok')"
    run(tmp_path, f"""
        import subprocess
        out = subprocess.run([sys.executable, "-c", "import site, sys; site.addsitedir(sys.argv[1]); " + {child!r},
                              {str(tmp_path / "site-packages")!r}], capture_output=True, text=True)
        assert out.stdout.strip() == "child ok", out.stderr
        print("ok")
        """, "sampling")
    # vLLM's plugin where no hook ran (python -S, aotinfer outside site-packages)
    run(tmp_path, """
        from aotinfer.overlay import vllm_plugin
        vllm_plugin()
        import aotinfer, flashinfer
        assert flashinfer.softmax is aotinfer.softmax
        print("ok")
        """, "1", hook=False)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '[project.entry-points."vllm.general_plugins"]\naotinfer_flashinfer = "aotinfer.overlay:vllm_plugin"' in pyproject


VLLM_GATE = """
    import os
    from aotinfer.overlay import vllm_plugin
    vllm_plugin()
    print(os.environ.get("VLLM_HAS_FLASHINFER_CUBIN"), "ok")
    """


def test_vllm_plugin_tells_vllm_no_compiler_is_needed(tmp_path, fake):
    # No real FlashInfer: vLLM's has_flashinfer() must not ask for nvcc; the hook's process too.
    assert run(tmp_path, VLLM_GATE, "1", hook=False).stdout.split() == ["1", "ok"]
    assert run(tmp_path, VLLM_GATE, "sampling").stdout.split() == ["1", "ok"]
    # Off, a real FlashInfer (whose other names may need its JIT), or the user's own value: untouched.
    assert run(tmp_path, VLLM_GATE, None).stdout.split() == ["None", "ok"]
    assert run(tmp_path, VLLM_GATE, "1", fake).stdout.split() == ["None", "ok"]
    assert run(tmp_path, "import os; os.environ['VLLM_HAS_FLASHINFER_CUBIN'] = '0'\n" + textwrap.dedent(VLLM_GATE),
               "1").stdout.split() == ["0", "ok"]


def test_info_says_whether_this_process_has_it(tmp_path):
    run(tmp_path, """
        from aotinfer import overlay
        assert overlay.state()["in_this_process"] == "start-up hook waiting for the first import of flashinfer"
        import flashinfer
        assert overlay.state()["in_this_process"] == "installed"
        print("ok")
        """, "1")
    run(tmp_path, """
        from aotinfer import overlay
        assert overlay.state()["in_this_process"].startswith("not installed: the start-up hook did not run")
        print("ok")
        """, "1", hook=False)


def test_info_shows_the_overlay(monkeypatch, capsys):
    monkeypatch.setenv(overlay.ENV, "sampling")
    assert cli.main(["info", "--json"]) in (0, 1)
    report = json.loads(capsys.readouterr().out)["overlay"]
    assert report["families"] == ["sampling"] and report["variable"] == "sampling"
    assert report["served"]["flashinfer.sampling"] == sorted(overlay.served(["sampling"])["flashinfer.sampling"])
    assert "softmax" in report["served"]["flashinfer"] and "flashinfer.norm" not in report["served"]
    cli.main(["info"])
    text = capsys.readouterr().out
    assert "flashinfer overlay: on for sampling (AOTINFER_FLASHINFER='sampling')" in text
    assert "flashinfer.sampling: " in text and "softmax" in text
    monkeypatch.delenv(overlay.ENV)
    cli.main(["info"])
    assert "flashinfer overlay: off (AOTINFER_FLASHINFER is unset" in capsys.readouterr().out


# ---- vLLM's and SGLang's call sequences through the overlay (server_sequences.py) ----------------


def replay(tmp_path, sequence, *args):
    """Runs ``server_sequences.<sequence>(*args)`` in a fresh interpreter with AOTINFER_FLASHINFER=1
    and the start-up hook, as a server's process runs: its ``import flashinfer`` is the overlay. In a
    subprocess because install() cannot be undone: this process keeps no overlay. This process's
    aotinfer comes first on the path (the built kernels are its), then the tests' references."""
    run(tmp_path, f"import server_sequences\nserver_sequences.{sequence}{args!r}\nprint('ok')\n", "1",
        paths=[Path(aotinfer.__file__).resolve().parent.parent, TESTS])


def test_servers_imports_get_aotinfers_objects(tmp_path):
    # Each server module's FlashInfer imports, as the GPU replays below make them: every served name
    # is aotinfer's object at the server's path, the others import.
    replay(tmp_path, "every_servers_names")


def test_sglangs_get_seq_lens_from_flashinfer_decode_is_aotinfers(tmp_path):
    # SGLang's fast_decode_plan imports get_seq_lens from flashinfer.decode (overlay.INTERNALS).
    replay(tmp_path, "sglang_get_seq_lens_is_served")


@gpu
def test_vllm_fast_plan_decode_sequence_through_the_overlay(tmp_path):
    """test_decode.py::test_vllm_fast_plan_decode_sequence on the GPU, with the run captured into a
    CUDA graph after the first plan and replayed after each fast plan, as vLLM does."""
    replay(tmp_path, "vllm_fast_plan_decode")


@gpu
@pytest.mark.parametrize("use_tensor_cores", [True, False])
def test_sglang_fast_decode_plan_sequence_through_the_overlay(tmp_path, use_tensor_cores):
    replay(tmp_path, "sglang_fast_decode_plan", use_tensor_cores)


@gpu
def test_sglang_fast_prefill_plan_sequence_through_the_overlay(tmp_path):
    """test_prefill.py::test_sglang_fast_prefill_plan_sequence on the GPU, under a CUDA graph
    captured after the first plan and replayed after each fast plan, as SGLang does."""
    replay(tmp_path, "sglang_fast_prefill_plan")


@gpu
def test_sglang_fast_prefill_plan_with_a_tree_mask_through_the_overlay(tmp_path):
    replay(tmp_path, "sglang_fast_prefill_plan_with_a_tree_mask")


@gpu
def test_vllm_flashinfer_sample_calls_through_the_overlay(tmp_path):
    replay(tmp_path, "vllm_flashinfer_sample")


@gpu
def test_sglang_sampler_calls_through_the_overlay(tmp_path):
    replay(tmp_path, "sglang_sampler")
