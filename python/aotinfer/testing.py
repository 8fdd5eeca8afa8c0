"""GPU timing shared by every benchmark: one timer for our kernels and for each baseline.

``bench_gpu_time`` measures with CUPTI's kernel records (``enable_cupti=True``, through the
cupti-python package), else by replaying a CUDA graph (``use_cuda_graph=True``), else with CUDA
events around each call. When the method asked for is unavailable it warns, naming the method it
falls back to. Cold L2 (the default): before every timed call a buffer twice the L2 size is
rewritten, so no call finds its inputs in L2; that write is never part of the time.
"""

from __future__ import annotations

import statistics
import warnings

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple


class _L2Flush:
    def __init__(self, enabled: bool) -> None:
        import torch

        self.buffer = None
        self.value = 0
        if enabled:
            l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
            self.buffer = torch.empty(max(2 * l2, 1 << 20), dtype=torch.int8, device="cuda")

    def __call__(self) -> None:
        if self.buffer is not None:
            self.value = (self.value + 1) & 0x7F  # a new value each time: nothing cached holds it
            self.buffer.fill_(self.value)


def _counts(run: Callable[[], Any], dry_run_iters, repeat_iters, dry_run_time_ms, repeat_time_ms) -> Tuple[int, int]:
    """Warm-up and repeat counts: given, or sized from a first estimate of one call's time."""
    import torch

    if dry_run_iters is not None and repeat_iters is not None:
        return dry_run_iters, repeat_iters
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
    return dry, repeat


def _time_with_events(run: Callable[[], Any], flush: _L2Flush, dry: int, repeat: int) -> List[float]:
    import torch

    for _ in range(dry):
        run()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeat)]
    for i in range(repeat):
        flush()
        starts[i].record()
        run()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends)]


def _capture(call: Callable[[], Any]):
    """A CUDA graph of one call, or None (with the reason) when the call cannot be captured."""
    import torch

    try:
        call()  # load modules and allocate outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        torch.cuda.synchronize()
        return graph, None
    except Exception as e:  # capture refuses synchronizing or host-dependent work
        torch.cuda.synchronize()
        _end_failed_capture()
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _end_failed_capture() -> None:
    """A capture that failed skips torch's end-of-capture step for its CUDA generators, which then
    refuse random numbers; one capture that succeeds runs that step again."""
    import torch

    graph = torch.cuda.CUDAGraph()
    scratch = torch.empty(1, device="cuda")
    with torch.cuda.graph(graph):
        scratch.fill_(0)
    torch.cuda.synchronize()
    del graph


def _time_with_cupti(call: Callable[[], Any], flush: _L2Flush, dry: int, repeat: int) -> List[float]:
    """Per call: from its first kernel's start to its last kernel's end, from CUPTI's records."""
    import torch
    from cupti import cupti

    records: List[Tuple[int, int, str]] = []

    def buffer_requested():
        return 8 << 20, 0

    def buffer_completed(activities):
        for a in activities:
            if a.kind == cupti.ActivityKind.CONCURRENT_KERNEL:
                records.append((a.start, a.end, a.name))

    for _ in range(dry):
        call()
    torch.cuda.synchronize()
    cupti.activity_register_callbacks(buffer_requested, buffer_completed)
    cupti.activity_enable(cupti.ActivityKind.CONCURRENT_KERNEL)
    try:
        # The flush's own kernels, by name, so they can be told apart from the call's.
        flush()
        torch.cuda.synchronize()
        cupti.activity_flush_all(1)
        flush_names = {name for _, _, name in records}
        records.clear()
        for _ in range(repeat):
            flush()
            call()
        torch.cuda.synchronize()
        cupti.activity_flush_all(1)
    finally:
        cupti.activity_disable(cupti.ActivityKind.CONCURRENT_KERNEL)
    times, current = [], []
    for start, end, name in sorted(records):
        if name in flush_names and flush.buffer is not None:
            if current:
                times.append((max(e for _, e in current) - min(s for s, _ in current)) * 1e-9)
            current = []
        else:
            current.append((start, end))
    if current:
        times.append((max(e for _, e in current) - min(s for s, _ in current)) * 1e-9)
    if not times:
        raise RuntimeError("CUPTI recorded no kernel of the timed function")
    return times


def bench_gpu_time(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Optional[Dict[str, Any]] = None,
    dry_run_iters: Optional[int] = None,
    repeat_iters: Optional[int] = None,
    dry_run_time_ms: float = 25,
    repeat_time_ms: float = 100,
    enable_cupti: bool = False,
    use_cuda_graph: bool = False,
    cold_l2_cache: bool = True,
) -> Tuple[float, float]:
    """Median and standard deviation, in seconds, of the GPU time of ``fn(*args, **kwargs)``.

    Warm-up and repeat counts are ``dry_run_iters`` and ``repeat_iters`` or, when None, sized to
    ``dry_run_time_ms`` and ``repeat_time_ms`` from a first estimate. See the module doc for the
    methods and their fallbacks.
    """
    kwargs = kwargs or {}

    def call():
        return fn(*args, **kwargs)

    flush = _L2Flush(cold_l2_cache)
    dry, repeat = _counts(call, dry_run_iters, repeat_iters, dry_run_time_ms, repeat_time_ms)
    times = None
    if enable_cupti:
        try:
            import cupti  # noqa: F401

            times = _time_with_cupti(call, flush, dry, repeat)
        except ImportError:
            warnings.warn("bench_gpu_time: cupti-python is not installed; falling back to CUDA graph replay", stacklevel=2)
            use_cuda_graph = True
    if times is None and use_cuda_graph:
        graph, why = _capture(call)
        if graph is None:
            warnings.warn(f"bench_gpu_time: the call cannot be captured in a CUDA graph ({why}); falling back to CUDA events", stacklevel=2)
        else:
            times = _time_with_events(graph.replay, flush, dry, repeat)
    if times is None:
        times = _time_with_events(call, flush, dry, repeat)
    return statistics.median(times), statistics.pstdev(times)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth now, in bytes per second (read plus written), timed by
    bench_gpu_time on ``torch.Tensor.copy_`` of ``nbytes`` of random data."""
    import torch

    src = torch.randint(-128, 127, (nbytes,), dtype=torch.int8, device="cuda")
    dst = torch.empty_like(src)
    median, _ = bench_gpu_time(dst.copy_, args=(src,))
    return 2 * nbytes / median
