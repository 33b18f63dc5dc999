"""GPU timing: CUDA-graph replays timed with CUDA events, medians, and the measured roofs (copy bandwidth,
bf16 GEMM throughput).

A benchmark captures ``steps`` consecutive decode steps in one CUDA graph, each on a different rotation of
inputs and pool slots (so the 60 MB L2 of an H200 cannot hold what the next step reads), replays the graph
``repeats`` times after ``warmup`` replays, and reports the median time per step.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from ..ops.graphs import clear_failed_capture

__all__ = [
    "capture_graph",
    "copy_bandwidth",
    "gemm_tflops",
    "kernel_breakdown",
    "profiled_kernels",
    "time_steps",
    "trace_spans",
]


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


def gemm_tflops(n: int = 8192, repeats: int = 10) -> float:
    """Measured bf16 GEMM throughput in TFLOP/s: ``2 n^3`` FLOPs of an ``n x n x n`` matmul over its median
    time (CUDA events): the compute roof of the decode roofline (:mod:`leapquant.bench.roofline`)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b, c = torch.randn_like(a), torch.empty_like(a)
    for _ in range(3):
        torch.mm(a, b, out=c)
    ms = statistics.median(_events_ms(lambda: torch.mm(a, b, out=c), repeats))
    return 2 * n**3 / (ms * 1e-3) / 1e12


def capture_graph(fn: Callable[[], None]):
    """``fn`` captured in a CUDA graph (after a warm-up call on a side stream), or None if capture fails."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    caller = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        # the context leaves this thread on its capture stream when ending the capture raises
        torch.cuda.set_stream(caller)
        clear_failed_capture()
        return None
    return graph


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

    def steps() -> None:
        for i in range(per_graph):
            step(i % rotations)

    graph = capture_graph(steps) if use_graph else None

    def run() -> None:
        graph.replay() if graph is not None else steps()

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


GPU_ACTIVITY = ("kernel", "gpu_memcpy", "gpu_memset")  # what a chrome trace's GPU lanes hold


def trace_spans(events: list[dict]) -> list[dict]:
    """The GPU activity of a PyTorch chrome trace's ``traceEvents`` (kernels, copies, memsets), in start
    order: ``{"name", "stream", "start", "end"}``, microseconds (the trace's ``ts`` and ``dur``)."""
    spans = []
    for e in events:
        if e.get("cat") in GPU_ACTIVITY:
            start = float(e["ts"])
            stream = int(e.get("args", {}).get("stream", -1))
            spans.append(
                {"name": e["name"], "stream": stream, "start": start, "end": start + float(e["dur"])}
            )
    return sorted(spans, key=lambda sp: sp["start"])


def profiled_kernels(fn: Callable[[], None], *, use_graph: bool = True) -> tuple[str, list[dict]]:
    """The GPU work of one call of ``fn``, from the PyTorch profiler (``trace_spans``): a replay of its CUDA
    graph, or an eager call where ``use_graph`` is off, capture fails or the replay's trace holds nothing.
    Returns ``(mode, spans)``, ``mode`` ``"graph"`` or ``"eager"``."""
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    graph = capture_graph(fn) if use_graph else None
    mode, spans = "eager", []
    for mode in ("graph", "eager"):
        if mode == "graph" and graph is None:
            continue
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay() if mode == "graph" else fn()
            torch.cuda.synchronize()
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            with open(path) as f:
                spans = trace_spans(json.load(f)["traceEvents"])
        finally:
            os.unlink(path)
        if spans:
            break
    del graph
    return mode, spans


def kernel_breakdown(step: Callable[[int], None], rotations: int, *, use_graph: bool = True) -> dict:
    """Where one step's time goes: ``step(i)`` for every rotation, profiled (``profiled_kernels``).

    Returns ``{"mode", "steps", "span_us", "kernels"}``.  ``span_us`` is the mean step period: the trace's
    length, first start to last end, over ``rotations``.  ``kernels`` has one entry per launch of a step,
    slowest first: ``{"kernel", "launch", "streams", "us", "start_us", "end_us"}``, the ``launch``-th launch
    of that kernel in the step (in start order), the streams it ran on, its mean duration and when it runs
    (mean offsets from its step's first launch): what overlaps what.  Launches are told apart by order, not
    by stream, because a graph replay puts a captured stream's kernels on different streams from one
    replay to the next.  Steps are told apart only where every step launches the same kernels in the same
    order; otherwise ``steps`` is 1 and the entries are the trace's launches, offsets from its start.
    """
    mode, spans = profiled_kernels(lambda: [step(i) for i in range(rotations)], use_graph=use_graph)
    if not spans:
        return {"mode": mode, "error": "the profiler recorded no kernels"}
    per_step = len(spans) // rotations if len(spans) % rotations == 0 else len(spans)
    chunks = [spans[i : i + per_step] for i in range(0, len(spans), per_step)]
    if any([sp["name"] for sp in c] != [sp["name"] for sp in chunks[0]] for c in chunks):
        chunks = [spans]
    groups: dict[tuple[str, int], list[dict]] = {}
    for chunk in chunks:
        origin, seen = chunk[0]["start"], {}
        for sp in chunk:
            nth = seen[sp["name"]] = seen.get(sp["name"], 0) + 1
            start, end = sp["start"] - origin, sp["end"] - origin
            entry = {"dur": end - start, "start": start, "end": end, "stream": sp["stream"]}
            groups.setdefault((sp["name"], nth), []).append(entry)
    kernels = []
    for (name, nth), g in groups.items():
        kernels.append({
            "kernel": name, "launch": nth, "streams": sorted({x["stream"] for x in g}),
            "us": statistics.mean(x["dur"] for x in g), "start_us": statistics.mean(x["start"] for x in g),
            "end_us": statistics.mean(x["end"] for x in g),
        })  # fmt: skip
    span = (max(sp["end"] for sp in spans) - spans[0]["start"]) / rotations
    return {
        "mode": mode,
        "steps": len(chunks),
        "span_us": span,
        "kernels": sorted(kernels, key=lambda k: -k["us"]),
    }
