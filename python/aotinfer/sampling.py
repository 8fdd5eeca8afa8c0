"""Sampling with FlashInfer's signatures and semantics (module ``flashinfer.sampling``): draws from
probabilities or logits under top-k, top-p, min-p and their combinations, the top-k / top-p
renormalizations, top-k masking of logits, softmax with temperature, and chain speculative
sampling (draft tokens accepted or resampled so that the emitted tokens follow the target model).

No op sorts the vocabulary. Every filter keeps the elements at or above one threshold value (ties
with it are kept), found by a radix search over the row's bit patterns in shared memory; a draw is
an exponential race in the same pass. Top-p alone draws from the whole row and keeps the first draw
that the filter keeps, which needs no threshold; with no filter, a row of probabilities draws its
token the same way and keeps it (include/aotinfer/sampling.cuh says how).

Randomness is Philox4x32-10 keyed by a seed, with a counter made of the element, the output row
and an offset. Without ``seed`` and ``offset`` both, they come from ``generator`` (the device's
default CUDA generator when None), whose offset is then advanced, so consecutive calls differ and
``torch.manual_seed`` reproduces them. ``seed`` and ``offset`` may be Python ints or int64 tensors
of 1 or ``batch_size`` elements; tensors are read on the GPU, so a CUDA graph captured with them
draws anew on each replay once the caller updates them. The same probabilities, seed and offset
give the same tokens on every run, whatever ``deterministic`` says.

Filters:

- top-k keeps the ``top_k`` largest (more when the k-th value has ties); ``top_k`` >= the number
  of positive entries, or <= 0 in a tensor, keeps every token.
- top-p keeps the smallest upper set whose mass reaches ``top_p`` times the row's total; 1 keeps
  every token.
- min-p keeps the probabilities >= ``min_p`` times the row's largest.
- ``filter_apply_order="top_k_first"``: top-p over the renormalized top-k set;
  ``"joint"``: both filters over the original row, a token kept where both keep it.

Probabilities <= 0 (and NaN) are never drawn. A row with nothing to draw gives token 0; an index in
``indices`` outside probs' rows gives -1. With ``return_valid=True`` a sampler returns ``(tokens,
valid)``, ``valid`` bool ``[batch_size]``: False exactly for those two cases (FlashInfer's flag for
rows without a valid distribution, NaN rows among them).

Every op takes the keyword ``skip_check=True`` to skip the Python-side checks of its scalar
parameters and options (the kernels check every tensor).
"""

from __future__ import annotations

from ._kernels import kernel
from .api_logging import aotinfer_api
from .trace.templates.sampling import (
    chain_speculative_sampling_trace,
    min_p_sampling_trace,
    sampling_from_logits_trace,
    sampling_from_probs_trace,
    softmax_trace,
    top_k_mask_logits_trace,
    top_k_renorm_probs_trace,
    top_k_sampling_trace,
    top_k_top_p_sampling_from_logits_trace,
    top_k_top_p_sampling_trace,
    top_p_renorm_probs_trace,
    top_p_sampling_trace,
)
from .utils import check_enable_pdl, check_int, check_real, check_tensor

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional, Tuple, Union

    import torch


_sample = kernel("sampling", "sample")
_renorm = kernel("sampling", "renorm")
_top_k_mask_logits = kernel("sampling", "top_k_mask_logits")
_softmax = kernel("sampling", "softmax")
_chain_speculative_sampling = kernel("sampling", "chain_speculative_sampling")

_ORDERS = ("top_k_first", "joint")  # filter_apply_order's values, the binding's names of those filters
_PHILOX_OFFSETS_PER_CALL = 4  # a call's draws use one offset; 4 keeps the generator's offset a multiple of 4


# ---- checks of what the bindings cannot see ------------------------------------------------------


def _is_tensor(value) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _check_top_k(top_k) -> None:
    if not _is_tensor(top_k):
        check_int(top_k, "top_k", 1)


def _check_fraction(value, name: str, low_open: bool) -> None:
    """A scalar in (0, 1] (low_open) or [0, 1]; tensors are the binding's."""
    if _is_tensor(value):
        return
    check_real(value, name)
    if not ((value > 0 if low_open else value >= 0) and value <= 1):
        raise ValueError(f"Expected {name} to be in {'(0' if low_open else '[0'}, 1], got {value}")


def _check_top_k_top_p(top_k, top_p, filter_apply_order) -> None:
    _check_top_k(top_k)
    _check_fraction(top_p, "top_p", low_open=True)
    if filter_apply_order not in _ORDERS:
        raise ValueError(f"Expected filter_apply_order to be 'top_k_first' or 'joint', got {filter_apply_order!r}")


def _check_temperature(temperature) -> None:
    if temperature is not None and not _is_tensor(temperature):
        check_real(temperature, "temperature")
        if not temperature > 0:
            raise ValueError(f"Expected temperature to be positive, got {temperature}")


def _check_random(deterministic, generator, check_nan, seed, offset, return_valid) -> None:
    """The options every sampler takes (indices is _draw's: it reads it with or without checks)."""
    import torch

    for value, name in ((deterministic, "deterministic"), (check_nan, "check_nan"), (return_valid, "return_valid")):
        if type(value) is not bool:
            raise TypeError(f"Expected {name} to be a bool, got {type(value).__name__}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"Expected generator to be a torch.Generator, got {type(generator).__name__}")
    for value, name in ((seed, "seed"), (offset, "offset")):
        if value is not None and not _is_tensor(value):
            check_int(value, name, -(2**63))
            if value >= 2**64:
                raise ValueError(f"Expected {name} to fit in 64 bits, got {value}")


# ---- the calls -----------------------------------------------------------------------------------------


def _per_row(value, dtype, sentinel, none):
    """(tensor, scalar) for a binding's per-row parameter: a tensor (converted to dtype, as
    FlashInfer does) with the scalar `sentinel` that says to read it, or `none` and the scalar
    (0 for a parameter the filter does not use)."""
    if value is None:
        return none, 0
    if _is_tensor(value):
        return (value if value.dtype == dtype else value.to(dtype)), sentinel
    return none, value


def _random_state(device, generator, seed, offset):
    """(seed, offset) for the kernel: the caller's, or the generator's, advancing it."""
    if seed is not None and offset is not None:
        return seed, offset
    import torch

    if generator is None:
        if device.type != "cuda" or torch._C._len_torch_dispatch_stack():
            return 0, 0  # a tracer's fake tensors, or a device the binding refuses by name
        generator = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    if generator.device.type != "cuda":
        raise ValueError(f"Expected generator to be a CUDA generator, got one on {generator.device}")
    seed, offset = generator.initial_seed(), generator.get_offset()
    generator.set_offset(offset + _PHILOX_OFFSETS_PER_CALL)
    return seed, offset


def _random_arguments(device, generator, seed, offset, none):
    """The bindings' (seed, seed_val, offset, offset_val): a tensor and 0, or ``none`` and the value as
    a signed 64-bit integer."""
    seed, offset = _random_state(device, generator, seed, offset)
    seed, seed_val = (seed, 0) if _is_tensor(seed) else (none, seed - 2**64 if seed >= 2**63 else seed)
    offset, offset_val = (offset, 0) if _is_tensor(offset) else (none, offset - 2**64 if offset >= 2**63 else offset)
    return seed, seed_val, offset, offset_val


def _draw(sample, probs, filter, top_k, top_p, min_p, indices, generator, check_nan, seed, offset,
          return_valid, from_logits=False):
    """One sampling call: output allocation, per-row parameters, random state, the binding."""
    import torch

    name = "logits" if from_logits else "probs"
    check_tensor(probs, name)
    if indices is not None:
        check_tensor(indices, "indices")
    filtered_logits = from_logits and filter != "none"  # any float dtype: the binding's softmax reads it
    if probs.dtype in (torch.float16, torch.bfloat16) and not filtered_logits:
        probs = probs.float()  # as FlashInfer does
    if check_nan and bool(torch.isnan(probs).any()):
        raise ValueError(f"Input {name} contains NaN.")
    rows = indices if indices is not None else probs
    batch = rows.shape[0] if rows.dim() else 1  # (a 0-d tensor: the binding names its rank)
    out = torch.empty(batch, dtype=indices.dtype if indices is not None else torch.int32, device=probs.device)
    none = probs.new_empty(0)
    top_k, top_k_val = _per_row(top_k, torch.int32, -1, none)
    top_p, top_p_val = _per_row(top_p, torch.float32, -1.0, none)
    min_p, min_p_val = _per_row(min_p, torch.float32, -1.0, none)
    seed, seed_val, offset, offset_val = _random_arguments(probs.device, generator, seed, offset, none)
    # No elements: not wanted. Its own tensor, not `none`: the op's schema marks valid as written, and
    # a written argument may not alias the others under torch.compile.
    valid = torch.empty(batch if return_valid else 0, dtype=torch.bool, device=probs.device)
    # From logits with a filter: the rows' probabilities, where the binding computes them (as many
    # rows as the logits', padded to 16 bytes). Written, so its own tensor, as valid.
    scratch = (torch.empty(probs.shape[0], (probs.shape[1] + 3) // 4 * 4, dtype=torch.float32, device=probs.device)
               if filtered_logits and probs.dim() == 2 else probs.new_empty(0))
    try:
        sample(out, valid, scratch, probs, none if indices is None else indices, top_k, top_p, min_p, seed, offset,
               filter, from_logits, top_k_val, top_p_val, min_p_val, seed_val, offset_val, -1)
    except (TypeError, ValueError) as error:
        if not from_logits or not str(error).startswith("Expected probs "):
            raise
        # The float32 copy of 16-bit logits made above is no argument of the op: the kernel function
        # names it by the binding's name for the rows, probs.
        raise type(error)("Expected logits " + str(error)[len("Expected probs "):]) from None
    return (out, valid) if return_valid else out


@aotinfer_api(trace=sampling_from_probs_trace)
def sampling_from_probs(probs: torch.Tensor, indices: Optional[torch.Tensor] = None, deterministic: bool = True,
                        generator: Optional[torch.Generator] = None, check_nan: bool = False,
                        seed: Optional[Union[int, torch.Tensor]] = None,
                        offset: Optional[Union[int, torch.Tensor]] = None,
                        return_valid: bool = False, *,
                        skip_check: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Draw one token per row with probability ``probs[i, j] / sum(probs[i])``.

    ``batch_size`` is ``indices``' length, else the input's rows.

    Parameters
    ----------
    probs : torch.Tensor
        ``[num_rows, vocab_size]`` probabilities of any positive scale (a row need not sum to 1;
        entries <= 0 are never drawn): float32, or float16/bfloat16 (converted to float32); last
        dimension contiguous.
    indices : Optional[torch.Tensor]
        int32 or int64 ``[batch_size]`` on the GPU: output row ``i`` draws from input row
        ``indices[i]`` (rows may repeat); None: one output row per input row.
    deterministic : bool
        Accepted for FlashInfer's API: draws are reproducible whatever it says.
    generator : Optional[torch.Generator]
        The CUDA generator that gives the seed and offset when ``seed`` and ``offset`` are not
        both set; each call advances its offset. None: the device's default generator.
    check_nan : bool
        Raise ValueError when the input holds a NaN (reads it on the host: a synchronization).
    seed, offset : Optional[Union[int, torch.Tensor]]
        The Philox key and counter offset, used when both are set: Python ints, or int64 GPU
        tensors of 1 or ``batch_size`` elements that the kernel reads when it runs (so a CUDA graph
        draws anew on each replay once they change). The same input, seed and offset give the
        same tokens.
    return_valid : bool
        Also return ``valid``.

    Returns
    -------
    torch.Tensor or Tuple[torch.Tensor, torch.Tensor]
        ``tokens``, ``[batch_size]`` token ids: int32, or ``indices``' dtype when given. With
        ``return_valid``, ``(tokens, valid)``, ``valid`` bool ``[batch_size]``: False for a row with
        nothing to draw (its token 0) or an index outside the input (its token -1).
    """
    if not skip_check:
        _check_random(deterministic, generator, check_nan, seed, offset, return_valid)

    return _draw(_sample, probs, "none", None, None, None, indices, generator, check_nan, seed, offset,
                 return_valid)


@aotinfer_api(trace=sampling_from_logits_trace)
def sampling_from_logits(logits: torch.Tensor, indices: Optional[torch.Tensor] = None, deterministic: bool = True,
                         generator: Optional[torch.Generator] = None, check_nan: bool = False,
                         seed: Optional[Union[int, torch.Tensor]] = None,
                         offset: Optional[Union[int, torch.Tensor]] = None,
                         return_valid: bool = False, *,
                         skip_check: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Draw one token per row from ``softmax(logits[i])``, as ``argmax(logits + Gumbel noise)`` in one
    pass (no softmax is written).

    ``batch_size`` is ``indices``' length, else the input's rows.

    Parameters
    ----------
    logits : torch.Tensor
        ``[num_rows, vocab_size]``: float32, or float16/bfloat16 (converted to float32); last
        dimension contiguous.
    indices : Optional[torch.Tensor]
        int32 or int64 ``[batch_size]`` on the GPU: output row ``i`` draws from input row
        ``indices[i]`` (rows may repeat); None: one output row per input row.
    deterministic : bool
        Accepted for FlashInfer's API: draws are reproducible whatever it says.
    generator : Optional[torch.Generator]
        The CUDA generator that gives the seed and offset when ``seed`` and ``offset`` are not
        both set; each call advances its offset. None: the device's default generator.
    check_nan : bool
        Raise ValueError when the input holds a NaN (reads it on the host: a synchronization).
    seed, offset : Optional[Union[int, torch.Tensor]]
        The Philox key and counter offset, used when both are set: Python ints, or int64 GPU
        tensors of 1 or ``batch_size`` elements that the kernel reads when it runs (so a CUDA graph
        draws anew on each replay once they change). The same input, seed and offset give the
        same tokens.
    return_valid : bool
        Also return ``valid``.

    Returns
    -------
    torch.Tensor or Tuple[torch.Tensor, torch.Tensor]
        ``tokens``, ``[batch_size]`` token ids: int32, or ``indices``' dtype when given. With
        ``return_valid``, ``(tokens, valid)``, ``valid`` bool ``[batch_size]``: False for a row with
        nothing to draw (its token 0) or an index outside the input (its token -1).
    """
    if not skip_check:
        _check_random(deterministic, generator, check_nan, seed, offset, return_valid)

    return _draw(_sample, logits, "none", None, None, None, indices, generator, check_nan, seed, offset,
                 return_valid, from_logits=True)


@aotinfer_api(trace=top_p_sampling_trace)
def top_p_sampling_from_probs(probs: torch.Tensor, top_p: Union[torch.Tensor, float],
                              indices: Optional[torch.Tensor] = None, deterministic: bool = True,
                              generator: Optional[torch.Generator] = None, check_nan: bool = False,
                              seed: Optional[Union[int, torch.Tensor]] = None,
                              offset: Optional[Union[int, torch.Tensor]] = None,
                              return_valid: bool = False, *,
                              skip_check: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Top-p (nucleus) sampling: draw from the smallest set of most probable tokens whose mass
    reaches ``top_p`` of the row's.

    ``batch_size`` is ``indices``' length, else the input's rows.

    Parameters
    ----------
    probs : torch.Tensor
        ``[num_rows, vocab_size]`` probabilities of any positive scale (a row need not sum to 1;
        entries <= 0 are never drawn): float32, or float16/bfloat16 (converted to float32); last
        dimension contiguous.
    top_p : float or torch.Tensor
        A float in (0, 1] for every row, or float32 ``[batch_size]``, one a row (1 keeps the row).
    indices : Optional[torch.Tensor]
        int32 or int64 ``[batch_size]`` on the GPU: output row ``i`` draws from input row
        ``indices[i]`` (rows may repeat); None: one output row per input row.
    deterministic : bool
        Accepted for FlashInfer's API: draws are reproducible whatever it says.
    generator : Optional[torch.Generator]
        The CUDA generator that gives the seed and offset when ``seed`` and ``offset`` are not
        both set; each call advances its offset. None: the device's default generator.
    check_nan : bool
        Raise ValueError when the input holds a NaN (reads it on the host: a synchronization).
    seed, offset : Optional[Union[int, torch.Tensor]]
        The Philox key and counter offset, used when both are set: Python ints, or int64 GPU
        tensors of 1 or ``batch_size`` elements that the kernel reads when it runs (so a CUDA graph
        draws anew on each replay once they change). The same input, seed and offset give the
        same tokens.
    return_valid : bool
        Also return ``valid``.

    Returns
    -------
    torch.Tensor or Tuple[torch.Tensor, torch.Tensor]
        ``tokens``, ``[batch_size]`` token ids: int32, or ``indices``' dtype when given. With
        ``return_valid``, ``(tokens, valid)``, ``valid`` bool ``[batch_size]``: False for a row with
        nothing to draw (its token 0) or an index outside the input (its token -1).
    """
    if not skip_check:
        _check_fraction(top_p, "top_p", low_open=True)
        _check_random(deterministic, generator, check_nan, seed, offset, return_valid)

    return _draw(_sample, probs, "top_p", None, top_p, None, indices, generator, check_nan, seed, offset,
                 return_valid)


@aotinfer_api(trace=top_k_sampling_trace)
def top_k_sampling_from_probs(probs: torch.Tensor, top_k: Union[torch.Tensor, int],
                              indices: Optional[torch.Tensor] = None, deterministic: bool = True,
                              generator: Optional[torch.Generator] = None, check_nan: bool = False,
                              seed: Optional[Union[int, torch.Tensor]] = None,
                              offset: Optional[Union[int, torch.Tensor]] = None,
                              return_valid: bool = False, *,
                              skip_check: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Top-k sampling: draw from the ``top_k`` most probable tokens (ties with the k-th kept),
    renormalized.

    ``batch_size`` is ``indices``' length, else the input's rows.

    Parameters
    ----------
    probs : torch.Tensor
        ``[num_rows, vocab_size]`` probabilities of any positive scale (a row need not sum to 1;
        entries <= 0 are never drawn): float32, or float16/bfloat16 (converted to float32); last
        dimension contiguous.
    top_k : int or torch.Tensor
        An int >= 1 for every row, or int32 ``[batch_size]``, one a row (<= 0 keeps the row).
    indices : Optional[torch.Tensor]
        int32 or int64 ``[batch_size]`` on the GPU: output row ``i`` draws from input row
        ``indices[i]`` (rows may repeat); None: one output row per input row.
    deterministic : bool
        Accepted for FlashInfer's API: draws are reproducible whatever it says.
    generator : Optional[torch.Generator]
        The CUDA generator that gives the seed and offset when ``seed`` and ``offset`` are not
        both set; each call advances its offset. None: the device's default generator.
    check_nan : bool
        Raise ValueError when the input holds a NaN (reads it on the host: a synchronization).
    seed, offset : Optional[Union[int, torch.Tensor]]
        The Philox key and counter offset, used when both are set: Python ints, or int64 GPU
        tensors of 1 or ``batch_size`` elements that the kernel reads when it runs (so a CUDA graph
        draws anew on each replay once they change). The same input, seed and offset give the
        same tokens.
    return_valid : bool
        Also return ``valid``.

    Returns
    -------
    torch.Tensor or Tuple[torch.Tensor, torch.Tensor]
        ``tokens``, ``[batch_size]`` token ids: int32, or ``indices``' dtype when given. With
        ``return_valid``, ``(tokens, valid)``, ``valid`` bool ``[batch_size]``: False for a row with
        nothing to draw (its token 0) or an index outside the input (its token -1).
    """
    if not skip_check:
        _check_top_k(top_k)
        _check_random(deterministic, generator, check_nan, seed, offset, return_valid)

    return _draw(_sample, probs, "top_k", top_k, None, None, indices, generator, check_nan, seed, offset,
                 return_valid)


@aotinfer_api(trace=min_p_sampling_trace)
def min_p_sampling_from_probs(probs: torch.Tensor, min_p: Union[torch.Tensor, float],
                              indices: Optional[torch.Tensor] = None, deterministic: bool = True,
                              generator: Optional[torch.Generator] = None, check_nan: bool = False,
                              seed: Optional[Union[int, torch.Tensor]] = None,
                              offset: Optional[Union[int, torch.Tensor]] = None,
                              return_valid: bool = False, *,
                              skip_check: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Min-p sampling: draw from the tokens whose probability is at least ``min_p`` times the
    row's largest.

    ``batch_size`` is ``indices``' length, else the input's rows.

    Parameters
    ----------
    probs : torch.Tensor
        ``[num_rows, vocab_size]`` probabilities of any positive scale (a row need not sum to 1;
        entries <= 0 are never drawn): float32, or float16/bfloat16 (converted to float32); last
        dimension contiguous.
    min_p : float or torch.Tensor
        A float in [0, 1] for every row, or float32 ``[batch_size]``, one a row.
    indices : Optional[torch.Tensor]
        int32 or int64 ``[batch_size]`` on the GPU: output row ``i`` draws from input row
        ``indices[i]`` (rows may repeat); None: one output row per input row.
    deterministic : bool
        Accepted for FlashInfer's API: draws are reproducible whatever it says.
    generator : Optional[torch.Generator]
        The CUDA generator that gives the seed and offset when ``seed`` and ``offset`` are not
        both set; each call advances its offset. None: the device's default generator.
    check_nan : bool
        Raise ValueError when the input holds a NaN (reads it on the host: a synchronization).
    seed, offset : Optional[Union[int, torch.Tensor]]
        The Philox key and counter offset, used when both are set: Python ints, or int64 GPU
        tensors of 1 or ``batch_size`` elements that the kernel reads when it runs (so a CUDA graph
        draws anew on each replay once they change). The same input, seed and offset give the
        same tokens.
    return_valid : bool
        Also return ``valid``.

    Returns
    -------
    torch.Tensor or Tuple[torch.Tensor, torch.Tensor]
        ``tokens``, ``[batch_size]`` token ids: int32, or ``indices``' dtype when given. With
        ``return_valid``, ``(tokens, valid)``, ``valid`` bool ``[batch_size]``: False for a row with
        nothing to draw (its token 0) or an index outside the input (its token -1).
    """
    if not skip_check:
        _check_fraction(min_p, "min_p", low_open=False)
        _check_random(deterministic, generator, check_nan, seed, offset, return_valid)

    return _draw(_sample, probs, "min_p", None, None, min_p, indices, generator, check_nan, seed, offset,
                 return_valid)


@aotinfer_api(trace=top_k_top_p_sampling_trace)
def top_k_top_p_sampling_from_probs(probs: torch.Tensor, top_k: Union[torch.Tensor, int],
                                    top_p: Union[torch.Tensor, float], indices: Optional[torch.Tensor] = None,
                                    filter_apply_order: str = "top_k_first", deterministic: bool = True,
                                    generator: Optional[torch.Generator] = None, check_nan: bool = False,
                                    seed: Optional[Union[int, torch.Tensor]] = None,
                                    offset: Optional[Union[int, torch.Tensor]] = None,
                                    return_valid: bool = False, *,
                                    skip_check: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Top-k and top-p sampling in one kernel.

    ``batch_size`` is ``indices``' length, else the input's rows.

    Parameters
    ----------
    probs : torch.Tensor
        ``[num_rows, vocab_size]`` probabilities of any positive scale (a row need not sum to 1;
        entries <= 0 are never drawn): float32, or float16/bfloat16 (converted to float32); last
        dimension contiguous.
    top_k : int or torch.Tensor
        An int >= 1 for every row, or int32 ``[batch_size]``, one a row (<= 0 keeps the row).
    top_p : float or torch.Tensor
        A float in (0, 1] for every row, or float32 ``[batch_size]``, one a row (1 keeps the row).
    filter_apply_order : str
        ``"top_k_first"``: top-p over the renormalized top-k set; ``"joint"``: both filters over
        the original row, a token kept where both keep it.
    indices : Optional[torch.Tensor]
        int32 or int64 ``[batch_size]`` on the GPU: output row ``i`` draws from input row
        ``indices[i]`` (rows may repeat); None: one output row per input row.
    deterministic : bool
        Accepted for FlashInfer's API: draws are reproducible whatever it says.
    generator : Optional[torch.Generator]
        The CUDA generator that gives the seed and offset when ``seed`` and ``offset`` are not
        both set; each call advances its offset. None: the device's default generator.
    check_nan : bool
        Raise ValueError when the input holds a NaN (reads it on the host: a synchronization).
    seed, offset : Optional[Union[int, torch.Tensor]]
        The Philox key and counter offset, used when both are set: Python ints, or int64 GPU
        tensors of 1 or ``batch_size`` elements that the kernel reads when it runs (so a CUDA graph
        draws anew on each replay once they change). The same input, seed and offset give the
        same tokens.
    return_valid : bool
        Also return ``valid``.

    Returns
    -------
    torch.Tensor or Tuple[torch.Tensor, torch.Tensor]
        ``tokens``, ``[batch_size]`` token ids: int32, or ``indices``' dtype when given. With
        ``return_valid``, ``(tokens, valid)``, ``valid`` bool ``[batch_size]``: False for a row with
        nothing to draw (its token 0) or an index outside the input (its token -1).
    """
    if not skip_check:
        _check_top_k_top_p(top_k, top_p, filter_apply_order)
        _check_random(deterministic, generator, check_nan, seed, offset, return_valid)

    return _draw(_sample, probs, filter_apply_order, top_k, top_p, None, indices, generator,
                 check_nan, seed, offset, return_valid)


@aotinfer_api(trace=top_k_top_p_sampling_from_logits_trace)
def top_k_top_p_sampling_from_logits(logits: torch.Tensor, top_k: Union[torch.Tensor, int],
                                     top_p: Union[torch.Tensor, float], indices: Optional[torch.Tensor] = None,
                                     filter_apply_order: str = "top_k_first", deterministic: bool = True,
                                     generator: Optional[torch.Generator] = None, check_nan: bool = False,
                                     seed: Optional[Union[int, torch.Tensor]] = None,
                                     offset: Optional[Union[int, torch.Tensor]] = None,
                                     return_valid: bool = False, *,
                                     skip_check: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """``top_k_top_p_sampling_from_probs(softmax(logits))``. Top-k first over the softmax is top-k
    over the logits, softmax, then top-p, as FlashInfer does it.

    Top-k first on float32 rows of at least 16384 logits (16-byte aligned) runs in one kernel, from
    the logits: its floor gathers the top logits in one pass and their softmax among themselves is
    the top-k set's distribution (rows where top-k keeps the whole row, or the floor misses, take
    their probabilities inside the kernel). Elsewhere: the softmax kernel, then the probabilities'
    sampler.

    ``batch_size`` is ``indices``' length, else the input's rows.

    Parameters
    ----------
    logits : torch.Tensor
        ``[num_rows, vocab_size]``: float32, or float16/bfloat16 (converted to float32); last
        dimension contiguous.
    top_k : int or torch.Tensor
        An int >= 1 for every row, or int32 ``[batch_size]``, one a row (<= 0 keeps the row).
    top_p : float or torch.Tensor
        A float in (0, 1] for every row, or float32 ``[batch_size]``, one a row (1 keeps the row).
    filter_apply_order : str
        ``"top_k_first"``: top-p over the renormalized top-k set; ``"joint"``: both filters over
        the original row, a token kept where both keep it.
    indices : Optional[torch.Tensor]
        int32 or int64 ``[batch_size]`` on the GPU: output row ``i`` draws from input row
        ``indices[i]`` (rows may repeat); None: one output row per input row.
    deterministic : bool
        Accepted for FlashInfer's API: draws are reproducible whatever it says.
    generator : Optional[torch.Generator]
        The CUDA generator that gives the seed and offset when ``seed`` and ``offset`` are not
        both set; each call advances its offset. None: the device's default generator.
    check_nan : bool
        Raise ValueError when the input holds a NaN (reads it on the host: a synchronization).
    seed, offset : Optional[Union[int, torch.Tensor]]
        The Philox key and counter offset, used when both are set: Python ints, or int64 GPU
        tensors of 1 or ``batch_size`` elements that the kernel reads when it runs (so a CUDA graph
        draws anew on each replay once they change). The same input, seed and offset give the
        same tokens.
    return_valid : bool
        Also return ``valid``.

    Returns
    -------
    torch.Tensor or Tuple[torch.Tensor, torch.Tensor]
        ``tokens``, ``[batch_size]`` token ids: int32, or ``indices``' dtype when given. With
        ``return_valid``, ``(tokens, valid)``, ``valid`` bool ``[batch_size]``: False for a row with
        nothing to draw (its token 0) or an index outside the input (its token -1).
    """
    if not skip_check:
        _check_top_k_top_p(top_k, top_p, filter_apply_order)
        _check_random(deterministic, generator, check_nan, seed, offset, return_valid)

    return _draw(_sample, logits, filter_apply_order, top_k, top_p, None, indices, generator, check_nan,
                 seed, offset, return_valid, from_logits=True)


@aotinfer_api(trace=top_p_renorm_probs_trace)
def top_p_renorm_probs(probs: torch.Tensor, top_p: Union[torch.Tensor, float], *, skip_check: bool = False) -> torch.Tensor:
    """Zero the probabilities outside each row's top-p set and divide the rest by their sum.

    probs : float32 ``[batch_size, vocab_size]`` (float16/bfloat16 converted to float32). top_p : a
    float in (0, 1] for every row, or float32 ``[batch_size]``, one a row. Returns float32
    ``[batch_size, vocab_size]``.
    """
    if not skip_check:
        _check_fraction(top_p, "top_p", low_open=True)

    import torch

    check_tensor(probs, "probs")
    if probs.dtype in (torch.float16, torch.bfloat16):
        probs = probs.float()
    out = torch.empty_like(probs)
    top_p, top_p_val = _per_row(top_p, torch.float32, -1.0, probs.new_empty(0))
    _renorm(out, probs, top_p, top_p, "top_p", 0, top_p_val, -1)
    return out


@aotinfer_api(trace=top_k_renorm_probs_trace)
def top_k_renorm_probs(probs: torch.Tensor, top_k: Union[torch.Tensor, int], *, skip_check: bool = False) -> torch.Tensor:
    """Zero all but the ``top_k`` largest probabilities of each row (ties with the k-th kept) and
    divide the rest by their sum.

    probs : float32, float16 or bfloat16 ``[batch_size, vocab_size]``. top_k : an int >= 1 for every
    row, or int32 ``[batch_size]``, one a row (<= 0 keeps the row). Returns probs' dtype and shape (the sums in float32).
    """
    if not skip_check:
        _check_top_k(top_k)

    import torch

    check_tensor(probs, "probs")
    out = torch.empty_like(probs)
    top_k, top_k_val = _per_row(top_k, torch.int32, -1, probs.new_empty(0))
    _renorm(out, probs, top_k, top_k, "top_k", top_k_val, 1.0, -1)
    return out


@aotinfer_api(trace=top_k_mask_logits_trace)
def top_k_mask_logits(logits: torch.Tensor, top_k: Union[torch.Tensor, int], *, skip_check: bool = False) -> torch.Tensor:
    """Set all but the ``top_k`` largest logits of each row to -inf (ties with the k-th kept).

    logits : float32, float16 or bfloat16 ``[batch_size, vocab_size]``. top_k : an int >= 1 for
    every row, or int32 ``[batch_size]``, one a row (<= 0 keeps the row). Returns logits' dtype and shape.
    """
    if not skip_check:
        _check_top_k(top_k)

    import torch

    check_tensor(logits, "logits")
    out = torch.empty_like(logits)
    top_k, top_k_val = _per_row(top_k, torch.int32, -1, logits.new_empty(0))
    _top_k_mask_logits(out, logits, top_k, top_k_val, -1)
    return out


@aotinfer_api(trace=softmax_trace)
def softmax(logits: torch.Tensor, temperature: Optional[Union[torch.Tensor, float]] = None,
            enable_pdl: Optional[bool] = None, *, skip_check: bool = False) -> torch.Tensor:
    """``softmax(logits / temperature)`` over each row, in float32 (one pass for the running max and
    sum, one that writes).

    logits : float32, float16 or bfloat16 ``[batch_size, vocab_size]``. temperature : None (1), a
    positive float for every row, or float32 ``[batch_size]``, one a row. enable_pdl : programmatic
    dependent launch; None where the GPU supports it. Returns float32 ``[batch_size, vocab_size]``.
    """
    if not skip_check:
        _check_temperature(temperature)
        check_enable_pdl(enable_pdl)

    import torch

    check_tensor(logits, "logits")
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    temperature, temperature_val = _per_row(1.0 if temperature is None else temperature, torch.float32, -1.0,
                                            out.new_empty(0))
    _softmax(out, logits, temperature, temperature_val, -1 if enable_pdl is None else enable_pdl)
    return out


@aotinfer_api(trace=chain_speculative_sampling_trace)
def chain_speculative_sampling(draft_probs: torch.Tensor, draft_token_ids: torch.Tensor, target_probs: torch.Tensor,
                               maybe_output_accepted_token_num: Optional[torch.Tensor] = None,
                               maybe_output_emitted_draft_token_num: Optional[torch.Tensor] = None,
                               deterministic: bool = True, generator: Optional[torch.Generator] = None,
                               seed: Optional[Union[int, torch.Tensor]] = None,
                               offset: Optional[Union[int, torch.Tensor]] = None, *,
                               skip_check: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Speculative sampling of a chain of draft tokens per request (FlashInfer's semantics).

    Draft token ``i`` of a request is accepted while ``u_i * draft_probs[i, d_i] <
    target_probs[i, d_i]`` (``u_i`` uniform in (0, 1)); the first rejected position draws from
    ``max(0, target_probs[i] - draft_probs[i])`` normalized, and where every draft token is accepted
    the bonus position draws from ``target_probs[n]``. The emitted tokens then follow the target
    model's distribution.

    Parameters
    ----------
    draft_probs : torch.Tensor
        float32 ``[batch_size, n, vocab_size]``: the draft model's distribution at each position.
    draft_token_ids : torch.Tensor
        int32 or int64 ``[batch_size, n]``: the draft tokens (one outside the vocabulary is rejected).
    target_probs : torch.Tensor
        float32 ``[batch_size, n + 1, vocab_size]``: the target model's distributions, one more
        position than the draft (the bonus token's).
    maybe_output_accepted_token_num, maybe_output_emitted_draft_token_num : Optional[torch.Tensor]
        int32 ``[batch_size]`` counters, added to in place (new zeros when None): the draft tokens
        whose test passes, each position tested on its own (how well the models agree), and the
        draft tokens emitted (the accepted prefix; the bonus or resampled token is not counted).
    deterministic : bool
        Accepted for FlashInfer's API: the same inputs, seed and offset always give the same tokens.
    generator, seed, offset
        As the other samplers: ``seed`` and ``offset`` Python ints or int64 tensors of 1 or
        ``batch_size`` elements read when the kernel runs (CUDA-graph replays draw anew), else the
        generator's, whose offset is advanced.

    Returns
    -------
    Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
        ``output_token_ids`` int32 ``[batch_size, n + 1]`` (the accepted draft tokens, the drawn
        token, then -1), and the two counters.
    """
    if not skip_check:
        _check_random(deterministic, generator, False, seed, offset, False)

    import torch

    check_tensor(draft_probs, "draft_probs")
    shape = list(draft_probs.shape) + [0] * max(0, 3 - draft_probs.dim())  # (a wrong rank: the binding names it)
    device = draft_probs.device
    out = torch.empty(shape[0], shape[1] + 1, dtype=torch.int32, device=device)
    accepted = maybe_output_accepted_token_num
    if accepted is None:
        accepted = torch.zeros(shape[0], dtype=torch.int32, device=device)
    emitted = maybe_output_emitted_draft_token_num
    if emitted is None:
        emitted = torch.zeros(shape[0], dtype=torch.int32, device=device)
    none = torch.empty(0, dtype=torch.int64, device=device)
    seed, seed_val, offset, offset_val = _random_arguments(device, generator, seed, offset, none)
    _chain_speculative_sampling(out, accepted, emitted, draft_probs, draft_token_ids, target_probs, seed, offset,
                                seed_val, offset_val, -1)
    return out, accepted, emitted
