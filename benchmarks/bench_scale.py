"""scale's bandwidth against torch's device-to-device copy (and torch.mul), in the same run.

    python benchmarks/bench_scale.py [--sizes-mib 256 1024] [--dtypes float16 bfloat16 float32]

Bytes moved = input read once + output written once. The copy baseline is torch's own
``dst.copy_(src)`` of the same tensors, timed by the same timer right beside each case; the
streaming limit (benchmarks/_bandwidth.py) reads and writes the same bytes with a kernel that does
nothing else, at its fastest configuration.
"""

import argparse

import torch

import aotinfer
from _bandwidth import streaming_limit
from aotinfer.testing import bench_gpu_time


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16", "float32"])
    args = parser.parse_args()

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, aotinfer {aotinfer.__version__}")
    header = (f"{'MiB':>6} {'dtype':>9} {'scale us':>9} {'GB/s':>7} {'copy GB/s':>9} {'limit GB/s':>10} {'/copy':>6}"
              f" {'/limit':>6} {'torch.mul':>9}")
    print(header)
    print("-" * len(header))
    ratios, limit_ratios = [], []
    for mib in args.sizes_mib:
        for name in args.dtypes:
            dtype = getattr(torch, name)
            n = (mib << 20) // dtype.itemsize
            x = torch.randn(n, device="cuda", dtype=dtype)
            out = torch.full_like(x, float("nan"))
            factor = 1.37
            aotinfer.scale(x, factor, out=out)
            assert torch.equal(out, x * factor), "scale is wrong: not timing it"
            nbytes = 2 * x.nbytes
            t_scale, _ = bench_gpu_time(aotinfer.scale, args=(x, factor), kwargs={"out": out})
            t_copy, _ = bench_gpu_time(out.copy_, args=(x,))
            t_mul, _ = bench_gpu_time(torch.mul, args=(x, factor), kwargs={"out": out})
            bw, copy_bw = nbytes / t_scale / 1e9, nbytes / t_copy / 1e9
            limit = streaming_limit(nbytes, 1, 1)
            ratios.append(bw / copy_bw)
            limit_ratios.append(bw / limit if limit else float("nan"))
            print(
                f"{mib:>6} {name:>9} {t_scale * 1e6:>9.1f} {bw:>7.0f} {copy_bw:>9.0f} {limit or float('nan'):>10.0f}"
                f" {bw / copy_bw:>6.3f} {limit_ratios[-1]:>6.3f} {nbytes / t_mul / 1e9 / copy_bw:>9.3f}"
            )
            del x, out
    print(f"lowest ratio to copy bandwidth: {min(ratios):.3f}, to the streaming limit: {min(limit_ratios):.3f}"
          "  (torch.mul column: torch.mul / copy)")


if __name__ == "__main__":
    main()
