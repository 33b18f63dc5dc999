"""``leapquant-auto`` on a transformers model: record a short calibration trace, choose a method per layer.

The default calibration text is this package's own Python source (sorted by path): in-domain for code
models, deterministic, and disjoint from the standard-library text ``leapquant eval`` scores on.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..errors import LeapQuantError
from ..methods.auto import POLICIES, AutoPolicy, calibrate
from ..methods.layer_plan import LayerPlan

__all__ = ["calibrate_model", "calibration_text"]


def calibration_text(min_bytes: int) -> str:
    """At least ``min_bytes`` of leapquant's own source, files in path order."""
    root = Path(__file__).resolve().parents[1]
    parts, size = [], 0
    for p in sorted(root.rglob("*.py")):
        text = p.read_text(encoding="utf-8")
        parts.append(f"# file: {p.relative_to(root.parent)}\n{text}\n")
        size += len(parts[-1].encode())
        if size >= min_bytes:
            return "".join(parts)
    raise LeapQuantError(f"leapquant's source holds {size} bytes, fewer than the {min_bytes} asked for")


def calibrate_model(
    model,
    tokenizer,
    policy: str | AutoPolicy = "leapquant-auto",
    *,
    tokens: int = 2048,
    text: str | None = None,
) -> LayerPlan:
    """The :class:`LayerPlan` ``policy`` chooses for ``model`` on ``tokens`` tokens of ``text``.

    Args:
        model, tokenizer: a loaded transformers hybrid (see :func:`leapquant.patch`) and its tokenizer.
        policy: ``"leapquant-auto"`` or an :class:`~leapquant.methods.AutoPolicy`.
        tokens: calibration tokens (the records of every linear layer, from the model's own FP32 state).
        text: calibration text (default: :func:`calibration_text`).
    """
    from ..eval.model_eval import record_trace, token_ids

    if isinstance(policy, str):
        if policy not in POLICIES:
            raise LeapQuantError(f"unknown policy {policy!r}; policies: {', '.join(POLICIES)}")
        name, policy = policy, POLICIES[policy]
    elif isinstance(policy, AutoPolicy):  # a policy equal to a named one is that one
        name = next((n for n, p in POLICIES.items() if p == policy), "custom")
    else:
        raise LeapQuantError(f"policy must be a name or an AutoPolicy, got {type(policy).__name__}")
    if tokens < 16:
        raise LeapQuantError(f"calibration needs at least 16 tokens, got {tokens}")
    source = "leapquant source" if text is None else "given text"
    if text is None:
        _, text, _ = token_ids(tokenizer, tokens, source, gather=lambda n: (calibration_text(n), []))
    records, meta = record_trace(model, tokenizer, tokens, text=text, text_source=source)
    layers = meta["layers"]
    heads = records.k.shape[0] // len(layers)
    per_layer = {
        layer: tuple(getattr(records, n)[i * heads : (i + 1) * heads] for n in ("a", "k", "b", "v"))
        for i, layer in enumerate(layers)
    }
    plan = calibrate(policy, per_layer, name=name)
    return replace(plan, evidence={**plan.evidence, "calibration_text": source})
