"""Reading ``leapquant eval`` reports: merging runs split by method, metrics after a token, table cells.

Kept apart from :mod:`leapquant.eval.model_eval`, which makes the reports.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import LeapQuantError

__all__ = [
    "first_nonfinite",
    "kl_cell",
    "merge_reports",
    "methods_table_rows",
    "metrics_after",
    "nonfinite_by",
]


def merge_reports(reports: Sequence[dict]) -> dict:
    """One report from several runs of the same evaluation split over processes by method.

    Every run scores its methods against its own FP32 row on the same text, so the runs must agree on the
    model, the text, the token count, the backend, the curve points and (to rounding: batches of other
    sizes may sum in another order) the FP32 NLL; a method may appear in one run only.  Raises
    :class:`LeapQuantError` otherwise.
    """
    if not reports:
        raise LeapQuantError("merge: no reports")
    first = reports[0]
    merged = {**first, "methods": {}, "curves": {"tokens": first["curves"]["tokens"], "layers": {}}}
    for r in reports:
        for key in ("model", "tokens", "prefill", "text", "chunk", "backend"):
            if r.get(key) != first.get(key):  # chunk: absent from reports made before it was recorded
                raise LeapQuantError(
                    f"merge: reports differ in {key!r} ({r.get(key)!r} vs {first.get(key)!r})"
                )
        marks, first_marks = r["curves"]["tokens"], first["curves"]["tokens"]
        if marks != first_marks:  # the segments of every row must line up
            raise LeapQuantError(f"merge: reports differ in curve points ({marks} vs {first_marks})")
        if abs(r["fp32"]["nll"] - first["fp32"]["nll"]) > 1e-4 * abs(first["fp32"]["nll"]):
            raise LeapQuantError(f"merge: FP32 NLL {r['fp32']['nll']} vs {first['fp32']['nll']}")
        for name, row in r["methods"].items():
            if name in merged["methods"]:
                raise LeapQuantError(f"merge: method {name!r} is in two reports")
            merged["methods"][name] = row
        for layer, curves in r["curves"]["layers"].items():
            merged["curves"]["layers"].setdefault(layer, {}).update(curves)
        for key in SEGMENT_CURVES:  # absent from reports made before they were recorded
            if key in r["curves"]:
                merged["curves"].setdefault(key, {}).update(r["curves"][key])
    merged["complete"] = all(r["complete"] for r in reports)
    merged["merged_from"] = len(reports)
    return merged


SEGMENT_CURVES = ("kl", "top1_agreement")


def metrics_after(report: dict, after: int) -> dict[str, dict]:
    """KL and top-1 agreement per method over the tokens after the first ``after`` (the curve segments
    that start at or after it, each weighted by its tokens): whether a method is ahead at long context,
    which the means over the whole run blur.  Returns ``{method: {"kl", "top1_agreement", "from",
    "tokens"}}``; raises :class:`LeapQuantError` for a report without segment curves or when no segment
    starts that late."""
    curves = report["curves"]
    if any(key not in curves for key in SEGMENT_CURVES):
        raise LeapQuantError(
            "this report has no per-segment KL (made by an older leapquant eval): run the evaluation again"
        )
    ends = curves["tokens"]
    starts = [0, *ends[:-1]]
    picked = [j for j, start in enumerate(starts) if start >= after]
    if not picked:
        raise LeapQuantError(
            f"--after {after}: no curve segment starts at or after token {after} "
            f"(segments start at {', '.join(map(str, starts))})"
        )
    weights = {j: ends[j] - starts[j] for j in picked}
    n = sum(weights.values())
    out = {}
    for name in report["methods"]:
        row = {key: sum(curves[key][name][j] * w for j, w in weights.items()) / n for key in SEGMENT_CURVES}
        out[name] = {**row, "from": starts[picked[0]], "tokens": n}
    return out


def first_nonfinite(ends: Sequence[int], values: Sequence[float]) -> int | None:
    """The curve point (``ends[j]``) that ends the first stretch whose value is not finite, or ``None``."""
    import math

    return next((end for end, v in zip(ends, values, strict=False) if not math.isfinite(v)), None)


def nonfinite_by(report: dict) -> dict[str, int | None]:
    """Per method, the curve point that ends the first stretch of tokens whose KL is not finite (the
    method's state or logits overflowed somewhere in that stretch), ``None`` where every stretch is finite.
    A mean KL of ``nan`` says only that it happened; this says how long the method lasted."""
    segments = report["curves"].get("kl", {})
    return {
        name: first_nonfinite(report["curves"]["tokens"], segments.get(name, ()))
        for name in report["methods"]
    }


def kl_cell(report: dict, name: str, spec: str = ".3e") -> str:
    """A method's mean KL for a table, with where it stopped being finite when it did."""
    by = first_nonfinite(report["curves"]["tokens"], report["curves"].get("kl", {}).get(name, ()))
    kl = format(report["methods"][name]["kl"], spec)
    return kl if by is None else f"{kl} (non-finite by token {by:,})"


def methods_table_rows(report: dict) -> Sequence[tuple[str, ...]]:
    """Rows for printing: method, B/elem, KL, top-1, NLL, state error."""
    return [
        (
            name,
            f"{row['bytes_per_element']:.3f}",
            kl_cell(report, name),
            f"{row['top1_agreement']:.4f}",
            f"{row['nll']:.4f}",
            f"{row['state_rel_err']:.3e}",
        )
        for name, row in report["methods"].items()
    ]
