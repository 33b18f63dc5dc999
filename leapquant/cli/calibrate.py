"""``leapquant calibrate``: the ``leapquant-auto`` policy's method per layer for a model, saved as a plan."""

from __future__ import annotations

import argparse
import json


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from ..checkpoints import DEFAULT_CHECKPOINT
    from ..methods.auto import AUTO_CANDIDATES, AutoPolicy
    from .args import JSON, count, device, input_file, output_file, positive_float
    from .model import model_arg

    default = AutoPolicy()
    p = sub.add_parser(
        "calibrate",
        help="choose a method per layer (leapquant-auto) on a short trace; write the plan as JSON",
        description="Record the model's linear-attention records on a calibration text (default: "
        "leapquant's own source), predict each candidate's state error per head over --horizon tokens, and "
        "keep per layer the cheapest candidate within --budget (the most accurate where none is). The plan "
        "goes to `leapquant eval -m PLAN.json`, `leapquant memory --method PLAN.json` and leapquant.patch.",
    )
    p.add_argument(
        "--model", default=DEFAULT_CHECKPOINT, type=model_arg,
        help=f"a shipped checkpoint's name or a transformers folder (default {DEFAULT_CHECKPOINT})",
    )  # fmt: skip
    p.add_argument("--tokens", type=count(16), default=2048, help="calibration tokens, >= 16 (default 2048)")
    p.add_argument(
        "--text", metavar="FILE", type=input_file("file"),
        help="calibration text (default: leapquant's own source)",
    )  # fmt: skip
    p.add_argument(
        "--candidate", "-c", action="append", metavar="M",
        help=f"repeatable, cheapest tried first (default: {' '.join(AUTO_CANDIDATES)})",
    )  # fmt: skip
    p.add_argument(
        "--budget", type=positive_float, default=default.budget,
        help=f"largest predicted state error (default {default.budget})",
    )  # fmt: skip
    p.add_argument(
        "--horizon", type=count(), default=default.horizon,
        help=f"tokens the prediction covers (default {default.horizon})",
    )  # fmt: skip
    p.add_argument("--device", default="cpu", type=device, help="cpu (default), cuda, cuda:1 or auto")
    p.add_argument("--out", required=True, type=output_file("file", JSON), help="the plan (.json)")
    p.set_defaults(run=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    from dataclasses import replace
    from pathlib import Path

    from ..eval.model_eval import load_model
    from ..eval.provenance import provenance
    from ..integrations.calibrate import calibrate_model
    from ..methods.auto import AUTO_CANDIDATES, AutoPolicy

    policy = AutoPolicy(tuple(args.candidate or AUTO_CANDIDATES), args.budget, args.horizon)
    text = None
    if args.text is not None:
        text = Path(args.text).read_text(encoding="utf-8", errors="replace")
    model, tokenizer = load_model(args.model, args.device)
    plan = calibrate_model(model, tokenizer, policy, tokens=args.tokens, text=text)
    how = provenance(cuda=args.device.startswith("cuda"))
    plan = replace(plan, evidence={**plan.evidence, "model": str(args.model), "provenance": how})
    plan.save(args.out)
    print(f"wrote {args.out}: {plan.name}")
    for layer, row in plan.evidence["layers"].items():
        worst = {m: r["worst"] for m, r in row["candidates"].items()}
        print(
            f"  layer {layer}: {row['chosen']}{' (fallback)' if row['fallback'] else ''}  worst head: "
            + json.dumps(worst)
        )
    return 0
