"""aotinfer.jit: compile what the wheel lacks, from the same declarations, into a safe cache.

The AOT half of aotinfer builds every module of modules.toml for every arch of
AOTINFER_CUDA_ARCH_LIST into the wheel. This is the other half, for a GPU the wheel has no build
for (a new part, a custom arch list) and for the developer loop (rebuild one module without
reinstalling)::

    from aotinfer.jit import gen_jit_spec, gen_module_spec
    spec = gen_module_spec("scale", "10.3a")       # a module of modules.toml, for one arch
    module = spec.build_and_load()                 # compiled once, then loaded from the cache
    spec = gen_jit_spec("my_ops", ["my_ops.cu"], extra_cuda_cflags=["-DMY_FLAG"])

A JitSpec compiles with the flags the CMake build uses (core.py); objects go to the cache
(cache.py), never into site-packages, keyed by the content of everything they are built from.
The loader falls back to ``resolve`` (modules.py) when no installed build runs on a GPU;
``python -m aotinfer build`` prebuilds into the cache. Importing this package does nothing else.
"""

from .cache import CacheDirError, LockTimeout, cache_root
from .core import JitBuildError, JitSpec, JitUnavailable, gen_jit_spec
from .modules import (
    cached_builds,
    cached_choice,
    declarations,
    find_or_build,
    gen_module_spec,
    kernel_source_dir,
    module_specs,
    resolve,
)

__all__ = [
    "CacheDirError",
    "JitBuildError",
    "JitSpec",
    "JitUnavailable",
    "LockTimeout",
    "cache_root",
    "cached_builds",
    "cached_choice",
    "declarations",
    "find_or_build",
    "gen_jit_spec",
    "gen_module_spec",
    "kernel_source_dir",
    "module_specs",
    "resolve",
]
