"""@aotinfer_api: zero cost at level 0, what each level logs, and where it goes."""

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from aotinfer import api_logging
from aotinfer.api_logging import aotinfer_api


@pytest.fixture
def fresh_logger(monkeypatch):
    """Each test sets its own AOTINFER_LOGDEST; the handler is made on first use."""
    def reset():
        logger = logging.getLogger("aotinfer.api")
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
            handler.close()
        api_logging._logger = None

    reset()
    yield
    reset()


def op_at_level(monkeypatch, level):
    monkeypatch.setenv("AOTINFER_LOGLEVEL", str(level))

    @aotinfer_api
    def my_op(x, y, scale=2.0, out=None):
        return x * scale + y

    return my_op


def test_level_0_returns_a_plain_function_itself(monkeypatch):
    monkeypatch.setenv("AOTINFER_LOGLEVEL", "0")

    def op(x):
        return x

    assert aotinfer_api(op) is op
    assert aotinfer_api()(op) is op


def test_level_0_public_ops_are_their_own_functions():
    # No wrapper at level 0: the op's code is its body, defined in its own module's file.
    import aotinfer

    for op in (aotinfer.rmsnorm, aotinfer.scale, aotinfer.top_k_top_p_sampling_from_probs):
        assert not hasattr(op, "__wrapped__")
        assert op.__code__.co_filename == __import__(op.__module__, fromlist=["_"]).__file__


@pytest.mark.parametrize("text", ["verbose", "-1", "3.5", "99"])
def test_bad_level_warns_and_logs_nothing(monkeypatch, text):
    monkeypatch.setenv("AOTINFER_LOGLEVEL", text)
    monkeypatch.setattr(api_logging, "_warned", set())
    with pytest.warns(RuntimeWarning, match=f"AOTINFER_LOGLEVEL={text!r} is not a level"):
        assert api_logging.log_level() == 0


def test_bad_settings_never_break_import_or_ops(tmp_path):
    # A level that is not one, a log file in a missing directory: one warning each, then the
    # defaults; import and ops work.
    script = textwrap.dedent(
        """
        import warnings
        warnings.simplefilter("always")
        import torch, aotinfer
        for _ in range(2):
            try:
                aotinfer.scale(torch.ones(3), 2.0)
            except ValueError as e:
                print("raised:", e)
        """
    )
    for env, warning in [
        ({"AOTINFER_LOGLEVEL": "verbose"}, "AOTINFER_LOGLEVEL='verbose' is not a level"),
        ({"AOTINFER_LOGLEVEL": "1", "AOTINFER_LOGDEST": str(tmp_path / "missing" / "log.txt")},
         "AOTINFER_LOGDEST="),
    ]:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             env=dict(os.environ, **env), cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert out.stdout.count("raised: Expected input to be a CUDA tensor") == 2
        assert out.stderr.count(warning) == 1, out.stderr


@pytest.mark.parametrize("dest", ["STDOUT", "Stdout"])
def test_stream_names_in_any_case(monkeypatch, fresh_logger, capsys, tmp_path, dest):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AOTINFER_LOGDEST", dest)
    op = op_at_level(monkeypatch, 1)
    op(torch.ones(2), torch.ones(2))
    assert "aotinfer.my_op" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == [], "no file named after the stream"


def test_level_1_names_the_op(monkeypatch, fresh_logger, capsys):
    monkeypatch.setenv("AOTINFER_LOGDEST", "stdout")
    op = op_at_level(monkeypatch, 1)
    op(torch.ones(2), torch.ones(2))
    out = capsys.readouterr().out
    assert "aotinfer.my_op" in out and "Tensor(" not in out


def test_level_3_inputs_and_outputs(monkeypatch, fresh_logger, capsys):
    monkeypatch.setenv("AOTINFER_LOGDEST", "stderr")
    op = op_at_level(monkeypatch, 3)
    x = torch.ones(4, 3, dtype=torch.bfloat16).t()
    op(x, torch.zeros(3, 4), scale=0.5)
    err = capsys.readouterr().err
    assert "x: Tensor(shape=[3, 4], dtype=bfloat16, device=cpu, stride=[1, 3])" in err
    assert "scale: 0.5" in err and "out: None" in err
    assert "aotinfer.my_op -> Tensor(shape=[3, 4], dtype=float32" in err
    assert "min=" not in err


def test_level_5_statistics(monkeypatch, fresh_logger, capsys):
    monkeypatch.setenv("AOTINFER_LOGDEST", "stdout")
    op = op_at_level(monkeypatch, 5)
    x = torch.tensor([1.0, -3.0, float("nan"), float("inf"), 5.0])
    op(x, torch.zeros(5), scale=1.0)
    out = capsys.readouterr().out
    assert "x: Tensor(shape=[5]" in out
    assert "min=-3 max=5 mean=1 nan=1 inf=1" in out
    assert "(empty)" in op_stats_of_empty(op, capsys)


def op_stats_of_empty(op, capsys):
    op(torch.zeros(0), torch.zeros(0))
    return capsys.readouterr().out


def test_file_destination_with_pid(monkeypatch, fresh_logger, tmp_path):
    monkeypatch.setenv("AOTINFER_LOGDEST", str(tmp_path / "api-%i.log"))
    op = op_at_level(monkeypatch, 1)
    op(torch.ones(1), torch.ones(1))
    logging.getLogger("aotinfer.api").handlers[0].flush()
    text = (tmp_path / f"api-{os.getpid()}.log").read_text()
    assert "aotinfer.my_op" in text


def test_logging_wrapper_keeps_the_op(monkeypatch, fresh_logger, capsys):
    # Above level 0 the published op is a wrapper that logs, then runs the op (errors included),
    # and keeps its name, signature and attributes.
    import inspect

    monkeypatch.setenv("AOTINFER_LOGLEVEL", "1")
    monkeypatch.setenv("AOTINFER_LOGDEST", "stdout")

    @aotinfer_api
    def checked(x, *, skip_check=False):
        if not skip_check and x < 0:
            raise ValueError("x must be non-negative")
        return x

    assert checked.__wrapped__.__name__ == "checked" and list(inspect.signature(checked).parameters) == ["x", "skip_check"]
    assert checked(1) == 1 and checked(-1, skip_check=True) == -1
    with pytest.raises(ValueError, match="x must be non-negative"):
        checked(-1)
    assert capsys.readouterr().out.count("aotinfer.checked") == 3
    assert checked.is_compute_capability_supported(90)  # it calls no kernel


def test_public_op_logs_then_raises(tmp_path):
    # A fresh interpreter: the level is read when aotinfer's ops are decorated, at import.
    script = textwrap.dedent(
        """
        import torch, aotinfer
        try:
            aotinfer.scale(torch.ones(3), 2.0)
        except ValueError as e:
            print("raised:", e)
        """
    )
    env = dict(os.environ, AOTINFER_LOGLEVEL="3", AOTINFER_LOGDEST="stdout")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "aotinfer.scale" in out.stdout
    assert "input: Tensor(shape=[3], dtype=float32, device=cpu, stride=[1])" in out.stdout
    assert "factor: 2.0" in out.stdout
    assert "raised: Expected CUDA tensors" in out.stdout or "raised: Expected input to be a CUDA tensor" in out.stdout


@pytest.mark.gpu
def test_level_5_under_graph_capture(tmp_path):
    script = textwrap.dedent(
        """
        import torch, aotinfer
        x = torch.randn(1000, device="cuda")
        y = torch.empty_like(x)
        aotinfer.scale(x, 2.0, out=y)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            aotinfer.scale(x, 3.0, out=y)
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, x * 3.0)
        print("replay ok")
        """
    )
    env = dict(os.environ, AOTINFER_LOGLEVEL="5", AOTINFER_LOGDEST="stdout")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "replay ok" in out.stdout
    assert "min=" in out.stdout  # the eager call
    assert out.stdout.count("(statistics skipped: CUDA graph capture)") >= 2  # input and out in capture
