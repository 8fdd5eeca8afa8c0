"""CUDA arch lists and which build of a module runs on which GPU.

Pure Python with no imports beyond the standard library: the build helper (cmake/modules.py) loads
this file by path to plan the per-SM shared objects, and the loader and ``aotinfer info`` use it to
pick one of them for a compute capability. Both sides therefore agree on what "9.0a" or "12.0+PTX"
means and on the order of preference.
"""

from __future__ import annotations

import collections

TYPE_CHECKING = False  # typing costs milliseconds at import; annotations are strings here
if TYPE_CHECKING:
    from typing import Iterable, Optional, Sequence, Tuple

#: What a release wheel is built for when AOTINFER_CUDA_ARCH_LIST is unset.
RELEASE_ARCH_LIST = "7.5 8.0 8.6 8.9 9.0a 10.0a 12.0+PTX"


class Arch(collections.namedtuple("Arch", "major minor suffix ptx", defaults=("", False))):
    """One entry of an arch list: SASS for ``sm_<major><minor><suffix>``, plus PTX if ``ptx``.

    ``suffix`` "a" marks arch-specific features: such SASS runs only on exactly that compute
    capability. Tuples order by (major, minor, suffix, ptx).
    """

    __slots__ = ()

    @classmethod
    def parse(cls, text: str) -> "Arch":
        rest = text.strip()
        ptx = rest.endswith("+PTX")
        rest = rest[: -len("+PTX")] if ptx else rest
        suffix = "a" if rest.endswith("a") else ""
        major, dot, minor = rest[: len(rest) - len(suffix)].partition(".")
        if not (dot and _is_number(major) and _is_number(minor) and len(minor) == 1):
            raise ValueError(
                f"bad CUDA arch {text!r}: expected MAJOR.MINOR with an optional 'a' and an optional"
                " '+PTX', like '8.9', '9.0a' or '12.0+PTX'"
            )
        arch = cls(int(major), int(minor), suffix, ptx)
        if arch.ptx and arch.suffix:
            # PTX for an arch-specific target runs only on that very chip, where its SASS already
            # runs: it would add size and nothing else.
            raise ValueError(f"bad CUDA arch {text!r}: '+PTX' is only for plain archs like '12.0+PTX'")
        return arch

    @property
    def name(self) -> str:
        """The arch as written in a list, without '+PTX': '9.0a'."""
        return f"{self.major}.{self.minor}{self.suffix}"

    @property
    def tag(self) -> str:
        """Compact form used in file names and CMake: '90a'."""
        return f"{self.major}{self.minor}{self.suffix}"

    @property
    def sass(self) -> str:
        return f"sm_{self.tag}"

    def __str__(self) -> str:
        return self.name + ("+PTX" if self.ptx else "")


def _is_number(text: str) -> bool:
    return text.isascii() and text.isdigit()


def parse_arch_list(text: str) -> Tuple[Arch, ...]:
    """Parse a space- or semicolon-separated arch list; each arch at most once, sorted."""
    archs = [Arch.parse(item) for item in text.replace(";", " ").replace(",", " ").split()]
    if not archs:
        raise ValueError("empty CUDA arch list")
    names = [a.name for a in archs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"CUDA arch list names {', '.join(dupes)} more than once: {text!r}")
    return tuple(sorted(archs))


def supported_archs(archs: Iterable[Arch], sm_majors: Optional[Sequence[int]]) -> Tuple[Arch, ...]:
    """The archs of a list that a module declared for ``sm_majors`` (None: all) is built for."""
    return tuple(a for a in archs if sm_majors is None or a.major in sm_majors)


class Choice(collections.namedtuple("Choice", "arch jit reason")):
    """The build a GPU loads; ``jit`` when the driver must compile its PTX at first load."""

    __slots__ = ()


class NoCompatibleBuild(RuntimeError):
    """No build of a module runs on a compute capability."""


def choose_arch(
    cc: Tuple[int, int], built: Iterable[Arch], sm_majors: Optional[Sequence[int]] = None
) -> Choice:
    """Pick the build of a module that runs best on a GPU of compute capability ``cc``.

    Order: the exact arch (preferring its 'a' variant), else the highest SASS of the same major
    with a minor no higher than the GPU's, else the highest PTX no higher than the GPU's, which
    the driver compiles at first load. Raises NoCompatibleBuild when none fits.
    """
    major, minor = cc
    built = sorted(set(built))
    cc_text = f"{major}.{minor}"
    if sm_majors is not None and major not in sm_majors:
        raise NoCompatibleBuild(
            f"compute capability {cc_text} is not supported: this module runs only on SM majors "
            f"{', '.join(str(m) for m in sorted(sm_majors))}"
        )
    exact = [a for a in built if (a.major, a.minor) == (major, minor)]
    if exact:
        best = max(exact, key=lambda a: a.suffix == "a")
        return Choice(best, False, f"exact match: {best.sass}")
    same_major = [a for a in built if a.major == major and a.minor < minor and not a.suffix]
    if same_major:
        best = max(same_major)
        return Choice(best, False, f"{best.sass} SASS runs on {cc_text} (same major, lower minor)")
    ptx = [a for a in built if a.ptx and (a.major, a.minor) <= (major, minor)]
    if ptx:
        best = max(ptx)
        return Choice(best, True, f"compute_{best.tag} PTX, compiled by the driver for {cc_text}")
    have = " ".join(str(a) for a in built) or "none"
    raise NoCompatibleBuild(
        f"no build runs on compute capability {cc_text}; this install has: {have}"
    )
