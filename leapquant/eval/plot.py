"""Figures: state error against tokens, in the style of the paper's Figure 3."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_state_error"]

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
        points = [(s, e) for s, e in row["state_rel_err"] if e > 0]
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
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path
