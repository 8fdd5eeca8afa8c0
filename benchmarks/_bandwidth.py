"""Helpers shared by the bandwidth benchmarks: one timed row, and per-op latency under graph replay."""

import torch

from aotinfer.testing import bench_gpu_time

GRAPH_CALLS = 20  # calls captured in one graph for the latency table


def gbps(nbytes, seconds):
    return nbytes / seconds / 1e9


def bandwidth_row(label, ours, torch_fn, nbytes, copy_bw):
    """Time ours and torch's version of one case; print ours and torch's GB/s as ratios to copy."""
    t_ours, _ = bench_gpu_time(ours)
    t_torch, _ = bench_gpu_time(torch_fn)
    ratio, torch_ratio = gbps(nbytes, t_ours) / copy_bw, gbps(nbytes, t_torch) / copy_bw
    print(f"  {label:<34} {t_ours * 1e6:9.1f} us {gbps(nbytes, t_ours):7.0f} GB/s {ratio:6.3f}   torch {torch_ratio:6.3f}")
    return ratio


def graph_latency(fn):
    """GPU time of one call, from replays of a graph holding GRAPH_CALLS calls back to back."""

    def calls():
        for _ in range(GRAPH_CALLS):
            fn()

    median, _ = bench_gpu_time(calls, use_cuda_graph=True, cold_l2_cache=False)
    return median / GRAPH_CALLS


def copy_row():
    from aotinfer.testing import copy_bandwidth

    bw = copy_bandwidth() / 1e9
    print(f"device-to-device copy bandwidth, this run: {bw:.0f} GB/s (bytes read + written)")
    return bw
