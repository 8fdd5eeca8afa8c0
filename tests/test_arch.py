"""Arch lists, the loader's choice of build and the build advice, for GPUs we may not have."""

import pytest

from aotinfer._arch import (
    RELEASE_ARCH_LISTS,
    TOOLKIT_ARCHS,
    Arch,
    NoCompatibleBuild,
    build_advice,
    choose_arch,
    parse_arch_list,
    release_arch_list,
    unbuildable,
)

# GPUs by compute capability -> (the arch each release list loads, whether the driver compiles PTX);
# None: that wheel loads nothing.
GPUS = {
    (7, 0): ("V100", "7.0", None),
    (7, 5): ("T4", "7.5", "7.5"),
    (8, 0): ("A100", "8.0", "8.0"),
    (8, 6): ("A10", "8.6", "8.6"),
    (8, 7): ("Jetson Orin", "8.6", "8.6"),
    (8, 9): ("L40S", "8.9", "8.9"),
    (9, 0): ("H100", "9.0a", "9.0a"),
    (10, 0): ("B200", "10.0f", "10.0f"),
    (10, 3): ("B300", "10.0f", "10.0f"),  # README's --cc 10.3 example: loaded nothing with 10.0a
    (11, 0): ("Jetson Thor", None, "11.0f"),  # CUDA 13 renumbered Thor from 10.1
    (12, 0): ("RTX 5090", "12.0+PTX", "12.0+PTX"),
    (12, 1): ("DGX Spark", "12.0+PTX", "12.0+PTX"),
    (13, 0): ("a GPU newer than the toolkit", "12.0+PTX", "12.0+PTX"),
}


@pytest.mark.parametrize("cuda_major", [12, 13])
@pytest.mark.parametrize("cc", sorted(GPUS), ids=lambda cc: "{}.{}".format(*cc))
def test_release_lists_serve_gpus(cc, cuda_major):
    expected = GPUS[cc][1 if cuda_major == 12 else 2]
    built = parse_arch_list(release_arch_list(cuda_major, "aarch64"))
    if expected is None:
        with pytest.raises(NoCompatibleBuild):
            choose_arch(cc, built)
        return
    choice = choose_arch(cc, built)
    assert str(choice.arch) == expected
    assert choice.jit == (cc == (13, 0))


def test_release_lists_build_with_their_toolkit():
    for major in RELEASE_ARCH_LISTS:
        archs = parse_arch_list(release_arch_list(major, "aarch64"))
        assert unbuildable(archs, major) == ()
    # CUDA 13's nvcc dropped Volta; its list must not ask for it.
    assert unbuildable(parse_arch_list("7.0 8.0"), 13) == (Arch(7, 0),)


def test_thor_only_in_aarch64_wheels():
    assert "11.0f" in release_arch_list(13, "aarch64").split()
    assert "11.0f" not in release_arch_list(13, "x86_64").split()


def test_family_sass_runs_on_its_family_only():
    f = Arch.parse("10.0f")
    assert [cc for cc in [(10, 0), (10, 3), (11, 0), (12, 0), (9, 0)] if f.runs_sass_on(cc)] == [(10, 0), (10, 3)]
    assert not Arch.parse("10.3f").runs_sass_on((10, 0))
    assert Arch.parse("12.0f").runs_sass_on((12, 1))
    # Under CUDA 12 numbering Thor (10.1) is a family of its own.
    assert not f.runs_sass_on((10, 1)) and Arch.parse("10.0").runs_sass_on((10, 1))


def test_exact_prefers_arch_specific_then_family():
    built = parse_arch_list("10.0 10.0a 10.0f")
    assert choose_arch((10, 0), built).arch.name == "10.0a"
    assert choose_arch((10, 0), parse_arch_list("10.0 10.0f")).arch.name == "10.0f"
    # On 10.3: 'a' is out; the family build wins over plain SASS of the same minor.
    assert choose_arch((10, 3), built).arch.name == "10.0f"
    # 10.0 SASS is not for 10.3 exactly; the highest lower minor of the same major wins over PTX.
    assert choose_arch((10, 3), parse_arch_list("8.0+PTX 10.0")).arch.name == "10.0"


# A narrow list: SASS for 8.0 and 9.0a only, no PTX.
NARROW_CHOICES = {(7, 5): None, (8, 0): "8.0", (8, 6): "8.0", (8, 9): "8.0", (9, 0): "9.0a", (10, 0): None, (12, 0): None}


@pytest.mark.parametrize("cc", sorted(NARROW_CHOICES))
def test_narrow_list_choice(cc):
    built = parse_arch_list("8.0 9.0a")
    expected = NARROW_CHOICES[cc]
    if expected is None:
        with pytest.raises(NoCompatibleBuild, match=rf"{cc[0]}\.{cc[1]}.*8\.0 9\.0a"):
            choose_arch(cc, built)
    else:
        choice = choose_arch(cc, built)
        assert str(choice.arch) == expected and not choice.jit


def test_arch_specific_never_runs_elsewhere():
    with pytest.raises(NoCompatibleBuild):
        choose_arch((10, 3), parse_arch_list("10.0a"))


def test_highest_ptx_not_above_device():
    choice = choose_arch((11, 0), parse_arch_list("8.0+PTX 10.0+PTX 12.0+PTX"))
    assert choice.arch.name == "10.0" and choice.jit


def test_sm_majors_restrict_the_module():
    built = parse_arch_list("8.0 9.0a")
    assert choose_arch((9, 0), built, sm_majors=[9, 10]).arch.name == "9.0a"
    with pytest.raises(NoCompatibleBuild, match=r"8\.0 is not supported.*SM majors 9, 10"):
        choose_arch((8, 0), built, sm_majors=[9, 10])


@pytest.mark.parametrize(
    "text, error",
    [
        ("", "empty"),
        ("8", "bad CUDA arch"),
        ("sm_90", "bad CUDA arch"),
        ("9.0a+PTX", "only for plain archs"),
        ("10.0f+PTX", "only for plain archs"),  # compute_100f PTX compiles only within family 10
        ("9.0f", "'f' targets exist from 10.0 on"),
        ("8.9a", "'a' targets exist from 9.0 on"),
        ("8.0 8.0+PTX", "more than once"),
    ],
)
def test_bad_arch_lists(text, error):
    with pytest.raises(ValueError, match=error):
        parse_arch_list(text)


def test_arch_names():
    a = Arch.parse("12.0+PTX")
    assert (a.name, a.tag, a.sass, str(a), a.ptx) == ("12.0", "120", "sm_120", "12.0+PTX", True)
    f = Arch.parse("10.0f")
    assert (f.name, f.tag, f.sass, f.ptx) == ("10.0f", "100f", "sm_100f", False)
    assert [str(x) for x in parse_arch_list("9.0a;8.0, 12.0+PTX 10.0f")] == ["8.0", "9.0a", "10.0f", "12.0+PTX"]


@pytest.mark.parametrize("cuda_major", sorted(TOOLKIT_ARCHS))
@pytest.mark.parametrize("cc", [(3, 5), (7, 0), (7, 2), (8, 7), (10, 1), (10, 3), (11, 0), (12, 1), (13, 0)],
                         ids=lambda cc: "{}.{}".format(*cc))
def test_build_advice_names_a_buildable_arch(cc, cuda_major):
    arch, why = build_advice(cc, cuda_major)
    if arch is None:
        assert f"CUDA {cuda_major} cannot build" in why
        return
    parsed = parse_arch_list(arch)
    assert unbuildable(parsed, cuda_major) == (), (arch, why)
    choose_arch(cc, parsed)  # and the build it names runs on the GPU


def test_build_advice_sends_volta_to_cuda_12():
    arch, why = build_advice((7, 0), 13)
    assert arch is None and "7.5 and newer" in why and "CUDA 12 release wheel (+cu129)" in why
    assert build_advice((7, 0), 12)[0] == "7.0"
    assert build_advice((3, 5), 13) == (None, "CUDA 13 cannot build for compute capability 3.5 (its nvcc builds"
                                              " for 7.5 and newer); no aotinfer release supports it")
