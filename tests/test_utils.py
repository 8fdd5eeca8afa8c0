"""The scalar checks the ops share and the helpers servers call (aotinfer/utils.py)."""

import pytest

from aotinfer.utils import cc_int, check_enable_pdl, check_int, check_real


def test_check_real():
    for good in (1, 1.5, -2, float("inf")):
        check_real(good, "eps")
    for bad in (True, "1", None, 1j):
        with pytest.raises(TypeError, match="Expected eps to be a real number"):
            check_real(bad, "eps")


def test_check_int():
    check_int(3, "top_k", 1)
    with pytest.raises(TypeError, match="Expected top_k to be an integer, got bool"):
        check_int(True, "top_k", 1)
    with pytest.raises(TypeError, match="Expected top_k to be an integer, got float"):
        check_int(2.0, "top_k", 1)
    with pytest.raises(ValueError, match="Expected top_k to be at least 1, got 0"):
        check_int(0, "top_k", 1)


def test_check_enable_pdl():
    for good in (None, True, False):
        check_enable_pdl(good)
    for bad in (1, "yes"):
        with pytest.raises(TypeError, match="Expected enable_pdl to be None, True or False"):
            check_enable_pdl(bad)


def test_cc_int():
    assert cc_int(90) == cc_int((9, 0)) == cc_int("9.0") == cc_int("9") == 90
    assert cc_int("10.3") == cc_int((10, 3)) == 103


def test_device_support_pdl():
    """FlashInfer's utility: True exactly where ops launch with PDL by default (sm90 and up)."""
    import torch

    from aotinfer.utils import device_support_pdl

    assert device_support_pdl("cpu") is False
    if torch.cuda.is_available():
        assert device_support_pdl("cuda") == (torch.cuda.get_device_capability()[0] >= 9)
