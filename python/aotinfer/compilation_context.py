"""Which CUDA archs a JIT build targets, and the nvcc flags for them.

``CompilationContext().TARGET_CUDA_ARCHS`` comes from ``AOTINFER_CUDA_ARCH_LIST`` when it is set,
read with the wheel build's grammar (``_arch.parse_arch_list``: "8.9 9.0a 10.0f 12.0+PTX"), else
from the GPUs the CUDA driver shows this process (CUDA_VISIBLE_DEVICES applies): one arch per
compute capability, with the 'a' suffix from 9.0 on (``arch_for_gpu``), since a JIT build is for
the GPU in front of it. ``current_compilation_context`` is made on first access, never at import:
asking the driver for its GPUs initializes CUDA in the process.

The flags are spelled as CMake spells them for the wheel's objects
(``--generate-code=arch=compute_90a,code=[sm_90a]``), so a JIT build and the wheel's build of an
arch are the same nvcc command.
"""

from __future__ import annotations

import os

from ._arch import Arch, arch_for_gpu, parse_arch_list  # noqa: F401  (arch_for_gpu: part of this module's API)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Iterable, List, Optional, Sequence, Tuple


def nvcc_arch_flags(archs: Iterable[Arch]) -> List[str]:
    """One ``--generate-code`` flag per arch: SASS, and PTX too for '+PTX' archs (as CMake writes them)."""
    return [
        f"--generate-code=arch=compute_{a.tag},code=[compute_{a.tag},sm_{a.tag}]"
        if a.ptx
        else f"--generate-code=arch=compute_{a.tag},code=[sm_{a.tag}]"
        for a in archs
    ]


class CompilationContext:
    """The archs JIT builds target in this process (``TARGET_CUDA_ARCHS``, sorted)."""

    def __init__(self) -> None:
        text = os.environ.get("AOTINFER_CUDA_ARCH_LIST", "").strip()
        if text:
            try:
                self.TARGET_CUDA_ARCHS: Tuple[Arch, ...] = parse_arch_list(text)
            except ValueError as e:
                raise ValueError(f"AOTINFER_CUDA_ARCH_LIST: {e}") from None
            self.source = "AOTINFER_CUDA_ARCH_LIST"
        else:
            from . import _device

            _, gpus, why_none = _device.driver_gpus()
            self.TARGET_CUDA_ARCHS = tuple(sorted({arch_for_gpu(g["compute_capability"]) for g in gpus}))
            self.source = "the visible GPUs" if gpus else f"the visible GPUs: none ({why_none})"

    def __repr__(self) -> str:
        archs = " ".join(str(a) for a in self.TARGET_CUDA_ARCHS) or "none"
        return f"<CompilationContext {archs} from {self.source}>"

    def target_archs(self, supported_major_versions: Optional[Sequence[int]] = None) -> Tuple[Arch, ...]:
        """TARGET_CUDA_ARCHS restricted to the given SM majors (None: all)."""
        if not self.TARGET_CUDA_ARCHS:
            raise RuntimeError(
                f"No CUDA architectures to build for: {self.source}. Set AOTINFER_CUDA_ARCH_LIST"
                ' (e.g. "9.0a") or make a GPU visible.'
            )
        archs = tuple(
            a for a in self.TARGET_CUDA_ARCHS
            if not supported_major_versions or a.major in supported_major_versions
        )
        if not archs:
            raise RuntimeError(
                f"No supported CUDA architectures found for major versions {list(supported_major_versions)}."
                f" Target archs: {' '.join(str(a) for a in self.TARGET_CUDA_ARCHS)} (from {self.source})."
            )
        return archs

    def get_nvcc_flags_list(self, supported_major_versions: Optional[Sequence[int]] = None) -> List[str]:
        """nvcc flags for TARGET_CUDA_ARCHS of the given SM majors (None: all).

        Raises RuntimeError "No supported CUDA architectures found for major versions [...]" when
        no target arch has one of those majors.
        """
        return nvcc_arch_flags(self.target_archs(supported_major_versions))


_current: Optional[CompilationContext] = None


def __getattr__(name: str):
    # ``current_compilation_context`` is made on first access (PEP 562): reading the GPUs at
    # import would initialize CUDA in every process that imports this module.
    global _current
    if name == "current_compilation_context":
        if _current is None:
            _current = CompilationContext()
        return _current
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
