"""scale(input, factor, out=None) against torch, on every path of the kernel."""

import pytest
import torch

import aotinfer
from aotinfer import _loader

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# One rounding of the same float product: torch's eager mul must match bit for bit; the fp64
# reference within half an ulp of the dtype, rounded.
TOLERANCE = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1.2e-7}


def reference(x, factor):
    return (x.double() * factor).to(x.dtype)


def check(out, x, factor):
    assert not out.isnan().any(), "some elements were not written"
    torch.testing.assert_close(out, reference(x, factor), rtol=TOLERANCE[x.dtype], atol=0)
    assert torch.equal(out, x * factor)


# ---- errors, without a GPU ---------------------------------------------------------------------


def test_cpu_input():
    with pytest.raises(ValueError, match="Expected (input to be a CUDA tensor|CUDA tensors)"):
        aotinfer.scale(torch.randn(8), 2.0)


def test_not_a_tensor():
    with pytest.raises(TypeError, match="argument 'input'.* must be Tensor, not list"):
        aotinfer.scale([1.0, 2.0], 2.0)


@pytest.mark.parametrize("factor", ["2", None, True, 1j])
def test_bad_factor(factor):
    with pytest.raises(TypeError, match="Expected factor to be a real number"):
        aotinfer.scale(torch.randn(8), factor)
    with pytest.raises(ValueError, match="CUDA"):  # what the factor check lets through fails later, by name
        aotinfer.scale(torch.randn(8), 2.5)


@pytest.fixture(scope="module")
def binding():
    # The raw tvm-ffi function of the build the loader picks for this process's GPU (any build
    # without one): its checks run before it touches a device.
    index = torch.cuda.current_device() if torch.cuda.is_available() else -1
    return _loader.get_module("scale", index).scale


# The binding checks shapes, dtypes and values before devices, inputs before outputs: these run on
# CPU tensors.


def test_binding_dtype_mismatch(binding):
    with pytest.raises(TypeError, match="Expected out and input to have the same dtype, got float32 and float16"):
        binding(torch.empty(8), torch.randn(8).half(), 2.0, -1)


def test_binding_shape_mismatch(binding):
    with pytest.raises(ValueError, match=r"Expected out and input to have the same shape, got \[4, 2\] and \[8\]"):
        binding(torch.empty(4, 2), torch.randn(8), 2.0, -1)


def test_binding_bad_values(binding):
    with pytest.raises(TypeError, match="Expected input to have dtype float32, float16 or bfloat16, got int32"):
        binding(torch.empty(8), torch.ones(8, dtype=torch.int32), 2.0, -1)
    with pytest.raises(ValueError, match=r"Expected enable_pdl to be -1 \(where supported\), 0 or 1, got 2"):
        binding(torch.empty(8), torch.randn(8), 2.0, 2)
    with pytest.raises(ValueError, match="Expected input to be contiguous"):
        binding(torch.empty(4, 4), torch.randn(4, 4).t(), 2.0, -1)


def test_binding_cpu(binding):
    # Shapes and dtypes right, so the device is what is refused: the input's, before the output's
    # that an op allocates beside it.
    with pytest.raises(ValueError, match="Expected input to be a CUDA tensor, got a tensor on cpu"):
        binding(torch.empty(8), torch.randn(8), 2.0, -1)


# ---- on the GPU --------------------------------------------------------------------------------

gpu = pytest.mark.gpu


def poisoned_like(x):
    return torch.full_like(x, float("nan"), memory_format=torch.contiguous_format)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1,), (7,), (8,), (1023,), (4097,), (1_000_003,), (33, 129), (3, 5, 4096)])
def test_matches_torch(dtype, shape):
    x = torch.randn(shape, device="cuda", dtype=dtype)
    factor = float(torch.randn(()).item()) * 3
    out = aotinfer.scale(x, factor)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    check(out, x, factor)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_out_and_in_place(dtype):
    x = torch.randn(10_001, device="cuda", dtype=dtype)
    out = poisoned_like(x)
    assert aotinfer.scale(x, 0.37, out=out) is out
    check(out, x, 0.37)
    y = x.clone()
    assert aotinfer.scale(y, -1.5, out=y) is y
    torch.testing.assert_close(y, reference(x, -1.5), rtol=TOLERANCE[dtype], atol=0)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("in_offset, out_offset", [(1, 0), (0, 1), (1, 1), (3, 5)])
def test_misaligned(dtype, in_offset, out_offset):
    # Offsets of whole elements move the pointers off 16-byte boundaries: a shared offset takes
    # the vector path after a scalar head, a different one the 1-element path.
    n = 5003
    src = torch.randn(n + 8, device="cuda", dtype=dtype)
    dst = torch.full((n + 8,), float("nan"), device="cuda", dtype=dtype)
    x, out = src[in_offset : in_offset + n], dst[out_offset : out_offset + n]
    assert x.data_ptr() % 16 != 0 or out.data_ptr() % 16 != 0
    aotinfer.scale(x, 1.75, out=out)
    check(out, x, 1.75)
    # Nothing outside out was written.
    assert dst[:out_offset].isnan().all() and dst[out_offset + n :].isnan().all()


@gpu
def test_non_contiguous_input_is_refused():
    base = torch.randn(64, 130, device="cuda", dtype=torch.bfloat16)
    x = base[:, 1:129:2].t()
    assert not x.is_contiguous()
    for skip_check in (False, True):
        with pytest.raises(ValueError, match="Expected input to be contiguous"):
            aotinfer.scale(x, 2.5, skip_check=skip_check)


@gpu
def test_bad_out():
    x = torch.randn(64, 64, device="cuda")
    with pytest.raises(ValueError, match="Expected out to be contiguous"):
        aotinfer.scale(x, 2.0, out=torch.empty(64, 64, device="cuda").t())
    with pytest.raises(ValueError, match="Expected out and input to have the same shape"):
        aotinfer.scale(x, 2.0, out=torch.empty(64, 65, device="cuda"))
    with pytest.raises(TypeError, match="same dtype, got float16 and float32"):
        aotinfer.scale(x, 2.0, out=torch.empty(64, 64, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match="Expected out to be a CUDA tensor"):
        aotinfer.scale(x, 2.0, out=torch.empty(64, 64))
    with pytest.raises(TypeError, match="Expected input to have dtype float32, float16 or bfloat16, got int32"):
        aotinfer.scale(torch.ones(8, device="cuda", dtype=torch.int32), 2.0)
    buf = torch.randn(200, device="cuda")
    with pytest.raises(ValueError, match="Expected out to be input itself or not to overlap it"):
        aotinfer.scale(buf[:100], 2.0, out=buf[50:150])


@gpu
def test_binding_out_off_the_gpu(binding):
    with pytest.raises(ValueError, match="Expected out to be a CUDA tensor, got a tensor on cpu"):
        binding(torch.empty(8, dtype=torch.float16), torch.randn(8, device="cuda", dtype=torch.float16), 2.0, -1)


@gpu
@pytest.mark.parametrize("enable_pdl", [-1, 0, 1])
def test_pdl_chain(binding, enable_pdl):
    # 30 dependent launches, each scaling what the one before wrote, through the binding's
    # enable_pdl: with PDL a read before the wait would show as a wrong product.
    x = torch.randn(1 << 20, device="cuda", dtype=torch.float32)
    a, b = x.clone(), torch.full_like(x, float("nan"))
    for _ in range(15):
        binding(b, a, 1.5, enable_pdl)
        binding(a, b, 0.5, enable_pdl)
    torch.cuda.synchronize()
    want = x.double()
    for _ in range(15):
        want = (want * 1.5).float().double() * 0.5
    assert torch.equal(a, want.float())


@gpu
def test_pdl_graph_capture(binding):
    x = torch.randn(3, 1001, device="cuda", dtype=torch.bfloat16)
    a, b = torch.empty_like(x), torch.empty_like(x)
    binding(a, x, 2.0, 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        binding(a, x, 2.0, 1)
        binding(b, a, -0.75, 1)
    x.copy_(torch.randn_like(x))
    a.fill_(float("nan"))
    b.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(b, (x * 2.0) * -0.75)


@gpu
@pytest.mark.parametrize("shape", [(0,), (0, 4096), (3, 0, 5)])
def test_empty(shape):
    x = torch.empty(shape, device="cuda", dtype=torch.float16)
    out = aotinfer.scale(x, 2.0)
    assert out.shape == x.shape


@gpu
def test_more_than_2_31_elements():
    free, _ = torch.cuda.mem_get_info()
    n = 2**31 + 37
    if free < 3 * 2 * n + (1 << 30):
        pytest.skip("needs about 13 GB of free GPU memory")
    x = torch.randn(n, device="cuda", dtype=torch.float16)
    out = aotinfer.scale(x, 0.5)
    assert torch.equal(out, x * 0.5)
    del x, out
    torch.cuda.empty_cache()


@gpu
def test_runs_on_the_current_stream():
    # The side stream is busy when the input is written; a kernel on any other stream would read
    # it too early.
    x = torch.randn(1 << 22, device="cuda")
    expected = reference(x + 1, 3.0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        x.add_(1)
        out = aotinfer.scale(x, 3.0)
    side.synchronize()
    torch.testing.assert_close(out, expected, rtol=TOLERANCE[torch.float32], atol=0)


@gpu
def test_cuda_graph_capture_and_replay():
    x = torch.randn(1 << 20, device="cuda", dtype=torch.bfloat16)
    out = poisoned_like(x)
    aotinfer.scale(x, 2.0, out=out)  # load the module outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        aotinfer.scale(x, 2.0, out=out)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, x, 2.0)


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device():
    torch.cuda.set_device(0)
    x = torch.randn(1 << 22, device="cuda:1", dtype=torch.float16)
    expected = reference(x + 1, 1.25)
    with torch.cuda.device(1):
        torch.cuda._sleep(50_000_000)  # on cuda:1's current stream: the kernel must wait for it
        x.add_(1)
    out = aotinfer.scale(x, 1.25)
    assert out.device == torch.device("cuda:1") and torch.cuda.current_device() == 0
    torch.cuda.synchronize(1)
    torch.testing.assert_close(out, expected, rtol=TOLERANCE[torch.float16], atol=0)
