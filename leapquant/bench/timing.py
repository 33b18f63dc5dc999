"""GPU timing: CUDA-graph replays timed with CUDA events, medians, and the measured copy bandwidth.

A benchmark captures ``steps`` consecutive decode steps in one CUDA graph, each on a different rotation of
inputs and pool slots (so the 60 MB L2 of an H200 cannot hold what the next step reads), replays the graph
``repeats`` times after ``warmup`` replays, and reports the median time per step.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

__all__ = ["copy_bandwidth", "time_steps"]


def _events_ms(fn: Callable[[], None], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written (median)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = statistics.median(_events_ms(lambda: dst.copy_(src), repeats))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def time_steps(
    step: Callable[[int], None],
    rotations: int,
    *,
    graph_steps: int = 32,
    warmup: int = 3,
    repeats: int = 15,
    use_graph: bool = True,
) -> dict[str, float]:
    """Median milliseconds per call of ``step(i)`` with ``i`` cycling over ``rotations``.

    Returns ``{"ms": median, "ms_min": ..., "ms_max": ..., "graph": bool}`` per step.  Each step is first run
    eagerly (so Triton compiles and allocations settle), then ``graph_steps`` steps are captured in one CUDA
    graph; if capture fails (a library that synchronizes inside), the steps are timed eagerly instead.
    """
    per_graph = max(rotations, graph_steps - graph_steps % rotations)
    for i in range(rotations):
        step(i)
    torch.cuda.synchronize()
    graph = None
    if use_graph:
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for i in range(rotations):
                    step(i)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(per_graph):
                    step(i % rotations)
        except RuntimeError:
            graph = None
            torch.cuda.synchronize()

    def run() -> None:
        if graph is not None:
            graph.replay()
        else:
            for i in range(per_graph):
                step(i % rotations)

    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    times = [t / per_graph for t in _events_ms(run, repeats)]
    return {
        "ms": statistics.median(times),
        "ms_min": min(times),
        "ms_max": max(times),
        "graph": graph is not None,
    }
