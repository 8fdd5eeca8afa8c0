"""What a server process does around aotinfer: fork while a JIT build runs in a thread, load a
tampered kernel object, point the trace dump at a directory it cannot write. CPU only: JIT builds
are faked (tests/jit_fakes.py) and the objects of this install load without a GPU."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aotinfer import _loader, _manifest
from aotinfer._arch import NoCompatibleBuild, choose_arch

TESTS = Path(__file__).resolve().parent


def uncovered_cc():
    """A compute capability no installed build of scale runs on (7.5 or 8.9 on most builds)."""
    for cc in [(8, 9), (7, 5), (8, 6), (8, 0), (9, 0), (12, 0)]:
        try:
            choose_arch(cc, _loader.module_builds("scale"), _loader.module_entry("scale")["sm_majors"])
        except NoCompatibleBuild:
            return cc
    pytest.skip("the installed builds run on every GPU tried")


def stand_in_object():
    build = next(iter(_loader.module_builds("scale").values()))
    return os.path.join(build["dir"], build["file"])


def run_script(code, tmp_path, timeout, *args, **env):
    full = dict(os.environ, AOTINFER_CACHE_DIR=str(tmp_path / "cache"), PYTHONWARNINGS="ignore",
                PYTHONPATH=os.pathsep.join([str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]), **env)
    full.pop("AOTINFER_JIT", None)
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], env=full,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"still running after {timeout} s (a deadlock):\n{e.stdout}\n{e.stderr}")


# ---- a fork while a JIT build runs ------------------------------------------------------------

FORK_DURING_BUILD = """
    import json, os, sys, threading
    import jit_fakes
    from aotinfer import _loader
    cc, stand_in = (int(sys.argv[1]), int(sys.argv[2])), sys.argv[3]
    _loader.device_capability = lambda index: cc
    jit_fakes.install(3.0, stand_in)
    building = threading.Event()
    real_run = jit_fakes.core.JitSpec._run

    def run(spec, commands, work):
        building.set()
        real_run(spec, commands, work)

    jit_fakes.core.JitSpec._run = run
    loaded = {}
    builder = threading.Thread(target=lambda: loaded.update(parent=_loader.get_module("scale", 0)))
    builder.start()
    assert building.wait(60), "the build never started"
    pid = os.fork()  # while the thread builds; with the loader's lock held across it, this hung
    if pid == 0:
        try:  # the child uses aotinfer: it waits for the parent's build, or builds itself
            module = _loader.get_module("scale", 0)
            print(json.dumps({"child": module.scale is not None}), flush=True)
            code = 0
        except BaseException as e:
            print(f"child failed: {e!r}", flush=True)
            code = 1
        os._exit(code)
    builder.join(60)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"parent": loaded.get("parent") is not None and loaded["parent"].scale is not None,
                      "child_status": os.waitstatus_to_exitcode(status)}), flush=True)
"""


def test_fork_during_a_jit_build_neither_hangs_nor_corrupts_the_cache(tmp_path):
    cc = uncovered_cc()
    out = run_script(FORK_DURING_BUILD, tmp_path, 60, *cc, stand_in_object(), AOTINFER_JIT_LOCK_TIMEOUT="60")
    print(out.stdout, out.stderr)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert {"child": True} in lines and {"parent": True, "child_status": 0} in lines
    # One build, whole and checked: the child waited for the parent's, or built its own after it.
    from aotinfer.jit import cache

    (entry,) = (tmp_path / "cache" / "jit").iterdir()
    stem, _, key = entry.name.rpartition("-")
    assert cache.Entry(tmp_path / "cache", stem, key).problem() is None
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []


THREADS_LOAD_ONCE = """
    import sys, threading
    import jit_fakes
    from aotinfer import _loader
    cc, stand_in = (int(sys.argv[1]), int(sys.argv[2])), sys.argv[3]
    _loader.device_capability = lambda index: cc
    jit_fakes.install(1.0, stand_in)
    loads = []
    real_load = _loader._load
    _loader._load = lambda name, index: loads.append(name) or real_load(name, index)
    got = []
    threads = [threading.Thread(target=lambda: got.append(_loader.get_module("scale", 0))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 4 and len({id(m) for m in got}) == 1, got
    assert loads == ["scale"], loads
    # A failed load is not remembered: every waiter gets its error, and the next call tries again.
    _loader._load = lambda name, index: (_ for _ in ()).throw(_loader.BrokenInstall("broken " + name))
    errors = []
    def fail():
        try:
            _loader.get_module("norm", 0)
        except _loader.BrokenInstall as e:
            errors.append(str(e))
    threads = [threading.Thread(target=fail) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == ["broken norm"] * 3, errors
    _loader._load = real_load
    print("ok")
"""


def test_threads_share_one_load(tmp_path):
    out = run_script(THREADS_LOAD_ONCE, tmp_path, 120, *uncovered_cc(), stand_in_object())
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr


# ---- the trace dump directory ---------------------------------------------------------------------


def test_trace_dump_dir_that_cannot_be_written_names_the_variable(tmp_path, monkeypatch):
    import torch

    import aotinfer

    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a directory below a file can be created by no one, root included
    x, w = torch.ones(2, 8), torch.ones(8)
    monkeypatch.setenv("AOTINFER_TRACE_DUMP_DIR", str(blocker / "traces"))
    with pytest.raises(OSError, match=r"rmsnorm\.trace cannot write .*a-file/traces/.*\.json .*"
                                      r"AOTINFER_TRACE_DUMP_DIR='.*a-file/traces' must name a directory"):
        aotinfer.rmsnorm.trace(x, w)
    with pytest.raises(OSError, match=r"dump_dir='.*a-file/given' must name a directory"):
        aotinfer.rmsnorm.trace(x, w, dump_dir=str(blocker / "given"))
    monkeypatch.setenv("AOTINFER_TRACE_DUMP_DIR", str(tmp_path / "fine"))
    definition = aotinfer.rmsnorm.trace(x, w)
    assert json.loads((tmp_path / "fine" / f"{definition['name']}.json").read_text()) == definition
