"""Bit packing with FlashInfer's signatures (module ``flashinfer.quantization``): ``packbits`` and
``segment_packbits``, which pack boolean attention masks into the bytes the prefill wrappers'
``packed_custom_mask`` takes.

Both are torch operations on the mask's device (a few elementwise kernels and a sum); nothing here
needs a kernel of its own. ``segment_packbits`` reads the segment offsets on the host to size its
output, as FlashInfer's does (a synchronization where they are on the GPU).
"""

from __future__ import annotations

from .api_logging import aotinfer_api
from .utils import check_tensor

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Tuple

    import torch

_BITORDERS = ("big", "little")


def _check_bitorder(bitorder) -> None:
    if bitorder not in _BITORDERS:
        raise ValueError(f"Expected bitorder to be 'big' or 'little', got {bitorder!r}")


def _bit_weights(bitorder: str, device) -> "torch.Tensor":
    """The value of each of a byte's 8 bits, first bit first: 128 .. 1 (big) or 1 .. 128 (little)."""
    import torch

    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)
    return weights.flip(0) if bitorder == "big" else weights


@aotinfer_api
def packbits(x: torch.Tensor, bitorder: str = "big") -> torch.Tensor:
    """Pack the elements of ``x`` (bool, or any dtype read as nonzero = 1), flattened, into bytes:
    ``numpy.packbits(x, bitorder=bitorder)``, the last byte padded with zeros.

    Returns uint8 ``[ceil(x.numel() / 8)]`` on x's device.
    """
    import torch

    check_tensor(x, "x")
    _check_bitorder(bitorder)
    bits = x.reshape(-1) != 0
    pad = -bits.numel() % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    return (bits.view(-1, 8).to(torch.uint8) * _bit_weights(bitorder, x.device)).sum(-1, dtype=torch.uint8)


@aotinfer_api
def segment_packbits(x: torch.Tensor, indptr: torch.Tensor, bitorder: str = "big") -> Tuple[torch.Tensor, torch.Tensor]:
    """Pack each segment ``x[indptr[i]:indptr[i + 1]]`` of a 1-D ``x`` on its own, as ``packbits``
    does (each segment padded to a whole byte): the per-request masks of a batch.

    indptr: int32 or int64 ``[num_segments + 1]``, non-decreasing from 0 to at most ``x.numel()``.
    Returns ``(packed, new_indptr)``: uint8 ``[new_indptr[-1]]`` and ``new_indptr`` (indptr's dtype
    and device), segment i's bytes at ``packed[new_indptr[i]:new_indptr[i + 1]]``.
    """
    import torch

    check_tensor(x, "x")
    check_tensor(indptr, "indptr")
    _check_bitorder(bitorder)
    if x.dim() != 1:
        raise ValueError(f"Expected x to be 1-D, got shape {list(x.shape)}")
    if indptr.dim() != 1 or indptr.numel() < 1 or indptr.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"Expected indptr to be an int32 or int64 tensor of num_segments + 1 elements, got "
                         f"{indptr.dtype} {list(indptr.shape)}")
    host = indptr.to("cpu", torch.int64)
    lengths = host[1:] - host[:-1]
    if int(host[0]) != 0 or bool((lengths < 0).any()) or int(host[-1]) > x.numel():
        raise ValueError(f"Expected indptr to rise from 0 to at most len(x) = {x.numel()}, got {host.tolist()}")
    packed_lengths = (lengths + 7) // 8
    new_host = torch.cat([host.new_zeros(1), packed_lengths.cumsum(0)])
    total = int(new_host[-1])
    device = x.device
    # Each output byte's segment, its place in the segment, and its 8 elements (past the segment's
    # end: zero bits).
    segment = torch.repeat_interleave(torch.arange(lengths.numel()), packed_lengths, output_size=total).to(device)
    first_bit = (torch.arange(total, device=device) - new_host.to(device)[segment]) * 8
    position = first_bit[:, None] + torch.arange(8, device=device)
    inside = position < lengths.to(device)[segment][:, None]
    flat = host.to(device)[segment][:, None] + position
    bits = (x[flat.clamp(max=max(x.numel() - 1, 0))] != 0) & inside if x.numel() else inside
    packed = (bits.to(torch.uint8) * _bit_weights(bitorder, device)).sum(-1, dtype=torch.uint8)
    return packed, new_host.to(device=indptr.device, dtype=indptr.dtype)
