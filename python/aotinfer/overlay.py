"""The ``flashinfer`` overlay: an unmodified server's ``import flashinfer`` served by aotinfer.

With ``AOTINFER_FLASHINFER=1`` (or ``all``, or families: ``sampling,decode``) in the environment,
``import flashinfer`` in the process, and in every process it starts, gives a module in which each
name aotinfer ships in an enabled family is aotinfer's own object, at FlashInfer's module path:
``flashinfer.softmax`` and ``flashinfer.sampling.softmax`` are ``aotinfer.softmax``. Every other
name is the real FlashInfer's when it is installed, imported on first access: a FlashInfer module
nobody uses is never imported, so never JIT-compiled. Without a real FlashInfer an unshipped name
still imports (``from flashinfer import X`` at a server's module top works) and raises
NotServedError, naming it, when called.

The one design choice to know: the real FlashInfer is imported under another name,
``aotinfer._real_flashinfer``, and never runs its ``__init__`` unless a name it defines only there
is asked for. Its modules import one another by relative imports, so they see FlashInfer's own
classes (a FlashInfer wrapper built on FlashInfer's prefill keeps working), while the server's
``flashinfer`` is the overlay. docs/design/overlay.md has the rest.

Switches on: ``aotinfer_overlay.pth`` (installed with the wheel) imports the tiny
``_aotinfer_overlay_hook`` at Python start when the variable is set, and that hook calls
``install_from_environment`` at the first ``import flashinfer``; ``install(families)`` for code
that wants it explicitly; ``vllm_plugin`` for vLLM's ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import threading
import types
import warnings

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

ENV = "AOTINFER_FLASHINFER"
#: family -> the aotinfer modules whose public ops it serves at ``flashinfer.<family>``
FAMILIES: Dict[str, Tuple[str, ...]] = {
    "activation": ("activation",),
    "cascade": ("cascade",),
    "decode": ("decode",),
    "mla": ("mla",),
    "norm": ("norm", "norm_quant"),
    "page": ("page",),
    "prefill": ("prefill",),
    "quantization": ("quantization",),
    "rope": ("rope",),
    "sampling": ("sampling",),
}
#: Families served only where named (``AOTINFER_FLASHINFER=mla,...``), not by ``1``/``all``: servers'
#: MLA backends reach into FlashInfer's MLA wrapper further than aotinfer's serves (SGLang's
#: ``fast_mla_decode_plan`` calls its ``_cached_module.plan``), and its kernel is not yet as fast
#: (docs/design/mla.md).
OPT_IN = frozenset({"mla"})
#: What ``1``/``all`` and ``install()`` serve.
DEFAULT_FAMILIES: Tuple[str, ...] = tuple(f for f in FAMILIES if f not in OPT_IN)
#: Served at their family's module only: FlashInfer's ``__init__`` does not export them.
NOT_AT_TOP = frozenset({"rope_quantize_fp8", "mla_rope_quantize_fp8"})
#: Names that servers import from a family's module where FlashInfer has them beside that module's
#: own ops, served there from aotinfer's module of that name (vLLM's flashinfer backend imports the
#: private ``flashinfer.decode._get_range_buf``; SGLang's ``flashinfer.decode.get_seq_lens``, which
#: FlashInfer's decode module imports from its page module).
INTERNALS: Dict[str, Tuple[str, ...]] = {"decode": ("_get_range_buf", "get_seq_lens")}
#: The FlashInfer release whose API aotinfer follows. Without a real FlashInfer,
#: ``flashinfer.__version__`` is this with a local label: version checks such as
#: ``Version(v) >= Version("0.7.0")`` and ``v in SpecifierSet("==0.7.2.post1")`` accept it.
FLASHINFER_API_VERSION = "0.7.2.post1"
STANDIN_VERSION = FLASHINFER_API_VERSION + "+aotinfer"
REAL = "aotinfer._real_flashinfer"  # the name the real FlashInfer's package is imported under
_TRUE = {"1", "all", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}

logger = logging.getLogger("aotinfer.overlay")


class NotServedError(ImportError):
    """A name of ``flashinfer`` that aotinfer does not serve was used, and FlashInfer is not
    installed (an ImportError: the import the server would have failed at, deferred to the use)."""


def parse_families(text: str) -> Optional[Tuple[str, ...]]:
    """The families ``AOTINFER_FLASHINFER=text`` enables, in FAMILIES' order; None when off."""
    value = text.strip().lower()
    if value in _FALSE:
        return None
    if value in _TRUE:
        return DEFAULT_FAMILIES
    return _check_families(value.split(","))


def _check_families(families: Union[str, Iterable[str]]) -> Tuple[str, ...]:
    if isinstance(families, str):
        families = families.split(",")
    try:
        chosen = {f.strip() for f in families if f.strip()}
    except (TypeError, AttributeError):
        raise TypeError(f"Expected families to be None or family names, got {families!r}") from None
    unknown = sorted(chosen - set(FAMILIES))
    if unknown or not chosen:
        what = f"unknown families {unknown}" if unknown else "no family named"
        raise ValueError(f"{what}: choose from {', '.join(FAMILIES)}, or 1 for all but {', '.join(sorted(OPT_IN))}")
    return tuple(f for f in FAMILIES if f in chosen)


def served(families: Iterable[str]) -> Dict[str, Dict[str, Any]]:
    """Module path -> {name: aotinfer's object} the overlay serves for ``families``: each family's
    ``flashinfer.<family>`` and the top-level ``flashinfer``."""
    import aotinfer

    family_of = {module: family for family, modules in FAMILIES.items() for module in modules}
    result: Dict[str, Dict[str, Any]] = {"flashinfer": {}}
    result.update({f"flashinfer.{family}": {} for family in families})
    for name in aotinfer.__all__:
        obj = getattr(aotinfer, name)
        family = family_of.get(getattr(obj, "__module__", "").rpartition(".")[2])
        if family in families:
            result[f"flashinfer.{family}"][name] = obj
            if name not in NOT_AT_TOP:
                result["flashinfer"][name] = obj
    for family, names in INTERNALS.items():
        if family in families:
            module = importlib.import_module(f"aotinfer.{FAMILIES[family][0]}")
            result[f"flashinfer.{family}"].update({name: getattr(module, name) for name in names})
    return result


# ---- stand-ins: flashinfer.utils helpers servers call, for when FlashInfer is not installed ----


def _cuda_device(device: Any) -> Any:
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"Expected device to be a CUDA device, got {device}")
    return device


def get_compute_capability(device: Any) -> Tuple[int, int]:
    """(major, minor) of a CUDA device (FlashInfer's flashinfer.utils helper)."""
    from . import _loader
    import torch

    device = _cuda_device(device)
    return _loader.device_capability(torch.cuda.current_device() if device.index is None else device.index)


def get_device_sm_count(device: Any) -> int:
    """The number of SMs of a CUDA device (FlashInfer's flashinfer.utils helper)."""
    import torch

    return torch.cuda.get_device_properties(_cuda_device(device)).multi_processor_count


def _arch_query(name: str, major: int, minor: Optional[int], cuda: Tuple[int, int]):
    def query(device: Any) -> bool:
        import torch

        cc = get_compute_capability(device)
        torch_cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
        return cc[0] == major and minor in (None, cc[1]) and torch_cuda >= cuda

    query.__name__ = query.__qualname__ = name
    query.__doc__ = (f"Whether a CUDA device is of SM {major}.{'x' if minor is None else minor} and torch's"
                     f" CUDA is {cuda[0]}.{cuda[1]} or newer (FlashInfer's flashinfer.utils helper).")
    return query


def _utils_standins() -> Dict[str, Any]:
    from .utils import device_support_pdl

    queries = {  # name: (SM major, minor or None for any, the CUDA that first compiles for it)
        "is_sm90a_supported": (9, None, (12, 3)),
        "is_sm100a_supported": (10, None, (12, 8)),
        "is_sm100f_supported": (10, None, (12, 9)),
        "is_sm110a_supported": (11, None, (13, 0)),
        "is_sm120a_supported": (12, 0, (12, 8)),
        "is_sm120f_supported": (12, None, (12, 9)),
        "is_sm121a_supported": (12, 1, (12, 9)),
    }
    names = {name: _arch_query(name, *spec) for name, spec in queries.items()}
    names.update(device_support_pdl=device_support_pdl, get_compute_capability=get_compute_capability,
                 get_device_sm_count=get_device_sm_count)
    return names


# ---- placeholders for unshipped names when FlashInfer is not installed --------------------------


class _Unserved(type):
    """The metaclass of a placeholder: calling it (or a subclass of it) raises NotServedError;
    reading any attribute it lacks raises AttributeError in the same words, so ``hasattr`` and
    ``getattr(x, name, None)`` probes answer no."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise NotServedError(cls._why, name=cls.__module__)

    def __getattr__(cls, attr: str) -> Any:
        raise AttributeError(f"{cls._why} (reading .{attr})")

    def __repr__(cls) -> str:
        return f"<{cls.__module__}.{cls.__qualname__}: not served: {cls._why}>"


def _placeholder(module: str, name: str, why: str) -> type:
    return _Unserved(name, (), {"__module__": module, "__qualname__": name, "__doc__": why, "_why": why})


# ---- the overlay -------------------------------------------------------------------------------


class _Overlay:
    """The modules of one installed overlay: which names it serves, where the real FlashInfer is."""

    def __init__(self, families: Tuple[str, ...]) -> None:
        self.families = families
        self.served = served(families)
        self.all_shipped = served(tuple(FAMILIES))
        self.modules: Dict[str, types.ModuleType] = {}
        self.placeholders: Dict[str, type] = {}
        self.real_spec = _find_real()
        self.real_paths = list(self.real_spec.submodule_search_locations) if self.real_spec else None
        self.real_top: Optional[types.ModuleType] = None  # REAL, made by real_module
        self.real_names: Optional[Dict[str, Tuple[str, Optional[str], bool]]] = None  # see real_attr
        self.real_init_ran = False
        if self.real_spec is None:
            self.served["flashinfer.utils"] = _utils_standins()

    # Which name is which kind of module.
    def spec(self, name: str, path: Any) -> Optional[importlib.machinery.ModuleSpec]:
        if name == REAL:
            return self._spec(name, self.real_paths, self.real_module) if self.real_spec else None
        if name in self.served:
            return self._spec(name, self._real_locations(name), lambda: self.overlay_module(name))
        if self.real_spec is None or path is None:
            return None
        real = importlib.machinery.PathFinder.find_spec(name, path)
        if real is None:
            return None
        alias = REAL + name[len("flashinfer"):]
        return self._spec(name, real.submodule_search_locations, lambda: importlib.import_module(alias))

    @staticmethod
    def _spec(name: str, locations: Optional[List[str]], make: Any) -> importlib.machinery.ModuleSpec:
        spec = importlib.machinery.ModuleSpec(name, _Loader(make), origin="aotinfer.overlay",
                                              is_package=locations is not None)
        if locations is not None:
            spec.submodule_search_locations = list(locations)
        return spec

    def _real_locations(self, name: str) -> Optional[List[str]]:
        """The real package's folders for an overlay module (so its real submodules import);
        [] for the top without a real FlashInfer; None for a plain module."""
        if name == "flashinfer":
            return self.real_paths or []
        if self.real_spec is None:
            return None
        real = importlib.machinery.PathFinder.find_spec(name, self.real_paths)
        return None if real is None or real.submodule_search_locations is None else list(real.submodule_search_locations)

    def overlay_module(self, name: str) -> types.ModuleType:
        module = self.modules.get(name)
        if module is not None:
            return module
        module = self.modules[name] = types.ModuleType(name, f"{name}, served by aotinfer's flashinfer overlay"
                                                             " (aotinfer.overlay, docs/design/overlay.md)")
        module.__dict__.update(self.served[name])
        module.__getattr__ = lambda attr: self.fall_through(name, attr)
        if name == "flashinfer":
            if self.real_spec is None:
                module.__version__ = STANDIN_VERSION
            logger.info("%s", self.summary())
        elif self.real_spec is not None:
            real = importlib.machinery.PathFinder.find_spec(name, self.real_paths)
            if real is not None and real.has_location:
                module.__file__ = real.origin  # without importing it
        return module

    def fall_through(self, module: str, attr: str) -> Any:
        """An attribute an overlay module does not serve: the real FlashInfer's, else a placeholder."""
        if module == "flashinfer":
            submodule = f"flashinfer.{attr}"
            if submodule in self.served or (
                    self.real_spec is not None and importlib.machinery.PathFinder.find_spec(submodule, self.real_paths)):
                return importlib.import_module(submodule)
        if self.real_spec is not None:
            if module == "flashinfer":
                return self.real_attr(attr)
            if attr.startswith("__"):  # never import the real module for a probe of dunders
                raise AttributeError(f"module {module!r} has no attribute {attr!r}")
            return getattr(importlib.import_module(REAL + module[len("flashinfer"):]), attr)
        if attr.startswith("__"):
            raise AttributeError(f"module {module!r} has no attribute {attr!r}")
        key = f"{module}.{attr}"
        if key not in self.placeholders:
            self.placeholders[key] = _placeholder(module, attr, self.why_not_served(module, attr))
        return self.placeholders[key]

    def why_not_served(self, module: str, attr: str) -> str:
        family = next((p.rpartition(".")[2] for p, names in self.all_shipped.items()
                       if p != "flashinfer" and attr in names), None)
        value = os.environ.get(ENV)
        setting = f"{ENV}={value!r}" if value is not None else f"install({list(self.families)})"
        if family is not None and family not in self.families:
            what = f"aotinfer ships {module}.{attr} in family {family!r}, which {setting} does not enable"
        elif family is not None:
            what = f"{module}.{attr} is not a FlashInfer name: FlashInfer has it at flashinfer.{family}"
        else:
            what = f"aotinfer does not serve {module}.{attr}"
        return f"{what}, and FlashInfer is not installed (pip install flashinfer-python=={FLASHINFER_API_VERSION})"

    # The real FlashInfer, under REAL.
    def real_module(self) -> types.ModuleType:
        """REAL: the real package's module with its folders and file, its __init__ not run."""
        if self.real_top is None:
            self.real_top_spec = importlib.util.spec_from_file_location(
                REAL, self.real_spec.origin, submodule_search_locations=self.real_paths)
            module = importlib.util.module_from_spec(self.real_top_spec)
            module.__getattr__ = self.real_attr
            self.real_top = sys.modules[REAL] = module
        return self.real_top

    def real_attr(self, attr: str) -> Any:
        """A top-level name of the real FlashInfer, from the module its __init__ imports it from
        (read from the file, not run); a name __init__ defines itself runs the whole __init__ once."""
        real = self.real_module()
        if attr in real.__dict__:
            return real.__dict__[attr]
        if self.real_names is None:
            import ast  # here: only a FlashInfer installed beside aotinfer needs it

            with open(self.real_spec.origin, encoding="utf-8") as f:
                self.real_names = _relative_imports(ast.parse(f.read()).body, False)
        where = self.real_names.get(attr)
        if where is not None:
            submodule, name, conditional = where
            try:
                module = importlib.import_module(f"{REAL}.{submodule}")
            except ImportError as e:
                if not conditional:
                    raise
                raise AttributeError(f"module 'flashinfer' has no attribute {attr!r} ({e})") from e
            return module if name is None else getattr(module, name)
        if attr.startswith("__") or self.real_init_ran:
            raise AttributeError(f"module 'flashinfer' has no attribute {attr!r}")
        if importlib.machinery.PathFinder.find_spec(f"{REAL}.{attr}", self.real_paths) is not None:
            # A submodule: FlashInfer's own `from . import x` asks for it by hasattr first.
            return importlib.import_module(f"{REAL}.{attr}")
        self.real_init_ran = True
        self.real_top_spec.loader.exec_module(real)  # FlashInfer's __init__, its imports all under REAL
        return getattr(real, attr)

    def summary(self) -> str:
        count = len(set().union(*(names for path, names in self.served.items() if path != "flashinfer.utils")))
        families = ", ".join(self.families)
        if self.real_spec is None:
            rest = (f"FlashInfer is not installed: every other name imports and raises NotServedError"
                    f" when used; flashinfer.__version__ is {STANDIN_VERSION}")
        else:
            rest = f"FlashInfer at {self.real_paths[0]} serves every other name, imported on first use"
        return f"aotinfer serves flashinfer's {families} ({count} names); {rest}"


def _relative_imports(body: List[Any], conditional: bool) -> Dict[str, Tuple[str, Optional[str], bool]]:
    """name -> (submodule, attribute or None for the submodule itself, whether the import is inside
    an if/try/with) for every ``from .x import y as name`` at module level of ``body``."""
    import ast

    found: Dict[str, Tuple[str, Optional[str], bool]] = {}
    for node in body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            for alias in node.names:
                if node.module:
                    found[alias.asname or alias.name] = (node.module, alias.name, conditional)
                else:
                    found[alias.asname or alias.name] = (alias.name, None, conditional)
        for block in ("body", "orelse", "finalbody", "handlers"):
            if isinstance(node, (ast.If, ast.Try, ast.With, ast.ExceptHandler)) and hasattr(node, block):
                found.update(_relative_imports(getattr(node, block), True))
    return found


def _find_real() -> Optional[importlib.machinery.ModuleSpec]:
    """The spec of an installed FlashInfer package on sys.path, found without importing it."""
    spec = importlib.machinery.PathFinder.find_spec("flashinfer")
    if spec is None or not spec.has_location or spec.submodule_search_locations is None:
        return None  # absent, or a namespace folder that holds no package
    return spec


class _Loader(importlib.abc.Loader):
    """Hands the import system a module made elsewhere: an overlay module, or the real one."""

    def __init__(self, make: Any) -> None:
        self.make = make
        self.own_spec = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = self.make()
        self.own_spec = getattr(module, "__spec__", None)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system set __spec__ to the overlay's spec: a real module keeps its own.
        if self.own_spec is not None:
            module.__spec__ = self.own_spec


class _Finder(importlib.abc.MetaPathFinder):
    """sys.meta_path's first entry while the overlay is installed: answers for ``flashinfer``,
    its submodules and REAL; None (the next finder's turn) for everything else."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if name != "flashinfer" and not name.startswith("flashinfer.") and name != REAL:
            return None
        overlay = _overlay
        return overlay.spec(name, path) if overlay is not None else None


_FINDER = _Finder()
_overlay: Optional[_Overlay] = None
_lock = threading.Lock()


def install(families: Optional[Union[str, Iterable[str]]] = None) -> None:
    """Make ``import flashinfer`` in this process serve aotinfer's ops of ``families`` (None:
    DEFAULT_FAMILIES, every family but the opt-in ones; a list or a comma-separated string) and the real FlashInfer's, when installed,
    for every other name. Processes this one starts get it through AOTINFER_FLASHINFER, not this
    call. Calling again with the same families does nothing; with others, it replaces the overlay
    unless flashinfer was imported already (RuntimeError, as for a flashinfer imported before)."""
    global _overlay
    chosen = DEFAULT_FAMILIES if families is None else _check_families(families)
    with _lock:
        if _overlay is not None and _overlay.families == chosen:
            return
        imported = sys.modules.get("flashinfer")
        if imported is not None:
            ours = _overlay is not None and imported is _overlay.modules.get("flashinfer")
            what = f"the overlay for {', '.join(_overlay.families)}" if ours else repr(imported)
            raise RuntimeError(
                f"flashinfer was imported already ({what}): an overlay for {', '.join(chosen)} can take over"
                f" flashinfer only before its first import; set {ENV} in the process's environment instead")
        _overlay = _Overlay(chosen)
        sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "aotinfer_overlay_hook", False)]
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)


def install_from_environment() -> bool:
    """install() with the families AOTINFER_FLASHINFER names; False (nothing installed) when it is
    unset or off, or names an unknown family (warned)."""
    try:
        families = parse_families(os.environ.get(ENV, ""))
    except ValueError as e:
        warnings.warn(f"{ENV}={os.environ.get(ENV)!r}: {e}; the flashinfer overlay stays off", RuntimeWarning,
                      stacklevel=2)
        return False
    if families is None:
        return False
    install(families)
    return True


def find_spec(name: str, path: Any = None, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
    """The installed overlay's answer for a module name (the start-up hook's first question)."""
    return _FINDER.find_spec(name, path, target)


# vLLM's has_flashinfer() takes FlashInfer only where its kernels need no compiler (this variable,
# or the flashinfer-cubin package) or where nvcc and ninja are there for its JIT.
VLLM_NO_JIT_NEEDED = "VLLM_HAS_FLASHINFER_CUBIN"


def vllm_plugin() -> None:
    """vLLM's general plugin (entry point ``aotinfer_flashinfer`` of ``vllm.general_plugins``, run in
    every vLLM process): installs the overlay when AOTINFER_FLASHINFER is set and the start-up hook
    has not (aotinfer outside site-packages, ``python -S``). Without a real FlashInfer, every
    FlashInfer name vLLM can reach is then aotinfer's compiled kernel or an error naming it, so
    nothing of FlashInfer's compiles: the plugin sets VLLM_HAS_FLASHINFER_CUBIN=1 (unless set),
    else vLLM refuses its FlashInfer paths on a machine without nvcc. With a real FlashInfer,
    vLLM's own check stands: the names not served are FlashInfer's and may need its JIT. Never
    raises into vLLM."""
    if not os.environ.get(ENV):
        return
    if _overlay is None:
        try:
            if not install_from_environment():
                return
        except RuntimeError as e:
            logger.warning("%s", e)
            return
    if VLLM_NO_JIT_NEEDED not in os.environ and _find_real() is None:
        os.environ[VLLM_NO_JIT_NEEDED] = "1"
        logger.info("aotinfer: %s=1 for vLLM: the flashinfer overlay serves compiled kernels, and no FlashInfer "
                    "is installed to compile anything", VLLM_NO_JIT_NEEDED)


def state() -> Dict[str, Any]:
    """What ``python -m aotinfer info`` reports: the variable, the families, whether this process
    has the overlay (installed, or the start-up hook waiting for the first import of flashinfer),
    the real FlashInfer, and the names served per module path."""
    from importlib import metadata

    text = os.environ.get(ENV)
    error = None
    try:
        families = parse_families(text or "")
    except ValueError as e:
        families, error = None, str(e)
    if _overlay is not None:
        families, in_process = _overlay.families, "installed"
    elif any(getattr(f, "aotinfer_overlay_hook", False) for f in sys.meta_path):
        in_process = "start-up hook waiting for the first import of flashinfer"
    elif families:
        in_process = ("not installed: the start-up hook did not run (aotinfer outside site-packages, or"
                      " python -S), so processes started this way do not get the overlay")
    else:
        in_process = "not installed"
    real = _find_real()
    try:
        version = metadata.version("flashinfer-python") if real else None
    except metadata.PackageNotFoundError:
        version = None
    names = served(families or ())
    return {
        "variable": text,
        "error": error,
        "families": list(families or ()),
        "in_this_process": in_process,
        "flashinfer": None if real is None else {"path": real.submodule_search_locations[0], "version": version},
        "standin_version": STANDIN_VERSION,
        "served": {path: sorted(n) for path, n in names.items() if n} if families else {},
    }


def format_state(report: Dict[str, Any]) -> List[str]:
    """``info``'s lines about the overlay."""
    real = report["flashinfer"]
    where = "FlashInfer: not installed" if real is None else f"FlashInfer: {real['version'] or 'version unknown'} at {real['path']}"
    if not report["families"]:
        why = f"{ENV}={report['variable']!r}: {report['error']}" if report["error"] else (
            f"{ENV} is {'unset' if report['variable'] is None else repr(report['variable'])};"
            f" set it to 1 or to families: {','.join(FAMILIES)}")
        return [f"flashinfer overlay: off ({why})", f"  {where}"]
    where += " (unserved names raise NotServedError when used)" if real is None else " (serves every other name)"
    lines = [f"flashinfer overlay: on for {', '.join(report['families'])} ({ENV}={report['variable']!r});"
             f" in this process: {report['in_this_process']}", f"  {where}"]
    lines += [f"  {path}: {', '.join(names)}" for path, names in report["served"].items()]
    return lines
