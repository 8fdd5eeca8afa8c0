"""Finds, loads and caches the per-SM shared object of a kernel module.

Nothing happens at import: no CUDA call, no file read, no .so load, so servers may fork after
``import aotinfer``. The first call of an op on a device reads the manifest (once per process),
picks the build for that device's compute capability (``_arch.choose_arch``), loads it through
tvm-ffi and caches it under (module, device index); later calls are one dict lookup.

A damaged install fails with BrokenInstall (a NotBuiltError), naming the file and the pip command
that reinstalls aotinfer from where it came; a broken provider package is skipped with a warning.
Each object (and the CUDA runtime library) is checked against the manifest's size and sha256 when
it is first loaded, in the words of ``python -m aotinfer verify``, which checks every file.
"""

from __future__ import annotations

import os
import threading

from ._arch import Choice, NoCompatibleBuild
# What the install holds (the manifest and its files): _manifest.py, also used by the JIT.
from ._manifest import (MANIFEST, OPS_DIR, PROVIDER_GROUP, BrokenInstall, NotBuiltError, declared_functions,
                        file_problem, manifest, module_builds, module_entry, no_build_advice, provider_manifests,
                        repair_command, resolve, verify)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Tuple

def fork_safe_lock() -> threading.Lock:
    """A lock for one-time work (loading a module, defining the torch ops) that a forking thread
    takes before the fork: a child never inherits it held by a thread that does not exist there,
    and finds the work either done or not started."""
    lock = threading.Lock()
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(before=lock.acquire, after_in_parent=lock.release, after_in_child=lock.release)
    return lock


_lock = fork_safe_lock()  # guards _modules and _loading; never held while a module loads
# Held while a thread imports tvm_ffi and dlopens a module, milliseconds: a fork waits for both.
# A child forked halfway through would inherit the import's module locks held by a thread it
# does not have, and its own first call would wait on them forever.
_native_lock = fork_safe_lock()
_modules: "Dict[Tuple[str, int], Any]" = {}
_loading: "Dict[Tuple[str, int], _Pending]" = {}  # loads in progress, by (module, device index)
_properties: "Dict[int, Any]" = {}  # device index -> torch.cuda.get_device_properties
_jit_warned: set = set()


def device_properties(index: int) -> Any:
    """``torch.cuda.get_device_properties`` of CUDA device ``index``, asked once per device and
    process (the loader's arch, the plans' SM count and L2 size)."""
    properties = _properties.get(index)
    if properties is None:
        import torch

        properties = _properties[index] = torch.cuda.get_device_properties(index)
    return properties


def device_capability(index: int) -> Tuple[int, int]:
    """(major, minor) of CUDA device ``index``."""
    properties = device_properties(index)
    return properties.major, properties.minor


def get_module(name: str, index: int) -> Any:
    """The loaded tvm-ffi module ``name`` for CUDA device ``index`` (``tensor.get_device()``);
    for index -1 (no GPU among the arguments), any build: its binding's checks then reject the
    arguments by name before anything touches a device.

    One thread loads each (module, device); others asking meanwhile wait for it. The loader's
    lock is held only to look up and record, never across the load: a load can be a JIT build of
    a minute, and a thread that forks meanwhile must not wait for it (the fork handler takes the
    lock, and a build ending under filelock's fork handling would wait for the fork in turn).
    """
    key = (name, index)
    module = _modules.get(key)
    if module is not None:
        return module
    with _lock:
        module = _modules.get(key)
        if module is not None:
            return module
        pending = _loading.get(key)
        loader = pending is None
        if loader:
            pending = _loading[key] = _Pending()
    if not loader:
        return pending.wait()
    try:
        module = _load(name, index)
    except BaseException as e:
        with _lock:
            del _loading[key]  # not remembered: the next call tries again
        pending.fail(e)
        raise
    with _lock:
        _modules[key] = module
        del _loading[key]
    pending.done(module)
    return module


class _Pending:
    """A load in progress in another thread: its module or its error, once it ends."""

    def __init__(self) -> None:
        self._ended = threading.Event()
        self._module: Any = None
        self._error: Optional[BaseException] = None

    def done(self, module: Any) -> None:
        self._module = module
        self._ended.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ended.set()

    def wait(self) -> Any:
        self._ended.wait()
        if self._error is not None:
            raise self._error
        return self._module


def _forget_loads_of_other_threads() -> None:
    # In a child, the threads that were loading do not exist: its callers load for themselves
    # (a JIT build waits on the cache's file lock like any other process's).
    _loading.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_loads_of_other_threads)


def _load(name: str, index: int) -> Any:
    import warnings

    if index < 0:  # no GPU among the arguments: any build, whose checks name them (get_module)
        builds = module_builds(name)
        if not builds:
            raise NotBuiltError(f"aotinfer module {name!r} has no build in this install (its arch list: "
                                f"{manifest()['arch_list']})")
        arch, build = next(iter(builds.items()))
        choice, path = Choice(arch, False, "any build"), os.path.join(build["dir"], build["file"])
    else:
        cc = device_capability(index)
        try:
            choice, path = resolve(name, cc)
            build = module_builds(name)[choice.arch]
        except NoCompatibleBuild as e:  # none installed: the JIT cache, else a JIT build
            from . import jit

            choice, path = jit.resolve(name, cc, str(e))
            build = None  # the JIT checked the object's sha256 against its sidecar before handing it over
    # The object and the CUDA runtime library it links, against the manifest: size, then sha256,
    # once per file and process. A tampered or corrupted file is refused in verify's words; a
    # truncated one would crash dlopen (SIGBUS) instead of failing.
    runtime = manifest().get("runtime")
    for file, entry in ([(path, build)] if build is not None else []) + (
            [(os.path.join(OPS_DIR, runtime["file"]), runtime)] if isinstance(runtime, dict) else []):
        problem = file_problem(file, entry)
        if problem:
            raise BrokenInstall(
                f"aotinfer module {name!r}: {file}: {problem}; reinstall aotinfer:"
                f" {repair_command(manifest()['arch_list'])}"
            )
    if choice.jit and path not in _jit_warned:
        _jit_warned.add(path)
        warnings.warn(
            f"aotinfer module {name!r} has no SASS for cuda:{index}; using {choice.reason}."
            " The first call is slow while the driver compiles it (cached afterwards).",
            RuntimeWarning,
            stacklevel=4,
        )
    # torch first, outside the lock: importing it runs aotinfer's hook, which takes the ops' lock.
    import torch  # noqa: F401

    try:
        with _native_lock:
            import tvm_ffi  # after the manifest's checks: a broken install says so first

            return tvm_ffi.load_module(path)
    except Exception as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise BrokenInstall(
            f"aotinfer module {name!r}: {path} does not load ({reason}); check it with"
            f" 'python -m aotinfer verify', then reinstall aotinfer: {repair_command(manifest()['arch_list'])}"
        ) from e
