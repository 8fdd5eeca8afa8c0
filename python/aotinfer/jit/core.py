"""JitSpec: what to compile into one shared object, and building it into the cache as CMake would.

A spec compiles exactly as CMakeLists.txt compiles a module for the wheel: the same nvcc flags
(``-O3 -DNDEBUG``, one ``--generate-code`` per arch, ``-fPIC``, hidden visibility,
``--compress-mode=size``, ``TVM_FFI_DLL_EXPORT_INCLUDE_METADATA=1``), include dirs ``include/``
and ``csrc/`` of the kernel sources plus tvm-ffi's, and the same link: the host compiler with
static libstdc++ kept private (``--exclude-libs,ALL``, ``--gc-sections``) against the install's
CUDA runtime library (libaotinfer_cudart.so, which every module of the process shares) and
libtvm_ffi.so. Only the rpath differs: the object lives in the cache, so it names the two
libraries' directories itself.

The cache key hashes the spec's inputs (sources and every header they include from the spec's
include dirs, found by scanning ``#include`` lines; flags; archs; tvm-ffi's version) and the
toolchain (``nvcc --version``, the host compiler's version). Headers outside those dirs (CUDA's,
tvm-ffi's, the system's) are covered by the versions. The inputs alone make the "inputs key" kept
in the sidecar, so a cache prebuilt elsewhere is usable where no nvcc is installed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .._arch import Arch
from . import cache, toolchain

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

logger = logging.getLogger("aotinfer.jit")
_PACKAGE = Path(__file__).resolve().parent.parent

#: Bump when the build recipe changes in a way the flags below do not show.
RECIPE = 1
CUDA_SUFFIXES = (".cu",)
CXX_SUFFIXES = (".cc", ".cpp", ".cxx")
#: nvcc flags of CMakeLists.txt's CUDA compile (Release: -O3 -DNDEBUG, then the target's options).
CUDA_FLAGS = ["-O3", "-DNDEBUG", "-Xcompiler=-fPIC", "-Xcompiler=-fvisibility=hidden", "-O3",
              "--compress-mode=size", "-std=c++17"]
CXX_FLAGS = ["-O3", "-DNDEBUG", "-fPIC", "-fvisibility=hidden", "-fvisibility-inlines-hidden", "-std=c++17"]
DEFINES = ["-DTVM_FFI_DLL_EXPORT_INCLUDE_METADATA=1"]
LINK_FLAGS = ["-fPIC", "-shared", "-Wl,--exclude-libs,ALL", "-Wl,--gc-sections", "-static-libstdc++"]
#: scikit-build-core installs the wheel's objects stripped (cmake --install --strip).
STRIP = "strip"
#: After the runtime library and libtvm_ffi.so, as CMakeLists.txt links them: libpthread, which the
#: static libstdc++ (linked last by the compiler driver) needs before glibc 2.34.
PTHREAD = ["-Wl,--push-state,--no-as-needed", "-lpthread", "-Wl,--pop-state"]
_ARCH_FLAG = re.compile(r"^(-gencode|--generate-code|-arch|--gpu-architecture|-code|--gpu-code)\b")
_INCLUDE = re.compile(r'^\s*#\s*include\s*(?:"([^"]+)"|<([^>]+)>|(\w))', re.MULTILINE)


class JitBuildError(RuntimeError):
    """A compiler or linker command of a JIT build failed."""


class JitUnavailable(RuntimeError):
    """A spec is neither built nor buildable here (no nvcc, or nvcc lacks an arch)."""


@dataclasses.dataclass
class JitSpec:
    """One shared object to compile: sources, flags and the archs it carries.

    ``arch_list`` is empty when the arch flags come in ``extra_cuda_cflags``. ``module`` names the
    modules.toml module the spec builds (None for other specs); ``source_dir`` is the kernel source
    tree whose ``include/`` and ``csrc/`` are on the include path (None: none).
    """

    name: str
    sources: List[Path]
    extra_cflags: List[str]
    extra_cuda_cflags: List[str]
    extra_ldflags: List[str]
    extra_include_dirs: List[Path]
    arch_list: Tuple[Arch, ...]
    module: Optional[str] = None
    source_dir: Optional[Path] = None
    cutedsl: Optional[Path] = None  # a CuTeDSL kernel file whose cubins the sources embed

    # ---- what the object is built from --------------------------------------------------------

    @property
    def include_dirs(self) -> List[Path]:
        own = [self.source_dir / "include", self.source_dir / "csrc"] if self.source_dir else []
        return list(self.extra_include_dirs) + own

    @property
    def stem(self) -> str:
        """File name of the object without '.so': 'scale_sm103a', like the wheel's."""
        return "_".join([self.name] + [f"sm{a.tag}" for a in self.arch_list])

    @property
    def cuda_flags(self) -> List[str]:
        from ..compilation_context import nvcc_arch_flags

        return CUDA_FLAGS[:2] + nvcc_arch_flags(self.arch_list) + CUDA_FLAGS[2:] + self.extra_cuda_cflags

    def inputs(self) -> Dict[str, Any]:
        """Everything the object depends on but the toolchain (sources and headers by sha256)."""
        return {
            "recipe": RECIPE,
            "name": self.name,
            "archs": [str(a) for a in self.arch_list],
            "files": {self._label(p): cache.sha256(p) for p in self.files()},
            "include_dirs": [self._label(d) for d in self.include_dirs],
            "cuda_flags": self.cuda_flags,
            "cxx_flags": CXX_FLAGS + self.extra_cflags,
            "ldflags": LINK_FLAGS + self.extra_ldflags,
            "tvm_ffi": toolchain.tvm_ffi_version(),
            "runtime": _runtime_library()[1],
            # The kernel file and its build helper; the DSL's version only in the build's record,
            # so that a cache prebuilt where the DSL is serves machines without it.
            **({"cutedsl": {self._label(f): cache.sha256(f) for f in self._cutedsl_files()}}
               if self.cutedsl is not None else {}),
        }

    def _cutedsl_files(self) -> List[Path]:
        """The CuTeDSL kernel file and the build helper that compiles it (cmake/cutedsl.py)."""
        return [Path(self.cutedsl).resolve(), self._cutedsl_builder()]

    def _cutedsl_builder(self) -> Path:
        return (self.source_dir / "cmake" / "cutedsl.py").resolve()

    def inputs_key(self) -> str:
        return _digest(self.inputs())

    def files(self) -> List[Path]:
        """The sources and every header they include from the include dirs, transitively."""
        dirs = [d for d in self.include_dirs if d.is_dir()]
        seen: Dict[Path, None] = {}
        todo = [Path(s).resolve() for s in self.sources]
        while todo:
            path = todo.pop()
            if path in seen:
                continue
            seen[path] = None
            for quoted, angled, macro in _INCLUDE.findall(path.read_text(errors="replace")):
                if macro:  # '#include SOME_MACRO': no telling what it names, so take every header
                    todo += [p.resolve() for d in dirs for p in sorted(d.rglob("*")) if p.is_file()]
                    continue
                where = ([path.parent] if quoted else []) + dirs
                found = next((d / (quoted or angled) for d in where if (d / (quoted or angled)).is_file()), None)
                if found is not None:
                    todo.append(found.resolve())
        return sorted(seen)

    def _label(self, path: Path) -> str:
        path = Path(path).resolve()
        if self.source_dir is not None:
            try:
                return path.relative_to(self.source_dir.resolve()).as_posix()
            except ValueError:
                pass
        return str(path)

    # ---- where it is ----------------------------------------------------------------------

    @property
    def aot_path(self) -> Optional[Path]:
        """The installed build of this spec (the wheel's or a provider's), if any."""
        if self.module is None or len(self.arch_list) != 1 or self.extra_cuda_cflags:
            return None
        from .. import _manifest

        if self.source_dir != packaged_source_dir():
            return None  # sources other than those the wheel was built from
        try:
            build = _manifest.module_builds(self.module).get(self.arch_list[0])
        except (_manifest.NotBuiltError, KeyError):
            return None
        return Path(build["dir"], build["file"]) if build else None

    @property
    def is_aot(self) -> bool:
        path = self.aot_path
        return path is not None and path.is_file()

    def entry(self, root: Optional[Path] = None, tools: Optional[toolchain.Toolchain] = None) -> cache.Entry:
        """The cache entry this spec builds with ``tools`` (default: the toolchain found here)."""
        tools = tools or toolchain.find()
        if tools is None:
            raise JitUnavailable(f"cannot build {self.stem}: {toolchain.why_not_found()}")
        key = _digest({"inputs": self.inputs_key(), "nvcc": tools.nvcc_id, "host": tools.host_id})
        return cache.Entry(root or cache.open_root(), self.stem, key[:16])

    def cached_entry(self, root: Optional[Path] = None) -> Optional[cache.Entry]:
        """The checked cache entry of this spec, or None.

        With nvcc here, only an entry built by this toolchain; without, any entry built from
        these inputs (a cache prebuilt where nvcc was).
        """
        root = root or cache.open_root(create=False)
        if root is None:
            return None
        if toolchain.find() is not None:
            entry = self.entry(root)
            return entry if entry.problem() is None else None
        key = self.inputs_key()
        for entry in reversed(cache.entries(root, self.stem)):
            record = entry.read_sidecar()
            if entry.stem == self.stem and record and record.get("inputs_key") == key and entry.problem() is None:
                return entry
        return None

    @property
    def jit_library_path(self) -> Path:
        entry = self.cached_entry()
        return entry.library if entry is not None else self.entry().library

    @property
    def library_path(self) -> Path:
        """The object ``load()`` loads: the installed build if there is one, else the cache's."""
        return self.aot_path if self.is_aot else self.jit_library_path

    # ---- build and load -------------------------------------------------------------------

    def build(self, why: str = "", prebuild: str = "") -> Path:
        """Build into the cache unless a checked object is there already; its path.

        Builds log one WARNING line before (``why`` a build is needed, what, where, and how to
        ``prebuild``) and one after, with the time taken. Other processes asking for the same
        object meanwhile wait for this build instead of starting theirs.
        """
        return self.ensure_built(why, prebuild)[0]

    def ensure_built(self, why: str = "", prebuild: str = "") -> Tuple[Path, str]:
        """``build()``, and how the object came to be there: "built" (by this call), "waited"
        (built by another process while this one waited for its lock) or "cached"."""
        tools = toolchain.find()
        if tools is None:
            entry = self.cached_entry()
            if entry is not None:
                return entry.library, "cached"
            raise JitUnavailable(f"cannot build {self.stem}: {toolchain.why_not_found()}")
        tools.check_archs(self.arch_list)
        if self.cutedsl is not None and not dsl_available():
            raise JitUnavailable(f"cannot build {self.stem}: {DSL_MISSING}")
        entry = self.entry(cache.open_root(), tools)
        if entry.problem() is None:
            return entry.library, "cached"
        with cache.locked(entry, self.describe()) as waited:
            problem = entry.problem()
            if problem is None:  # built by the process we waited for
                return entry.library, "waited" if waited else "cached"
            if problem != "missing":
                logger.warning("aotinfer: cached %s fails its check (%s); rebuilding it", entry.dir, problem)
            self._build_entry(entry, tools, why, prebuild)
        return entry.library, "built"

    def load(self):
        """Load the object (installed or cached and checked) as a tvm-ffi module."""
        import tvm_ffi

        if self.is_aot:
            return tvm_ffi.load_module(str(self.aot_path))
        entry = self.cached_entry()
        if entry is None:
            raise JitUnavailable(f"{self.stem} is not built: call build() or build_and_load()")
        return tvm_ffi.load_module(str(entry.library))

    def build_and_load(self):
        if self.is_aot:
            return self.load()
        import tvm_ffi

        return tvm_ffi.load_module(str(self.build()))

    def describe(self) -> str:
        archs = " ".join(a.sass + ("+PTX" if a.ptx else "") for a in self.arch_list)
        return f"{self.name} for {archs}" if archs else self.name

    def _build_entry(self, entry: cache.Entry, tools: toolchain.Toolchain, why: str, prebuild: str) -> None:
        work = cache.new_build_dir(entry)
        cache.remove_abandoned_builds(entry, keep=work)
        logger.warning(
            "aotinfer: %scompiling %s with nvcc %s into %s (once: later runs load it from there).%s",
            f"{why}; " if why else "", self.describe(), tools.cuda_version, entry.dir,
            f" Prebuild it with: {prebuild}" if prebuild else "",
        )
        start = time.monotonic()
        try:
            out = work / "out"
            out.mkdir()
            commands = self.commands(tools, work, out / entry.library.name)
            self._run(commands, work)
            seconds = time.monotonic() - start
            record = {"name": self.name, "module": self.module, "archs": [str(a) for a in self.arch_list],
                      "key": entry.key, "inputs_key": self.inputs_key(), "inputs": self.inputs(),
                      "nvcc": tools.nvcc_id, "host": tools.host_id, "commands": commands,
                      "seconds": round(seconds, 2), "built_at": time.time()}
            if self.cutedsl is not None:
                record["nvidia_cutlass_dsl"] = _dsl_version()
            cache.publish(entry, out, record)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        logger.warning("aotinfer: compiled %s in %.1f s: %s", self.describe(), seconds, entry.library)

    def commands(self, tools: toolchain.Toolchain, work: Path, output: Path) -> List[List[str]]:
        """The compile commands (one per source, run in parallel), then link and strip; first, for
        a CuTeDSL module, the DSL's compile of its kernel file into the sources that embed the
        cubins (cmake/cutedsl.py, as the wheel's build runs it)."""
        tvm_include, libtvm_ffi = toolchain.tvm_ffi_paths()
        includes = [f"-I{d}" for d in self.include_dirs] + ["-isystem", tvm_include]
        sources, generate = list(self.sources), []
        if self.cutedsl is not None:
            generated = work / "cutedsl"
            (arch,) = self.arch_list
            generate = [[sys.executable, str(self._cutedsl_builder()), "--kernels", str(Path(self.cutedsl).resolve()),
                         "--module", str(self.module), "--arch", str(arch), "--out-dir", str(generated)]]
            includes.insert(0, f"-I{generated}")
            sources.append(generated / f"{self.module}_kernels.cc")
        compiles, objects = [], []
        for i, source in enumerate(sources):
            source = Path(source).resolve()
            obj = str(work / f"{i}_{source.name}.o")
            if source.suffix in CUDA_SUFFIXES:
                compiles.append([tools.nvcc, "-forward-unknown-to-host-compiler", "-ccbin", tools.host_cxx,
                                 *DEFINES, *includes, *self.cuda_flags, "-x", "cu", "-c", str(source), "-o", obj])
            elif source.suffix in CXX_SUFFIXES:
                compiles.append([tools.host_cxx, *DEFINES, *includes, *CXX_FLAGS, *self.extra_cflags,
                                 "-c", str(source), "-o", obj])
            else:
                raise ValueError(f"{self.name}: cannot compile {source}: expected {CUDA_SUFFIXES + CXX_SUFFIXES}")
            objects.append(obj)
        runtime, _ = _runtime_library()
        link = [tools.host_cxx, *LINK_FLAGS, "-o", str(output), *objects,
                f"-Wl,-rpath,{runtime.parent}", f"-Wl,-rpath,{os.path.dirname(libtvm_ffi)}", str(runtime), libtvm_ffi,
                *PTHREAD, *[f"-L{d}" for d in tools.library_dirs], *self.extra_ldflags]
        return generate + compiles + [link, [STRIP, str(output)]]

    def _run(self, commands: List[List[str]], work: Path) -> None:
        # nvcc's temporary files go to the build directory, which the next builder removes if
        # this process dies mid-build.
        env = dict(os.environ, TMPDIR=str(work))
        if self.cutedsl is not None:  # the generated sources first
            generate, *commands = commands
            _call(generate, env).check()
        *compiles, link, strip = commands
        workers = max(1, min(len(compiles), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for result in pool.map(lambda c: _call(c, env), compiles):
                result.check()
        _call(link, env).check()
        _call(strip, env).check()


class _Result:
    def __init__(self, command: List[str], proc: subprocess.CompletedProcess) -> None:
        self.command, self.proc = command, proc

    def check(self) -> None:
        if self.proc.returncode != 0:
            output = "\n".join(self.proc.stdout.splitlines()[-60:])
            raise JitBuildError(
                f"aotinfer: JIT build command failed (exit {self.proc.returncode}):\n"
                f"  {subprocess.list2cmdline(self.command)}\n{output}"
            )


def _call(command: List[str], env: Dict[str, str]) -> _Result:
    proc = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return _Result(command, proc)


def _runtime_library() -> Tuple[Path, Dict[str, Any]]:
    """The CUDA runtime library of this install (path, and what the key records of it: where it is,
    since the object names its directory, and its sha256)."""
    from .. import _manifest

    entry = _manifest.manifest().get("runtime")
    if not isinstance(entry, dict):
        raise JitUnavailable("this install has no CUDA runtime library (libaotinfer_cudart.so) to link against")
    path = Path(_manifest.OPS_DIR, entry["file"])
    return path, {"path": str(path), "sha256": entry["sha256"]}


#: Why a module written in CuTeDSL cannot be built here, and what to do.
DSL_MISSING = ("it is written in CuTeDSL, and nvidia-cutlass-dsl is not installed here (pip install"
               " 'nvidia-cutlass-dsl>=4.8,<4.9'), or install a wheel that has this GPU's arch")


def dsl_available() -> bool:
    """Whether NVIDIA's CuTeDSL (the nvidia-cutlass-dsl package) is importable here."""
    import importlib.util

    return importlib.util.find_spec("cutlass") is not None and _dsl_version() is not None


def _dsl_version() -> Optional[str]:
    import importlib.metadata

    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return None


def packaged_source_dir() -> Optional[Path]:
    """The kernel sources installed with the wheel (aotinfer/_src), if present."""
    path = _PACKAGE / "_src"
    return path if (path / "modules.toml").is_file() else None


def kernel_source_dir() -> Optional[Path]:
    """The kernel sources to build from: the wheel's, else the checkout aotinfer runs from."""
    packaged = packaged_source_dir()
    if packaged is not None:
        return packaged
    checkout = _PACKAGE.parent.parent
    return checkout if (checkout / "modules.toml").is_file() and (checkout / "csrc").is_dir() else None


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def gen_jit_spec(
    name: str,
    sources: Sequence[Union[str, Path]],
    extra_cflags: Optional[List[str]] = None,
    extra_cuda_cflags: Optional[List[str]] = None,
    extra_ldflags: Optional[List[str]] = None,
    extra_include_paths: Optional[List[Union[str, Path]]] = None,
    *,
    arch_list: Union[str, Sequence[Arch], None] = None,
) -> JitSpec:
    """A spec compiling ``sources`` into one object named ``name``, as the wheel's modules are.

    ``extra_cflags`` go to C++ sources (.cc, .cpp, .cxx), ``extra_cuda_cflags`` to nvcc for .cu
    sources. The archs: ``arch_list`` ("9.0a 10.0f" or Arch values), else those of
    ``extra_cuda_cflags`` if it carries arch flags (e.g. from
    ``current_compilation_context.get_nvcc_flags_list([9])``), else the current compilation
    context's. aotinfer's ``include/`` and ``csrc/`` are on the include path, after
    ``extra_include_paths``. Nothing is compiled until ``build()``.
    """
    from .. import compilation_context
    from .._arch import parse_arch_list

    if not name.isidentifier():
        raise ValueError(f"a JIT spec name must be an identifier, got {name!r}")
    cuda_cflags = list(extra_cuda_cflags or [])
    if isinstance(arch_list, str):
        archs = parse_arch_list(arch_list)
    elif arch_list is not None:
        archs = tuple(sorted(arch_list))
    elif any(_ARCH_FLAG.match(f) for f in cuda_cflags):
        archs = ()
    else:
        archs = compilation_context.current_compilation_context.target_archs()
    return JitSpec(
        name=name,
        sources=[Path(s).resolve() for s in sources],
        extra_cflags=list(extra_cflags or []),
        extra_cuda_cflags=cuda_cflags,
        extra_ldflags=list(extra_ldflags or []),
        extra_include_dirs=[Path(p).resolve() for p in extra_include_paths or []],
        arch_list=archs,
        source_dir=kernel_source_dir(),
    )
