"""What the attention wrappers share: decode (decode.py), prefill (prefill.py) and the cascade
(cascade.py), each with FlashInfer's API.

- FlashInfer's option names (KV layouts, backends, position encodings, dtypes) and the checks of
  what the bindings cannot name;
- the split-KV chunks both partitions cut requests into;
- the device facts a plan reads (SMs, L2), and what it assumes for a workspace on the CPU;
- the paged KV cache's forms (``unpack_kv_cache``);
- ``AttentionWrapper``, the base of the wrappers: the workspaces, the CUDA-graph buffers, the
  attention options (set by ``plan``, replaced by the deprecated ``forward``), ``sm_scale`` with its
  calibration scales, the paged cache checked against the plan, and FlashInfer's older forms.
"""

from __future__ import annotations

import math

from . import _loader
from ._workspace import INT_WORKSPACE_BYTES, AttentionWorkspace, check_workspace
from .trace.template import dtype_name
from .utils import check_int, check_real, check_tensor

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Optional, Tuple

    import torch

HEAD_DIMS = (64, 128, 256)  # the head dims the kernels are built for
KV_LAYOUTS = {"NHD": 0, "HND": 1}
POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")  # FlashInfer's; ALIBI is not implemented
BACKENDS = ("auto", "fa2", "fa3", "trtllm-gen", "cute-dsl")  # FlashInfer's names (prefill: fa3 is Hopper's kernel)
Q_DTYPES = ("float16", "bfloat16")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
CPU_SMS = 132  # what plan assumes for a workspace on the CPU (tests of the plan: no kernel runs there)
# Split-KV chunks are multiples of 64 tokens (and of the page size where that stays under 4096
# tokens, so that chunks end on page boundaries), at least 128 tokens (two of the decode kernel's
# tiles): a block's time is mostly the latency of its first tiles, so short requests gain from
# more, shorter chunks (docs/design/decode.md#split-kv-and-merge).
_CHUNK_UNIT = 64
_MAX_CHUNK_UNIT = 4096
MIN_CHUNK = 128


# ---- argument checks (what the binding cannot name) --------------------------------------------


def check_backend(backend: Any) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"Expected backend to be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")


def check_kv_layout(kv_layout: Any) -> None:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"Expected kv_layout to be 'NHD' or 'HND', got {kv_layout!r}")


# The binding's pos_encoding_mode: "ROPE_LLAMA" turns q and k inside the kernel (attention.cuh,
# RopeRowsInPlace), at FlashInfer's defaults where rope_scale / rope_theta are None.
POS_ENCODING_CODES = {"NONE": 0, "ROPE_LLAMA": 1}
DEFAULT_ROPE_SCALE, DEFAULT_ROPE_THETA = 1.0, 1e4


def check_pos_encoding_mode(pos_encoding_mode: Any) -> None:
    if pos_encoding_mode in POS_ENCODING_CODES:
        return
    if pos_encoding_mode in POS_ENCODING_MODES:
        raise NotImplementedError(
            f"pos_encoding_mode={pos_encoding_mode!r} is not implemented: supported are 'NONE' and 'ROPE_LLAMA' "
            "(apply ALiBi's bias outside attention, or use a custom mask)"
        )
    raise ValueError(f"Expected pos_encoding_mode to be one of {', '.join(map(repr, POS_ENCODING_MODES))}, got {pos_encoding_mode!r}")


def check_rope_options(pos_encoding_mode: Any, rope_scale: Any, rope_theta: Any) -> None:
    if pos_encoding_mode != "ROPE_LLAMA":
        return
    for value, name in ((rope_scale, "rope_scale"), (rope_theta, "rope_theta")):
        if value is not None and not 0.0 < value < float("inf"):
            raise ValueError(f"Expected {name} to be None or positive and finite with pos_encoding_mode='ROPE_LLAMA', got {value}")


def rope_arguments(pos_encoding_mode: str, rope_scale: Optional[float], rope_theta: Optional[float]) -> Tuple[int, float, float]:
    """The binding's (pos_encoding_mode, rope_scale, rope_theta) for checked options."""
    return (POS_ENCODING_CODES[pos_encoding_mode], DEFAULT_ROPE_SCALE if rope_scale is None else float(rope_scale),
            DEFAULT_ROPE_THETA if rope_theta is None else float(rope_theta))  # fmt: skip


def check_rope_supported(pos_encoding_mode: str, q_dtype: Any, kv_dtype: Any, head_dim: int, head_dim_vo: int) -> None:
    """What RoPE inside the kernel takes: a cache of q's dtype, one head dim."""
    if pos_encoding_mode != "ROPE_LLAMA":
        return
    if kv_dtype != q_dtype:
        raise NotImplementedError(
            f"pos_encoding_mode='ROPE_LLAMA' with a {dtype_name(kv_dtype)} KV cache is not implemented: apply RoPE "
            "before attention (aotinfer.apply_rope_pos_ids) and pass 'NONE', or keep K and V in q's dtype"
        )
    if head_dim != head_dim_vo:
        raise NotImplementedError(
            f"pos_encoding_mode='ROPE_LLAMA' with head_dim_qk {head_dim} and head_dim_vo {head_dim_vo} is not "
            "implemented: apply RoPE before attention and pass 'NONE'"
        )


def check_window_left(window_left: Any) -> None:
    check_int(window_left, "window_left", -1)


def check_soft_cap(logits_soft_cap: Any) -> None:
    if logits_soft_cap is not None:
        check_real(logits_soft_cap, "logits_soft_cap")
        if not 0.0 <= logits_soft_cap < float("inf"):
            raise ValueError(f"Expected logits_soft_cap to be None, 0 (off) or positive, got {logits_soft_cap}")


def check_optional_reals(**values: Any) -> None:
    for name, value in values.items():
        if value is not None:
            check_real(value, name)


def check_options(pos_encoding_mode: Any, window_left: Any, logits_soft_cap: Any, sm_scale: Any, rope_scale: Any,
                  rope_theta: Any) -> None:  # fmt: skip
    """The attention options plan and forward take alike."""
    check_pos_encoding_mode(pos_encoding_mode)
    check_window_left(window_left)
    check_soft_cap(logits_soft_cap)
    check_optional_reals(sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta)
    check_rope_options(pos_encoding_mode, rope_scale, rope_theta)


def fixed_split(fixed_split_size: Any) -> Optional[int]:
    """plan's ``fixed_split_size`` checked, as the partitions take it: None (the plan splits) for
    None or a value <= 0, as FlashInfer reads it (vLLM passes -1 outside its batch-invariant mode),
    else the fixed chunk in pages (tokens for ragged KV)."""
    if fixed_split_size is None:
        return None
    check_int(fixed_split_size, "fixed_split_size", -(2**31))
    return fixed_split_size if fixed_split_size > 0 else None


def check_head_dim(head_dim: Any) -> None:
    check_int(head_dim, "head_dim", 1)
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported: supported head dims are {', '.join(map(str, HEAD_DIMS))}")


def check_heads(num_qo_heads: Any, num_kv_heads: Any) -> None:
    check_int(num_qo_heads, "num_qo_heads", 1)
    check_int(num_kv_heads, "num_kv_heads", 1)
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"Expected num_qo_heads ({num_qo_heads}) to be a multiple of num_kv_heads ({num_kv_heads})")


def check_int32(tensor: Any, name: str) -> None:
    import torch

    check_tensor(tensor, name)
    if tensor.dtype != torch.int32:
        raise TypeError(f"Expected {name} to have dtype int32, got {str(tensor.dtype).replace('torch.', '')}")
    if tensor.dim() != 1:
        raise ValueError(f"Expected {name} to be 1-D, got shape {list(tensor.shape)}")


def as_dtype(value: Any, name: str) -> "torch.dtype":
    """A torch dtype from a dtype or its name, as FlashInfer's canonicalize_torch_dtype."""
    import torch

    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
        return getattr(torch, value)
    raise TypeError(f"Expected {name} to be a torch.dtype or its name, got {value!r}")


def check_dtypes(q_data_type: Any, kv_data_type: Any, o_data_type: Any, fp8_kv: bool) -> Tuple["torch.dtype", "torch.dtype"]:
    """(q's dtype, K's and V's) from plan's arguments: q float16 (the default) or bfloat16; K and V
    q's, or fp8 where ``fp8_kv`` (a paged cache); the output q's."""
    q_dtype = as_dtype("float16" if q_data_type is None else q_data_type, "q_data_type")
    if dtype_name(q_dtype) not in Q_DTYPES:
        raise ValueError(f"Expected q_data_type to be float16 or bfloat16, got {dtype_name(q_dtype)}")
    kv_dtype = q_dtype if kv_data_type is None else as_dtype(kv_data_type, "kv_data_type")
    if kv_dtype != q_dtype:
        if dtype_name(kv_dtype) in FP8_DTYPES and not fp8_kv:
            raise NotImplementedError(
                f"kv_data_type={dtype_name(kv_dtype)} is not implemented here: fp8 K and V are read from a paged "
                "cache (BatchPrefillWithPagedKVCacheWrapper, BatchDecodeWithPagedKVCacheWrapper)"
            )
        if dtype_name(kv_dtype) not in FP8_DTYPES:
            fp8 = ", float8_e4m3fn or float8_e5m2" if fp8_kv else ""
            raise ValueError(f"Expected kv_data_type to be q_data_type ({dtype_name(q_dtype)}){fp8}, got {dtype_name(kv_dtype)}")
    if o_data_type is not None and as_dtype(o_data_type, "o_data_type") != q_dtype:
        raise NotImplementedError(
            f"o_data_type={dtype_name(as_dtype(o_data_type, 'o_data_type'))} is not implemented: the output has q's "
            f"dtype ({dtype_name(q_dtype)})"
        )
    return q_dtype, kv_dtype


# ---- split-KV chunks ------------------------------------------------------------------------------


def chunk_unit(page_size: int) -> int:
    """Chunk sizes are multiples of this: 64 tokens and whole pages where that stays small."""
    unit = math.lcm(_CHUNK_UNIT, page_size)
    return unit if unit <= _MAX_CHUNK_UNIT else _CHUNK_UNIT


def num_chunks(lo: int, hi: int, chunk: int) -> int:
    """Chunks of ``chunk`` tokens, aligned to multiples of ``chunk`` from position 0, that cover
    positions [lo, hi); one (empty) item for an empty range, one item for chunk 0 (no split)."""
    return (hi - 1) // chunk - lo // chunk + 1 if chunk > 0 and hi > lo else 1


def smallest_chunk(longest: int, end: int, max_items: int, page_size: int, count: Callable[[int], int]) -> int:
    """The smallest chunk size (a multiple of chunk_unit(page_size), at least MIN_CHUNK tokens)
    whose partition has at most ``max_items`` items, ``count(chunk)`` being its number of items; 0
    (no split) when no request attends more than MIN_CHUNK positions (``longest``: the most any attends).
    ``end``: the last position any request attends, plus one. Assumes one item a request fits."""
    unit = chunk_unit(page_size)
    if longest <= MIN_CHUNK:
        return 0
    # Binary search for the smallest k (chunk = k * unit) that fits. k_hi fits (a chunk as long
    # as every sequence: one a request), so the answer always fits, even where the count is not
    # monotonic in k (chunks are aligned to their size).
    k_lo, k_hi = -(-MIN_CHUNK // unit), max(-(-end // unit), 1)
    while k_lo < k_hi:
        mid = (k_lo + k_hi) // 2
        if count(mid * unit) <= max_items:
            k_hi = mid
        else:
            k_lo = mid + 1
    return k_hi * unit


# ---- device facts ---------------------------------------------------------------------------------


def device_property(device: "torch.device", name: str, cpu_value: int) -> int:
    """A field of the device's ``torch.cuda.get_device_properties`` (the loader's, read once a
    device), or ``cpu_value`` for a workspace on the CPU or a tracer's fake CUDA tensors where torch
    has no CUDA (asked only before the device's first answer: plans call this every step)."""
    if device.type != "cuda":
        return cpu_value
    import torch

    if device.index not in _loader._properties and not torch.cuda.is_available():
        return cpu_value

    index = device.index if device.index is not None else torch.cuda.current_device()
    return getattr(_loader.device_properties(index), name)


def last_page_len_of(kv_len: "torch.Tensor", page_size: int) -> "torch.Tensor":
    """int32 tokens in each request's last page, for KV lengths ``kv_len`` (0 where a request has
    none): what FlashInfer's planners, given lengths, leave the wrappers to derive."""
    import torch

    return torch.where(kv_len > 0, (kv_len - 1) % page_size + 1, 0).to(torch.int32)


_host_bindings: dict = {}  # (module, function, device index) -> the tvm-ffi function


def host_binding(module: str, function: str, device: "torch.device") -> Any:
    """A binding that runs on the host (a plan's tables), from the build of ``module`` that the
    device's kernels use (a CPU workspace: any build), found once."""
    index = device.index if device.type == "cuda" else -1
    key = (module, function, index)
    binding = _host_bindings.get(key)
    if binding is None:
        binding = _host_bindings[key] = getattr(_loader.get_module(module, index), function)
    return binding


def num_sms(device: "torch.device") -> int:
    return device_property(device, "multi_processor_count", CPU_SMS)


# ---- the KV cache ------------------------------------------------------------------------------


def _expand_4d(cache: Any, kv_layout: str, name: str) -> "torch.Tensor":
    """One of K or V as ``[pages, page_size, heads, dim]`` (NHD) or ``[pages, heads, page_size,
    dim]`` (HND); a 3-D tensor is pages of one token (page_size 1), as FlashInfer reads it."""
    check_tensor(cache, name)
    if cache.dim() == 3:
        return cache.unsqueeze(-3 if kv_layout == "NHD" else -2)
    if cache.dim() != 4:
        raise ValueError(f"Expected {name} to have 3 or 4 dimensions, got shape {list(cache.shape)}")
    return cache


def unpack_kv_cache(paged_kv_cache: Any, kv_layout: str) -> Tuple["torch.Tensor", "torch.Tensor"]:
    """(k_cache, v_cache) 4-D views of a ``(k, v)`` tuple of 3-D or 4-D tensors, or of one 5-D
    tensor ``[pages, 2, ...]`` (4-D: page_size 1) holding K at ``[:, 0]`` and V at ``[:, 1]``."""
    import torch

    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"Expected paged_kv_cache to be a (k_cache, v_cache) pair, got {len(paged_kv_cache)} tensors")
        return (
            _expand_4d(paged_kv_cache[0], kv_layout, "paged_kv_cache[0] (k_cache)"),
            _expand_4d(paged_kv_cache[1], kv_layout, "paged_kv_cache[1] (v_cache)"),
        )
    if not isinstance(paged_kv_cache, torch.Tensor):
        raise TypeError(f"Expected paged_kv_cache to be a torch.Tensor or a (k_cache, v_cache) tuple, got {type(paged_kv_cache).__name__}")
    cache = paged_kv_cache
    if cache.dim() == 4:
        cache = cache.unsqueeze(-3 if kv_layout == "NHD" else -2)
    if cache.dim() != 5 or cache.shape[1] != 2:
        page = "page_size, num_kv_heads, head_dim" if kv_layout == "NHD" else "num_kv_heads, page_size, head_dim"
        raise ValueError(
            f"Expected paged_kv_cache to have shape [pages, 2, {page}] ({kv_layout}), or [pages, 2, num_kv_heads, "
            f"head_dim] for page_size 1, got {list(paged_kv_cache.shape)}"
        )
    return cache.select(1, 0), cache.select(1, 1)


# ---- the wrappers' base --------------------------------------------------------------------------


class AttentionWrapper(AttentionWorkspace):
    """What every attention wrapper holds and does alike (see the module doc); ``run`` and ``plan``
    are each wrapper's own."""

    def _init_wrapper(self, float_workspace_buffer: Any, kv_layout: Any, use_cuda_graph: Any, backend: Any) -> None:
        import ctypes  # here, not at import: it costs `import aotinfer` about 4 ms

        import torch

        check_kv_layout(kv_layout)
        check_backend(backend)
        self._kv_layout = kv_layout
        self._kv_layout_code = KV_LAYOUTS[kv_layout]
        self._backend = backend
        self._use_cuda_graph = bool(use_cuda_graph)
        check_workspace(float_workspace_buffer, "float_workspace_buffer")
        self.device = float_workspace_buffer.device
        self._set_workspaces(float_workspace_buffer, torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device))
        self._fixed_batch_size = 0
        # The attention options run uses: set by plan, replaced by forward (as FlashInfer's).
        self._causal = False
        self._pos_encoding_mode = "NONE"
        self._window_left = -1
        self._logits_soft_cap: Optional[float] = None
        self._sm_scale: Optional[float] = None
        self._rope_scale: Optional[float] = None
        self._rope_theta: Optional[float] = None
        self._rope_arguments = rope_arguments("NONE", None, None)  # the binding's, from the three above
        self._plan: Any = None
        # run's `captured`: the address of a host byte the binding sets where a run is captured
        # into a CUDA graph (a wrapper without use_cuda_graph, whose next plan would change the
        # tables under the captured grid); 0 for a wrapper that keeps its grid.
        self._captured = torch.zeros(1, dtype=torch.uint8)  # owns the byte
        self._captured_address = 0 if self._use_cuda_graph else self._captured.data_ptr()
        self._captured_byte = ctypes.c_uint8.from_address(self._captured.data_ptr())

    def _check_not_captured(self) -> None:
        """Refuse a new plan once a run under the current one was captured (see _init_wrapper): the
        graph's replays would run the old plan's grid over the new plan's tables."""
        if self._captured_byte.value:
            raise RuntimeError(
                f"{type(self).__name__}.plan: a run of this wrapper was captured into a CUDA graph, and its replays "
                "launch the grid of the plan it was captured under: a new plan would have them read other tables. "
                "Capture runs of a wrapper made with use_cuda_graph=True (and its buffers) to plan between replays, "
                "or plan on a new wrapper."
            )

    def _fix_batch_size(self, buffers: dict, batch_from: str) -> None:
        """Check use_cuda_graph's buffers (name -> tensor): int32, 1-D, on the workspace's device.
        ``batch_from`` fixes the batch size (its elements, or one fewer for an indptr); every
        indptr buffer holds batch_size + 1."""
        import torch

        for name, buffer in buffers.items():
            if not isinstance(buffer, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor when use_cuda_graph=True, got {type(buffer).__name__}")
            check_int32(buffer, name)
            if buffer.device != self.device:
                raise ValueError(f"Expected {name} on the workspace's device {self.device}, got {buffer.device}")
        self._fixed_batch_size = buffers[batch_from].numel() - ("indptr" in batch_from)
        for name, buffer in buffers.items():
            if "indptr" in name and buffer.numel() != self._fixed_batch_size + 1:
                raise ValueError(
                    f"Expected {name} to have batch_size + 1 = {self._fixed_batch_size + 1} elements (batch_size from "
                    f"{batch_from}), got {buffer.numel()}"
                )

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def _set_options(self, pos_encoding_mode: Any, window_left: Any, logits_soft_cap: Any, sm_scale: Any,
                     rope_scale: Any, rope_theta: Any) -> None:  # fmt: skip
        """The deprecated forward's options: checked, then kept from now on."""
        check_options(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)
        self._keep_options(pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta)

    def _keep_options(self, pos_encoding_mode: Any, window_left: Any, logits_soft_cap: Any, sm_scale: Any,
                      rope_scale: Any, rope_theta: Any) -> None:  # fmt: skip
        """Keep checked options (plan's, last, so that a plan that raises leaves the wrapper as it was).
        Servers read them back (vLLM asserts ``_sm_scale``, ``_window_left`` and ``_logits_soft_cap``
        against its layers'): plan passes sm_scale resolved, as FlashInfer's does."""
        self._pos_encoding_mode = pos_encoding_mode
        self._window_left = window_left
        self._logits_soft_cap = 0.0 if logits_soft_cap is None else logits_soft_cap  # as FlashInfer keeps it
        self._sm_scale = sm_scale
        self._rope_scale = rope_scale
        self._rope_theta = rope_theta
        self._rope_arguments = rope_arguments(pos_encoding_mode, rope_scale, rope_theta)

    def _sm_scale_for(self, head_dim: int, *scales: Optional[float]) -> float:
        """The kept sm_scale (1/sqrt(head_dim) where None), times the calibration scales given."""
        sm_scale = self._sm_scale if self._sm_scale is not None else 1.0 / math.sqrt(head_dim)
        for scale in scales:
            if scale is not None:
                sm_scale *= scale
        return sm_scale

    def _paged_cache(self, paged_kv_cache: Any, plan: Any) -> Tuple["torch.Tensor", "torch.Tensor"]:
        """(k_cache, v_cache) of run's paged_kv_cache, checked against the plan: its kv dtype, and
        its page size, from which the kernels find a request's pages (another would read past them)."""
        k_cache, v_cache = unpack_kv_cache(paged_kv_cache, self._kv_layout)
        if k_cache.dtype != plan.kv_dtype:
            raise ValueError(f"The dtype of k {k_cache.dtype} does not match the kv_data_type {plan.kv_dtype} specified in plan")
        page_size = k_cache.shape[1 if self._kv_layout_code == 0 else 2]
        if page_size != plan.page_size:
            raise ValueError(f"Expected paged_kv_cache with the planned page_size {plan.page_size}, got {page_size}")
        return k_cache, v_cache

    def run_return_lse(self, *args: Any, **kwargs: Any) -> Tuple["torch.Tensor", "torch.Tensor"]:
        r"""``run(..., return_lse=True)``: ``(out, lse)``."""
        return self.run(*args, return_lse=True, **kwargs)

    def end_forward(self) -> None:
        r"""Deprecated and does nothing (FlashInfer's)."""
