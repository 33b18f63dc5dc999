"""Figures: state error against tokens (the paper's Figure 3), KL along a run, recall against distance."""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "plot_kl_curves", "plot_model_state_error", "plot_recall_accuracy", "plot_state_error", "save_figure",
]  # fmt: skip


def save_figure(fig, path: str | Path, bbox_inches: str | None = None) -> Path:
    """Lay out, write (creating the folder) and close a matplotlib figure; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches=bbox_inches)
    plt.close(fig)
    return path


# Errors above this are divergence, not drift: the axis stops here so the others stay readable.
CLIP = 10.0


def plot_state_error(report: dict, path: str | Path, title: str | None = None) -> Path:
    """Plot each method's pooled ``state_rel_err`` against tokens (log scale) into a PNG.

    Per-step methods are dashed, per-window ones solid; a method whose error leaves the axis (above
    ``CLIP``) is drawn up to there and marked "diverged" in the legend.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["methods"]
    fig, ax = plt.subplots(figsize=(10.0, 4.8), dpi=130)
    colors = plt.get_cmap("tab20").colors + plt.get_cmap("tab20b").colors
    for i, (name, row) in enumerate(rows.items()):
        points = [(s, e) for s, e in row["state_rel_err"] if e is not None and e > 0]  # None: no reference
        if not points:
            continue
        steps, errs = zip(*points)
        diverged = max(errs) > CLIP
        style = "-" if row.get("window", 1) > 1 else "--"
        label = f"{name} ({row['bytes_per_element']:.2f} B/elem)" + (", diverged" if diverged else "")
        ax.plot(
            steps, [min(e, CLIP) for e in errs], style, lw=1.5, color=colors[i % len(colors)], label=label
        )
    ax.set_yscale("log")
    ax.set_ylim(top=CLIP * 1.5)
    ax.set_xlabel("decoded tokens")
    ax.set_ylabel("state relative error ||S - S_ref|| / ||S_ref||")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(
        title or "State error against the exact trajectory (dashed: per-step, solid: per-window)", fontsize=9
    )
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=1 if len(rows) <= 18 else 2)
    return save_figure(fig, path, bbox_inches="tight")


def plot_model_state_error(report: dict, path: str | Path, title: str | None = None) -> Path:
    """State error against decoded tokens for every linear-attention layer of a model evaluation
    (``leapquant eval``): one panel per layer, one line per method (dashed: per-step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = report["curves"]["layers"]
    steps = report["curves"]["tokens"]
    cols = min(3, max(1, len(layers)))
    rows = -(-len(layers) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), dpi=120, squeeze=False)
    colors = plt.get_cmap("tab20").colors + plt.get_cmap("tab20b").colors
    names = list(report["methods"])
    for ax, (layer, curves) in zip(axes.flat, layers.items()):
        for name, errs in curves.items():
            if name not in report["methods"]:
                continue
            style = "-" if report["methods"][name]["window"] > 1 else "--"
            pts = [(s, min(e, CLIP)) for s, e in zip(steps, errs) if e > 0]
            if pts:
                ax.plot(*zip(*pts), style, lw=1.3, color=colors[names.index(name) % len(colors)], label=name)
        ax.set_yscale("log")
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlabel("decoded tokens", fontsize=8)
    for ax in list(axes.flat)[len(layers) :]:
        ax.axis("off")
    axes[0][0].set_ylabel("||S - S_fp32|| / ||S_fp32||", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(
        handles, labels, fontsize=7, loc="upper center", ncol=min(6, len(labels)), bbox_to_anchor=(0.5, 1.0)
    )
    fig.suptitle(title or f"{report['architecture']}: state error per layer", fontsize=9, y=1.04)
    return save_figure(fig, path, bbox_inches="tight")


# a stretch whose KL is not finite is drawn at the axis' top: the method's logits overflowed there
_KL_TOP = 10.0


def plot_kl_curves(
    reports: list[dict], path: str | Path, methods: list[str] | None = None, title: str | None = None
) -> Path:
    """Mean KL(FP32 || method) over each stretch of tokens between curve points, against tokens (log
    scale), one panel per model and one line per method (dashed: per-step). Whether a method holds at long
    context, drifts or diverges, which a mean over the whole run hides. Reports of the same model (runs
    split by method) share a panel, where a method in two of them is drawn from the first; ``methods``
    picks and orders the lines (default: every method). KL is drawn up to ``_KL_TOP``; the first stretch
    whose KL is not finite is marked there with an x, and the later ones stay at the top."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..errors import LeapQuantError
    from .eval_report import first_nonfinite

    panels: dict[str, dict[str, tuple[list[int], list[float], dict]]] = {}
    for report in reports:
        if "kl" not in report["curves"]:
            raise LeapQuantError("a report without per-stretch KL (made by an older leapquant eval)")
        lines = panels.setdefault(Path(report["model"]).name, {})
        for name, row in report["methods"].items():
            lines.setdefault(name, (report["curves"]["tokens"], report["curves"]["kl"][name], row))
    known = {name for lines in panels.values() for name in lines}
    unknown = [m for m in methods or () if m not in known]
    if unknown:
        have = ", ".join(sorted(known))
        raise LeapQuantError(f"--only: no report has {', '.join(unknown)} (they have: {have})")
    order = list(methods) if methods else list(dict.fromkeys(n for lines in panels.values() for n in lines))
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.6 * cols, 3.6 * rows), dpi=120, squeeze=False)
    colors = plt.get_cmap("tab10").colors + plt.get_cmap("Dark2").colors
    for ax, (model, lines) in zip(axes.flat, panels.items()):
        for i, name in enumerate(order):
            if name not in lines:
                continue
            tokens, kl, row = lines[name]
            style = "-" if row.get("window", 1) > 1 else "--"
            color = colors[i % len(colors)]
            drawn = [min(v, _KL_TOP) if math.isfinite(v) else _KL_TOP for v in kl]
            ax.plot(tokens, drawn, style, lw=1.3, color=color, label=name)
            bad = first_nonfinite(tokens, kl)
            if bad is not None:
                ax.plot([bad], [_KL_TOP], "x", color=color, ms=7)
        ax.set_yscale("log")
        ax.set_ylim(top=_KL_TOP * 2)
        ax.set_title(model, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlabel("teacher-forced tokens", fontsize=8)
        ax.set_ylabel("KL(FP32 || method) per stretch, nats", fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    labels = [n for n in order if n in handles]
    legend_rows = -(-len(labels) // 5)
    fig.legend([handles[n] for n in labels], labels, fontsize=7, loc="upper center", ncol=min(5, len(labels)),
               bbox_to_anchor=(0.5, 1.0 + 0.02 * legend_rows))  # fmt: skip
    fig.suptitle(title or "KL against FP32 along the run (x: the first non-finite stretch)", fontsize=9,
                 y=1.04 + 0.02 * legend_rows)  # fmt: skip
    return save_figure(fig, path, bbox_inches="tight")


# state errors above this are drawn at the axis' top: the state is gone (or inf/nan)
_RECALL_ERR_TOP = 100.0


# drawn thick in fixed colours on every recall figure: the comparison the task exists for
_RECALL_HIGHLIGHT = {"leapquant-int8": "tab:red", "int8": "tab:blue"}


def plot_recall_accuracy(report: dict, path: str | Path, title: str | None = None) -> Path:
    """Recall against distance (log scale), one line per method (``leapquant recall``), three panels:
    exact-match accuracy; how often the decoded answer equals FP32's (past its trained distances FP32
    itself misses keys, and this is what separates the methods); the state error ``||S - S_fp32|| /
    ||S_fp32||`` after the last answer.  FP32 black and on top, ``leapquant-int8`` and per-step ``int8``
    thick in fixed colours, per-step methods dashed, per-window solid; a method with non-finite logits is
    marked, and state errors beyond the axis (diverged, inf, nan) are drawn at its top as crosses."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dists = report["distances"]
    fig, (ax, ax_agree, ax_err) = plt.subplots(1, 3, figsize=(16.5, 4.6), dpi=130)
    # tab20 without its blues and reds (0, 1, 6, 7): those mark the highlighted pair alone
    tab20 = [c for j, c in enumerate(plt.get_cmap("tab20").colors) if j not in (0, 1, 6, 7)]
    colors = tuple(tab20) + plt.get_cmap("tab20b").colors
    top = _RECALL_ERR_TOP
    for i, (name, row) in enumerate(report["methods"].items()):
        have = [d for d in dists if str(d) in row["accuracy"]]  # a run cut short misses the longest
        acc = [100 * row["accuracy"][str(d)] for d in have]
        bad = any(row["nonfinite"][str(d)] for d in have)
        fp32 = name == "fp32"
        style = "-" if row["window"] > 1 or fp32 else "--"
        color = "black" if fp32 else _RECALL_HIGHLIGHT.get(name, colors[i % len(colors)])
        lw = 2.4 if fp32 or name in _RECALL_HIGHLIGHT else 1.3
        shown = f"plan {Path(name).name}" if "plan" in row else name
        label = f"{shown} ({row['bytes_per_element']:.2f} B/elem)" + (", non-finite" if bad else "")
        z = 4 if fp32 else 3 if name in _RECALL_HIGHLIGHT else 2
        ax.plot(have, acc, style, marker="o", ms=3, lw=lw, color=color, label=label, zorder=z)
        if fp32:
            continue
        agreed = [d for d in have if str(d) in row.get("agree_fp32", {})]
        ax_agree.plot(
            agreed, [100 * row["agree_fp32"][str(d)] for d in agreed], style, marker="o", ms=3, lw=lw,
            color=color, zorder=z,
        )  # fmt: skip
        if "state_rel_err" not in row:
            continue
        measured = [d for d in have if str(d) in row["state_rel_err"]]
        errs = [row["state_rel_err"][str(d)] for d in measured]
        over = [not (math.isfinite(e) and e <= top) for e in errs]
        # an error of exactly 0 (a state equal to FP32's) has no place on a log axis: left out
        points = [(d, top if o else e) for d, e, o in zip(measured, errs, over, strict=True) if o or e > 0]
        if points:
            ax_err.plot(*zip(*points), style, marker="o", ms=3, lw=lw, color=color, zorder=z)
        gone = [d for d, o in zip(measured, over, strict=True) if o]
        ax_err.plot(gone, [top] * len(gone), "x", ms=7, color=color)
    ticks = [f"{d // 1024}K" if d % 1024 == 0 else str(d) for d in dists]
    for a in (ax, ax_agree, ax_err):
        a.set_xscale("log", base=2)
        a.set_xticks(dists, ticks)
        a.set_xlabel("distance from the planted key to the query (tokens)")
        a.grid(True, which="both", alpha=0.3)
    ax.set_ylim(-3, 103)
    ax.set_ylabel("exact-match accuracy (%)")
    ax_agree.set_ylim(-3, 103)
    ax_agree.set_ylabel("answers equal to FP32's (%)")
    ax_err.set_yscale("log")
    ax_err.set_ylim(top=top * 2)
    ax_err.set_ylabel(f"state error vs FP32 (x: > {top:g}, inf or nan)")
    model = Path(str(report["model"])).name
    fig.suptitle(
        title
        or f"{report['task']} recall, {model}, {report['examples']} prompts per distance "
        "(dashed: per-step, solid: per-window)",
        fontsize=9,
    )
    ax_err.legend(*ax.get_legend_handles_labels(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save_figure(fig, path, bbox_inches="tight")
