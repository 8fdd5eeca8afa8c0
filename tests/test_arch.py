"""Arch lists and the loader's choice of build, for GPUs we may not have."""

import pytest

from aotinfer._arch import RELEASE_ARCH_LIST, Arch, NoCompatibleBuild, choose_arch, parse_arch_list

# compute capability -> (the arch chosen from the release list, whether the driver compiles PTX)
RELEASE_CHOICES = {
    (7, 5): ("7.5", False),
    (8, 0): ("8.0", False),
    (8, 6): ("8.6", False),
    (8, 9): ("8.9", False),
    (9, 0): ("9.0a", False),
    (10, 0): ("10.0a", False),
    (12, 0): ("12.0+PTX", False),
    (12, 1): ("12.0+PTX", False),  # sm_120 SASS runs on 12.1
    (13, 0): ("12.0+PTX", True),  # no SASS of major 13: the driver compiles compute_120
}


@pytest.mark.parametrize("cc", sorted(RELEASE_CHOICES))
def test_release_list_choice(cc):
    arch, jit = RELEASE_CHOICES[cc]
    choice = choose_arch(cc, parse_arch_list(RELEASE_ARCH_LIST))
    assert (str(choice.arch), choice.jit) == (arch, jit)


# A narrow list: SASS for 8.0 and 9.0a only, no PTX.
NARROW_CHOICES = {
    (7, 5): None,
    (8, 0): "8.0",
    (8, 6): "8.0",
    (8, 9): "8.0",
    (9, 0): "9.0a",
    (10, 0): None,  # 9.0a runs only on 9.0, and there is no PTX
    (12, 0): None,
    (12, 1): None,
    (13, 0): None,
}


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


def test_exact_prefers_arch_specific_variant():
    built = parse_arch_list("9.0 9.0a 10.0")
    assert choose_arch((9, 0), built).arch.name == "9.0a"
    # 10.0 SASS is not for 10.3; the highest lower minor of the same major wins over PTX.
    assert choose_arch((10, 3), parse_arch_list("8.0+PTX 10.0")).arch.name == "10.0"


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
        ("8.0 8.0+PTX", "more than once"),
    ],
)
def test_bad_arch_lists(text, error):
    with pytest.raises(ValueError, match=error):
        parse_arch_list(text)


def test_arch_names():
    a = Arch.parse("12.0+PTX")
    assert (a.name, a.tag, a.sass, str(a), a.ptx) == ("12.0", "120", "sm_120", "12.0+PTX", True)
    assert [str(x) for x in parse_arch_list("9.0a;8.0, 12.0+PTX")] == ["8.0", "9.0a", "12.0+PTX"]
