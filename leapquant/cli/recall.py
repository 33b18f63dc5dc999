"""``leapquant recall | recall-report``: long-memory recall through each method's state, by distance."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import LeapQuantError

# The all-linear-attention GDN checkpoint trained for the task (scripts/train_recall.py): its long memory
# has no attention to fall back on. Named beside the shipped checkpoints, wherever those live.
RECALL_MODEL = "qwen35-gdn-linear-recall-byte"


def _default_model() -> Path:
    from ..eval.model_eval import DEFAULT_MODEL

    return DEFAULT_MODEL.parent / RECALL_MODEL


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from ..eval.recall import METHOD_PRESETS
    from ..eval.recall_tasks import TASKS
    from .args import JSON, PLOT, count, device, input_file, output_file
    from .model import backend, model_arg

    presets = "; ".join(f"{k}: {' '.join(v)}" for k, v in METHOD_PRESETS.items())
    p = sub.add_parser(
        "recall",
        help="long-memory recall (passkey, multi-query key-value) decoded through each method's state",
        description="Keys planted DISTANCE tokens before their query in standard-library text; the context "
        "streams through each method's state (FP32 beside every method, one batch), and the answer is "
        "decoded greedily through that state. Prints exact-match accuracy per method and distance. "
        f"Method presets: {presets}.",
    )
    p.add_argument(
        "--model", type=model_arg,
        help=f"a checkpoint's name or a transformers folder (default {RECALL_MODEL})",
    )  # fmt: skip
    p.add_argument(
        "--method", "-m", action="append",
        help="method, preset or layer plan (PLAN.json), repeatable (default: int8-ablation)",
    )  # fmt: skip
    p.add_argument("--task", choices=list(TASKS), default="passkey")
    p.add_argument(
        "--distances", type=count(), nargs="+", default=[1024, 4096, 16384], metavar="N",
        help="tokens between the planted keys and their query (default 1024 4096 16384)",
    )  # fmt: skip
    p.add_argument("--examples", type=count(), default=8, help="prompts per distance (default 8)")
    p.add_argument("--prefix", type=count(), default=128, help="text tokens prefilled before the keys")
    p.add_argument("--chunk", type=count(), default=256, help="tokens per model call while streaming")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--text", metavar="FILE", type=input_file("file"), help="filler text instead of the standard library"
    )
    p.add_argument(
        "--device", default="auto", type=device, help="auto (cuda if present), cpu, cuda, cuda:1, ..."
    )
    p.add_argument(
        "--backend", choices=("auto", "reference", "reference64", "triton"), default="auto", type=backend
    )
    p.add_argument(
        "--json", metavar="OUT", type=output_file("file", JSON),
        help="write the report as JSON (after every distance)",
    )  # fmt: skip
    p.add_argument(
        "--plot", metavar="OUT.png", type=output_file("file", PLOT),
        help="accuracy against distance, one line per method",
    )  # fmt: skip
    p.set_defaults(run=run_recall)

    p = sub.add_parser(
        "recall-report",
        help="markdown table (and plot) from `leapquant recall` JSON files",
        description="One markdown table of exact-match accuracy per method and distance. Several JSONs of "
        "one evaluation split over processes (by method or by distance) are merged first.",
    )
    p.add_argument("reports", nargs="+", metavar="JSON", type=input_file("report", JSON))
    p.add_argument(
        "--merge", metavar="OUT", type=output_file("file", JSON), help="also write the merged report to OUT"
    )
    p.add_argument(
        "--plot", metavar="OUT.png", type=output_file("file", PLOT), help="accuracy against distance"
    )
    p.set_defaults(run=run_recall_report)


def run_recall(args: argparse.Namespace) -> int:
    from rich.table import Table

    from ..checkpoints import resolve_model
    from ..eval.model_eval import load_model
    from ..eval.provenance import provenance
    from ..eval.recall import METHOD_PRESETS, RecallConfig, evaluate_recall, recall_table_rows
    from .simulate import console

    config = RecallConfig(
        methods=tuple(args.method or ["int8-ablation"]),
        task=args.task,
        distances=tuple(args.distances),
        examples=args.examples,
        prefix=args.prefix,
        chunk=args.chunk,
        seed=args.seed,
        backend=args.backend,
    )
    model_dir = resolve_model(args.model) if args.model else _default_model()
    if args.model is None and not (model_dir / "config.json").is_file():
        raise LeapQuantError(
            f"no {RECALL_MODEL} checkpoint at {model_dir}: train it (scripts/gpu-train-recall.sh) "
            "or give --model"
        )
    text = None
    if args.text:
        text = Path(args.text).read_text(encoding="utf-8", errors="replace")
    model, tokenizer = load_model(model_dir, args.device)
    info = provenance(cuda=str(model.device).startswith("cuda"))
    info["method_presets"] = {
        k: v for k, v in METHOD_PRESETS.items() if k in (args.method or ["int8-ablation"])
    }

    def write(report: dict) -> None:
        report["model"] = str(model_dir)
        report["provenance"] = info
        if args.json:  # its folder was checked when the command line was read
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")

    report = evaluate_recall(
        model, tokenizer, config, text=text, text_source=str(args.text) if args.text else "stdlib",
        on_partial=write,
    )  # fmt: skip
    write(report)
    table = Table(
        title=f"leapquant recall: {model_dir.name}, {config.task}, {config.examples} prompts per distance, "
        "exact-match accuracy (%)",
        title_justify="left",
    )
    table.add_column("method")
    table.add_column("bytes/elem", justify="right")
    for d in report["distances"]:
        table.add_column(f"{d}", justify="right")
    for row in recall_table_rows(report):
        table.add_row(*row)
    console().print(table)
    if args.json:
        print(f"wrote {args.json}")
    if args.plot:
        from ..eval.plot import plot_recall_accuracy

        print(f"wrote {plot_recall_accuracy(report, args.plot)}")
    return 0


def recall_markdown(report: dict) -> str:
    """Markdown tables of one ``leapquant recall`` report: accuracy, then agreement with FP32 and state
    error."""
    from ..eval.recall import recall_table_rows, state_table_rows

    done = "" if report.get("complete", True) else " (cut short: partial report)"
    dists = report["distances"]
    lines = [
        f"`{Path(report['model']).name}` ({report['architecture']}), {report['task']}, {report['examples']} "
        f"prompts per distance, {report['prefix']}-token prefix{done}; {_where(report)}, "
        f"backend {report['backend']}. Exact-match accuracy (%) by distance (tokens).",
        "",
        "| method | bytes/elem | " + " | ".join(str(d) for d in dists) + " |",
        "| --- | ---: |" + " ---: |" * len(dists),
    ]
    lines += [f"| `{r[0]}` | " + " | ".join(r[1:]) + " |" for r in recall_table_rows(report)]
    lines += [
        "",
        "Decoded answers equal to FP32's, and the state error ||S - S_fp32|| / ||S_fp32|| after the last "
        "answer, by distance.",
        "",
        "| method | " + " | ".join([*(f"= FP32 {d}" for d in dists), *(f"err {d}" for d in dists)]) + " |",
        "| --- |" + " ---: |" * (2 * len(dists)),
    ]
    lines += [f"| `{r[0]}` | " + " | ".join(r[1:]) + " |" for r in state_table_rows(report)]
    return "\n".join(lines) + "\n"


def merge_recall(reports: list[dict]) -> dict:
    """One report from runs split by method or distance; they must share model, task and prompts.

    A method may miss a distance only where a report holding it was cut short (``complete`` false: a
    process that ran out of time keeps the distances it finished); its cell then reads "not reached".
    A complete report missing a distance means a file was left out, and is refused.
    """
    first = reports[0]
    merged = {**first, "methods": {}, "distances": [], "seconds": {}, "values": {}}
    cut_short = set()
    text_tokens: dict[int, int | None] = {}  # the filler text each distance's prompts were cut from
    for r in reports:
        if not r["complete"]:
            cut_short |= set(r["methods"])
        for key in ("model", "task", "examples", "prefix", "seed"):
            if r[key] != first[key]:
                raise LeapQuantError(f"merge: reports differ in {key!r} ({r[key]!r} vs {first[key]!r})")
        source, tokens = r.get("text", {}).get("source"), r.get("text", {}).get("tokens")
        first_source = first.get("text", {}).get("source")
        if None not in (source, first_source) and source != first_source:  # None: made before it was kept
            raise LeapQuantError(f"merge: reports differ in filler text ({source!r} vs {first_source!r})")
        for d in r["distances"]:
            # an example's offset is drawn over the whole text, whose length follows the run's longest
            # distance: two runs of one distance with other longest distances asked other prompts.  A merged
            # report keeps each distance's length; one merged before it did (a single count) says nothing.
            if isinstance(tokens, dict):
                here = tokens.get(str(d))
            else:
                here = None if "merged_from" in r else tokens
            seen = text_tokens.get(d)
            if None not in (here, seen) and here != seen:
                raise LeapQuantError(
                    f"merge: distance {d} was asked on {seen} and on {here} tokens of text (runs "
                    "with other longest distances draw other prompts): merge runs that split by method with "
                    "the same distances, or by distance"
                )
            if seen is None:
                text_tokens[d] = here
        merged["distances"] = sorted(set(merged["distances"]) | set(r["distances"]))
        merged["seconds"].update(r["seconds"])
        merged["values"].update(r.get("values", {}))
        for name, row in r["methods"].items():
            into = merged["methods"].setdefault(name, {})
            for key, value in row.items():
                if not isinstance(value, dict):
                    # one name, one configuration: the same plan path on two machines may hold two plans
                    if key in into and into[key] != value:
                        hint = (
                            " (reports before 2026-12-07 counted all heads as 128x128: rerun the older one)"
                            if key == "bytes_per_element"
                            else ""
                        )
                        raise LeapQuantError(
                            f"merge: method {name!r} has {key} {into[key]!r} in one report and {value!r} "
                            f"in another{hint}"
                        )
                    into[key] = value
                    continue
                for d, v in value.items():
                    if key == "accuracy" and d in into.get(key, {}):
                        # FP32 runs in every process of a split by method: it must agree with itself
                        if name != "fp32":
                            raise LeapQuantError(f"merge: method {name!r} at distance {d} is in two reports")
                        if into[key][d] != v:
                            raise LeapQuantError(
                                f"merge: FP32 accuracy at distance {d} differs between reports"
                            )
                    into.setdefault(key, {})[d] = v
    for name, row in merged["methods"].items():
        missing = [d for d in merged["distances"] if str(d) not in row.get("accuracy", {})]
        if missing and name not in cut_short:
            raise LeapQuantError(f"merge: method {name!r} has no result at distances {missing}")
    # per distance (None: not known), so that a merge of this report can check it again
    by_distance = {str(d): n for d, n in sorted(text_tokens.items())}
    merged["text"] = {**first.get("text", {}), "tokens": by_distance}
    merged["complete"] = all(r["complete"] for r in reports)
    merged["merged_from"] = len(reports)
    # each run's own wall time per distance (``seconds`` above is only the last run's, per distance) and
    # where it ran: a table may join distances measured on different machines. A merged input keeps its runs.
    merged["seconds_by_run"] = [run for r in reports for run in _runs(r)]
    return merged


def _runs(report: dict) -> list[dict]:
    """The runs a report holds, each with its machine (a merged report's runs carry their own; runs merged
    before runs recorded a machine take the report's)."""
    prov = report.get("provenance", {})
    where = {"device": prov.get("device", "?"), "date_utc": prov.get("date_utc", "?")}
    if "seconds_by_run" in report:
        return [{**where, **run} for run in report["seconds_by_run"]]
    methods = [m for m in report["methods"] if m != "fp32"]
    return [{"methods": methods, "distances": report["distances"], "seconds": report["seconds"], **where}]


def _where(report: dict) -> str:
    """``device, date`` of a report, or per machine the distances it measured (a merge across machines)."""
    prov = report.get("provenance", {})
    runs = report.get("seconds_by_run") or []
    devices: dict[str, tuple[set, set]] = {}
    for run in runs:
        dists, dates = devices.setdefault(run.get("device", prov.get("device", "?")), (set(), set()))
        dists.update(run.get("distances", run.get("seconds", {})))
        dates.add(str(run.get("date_utc", prov.get("date_utc", "?")))[:10])
    if len(devices) < 2:
        return f"{prov.get('device', '?')}, {prov.get('date_utc', '?')}"
    parts = []
    for dev, (dists, dates) in devices.items():
        tokens = ", ".join(str(d) for d in sorted(int(x) for x in dists))
        parts.append(f"{dev} ({tokens} tokens, {', '.join(sorted(dates))})")
    return "; ".join(parts)


def run_recall_report(args: argparse.Namespace) -> int:
    from ..checks import read_json

    reports = [read_json(path, "report") for path in args.reports]
    try:
        report = merge_recall(reports) if len(reports) > 1 else reports[0]
        if args.merge:
            Path(args.merge).write_text(json.dumps(report, indent=1) + "\n")
        print(recall_markdown(report))
        if args.plot:
            from ..eval.plot import plot_recall_accuracy

            plot_recall_accuracy(report, args.plot)
    except (KeyError, TypeError) as exc:
        raise LeapQuantError(f"not a `leapquant recall` JSON report ({type(exc).__name__}: {exc})") from None
    return 0
