"""Finds, loads and caches the per-SM shared object of a kernel module.

Nothing happens at import: no CUDA call, no file read, no .so load, so servers may fork after
``import aotinfer``. The first call of an op on a device reads the manifest (once per process),
picks the build for that device's compute capability (``_arch.choose_arch``), loads it through
tvm-ffi and caches it under (module, device index); later calls are one dict lookup.
"""

from __future__ import annotations

import functools
import os
import threading

from ._arch import Arch, Choice, NoCompatibleBuild, choose_arch

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, Tuple

OPS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ops")
MANIFEST = os.path.join(OPS_DIR, "manifest.json")

def fork_safe_lock() -> threading.Lock:
    """A lock for one-time work (loading a module, defining the torch ops) that a forking thread
    takes before the fork: a child never inherits it held by a thread that does not exist there,
    and finds the work either done or not started."""
    lock = threading.Lock()
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(before=lock.acquire, after_in_parent=lock.release, after_in_child=lock.release)
    return lock


_lock = fork_safe_lock()
_modules: "Dict[Tuple[str, int], Any]" = {}
_capabilities: "Dict[int, Tuple[int, int]]" = {}
_jit_warned: set = set()


class NotBuiltError(ImportError):
    """aotinfer is imported from a source tree without its compiled kernels."""


def build_command(arch: str) -> str:
    return f'AOTINFER_CUDA_ARCH_LIST="{arch}" pip install --no-binary aotinfer aotinfer'


#: Entry-point group of provider packages: separately installed wheels that ship more builds.
#: An entry point names a package with an ``_ops/manifest.json`` and the shared objects it lists.
PROVIDER_GROUP = "aotinfer.ops"


def _read_manifest(path: str) -> Dict[str, Any]:
    import json

    with open(path) as f:
        return json.load(f)


@functools.lru_cache(maxsize=None)
def manifest() -> Dict[str, Any]:
    """The build's manifest: versions, arch list, and every module's builds with their sha256.

    Builds from provider packages (PROVIDER_GROUP) are added for archs this install lacks; each
    build records the directory of its file under "dir". Read once, on first use.
    """
    try:
        merged = _read_manifest(MANIFEST)
    except FileNotFoundError:
        raise NotBuiltError(
            f"aotinfer's kernels are not built: {MANIFEST} is missing. Install the wheel"
            " ('pip install aotinfer') or build from a checkout ('pip install .')."
        ) from None
    for entry in merged["modules"].values():
        for build in entry["builds"].values():
            build["dir"] = OPS_DIR
    for name, ops_dir in _providers():
        try:
            provided = _read_manifest(os.path.join(ops_dir, "manifest.json"))
        except OSError as e:
            _warn(f"aotinfer: provider {name!r} has no readable manifest ({e}); ignored")
            continue
        if provided.get("package_version") != merged["package_version"]:
            _warn(
                f"aotinfer: provider {name!r} was built for aotinfer {provided.get('package_version')},"
                f" this is {merged['package_version']}; ignored"
            )
            continue
        for module, entry in provided["modules"].items():
            if module not in merged["modules"]:
                continue
            builds = merged["modules"][module]["builds"]
            for arch, build in entry["builds"].items():
                if arch not in builds:
                    builds[arch] = dict(build, dir=ops_dir, provider=name)
    return merged


def declared_functions() -> Dict[str, Dict[str, str]]:
    """{module: {function: schema}} of this install, from the main manifest alone."""
    return {name: entry["functions"] for name, entry in _read_main_manifest()["modules"].items()}


def _read_main_manifest() -> Dict[str, Any]:
    try:
        return _read_manifest(MANIFEST)
    except FileNotFoundError:
        raise NotBuiltError(
            f"aotinfer's kernels are not built: {MANIFEST} is missing. Install the wheel"
            " ('pip install aotinfer') or build from a checkout ('pip install .')."
        ) from None


def _providers():
    """(entry point name, _ops directory) of each installed provider package."""
    from importlib import metadata
    from importlib.util import find_spec

    found = []
    for point in metadata.entry_points(group=PROVIDER_GROUP):
        spec = find_spec(point.value)
        if spec is None or not spec.submodule_search_locations:
            _warn(f"aotinfer: provider {point.name!r} names package {point.value!r}, which is not installed; ignored")
            continue
        found.append((point.name, os.path.join(list(spec.submodule_search_locations)[0], "_ops")))
    return found


def _warn(message: str) -> None:
    import warnings

    warnings.warn(message, RuntimeWarning, stacklevel=3)


def module_builds(name: str) -> Dict[Arch, Dict[str, Any]]:
    """The builds of one module in this install, keyed by arch (with its +PTX flag)."""
    entry = module_entry(name)
    return {
        Arch.parse(arch + ("+PTX" if build["ptx"] else "")): build
        for arch, build in entry["builds"].items()
    }


def module_entry(name: str) -> Dict[str, Any]:
    modules = manifest()["modules"]
    if name not in modules:
        raise KeyError(f"aotinfer has no kernel module {name!r}; it has: {', '.join(sorted(modules))}")
    return modules[name]


def resolve(name: str, cc: Tuple[int, int]) -> Tuple[Choice, str]:
    """Which file of module ``name`` a GPU of compute capability ``cc`` loads, and why."""
    builds = module_builds(name)
    try:
        choice = choose_arch(cc, builds, module_entry(name)["sm_majors"])
    except NoCompatibleBuild as e:
        raise NoCompatibleBuild(
            f"aotinfer module {name!r}: {e}. To add this GPU, build from source: "
            f"{build_command(f'{cc[0]}.{cc[1]}')}"
        ) from None
    build = builds[choice.arch]
    return choice, os.path.join(build["dir"], build["file"])


def device_capability(index: int) -> Tuple[int, int]:
    """(major, minor) of CUDA device ``index``, asked once per device and process."""
    cc = _capabilities.get(index)
    if cc is None:
        import torch

        cc = _capabilities[index] = torch.cuda.get_device_capability(index)
    return cc


def get_module(name: str, index: int) -> Any:
    """The loaded tvm-ffi module ``name`` for CUDA device ``index`` (``tensor.get_device()``);
    for index -1 (no GPU among the arguments), any build: its binding's checks then reject the
    arguments by name before anything touches a device."""
    key = (name, index)
    module = _modules.get(key)
    if module is None:
        with _lock:
            module = _modules.get(key)
            if module is None:
                module = _modules[key] = _load(name, index)
    return module


def _load(name: str, index: int) -> Any:
    import warnings

    import tvm_ffi

    if index < 0:
        build = next(iter(module_entry(name)["builds"].values()))
        return tvm_ffi.load_module(os.path.join(build["dir"], build["file"]))
    choice, path = resolve(name, device_capability(index))
    if choice.jit and path not in _jit_warned:
        _jit_warned.add(path)
        warnings.warn(
            f"aotinfer module {name!r} has no SASS for cuda:{index}; using {choice.reason}."
            " The first call is slow while the driver compiles it (cached afterwards).",
            RuntimeWarning,
            stacklevel=4,
        )
    return tvm_ffi.load_module(path)
