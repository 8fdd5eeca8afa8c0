"""@supported_compute_capability and @backend_requirement, on a fake GPU of a chosen capability."""

import inspect

import pytest

from aotinfer import _loader
from aotinfer.utils import BackendSupportedError, backend_requirement, supported_compute_capability


class FakeCudaTensor:
    """Enough of a CUDA tensor for the requirement checks: a device index and a shape."""

    is_cuda = True

    def __init__(self, index=0, width=64):
        self.index, self.width = index, width

    def get_device(self):
        return self.index


@pytest.fixture
def gpus(monkeypatch):
    """cuda:0 is an 8.0 GPU, cuda:1 a 9.0 one."""
    capabilities = {0: (8, 0), 1: (9, 0)}
    monkeypatch.setattr(_loader, "device_capability", lambda index: capabilities[index])


@supported_compute_capability([80, 90])
def _common(x, y=None):
    if x.width > 128:
        raise ValueError("x.width must be at most 128")
    return True


@backend_requirement(backend_checks={}, common_check=_common)
def single(x, y=None):
    return ("ran", x.index)


def test_single_backend(gpus):
    assert single(FakeCudaTensor(0)) == ("ran", 0)
    assert single(FakeCudaTensor(1), y=3) == ("ran", 1)
    with pytest.raises(ValueError, match="x.width must be at most 128"):
        single(FakeCudaTensor(0, width=256))
    assert single(FakeCudaTensor(0, width=256), skip_check=True) == ("ran", 0)
    assert not single.has_backend_choices() and not single.has_backend("cuda")
    assert single.is_compute_capability_supported(80) and single.is_compute_capability_supported((9, 0))
    assert not single.is_compute_capability_supported("8.6")


def test_signature_and_metadata_kept():
    assert single.__name__ == "single" and single.__wrapped__.__name__ == "single"
    params = inspect.signature(single.__wrapped__).parameters
    assert list(params) == ["x", "y"]
    with pytest.raises(TypeError):
        single()  # missing x, as for the plain function
    with pytest.raises(TypeError):
        single(FakeCudaTensor(), 1, 2)  # too many positionals


@supported_compute_capability([90, 100])
def _hopper_only(x, backend="cuda"):
    return True


@supported_compute_capability([80, 86, 89, 90])
def _everywhere(x, backend="cuda"):
    if x.width % 8:
        raise ValueError("x.width must be a multiple of 8")
    return True


def _prefer_hopper(suitable, x, backend):
    return sorted(suitable, key=lambda b: b != "hopper")


@backend_requirement(
    backend_checks={"hopper": _hopper_only, "cuda": _everywhere},
    heuristic_func=_prefer_hopper,
)
def attention(x, backend="cuda"):
    if backend == "auto":
        backend = attention.suitable_auto_backends[0]
    return backend


def test_explicit_backends(gpus):
    assert attention(FakeCudaTensor(0), backend="cuda") == "cuda"
    assert attention(FakeCudaTensor(1), backend="hopper") == "hopper"
    with pytest.raises(BackendSupportedError) as e:
        attention(FakeCudaTensor(0), backend="hopper")
    message = str(e.value)
    assert "attention" in message and "'hopper'" in message
    assert "cuda:0 (compute capability 8.0)" in message and "90, 100" in message
    with pytest.raises(BackendSupportedError, match="unknown backend; choose one of 'hopper', 'cuda' or 'auto'"):
        attention(FakeCudaTensor(0), backend="triton")


def test_auto_backend(gpus):
    assert attention(FakeCudaTensor(1), backend="auto") == "hopper"
    assert attention.suitable_auto_backends == ["hopper", "cuda"]
    assert attention(FakeCudaTensor(0), backend="auto") == "cuda"
    assert attention.suitable_auto_backends == ["cuda"]
    with pytest.raises(BackendSupportedError, match="no backend of"):
        attention(FakeCudaTensor(0, width=12), backend="auto")
    # skip_check does not skip the choice: the op reads it.
    assert attention(FakeCudaTensor(1), backend="auto", skip_check=True) == "hopper"


def test_backend_queries():
    assert attention.has_backend_choices() and attention.has_backend("cuda") and not attention.has_backend("auto")
    assert attention.is_backend_supported("hopper") and attention.is_backend_supported("hopper", cc=90)
    assert not attention.is_backend_supported("hopper", cc=80)
    assert not attention.is_backend_supported("triton")
    assert attention.is_compute_capability_supported(100)  # hopper
    assert attention.is_compute_capability_supported(86)  # cuda
    assert not attention.is_compute_capability_supported(75)


def test_check_returning_false(gpus):
    def lazy(x):
        return False

    @backend_requirement(backend_checks={}, common_check=lazy)
    def op(x):
        return "ran"

    with pytest.raises(BackendSupportedError, match="lazy rejected the arguments"):
        op(FakeCudaTensor())


def test_keyword_only_parameters(gpus):
    seen = []

    def check(x, *, mode="a"):
        seen.append(mode)
        return True

    @backend_requirement(backend_checks={}, common_check=check)
    def op(x, *, mode="a"):
        return mode

    assert op(FakeCudaTensor(), mode="b") == "b" and seen == ["b"]


def test_backend_checks_need_a_backend_parameter():
    with pytest.raises(TypeError, match="need a 'backend' parameter"):
        backend_requirement(backend_checks={"cuda": _everywhere})(lambda x: x)
    with pytest.raises(ValueError, match="'auto' is not a backend name"):
        backend_requirement(backend_checks={"auto": _everywhere})


def test_device_support_pdl():
    """FlashInfer's utility: True exactly where ops launch with PDL by default (sm90 and up)."""
    import torch

    from aotinfer.utils import device_support_pdl

    assert device_support_pdl("cpu") is False
    if torch.cuda.is_available():
        assert device_support_pdl("cuda") == (torch.cuda.get_device_capability()[0] >= 9)
