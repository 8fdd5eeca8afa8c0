"""How long ``import aotinfer`` takes: alone, after torch (a server's case), and beside torch's own.

    python benchmarks/bench_import.py [--runs 20]

Each figure is the median over fresh interpreters, minus an interpreter that imports nothing.
"""

import argparse
import statistics
import subprocess
import sys

TIMED = "import time; t = time.perf_counter(); {stmt}; print(time.perf_counter() - t)"


def median_seconds(setup: str, stmt: str, runs: int) -> float:
    code = f"{setup}\n" + TIMED.format(stmt=stmt)
    times = [float(subprocess.check_output([sys.executable, "-c", code], text=True)) for _ in range(runs)]
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    rows = [
        ("import aotinfer (fresh interpreter)", "", "import aotinfer"),
        ("import aotinfer after import torch", "import torch", "import aotinfer"),
        ("import torch (for comparison)", "", "import torch"),
    ]
    for label, setup, stmt in rows:
        print(f"{label:<40} {median_seconds(setup, stmt, args.runs) * 1e3:8.2f} ms")
    check = "import sys, aotinfer; print('torch' in sys.modules, 'tvm_ffi' in sys.modules)"
    print("torch / tvm_ffi imported by import aotinfer:", subprocess.check_output([sys.executable, "-c", check], text=True).strip())


if __name__ == "__main__":
    main()
