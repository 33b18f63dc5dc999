"""``leapquant simulate | synth | methods | demo``: trace replay from the command line."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

from ..errors import LeapQuantError
from .args import JSON, PLOT, TRACE, count, input_file, output_dir, output_file

DEMO_METHODS = (
    "fp32",
    "bf16",
    "int8",
    "bf16/w16",
    "int8/w16",
    "int8/w16+ct4",
    "leapquant-int8",
    "int4",
    "leapquant-int4",
)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="replay traces through methods and report drift from the exact trajectory",
        description="Replay every stream of every TRACE through each --method in float64 and report the "
        "pooled output and state error against the exact trajectory.",
    )
    p.add_argument(
        "traces",
        nargs="+",
        metavar="TRACE",
        type=input_file("trace", TRACE),
        help=".npz trace files (`leapquant synth` or `leapquant trace` write them)",
    )
    p.add_argument("--method", "-m", action="append", required=True, help="method name; repeat for more")
    p.add_argument("--json", metavar="OUT", type=output_file("file", JSON), help="write the report as JSON")
    p.add_argument(
        "--plot", metavar="OUT.png", type=output_file("file", PLOT), help="state error against tokens"
    )
    p.add_argument("--checkpoints", type=count(), default=32, help="state-error checkpoints (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed for stochastic rounding (default 0)")
    p.add_argument(
        "--backend",
        choices=("reference", "triton"),
        default="reference",
        help="reference: float64 methods; triton: the decode kernels (GPU, or the CPU through the Triton "
        "interpreter: slow, small traces)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run_simulate)

    p = sub.add_parser(
        "synth",
        help="write a synthetic GDN or KDA trace",
        description="Write a synthetic trace (.npz) of --streams heads with long-memory channels, for "
        "`leapquant simulate`.",
    )
    p.add_argument("--family", choices=("gdn", "kda"), default="gdn", help="decay form (default gdn)")
    p.add_argument("--streams", type=count(), default=8, help="heads (default 8)")
    p.add_argument("--tokens", type=count(), default=4096, help="records per head (default 4096)")
    p.add_argument("--dk", type=count(), default=128, help="key dimension (default 128)")
    p.add_argument("--dv", type=count(), default=128, help="value dimension (default 128)")
    p.add_argument(
        "--long-memory",
        type=float,
        default=0.75,
        help="fraction of long-memory heads/channels (default 0.75)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--out", required=True, type=output_file("file", TRACE), help="the .npz file to write")
    p.set_defaults(run=run_synth)

    p = sub.add_parser("methods", help="list named methods with their bytes per element")
    p.add_argument("--dk", type=count(), default=128, help="key dimension of a head (default 128)")
    p.add_argument("--dv", type=count(), default=128, help="value dimension of a head (default 128)")
    p.add_argument("--json", metavar="OUT", type=output_file("file", JSON), help="write the list as JSON")
    p.set_defaults(run=run_methods)

    p = sub.add_parser(
        "demo",
        help="synthetic GDN and KDA traces through the main methods (table + plot)",
        description="The main job on an embedded default: synthesizes GDN and KDA traces with long-memory "
        "heads and replays them through per-step and LeapQuant methods, then writes demo.json and demo.png "
        "into --out.",
    )
    p.add_argument("--tokens", type=count(), default=2048, help="records per head (default 2048)")
    p.add_argument("--streams", type=count(), default=4, help="heads per family (default 4)")
    p.add_argument(
        "--out",
        default="leapquant-demo",
        type=output_dir("folder"),
        help="folder for demo.json and demo.png, created if missing (default ./leapquant-demo)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run_demo)


def _progress(total: int, quiet: bool):
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    if quiet:
        return None
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} records"),
        TimeRemainingColumn(),
        transient=True,
    )


def _run(
    traces, methods: Sequence[str], checkpoints: int, seed: int, quiet: bool, backend="reference"
) -> dict:
    from ..eval.simulate import simulate
    from ..methods.config import parse_method

    if len(set(methods)) != len(methods):
        raise LeapQuantError("simulate: a method is listed twice")
    methods = {m: parse_method(m) for m in methods}  # a bad name fails here, before any work
    total = sum(t.records.steps for t in traces) * len(methods)
    progress = _progress(total, quiet)
    if backend == "triton" and not torch_cuda_available():
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    kwargs = dict(checkpoints=checkpoints, seed=seed, backend=backend)
    if progress is None:
        return simulate(traces, methods, **kwargs)
    with progress:
        task = progress.add_task("replaying", total=total)
        return simulate(traces, methods, on_step=lambda n: progress.advance(task, n), **kwargs)


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def console():
    """A rich console that never truncates tables when output is piped (CI logs, files)."""
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=200)


def print_report(report: dict, title: str) -> None:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("method")
    table.add_column("configuration", style="dim")
    table.add_column("bytes/elem", justify="right")
    table.add_column("output rel err", justify="right")
    table.add_column("final state rel err", justify="right")
    table.add_column("seconds", justify="right", style="dim")

    def err(x):
        return "n/a" if x is None else f"{x:.3e}"

    for name, row in report["methods"].items():
        table.add_row(
            name,
            row["config"],
            f"{row['bytes_per_element']:.3f}",
            err(row["output_rel_err"]),
            err(row["final_state_rel_err"]),
            f"{row['seconds']:.1f}",
        )
    console().print(table)
    for line in report.get("warnings", ()):
        print(f"warning: {line}")


def _write_outputs(report: dict, json_path: str | None, plot_path: str | None, title: str) -> None:
    from ..eval.provenance import provenance

    report["provenance"] = provenance(cuda=report["backend"] == "triton")
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {json_path}")
    if plot_path:
        from ..eval.plot import plot_state_error

        print(f"wrote {plot_state_error(report, plot_path, title)}")


def run_simulate(args: argparse.Namespace) -> int:
    from ..traces.io import load_trace

    traces = [load_trace(p) for p in args.traces]
    stems = [t.name for t in traces]
    if len(set(stems)) != len(stems):  # a/t.npz and b/t.npz: name them by path, so neither overwrites
        for trace, path in zip(traces, args.traces, strict=True):
            trace.name = str(path)
    report = _run(traces, args.method, args.checkpoints, args.seed, args.quiet, args.backend)
    shape = ", ".join(f"{t.name}: {t.streams}x{t.records.steps}" for t in traces)
    print_report(report, f"leapquant simulate ({shape}, backend {args.backend})")
    _write_outputs(report, args.json, args.plot, None)
    return 0


def run_synth(args: argparse.Namespace) -> int:
    from ..traces.io import save_trace
    from ..traces.synth import SynthConfig, synthesize

    cfg = SynthConfig(
        family=args.family,
        streams=args.streams,
        tokens=args.tokens,
        d_k=args.dk,
        d_v=args.dv,
        long_memory=args.long_memory,
        seed=args.seed,
    )
    trace = synthesize(cfg)
    path = save_trace(args.out, trace.records, trace.initial_state, trace.meta)
    print(f"wrote {path} ({cfg.streams} streams x {cfg.tokens} records, d_k={cfg.d_k}, d_v={cfg.d_v})")
    return 0


def run_methods(args: argparse.Namespace) -> int:
    from rich.table import Table

    from ..methods.config import method_names, parse_method

    rows = []
    for name, what in method_names():
        cfg = parse_method(name)
        rows.append(
            {
                "method": name,
                "configuration": cfg.name,
                "what": what,
                "bytes_per_element": cfg.bytes_per_element(args.dk, args.dv),
                # the buffer holds each record's decay: one value per record for GDN, d_k for KDA
                "record_buffer_bytes_per_head_gdn": cfg.record_buffer_bytes(args.dk, args.dv, 1),
                "record_buffer_bytes_per_head_kda": cfg.record_buffer_bytes(args.dk, args.dv, args.dk),
            }
        )
    table = Table(title=f"methods (bytes per element for {args.dk}x{args.dv} heads)", title_justify="left")
    columns = ("method", "configuration", "bytes/elem", "records B/head GDN", "records B/head KDA", "what")
    for col in columns:
        table.add_column(col, justify="right" if "B" in col or "bytes" in col else "left")
    for r in rows:
        table.add_row(
            r["method"],
            r["configuration"],
            f"{r['bytes_per_element']:.4f}",
            f"{r['record_buffer_bytes_per_head_gdn']:,}",
            f"{r['record_buffer_bytes_per_head_kda']:,}",
            r["what"],
        )
    console().print(table)
    print("Record buffers: GDN keeps one decay value per record, KDA one per key channel.")
    print("Grammar: CODEC[/wP][+ctR][+svd][+itN][+smooth][+ls][+rec16|+recbf16|+rec32][+sr]")
    if args.json:
        from ..eval.provenance import provenance

        report = {"d_k": args.dk, "d_v": args.dv, "methods": rows, "provenance": provenance()}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from ..traces.synth import SynthConfig, synthesize

    start = time.perf_counter()
    traces = [
        synthesize(SynthConfig(family=f, streams=args.streams, tokens=args.tokens, seed=i))
        for i, f in enumerate(("gdn", "kda"))
    ]
    report = _run(traces, DEMO_METHODS, 32, 0, args.quiet)
    title = f"leapquant demo: synthetic GDN + KDA, {args.streams}+{args.streams} heads x {args.tokens} tokens"
    print_report(report, title)
    out = Path(args.out)
    out.mkdir(exist_ok=True)  # its parent was checked before the run
    _write_outputs(report, str(out / "demo.json"), str(out / "demo.png"), title)
    print(f"demo finished in {time.perf_counter() - start:.1f} s")
    return 0
