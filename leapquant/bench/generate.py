"""Decode throughput of a transformers model through ``generate()``: the model's own recurrent state against a
patched one (:func:`leapquant.patch`), same weights, same prompts, in the same run.

This is the small-batch, host-driven path a user of ``transformers`` runs (eager launches, Python between
layers), not a serving engine: what it measures is whether the patched layers add host work or GPU
synchronization that the native path does not.  Each method decodes ``new_tokens`` greedy tokens (no early
stop) from ``batch`` prompts; the time of a one-token ``generate()`` (the prefill and setup) is subtracted, so
the rate is decode tokens per second.  Times are wall-clock between ``torch.cuda.synchronize()`` calls (a
``generate()`` loop is driven by the host, so CUDA events around it would time the same span); each is the
median of ``repeats`` runs after one warm-up run that also compiles the kernels, and the methods take turns
run by run (a shared host's speed drifts by more than the differences measured).  A second warm-up run
times the host side of every linear-attention layer's one-token call (the model's recurrent function, or
the patch's dispatcher and state step in its place): in a host-bound loop that is where a patched layer
gains or loses against the native one.  On the CPU it runs the same code (a check that it works, for
tests), but its times say nothing about a GPU.
"""

from __future__ import annotations

import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import LeapQuantError

__all__ = ["GenerateCase", "bench_generate"]


@dataclass(frozen=True)
class GenerateCase:
    """One throughput measurement: ``batch`` prompts of ``prompt_tokens`` tokens, ``new_tokens`` decoded."""

    batch: int = 64
    prompt_tokens: int = 64
    new_tokens: int = 256
    repeats: int = 3

    def __post_init__(self) -> None:
        for name in ("batch", "prompt_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise LeapQuantError(f"generate bench: {name} must be >= 1, got {getattr(self, name)}")
        if self.new_tokens < 2:
            raise LeapQuantError("generate bench: new_tokens must be >= 2 (one token is the prefill's)")


def _timed(fn, repeats: int, device: str) -> float:
    import torch

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@contextmanager
def _timed_recurrent_calls(model, samples: list[float]):
    """Append the host time (seconds, no synchronization) of each one-token call of the model's
    linear-attention recurrent functions to ``samples``: the module globals its layers call, wrapped for the
    duration (outside a patch's dispatcher, so a patched call counts the patch's whole path).  Not to be
    held across a ``patch`` or ``unpatch`` of the model, which install and remove those dispatchers."""
    from ..integrations.transformers import SUPPORTED_LAYERS, linear_attention_layers

    installed: dict[tuple[str, str], tuple] = {}  # (module, name) -> (the wrapper, the function it wraps)
    timing = [True]  # off once the block ends: a patch's dispatcher may still call a wrapper it wrapped
    try:
        for _, module in linear_attention_layers(model):
            module_name = type(module).__module__
            fn_name = SUPPORTED_LAYERS[type(module).__name__].recurrent_fn
            if (module_name, fn_name) in installed:
                continue
            namespace = sys.modules[module_name].__dict__
            inner = namespace[fn_name]

            def timed(query, *args, _inner=inner, **kwargs):
                start = time.perf_counter()
                try:
                    return _inner(query, *args, **kwargs)
                finally:
                    if timing[0] and query.shape[1] == 1:
                        samples.append(time.perf_counter() - start)

            # a patched layer finds the model's own function behind the dispatcher as ``__wrapped__``
            timed.__wrapped__ = inner.__wrapped__ if getattr(inner, "_leapquant_dispatcher", False) else inner
            namespace[fn_name] = timed
            installed[module_name, fn_name] = (timed, inner)
        yield
    finally:
        timing[0] = False
        for (module_name, fn_name), (timed, inner) in installed.items():
            namespace = sys.modules[module_name].__dict__
            current = namespace.get(fn_name)
            if current is timed:
                namespace[fn_name] = inner
            elif getattr(current, "_leapquant_dispatcher", False) and current.__wrapped__ is timed:
                # a patch made inside the block is still on: its unpatch must restore the function we found
                current.__wrapped__ = inner


def bench_generate(
    model_path: str | Path,
    methods: list[str],
    case: GenerateCase,
    device: str = "cuda",
    graphs: tuple[bool, ...] = (True,),
) -> list[dict]:
    """Decode tokens/s of ``generate()`` for each method (``"fp32"``: the model's own state, unpatched), on
    ``device`` (``"cuda"`` or ``"cpu"``), each patched method once per ``graphs`` setting (``patch(...,
    graphs=)``: per-layer CUDA graphs on or off, to compare both in one process).

    Returns one row per method and setting: ``method``, ``graphs`` (None for fp32), ``decode_s`` (the
    ``new_tokens - 1`` decode steps),
    ``tokens_per_s`` (``batch * (new_tokens - 1) / decode_s``; ``None`` where the decode was within the
    timing noise), ``vs_fp32`` (its rate over FP32's, when ``"fp32"`` is among the methods) and
    ``recurrent_call_us`` (the median host time of one linear-attention layer's one-token call, in a
    warm-up run).
    """
    import torch

    from ..eval.model_eval import load_model, stdlib_text
    from ..integrations import patch

    if not graphs or any(not isinstance(g, bool) for g in graphs):
        raise LeapQuantError(f"generate bench: graphs must be a non-empty tuple of booleans, got {graphs!r}")
    if device not in ("cuda", "cpu"):
        raise LeapQuantError(f"generate bench: device must be cuda or cpu, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise LeapQuantError("generate bench: no CUDA GPU here (--device cpu runs it, its times meaningless)")
    model, tokenizer = load_model(model_path, device)
    text, _ = stdlib_text(64 * case.batch * case.prompt_tokens)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stride = len(ids) // case.batch
    prompts = torch.tensor(
        [ids[i * stride : i * stride + case.prompt_tokens] for i in range(case.batch)], device=device
    )
    mask = torch.ones_like(prompts)

    def generate(n: int):
        return model.generate(
            input_ids=prompts, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
            use_cache=True, pad_token_id=tokenizer.pad_token_id or 0,
        )  # fmt: skip

    methods = list(dict.fromkeys(methods))  # a repeated name would pool its timings into one row
    runs = [(m, None if m == "fp32" else g) for m in methods for g in ((None,) if m == "fp32" else graphs)]
    full: dict[tuple, list[float]] = {run: [] for run in runs}
    setup: dict[tuple, list[float]] = {run: [] for run in runs}
    calls: dict[tuple, list[float]] = {run: [] for run in runs}
    # the methods take turns, one repeat each (pass 0: the warm-ups), so that the host's speed drifting over
    # the run (a shared machine's) reaches every method alike
    for rep in range(case.repeats + 1):
        for run in runs:
            method, use_graphs = run
            handle = None if method == "fp32" else patch(model, method, graphs=use_graphs)
            try:
                if rep == 0:
                    generate(case.new_tokens)  # kernel compilation, allocator
                    with _timed_recurrent_calls(model, calls[run]):
                        generate(case.new_tokens)
                else:
                    full[run].append(_timed(lambda: generate(case.new_tokens), 1, device))
                    setup[run].append(_timed(lambda: generate(1), 1, device))
            finally:
                if handle is not None:
                    handle.unpatch()
    rows = []
    for run in runs:
        method, use_graphs = run
        generate_s, setup_s = statistics.median(full[run]), statistics.median(setup[run])
        decode_s = generate_s - setup_s  # at or below zero when the decode is within the timing noise
        rows.append({
            "method": method, "graphs": use_graphs, "device": device, "batch": case.batch,
            "prompt_tokens": case.prompt_tokens, "new_tokens": case.new_tokens, "generate_s": generate_s,
            "setup_s": setup_s, "decode_s": decode_s,
            "tokens_per_s": case.batch * (case.new_tokens - 1) / decode_s if decode_s > 0 else None,
            "recurrent_call_us": statistics.median(calls[run]) * 1e6 if calls[run] else None,
        })  # fmt: skip
    base = next((r["tokens_per_s"] for r in rows if r["method"] == "fp32"), None)
    for r in rows:
        r["vs_fp32"] = r["tokens_per_s"] / base if base and r["tokens_per_s"] else None
    return rows
