"""aotinfer's ops as torch custom ops: defined on import, from the declarations; fake
implementations, torch.compile, opcheck; never breaking torch's import or a fork."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import aotinfer
from aotinfer import _kernels, _loader
from op_arguments import IDS, PAIRS, make_arguments, ranks

BINDINGS = [
    (module, function, schema)
    for module, entry in _loader.manifest()["modules"].items()
    for function, schema in entry["functions"].items()
]
# torch schema types -> the types tvm-ffi records for the binding's C++ parameters
TVM_TYPES = {"Tensor": "DLTensor*", "float": "float", "int": "int", "bool": "bool", "str": "ffi.String"}


@pytest.mark.parametrize("module, function, schema", BINDINGS, ids=[b[1] for b in BINDINGS])
def test_registered_from_the_declaration(module, function, schema):
    registered = str(getattr(torch.ops.aotinfer, function).default._schema)
    assert registered.replace(" ", "") == f"aotinfer::{function}{schema}".replace(" ", "")


@pytest.mark.parametrize("module, function, schema", BINDINGS, ids=[b[1] for b in BINDINGS])
def test_declaration_matches_the_compiled_binding(module, function, schema):
    import tvm_ffi

    build = next(iter(_loader.module_entry(module)["builds"].values()))
    binding = tvm_ffi.load_module(os.path.join(_loader.OPS_DIR, build["file"]))
    params = json.loads(binding.get_function_metadata(function)["type_schema"])["named_args"]["params"]
    arguments = getattr(torch.ops.aotinfer, function).default._schema.arguments
    assert [TVM_TYPES[str(a.type)] for a in arguments] == [p["type"] for p in params]
    assert [a.name for a in arguments if a.alias_info and a.alias_info.is_write], "a binding must write an output"


def test_fake_implementation():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(8, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        assert torch.ops.aotinfer.scale(out, x, 2.0, -1) is None


def _tensor(shape, device, dtype=torch.float16):
    """Random values on the CPU; on "cuda" under FakeTensorMode, a fake tensor (no values)."""
    if device != "cpu":
        return torch.empty(shape, device=device, dtype=dtype)
    if dtype in (torch.int32, torch.int64):
        return torch.randint(0, 4, shape, dtype=dtype)
    return torch.randn(shape).to(dtype)


# Calls with one fault each, across the kernel modules: eagerly on CPU tensors the binding names the
# fault (it checks shapes before devices); traced, its checks run on stand-ins for fake tensors.
I32 = torch.int32
BAD_CALLS = {
    "rmsnorm weight": lambda d: aotinfer.rmsnorm(_tensor((4, 64), d), _tensor((32,), d)),
    "1-D probs": lambda d: aotinfer.top_p_sampling_from_probs(_tensor((64,), d, torch.float32), 0.5),
    "list for a tensor": lambda d: aotinfer.rmsnorm(_tensor((4, 64), d), [1.0] * 64),
    "odd activation": lambda d: aotinfer.silu_and_mul(_tensor((4, 63), d)),
    "merge shapes": lambda d: aotinfer.merge_state(_tensor((5, 8, 64), d), _tensor((5, 8), d, torch.float32),
                                                   _tensor((5, 8, 32), d), _tensor((5, 8), d, torch.float32)),
    "rope k": lambda d: aotinfer.apply_rope_pos_ids(_tensor((5, 8, 64), d), _tensor((5, 2, 32), d), _tensor((5,), d, I32)),
    "append cache": lambda d: aotinfer.append_paged_kv_cache(
        _tensor((5, 2, 64), d), _tensor((5, 2, 64), d), _tensor((5,), d, I32), _tensor((5,), d, I32),
        (_tensor((9, 16, 2, 32), d), _tensor((9, 16, 2, 32), d)), _tensor((9,), d, I32), _tensor((3,), d, I32),
        _tensor((2,), d, I32)),
    "fp8 weight dtype": lambda d: aotinfer.rmsnorm_quant(_tensor((4, 64), d, torch.float8_e4m3fn), _tensor((4, 64), d),
                                                         _tensor((64,), d, torch.float32), 1.0),
    "decode q heads": lambda d: _batch_decode(d, kv_heads=3),
    "decode cache of no pages": lambda d: _batch_decode(d, pages=0),
}


def _batch_decode(device, kv_heads=8, pages=4):
    """The decode binding on 2 requests of q [2, 8, 128] over a cache of ``pages`` pages."""
    f16, f32 = torch.float16, torch.float32
    cache = (pages, 16, kv_heads, 128)
    shapes = [((2, 8, 128), f16), ((2, 8), f32), ((0,), f32), ((0,), f32), ((2, 8, 128), f16), (cache, f16),
              (cache, f16), ((4,), I32), ((2, 4), I32), ((2, 4), I32), ((48,), I32), ((0,), f32)]
    return torch.ops.aotinfer.batch_decode(*[_tensor(s, device, t) for s, t in shapes], 0, 0, 0.1, 0.0, -1, 0, 1.0, 1e4, 1.0, 0, 0, 0)


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_traced_call_raises_what_the_eager_call_raises(case):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with pytest.raises((TypeError, ValueError)) as eager:
        BAD_CALLS[case]("cpu")
    assert "CUDA" not in str(eager.value), "the fault, not the device, is what eager names here"
    with FakeTensorMode(), pytest.raises(type(eager.value)) as traced:
        BAD_CALLS[case]("cuda")
    assert str(traced.value) == str(eager.value)


def test_make_fx_checks_and_records_the_call():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):
        return aotinfer.rmsnorm(x, w)

    with FakeTensorMode():
        x, w = _tensor((4, 64), "cuda"), _tensor((64,), "cuda")
        graph = make_fx(f)(x, w)
        with pytest.raises(ValueError, match=r"Expected weight to have shape \[64\]"):
            make_fx(f)(x, _tensor((63,), "cuda"))
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert torch.ops.aotinfer.rmsnorm.default in targets


def test_fake_tensor_that_requires_grad_does_not_abort():
    # torch's autograd fallback would make a device guard for the fake CUDA tensor, which aborts a
    # CPU-only torch; the ops' autograd implementation goes straight below autograd.
    out = run_python("""
        import torch, aotinfer
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode():
            x = torch.empty(4, 64, device="cuda", dtype=torch.float16, requires_grad=True)
            w = torch.empty(64, device="cuda", dtype=torch.float16, requires_grad=True)
            for y in (aotinfer.rmsnorm(x, w), aotinfer.gemma_rmsnorm(x, w), aotinfer.scale(x, 2.0)):
                assert y.shape == (4, 64) and not y.requires_grad
        print("traced")
    """)
    assert "traced" in out.stdout


def test_compile_fullgraph_traces_the_custom_op():
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(x):
        y = aotinfer.scale(x, 2.0)
        return aotinfer.scale(y, 3.0, skip_check=True) + 1

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=record)
    # Tracing runs the binding's checks on the fake tensors: CPU ones are refused by name (dynamo
    # reports the ValueError as its TorchRuntimeError, with the same words) ...
    with pytest.raises((ValueError, RuntimeError), match="Expected input to be a CUDA tensor, got a tensor on cpu"):
        compiled(torch.randn(8))
    assert not graphs
    # ... and meta ones, which have no device to check, trace (and run the checks only).
    assert compiled(torch.randn(8, device="meta")).shape == (8,)
    (graph,) = graphs
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aotinfer.scale) + targets.count(torch.ops.aotinfer.scale.default) == 2


def run_python(script, env=None, cwd=None, timeout=120):
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                         env=env, cwd=cwd, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


@pytest.mark.parametrize("order", ["torch first", "aotinfer first"])
def test_ops_defined_on_import_without_loading_kernels(order, tmp_path):
    # In either order, once both are imported every binding is torch.ops.aotinfer.<name>: no
    # shared object loaded, no CUDA initialized.
    imports = "import torch, aotinfer" if order == "torch first" else "import aotinfer, torch"
    functions = [f for fs in _loader.declared_functions().values() for f in fs]
    out = run_python(
        f"""
        {imports}
        for name in {functions!r}:
            assert str(getattr(torch.ops.aotinfer, name).default._schema).startswith("aotinfer::" + name)
        maps = open("/proc/self/maps").read()
        assert "aotinfer/_ops/" not in maps, "a kernel module was loaded"
        assert not torch.cuda.is_initialized()
        print("defined", len({functions!r}))
        """,
        cwd=tmp_path,
    )
    assert f"defined {len(functions)}" in out.stdout and not out.stderr.count("Warning: aotinfer")


@pytest.fixture(scope="module")
def broken_install(tmp_path_factory):
    """A copy of the installed package whose manifest is not JSON, first on sys.path."""
    root = tmp_path_factory.mktemp("broken")
    package = os.path.dirname(aotinfer.__file__)
    shutil.copytree(package, root / "aotinfer", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    (root / "aotinfer" / "_ops" / "manifest.json").write_text('{"modules": {"norm": ')
    return root


@pytest.mark.parametrize("order", ["torch first", "aotinfer first"])
def test_broken_manifest_breaks_nothing_else(order, broken_install, tmp_path):
    # A damaged install must not break torch: torch.compile of code that never uses aotinfer
    # works, and an op says what is wrong.
    imports = "import torch, aotinfer" if order == "torch first" else "import aotinfer, torch"
    out = run_python(
        f"""
        import warnings
        warnings.simplefilter("always")
        {imports}
        import torch._dynamo
        f = torch.compile(lambda x: x * 2, backend="eager")
        assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))
        try:
            aotinfer.rmsnorm(torch.randn(2, 8), torch.randn(8))
        except ImportError as e:
            print("op:", e)
        """,
        env=dict(os.environ, PYTHONPATH=str(broken_install)),
        cwd=tmp_path,
    )
    assert "op: " in out.stdout and "manifest" in out.stdout
    assert out.stderr.count("RuntimeWarning: aotinfer's torch custom ops are not defined") == 1, out.stderr


FORK_SCRIPT = """
import os, random, sys, threading, time
import torch, aotinfer
from aotinfer import _loader

load = _loader._load
def slow_load(name, index):  # a first call that takes a while to load its module
    time.sleep(0.004)
    return load(name, index)
_loader._load = slow_load

x, w = torch.randn(4, 8), torch.randn(8)
def first_call():
    try:
        aotinfer.rmsnorm(x, w)
    except ValueError:
        pass

hung = 0
for trial in range({trials}):
    _loader._modules.clear()
    aotinfer.norm._rmsnorm.forget()
    thread = threading.Thread(target=first_call)
    thread.start()
    time.sleep(random.uniform(0, 0.006))
    pid = os.fork()
    if pid == 0:
        signal_timer = threading.Timer(10, lambda: os._exit(3))
        signal_timer.start()
        try:
            aotinfer.rmsnorm(x, w)
        except ValueError:
            os._exit(0)
        os._exit(1)
    thread.join()
    _, status = os.waitpid(pid, 0)
    hung += os.waitstatus_to_exitcode(status) != 0
print("children that did not finish:", hung)
"""


FIRST_LOAD_FORK_SCRIPT = """
import os, sys, threading, time
import torch, aotinfer
assert "tvm_ffi" not in sys.modules  # the first call imports it

x, w = torch.randn(4, 8), torch.randn(8)
def call():
    try:
        aotinfer.rmsnorm(x, w)
    except ValueError:
        return True
    return False

thread = threading.Thread(target=call)
thread.start()
children = []
while thread.is_alive() or not children:  # forks all through the first call's import and load
    pid = os.fork()
    if pid == 0:
        threading.Timer(10, lambda: os._exit(3)).start()
        os._exit(0 if call() else 1)
    children.append(pid)
    time.sleep(0.002)
thread.join()
codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
print("children:", len(children), "that did not finish:", sum(code != 0 for code in codes))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_during_the_first_import_of_tvm_ffi(tmp_path):
    # The first call imports tvm_ffi and loads a module in one thread; a child forked meanwhile
    # must not inherit the import's locks held by a thread it does not have.
    out = run_python(FIRST_LOAD_FORK_SCRIPT, cwd=tmp_path, timeout=300)
    assert "that did not finish: 0" in out.stdout, out.stdout


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_while_another_thread_loads(tmp_path):
    # A server forks workers while warm-up threads make their first calls: a child must never
    # inherit a lock held by a thread that does not exist in it.
    out = run_python(FORK_SCRIPT.format(trials=30), cwd=tmp_path, timeout=300)
    assert "children that did not finish: 0" in out.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compile_fullgraph_on_gpu(mode):
    def f(x, w):
        h = aotinfer.scale(x, 0.5) * w
        return aotinfer.scale(h, 4.0, skip_check=True) + x

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, mode=mode)
    for _ in range(3):  # reduce-overhead records, then replays CUDA graphs
        x = torch.randn(1000, 64, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(64, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(compiled(x, w), f(x, w), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("op, template", PAIRS, ids=IDS)
def test_opcheck(op, template):
    # torch's checks of a custom op (schema, fake implementation, dispatch), on the calls each
    # public op makes.
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "aotinfer":
                calls.append((func, [a.clone() if isinstance(a, torch.Tensor) else a for a in args]))
            return func(*args, **(kwargs or {}))

    args, _ = make_arguments(template, "cuda", torch.float16, rank=ranks(template)[-1])
    with Record():
        op(**args)
    assert calls
    for func, call_args in calls:
        # torch's schema check compares tensors with arithmetic that FP8 dtypes lack; the others run.
        fp8 = any(isinstance(a, torch.Tensor) and a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for a in call_args)
        tests = ("test_faketensor", "test_aot_dispatch_dynamic") if fp8 else None
        torch.library.opcheck(func, call_args, **({"test_utils": tests} if tests else {}))
