"""The manifest of this install and of provider packages: which per-SM shared objects there are,
which one a compute capability loads, and whether the files are intact.

Read once, on first use; nothing at import. Split from the loader (_loader.py) so that the JIT
(aotinfer.jit), which asks what the install holds, and the loader, which falls back to the JIT,
do not import each other.
"""

from __future__ import annotations

import functools
import os

from ._arch import Arch, Choice, NoCompatibleBuild, build_advice, choose_arch

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Tuple

OPS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ops")
MANIFEST = os.path.join(OPS_DIR, "manifest.json")


class NotBuiltError(ImportError):
    """aotinfer's compiled kernels are not there: a source tree, or a broken install."""


class BrokenInstall(NotBuiltError):
    """A file of the install is missing, unreadable, corrupted or does not load."""


#: Entry-point group of provider packages: separately installed wheels that ship more builds.
#: An entry point names a package with an ``_ops/manifest.json`` and the shared objects it lists.
PROVIDER_GROUP = "aotinfer.ops"


def repair_command(arch_list: Optional[str] = None) -> str:
    """The pip command that reinstalls this aotinfer from where it came (its PEP 610 record).

    A wheel file or checkout: that path again, with the arch list of the install for a checkout;
    an index or a folder of release wheels (--find-links): the exact version, from the same place.
    """
    from importlib import metadata

    try:
        dist = metadata.distribution("aotinfer")
        version, direct = dist.version, dist.read_text("direct_url.json")
    except Exception:  # not installed by pip, or its record is unreadable
        from ._version import __version__ as version

        direct = None
    source, prefix, suffix = f"'aotinfer=={version}'", "", " (with the --find-links folder or index it came from)"
    if direct:
        import json
        import shlex
        from urllib.parse import unquote, urlparse

        try:
            record = json.loads(direct)
            url = urlparse(record["url"])
            source = shlex.quote(unquote(url.path) if url.scheme == "file" else record["url"])
            suffix = ""
            if "dir_info" in record and arch_list:
                prefix = f'AOTINFER_CUDA_ARCH_LIST="{arch_list}" '
        except (ValueError, KeyError, TypeError):
            pass
    return f"{prefix}pip install --force-reinstall --no-deps {source}{suffix}"


def _read_manifest(path: str) -> Dict[str, Any]:
    """The manifest at ``path``, checked for the shape the loader relies on; ValueError if not."""
    import json

    with open(path) as f:
        data = json.load(f)  # ValueError (JSONDecodeError) when it is not JSON
    _check_manifest(data)
    return data


def _check_manifest(data: Any) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(what)

    need(isinstance(data, dict), "not a JSON object")
    for key in ("package_version", "cuda_version", "arch_list"):
        need(isinstance(data.get(key), str), f"no {key!r}")
    modules = data.get("modules")
    need(isinstance(modules, dict), "no 'modules'")
    for name, entry in modules.items():
        need(isinstance(entry, dict) and isinstance(entry.get("builds"), dict)
             and isinstance(entry.get("functions"), dict), f"module {name!r} has no 'builds' or 'functions'")
        need(all(isinstance(f, str) and isinstance(s, str) for f, s in entry["functions"].items()),
             f"module {name!r}: 'functions' must map names to schemas")
        majors = entry.get("sm_majors")
        need(majors is None or (isinstance(majors, list) and all(isinstance(m, int) for m in majors)),
             f"module {name!r}: bad 'sm_majors'")
        for arch, build in entry["builds"].items():
            Arch.parse(arch)  # ValueError for a bad arch name
            need(isinstance(build, dict) and isinstance(build.get("file"), str)
                 and os.path.basename(build["file"]) == build["file"] and isinstance(build.get("sha256"), str)
                 and (build.get("ptx") is None or isinstance(build["ptx"], str)),
                 f"module {name!r}: bad build {arch!r}")


@functools.lru_cache(maxsize=None)
def _main_manifest() -> Dict[str, Any]:
    """The manifest of this install's own _ops/, read once."""
    try:
        return _read_manifest(MANIFEST)
    except FileNotFoundError:
        raise NotBuiltError(
            f"aotinfer's kernels are not built: {MANIFEST} is missing. In a checkout, build them"
            " ('pip install .', see the README); an installed aotinfer is broken, reinstall it:"
            f" {repair_command()}"
        ) from None
    except (OSError, ValueError) as e:
        raise BrokenInstall(
            f"aotinfer's manifest {MANIFEST} is unreadable or corrupted ({e}); reinstall aotinfer:"
            f" {repair_command()}"
        ) from None


def declared_functions() -> Dict[str, Dict[str, str]]:
    """{module: {function: schema}} of this install, from its own manifest only (no providers).

    Cheap (one small JSON file, read once): aotinfer calls it to define its torch ops. Raises
    NotBuiltError (BrokenInstall when the manifest is unreadable or corrupted) saying how to repair.
    """
    return {name: dict(entry["functions"]) for name, entry in _main_manifest()["modules"].items()}


@functools.lru_cache(maxsize=None)
def manifest() -> Dict[str, Any]:
    """The build's manifest: versions, arch list, and every module's builds with their sha256.

    Builds from provider packages (PROVIDER_GROUP) are added for archs this install lacks; each
    build records the directory of its file under "dir". A provider whose manifest does not fit
    is skipped with one warning. Read once, on first use.
    """
    main = _main_manifest()
    merged = dict(main, modules={
        name: dict(entry, builds={arch: dict(build, dir=OPS_DIR) for arch, build in entry["builds"].items()})
        for name, entry in main["modules"].items()
    })
    for name, ops_dir, provided in provider_manifests(main):
        for module, entry in provided["modules"].items():
            if module not in merged["modules"]:
                continue
            builds = merged["modules"][module]["builds"]
            for arch, build in entry["builds"].items():
                if arch not in builds:
                    builds[arch] = dict(build, dir=ops_dir, provider=name)
    return merged


def provider_manifests(main: Dict[str, Any]):
    """(entry point name, _ops directory, manifest) of each usable provider package.

    A provider is skipped, with one warning naming it, when its package is missing, its manifest
    is unreadable or malformed, or it was built for another aotinfer version or CUDA version.
    """
    from importlib import metadata
    from importlib.util import find_spec

    try:
        points = list(metadata.entry_points(group=PROVIDER_GROUP))
    except Exception as e:  # a broken distribution's metadata
        _warn(f"aotinfer: cannot list provider packages ({e!r}); using this install's builds only")
        return
    for point in points:
        try:
            spec = find_spec(point.value)
            if spec is None or not spec.submodule_search_locations:
                raise ValueError(f"package {point.value!r} is not installed")
            ops_dir = os.path.join(list(spec.submodule_search_locations)[0], "_ops")
            provided = _read_manifest(os.path.join(ops_dir, "manifest.json"))
            for key in ("package_version", "cuda_version"):
                if provided[key] != main[key]:
                    raise ValueError(f"built for {key} {provided[key]}, this aotinfer has {main[key]}")
        except Exception as e:
            _warn(f"aotinfer: provider {point.name!r} ({point.value}) skipped: {e}")
            continue
        yield point.name, ops_dir, provided


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
    sm_majors = module_entry(name)["sm_majors"]
    try:
        choice = choose_arch(cc, builds, sm_majors)
    except NoCompatibleBuild as e:
        if sm_majors is not None and cc[0] not in sm_majors:
            raise NoCompatibleBuild(f"aotinfer module {name!r}: {e}") from None
        raise NoCompatibleBuild(f"aotinfer module {name!r}: {e}. {no_build_advice(cc)}") from None
    build = builds[choice.arch]
    return choice, os.path.join(build["dir"], build["file"])


def no_build_advice(cc: Tuple[int, int]) -> str:
    """What to install or build for a GPU no build of this install runs on, as commands that work."""
    cuda_major = int(manifest()["cuda_version"].split(".")[0])
    arch, why = build_advice(cc, cuda_major)
    if arch is None:
        return why[0].upper() + why[1:] + "."
    return (
        f"To add this GPU: {why}; or build from a checkout of aotinfer {manifest()['package_version']}"
        f" with CUDA {cuda_major}: AOTINFER_CUDA_ARCH_LIST=\"{arch}\" pip install ."
    )


def verify(cached: bool = False) -> List[Tuple[str, Optional[str]]]:
    """(path, problem or None) for every file the manifests list: this install's and providers'.

    Hashes every file (``python -m aotinfer verify``; afresh unless ``cached``); the loader checks
    each file it loads the same way (``file_problem``), once per process.
    """
    main = _main_manifest()
    sources = [(OPS_DIR, main)] + [(ops_dir, m) for _, ops_dir, m in provider_manifests(main)]
    results = []
    for ops_dir, listed in sources:
        files = [build for entry in listed["modules"].values() for build in entry["builds"].values()]
        if isinstance(listed.get("runtime"), dict):
            files.append(listed["runtime"])
        for build in files:
            path = os.path.join(ops_dir, build["file"])
            results.append((path, file_problem(path, build, cached=cached)))
    return results


#: path -> ((size, mtime_ns, inode), problem or None): the verdicts of file_problem in this process.
_verdicts: Dict[str, Tuple[Tuple[int, int, int], Optional[str]]] = {}


def file_problem(path: str, build: Dict[str, Any], cached: bool = True) -> Optional[str]:
    """What is wrong with the file at ``path`` that the manifest entry ``build`` describes, in the
    words ``verify`` prints ('missing', 'has 4096 bytes, the manifest says 776520', 'sha256 differs
    from the manifest'); None when it is intact.

    The size first, then the sha256 (a few ms for a 1-2 MB object, docs/design/loader.md). With
    ``cached``, a verdict is kept for the process while the file's size, mtime and inode stay the
    same: several devices of one arch load the same file, and ``info`` asks for every file.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    expected = build.get("size")
    if expected is not None and st.st_size != expected:
        # Truncated files are common (a full disk, a killed copy) and dlopen would map them and
        # crash (SIGBUS) instead of reporting; this says so without reading the file.
        return f"has {st.st_size} bytes, the manifest says {expected}"
    stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
    verdict = _verdicts.get(path) if cached else None
    if verdict is not None and verdict[0] == stamp:
        return verdict[1]
    from hashlib import sha256

    digest = sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError as e:
        return f"unreadable ({e.strerror})"
    problem = None if digest.hexdigest() == build.get("sha256") else "sha256 differs from the manifest"
    _verdicts[path] = (stamp, problem)
    return problem


#: ELF e_machine of the machines aotinfer builds for, by ``platform.machine()``.
_ELF_MACHINES = {"x86_64": 62, "AMD64": 62, "aarch64": 183, "arm64": 183}


def elf_problem(path: str) -> Optional[str]:
    """Why the dynamic loader would refuse ``path`` from its ELF header alone, or None: not an
    ELF file, not a shared object, or built for another machine. Reads 20 bytes; ``info`` asks
    it of each file a GPU would load, where the file's sha256 may match a manifest that lists a
    bad object."""
    import platform
    import struct

    try:
        with open(path, "rb") as f:
            header = f.read(20)
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if len(header) < 20 or header[:4] != b"\x7fELF":
        return "not an ELF file, which the dynamic loader refuses"
    little = header[5] == 1
    e_type, e_machine = struct.unpack("<HH" if little else ">HH", header[16:20])
    if e_type != 3:  # ET_DYN
        return f"an ELF file of type {e_type}, not a shared object, which the dynamic loader refuses"
    want = _ELF_MACHINES.get(platform.machine())
    if header[4] != 2 or (want is not None and e_machine != want):
        return f"an ELF object for another machine (e_machine {e_machine}), not this {platform.machine()}"
    return None
