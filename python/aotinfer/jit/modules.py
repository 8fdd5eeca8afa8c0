"""JIT specs of the modules of modules.toml, and the loader's fallback to them.

Each module's spec comes from its modules.toml entry (sources, sm_majors), read from the kernel
sources this install carries (``aotinfer/_src``: modules.toml, include/, csrc/), or from the
checkout when aotinfer runs from one. One spec per (module, arch), named like the wheel's
objects (``scale_sm103a``).

The loader asks here only once the installed builds (wheel, providers) have none for a GPU:
``resolve`` picks a checked build from the JIT cache (``_arch.choose_arch`` over what is cached,
so a prebuilt ``10.0f`` serves a 10.3 GPU), else compiles one for the GPU's own arch when nvcc is
found and ``AOTINFER_JIT`` is not ``0``, else raises NoCompatibleBuild saying what was tried.
"""

from __future__ import annotations

import os
from pathlib import Path

from .._arch import Arch, Choice, NoCompatibleBuild, choose_arch, parse_arch_list, supported_archs
from . import cache, core, toolchain
from .core import JitSpec, JitUnavailable, kernel_source_dir, packaged_source_dir

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

def declarations(root: Optional[Path] = None) -> Dict[str, Dict[str, Any]]:
    """The module declarations of ``root``/modules.toml (default: ``kernel_source_dir()``)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        import tomli as tomllib

    root = root or kernel_source_dir()
    if root is None:
        raise JitUnavailable("this install carries no kernel sources (aotinfer/_src is missing)")
    with open(root / "modules.toml", "rb") as f:
        return tomllib.load(f)


def gen_module_spec(name: str, arch: Union[str, Arch], source_dir: Optional[Path] = None) -> JitSpec:
    """The spec of module ``name`` of modules.toml for one arch ('10.3a', '12.0+PTX')."""
    root = Path(source_dir) if source_dir is not None else kernel_source_dir()
    if root is None:
        raise JitUnavailable("this install carries no kernel sources (aotinfer/_src is missing)")
    decls = declarations(root)
    if name not in decls:
        raise KeyError(f"modules.toml has no module {name!r}; it has: {', '.join(decls)}")
    arch = Arch.parse(arch) if isinstance(arch, str) else arch
    majors = decls[name].get("sm_majors")
    if not supported_archs([arch], majors):
        raise ValueError(f"module {name!r} runs only on SM majors {majors}, not on {arch}")
    return JitSpec(
        name=name,
        sources=[(root / s).resolve() for s in decls[name]["sources"]],
        extra_cflags=[],
        extra_cuda_cflags=[],
        extra_ldflags=[],
        extra_include_dirs=[],
        arch_list=(arch,),
        module=name,
        source_dir=root.resolve(),
        cutedsl=(root / decls[name]["cutedsl"]).resolve() if decls[name].get("cutedsl") else None,
    )


def module_specs(arch_list: Union[str, Sequence[Arch], None] = None,
                 modules: Optional[Sequence[str]] = None,
                 source_dir: Optional[Path] = None) -> List[JitSpec]:
    """Specs of ``modules`` (default: all of modules.toml) for each arch of ``arch_list`` each
    supports, as the wheel build plans them (default archs: the current compilation context's)."""
    from .. import compilation_context

    if arch_list is None:
        archs = compilation_context.current_compilation_context.target_archs()
    else:
        archs = parse_arch_list(arch_list) if isinstance(arch_list, str) else tuple(arch_list)
    decls = declarations(source_dir)
    specs = []
    for name in modules or decls:
        if name not in decls:
            raise KeyError(f"modules.toml has no module {name!r}; it has: {', '.join(decls)}")
        for arch in supported_archs(archs, decls[name].get("sm_majors")):
            specs.append(gen_module_spec(name, arch, source_dir))
    return specs


def cached_builds(name: str) -> Dict[Arch, cache.Entry]:
    """The checked cache entries of module ``name`` built from the current sources, by arch.

    Where nvcc is found, only entries it built count (a new toolkit means new builds).
    """
    root = cache.open_root(create=False)
    if root is None:
        return {}
    tools = toolchain.find()
    found = {}
    for entry in cache.entries(root, f"{name}_sm"):
        record = entry.read_sidecar()
        if not record or record.get("module") != name or len(record.get("archs", ())) != 1:
            continue
        try:
            spec = gen_module_spec(name, record["archs"][0])
        except (ValueError, TypeError):  # an arch the module no longer supports, or a damaged record
            continue
        if record.get("inputs_key") != spec.inputs_key():
            continue
        if tools is not None and entry.key != spec.entry(root, tools).key:
            continue
        if entry.problem() is None:
            found[spec.arch_list[0]] = entry
    return found


def jit_builds_off() -> Optional[str]:
    """Why this process will not compile (AOTINFER_JIT=0, no nvcc, no sources), or None."""
    setting = os.environ.get("AOTINFER_JIT", "").strip()
    if setting.lower() in ("0", "false", "off", "no"):
        return f"turned off by AOTINFER_JIT={setting}"
    if kernel_source_dir() is None:
        return "impossible: this install carries no kernel sources"
    if toolchain.find() is None:
        return f"impossible: {toolchain.why_not_found()}"
    return None


def module_builds_off(name: str) -> Optional[str]:
    """Why this process will not compile module ``name`` (jit_builds_off, or a module written in
    CuTeDSL where the DSL is not installed), or None."""
    off = jit_builds_off()
    if off is None and declarations().get(name, {}).get("cutedsl") and not core.dsl_available():
        # Its kernels are compiled by CuTeDSL (cmake/cutedsl.py), which a server need not have.
        off = f"impossible: {core.DSL_MISSING}"
    return off


def prebuild_command(name: str, cc: Tuple[int, int]) -> str:
    return f"python -m aotinfer build {name} --cc {cc[0]}.{cc[1]}"


def resolve(name: str, cc: Tuple[int, int], tried: str = "", build: bool = True) -> Tuple[Choice, str]:
    """The JIT build module ``name`` loads on compute capability ``cc``: cached, else built now.

    For the loader, once the installed builds have none for ``cc`` (``tried`` says so). Raises
    NoCompatibleBuild, saying what was tried and how to build, when neither applies; with
    ``build=False`` (for questions such as "do all GPUs load one file?") it never compiles.
    """
    cc = (int(cc[0]), int(cc[1]))
    cc_text = f"{cc[0]}.{cc[1]}"
    tried = (tried or f"aotinfer module {name!r}: no installed build runs on compute capability {cc_text}").rstrip(".")
    also = []  # what was tried here, for the error

    def unavailable(why: str) -> NoCompatibleBuild:
        also.append(why)
        return NoCompatibleBuild(
            f"{tried}. Also tried {' and '.join(also)}. Or prebuild into the JIT cache where nvcc is:"
            f" {prebuild_command(name, cc)}"
        )

    root = kernel_source_dir()
    if root is None:
        raise unavailable("a JIT build (impossible: this install carries no kernel sources, aotinfer/_src)")
    majors = declarations(root)[name].get("sm_majors")
    if majors is not None and cc[0] not in majors:
        raise NoCompatibleBuild(f"{tried}; module {name!r} runs only on SM majors {majors}")
    try:
        found = cached_builds(name)
    except cache.CacheDirError as e:
        raise unavailable(f"the JIT cache (refused: {e})") from None
    try:
        choice = choose_arch(cc, found)
    except NoCompatibleBuild:
        also.append(f"the JIT cache {cache.cache_root()} (nothing for {cc_text})")
    else:
        return Choice(choice.arch, choice.jit, f"JIT cache: {choice.reason}"), str(found[choice.arch].library)
    off = module_builds_off(name) if build else "not attempted: build=False"
    if off is not None:
        raise unavailable(f"a JIT build ({off})")
    tools = toolchain.find()
    arch = tools.arch_for(cc)
    if arch is None:
        raise unavailable(f"a JIT build (nvcc {tools.cuda_version} at {tools.nvcc} cannot build for {cc_text})")
    path = gen_module_spec(name, arch, root).build(
        why=f"no installed build of module {name!r} runs on compute capability {cc_text}",
        prebuild=prebuild_command(name, cc),
    )
    return Choice(arch, arch.ptx and (arch.major, arch.minor) != cc, f"JIT build of {arch.sass}"), str(path)


def find_or_build(name: str, cc: Tuple[int, int]) -> Optional[str]:
    """Path of a JIT object of module ``name`` for compute capability ``cc``, cached or built now;
    None when the JIT does not apply (see ``resolve`` for the reason)."""
    try:
        return resolve(name, cc)[1]
    except NoCompatibleBuild:
        return None


def cached_choice(name: str, cc: Tuple[int, int]) -> Optional[Tuple[Choice, str]]:
    """Like ``resolve`` but never builds: the cached build ``cc`` would load, or None."""
    try:
        found = cached_builds(name)
        choice = choose_arch(cc, found)
    except (NoCompatibleBuild, JitUnavailable, cache.CacheDirError, KeyError):
        return None
    return Choice(choice.arch, choice.jit, f"JIT cache: {choice.reason}"), str(found[choice.arch].library)
