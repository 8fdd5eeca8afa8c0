"""aotinfer: ahead-of-time compiled CUDA kernels for LLM inference, with FlashInfer's Python API.

Importing is cheap and side-effect free: no CUDA call, no torch import, no file access and no
shared object loaded. Each op loads the build of its kernel module that matches the input's GPU
on first use (see _loader.py).
"""

from ._arch import NoCompatibleBuild
from ._version import __version__
from .scale import scale

__all__ = ["NoCompatibleBuild", "__version__", "scale"]
