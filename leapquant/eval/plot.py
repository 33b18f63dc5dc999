"""Figures: state error against tokens, in the style of the paper's Figure 3."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_state_error"]


def plot_state_error(report: dict, path: str | Path, title: str | None = None) -> Path:
    """Plot each method's pooled ``state_rel_err`` against tokens (log scale) into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.2), dpi=130)
    for name, row in report["methods"].items():
        points = [(s, e) for s, e in row["state_rel_err"] if e > 0]
        if not points:
            continue
        steps, errs = zip(*points)
        style = "-" if "/w" in row["config"] else "--"
        ax.plot(steps, errs, style, lw=1.6, label=f"{name} ({row['bytes_per_element']:.2f} B/elem)")
    ax.set_yscale("log")
    ax.set_xlabel("decoded tokens")
    ax.set_ylabel("state relative error  ||S - S_ref|| / ||S_ref||")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title or "State error against the exact trajectory (dashed: per-step, solid: per-window)")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
