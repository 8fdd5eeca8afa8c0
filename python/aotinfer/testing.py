"""Timing helpers shared by the benchmarks: one timer for our kernels and every baseline."""

from __future__ import annotations

import statistics
from typing import Any, Callable, Dict, Optional, Sequence, Tuple


def _l2_flush_buffer(device: Any):
    import torch

    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    return torch.empty(max(2 * l2_bytes, 1 << 20), dtype=torch.int8, device=device)


def bench_gpu_time(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Optional[Dict[str, Any]] = None,
    dry_run_iters: Optional[int] = None,
    repeat_iters: Optional[int] = None,
    dry_run_time_ms: float = 25,
    repeat_time_ms: float = 100,
    use_cuda_graph: bool = False,
    cold_l2_cache: bool = True,
) -> Tuple[float, float]:
    """Median and standard deviation, in seconds, of the GPU time of ``fn(*args, **kwargs)``.

    Warm-up and repeat counts come from the ``*_iters`` arguments or, when those are None, from
    the time budgets measured on a first call. Each timed call sits between two CUDA events on the
    current stream; with ``cold_l2_cache`` a buffer twice the L2 size is rewritten before each one
    so no call finds its inputs in L2. With ``use_cuda_graph`` the calls are captured into a graph
    (one call per graph) and each replay is timed, which removes launch gaps for small kernels.
    """
    import torch

    kwargs = kwargs or {}
    call = lambda: fn(*args, **kwargs)  # noqa: E731
    device = torch.cuda.current_device()
    flush = _l2_flush_buffer(device) if cold_l2_cache else None
    fill = 0

    if use_cuda_graph:
        call()  # load modules and allocate outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        run = graph.replay
    else:
        run = call

    # Estimate one call's time to size the warm-up and the repeats.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    run()
    torch.cuda.synchronize()
    start.record()
    for _ in range(5):
        run()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = max(start.elapsed_time(end) / 5, 1e-4)
    dry = dry_run_iters if dry_run_iters is not None else max(1, int(dry_run_time_ms / estimate_ms))
    repeat = repeat_iters if repeat_iters is not None else max(10, int(repeat_time_ms / estimate_ms))

    for _ in range(dry):
        run()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
    for i in range(repeat):
        if flush is not None:
            fill = (fill + 1) & 0x7F  # a new value each time: nothing cached holds it
            flush.fill_(fill)
        starts[i].record()
        run()
        ends[i].record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends)]
    return statistics.median(times), statistics.pstdev(times)


def copy_bandwidth(nbytes: int = 1 << 30, device: Any = None) -> float:
    """Device-to-device copy bandwidth in bytes per second (bytes read plus bytes written),
    measured now by ``torch.Tensor.copy_`` on ``nbytes`` of random data."""
    import torch

    src = torch.randint(-128, 127, (nbytes,), dtype=torch.int8, device=device or "cuda")
    dst = torch.empty_like(src)
    median, _ = bench_gpu_time(dst.copy_, args=(src,))
    return 2 * nbytes / median
