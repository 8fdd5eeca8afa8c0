"""aotinfer.testing.bench_gpu_time: each timing method and each fallback, on a GPU."""

import sys
import warnings

import pytest
import torch

from aotinfer.testing import bench_gpu_time, copy_bandwidth

pytestmark = pytest.mark.gpu


def workload():
    x = torch.randn(1 << 24, device="cuda")
    y = torch.empty_like(x)
    return torch.mul, (x, 2.0), {"out": y}


def test_events():
    fn, args, kwargs = workload()
    median, std = bench_gpu_time(fn, args, kwargs, dry_run_iters=3, repeat_iters=20)
    assert 1e-6 < median < 1e-1 and std >= 0


def test_cuda_graph_matches_events():
    fn, args, kwargs = workload()
    events, _ = bench_gpu_time(fn, args, kwargs, repeat_iters=30, dry_run_iters=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graph, _ = bench_gpu_time(fn, args, kwargs, repeat_iters=30, dry_run_iters=5, use_cuda_graph=True)
    assert 0.7 < graph / events < 1.3


def test_cupti_or_its_fallback():
    fn, args, kwargs = workload()
    try:
        import cupti  # noqa: F401
    except ImportError:
        with pytest.warns(UserWarning, match="cupti-python is not installed; falling back to CUDA graph replay"):
            bench_gpu_time(fn, args, kwargs, repeat_iters=10, dry_run_iters=2, enable_cupti=True)
        return
    events, _ = bench_gpu_time(fn, args, kwargs, repeat_iters=30, dry_run_iters=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        timed, _ = bench_gpu_time(fn, args, kwargs, repeat_iters=30, dry_run_iters=5, enable_cupti=True)
    assert 0.7 < timed / events < 1.3


def test_missing_cupti_falls_back_to_graph(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupti", None)  # import cupti raises ImportError
    fn, args, kwargs = workload()
    with pytest.warns(UserWarning, match="cupti-python is not installed; falling back to CUDA graph replay"):
        median, _ = bench_gpu_time(fn, args, kwargs, repeat_iters=10, dry_run_iters=2, enable_cupti=True)
    assert median > 0


def test_uncapturable_call_falls_back_to_events():
    x = torch.randn(1 << 20, device="cuda")

    def syncs():
        torch.mul(x, 2.0)
        torch.cuda.synchronize()  # not allowed while a graph is captured

    with pytest.warns(UserWarning, match="cannot be captured in a CUDA graph .*falling back to CUDA events"):
        median, _ = bench_gpu_time(syncs, repeat_iters=10, dry_run_iters=2, use_cuda_graph=True)
    assert median > 0
    # The failed capture left nothing broken: random numbers and new captures still work.
    assert torch.randn(16, device="cuda").isfinite().all()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.randn(16, device="cuda")
    graph.replay()
    torch.cuda.synchronize()
    assert y.isfinite().all()


def test_copy_bandwidth_is_plausible():
    assert 1e11 < copy_bandwidth(1 << 28) < 1e14
