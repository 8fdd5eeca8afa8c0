"""FlashInfer's own tests, run against aotinfer: the check that a server switches by changing an import.

    python ci/flashinfer_tests.py CHECKOUT [--overlay] [--shard I/N] [--deadline SECONDS]
                                  [--report FILE.json] [TEST_PATH ...] [-- PYTEST_ARGS]
    python ci/flashinfer_tests.py --merge FILE.json ...

TEST_PATHs are relative to the checkout (default: the tests of the ops aotinfer ships). --shard runs
every N-th test from the I-th (0-based), so that N processes share a GPU's machine (FlashInfer's
large attention cases take 16-32 GB each: two processes at a time for those); --merge prints the
bins of several shards' reports together. Tests that would start after --deadline seconds are
skipped.

The tests import `flashinfer`; here that name is aotinfer, through a module finder installed before
pytest starts: `flashinfer.X` is `aotinfer.X` where aotinfer has it, and any name aotinfer does not
ship (a module, a function, a class) is a placeholder that raises NotShipped when it is used. Python
processes the tests start get the same finder, through a `flashinfer` package put first on their
PYTHONPATH. The tests' own helpers (`tests.test_helpers`) come from the checkout; its conftest.py
does not load (it wraps FlashInfer's internals in torch.compile).

Every test ends in one of these bins, counted per test function in the report:
- passed;
- not shipped: it used a FlashInfer name aotinfer does not have (NotShipped), or passed a keyword
  argument aotinfer's function does not take;
- declined: aotinfer refused the arguments with its documented error for what it does not support
  (NotImplementedError, BackendSupportedError, or a ValueError/TypeError whose message names the
  supported set) -- the message is in the report, to be read, since a refusal is only right where
  the op's docs say so;
- differs: a test of a limit of FlashInfer's kernels that aotinfer's lack (_DIFFERS names each);
- failed: anything else, a wrong result or an error FlashInfer's op would not raise.
Exit status 0 only where nothing failed.

--overlay runs them as a server would run on aotinfer: beside a real FlashInfer (importable here),
with aotinfer's overlay installed (`aotinfer.overlay.install()`, and AOTINFER_FLASHINFER=1 for the
processes the tests start, which take it through the .pth hook of aotinfer's wheel). Then a passed
test is binned by who served it: "passed on aotinfer", or "passed on FlashInfer" where code of the
real FlashInfer's ran during its setup or call (beside its helpers, which the tests call to decide
what to run: _REAL_HELPERS), the files named in the report. The other bins are as above but "not
shipped", which cannot happen there (every other name is FlashInfer's).
"""

from __future__ import annotations

import atexit
import collections
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import types

import pytest

_DEFAULT_TESTS = [
    "tests/utils/test_sampling.py",
    "tests/utils/test_norm.py",
    "tests/utils/test_activation.py",
    "tests/attention/test_batch_decode_kernels.py",
    "tests/attention/test_batch_prefill_kernels.py",
    "tests/attention/test_single_prefill.py",
    "tests/attention/test_hopper.py",
    "tests/attention/test_deepseek_mla.py",
    "tests/attention/test_decode_prefill_lse.py",
    "tests/attention/test_non_contiguous_decode.py",
    "tests/attention/test_non_contiguous_prefill.py",
    "tests/attention/test_rope.py",
    "tests/attention/test_page.py",
]


class NotShipped(NotImplementedError):
    """A FlashInfer name that aotinfer does not ship was used."""


def _placeholder(qualname: str):
    """Stands for a name aotinfer lacks: importable (tests import helpers they may not call), raising
    NotShipped when called, subclassed, or read further."""

    class Placeholder:
        def __init__(self, *args, **kwargs):
            raise NotShipped(qualname)

        def __init_subclass__(cls, **kwargs):
            raise NotShipped(qualname)

        def __class_getitem__(cls, item):
            return cls

    Placeholder.__name__ = Placeholder.__qualname__ = qualname.rsplit(".", 1)[-1]
    return Placeholder


# FlashInfer's utilities that its tests call to decide what to run: real answers, not placeholders.
def _capability(device=None):
    import torch

    return torch.cuda.get_device_capability(device)


def _utils_overrides():
    return {
        "get_compute_capability": _capability,
        "is_sm90a_supported": lambda device=None: _capability(device) == (9, 0),
        "is_sm100a_supported": lambda device=None: False,
        "is_sm110a_supported": lambda device=None: False,
        "is_sm120a_supported": lambda device=None: False,
        "is_sm121a_supported": lambda device=None: False,
        # The tests build FlashInfer's JIT modules in a fixture unless a prebuilt cache is there;
        # aotinfer's kernels are prebuilt.
        "has_flashinfer_jit_cache": lambda: True,
        "GPUArchitectureError": type("GPUArchitectureError", (Exception,), {}),
    }


# FlashInfer's trace check, which its norm tests call: a test utility, restated here from its
# documented behaviour. Each output within the dtype's tolerance except for max_mismatch_pct percent
# of its elements, and (min_cos_sim) cosine-similar to the reference.
_CHECK_TOLERANCE = {"float64": 1e-7, "float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2}


def _default_check(reference_outputs, actual_outputs, *, rtol=None, atol=None, max_mismatch_pct=0.0,
                   min_cos_sim=1.0 - 1e-3) -> bool:
    import torch

    as_list = lambda outputs: list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]  # noqa: E731
    refs, actuals = as_list(reference_outputs), as_list(actual_outputs)
    if len(refs) != len(actuals):
        return False
    for ref, actual in zip(refs, actuals):
        if not isinstance(ref, torch.Tensor) or not isinstance(actual, torch.Tensor):
            if ref != actual:
                return False
            continue
        if ref.shape != actual.shape:
            return False
        if ref.numel() == 0:
            continue
        if ref.is_floating_point() or actual.is_floating_point():
            name = str(actual.dtype if actual.is_floating_point() else ref.dtype).replace("torch.", "")
            tolerance = 0.1 if name.startswith("float8") else _CHECK_TOLERANCE.get(name, 0.0)
            a, r = actual.float(), ref.float()
            close = torch.isclose(a, r, rtol=tolerance if rtol is None else rtol,
                                  atol=tolerance if atol is None else atol)
        else:
            a, r = actual, ref
            close = actual == ref
        if 100.0 * (1.0 - close.float().mean().item()) > max_mismatch_pct:
            return False
        if min_cos_sim is not None and (ref.is_floating_point() or actual.is_floating_point()):
            finite = torch.isfinite(a) & torch.isfinite(r)
            a, r = a[finite], r[finite]
            norms = a.norm() * r.norm()
            cos = 1.0 if norms.item() == 0 and torch.equal(a, r) else (a * r).sum().item() / max(norms.item(), 1e-30)
            if cos < min_cos_sim:
                return False
    return True


_OVERRIDES = {"flashinfer.utils": _utils_overrides, "flashinfer.trace": lambda: {"default_check": _default_check}}


class _Shim(types.ModuleType):
    """`flashinfer.<name>`: aotinfer's module of that name (if any), then overrides, then placeholders."""

    def __init__(self, name: str, target, overrides: dict):
        super().__init__(name)
        self.__path__ = []  # a package: every submodule resolves through the finder
        self._target = target
        self._overrides = overrides

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr in self._overrides:
            return self._overrides[attr]
        submodule = f"{self.__name__}.{attr}"
        value = getattr(self._target, attr, None)
        if isinstance(value, types.ModuleType):  # aotinfer's module, seen through its own shim
            return importlib.import_module(submodule)
        if value is not None:
            return value
        return _placeholder(submodule)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "flashinfer" or fullname.startswith("flashinfer."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        name = spec.name
        aot_name = "aotinfer" + name[len("flashinfer") :]
        try:
            target = importlib.import_module(aot_name)
        except ImportError:
            target = None
        overrides = _OVERRIDES[name]() if name in _OVERRIDES else {}
        return _Shim(name, target, overrides)

    def exec_module(self, module):
        pass


# A `flashinfer` package for the Python processes the tests start (FlashInfer's torch.compile tests
# run their script in a subprocess): on PYTHONPATH, it installs this module's finder in the child and
# replaces itself with the shim, so the child's `flashinfer` is aotinfer as the parent's is.
_CHILD_PACKAGE = """\
import importlib.machinery, importlib.util, sys
_spec = importlib.util.spec_from_file_location("_flashinfer_tests_harness", {harness!r})
_harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_harness)
_finder = _harness._Finder()
sys.meta_path.insert(0, _finder)
sys.modules[__name__] = _finder.create_module(importlib.machinery.ModuleSpec(__name__, _finder, is_package=True))
"""


def _resolve_in_children(directory: str) -> None:
    """Puts the child package under `directory` first on the PYTHONPATH that started processes inherit."""
    package = os.path.join(directory, "flashinfer")
    os.makedirs(package, exist_ok=True)
    with open(os.path.join(package, "__init__.py"), "w") as f:
        f.write(_CHILD_PACKAGE.format(harness=os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [directory, os.environ.get("PYTHONPATH")]))
    atexit.register(shutil.rmtree, directory, True)


# Tests that check a limit of FlashInfer's kernels which aotinfer's do not have: a failure of one of
# these is binned as "differs", with the reason. Nothing else is.
_DIFFERS = {
    "test_batch_decode_rejects_unequal_kv_strides_nvfp4_contract":
        "expects K and V pools of unequal strides refused; aotinfer's decode reads V through V's own strides "
        "(tests/test_decode.py::test_strided_pages checks the output)",
    "test_layernorm_quant_invalid_inputs":
        "expects float16 and strided inputs refused; aotinfer's layernorm_quant takes both (tests/test_norm_quant.py)",
    "test_norm_compilation_without_fp8": "builds FlashInfer's own JIT module from its source tree",
    "test_tensor_core_decode_rejects_mismatched_q_len":
        "expects q_len_per_req > 1 refused on backend='fa3' and in fast_decode_plan without a prior plan; "
        "aotinfer runs both (tests/test_decode.py::test_several_query_tokens_a_request*); its other refusals match",
}


def _unknown_keyword(excinfo) -> bool:
    """A keyword argument of FlashInfer's that aotinfer's function does not take (a feature not shipped)."""
    return excinfo.errisinstance(TypeError) and "got an unexpected keyword argument" in str(excinfo.value)


def _declined(excinfo) -> bool:
    """aotinfer's documented refusal of what it does not support (see the module docstring)."""
    import aotinfer

    if excinfo.errisinstance(NotShipped):
        return False
    if excinfo.errisinstance((NotImplementedError, aotinfer.BackendSupportedError)):
        return True
    message = str(excinfo.value)
    return excinfo.errisinstance((ValueError, TypeError)) and "supported" in message


# The real FlashInfer's files that a test may run without being served by it: the helpers its
# tests call to decide what to run (capabilities, versions, JIT environment, test utilities).
_REAL_HELPERS = ("__init__.py", "version.py", "_build_meta.py", "utils.py", "api_logging.py", "compilation_context.py",
                 "jit/", "testing/")  # fmt: skip


class _RealCodeTracker:
    """Which files of the real FlashInfer (under ``real_dir``) ran between start() and stop(),
    helpers aside: sys.monitoring's PY_START, each code object reported once a test (then disabled
    until the next start), where Python has it (3.12); else a profile function."""

    def __init__(self, real_dir: str) -> None:
        self.real_dir = os.path.join(os.path.abspath(real_dir), "")
        self.ran: set = set()
        self.tool = None

    def _note(self, filename: str) -> None:
        if filename.startswith(self.real_dir):
            relative = filename[len(self.real_dir) :].replace(os.sep, "/")
            if not relative.startswith(_REAL_HELPERS):
                self.ran.add("flashinfer/" + relative)

    def _on_start(self, code, offset):
        self._note(code.co_filename)
        return sys.monitoring.DISABLE

    def _on_profile(self, frame, event, arg):
        if event == "call":
            self._note(frame.f_code.co_filename)

    def start(self) -> None:
        self.ran = set()
        monitoring = getattr(sys, "monitoring", None)
        if monitoring is None:
            sys.setprofile(self._on_profile)
            return
        if self.tool is None:
            self.tool = next(i for i in range(6) if monitoring.get_tool(i) is None)
            monitoring.use_tool_id(self.tool, "flashinfer_tests")
            monitoring.register_callback(self.tool, monitoring.events.PY_START, self._on_start)
        monitoring.set_events(self.tool, monitoring.events.PY_START)
        monitoring.restart_events()

    def stop(self) -> set:
        monitoring = getattr(sys, "monitoring", None)
        if monitoring is None:
            sys.setprofile(None)
        elif self.tool is not None:
            monitoring.set_events(self.tool, 0)
        return self.ran


class _Bins:
    def __init__(self, shard=(0, 1), deadline=None, tracker=None):
        self.shard = shard
        self.deadline = deadline
        self.tracker = tracker  # --overlay: a _RealCodeTracker
        self.counts = collections.defaultdict(collections.Counter)  # test function -> bin -> count
        self.messages = collections.defaultdict(collections.Counter)  # "function|bin" -> message -> count
        self.examples = {}  # "function|message" -> a test id
        self.failed_ids = []  # every failed test, to run again by id

    @pytest.hookimpl(tryfirst=True)  # before the fixtures' setup: they count as the test's
    def pytest_runtest_setup(self, item):
        if self.deadline is not None and time.monotonic() > self.deadline:
            pytest.skip("past the run's deadline")
        if self.tracker is not None:
            self.tracker.start()

    def pytest_collection_modifyitems(self, config, items):
        index, count = self.shard
        if count > 1:
            items[:] = items[index::count]

    def pytest_runtest_logreport(self, report):
        if report.when != "call" and not (report.when == "setup" and not report.passed):
            return
        function = report.nodeid.split("[")[0]
        ran = self.tracker.stop() if self.tracker is not None else set()
        if report.passed and self.tracker is None:
            self.counts[function]["passed"] += 1
            return
        if report.passed:
            bin_ = "passed on FlashInfer" if ran else "passed on aotinfer"
            self.counts[function][bin_] += 1
            if ran:
                message = "ran " + ", ".join(sorted(ran)[:3]) + (f" and {len(ran) - 3} more" if len(ran) > 3 else "")
                self.messages[f"{function}|{bin_}"][message] += 1
                self.examples.setdefault(f"{function}|{message}", report.nodeid)
            return
        if report.skipped:
            bin_ = "skipped"
            message = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        else:
            bin_ = getattr(report, "aot_bin", "failed")
            message = getattr(report, "aot_message", "") or report.longreprtext.strip().splitlines()[-1]
        message = " ".join(message.split())[:300]
        self.counts[function][bin_] += 1
        if bin_ == "failed":
            self.failed_ids.append(report.nodeid)
        self.messages[f"{function}|{bin_}"][message] += 1
        self.examples.setdefault(f"{function}|{message}", report.nodeid)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if call.excinfo is None or report.passed or report.skipped:
            return
        excinfo = call.excinfo
        function = item.nodeid.split("::")[-1].split("[")[0]
        if function in _DIFFERS:
            report.aot_bin = "differs"
            report.aot_message = _DIFFERS[function]
            return
        if excinfo.errisinstance(NotShipped) or _unknown_keyword(excinfo):
            report.aot_bin = "not shipped"
        elif _declined(excinfo):
            report.aot_bin = "declined"
        else:
            report.aot_bin = "failed"
        text = str(excinfo.value).strip()
        report.aot_message = f"{excinfo.typename}: {text.splitlines()[0] if text else ''}"

    def to_json(self):
        return {"counts": self.counts, "messages": self.messages, "examples": self.examples,
                "failed_ids": self.failed_ids}

    def add_json(self, data):
        for function, counts in data["counts"].items():
            self.counts[function].update(counts)
        for key, messages in data["messages"].items():
            self.messages[key].update(messages)
        for key, example in data["examples"].items():
            self.examples.setdefault(key, example)
        self.failed_ids += data.get("failed_ids", [])

    def write(self, out):
        totals = collections.Counter()
        for function in sorted(self.counts):
            counts = self.counts[function]
            totals.update(counts)
            print(f"{function}: " + ", ".join(f"{n} {b}" for b, n in sorted(counts.items())), file=out)
            for bin_ in ("failed", "differs", "declined", "not shipped", "passed on FlashInfer", "skipped"):
                for message, n in self.messages.get(f"{function}|{bin_}", collections.Counter()).most_common(8):
                    print(f"    {bin_} x{n}: {message}", file=out)
                    print(f"        e.g. {self.examples[f'{function}|{message}']}", file=out)
        print("total: " + ", ".join(f"{n} {b}" for b, n in sorted(totals.items())), file=out)
        return totals


def main(argv: list[str]) -> int:
    if argv[:1] == ["--merge"]:
        bins = _Bins()
        for path in argv[1:]:
            with open(path) as f:
                bins.add_json(json.load(f))
        return 1 if bins.write(sys.stdout)["failed"] else 0
    pytest_args = []
    if "--" in argv:
        at = argv.index("--")
        argv, pytest_args = argv[:at], argv[at + 1 :]
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    checkout, argv = os.path.abspath(argv[0]), argv[1:]
    shard, report_path = (0, 1), None
    deadline = None
    overlay = False
    while argv and argv[0] in ("--shard", "--report", "--deadline", "--overlay"):
        if argv[0] == "--overlay":
            overlay, argv = True, argv[1:]
            continue
        if argv[0] == "--deadline":
            deadline = time.monotonic() + float(argv[1])
        elif argv[0] == "--shard":
            index, count = argv[1].split("/")
            shard = (int(index), int(count))
        else:
            report_path = os.path.abspath(argv[1])
        argv = argv[2:]
    tests = argv or _DEFAULT_TESTS

    tracker = None
    if overlay:
        from aotinfer import overlay as aotinfer_overlay

        real = aotinfer_overlay._find_real()
        if real is None:
            print("--overlay runs the tests beside a real FlashInfer, and none is importable here", file=sys.stderr)
            return 2
        os.environ[aotinfer_overlay.ENV] = "1"  # the processes the tests start: the wheel's .pth hook
        aotinfer_overlay.install()
        tracker = _RealCodeTracker(real.submodule_search_locations[0])
    elif importlib.util.find_spec("flashinfer") is not None:
        print("a real flashinfer is importable here: run this where only aotinfer is, or pass --overlay", file=sys.stderr)
        return 2
    else:
        sys.meta_path.insert(0, _Finder())
        _resolve_in_children(tempfile.mkdtemp(prefix="flashinfer_tests_"))
    sys.path.insert(0, checkout)  # the tests import tests.test_helpers
    os.chdir(checkout)
    bins = _Bins(shard, deadline, tracker)
    args = ["--noconftest", "-p", "no:cacheprovider", "-q", "--tb=no", "-rN", *tests, *pytest_args]
    pytest_status = pytest.main(args, plugins=[bins])
    if report_path:
        with open(report_path, "w") as f:
            json.dump(bins.to_json(), f)
    totals = bins.write(sys.stdout)
    if pytest_status not in (0, 1):  # 1: some tests failed (the bins say which); else pytest itself failed
        return int(pytest_status)
    return 1 if totals["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
