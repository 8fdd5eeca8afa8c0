"""aotinfer: ahead-of-time compiled CUDA kernels for LLM inference, with FlashInfer's Python API.

Importing is cheap and side-effect free: no CUDA call, no torch import and no shared object
loaded; where torch is already imported, aotinfer's torch custom ops are defined from the
manifest. Each op loads the build of its kernel module that matches the input's GPU on first use
(see _loader.py).
"""

import sys as _sys

from ._arch import NoCompatibleBuild
from ._version import __version__
from .activation import gelu_and_mul, gelu_tanh_and_mul, silu_and_mul
from .norm import fused_add_rmsnorm, gemma_fused_add_rmsnorm, gemma_rmsnorm, layernorm, rmsnorm
from .scale import scale
from .utils import BackendSupportedError

__all__ = [
    "BackendSupportedError",
    "NoCompatibleBuild",
    "__version__",
    "fused_add_rmsnorm",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "gemma_fused_add_rmsnorm",
    "gemma_rmsnorm",
    "layernorm",
    "rmsnorm",
    "scale",
    "silu_and_mul",
]

if "torch" in _sys.modules:
    # torch.compile can only see aotinfer's custom ops once they exist; define them now when that
    # costs no torch import (otherwise the first kernel call does it), and, if torch._dynamo is
    # loaded already, let it trace the ops (otherwise that happens when it is imported).
    from . import _kernels, _loader

    try:
        _kernels.register_torch_ops()
    except _loader.NotBuiltError:
        pass
    if "torch._dynamo" in _sys.modules:
        _kernels._on_dynamo_loaded()
