"""Benchmark reports: Markdown tables and the kernel-throughput figure (paper Figure 7 style)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["kernel_markdown", "plot_kernel"]


def kernel_markdown(report: dict) -> str:
    """A Markdown table of a ``bench kernel`` report, with its provenance."""
    prov = report["provenance"]
    lines = [
        f"Card: {prov.get('device')} (driver {prov.get('driver')}, CUDA {prov.get('cuda')}), "
        f"torch {prov['torch']}, triton {prov['triton']}, fla {prov.get('fla')}; {prov['date_utc']}.",
        f"Command: `{prov['command']}`; measured copy bandwidth {report['copy_gbps']:.0f} GB/s; "
        f"launch {report['launch']}.",
        "",
        "| family | N | variant | time (us) | state + io MB | GB/s | % of copy BW | speedup vs FLA fp32 |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["rows"]:
        if "error" in r:
            lines.append(
                f"| {r['family']} | {r['n']} | `{r['variant']}` | error: {r['error'][:80]} | | | | |"
            )
            continue
        speed = f"{r['speedup_vs_fla_fp32']:.2f}x" if r.get("speedup_vs_fla_fp32") else ""
        mb = (r["state_bytes"] + r["io_bytes"]) / 1e6
        lines.append(
            f"| {r['family']} | {r['n']} | `{r['variant']}` | {r['ms'] * 1e3:.1f} | {mb:.0f} | "
            f"{r['gbps']:.0f} | {100 * r['copy_fraction']:.0f}% | {speed} |"
        )
    return "\n".join(lines) + "\n"


def plot_kernel(report: dict, path: str | Path) -> Path:
    """Speedup over FLA fp32 against batch size, one panel per family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if "error" not in r and r.get("speedup_vs_fla_fp32")]
    families = sorted({r["family"] for r in rows})
    fig, axes = plt.subplots(1, max(1, len(families)), figsize=(6.0 * max(1, len(families)), 4.2), dpi=130)
    axes = [axes] if len(families) <= 1 else list(axes)
    for ax, family in zip(axes, families):
        variants = []
        for r in rows:
            v = r["variant"]
            if r["family"] == family and v not in variants and not v.endswith(":step"):
                variants.append(v)
        for v in variants:
            pts = sorted(
                (r["n"], r["speedup_vs_fla_fp32"])
                for r in rows
                if r["family"] == family and r["variant"] == v
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", lw=1.5, label=v)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size N (HV=32, K=V=128, one decode token)")
        ax.set_ylabel("speedup over FLA fp32 (same run)")
        ax.set_title(f"{family.upper()} decode kernel, {report['provenance'].get('device')}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
