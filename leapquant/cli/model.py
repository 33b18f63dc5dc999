"""``leapquant eval | trace``: methods on a real transformers model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import LeapQuantError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from ..eval.model_eval import DEFAULT_EVAL_METHODS, DEFAULT_MODEL

    p = sub.add_parser(
        "eval",
        help="teacher-forced decoding, FP32 and each method side by side: KL, top-1, NLL, state error",
        description="Teacher-forced decoding of held-out text (the interpreter's standard library, or "
        "--text) with the FP32 state and each --method's state side by side in one batch. Default model: the "
        f"shipped Qwen3.5-architecture checkpoint ({DEFAULT_MODEL.name}); default methods: the paper's "
        "Table 2 ablation.",
    )
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="transformers model folder (default: shipped)")
    p.add_argument(
        "--method", "-m", action="append", help=f"repeatable (default: {' '.join(DEFAULT_EVAL_METHODS)})"
    )
    p.add_argument("--tokens", type=int, default=1024, help="decode steps scored (default 1024)")
    p.add_argument("--prefill", type=int, default=64, help="prompt tokens before decoding (default 64)")
    p.add_argument("--text", metavar="FILE", help="evaluate on this text instead of the standard library")
    p.add_argument(
        "--generate", action="append", default=[], metavar="M", help="also free-run greedy M vs FP32"
    )
    p.add_argument("--generate-tokens", type=int, default=256)
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu, cuda, cuda:1, ...")
    p.add_argument("--backend", choices=("auto", "reference", "reference64", "triton"), default="auto")
    p.add_argument("--json", metavar="OUT", help="write the report as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="state error per layer against tokens")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run_eval)

    p = sub.add_parser(
        "eval-report",
        help="markdown tables from `leapquant eval` JSON files (RESULTS.md)",
        description="One markdown table per JSON: method, bytes/element, KL, top-1 agreement, NLL, state "
        "error, with the model, token count and device that produced it.",
    )
    p.add_argument("reports", nargs="+", metavar="JSON")
    p.add_argument(
        "--merge",
        metavar="OUT",
        help="the JSONs are one evaluation split over processes by method: write them as one report to OUT "
        "and print one table",
    )
    p.add_argument("--plot", metavar="OUT.png", help="state error per layer against tokens (one report)")
    p.set_defaults(run=run_eval_report)

    p = sub.add_parser(
        "trace",
        help="record a model's linear-attention records on a text into a trace file for `simulate`",
        description="Run TEXT through the model (its own chunked kernels, fp32) and save the general-form "
        "records (decay, write key, read vector, value, query) of the chosen layers and heads.",
    )
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--text", metavar="FILE", help="text file (default: standard-library source)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", help="comma-separated layer indices (default: every linear-attention layer)")
    p.add_argument("--heads", help="comma-separated value-head indices (default: all)")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", required=True, help="output .npz")
    p.set_defaults(run=run_trace)


def _read_text(path: str | None, needed_bytes: int) -> tuple[str | None, str]:
    if path is None:
        return None, "stdlib"
    p = Path(path)
    if not p.is_file():
        raise LeapQuantError(f"text file {path} does not exist")
    return p.read_text(encoding="utf-8", errors="replace"), str(p)


def _int_list(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LeapQuantError(f"--{what} must be comma-separated integers, got {text!r}") from None


def run_eval(args: argparse.Namespace) -> int:
    from rich.table import Table

    from ..eval.model_eval import (
        DEFAULT_EVAL_METHODS,
        EvalConfig,
        evaluate_model,
        load_model,
        methods_table_rows,
    )
    from ..eval.provenance import provenance
    from .simulate import console

    config = EvalConfig(
        methods=tuple(args.method or DEFAULT_EVAL_METHODS),
        tokens=args.tokens,
        prefill=args.prefill,
        generate=tuple(args.generate),
        generate_tokens=args.generate_tokens,
        backend=args.backend,
    )
    text, source = _read_text(args.text, 0)
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

    def write(report: dict) -> None:
        report["model"] = str(args.model)
        report["provenance"] = info
        if args.json:
            path = Path(args.json)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=2) + "\n")

    kwargs = dict(text=text, text_source=source, on_partial=write)
    if progress is None:
        report = evaluate_model(model, tokenizer, config, **kwargs)
    else:
        with progress:
            task = progress.add_task("decode", total=config.tokens)
            report = evaluate_model(
                model, tokenizer, config, on_step=lambda n: progress.advance(task, n), **kwargs
            )
    write(report)
    table = Table(
        title=f"leapquant eval: {Path(args.model).name} ({report['architecture']}), {config.tokens} tokens "
        f"teacher-forced after {config.prefill}; FP32 NLL {report['fp32']['nll']:.4f} nats/token",
        title_justify="left",
    )
    for col in ("method", "bytes/elem", "KL(fp32||m) nats", "top-1 agree", "NLL nats", "state rel err"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for row in methods_table_rows(report):
        table.add_row(*row)
    console().print(table)
    for name, row in report["methods"].items():
        if "generate" in row:
            g = row["generate"]
            print(
                f"greedy {name} vs fp32: {g['agreement']:.3f} of {g['tokens']} tokens equal, "
                f"median first divergence {g['first_divergence']:g} over {g['prompts']} prompts"
            )
    if args.json:
        print(f"wrote {args.json}")
    if args.plot:
        from ..eval.plot import plot_model_state_error

        print(f"wrote {plot_model_state_error(report, args.plot)}")
    return 0


def eval_markdown(report: dict) -> str:
    """A markdown table of one evaluation report."""
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
            f"| `{name}`{extra} | {row['bytes_per_element']:.3f} | {row['kl']:.2e} "
            f"| {row['top1_agreement']:.4f} | {row['nll']:.4f} | {row['state_rel_err']:.2e} |"
        )
    return "\n".join(lines) + "\n"


def run_eval_report(args: argparse.Namespace) -> int:
    reports = []
    for path in args.reports:
        p = Path(path)
        if not p.is_file():
            raise LeapQuantError(f"report {path} does not exist")
        try:
            reports.append(json.loads(p.read_text()))
        except json.JSONDecodeError as exc:
            raise LeapQuantError(f"{path} is not a `leapquant eval` JSON report ({exc})") from None
    try:
        if args.merge:
            from ..eval.model_eval import merge_reports

            reports = [merge_reports(reports)]
            Path(args.merge).write_text(json.dumps(reports[0], indent=1))
        for report in reports:
            print(eval_markdown(report))
        if args.plot:
            if len(reports) != 1:
                raise LeapQuantError("--plot draws one report: give one JSON (or several with --merge)")
            from ..eval.plot import plot_model_state_error

            plot_model_state_error(reports[0], args.plot)
    except (KeyError, TypeError) as exc:
        raise LeapQuantError(f"not a `leapquant eval` JSON report ({type(exc).__name__}: {exc})") from None
    return 0


def run_trace(args: argparse.Namespace) -> int:
    from ..eval.model_eval import load_model, record_trace
    from ..eval.provenance import provenance
    from ..traces.io import save_trace

    if args.tokens < 2:
        raise LeapQuantError(f"--tokens must be >= 2, got {args.tokens}")
    text, source = _read_text(args.text, 0)
    model, tokenizer = load_model(args.model, args.device)
    records, meta = record_trace(
        model,
        tokenizer,
        args.tokens,
        text=text,
        text_source=source,
        layers=_int_list(args.layers, "layers"),
        heads=_int_list(args.heads, "heads"),
    )
    meta.update(model=str(args.model), provenance=provenance())
    path = save_trace(args.out, records, None, meta)
    print(f"wrote {path} ({records.k.shape[0]} streams x {records.steps} records, layers {meta['layers']})")
    return 0
