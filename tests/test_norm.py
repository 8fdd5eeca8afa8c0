"""rmsnorm, fused_add_rmsnorm, their Gemma variants and layernorm against float64 references."""

import subprocess
import sys

import pytest
import torch

import aotinfer

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# 4095 and 111: one element per access; 20480 and 20481: rows too long for registers (streamed).
HIDDEN = [96, 111, 4095, 4096, 5120, 8192, 20480, 20481]
LAYOUTS = ["2d", "3d", "2d-strided", "3d-strided"]
TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 2e-2, torch.float32: 2e-5}


# ---- references (float64) -----------------------------------------------------------------------


def rms_reference(x, weight, eps, weight_offset):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (weight.double() + weight_offset)


def layernorm_reference(x, gamma, beta, eps):
    x = x.double()
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + eps) * gamma.double() + beta.double()


# ---- inputs ------------------------------------------------------------------------------------


def make_rows(layout, hidden, dtype, tokens=7):
    """A fresh random input of the layout; strided layouts are slices of wider tensors."""
    if layout == "2d":
        x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    elif layout == "3d":
        x = torch.randn(3, tokens, hidden, device="cuda", dtype=dtype)
    elif layout == "2d-strided":
        x = torch.randn(tokens, hidden + 24, device="cuda", dtype=dtype)[:, 8 : 8 + hidden]
    else:
        x = torch.randn(3, tokens + 2, hidden + 16, device="cuda", dtype=dtype)[:, 1 : 1 + tokens, :hidden]
    assert x.is_contiguous() == (not layout.endswith("strided"))
    return x


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


def close(got, want, dtype):
    assert not got.isnan().any(), "some outputs were not written"
    torch.testing.assert_close(got, want.to(got.dtype), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("gemma", [False, True], ids=["rmsnorm", "gemma_rmsnorm"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rmsnorm(gemma, layout, hidden, dtype):
    op = aotinfer.gemma_rmsnorm if gemma else aotinfer.rmsnorm
    x = make_rows(layout, hidden, dtype)
    weight = torch.randn(hidden, device="cuda", dtype=dtype)
    want = rms_reference(x, weight, 1e-6, 1.0 if gemma else 0.0)
    out = poisoned(x.shape, dtype)
    assert op(x, weight, out=out) is out
    close(out, want, dtype)
    close(op(x, weight, eps=1e-5, enable_pdl=False), rms_reference(x, weight, 1e-5, 1.0 if gemma else 0.0), dtype)


@gpu
@pytest.mark.parametrize("gemma", [False, True], ids=["fused_add_rmsnorm", "gemma_fused_add_rmsnorm"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rmsnorm(gemma, layout, hidden, dtype):
    op = aotinfer.gemma_fused_add_rmsnorm if gemma else aotinfer.fused_add_rmsnorm
    x, residual = make_rows(layout, hidden, dtype), make_rows(layout, hidden, dtype)
    weight = torch.randn(hidden, device="cuda", dtype=dtype)
    total = x.double() + residual.double()
    want_out = rms_reference(total, weight, 1e-6, 1.0 if gemma else 0.0)
    assert op(x, residual, weight) is None
    close(residual, total, dtype)
    close(x, want_out, dtype)


# The fused add normalizes input + residual as summed in float32 and rounds once, on the way out:
# every output within half a unit in the last place (of its dtype, at the float32-sum reference)
# plus 1e-5 relative for the kernel's own float arithmetic. Normalizing the residual rounded to
# the dtype first (the old behaviour) adds up to half an ulp of the input's rounding and fails
# this bound in 16-bit dtypes. The residual must be the float32 sum rounded, bit for bit.
MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}
MIN_EXPONENT = {torch.float16: -14, torch.bfloat16: -126, torch.float32: -126}


def ulp(want, dtype):
    """The spacing of dtype's values at each element of want (float64)."""
    _, exponent = torch.frexp(want)  # want = m * 2**exponent, 0.5 <= |m| < 1
    exponent = torch.clamp(exponent - 1, min=MIN_EXPONENT[dtype])
    return torch.pow(2.0, (exponent - MANTISSA_BITS[dtype]).double())


def assert_one_rounding(got, want, dtype):
    assert not got.isnan().any(), "some outputs were not written"
    error = (got.double() - want).abs()
    bound = 0.5 * ulp(want, dtype) + 1e-5 * want.abs() + 1e-30
    worst = (error / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3f} times the one-rounding bound (max abs error {error.max().item():.3g})"


# 40 rows (weights beside the row, a row over up to 512 threads) and 600 (the large-batch shapes);
# 20481 and 40960: rows too long for registers, streamed (40960: with 16-byte vectors).
ONE_ROUNDING_SIZES = [(tokens, hidden) for tokens in (40, 600) for hidden in (96, 111, 4095, 4096, 8192)]
ONE_ROUNDING_SIZES += [(40, 20481), (40, 40960)]


@gpu
@pytest.mark.parametrize("gemma", [False, True], ids=["fused_add_rmsnorm", "gemma_fused_add_rmsnorm"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tokens, hidden", ONE_ROUNDING_SIZES, ids=[f"{t}-{h}" for t, h in ONE_ROUNDING_SIZES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rmsnorm_one_rounding(gemma, layout, tokens, hidden, dtype):
    op = aotinfer.gemma_fused_add_rmsnorm if gemma else aotinfer.fused_add_rmsnorm
    x, residual = make_rows(layout, hidden, dtype, tokens), make_rows(layout, hidden, dtype, tokens)
    weight = torch.randn(hidden, device="cuda", dtype=dtype)
    total = x.float() + residual.float()  # float32, as the kernel sums
    want_out = rms_reference(total, weight, 1e-6, 1.0 if gemma else 0.0)
    want_residual = total.to(dtype)
    op(x, residual, weight)
    assert torch.equal(residual, want_residual), "the residual is not the float32 sum rounded"
    assert_one_rounding(x, want_out, dtype)


@gpu
@pytest.mark.parametrize("weights", ["float32", "input"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layernorm(weights, layout, hidden, dtype):
    # A mean and a spread to remove, in place so that the layout stays.
    x = make_rows(layout, hidden, dtype).mul_(3).add_(1.5)
    wdtype = torch.float32 if weights == "float32" else dtype
    gamma = torch.randn(hidden, device="cuda", dtype=wdtype)
    beta = torch.randn(hidden, device="cuda", dtype=wdtype)
    close(aotinfer.layernorm(x, gamma, beta, eps=1e-5), layernorm_reference(x, gamma, beta, 1e-5), dtype)


# Batches of more than 512 rows, over hidden sizes that a block covers exactly, take the staged
# kernel (rows walked by a grid that fills the GPU, weights kept in registers) while the grid is
# short: at most 8 rows a block. The strided 3-D layout and long grids stay with the per-row
# kernel. Five rows an SM and a few more fit every shape's grid (one block an SM at the least) and
# give blocks unequal numbers of rows.
STAGED_HIDDEN = [2048, 4096, 5120, 8192]


def staged_rows():
    return 5 * torch.cuda.get_device_properties(0).multi_processor_count + 7


@gpu
@pytest.mark.parametrize("op", ["rmsnorm", "gemma_rmsnorm", "layernorm-float32", "layernorm-input"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("hidden", STAGED_HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_batch(op, layout, hidden, dtype):
    rows = staged_rows()
    x = make_rows(layout, hidden, dtype, tokens=rows if layout.startswith("2d") else rows // 3)
    if op.startswith("layernorm"):
        x.mul_(3).add_(1.5)  # in place: the layout stays
        wdtype = torch.float32 if op == "layernorm-float32" else dtype
        gamma = torch.randn(hidden, device="cuda", dtype=wdtype)
        beta = torch.randn(hidden, device="cuda", dtype=wdtype)
        close(aotinfer.layernorm(x, gamma, beta, eps=1e-5), layernorm_reference(x, gamma, beta, 1e-5), dtype)
    else:
        weight = torch.randn(hidden, device="cuda", dtype=dtype)
        out = poisoned(x.shape, dtype)
        getattr(aotinfer, op)(x, weight, out=out)
        close(out, rms_reference(x, weight, 1e-6, 1.0 if op == "gemma_rmsnorm" else 0.0), dtype)


# Which kernel each case launches, as the profiler sees it: in a process of its own, since the
# profiler's hold on CUPTI would disturb bench_gpu_time's CUPTI timing in this one.
KERNEL_CHOICE = """
import torch, aotinfer
sms = torch.cuda.get_device_properties(0).multi_processor_count
rows = 5 * sms + 7
def launched(call):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    return sorted(k for k in ("NormStagedKernel", "NormKernel") if any(k in n for n in names))
bf16 = dict(device="cuda", dtype=torch.bfloat16)
w, w32 = torch.randn(4096, **bf16), torch.randn(4096, device="cuda")
x = torch.randn(rows, 4096, **bf16)
x8k, w8k = torch.randn(rows, 8192, **bf16), torch.randn(8192, device="cuda")  # 48 KB staged: past the default limit
wide = torch.randn(rows, 4096 + 64, **bf16)[:, 32:4128]
spaced = torch.randn(3, rows // 3 + 2, 4096, **bf16)[:, 1:-1]
cases = {
    "rmsnorm": lambda: aotinfer.rmsnorm(x, w),
    "layernorm fp32 weights": lambda: aotinfer.layernorm(x, w32, w32),
    "layernorm bf16 weights": lambda: aotinfer.layernorm(x, w, w),
    "layernorm fp32 weights, hidden 8192": lambda: aotinfer.layernorm(x8k, w8k, w8k),
    "strided 2-D rows": lambda: aotinfer.rmsnorm(wide, w),
    "3-D rows, unevenly spaced": lambda: aotinfer.rmsnorm(spaced, w),
    "512 rows": lambda: aotinfer.rmsnorm(x[:512], w),
    "long grid": lambda: aotinfer.rmsnorm(torch.randn(64 * rows, 4096, **bf16), w),
    "fused add": lambda: aotinfer.fused_add_rmsnorm(x, torch.randn_like(x), w),
}
for name, call in cases.items():
    print(name, "=", ",".join(launched(call)))
"""


@gpu
def test_kernel_choice():
    out = subprocess.run([sys.executable, "-c", KERNEL_CHOICE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    chosen = dict(line.split(" = ") for line in out.stdout.splitlines())
    if not any(chosen.values()):
        pytest.skip("the profiler saw no kernels (another CUPTI client, e.g. compute-sanitizer)")
    staged = {"rmsnorm", "layernorm fp32 weights", "layernorm bf16 weights", "layernorm fp32 weights, hidden 8192",
              "strided 2-D rows"}
    assert chosen == {name: "NormStagedKernel" if name in staged else "NormKernel" for name in chosen}


@gpu
def test_strided_rows_leave_neighbours_alone():
    base = torch.randn(16, 4096 + 64, device="cuda", dtype=torch.bfloat16)
    keep = base.clone()
    x = base[:, 32 : 32 + 4096]
    residual = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    aotinfer.fused_add_rmsnorm(x, residual, torch.ones(4096, device="cuda", dtype=torch.bfloat16))
    assert torch.equal(base[:, :32], keep[:, :32]) and torch.equal(base[:, 32 + 4096 :], keep[:, 32 + 4096 :])


@gpu
@pytest.mark.parametrize("shape", [(0, 4096), (0, 8, 128), (5, 0, 128)])
def test_no_rows(shape):
    x = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(shape[-1], device="cuda", dtype=torch.bfloat16)
    assert aotinfer.rmsnorm(x, w).shape == x.shape
    aotinfer.fused_add_rmsnorm(x, torch.empty_like(x), w)
    assert aotinfer.layernorm(x, w.float(), w.float()).shape == x.shape


@gpu
@pytest.mark.parametrize("rows, hidden", [(64, 4096), (64, 4095), (1500, 4096), (16, 40960)])
def test_pdl_chain_matches_plain_chain(rows, hidden):
    # 40 dependent launches, each reading what the one before wrote: with PDL the kernels overlap
    # their starts, and a read before the wait would show as a different result. 1500 rows take
    # the staged kernel for rmsnorm; rows of 40960 stream.
    x0 = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    results = []
    for pdl in (False, True, None):
        x, residual = x0.clone(), torch.zeros_like(x0)
        for _ in range(20):
            aotinfer.fused_add_rmsnorm(x, residual, w, enable_pdl=pdl)
            x = aotinfer.rmsnorm(x, w, enable_pdl=pdl)
        results.append((x, residual))
    for x, residual in results[1:]:
        assert torch.equal(x, results[0][0]) and torch.equal(residual, results[0][1])


@gpu
@pytest.mark.parametrize("rows, hidden", [(32, 4096), ("staged", 8192)])
def test_cuda_graph_capture(rows, hidden):
    # "staged": the staged kernel for rmsnorm, with 48 KB of shared memory, past the default.
    rows = staged_rows() if rows == "staged" else rows
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    aotinfer.rmsnorm(x, w, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        aotinfer.rmsnorm(x, w, out=out)
        aotinfer.fused_add_rmsnorm(x, residual, w)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        residual.copy_(torch.randn_like(x))
        want_out = rms_reference(x, w, 1e-6, 0.0)
        total = x.double() + residual.double()
        want_x = rms_reference(total, w, 1e-6, 0.0)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        close(out, want_out, torch.bfloat16)
        close(x, want_x, torch.bfloat16)


# ---- the bindings' own checks -------------------------------------------------------------------


@pytest.fixture(scope="module")
def norm_binding():
    # The module the loader picks for this process's GPU (any build without one).
    from aotinfer import _loader

    return _loader.get_module("norm", torch.cuda.current_device() if torch.cuda.is_available() else -1)


# Shapes, dtypes, layouts and values before devices, inputs before outputs: on CPU tensors.
def _random_bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


BINDING_ERRORS = [
    (lambda b, x, w, out: b.rmsnorm(out, x.float(), w, 1e-6, False, -1), TypeError, "Expected weight and input to have the same dtype"),
    (lambda b, x, w, out: b.rmsnorm(out, x.int(), w.int(), 1e-6, False, -1), TypeError, "Expected input to have dtype float32, float16 or bfloat16, got int32"),
    (lambda b, x, w, out: b.rmsnorm(out.float(), x, w, 1e-6, False, -1), TypeError, "Expected out and input to have the same dtype"),
    (lambda b, x, w, out: b.rmsnorm(out[:2], x, w, 1e-6, False, -1), ValueError, "Expected out and input to have the same shape"),
    (lambda b, x, w, out: b.rmsnorm(out, x, w, -1.0, False, -1), ValueError, "Expected eps to be finite and non-negative"),
    (lambda b, x, w, out: b.rmsnorm(out, x, w, float("nan"), False, -1), ValueError, "Expected eps to be finite and non-negative"),
    (lambda b, x, w, out: b.rmsnorm(out, x, w, 1e-6, False, 3), ValueError, "Expected enable_pdl to be -1"),
    (lambda b, x, w, out: b.rmsnorm(out, x, w[::2], 1e-6, False, -1), ValueError, r"Expected weight to have shape \[8\]"),
    (lambda b, x, w, out: b.rmsnorm(out, x, _random_bf16(16)[::2], 1e-6, False, -1), ValueError, "Expected weight to be contiguous"),
    (lambda b, x, w, out: b.rmsnorm(out, x.t(), w, 1e-6, False, -1), ValueError, "Expected the last dimension of input to be contiguous"),
    (lambda b, x, w, out: b.rmsnorm(out, x[0], w, 1e-6, False, -1), ValueError, "Expected input to have 2 or 3 dimensions"),
    (lambda b, x, w, out: b.fused_add_rmsnorm(x, x.half(), w, 1e-6, False, -1), TypeError, "Expected residual and input to have the same dtype"),
    (lambda b, x, w, out: b.fused_add_rmsnorm(x, x[:2], w, 1e-6, False, -1), ValueError, "Expected residual and input to have the same shape"),
    (lambda b, x, w, out: b.layernorm(out, x, w.half(), w.half(), 1e-6, -1), TypeError, "Expected gemma and beta to be float32 or input's dtype"),
    (lambda b, x, w, out: b.layernorm(out, x, w, w.float(), 1e-6, -1), TypeError, "Expected beta and gemma to have the same dtype"),
    (lambda b, x, w, out: b.layernorm(out, x, w[:4], w, 1e-6, -1), ValueError, r"Expected gemma to have shape \[8\]"),
    (lambda b, x, w, out: b.layernorm(out, x, w, w, 1e-6, -1), ValueError, "Expected input to be a CUDA tensor, got a tensor on cpu"),
    (lambda b, x, w, out: b.fused_add_rmsnorm(x, torch.empty_like(x), w, 1e-6, True, -1), ValueError, "Expected input to be a CUDA tensor"),
]


@pytest.mark.parametrize("call, error, message", BINDING_ERRORS)
def test_binding_errors(norm_binding, call, error, message):
    x, w = _random_bf16(4, 8), _random_bf16(8)
    with pytest.raises(error, match=message):
        call(norm_binding, x, w, torch.empty_like(x))


@gpu
def test_binding_device_errors(norm_binding):
    x = torch.randn(4, 8, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="Expected out to be a CUDA tensor, got a tensor on cpu"):
        norm_binding.rmsnorm(torch.empty(4, 8, dtype=torch.bfloat16), x, w, 1e-6, False, -1)
    with pytest.raises(ValueError, match="Expected weight to be a CUDA tensor, got a tensor on cpu"):
        norm_binding.rmsnorm(torch.empty_like(x), x, w.cpu(), 1e-6, False, -1)
    with pytest.raises(ValueError, match="Expected beta to be a CUDA tensor"):
        norm_binding.layernorm(torch.empty_like(x), x, w, w.cpu(), 1e-6, -1)


# ---- argument errors, without a GPU: the bindings check shapes and dtypes before devices ----------


def test_cpu_input():
    with pytest.raises(ValueError, match="Expected input to be a CUDA tensor, got a tensor on cpu"):
        aotinfer.rmsnorm(torch.randn(4, 8), torch.randn(8))
    with pytest.raises(ValueError, match="Expected input to be a CUDA tensor, got a tensor on cpu"):
        aotinfer.layernorm(torch.randn(4, 8), torch.randn(8), torch.randn(8))


def _bf16(*shape):
    return torch.empty(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda x: aotinfer.rmsnorm(x, torch.empty(8, dtype=torch.float16)), TypeError, "weight and input to have the same dtype"),
        (lambda x: aotinfer.rmsnorm(x, _bf16(7)), ValueError, r"weight to have shape \[8\]"),
        (lambda x: aotinfer.rmsnorm(_bf16(8), _bf16(8)), ValueError, "input to have 2 or 3 dimensions"),
        (lambda x: aotinfer.rmsnorm(x, _bf16(8), out=_bf16(4, 9)), ValueError, "out and input to have the same shape"),
        (lambda x: aotinfer.rmsnorm(x.t(), _bf16(4)), ValueError, "last dimension of input to be contiguous"),
        (lambda x: aotinfer.fused_add_rmsnorm(x, torch.empty(4, 8, dtype=torch.float16), _bf16(8)), TypeError, "residual and input to have the same dtype"),
        (lambda x: aotinfer.gemma_fused_add_rmsnorm(x, _bf16(4, 7), _bf16(8)), ValueError, "residual and input to have the same shape"),
        (lambda x: aotinfer.layernorm(x, torch.empty(8, dtype=torch.float16), torch.empty(8, dtype=torch.float16)), TypeError, "gemma and beta to be float32 or input's dtype"),
        (lambda x: aotinfer.layernorm(x, torch.empty(8), torch.empty(9)), ValueError, r"beta to have shape \[8\]"),
        (lambda x: aotinfer.layernorm(x, torch.empty(8), _bf16(8)), TypeError, "beta and gemma to have the same dtype"),
        (lambda x: aotinfer.rmsnorm(x, _bf16(8), eps=-1.0), ValueError, "eps to be finite and non-negative"),
    ],
)
def test_argument_errors(call, error, message):
    # Each reaches the user as the class and words of the one place that checks it; a bad
    # argument on the CPU is named before the CPU itself is refused.
    with pytest.raises(error, match=message):
        call(_bf16(4, 8))


@gpu
@pytest.mark.parametrize("rows, hidden", [(8, 4096), (8, 20480), (1500, 4096)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layernorm_large_mean(rows, hidden, dtype):
    # Sum and sum of squares share one reduction: the kernel shifts each row by its first element
    # so that a mean of 1000 against a spread of 1 does not cancel away the variance. Each row its
    # own mean, so that a pivot taken from another row would show (1500 rows: the staged kernel).
    means = 1000.0 + 10.0 * torch.arange(rows, device="cuda").unsqueeze(1) % 7
    x = (torch.randn(rows, hidden, device="cuda") + means).to(dtype)
    gamma, beta = torch.randn(hidden, device="cuda"), torch.randn(hidden, device="cuda")
    close(aotinfer.layernorm(x, gamma, beta, eps=1e-5), layernorm_reference(x, gamma, beta, 1e-5), dtype)
