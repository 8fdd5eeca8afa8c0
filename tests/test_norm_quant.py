"""rmsnorm_quant, fused_add_rmsnorm_quant and layernorm_quant (kernels written in CuTeDSL, compiled
into the wheel) against float32 references quantized the same way, and the build and install
machinery of CuTeDSL modules: export without a GPU, the wheel's object, an install without the DSL."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aotinfer
from aotinfer import _loader

ROOT = Path(__file__).resolve().parent.parent
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
INPUTS = [torch.float16, torch.bfloat16]
KINDS = ["rmsnorm", "fused_add_rmsnorm", "layernorm"]
EPS = 1e-6


# ---- references (float32, quantized as the kernels do) ---------------------------------------------


def prequantized(kind, x, residual, weight, bias, scale):
    """The float32 value each output element rounds from (the norm, times weight (+ bias), times
    float32 1 / scale, clamped to the format's range later), and the magnitude of the terms it sums:
    LayerNorm's value is the normalized one times gamma plus beta, which may cancel to far less than
    either, and then float32 rounding of the terms (the kernel sums the row in another order) moves
    it by more than its own size would suggest."""
    x = x.float() + (residual.float() if kind == "fused_add_rmsnorm" else 0)
    inv = (1.0 / torch.tensor(float(scale), dtype=torch.float32)).to(x.device)
    if kind == "layernorm":
        mean = x.mean(-1, keepdim=True)
        normed = (x - mean) * torch.rsqrt((x - mean).pow(2).mean(-1, keepdim=True) + EPS) * weight.float()
        y = normed + bias.float()
        return y * inv, (normed.abs() + bias.float().abs()) * inv
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.float() * inv
    return y, y.abs()


def assert_fp8_matches(out, y, terms):
    """out's bytes equal fp8(clamp(y)), except where y sits within 1e-3 of its terms' magnitude
    (prequantized's) of the midpoint between the two FP8 values out and the reference round to;
    such elements are counted and must stay rare (at most 0.5%)."""
    limit = FP8_MAX[out.dtype]
    want = y.clamp(-limit, limit).to(out.dtype)
    differ = out.view(torch.uint8) != want.view(torch.uint8)
    if not differ.any():
        return 0
    got_v, want_v, y_v = out[differ].float(), want[differ].float(), y.clamp(-limit, limit)[differ]
    midpoint = (got_v + want_v) / 2
    near = (y_v - midpoint).abs() <= 1e-3 * terms[differ] + 1e-30
    assert near.all(), (
        f"{int((~near).sum())} of {out.numel()} elements differ away from a rounding boundary: got"
        f" {got_v[~near][:5].tolist()}, want {want_v[~near][:5].tolist()} from {y_v[~near][:5].tolist()}"
    )
    count = int(differ.sum())
    assert count <= max(2, out.numel() // 200), f"{count} of {out.numel()} elements on rounding boundaries"
    return count


# ---- inputs -----------------------------------------------------------------------------------------


def rows(tokens, hidden, dtype, strided):
    if strided:  # rows of a wider tensor, of a row stride that is a multiple of 8 or not
        wide = torch.randn(tokens, hidden + (24 if hidden % 8 == 0 else 3), device="cuda", dtype=dtype)
        x = wide[:, 8 : 8 + hidden] if hidden % 8 == 0 else wide[:, 1 : 1 + hidden]
        assert not x.is_contiguous()
        return x
    return torch.randn(tokens, hidden, device="cuda", dtype=dtype)


def run(kind, out, x, residual, weight, bias, scale, **kw):
    if kind == "rmsnorm":
        aotinfer.rmsnorm_quant(out, x, weight, scale, EPS, **kw)
    elif kind == "fused_add_rmsnorm":
        aotinfer.fused_add_rmsnorm_quant(out, x, residual, weight, scale, EPS, **kw)
    else:
        aotinfer.layernorm_quant(out, x, weight, bias, scale, EPS)


def case(kind, tokens, hidden, dtype, fp8, strided=False):
    x = rows(tokens, hidden, dtype, strided)
    residual = rows(tokens, hidden, dtype, strided)
    wdtype = torch.float32 if kind == "layernorm" else dtype
    weight = torch.randn(hidden, device="cuda", dtype=wdtype)
    bias = torch.randn(hidden, device="cuda", dtype=torch.float32)
    out = torch.full((tokens, hidden), float("nan"), device="cuda").to(fp8)
    return x, residual, weight, bias, out


# ---- GPU --------------------------------------------------------------------------------------------


def test_flashinfer_module_layout():
    """FlashInfer keeps the FP8-output norms in flashinfer.norm; aotinfer.norm has them too."""
    import aotinfer.norm

    for name in ("rmsnorm_quant", "fused_add_rmsnorm_quant", "layernorm_quant"):
        assert getattr(aotinfer.norm, name) is getattr(aotinfer, name)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", INPUTS, ids=str)
@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("scale_kind", ["float", "tensor", "0-d tensor"])
@pytest.mark.parametrize("hidden, strided", [(4096, False), (4096, True), (1001, False), (1001, True), (16384, False),
                                             (128, False), (16392, False), (3001, False)])
def test_matches_reference(kind, dtype, fp8, scale_kind, hidden, strided):
    torch.manual_seed(hidden + len(kind))
    x, residual, weight, bias, out = case(kind, 37, hidden, dtype, fp8, strided)
    scale = 3.0 / FP8_MAX[fp8]  # values past 3 standard deviations saturate at the format's maximum
    y, terms = prequantized(kind, x, residual, weight, bias, scale)
    expected_residual = (x.float() + residual.float()).to(dtype)
    scale_arg = {"float": scale, "tensor": torch.tensor([scale], device="cuda"),
                 "0-d tensor": torch.tensor(scale, device="cuda")}[scale_kind]
    run(kind, out, x, residual, weight, bias, scale_arg)
    assert_fp8_matches(out, y, terms)
    assert (out.float().abs() == FP8_MAX[fp8]).any(), "the case exercises the clamp"
    if kind == "fused_add_rmsnorm":
        torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hidden, strided", [(4096, False), (4096, True), (2056, False), (1001, False)])
def test_more_rows_than_multiprocessors(kind, hidden, strided):
    """Past one block an SM the weights are read after the reduction (up to one block an SM,
    beside the row, as in test_matches_reference's 37 rows), strided rows too; 2056: threads with
    accesses past the row's end."""
    rows = 2 * torch.cuda.get_device_properties(0).multi_processor_count + 7
    torch.manual_seed(rows + hidden)
    x, residual, weight, bias, out = case(kind, rows, hidden, torch.bfloat16, torch.float8_e4m3fn, strided)
    y, terms = prequantized(kind, x, residual, weight, bias, 0.25)
    expected_residual = (x.float() + residual.float()).to(torch.bfloat16)
    run(kind, out, x, residual, weight, bias, 0.25)
    assert_fp8_matches(out, y, terms)
    if kind == "fused_add_rmsnorm":
        torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)


@pytest.mark.gpu
def test_boundaries_are_counted_and_rare():
    x, residual, weight, bias, out = case("rmsnorm", 4096, 4096, torch.bfloat16, torch.float8_e4m3fn)
    aotinfer.rmsnorm_quant(out, x, weight, 1.0)
    count = assert_fp8_matches(out, *prequantized("rmsnorm", x, residual, weight, bias, 1.0))
    print(f"rmsnorm_quant 4096x4096 bf16 -> e4m3: {count} of {out.numel()} elements on rounding boundaries")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_no_rows_and_no_columns(kind):
    for tokens, hidden in ((0, 4096), (3, 0)):
        x, residual, weight, bias, out = case(kind, tokens, hidden, torch.bfloat16, torch.float8_e4m3fn)
        run(kind, out, x, residual, weight, bias, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_graph_reads_the_scale_on_replay(kind):
    x, residual, weight, bias, out = case(kind, 16, 4096, torch.bfloat16, torch.float8_e4m3fn)
    scale = torch.tensor([1.0], device="cuda")
    start = residual.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run(kind, out, x, residual, weight, bias, scale)  # warm-up: loads the kernel outside the capture
        torch.cuda.current_stream().synchronize()
        with torch.cuda.graph(graph, stream=stream):
            run(kind, out, x, residual, weight, bias, scale)
    for value in (0.25, 2.0):
        scale.fill_(value)
        residual.copy_(start)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_fp8_matches(out, *prequantized(kind, x, start, weight, bias, value))


@pytest.mark.gpu
def test_side_stream_and_pdl():
    x, residual, weight, bias, out = case("rmsnorm", 64, 2048, torch.float16, torch.float8_e5m2)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for pdl in (True, False, None):
            out.fill_(float("nan"))
            aotinfer.rmsnorm_quant(out, x, weight, 0.5, enable_pdl=pdl)
    stream.synchronize()
    assert_fp8_matches(out, *prequantized("rmsnorm", x, residual, weight, bias, 0.5))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_longest_rows(kind):
    """Rows of 40000 elements: the most threads a block has, several groups of accesses each."""
    x, residual, weight, bias, out = case(kind, 3, 40000, torch.bfloat16, torch.float8_e4m3fn)
    y, terms = prequantized(kind, x, residual, weight, bias, 0.5)
    run(kind, out, x, residual, weight, bias, 0.5)
    assert_fp8_matches(out, y, terms)


@pytest.mark.gpu
def test_hidden_past_shared_memory_is_a_value_error():
    x, residual, weight, bias, out = case("rmsnorm", 1, 1 << 17, torch.bfloat16, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="last dimension"):
        aotinfer.rmsnorm_quant(out, x, weight, 1.0)


@pytest.mark.gpu
def test_first_call_loads_the_built_kernel():
    """The first call of an op in a new process against its second: a module load and a kernel
    image load, no compile (printed; the DSL's in-process compile is in bench_norm_quant.py)."""
    script = ROOT / "benchmarks" / "bench_norm_quant.py"
    result = subprocess.run([sys.executable, str(script), "--first-call"], capture_output=True, text=True,
                            cwd=script.parent)
    print(result.stdout)
    assert "first call" in result.stdout, result.stderr[-2000:]


# ---- CPU: argument errors -------------------------------------------------------------------------


def cpu_case(**changes):
    args = dict(
        out=torch.empty(4, 64, dtype=torch.float8_e4m3fn),
        input=torch.randn(4, 64, dtype=torch.bfloat16),
        weight=torch.randn(64, dtype=torch.bfloat16),
        scale=1.0,
    )
    args.update(changes)
    return args


@pytest.mark.parametrize("changes, error, match", [
    ({"input": torch.randn(4, 64)}, TypeError, "input to have dtype float16 or bfloat16"),
    ({"input": torch.randn(2, 4, 64, dtype=torch.bfloat16)}, ValueError, "input to have 2 dimensions"),
    ({"input": torch.randn(64, 4, dtype=torch.bfloat16).t()}, ValueError, "last dimension of input"),
    ({"weight": torch.randn(32, dtype=torch.bfloat16)}, ValueError, "weight to have shape \\[64\\]"),
    ({"weight": torch.randn(64, dtype=torch.float16)}, TypeError, "weight to have dtype"),
    ({"out": torch.empty(4, 64, dtype=torch.uint8)}, TypeError, "out to have dtype float8_e4m3fn or float8_e5m2"),
    ({"out": torch.empty(4, 32, dtype=torch.float8_e4m3fn)}, ValueError, "out and input to have the same shape"),
    ({"scale": torch.ones(2)}, ValueError, "scale to be a float or a float32 tensor of one element"),
    ({"scale": torch.ones(1, 1)}, ValueError, "scale to be a float or a float32 tensor of one element"),
    ({"scale": torch.ones(1, dtype=torch.float16)}, TypeError, "scale to have dtype float32"),
    ({"scale": "1"}, TypeError, "scale to be a real number"),
    ({"scale": True}, TypeError, "scale to be a real number"),
    ({"scale": 0.0}, ValueError, "scale to be finite and nonzero"),
    ({"scale": float("inf")}, ValueError, "scale to be finite and nonzero"),
    ({"eps": -1.0}, ValueError, "eps to be finite and non-negative"),
    ({"enable_pdl": 1}, TypeError, "enable_pdl"),
    ({}, ValueError, "input to be a CUDA tensor"),
])
def test_rmsnorm_quant_argument_errors(changes, error, match):
    with pytest.raises(error, match=match):
        aotinfer.rmsnorm_quant(**cpu_case(**changes))


def test_fused_add_and_layernorm_argument_errors():
    base = cpu_case()
    with pytest.raises(ValueError, match="residual and input to have the same shape"):
        aotinfer.fused_add_rmsnorm_quant(base["out"], base["input"], torch.randn(4, 32, dtype=torch.bfloat16),
                                         base["weight"], 1.0)
    with pytest.raises(TypeError, match="residual and input to have the same dtype"):
        aotinfer.fused_add_rmsnorm_quant(base["out"], base["input"], torch.randn(4, 64), base["weight"], 1.0)
    with pytest.raises(TypeError, match="gemma to have dtype float32"):
        aotinfer.layernorm_quant(base["out"], base["input"], base["weight"], torch.randn(64), 1.0)
    with pytest.raises(ValueError, match="beta to have shape"):
        aotinfer.layernorm_quant(base["out"], base["input"], torch.randn(64), torch.randn(63), 1.0)
    with pytest.raises(ValueError, match="input to be a CUDA tensor"):
        aotinfer.layernorm_quant(base["out"], base["input"], torch.randn(64), torch.randn(64), 1.0)


# ---- CPU: the build and the install -------------------------------------------------------------------


def test_module_is_declared_built_and_listed():
    entry = _loader.manifest()["modules"]["norm_quant"]
    assert entry["cutedsl"] == "cutedsl/norm_quant.py"
    assert set(entry["functions"]) == {"rmsnorm_quant", "fused_add_rmsnorm_quant", "layernorm_quant"}
    assert entry["builds"], "no build of norm_quant in this install"
    from aotinfer import cli

    info = subprocess.run([sys.executable, "-m", "aotinfer", "info"], capture_output=True, text=True)
    assert "norm_quant" in info.stdout and cli is not None


# cutedsl/norm_quant.py's VARIANTS: 3 kinds x 2 inputs x 2 FP8 formats x 2 access widths x 3 stagings.
NUM_VARIANTS = 72


def test_wheel_check_sees_the_embedded_kernels():
    sys.path.insert(0, str(ROOT / "ci"))
    try:
        import check_wheel
    finally:
        sys.path.pop(0)
    entry = _loader.manifest()["modules"]["norm_quant"]
    for arch, build in entry["builds"].items():
        sms = check_wheel.embedded_cubins(Path(build["dir"]) / build["file"])
        major, minor = arch.split(".")
        assert len(sms) == NUM_VARIANTS and set(sms) == {int(major) * 10 + int(minor[0])}, (arch, sms)


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="needs nvidia-cutlass-dsl (a build dependency)")
def test_export_for_two_archs_without_a_gpu(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    for arch in ("9.0a", "12.0+PTX"):
        out = tmp_path / arch
        subprocess.run([sys.executable, str(ROOT / "cmake" / "cutedsl.py"), "--kernels", str(ROOT / "cutedsl" / "norm_quant.py"),
                        "--module", "norm_quant", "--arch", arch, "--out-dir", str(out)], check=True, env=env,
                       capture_output=True)
        header = (out / "norm_quant_kernels.h").read_text()
        source = (out / "norm_quant_kernels.cc").read_text()
        assert f"inline constexpr int kNumVariants = {NUM_VARIANTS};" in header
        assert source.count("{\"kernel_cutlass_kernel") == NUM_VARIANTS
        tag = arch.split("+")[0].replace(".", "")
        assert f"for sm_{tag}" in source
        assert (source.count("kPtx") > 0) == arch.endswith("+PTX")
        assert not [p for p in out.iterdir() if p.name not in ("norm_quant_kernels.h", "norm_quant_kernels.cc")]


def test_installed_wheel_loads_without_the_dsl(tmp_path):
    """This install's package, with torch and tvm-ffi but none of the DSL's packages, in an
    interpreter that reads no site-packages: aotinfer imports, resolves norm_quant, loads its
    shared object and runs its binding's checks. Fails if the DSL is importable there."""
    import tvm_ffi

    site = tmp_path / "site"
    site.mkdir()
    dsl = ("nvidia_cutlass_dsl", "cutlass", "cuda", "cuda_bindings", "cuda_pathfinder", "nvidia_cutlass")
    # The folders torch, tvm-ffi and aotinfer were installed into, less the DSL and .pth files.
    folders = {Path(m.__file__).resolve().parent.parent for m in (torch, tvm_ffi, aotinfer)}
    for folder in sorted(folders):
        for entry in folder.iterdir():
            if entry.name.startswith(dsl) or entry.suffix == ".pth" or entry.name == "aotinfer":
                continue
            if not (site / entry.name).exists():
                (site / entry.name).symlink_to(entry)
    shutil.copytree(Path(aotinfer.__file__).parent, site / "aotinfer", ignore=shutil.ignore_patterns("__pycache__"))
    script = r"""
import importlib.util, sys
assert importlib.util.find_spec("cutlass") is None and importlib.util.find_spec("nvidia_cutlass_dsl") is None, "DSL importable"
import torch, tvm_ffi, aotinfer
from aotinfer import _loader
arch = next(iter(_loader.manifest()["modules"]["norm_quant"]["builds"]))
major, minor = arch.split(".")
choice, path = _loader.resolve("norm_quant", (int(major), int(minor[0])))
module = tvm_ffi.load_module(path)
for name in ("rmsnorm_quant", "fused_add_rmsnorm_quant", "layernorm_quant"):
    getattr(module, name)
try:
    aotinfer.rmsnorm_quant(torch.empty(2, 8, dtype=torch.float8_e4m3fn), torch.randn(2, 8, dtype=torch.half),
                           torch.randn(8, dtype=torch.half), 1.0)
except ValueError as e:
    assert "CUDA tensor" in str(e), e
assert not [m for m in sys.modules if m.startswith(("cutlass", "nvidia_cutlass_dsl"))]
print("ok", path)
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    result = subprocess.run([sys.executable, "-S", "-s", "-c", script], capture_output=True, text=True, env=env,
                            cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.startswith("ok"), result.stdout + result.stderr[-3000:]
