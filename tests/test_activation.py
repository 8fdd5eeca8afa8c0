"""silu_and_mul, gelu_and_mul and gelu_tanh_and_mul against float64 references."""

import math

import pytest
import torch

import aotinfer

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
HIDDEN = [64, 111, 4095, 4096, 5120, 11008]  # d, the output's last dimension
LAYOUTS = ["2d", "3d", "2d-strided", "3d-strided", "4d"]
TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 2e-2, torch.float32: 2e-5}


def silu(x):
    return x / (1 + torch.exp(-x))


def gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x.pow(3))))


OPS = [(aotinfer.silu_and_mul, silu), (aotinfer.gelu_and_mul, gelu), (aotinfer.gelu_tanh_and_mul, gelu_tanh)]
IDS = [op.__name__ for op, _ in OPS]


def reference(x, act):
    d = x.shape[-1] // 2
    x = x.double()
    return act(x[..., :d]) * x[..., d:]


def make_input(layout, d, dtype, tokens=9):
    if layout == "2d":
        x = torch.randn(tokens, 2 * d, device="cuda", dtype=dtype)
    elif layout == "3d":
        x = torch.randn(2, tokens, 2 * d, device="cuda", dtype=dtype)
    elif layout == "2d-strided":
        x = torch.randn(tokens, 2 * d + 40, device="cuda", dtype=dtype)[:, 8 : 8 + 2 * d]
    elif layout == "3d-strided":
        x = torch.randn(2, tokens + 3, 2 * d + 8, device="cuda", dtype=dtype)[:, 1 : 1 + tokens, : 2 * d]
    else:
        x = torch.randn(2, 3, tokens, 2 * d, device="cuda", dtype=dtype)
    assert x.is_contiguous() == (not layout.endswith("strided"))
    return x * 2


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("op, act", OPS, ids=IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("d", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(op, act, layout, d, dtype):
    x = make_input(layout, d, dtype)
    out = torch.full(x.shape[:-1] + (d,), float("nan"), device="cuda", dtype=dtype)
    assert op(x, out=out) is out
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference(x, act).to(dtype), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    for pdl in (True, False):
        torch.testing.assert_close(op(x, enable_pdl=pdl), out, rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("op, act", OPS, ids=IDS)
@pytest.mark.parametrize("layout", ["2d", "3d-strided"])
@pytest.mark.parametrize("d", [111, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_grids_past_one_block_an_sm(op, act, layout, d, dtype):
    """Grids of more 128-thread blocks than SMs launch in 256-thread blocks (activation.cuh)."""
    tokens = torch.cuda.get_device_properties(0).multi_processor_count + 5
    x = make_input(layout, d, dtype, tokens)
    out = torch.full(x.shape[:-1] + (d,), float("nan"), device="cuda", dtype=dtype)
    op(x, out=out)
    torch.testing.assert_close(out, reference(x, act).to(dtype), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@gpu
@pytest.mark.parametrize("op, act", OPS, ids=IDS)
def test_strided_out_and_no_rows(op, act):
    x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
    wide = torch.full((5, 200), float("nan"), device="cuda", dtype=torch.bfloat16)
    op(x, out=wide[:, 40:168])
    torch.testing.assert_close(wide[:, 40:168], reference(x, act).to(torch.bfloat16), rtol=2e-2, atol=2e-2)
    assert wide[:, :40].isnan().all() and wide[:, 168:].isnan().all()
    assert op(torch.empty(0, 256, device="cuda", dtype=torch.bfloat16)).shape == (0, 128)


@gpu
def test_cuda_graph_capture():
    x = torch.randn(64, 2 * 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(64, 4096, device="cuda", dtype=torch.bfloat16)
    aotinfer.silu_and_mul(x, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        aotinfer.silu_and_mul(x, out=out)
    x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, reference(x, silu).to(torch.bfloat16), rtol=2e-2, atol=2e-2)


# ---- argument errors, without a GPU -------------------------------------------------------------


@pytest.fixture(scope="module")
def bindings():
    # The module the loader picks for this process's GPU (any build without one).
    from aotinfer import _loader

    return _loader.get_module("activation", torch.cuda.current_device() if torch.cuda.is_available() else -1)


@pytest.mark.parametrize("name", IDS)
def test_binding_errors(bindings, name):
    # Shapes, dtypes and values before devices, the input before the output: on CPU tensors.
    binding = getattr(bindings, name)
    bf16 = dict(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="last dimension of input to be even"):
        binding(torch.empty(4, 4, **bf16), torch.empty(4, 7, **bf16), -1)
    with pytest.raises(ValueError, match=r"Expected out to have shape \[4, 8\] with the last dimension halved, got \[4, 8\]"):
        binding(torch.empty(4, 8, **bf16), torch.empty(4, 8, **bf16), -1)
    with pytest.raises(TypeError, match="Expected out and input to have the same dtype"):
        binding(torch.empty(4, 4, dtype=torch.float16), torch.empty(4, 8, **bf16), -1)
    with pytest.raises(TypeError, match="Expected input to have dtype float32, float16 or bfloat16, got int32"):
        binding(torch.empty(4, 4, **bf16), torch.ones(4, 8, dtype=torch.int32), -1)
    with pytest.raises(ValueError, match="Expected enable_pdl to be -1"):
        binding(torch.empty(4, 4, **bf16), torch.empty(4, 8, **bf16), 5)
    with pytest.raises(ValueError, match="Expected input to be a CUDA tensor, got a tensor on cpu"):
        binding(torch.empty(4, 4, **bf16), torch.empty(4, 8, **bf16), -1)


@pytest.mark.parametrize("op", [op for op, _ in OPS], ids=IDS)
def test_errors(op):
    # The binding checks shapes and dtypes before it refuses the CPU, so all of them show here.
    with pytest.raises(ValueError, match="Expected input to be a CUDA tensor, got a tensor on cpu"):
        op(torch.randn(4, 8))
    with pytest.raises(ValueError, match="last dimension of input to be even"):
        op(torch.empty(4, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="last dimension of input to be even"):
        op(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"Expected out to have shape \[4, 8\] with the last dimension halved"):
        op(torch.empty(4, 8, dtype=torch.bfloat16), out=torch.empty(4, 8, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="Expected out and input to have the same dtype"):
        op(torch.empty(4, 8, dtype=torch.bfloat16), out=torch.empty(4, 4, dtype=torch.float16))
