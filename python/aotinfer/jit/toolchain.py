"""The programs a JIT build runs: nvcc, the host C++ compiler, and tvm-ffi's headers and library.

Found on first use, never at import. nvcc: ``$CUDA_HOME/bin/nvcc`` (or ``$CUDA_PATH``), else the
first nvcc on PATH, else ``/usr/local/cuda/bin/nvcc``. The host compiler: ``$CUDAHOSTCXX`` (which
CMake reads too), else ``$NVCC_CCBIN``, else g++ on PATH; nvcc gets it through ``-ccbin`` and it
links the object, so one compiler does both, as in the CMake build. Each program's ``--version``
text goes into the cache key: a new nvcc or g++ means a new build.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess

from .._arch import Arch, arch_for_gpu

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import FrozenSet, Optional, Tuple


class Toolchain:
    """nvcc and the host compiler found for this environment; slow facts are read when needed."""

    def __init__(self, nvcc: str, host_cxx: str) -> None:
        self.nvcc = nvcc
        self.host_cxx = host_cxx

    def __repr__(self) -> str:
        return f"<Toolchain nvcc {self.cuda_version} at {self.nvcc}, host {self.host_cxx}>"

    @functools.cached_property
    def nvcc_id(self) -> str:
        """``nvcc --version``: release and build, e.g. '... release 13.0, V13.0.88 ...'."""
        return _run([self.nvcc, "--version"]).strip()

    @functools.cached_property
    def host_id(self) -> str:
        return _run([self.host_cxx, "--version"]).splitlines()[0].strip()

    @functools.cached_property
    def cuda_version(self) -> str:
        m = re.search(r"release (\d+\.\d+)", self.nvcc_id)
        return m.group(1) if m else "unknown"

    @functools.cached_property
    def gpu_codes(self) -> FrozenSet[Tuple[int, int]]:
        """The compute capabilities this nvcc builds SASS for (``nvcc --list-gpu-code``)."""
        codes = re.findall(r"sm_(\d+)(\d)\b", _run([self.nvcc, "--list-gpu-code"]))
        return frozenset((int(major), int(minor)) for major, minor in codes)

    @functools.cached_property
    def library_dirs(self) -> Tuple[str, ...]:
        """Where this toolkit's cudart_static and cudadevrt live, as nvcc itself would link them."""
        # The link step of a dry run prints them; no file is read or written.
        dry = _run([self.nvcc, "-v", "--dryrun", "-o", os.devnull, "aotinfer-probe.o"], stderr=True)
        line = next((l for l in dry.splitlines() if l.startswith("#$ LIBRARIES=")), "")
        dirs = tuple(os.path.normpath(d) for d in re.findall(r'"-L([^"]+)"', line))
        if not dirs:
            raise RuntimeError(f"cannot tell where {self.nvcc}'s CUDA libraries are: no LIBRARIES in its -v output")
        return dirs

    def arch_for(self, cc: Tuple[int, int]) -> Optional[Arch]:
        """The arch to build for a GPU of compute capability ``cc``, or None if this nvcc cannot.

        SASS for the GPU itself ('a' from 9.0 on) where nvcc builds for it; for a GPU newer than
        the toolkit, the newest arch of nvcc's not above it as '+PTX' (the driver compiles it).
        """
        cc = (int(cc[0]), int(cc[1]))
        if cc in self.gpu_codes:
            return arch_for_gpu(cc)
        if self.gpu_codes and cc > max(self.gpu_codes):
            major, minor = max(self.gpu_codes)
            return Arch(major, minor, "", True)
        return None

    def check_archs(self, archs) -> None:
        missing = [a for a in archs if (a.major, a.minor) not in self.gpu_codes]
        if missing:
            known = " ".join("{}.{}".format(*c) for c in sorted(self.gpu_codes))
            raise RuntimeError(
                f"nvcc {self.cuda_version} ({self.nvcc}) does not build for"
                f" {' '.join(str(a) for a in missing)}; it builds for {known}"
            )


def _run(cmd, stderr: bool = False) -> str:
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60)
    return proc.stdout + (proc.stderr if stderr else "")


def find() -> Optional[Toolchain]:
    """The toolchain of this environment, or None when no nvcc is found (see ``why_not_found``)."""
    env = os.environ
    return _find(env.get("CUDA_HOME"), env.get("CUDA_PATH"), env.get("PATH"),
                 env.get("CUDAHOSTCXX"), env.get("NVCC_CCBIN"))


@functools.lru_cache(maxsize=None)
def _find(cuda_home, cuda_path, path, host_env, nvcc_ccbin) -> Optional[Toolchain]:
    nvcc = _find_nvcc(cuda_home, cuda_path, path)
    if nvcc is None:
        return None
    host = host_env or nvcc_ccbin or shutil.which("g++", path=path) or "g++"
    return Toolchain(nvcc, host)


def _find_nvcc(cuda_home, cuda_path, path) -> Optional[str]:
    for root in (cuda_home, cuda_path):
        if root:
            # An explicit toolkit wins; if it has no nvcc, say so rather than use another one.
            candidate = os.path.join(root, "bin", "nvcc")
            return candidate if os.access(candidate, os.X_OK) else None
    found = shutil.which("nvcc", path=path)
    if found:
        return found
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.access(default, os.X_OK) else None


def why_not_found() -> str:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return f"no nvcc in {var}={os.environ[var]} (expected {os.environ[var]}/bin/nvcc)"
    return "nvcc not found: set CUDA_HOME to a CUDA 12.8+ toolkit or put nvcc on PATH"


def tvm_ffi_version() -> str:
    """The installed apache-tvm-ffi's version, read without importing it (which imports torch)."""
    from importlib import metadata

    return metadata.version("apache-tvm-ffi")


@functools.lru_cache(maxsize=None)
def tvm_ffi_paths() -> Tuple[str, str]:
    """(include dir, libtvm_ffi.so) of the installed apache-tvm-ffi, as CMake finds them."""
    import tvm_ffi.libinfo

    return tvm_ffi.libinfo.find_include_path(), tvm_ffi.libinfo.find_libtvm_ffi()
