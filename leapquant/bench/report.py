"""Benchmark reports: Markdown tables and the kernel-throughput figure (paper Figure 7 style)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["kernel_markdown", "kernel_summary_markdown", "plot_kernel"]


def _ok(report: dict) -> list[dict]:
    return [r for r in report["rows"] if "error" not in r]


def _header(report: dict) -> list[str]:
    prov = report["provenance"]
    return [
        f"Card: {prov.get('device')} (driver {prov.get('driver')}, CUDA {prov.get('cuda')}), "
        f"torch {prov['torch']}, triton {prov['triton']}, fla {prov.get('fla')}; {prov['date_utc']}.",
        f"Command: `{prov['command']}`; measured copy bandwidth {report['copy_gbps']:.0f} GB/s.",
    ]


def _breakdown_lines(rows: list[dict]) -> list[str]:
    """The profiled steps of rows timed with ``--breakdown``: each launch's duration and place."""
    profiled = [r for r in rows if "span_us" in r.get("breakdown", {})]
    if not profiled:
        return []
    out = [
        "",
        "**Profiled steps** (`--breakdown`: the steps of one profiled CUDA-graph replay, or eager launches; "
        "step us = the mean step period; each kernel launch of a step, its duration and when it runs, from "
        "the step's first launch)",
        "",
        "| family | N | variant | profile | step us | kernel (launch) | us | from - to us |",
        "| --- | ---: | --- | --- | ---: | --- | ---: | --- |",
    ]
    for r in profiled:
        bd = r["breakdown"]
        for i, k in enumerate(bd["kernels"][:6]):
            head = f"{r['family']} | {r['n']} | `{r['variant']}` | {bd['mode']} | {bd['span_us']:.1f}"
            if "launch" in k:
                which, us = k["launch"], k["us"]
            else:  # reports of 2026-12-03 16:36-16:55Z: launches grouped by stream, summed per step
                which, us = f"stream {k['stream']}", k["us"] / k["launches"] if k["launches"] else k["us"]
            out.append(
                f"| {head if i == 0 else ' | | | |'} | {k['kernel'][:40]} ({which}) | {us:.1f} | "
                f"{k['start_us']:.1f} - {k['end_us']:.1f} |"
            )
    return out


def kernel_markdown(report: dict) -> str:
    """Every row of a ``bench kernel`` report as one Markdown table, with its provenance."""
    lines = [
        *_header(report),
        f"Launch shapes: {report['launch']}.",
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
    lines += _breakdown_lines(_ok(report))
    return "\n".join(lines) + "\n"


def kernel_summary_markdown(report: dict, n: int = 512) -> str:
    """The tables of BENCHMARKS.md: variants at batch ``n``, speedup against batch size, the sweep."""
    rows = _ok(report)
    families = sorted({r["family"] for r in rows})
    out = [*_header(report), ""]
    shapes = sorted({(r["heads"], r["d_k"], r["d_v"]) for r in rows if "heads" in r})
    shape = "; ".join(f"HV={hv}, K={k}, V={v}" for hv, k, v in shapes) or "shape not recorded"
    out += [
        f"**All variants at N={n}** (time per decode step of one layer, {shape}; floor = the byte "
        "model at the measured copy bandwidth)",
        "",
        "| variant | "
        + " | ".join(f"{f.upper()} us | {f.upper()} floor us | {f.upper()} vs FLA" for f in families)
        + " |",
        "| --- | " + " | ".join("---: | ---: | ---:" for _ in families) + " |",
    ]
    every = [r for r in rows if r.get("table", "main") == "main"]
    main = [r for r in every if r["n"] == n]
    # the batch-size tables take every variant of the run, those with a row at N=n first: one that has none
    # there (measured at other batch sizes only, or an error at this one) still gets its row
    variants = list(dict.fromkeys(r["variant"] for r in sorted(every, key=lambda r: r["n"] != n)))
    for v in dict.fromkeys(r["variant"] for r in main):
        cells = []
        for f in families:
            r = next((x for x in main if x["family"] == f and x["variant"] == v), None)
            if r is None:
                cells.append(" | | ")
                continue
            floor = (r["state_bytes"] + r["io_bytes"]) / (report["copy_gbps"] * 1e9) * 1e6
            cells.append(f"{r['ms'] * 1e3:.0f} | {floor:.0f} | {r.get('speedup_vs_fla_fp32') or 0:.2f}x")
        out.append(f"| `{v}` | " + " | ".join(cells) + " |")
    if not main:
        ran = ", ".join(str(x) for x in sorted({r["n"] for r in every}))
        out.append(f"| (no rows at N={n}; the run has N={ran}) |")
    sizes = sorted({r["n"] for r in every})
    for f in families:
        out += ["", f"**{f.upper()}: speedup over FLA fp32 against batch size**", ""]
        out.append("| variant | " + " | ".join(f"N={s}" for s in sizes) + " |")
        out.append("| --- | " + " | ".join("---:" for _ in sizes) + " |")
        for v in variants:
            cells = []
            for s in sizes:
                r = next(
                    (x for x in rows if x["family"] == f and x["variant"] == v and x["n"] == s
                     and x.get("table", "main") == "main"),
                    None,
                )  # fmt: skip
                cells.append(f"{r['speedup_vs_fla_fp32']:.2f}x" if r and r.get("speedup_vs_fla_fp32") else "")
            out.append(f"| `{v}` | " + " | ".join(cells) + " |")
    sweep = [r for r in rows if r.get("table") == "sweep"]
    if sweep:
        out += ["", "**Window / rank sweep (paper Table 3)**", ""]
        out.append(
            "| variant | " + " | ".join(f"{f.upper()} us | {f.upper()} vs FLA" for f in families) + " |"
        )
        out.append("| --- | " + " | ".join("---: | ---:" for _ in families) + " |")
        for v in dict.fromkeys(r["variant"] for r in sweep):
            cells = []
            for f in families:
                r = next((x for x in sweep if x["family"] == f and x["variant"] == v), None)
                cells.append(
                    f"{r['ms'] * 1e3:.0f} | {r.get('speedup_vs_fla_fp32') or 0:.2f}x" if r else " | "
                )
            out.append(f"| `{v}` | " + " | ".join(cells) + " |")
    out += _breakdown_lines(rows)
    tuning = [r for r in report.get("tuning", []) if "error" not in r]
    if tuning:
        out += ["", "**Launch-shape tuning** (`--tune`, first batch size)", ""]
        out += ["| family | variant | launch | us |", "| --- | --- | --- | ---: |"]
        for r in tuning:
            shape = ", ".join(f"{k}={v}" for k, v in r["launch"].items())
            out.append(f"| {r['family']} | `{r['variant']}` | {shape} | {r['ms'] * 1e3:.0f} |")
    return "\n".join(out) + "\n"


def plot_kernel(report: dict, path: str | Path) -> Path:
    """Speedup over FLA fp32 against batch size, one panel per family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in _ok(report) if r.get("speedup_vs_fla_fp32") and r.get("table", "main") == "main"]
    families = sorted({r["family"] for r in rows})
    fig, axes = plt.subplots(1, max(1, len(families)), figsize=(6.0 * max(1, len(families)), 4.2), dpi=130)
    axes = [axes] if len(families) <= 1 else list(axes)
    for ax, family in zip(axes, families):
        variants = []
        for r in rows:
            v = r["variant"]
            if r["family"] == family and v not in variants:
                variants.append(v)
        for v in variants:
            mine = [r for r in rows if r["family"] == family and r["variant"] == v]
            pts = sorted((r["n"], r["speedup_vs_fla_fp32"]) for r in mine)
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                "o--" if v.endswith(":step") else "o-",
                lw=1.5,
                label=v,
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size N (HV=32, K=V=128, one decode token)")
        ax.set_ylabel("speedup over FLA fp32 (same run)")
        ax.set_title(f"{family.upper()} decode kernel, {report['provenance'].get('device')}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    from ..eval.plot import save_figure

    return save_figure(fig, path)
