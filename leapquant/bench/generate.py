"""Decode throughput of a transformers model through ``generate()``: the model's own recurrent state against a
patched one (:func:`leapquant.patch`), same weights, same prompts, in the same run.

This is the small-batch, host-driven path a user of ``transformers`` runs (eager launches, Python between
layers), not a serving engine: what it measures is whether the patched layers add host work or GPU
synchronization that the native path does not.  Each method decodes ``new_tokens`` greedy tokens (no early
stop) from ``batch`` prompts; the time of a one-token ``generate()`` (the prefill and setup) is subtracted, so
the rate is decode tokens per second.  Times are wall-clock between ``torch.cuda.synchronize()`` calls (a
``generate()`` loop is driven by the host, so CUDA events around it would time the same span); each is the
median of ``repeats`` runs after one warm-up run that also compiles the kernels.  On the CPU it runs the
same code (a check that it works, for tests), but its times say nothing about a GPU.
"""

from __future__ import annotations

import statistics
import time
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
    timing noise) and ``vs_fp32`` (its rate over FP32's, when ``"fp32"`` is among the methods).
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

    runs = [(m, None if m == "fp32" else g) for m in methods for g in ((None,) if m == "fp32" else graphs)]
    rows = []
    for method, use_graphs in runs:
        handle = None if method == "fp32" else patch(model, method, graphs=use_graphs)
        try:
            generate(case.new_tokens)  # warm-up: kernel compilation, allocator
            full = _timed(lambda: generate(case.new_tokens), case.repeats, device)
            setup = _timed(lambda: generate(1), case.repeats, device)
        finally:
            if handle is not None:
                handle.unpatch()
        decode_s = full - setup  # at or below zero when the decode is within the timing noise (tiny runs)
        rows.append({
            "method": method, "graphs": use_graphs, "device": device, "batch": case.batch,
            "prompt_tokens": case.prompt_tokens, "new_tokens": case.new_tokens, "generate_s": full,
            "setup_s": setup, "decode_s": decode_s,
            "tokens_per_s": case.batch * (case.new_tokens - 1) / decode_s if decode_s > 0 else None,
        })  # fmt: skip
    base = next((r["tokens_per_s"] for r in rows if r["method"] == "fp32"), None)
    for r in rows:
        r["vs_fp32"] = r["tokens_per_s"] / base if base and r["tokens_per_s"] else None
    return rows
