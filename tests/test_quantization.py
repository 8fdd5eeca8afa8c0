"""aotinfer.packbits and segment_packbits against numpy.packbits, on the CPU and the GPU."""

import numpy as np
import pytest
import torch

import aotinfer

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bitorder", ["big", "little"])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000, 4099])
def test_packbits_is_numpys(n, bitorder, device):
    g = torch.Generator().manual_seed(n)
    x = torch.rand(n, generator=g) < 0.4
    want = np.packbits(x.numpy(), bitorder=bitorder)
    got = aotinfer.packbits(x.to(device), bitorder)
    assert got.dtype == torch.uint8 and got.device.type == device
    assert np.array_equal(got.cpu().numpy(), want)
    # Any dtype reads nonzero as a set bit; a 2-D mask is packed flattened, as numpy does.
    assert torch.equal(aotinfer.packbits(x.float().to(device), bitorder), got)
    if n % 10 == 0 and n:
        assert torch.equal(aotinfer.packbits(x.view(10, -1).to(device), bitorder), got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bitorder", ["big", "little"])
def test_segment_packbits_packs_each_segment(bitorder, device):
    """Segments of other lengths (empty ones, lengths off a byte), each packed on its own."""
    g = torch.Generator().manual_seed(3)
    lengths = [13, 0, 8, 1, 200, 7, 0, 64]
    indptr = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).int()
    x = torch.rand(int(indptr[-1]), generator=g) < 0.5
    packed, new_indptr = aotinfer.segment_packbits(x.to(device), indptr.to(device), bitorder)
    want = [np.packbits(x[int(a):int(b)].numpy(), bitorder=bitorder) for a, b in zip(indptr[:-1], indptr[1:])]
    assert new_indptr.dtype == torch.int32 and new_indptr.device.type == device
    assert new_indptr.tolist() == np.concatenate([[0], np.cumsum([w.size for w in want])]).tolist()
    assert np.array_equal(packed.cpu().numpy(), np.concatenate(want))


def test_packbits_arguments():
    with pytest.raises(ValueError, match="Expected bitorder to be 'big' or 'little', got 'middle'"):
        aotinfer.packbits(torch.ones(3, dtype=torch.bool), "middle")
    with pytest.raises(TypeError, match="Expected x to be a torch.Tensor"):
        aotinfer.packbits([1, 0, 1])
    x = torch.ones(10, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"Expected indptr to rise from 0 to at most len\(x\) = 10"):
        aotinfer.segment_packbits(x, torch.tensor([0, 4, 11], dtype=torch.int32))
    with pytest.raises(ValueError, match="Expected indptr to rise"):
        aotinfer.segment_packbits(x, torch.tensor([0, 5, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="Expected indptr to be an int32 or int64 tensor"):
        aotinfer.segment_packbits(x, torch.tensor([0.0, 4.0]))
    with pytest.raises(ValueError, match=r"Expected x to be 1-D, got shape \[2, 5\]"):
        aotinfer.segment_packbits(x.view(2, 5), torch.tensor([0, 4], dtype=torch.int32))
    packed, new_indptr = aotinfer.segment_packbits(x[:0], torch.zeros(3, dtype=torch.int64))
    assert packed.numel() == 0 and new_indptr.tolist() == [0, 0, 0] and new_indptr.dtype == torch.int64
