"""Helpers shared by the bandwidth benchmarks: one timed row, and per-op latency under graph replay."""

import torch

from aotinfer.testing import bench_gpu_time

GRAPH_CALLS = 20  # calls captured in one graph for the latency table


def gbps(nbytes, seconds):
    return nbytes / seconds / 1e9


def same_size_copy(nbytes):
    """Bandwidth of torch's device-to-device copy moving nbytes in all (nbytes / 2 read, written)."""
    src = torch.randint(-128, 127, (nbytes // 2,), dtype=torch.int8, device="cuda")
    dst = torch.empty_like(src)
    t, _ = bench_gpu_time(dst.copy_, args=(src,))
    return gbps(nbytes, t)


def bandwidth_row(label, ours, torch_fn, nbytes, copy_bw):
    """Time ours and torch's version of one case beside a copy of the same bytes; print GB/s and
    ratios to that copy (and to copy_bw, the large copy of the run). Returns ours / same-size copy."""
    t_ours, _ = bench_gpu_time(ours)
    t_torch, _ = bench_gpu_time(torch_fn)
    same = same_size_copy(nbytes)
    ratio, torch_ratio = gbps(nbytes, t_ours) / same, gbps(nbytes, t_torch) / same
    print(f"  {label:<32} {t_ours * 1e6:8.1f} us {gbps(nbytes, t_ours):6.0f} GB/s  copy {same:5.0f}"
          f"  {ratio:6.3f} ({gbps(nbytes, t_ours) / copy_bw:5.3f})   torch {torch_ratio:6.3f} ({gbps(nbytes, t_torch) / copy_bw:5.3f})")
    return ratio


def graph_latency(fn):
    """GPU time of one call, from replays of a graph holding GRAPH_CALLS calls back to back."""

    def calls():
        for _ in range(GRAPH_CALLS):
            fn()

    median, _ = bench_gpu_time(calls, use_cuda_graph=True, cold_l2_cache=False)
    return median / GRAPH_CALLS


def start(dtype):
    """Print the run's header (device, versions, copy bandwidth) and the bandwidth table's title;
    return the copy bandwidth in GB/s."""
    import aotinfer
    from aotinfer.testing import copy_bandwidth

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, aotinfer {aotinfer.__version__}, {dtype}")
    bw = copy_bandwidth() / 1e9
    print(f"device-to-device copy bandwidth, this run: {bw:.0f} GB/s (bytes read + written)")
    print("\nbandwidth: ours, then eager torch, as ratios to a copy of the same bytes (to the 1 GiB copy)")
    return bw
