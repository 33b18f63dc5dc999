"""``leapquant eval | trace``: methods on a real transformers model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..checks import read_json, require_triton
from ..errors import LeapQuantError
from .args import JSON, PLOT, TRACE, count, device, input_file, output_file, positive_float, typed


def _model(text: str) -> str:
    from ..checkpoints import resolve_model

    resolve_model(text)  # fails now, before any work; the report keeps the name as given
    return text


def _backend(text: str) -> str:
    if text == "triton":
        require_triton("--backend triton")
    return text


model_arg = typed(_model, "model")
backend = typed(_backend, "backend")
TRACE_LIMIT_GIB = 1.0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from ..checkpoints import DEFAULT_CHECKPOINT, checkpoint_names
    from ..eval.model_eval import DEFAULT_EVAL_METHODS, EvalConfig

    model_help = (
        f"a shipped checkpoint's name or a transformers model folder (default {DEFAULT_CHECKPOINT}; "
        "shipped: " + ", ".join(checkpoint_names()) + ")"
    )
    p = sub.add_parser(
        "eval",
        help="teacher-forced decoding, FP32 and each method side by side: KL, top-1, NLL, state error",
        description="Teacher-forced decoding of held-out text (the interpreter's standard library, or "
        "--text) with the FP32 state and each --method's state side by side in one batch. Default model: the "
        f"shipped Qwen3.5-architecture checkpoint ({DEFAULT_CHECKPOINT}); default methods: the paper's "
        "Table 2 ablation.",
    )
    p.add_argument("--model", default=DEFAULT_CHECKPOINT, type=model_arg, help=model_help)
    p.add_argument(
        "--method", "-m", action="append", help=f"repeatable (default: {' '.join(DEFAULT_EVAL_METHODS)})"
    )
    p.add_argument("--tokens", type=count(), default=1024, help="decode steps scored (default 1024)")
    p.add_argument("--prefill", type=count(), default=64, help="prompt tokens before decoding (default 64)")
    p.add_argument(
        "--chunk",
        type=count(),
        default=EvalConfig.chunk,
        help="teacher-forced tokens per model call; the method states still take them one by one (default "
        f"{EvalConfig.chunk}; 1: a model call per token)",
    )
    p.add_argument(
        "--text", metavar="FILE", type=input_file("file"), help="evaluate on this text (default: stdlib)"
    )
    p.add_argument(
        "--generate",
        action="append",
        default=[],
        metavar="M",
        help="also free-run greedy M vs FP32 (M one of the -m methods)",
    )
    p.add_argument("--generate-tokens", type=count(), default=256, help="greedy tokens (default 256)")
    p.add_argument("--device", default="auto", type=device, help="auto (cuda if present), cpu, cuda, cuda:1")
    p.add_argument(
        "--backend",
        type=backend,
        choices=("auto", "reference", "reference64", "triton"),
        default="auto",
        help="the methods' decode path (default auto: kernels on CUDA, else the torch reference)",
    )
    p.add_argument("--json", metavar="OUT", type=output_file("file", JSON), help="write the report as JSON")
    p.add_argument(
        "--plot", metavar="OUT.png", type=output_file("file", PLOT), help="state error per layer vs tokens"
    )
    p.add_argument(
        "--checkpoint",
        metavar="FILE.pt",
        type=output_file("file", (".pt",)),
        help="save the run at every curve point and, if FILE exists, go on from it (same command)",
    )
    p.add_argument(
        "--time-limit",
        metavar="SECONDS",
        type=positive_float,
        help="with --checkpoint: stop at the first curve point after SECONDS of decoding (exit status 75)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run_eval)

    p = sub.add_parser(
        "eval-report",
        help="markdown tables from `leapquant eval` JSON files (RESULTS.md)",
        description="One markdown table per JSON: method, bytes/element, KL, top-1 agreement, NLL, state "
        "error, with the model, token count and device that produced it.",
    )
    p.add_argument("reports", nargs="+", metavar="JSON", type=input_file("report", JSON))
    p.add_argument(
        "--merge",
        metavar="OUT",
        type=output_file("file", JSON),
        help="the JSONs are one evaluation split over processes by method: write them as one report to OUT "
        "and print one table",
    )
    p.add_argument(
        "--plot",
        metavar="OUT.png",
        type=output_file("file", PLOT),
        help="state error per layer (one report)",
    )
    p.add_argument(
        "--plot-kl",
        metavar="OUT.png",
        type=output_file("file", PLOT),
        help="KL per stretch of tokens against tokens, one panel per model (any number of reports)",
    )
    p.add_argument(
        "--only",
        action="append",
        metavar="M",
        help="with --plot-kl: these methods only (repeatable, in order)",
    )
    p.add_argument(
        "--after",
        metavar="N",
        type=count(0),
        help="also a table of KL and top-1 agreement over the tokens after the first N (from the curve "
        "segments that start at or after N)",
    )
    p.set_defaults(run=run_eval_report)

    p = sub.add_parser(
        "trace",
        help="record a model's linear-attention records on a text into a trace file for `simulate`",
        description="Run TEXT through the model (its own chunked kernels, fp32) and save the general-form "
        "records (decay, write key, read vector, value, query) of the chosen layers and heads.",
    )
    p.add_argument("--model", default=DEFAULT_CHECKPOINT, type=model_arg, help=model_help)
    p.add_argument("--text", metavar="FILE", type=input_file("file"), help="text (default: stdlib source)")
    p.add_argument("--tokens", type=count(2), default=2048, help="tokens recorded (default 2048)")
    p.add_argument("--layers", help="comma-separated layer indices (default: every linear-attention layer)")
    p.add_argument("--heads", help="comma-separated value-head indices (default: all)")
    p.add_argument("--device", default="auto", type=device, help="auto (cuda if present), cpu, cuda, cuda:1")
    p.add_argument("--out", required=True, type=output_file("file", TRACE), help="the .npz file to write")
    p.add_argument(
        "--allow-large",
        action="store_true",
        help=f"write traces over {TRACE_LIMIT_GIB:g} GiB (the size is printed before recording)",
    )
    p.set_defaults(run=run_trace)


def cpu_note(device: str) -> None:
    """The one line a CPU run prints about speed, in place of the libraries' own notices (not prefixed
    ``leapquant:``, which marks errors)."""
    if device == "cpu":
        print(
            "CPU run: transformers' torch reference kernels stand in for flash-linear-attention "
            "(slower; FP32 and every method use the same ones, so the comparison is unchanged)",
            file=sys.stderr,
        )


def _read_text(path: Path | None) -> tuple[str | None, str]:
    if path is None:
        return None, "stdlib"
    return path.read_text(encoding="utf-8", errors="replace"), str(path)


def _int_list(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LeapQuantError(f"--{what} must be comma-separated integers, got {text!r}") from None


def _print_eval_table(report: dict, model: str, config) -> None:
    from rich.table import Table

    from ..eval.eval_report import methods_table_rows
    from .simulate import console

    partial = "" if report.get("complete", True) else f" (interrupted: {report['tokens']} of {config.tokens})"
    table = Table(
        title=f"leapquant eval: {Path(model).name} ({report['architecture']}), {report['tokens']} tokens "
        f"teacher-forced after {config.prefill}{partial}; FP32 NLL {report['fp32']['nll']:.4f} nats/token",
        title_justify="left",
    )
    for col in ("method", "bytes/elem", "KL(fp32||m) nats", "top-1 agree", "NLL nats", "state rel err"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for row in methods_table_rows(report):
        table.add_row(*row)
    console().print(table)


def run_eval(args: argparse.Namespace) -> int:
    from ..eval.model_eval import DEFAULT_EVAL_METHODS, EvalConfig, evaluate_model, load_model
    from ..eval.provenance import provenance

    if args.time_limit is not None and args.checkpoint is None:
        raise LeapQuantError("eval: --time-limit needs --checkpoint (the file the run goes on from)")
    config = EvalConfig(
        methods=tuple(args.method or DEFAULT_EVAL_METHODS),
        tokens=args.tokens,
        prefill=args.prefill,
        chunk=args.chunk,
        generate=tuple(args.generate),
        generate_tokens=args.generate_tokens,
        backend=args.backend,
    )
    text, source = _read_text(args.text)
    cpu_note(args.device)
    model, tokenizer = load_model(args.model, args.device)
    progress = None
    if not args.quiet:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        progress = Progress(
            TextColumn("decoding"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} tokens"),
            TimeRemainingColumn(),
            transient=True,
        )
    info = provenance(cuda=str(model.device).startswith("cuda"))
    latest: dict = {}

    def write(report: dict) -> None:
        report["model"] = str(args.model)
        report["provenance"] = info
        latest["report"] = report
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")

    kwargs = dict(text=text, text_source=source, on_partial=write)
    kwargs |= dict(checkpoint=args.checkpoint, time_limit=args.time_limit)
    try:
        if progress is None:
            report = evaluate_model(model, tokenizer, config, **kwargs)
        else:
            with progress:
                task = progress.add_task("decode", total=config.tokens)
                report = evaluate_model(
                    model, tokenizer, config, on_step=lambda n: progress.advance(task, n), **kwargs
                )
    except KeyboardInterrupt:
        # the numbers so far are finished results: show them, and say where the partial JSON is
        if "report" not in latest:
            raise
        _print_eval_table(latest["report"], args.model, config)
        where = f'; {args.json} holds this partial report ("complete": false)' if args.json else ""
        print(f"leapquant: interrupted after {latest['report']['tokens']} of {config.tokens} tokens{where}",
              file=sys.stderr)  # fmt: skip
        return 130
    report["model"] = str(args.model)
    report["provenance"] = info
    _print_eval_table(report, args.model, config)  # before any file: a failed write loses nothing shown
    if not report["complete"]:  # stopped at the time limit
        if args.json:
            write(report)
        print(f"leapquant: stopped after {report['tokens']} of {config.tokens} tokens at the time limit; "
              f"the same command goes on from {args.checkpoint}", file=sys.stderr)  # fmt: skip
        return 75  # EX_TEMPFAIL: not done, run again
    for name, row in report["methods"].items():
        if "generate" in row:
            g = row["generate"]
            print(
                f"greedy {name} vs fp32: {g['agreement']:.3f} of {g['tokens']} tokens equal, "
                f"median first divergence {g['first_divergence']:g} over {g['prompts']} prompts"
            )
    if args.json:
        write(report)
        print(f"wrote {args.json}")
    if args.plot:
        from ..eval.plot import plot_model_state_error

        print(f"wrote {plot_model_state_error(report, args.plot)}")
    return 0


def eval_markdown(report: dict) -> str:
    """A markdown table of one evaluation report."""
    from ..eval.eval_report import kl_cell

    prov = report.get("provenance", {})
    done = "" if report.get("complete", True) else " (cut short: partial report)"
    lines = [
        f"`{Path(report['model']).name}` ({report['architecture']}), {report['tokens']} teacher-forced "
        f"tokens after a {report['prefill']}-token prompt{done}; "
        f"FP32 NLL {report['fp32']['nll']:.4f} nats/token; "
        f"{prov.get('device', '?')}, {prov.get('date_utc', '?')}, backend {report['backend']}.",
        "",
        "| method | bytes/elem | KL(fp32 \\|\\| m) nats/token | top-1 agreement | NLL nats/token "
        "| state rel err |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, row in report["methods"].items():
        gen = row.get("generate")
        extra = ""
        if gen:
            first = gen["first_divergence"] if gen["first_divergence"] is not None else gen["tokens"]
            extra = (
                f" (greedy, {gen.get('prompts', 1)} prompts: {gen['agreement']:.3f} equal, median first "
                f"divergence {first:g})"
            )
        lines.append(
            f"| `{name}`{extra} | {row['bytes_per_element']:.3f} | {kl_cell(report, name, '.2e')} "
            f"| {row['top1_agreement']:.4f} | {row['nll']:.4f} | {row['state_rel_err']:.2e} |"
        )
    return "\n".join(lines) + "\n"


def after_markdown(report: dict, after: int) -> str:
    """A markdown table of KL and top-1 agreement over the tokens after the first ``after``."""
    from ..eval.eval_report import metrics_after

    rows = metrics_after(report, after)
    first = next(iter(rows.values()))
    lines = [
        f"`{Path(report['model']).name}`: tokens {first['from'] + 1} to {first['from'] + first['tokens']} of "
        f"{report['tokens']} (curve segments from token {after} on).",
        "",
        "| method | bytes/elem | KL(fp32 \\|\\| m) nats/token | top-1 agreement |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, row in rows.items():
        b = report["methods"][name]["bytes_per_element"]
        lines.append(f"| `{name}` | {b:.3f} | {row['kl']:.2e} | {row['top1_agreement']:.4f} |")
    return "\n".join(lines) + "\n"


_EVAL_KEYS = ("architecture", "tokens", "prefill", "backend", "fp32", "methods")


def _eval_report(path: Path) -> dict:
    report = read_json(path, "report")
    if not isinstance(report, dict) or not all(key in report for key in _EVAL_KEYS):
        kind = (
            " (a `leapquant memory` report)"
            if isinstance(report, dict) and "gpu_memory_gib" in report
            else ""
        )
        raise LeapQuantError(f"report {path}: not a `leapquant eval` JSON report{kind}")
    report.setdefault("model", path.stem)
    return report


def run_eval_report(args: argparse.Namespace) -> int:
    reports = [_eval_report(p) for p in args.reports]
    if args.only and not args.plot_kl:
        raise LeapQuantError("--only picks the lines of --plot-kl: give --plot-kl OUT.png")
    if args.plot and len(reports) != 1 and not args.merge:
        raise LeapQuantError("--plot draws one report: give one JSON (or several with --merge)")
    try:
        if args.merge:
            from ..eval.eval_report import merge_reports

            reports = [merge_reports(reports)]
        markdown = [eval_markdown(report) for report in reports]
        if args.after is not None:
            markdown += [after_markdown(report, args.after) for report in reports]
    except (KeyError, TypeError) as exc:  # a report with the keys but not their contents
        raise LeapQuantError(
            f"not a well-formed `leapquant eval` report ({type(exc).__name__}: {exc})"
        ) from None
    for text in markdown:
        print(text)
    if args.merge:
        Path(args.merge).write_text(json.dumps(reports[0], indent=1))
        print(f"wrote {args.merge}")
    if args.plot:
        from ..eval.plot import plot_model_state_error

        plot_model_state_error(reports[0], args.plot)
        print(f"wrote {args.plot}")
    if args.plot_kl:
        from ..eval.plot import plot_kl_curves

        print(f"wrote {plot_kl_curves(reports, args.plot_kl, methods=args.only)}")
    return 0


def _trace_bytes(model: str, layers: list[int] | None, heads: list[int] | None, tokens: int) -> int | None:
    """Bytes of the float32 records a trace holds (before compression): a, k, b, q of d_k and v of d_v;
    ``None`` when the planner cannot read the model's config (the records are then measured instead)."""
    from ..checkpoints import resolve_model
    from ..plan import load_shape

    try:
        shape = load_shape(str(resolve_model(model)))
    except LeapQuantError:
        return None
    streams = (len(layers) if layers else shape.linear_layers) * (len(heads) if heads else shape.heads_v)
    return streams * tokens * (4 * shape.d_k + shape.d_v) * 4


def _check_trace_size(size: int, tokens: int, allow_large: bool) -> None:
    if size > TRACE_LIMIT_GIB * 2**30 and not allow_large:
        raise LeapQuantError(
            f"trace: {tokens} tokens make about {size / 2**30:.1f} GiB of records; pass --allow-large to "
            "write it, or fewer --tokens, --layers or --heads"
        )


def run_trace(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from ..eval.model_eval import load_model, record_trace
    from ..eval.provenance import provenance
    from ..traces.io import save_trace

    layers, heads = _int_list(args.layers, "layers"), _int_list(args.heads, "heads")
    size = _trace_bytes(args.model, layers, heads, args.tokens)
    if size is not None:
        _check_trace_size(size, args.tokens, args.allow_large)
    expected = f" (up to {size / 2**20:,.0f} MiB before compression)" if size is not None else ""
    print(f"recording {args.tokens} tokens into {args.out}{expected}")
    text, source = _read_text(args.text)
    cpu_note(args.device)
    model, tokenizer = load_model(args.model, args.device)
    # one forward pass over the whole text: no step count to show, so a spinner and the time it has taken
    spinner = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    with spinner:
        spinner.add_task(f"running {args.tokens} tokens through the model", total=None)
        records, meta = record_trace(
            model, tokenizer, args.tokens, text=text, text_source=source, layers=layers, heads=heads
        )
    if size is None:
        size = sum(getattr(records, n).numel() * 4 for n in ("a", "k", "b", "v", "q"))
        _check_trace_size(size, args.tokens, args.allow_large)
    meta.update(model=str(args.model), provenance=provenance())
    path = save_trace(args.out, records, None, meta)
    mib = path.stat().st_size / 2**20
    print(f"wrote {path} ({records.k.shape[0]} streams x {records.steps} records, layers {meta['layers']}, "
          f"{mib:,.1f} MiB)")  # fmt: skip
    return 0
