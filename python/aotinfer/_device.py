"""The GPUs and driver of this machine as the CUDA driver reports them, and the spellings of
compute capabilities and driver versions on the command line.

Standard library only, and nothing above it in aotinfer: ``info`` (cli.py), ``build``
(jit/cli.py) and the JIT's arch context (compilation_context.py) all ask here, so none of them
imports another to learn what GPUs there are.

GPUs are listed through the CUDA driver API (libcuda, by ctypes), not torch, so this works
without a GPU, without torch's CUDA state, and in the same order and visibility as CUDA programs
(CUDA_VISIBLE_DEVICES applies).
"""

from __future__ import annotations

import re

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Tuple

#: The driver library; tests point it at a stand-in.
LIBCUDA = "libcuda.so.1"
_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
#: The highest SM major ``--cc`` accepts. CUDA 13 knows majors up to 12; a few beyond leave room
#: for GPUs newer than this release (their PTX path), while 99.0 or 1000.0 is a typo.
MAX_CC_MAJOR = 20


def driver_gpus() -> Tuple[Optional[str], List[Dict[str, Any]], Optional[str]]:
    """(driver's CUDA version, [{index, name, compute_capability}], why no GPU is listed) from libcuda."""
    import ctypes

    try:
        cuda = ctypes.CDLL(LIBCUDA)
    except OSError:
        return None, [], f"no NVIDIA driver found ({LIBCUDA} does not load)"
    version = ctypes.c_int()
    if cuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None, [], "cuDriverGetVersion failed"
    driver = f"{version.value // 1000}.{version.value % 1000 // 10}"
    status = cuda.cuInit(0)
    if status != 0:
        return driver, [], f"cuInit failed with CUDA driver error {status}"
    count = ctypes.c_int()
    cuda.cuDeviceGetCount(ctypes.byref(count))
    gpus = []
    for index in range(count.value):
        device = ctypes.c_int()
        cuda.cuDeviceGet(ctypes.byref(device), index)
        name = ctypes.create_string_buffer(256)
        cuda.cuDeviceGetName(name, 256, device)
        cc = []
        for attr in (_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR):
            value = ctypes.c_int()
            cuda.cuDeviceGetAttribute(ctypes.byref(value), attr, device)
            cc.append(value.value)
        gpus.append({"index": index, "name": name.value.decode(), "compute_capability": tuple(cc)})
    return driver, gpus, None if gpus else "the driver reports no GPU"


def parse_cc(text: str) -> Tuple[int, int]:
    """'8.9' -> (8, 9). ValueError for anything CUDA would not print as a compute capability:
    leading zeros ('08.9'), a minor of two digits ('8.10'), a major of 0 or above MAX_CC_MAJOR."""
    m = re.fullmatch(r"([1-9][0-9]*)\.([0-9])", text.strip())
    if m is None or int(m.group(1)) > MAX_CC_MAJOR:
        raise ValueError(
            f"expected a compute capability like 8.9 (a major from 1 to {MAX_CC_MAJOR} without leading"
            f" zeros, a dot, a one-digit minor), got {text!r}"
        )
    return int(m.group(1)), int(m.group(2))


def parse_driver(text: str) -> str:
    """'12.8' -> '12.8': the CUDA version a driver supports, as ``nvidia-smi`` prints it."""
    if re.fullmatch(r"[1-9][0-9]?\.[0-9]{1,2}", text.strip()) is None:
        raise ValueError(f"expected the CUDA version a driver supports, like 12.8, got {text!r}")
    return text.strip()


def cc_argument(text: str) -> Tuple[int, int]:
    """``parse_cc`` for argparse (``--cc`` of ``info`` and ``build``): a bad value is a usage error."""
    import argparse

    try:
        return parse_cc(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def driver_argument(text: str) -> str:
    """``parse_driver`` for argparse (``--driver`` of ``info``)."""
    import argparse

    try:
        return parse_driver(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cuda_version(text: str) -> Tuple[int, int]:
    """'12.8' -> (12, 8)."""
    major, _, minor = text.partition(".")
    return int(major), int(minor or 0)


def driver_problem(driver: Optional[str], built_with: str, jit: bool) -> Optional[str]:
    """Why a driver supporting CUDA ``driver`` cannot load code of CUDA ``built_with``, or None.

    Binaries of CUDA X.y run on a driver of any CUDA X.z (minor-version compatibility) or newer;
    PTX needs a driver at least as new as the toolkit that wrote it. None when the driver is unknown.
    """
    if driver is None:
        return None
    have, need = cuda_version(driver), cuda_version(built_with)
    if have[0] < need[0]:
        return (f"the driver supports CUDA {driver}, and this CUDA {built_with} build needs a driver"
                f" for CUDA {need[0]}.0 or newer")
    if jit and have < need:
        return (f"the driver supports CUDA {driver}, too old to compile PTX written by CUDA {built_with};"
                f" it needs a driver for CUDA {built_with} or newer")
    return None
