"""A JIT toolchain that compiles nothing, for tests about what happens around a build (forks,
waiting processes) rather than the build itself: run in a child process, ``install(seconds,
stand_in)`` makes every JIT build take ``seconds`` and produce a copy of ``stand_in`` (an object
of this install that loads here), with no nvcc needed."""

import os
import shutil
import time

from aotinfer.jit import core, toolchain


def install(seconds: float, stand_in: str, ccs=((7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0))) -> None:
    tools = toolchain.Toolchain("/fake/nvcc", "/fake/g++")
    # The facts a build asks of its toolchain, set instead of read from programs that are not run.
    tools.__dict__.update(nvcc_id="fake nvcc, release 13.0", host_id="fake g++", cuda_version="13.0",
                          gpu_codes=frozenset(ccs), library_dirs=("/fake/lib64",))
    toolchain.find = lambda: tools

    def run(spec, commands, work):
        print(f"fake build {spec.stem} in {os.getpid()}", flush=True)
        time.sleep(seconds)
        shutil.copyfile(stand_in, commands[-1][-1])  # the last command strips the output in place

    core.JitSpec._run = run
    # The stand-in finds the CUDA runtime library beside itself ($ORIGIN); in the cache it is not
    # there, so load it first: the dynamic loader then finds it by its soname.
    import ctypes

    ctypes.CDLL(str(core._runtime_library()[0]), mode=ctypes.RTLD_GLOBAL)
