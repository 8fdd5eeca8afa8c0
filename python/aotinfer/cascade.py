"""Merging attention states, with FlashInfer's signatures: merge_state, merge_state_in_place and
merge_states (module ``flashinfer.cascade``).

An attention state is the output ``v`` of attention over one segment of the keys and the
log-sum-exp ``s`` of its logits, base 2 (``s = log2(sum(exp(logits)))``, as FlashInfer's kernels
return it). Merging the states of two segments gives the state of their union::

    s = log2(2**s_a + 2**s_b)
    v = v_a * 2**(s_a - s) + v_b * 2**(s_b - s)

computed in float32. A segment with no keys has ``s = -inf`` and contributes nothing; merging two
such states gives ``v = 0``, ``s = -inf``. ``v`` is float16, bfloat16 or float32 with a contiguous
last dimension; ``s`` is float32. Batched decode (aotinfer.decode) merges its split chunks with
the same math.
"""

from __future__ import annotations

from ._kernels import kernel
from .api_logging import aotinfer_api
from .trace.templates.cascade import merge_state_in_place_trace, merge_state_trace, merge_states_trace
from .utils import check_tensor

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional, Tuple

    import torch

_merge_state = kernel("cascade", "merge_state")
_merge_state_in_place = kernel("cascade", "merge_state_in_place")
_merge_states = kernel("cascade", "merge_states")


@aotinfer_api(trace=merge_state_trace)
def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor, *, skip_check: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Merge the attention states of two KV segments ``A`` and ``B`` (see the module doc).

    Parameters
    ----------
    v_a, v_b : torch.Tensor
        Attention outputs of the segments, ``[seq_len, num_heads, head_dim]``, one dtype (float16,
        bfloat16 or float32).
    s_a, s_b : torch.Tensor
        Their log-sum-exp values (base 2), ``[seq_len, num_heads]``; converted to float32 when
        they are not (as FlashInfer does).

    Returns
    -------
    Tuple[torch.Tensor, torch.Tensor]
        ``v_merged`` (``[seq_len, num_heads, head_dim]``, v_a's dtype) and ``s_merged``
        (``[seq_len, num_heads]``, float32): the state of the segment ``[A, B]``.
    """
    import torch

    for value, name in ((v_a, "v_a"), (s_a, "s_a"), (v_b, "v_b"), (s_b, "s_b")):
        check_tensor(value, name)
    if s_a.dtype != torch.float32:
        s_a = s_a.float()
    if s_b.dtype != torch.float32:
        s_b = s_b.float()
    v_merged = torch.empty(v_a.shape, dtype=v_a.dtype, device=v_a.device)
    s_merged = torch.empty(s_a.shape, dtype=torch.float32, device=s_a.device)
    _merge_state(v_merged, s_merged, v_a, s_a, v_b, s_b, -1)
    return v_merged, s_merged


@aotinfer_api(trace=merge_state_in_place_trace)
def merge_state_in_place(
    v: torch.Tensor,
    s: torch.Tensor,
    v_other: torch.Tensor,
    s_other: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    skip_check: bool = False,
) -> None:
    r"""Merge the state ``(v_other, s_other)`` into ``(v, s)``, in place (see the module doc).

    Parameters
    ----------
    v : torch.Tensor
        ``[seq_len, num_heads, head_dim]``, float16, bfloat16 or float32, updated in place.
    s : torch.Tensor
        ``[seq_len, num_heads]``, float32 (it is written), updated in place.
    v_other : torch.Tensor
        ``[seq_len, num_heads, head_dim]``, v's dtype.
    s_other : torch.Tensor
        ``[seq_len, num_heads]``, float32.
    mask : Optional[torch.Tensor]
        ``[seq_len]`` bool: rows where it is False keep their state (useful under CUDA graphs,
        where the rows to merge change between replays). None merges every row.

    Returns
    -------
    None
        The merged state is in ``v`` and ``s``.
    """
    import torch

    check_tensor(v, "v")
    if mask is None:
        mask = torch.empty(0, dtype=torch.bool, device=v.device)
    _merge_state_in_place(v, s, v_other, s_other, mask, -1)


@aotinfer_api(trace=merge_states_trace)
def merge_states(
    v: torch.Tensor, s: torch.Tensor, *, skip_check: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Merge ``num_states`` attention states per row (see the module doc).

    Parameters
    ----------
    v : torch.Tensor
        ``[seq_len, num_states, num_heads, head_dim]``, float16, bfloat16 or float32.
    s : torch.Tensor
        ``[seq_len, num_states, num_heads]``; converted to float32 when it is not (as FlashInfer
        does).

    Returns
    -------
    Tuple[torch.Tensor, torch.Tensor]
        ``v_merged`` (``[seq_len, num_heads, head_dim]``, v's dtype) and ``s_merged``
        (``[seq_len, num_heads]``, float32). With ``num_states == 0`` the output is zeros and
        ``-inf``.
    """
    import torch

    check_tensor(v, "v")
    check_tensor(s, "s")
    if v.dim() != 4:
        raise ValueError(f"Expected v to have 4 dimensions [seq_len, num_states, num_heads, head_dim], got shape {list(v.shape)}")
    if s.dtype != torch.float32:
        s = s.float()
    seq_len, _, num_heads, head_dim = v.shape
    v_merged = torch.empty((seq_len, num_heads, head_dim), dtype=v.dtype, device=v.device)
    s_merged = torch.empty((seq_len, num_heads), dtype=torch.float32, device=v.device)
    _merge_states(v_merged, s_merged, v, s, -1)
    return v_merged, s_merged
