"""The workspaces of the attention wrappers (decode, prefill): where ``plan`` writes its int32 work
tables for ``run``'s kernels, and where split sequences keep their float32 partial results.

Two buffers, as in FlashInfer: the caller's float workspace (partial outputs and log-sum-exps)
and an int workspace of ``INT_WORKSPACE_BYTES`` on the same GPU (the tables). ``plan`` builds the
tables on the host and copies them in one transfer from a pinned staging buffer, in two halves
used in turn, so that a plan never overwrites the half whose copy of the plan before may still be
in flight.
"""

from __future__ import annotations

import math

from .utils import check_tensor

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, List, Optional, Sequence, Tuple

    import torch

INT_WORKSPACE_BYTES = 8 << 20  # FlashInfer's size
ALIGN = 16
# Views of the workspaces kept for reuse, per kind: a plan makes its views once per layout (a
# serving loop without CUDA graphs meets a new batch size most steps; the views are small).
_VIEWS_KEPT = 256


def check_workspace(buffer: Any, name: str) -> None:
    check_tensor(buffer, name)
    if not buffer.is_contiguous():
        raise ValueError(f"Expected {name} to be contiguous")
    if buffer.numel() and buffer.data_ptr() % ALIGN:
        raise ValueError(f"{name} must be {ALIGN}-byte aligned, got data_ptr % {ALIGN} = {buffer.data_ptr() % ALIGN}")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class AttentionWorkspace:
    """The workspace side of a plan/run wrapper; the wrapper sets ``self.device`` and calls
    ``_set_workspaces`` from its constructor."""

    device: "torch.device"

    def _set_workspaces(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer: torch.Tensor) -> None:
        import torch

        self._float_workspace_buffer = float_workspace_buffer
        self._int_workspace_buffer = int_workspace_buffer
        self._float_bytes = float_workspace_buffer.view(-1).view(torch.uint8)
        self._int_bytes = int_workspace_buffer.view(-1).view(torch.uint8)
        # The host side of the int32 tables: pinned (the copy to the GPU does not wait for it).
        pinned = self.device.type == "cuda"
        self._pin_memory_int_workspace_buffer = torch.empty(self._int_bytes.numel(), dtype=torch.uint8, pin_memory=pinned)
        self._staging_events: List[Optional[Any]] = [None, None]
        self._staging_half = 0
        half_bytes = (self._pin_memory_int_workspace_buffer.numel() // 2) // ALIGN * ALIGN
        table_bytes = self._table_bytes()
        self._staging_halves = [self._pin_memory_int_workspace_buffer[h * half_bytes : h * half_bytes + table_bytes]
                                for h in (0, 1)]
        self._table_views: dict = {}  # table layout -> views of the int workspace (_upload)
        self._partial: dict = {}  # (slots, heads, head_dim) -> views of the float workspace (_partial_views)
        self._empty: Optional[torch.Tensor] = None
        self._plan_facts = torch.empty(8, dtype=torch.int64)  # what a compiled plan reports of its tables

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer: torch.Tensor) -> None:
        r"""Use new workspace buffers from the next ``plan`` on (FlashInfer's API): the float one
        for partial results, the int one (bytes on the same GPU) for the work tables."""
        check_workspace(float_workspace_buffer, "float_workspace_buffer")
        check_workspace(int_workspace_buffer, "int_workspace_buffer")
        if int_workspace_buffer.device != float_workspace_buffer.device:
            raise ValueError(
                f"Expected int_workspace_buffer on float_workspace_buffer's device {float_workspace_buffer.device}, "
                f"got {int_workspace_buffer.device}"
            )
        self.device = float_workspace_buffer.device
        self._set_workspaces(float_workspace_buffer, int_workspace_buffer)

    def _table_bytes(self) -> int:
        """The bytes of tables one plan can write (half the staging buffer, at most the workspace)."""
        return min((self._pin_memory_int_workspace_buffer.numel() // 2) // ALIGN * ALIGN, self._int_bytes.numel())

    def _check_table_bytes(self, need: int, what: str) -> None:
        """Refuse, before any work that grows with the batch, a plan whose tables cannot fit:
        ``need`` is a lower bound on their bytes (O(1) from the sizes of the inputs)."""
        if need > self._table_bytes():
            raise ValueError(
                f"The int workspace holds {self._table_bytes()} bytes of work tables, {what} needs at least {need}: "
                "give reset_workspace_buffer a larger int_workspace_buffer"
            )

    def _require_workspace_on(self, device: "torch.device") -> None:
        """run's kernels read the workspace where q is: a workspace elsewhere (a CPU one plans
        fine) is refused before the launch, naming the device wanted."""
        if device != self.device:
            raise ValueError(
                f"float_workspace_buffer is on {self.device}, q on {device}: run needs the workspace on q's device "
                "(a contiguous buffer of 128 MB is plenty; the wrapper's plan says when more is needed)"
            )

    def _staging(self) -> torch.Tensor:
        """The pinned staging half whose copy is not in flight, ``_table_bytes()`` long: a plan
        writes its tables there, then ``_upload`` copies them to the workspace."""
        half = self._staging_half
        event = self._staging_events[half]
        if event is not None:
            event.synchronize()  # the copy of two plans ago, long done in practice
        return self._staging_halves[half]

    def _upload(self, staging: torch.Tensor, need: int, layout: Sequence[Tuple[int, tuple]],
                non_blocking: bool) -> List[torch.Tensor]:
        """Copy the first ``need`` bytes of ``staging`` (``_staging``) into the int workspace and
        return views of the int32 tables there, given as (byte offset, shape); the views of a
        layout are made once (a CUDA-graph wrapper's layout never changes)."""
        import torch

        half = self._staging_half
        self._staging_half ^= 1
        self._int_bytes[:need].copy_(staging[:need], non_blocking=non_blocking)
        if self.device.type == "cuda" and non_blocking:
            event = self._staging_events[half]
            if event is None:
                event = self._staging_events[half] = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        key = tuple(layout)
        views = self._table_views.get(key)
        if views is None:
            if len(self._table_views) >= _VIEWS_KEPT:
                self._table_views.clear()
            views = self._table_views[key] = [
                self._int_bytes[offset : offset + math.prod(shape) * 4].view(torch.int32).view(shape)
                for offset, shape in layout
            ]
        return views

    def _empty_tensor(self) -> torch.Tensor:
        """A float32 tensor of no elements on the workspace's device: what a binding gets for an
        output or input left out (made once a workspace)."""
        import torch

        if self._empty is None:
            self._empty = torch.empty(0, dtype=torch.float32, device=self.device)
        return self._empty

    def _partial_views(self, slots: int, num_heads: int, head_dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """float32 ``[slots, heads, head_dim]`` and ``[slots, heads]`` views of the float workspace."""
        import torch

        views = self._partial.get((slots, num_heads, head_dim))
        if views is not None:
            return views
        out_bytes = slots * num_heads * head_dim * 4
        lse_begin = _aligned(out_bytes)
        need = lse_begin + slots * num_heads * 4
        if need > self._float_bytes.numel():
            raise ValueError(
                f"float_workspace_buffer holds {self._float_bytes.numel()} bytes, this plan needs {need} for the partial "
                f"results of {slots} split chunks: give the wrapper a larger one"
            )
        partial_out = self._float_bytes[:out_bytes].view(torch.float32).view(slots, num_heads, head_dim)
        partial_lse = self._float_bytes[lse_begin:need].view(torch.float32).view(slots, num_heads)
        if len(self._partial) >= _VIEWS_KEPT:
            self._partial.clear()
        self._partial[(slots, num_heads, head_dim)] = partial_out, partial_lse
        return partial_out, partial_lse

    def _partial_capacity(self, num_heads: int, head_dim: int) -> int:
        """The most slots the float workspace holds for ``num_heads`` heads of ``head_dim``."""
        return max(self._float_bytes.numel() - ALIGN, 0) // (num_heads * (head_dim + 1) * 4)
