"""CUDA arch lists and which build of a module runs on which GPU.

Pure Python with no imports beyond the standard library: the build helper (cmake/modules.py) loads
this file by path to plan the per-SM shared objects, and the loader and ``aotinfer info`` use it to
pick one of them for a compute capability. Both sides therefore agree on what "9.0a", "10.0f" or
"12.0+PTX" means, on the order of preference, and on what each CUDA toolkit can build.

What runs where (CUDA's rules; ptxas 13.0 enforces the same ones for PTX):

- ``X.Y`` SASS runs on compute capability X.Z for every Z >= Y (same major);
- ``X.Ya`` SASS (arch-specific features, from 9.0 on) runs on X.Y only;
- ``X.Yf`` SASS (family-specific features, from 10.0 on) runs on the GPUs of its family with a
  minor >= Y. CUDA 13 made the family the major (10.0 and 10.3; 11.0; 12.0 and 12.1) by
  renumbering Jetson Thor from 10.1 to 11.0; under CUDA 12.9 numbering Thor's 10.1 is a family of
  its own (sm_101f), which 10.0f does not cover;
- ``compute_XY`` PTX is compiled by the driver for any compute capability >= X.Y. PTX of an 'a' or
  'f' target compiles only within its chip or family, where its SASS already runs, so '+PTX' is
  allowed on plain archs only.
"""

from __future__ import annotations

import collections

TYPE_CHECKING = False  # typing costs milliseconds at import; annotations are strings here
if TYPE_CHECKING:
    from typing import Iterable, Optional, Sequence, Tuple

#: What a release wheel of each CUDA major is built for, and the default of AOTINFER_CUDA_ARCH_LIST.
#: 9.0a: 9.0 is the only Hopper GPU, so 'a' costs no coverage and allows wgmma/setmaxnreg.
#: 10.0f: B200/GB200 (10.0) and B300/GB300 (10.3), with tcgen05; 10.0a would leave out 10.3.
#: 11.0f: Jetson AGX Thor, an aarch64 part (AARCH64_ONLY). 12.0+PTX: RTX 50xx, RTX PRO 6000 and
#: DGX Spark (12.1) run its SASS; its PTX serves GPUs newer than the toolkit.
#: CUDA 13's nvcc no longer builds for 7.0 (V100): the CUDA 12 wheel keeps it.
RELEASE_ARCH_LISTS = {
    12: "7.0 7.5 8.0 8.6 8.9 9.0a 10.0f 12.0+PTX",
    13: "7.5 8.0 8.6 8.9 9.0a 10.0f 11.0f 12.0+PTX",
}
#: The CUDA release each major's wheels are built with (.github/workflows/wheels.yml).
RELEASE_CUDA = {12: "12.9", 13: "13.0"}
#: Archs whose GPUs exist only in aarch64 systems; x86_64 release wheels leave them out.
AARCH64_ONLY = frozenset({"11.0f"})

#: Compute capabilities the nvcc of each CUDA major builds SASS for (12: 12.9, the oldest toolkit
#: CMakeLists.txt accepts; 13: 13.0).
TOOLKIT_ARCHS = {
    12: ((5, 0), (5, 2), (5, 3), (6, 0), (6, 1), (6, 2), (7, 0), (7, 2), (7, 5), (8, 0), (8, 6), (8, 7),
         (8, 9), (9, 0), (10, 0), (10, 1), (10, 3), (12, 0), (12, 1)),
    13: ((7, 5), (8, 0), (8, 6), (8, 7), (8, 8), (8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)),
}
#: Suffixes exist from these majors on: 'a' from Hopper, 'f' from Blackwell.
SUFFIX_MIN_MAJOR = {"a": 9, "f": 10}
#: Compute capabilities that are a family of their own although they share a major (see above).
_OWN_FAMILY = frozenset({(10, 1)})


def release_arch_list(cuda_major: int, machine: str = "x86_64") -> str:
    """The release arch list of a CUDA major for a platform (``platform.machine()``)."""
    archs = RELEASE_ARCH_LISTS[cuda_major].split()
    if machine not in ("aarch64", "arm64"):
        archs = [a for a in archs if a not in AARCH64_ONLY]
    return " ".join(archs)


class Arch(collections.namedtuple("Arch", "major minor suffix ptx", defaults=("", False))):
    """One entry of an arch list: SASS for ``sm_<major><minor><suffix>``, plus PTX if ``ptx``.

    ``suffix`` "a" marks arch-specific SASS (runs only on that compute capability), "f"
    family-specific SASS (runs on its family, see the module docstring). Tuples order by
    (major, minor, suffix, ptx).
    """

    __slots__ = ()

    @classmethod
    def parse(cls, text: str) -> "Arch":
        rest = text.strip()
        ptx = rest.endswith("+PTX")
        rest = rest[: -len("+PTX")] if ptx else rest
        suffix = rest[-1:] if rest[-1:] in ("a", "f") else ""
        major, dot, minor = rest[: len(rest) - len(suffix)].partition(".")
        if not (dot and _is_number(major) and _is_number(minor) and len(minor) == 1):
            raise ValueError(
                f"bad CUDA arch {text!r}: expected MAJOR.MINOR with an optional 'a' or 'f' and an"
                " optional '+PTX', like '8.9', '9.0a', '10.0f' or '12.0+PTX'"
            )
        arch = cls(int(major), int(minor), suffix, ptx)
        if suffix and arch.major < SUFFIX_MIN_MAJOR[suffix]:
            raise ValueError(
                f"bad CUDA arch {text!r}: '{suffix}' targets exist from {SUFFIX_MIN_MAJOR[suffix]}.0 on"
            )
        if arch.ptx and arch.suffix:
            # PTX of an 'a' or 'f' target compiles only for the chip or family its SASS already
            # runs on: it would add size and nothing else.
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

    def runs_sass_on(self, cc: Tuple[int, int]) -> bool:
        """Whether this arch's SASS runs on a GPU of compute capability ``cc``."""
        if self.suffix == "a":
            return (self.major, self.minor) == tuple(cc)
        if self.suffix == "f" and (tuple(cc) in _OWN_FAMILY) != ((self.major, self.minor) in _OWN_FAMILY):
            return False
        return self.major == cc[0] and self.minor <= cc[1]

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


def unbuildable(archs: Iterable[Arch], cuda_major: int) -> Tuple[Arch, ...]:
    """The archs of a list that the nvcc of ``cuda_major`` does not build for."""
    known = TOOLKIT_ARCHS.get(cuda_major)
    return () if known is None else tuple(a for a in archs if (a.major, a.minor) not in known)


def supported_archs(archs: Iterable[Arch], sm_majors: Optional[Sequence[int]]) -> Tuple[Arch, ...]:
    """The archs of a list that a module declared for ``sm_majors`` (None: all) is built for."""
    return tuple(a for a in archs if sm_majors is None or a.major in sm_majors)


def arch_for_gpu(cc: Tuple[int, int]) -> Arch:
    """The arch a build for one GPU of compute capability ``cc`` targets: SASS for that GPU, with
    the 'a' suffix from 9.0 on (9.0 -> 9.0a, 8.9 -> 8.9), as the JIT builds for the GPU in front of it."""
    major, minor = int(cc[0]), int(cc[1])
    return Arch(major, minor, "a" if major >= SUFFIX_MIN_MAJOR["a"] else "")


class Choice(collections.namedtuple("Choice", "arch jit reason")):
    """The build a GPU loads; ``jit`` when the driver must compile its PTX at first load."""

    __slots__ = ()


class NoCompatibleBuild(RuntimeError):
    """No build of a module runs on a compute capability."""


def choose_arch(
    cc: Tuple[int, int], built: Iterable[Arch], sm_majors: Optional[Sequence[int]] = None
) -> Choice:
    """Pick the build of a module that runs best on a GPU of compute capability ``cc``.

    Order: SASS for exactly this compute capability ('a' before 'f' before plain), else the
    highest SASS that runs on it (same major or family, lower minor), else the highest PTX not
    above it, which the driver compiles at first load. Raises NoCompatibleBuild when none fits.
    """
    major, minor = cc
    built = sorted(set(built))
    cc_text = f"{major}.{minor}"
    if sm_majors is not None and major not in sm_majors:
        raise NoCompatibleBuild(
            f"compute capability {cc_text} is not supported: this module runs only on SM majors "
            f"{', '.join(str(m) for m in sorted(sm_majors))}"
        )
    exact = [a for a in built if (a.major, a.minor) == (major, minor) and a.runs_sass_on(cc)]
    if exact:
        best = max(exact, key=lambda a: ("", "f", "a").index(a.suffix))
        return Choice(best, False, f"exact match: {best.sass}")
    lower = [a for a in built if a.runs_sass_on(cc)]
    if lower:
        best = max(lower, key=lambda a: (a.minor, a.suffix == "f"))
        kind = "same family" if best.suffix == "f" else "same major"
        return Choice(best, False, f"{best.sass} SASS runs on {cc_text} ({kind}, lower minor)")
    ptx = [a for a in built if a.ptx and (a.major, a.minor) <= (major, minor)]
    if ptx:
        best = max(ptx)
        return Choice(best, True, f"compute_{best.tag} PTX, compiled by the driver for {cc_text}")
    have = " ".join(str(a) for a in built) or "none"
    raise NoCompatibleBuild(
        f"no build runs on compute capability {cc_text}; this install has: {have}"
    )


def build_advice(cc: Tuple[int, int], cuda_major: int) -> Tuple[Optional[str], str]:
    """(arch list to build, or None, and why) for a GPU that no installed build runs on.

    The arch is one the nvcc of ``cuda_major`` accepts: the release list's arch for that GPU where
    it has one (PTX for GPUs newer than the toolkit), else the compute capability itself. None
    when this CUDA major cannot build for the GPU; the sentence then names the release that can.
    """
    cc = (int(cc[0]), int(cc[1]))
    cc_text = "{}.{}".format(*cc)

    def release_arch(major):
        try:
            return str(choose_arch(cc, parse_arch_list(RELEASE_ARCH_LISTS[major])).arch)
        except NoCompatibleBuild:
            return None

    if cuda_major in RELEASE_ARCH_LISTS and release_arch(cuda_major):
        arch = release_arch(cuda_major)
        return arch, f"the CUDA {cuda_major} release wheel (+{release_label(cuda_major)}) covers it with {arch}"
    known = TOOLKIT_ARCHS.get(cuda_major, ())
    if cc in known:
        return cc_text, f"CUDA {cuda_major}'s nvcc builds for it"
    if known and cc > max(known):
        arch = "{}.{}+PTX".format(*max(known))
        return arch, f"the driver compiles {arch}'s PTX for it"
    others = [m for m in sorted(RELEASE_ARCH_LISTS, reverse=True) if m != cuda_major and release_arch(m)]
    why = f"CUDA {cuda_major} cannot build for compute capability {cc_text}"
    if known and cc < min(known):
        why += " (its nvcc builds for {}.{} and newer)".format(*min(known))
    if others:
        why += f"; the CUDA {others[0]} release wheel (+{release_label(others[0])}) covers it"
    else:
        why += "; no aotinfer release supports it"
    return None, why


def release_label(cuda_major: int) -> str:
    """The local version label of a CUDA major's release wheels: 'cu130' for 0.1.0+cu130."""
    return "cu" + RELEASE_CUDA[cuda_major].replace(".", "")
