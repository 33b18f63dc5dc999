"""``leapquant calibrate``: the ``leapquant-auto`` policy's method per layer for a model, saved as a plan."""

from __future__ import annotations

import argparse
import json

from ..errors import LeapQuantError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from ..eval.model_eval import DEFAULT_MODEL
    from ..methods.auto import AUTO_CANDIDATES, AutoPolicy

    default = AutoPolicy()
    p = sub.add_parser(
        "calibrate",
        help="choose a method per layer (leapquant-auto) on a short trace; write the plan as JSON",
        description="Record the model's linear-attention records on a calibration text (default: "
        "leapquant's own source), predict each candidate's state error per head over --horizon tokens, and "
        "keep per layer the cheapest candidate within --budget (the most accurate where none is). The plan "
        "goes to `leapquant eval -m PLAN.json`, `leapquant memory --method PLAN.json` and leapquant.patch.",
    )
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--tokens", type=int, default=2048, help="calibration tokens (default 2048)")
    p.add_argument("--text", metavar="FILE", help="calibration text (default: leapquant's own source)")
    p.add_argument(
        "--candidate", "-c", action="append", metavar="M",
        help=f"repeatable, cheapest tried first (default: {' '.join(AUTO_CANDIDATES)})",
    )  # fmt: skip
    p.add_argument("--budget", type=float, default=default.budget, help="largest predicted state error")
    p.add_argument("--horizon", type=int, default=default.horizon, help="tokens the prediction covers")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", required=True, help="the plan (.json)")
    p.set_defaults(run=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    from dataclasses import replace
    from pathlib import Path

    from ..eval.model_eval import load_model
    from ..eval.provenance import provenance
    from ..integrations.calibrate import calibrate_model
    from ..methods.auto import AUTO_CANDIDATES, AutoPolicy

    if not args.out.endswith(".json"):
        raise LeapQuantError(f"--out must name a .json file, got {args.out}")
    policy = AutoPolicy(tuple(args.candidate or AUTO_CANDIDATES), args.budget, args.horizon)
    text = None
    if args.text is not None:
        if not Path(args.text).is_file():
            raise LeapQuantError(f"text file {args.text} does not exist")
        text = Path(args.text).read_text(encoding="utf-8", errors="replace")
    model, tokenizer = load_model(args.model, args.device)
    plan = calibrate_model(model, tokenizer, policy, tokens=args.tokens, text=text)
    plan = replace(plan, evidence={**plan.evidence, "model": str(args.model), "provenance": provenance()})
    plan.save(args.out)
    print(f"wrote {args.out}: {plan.name}")
    for layer, row in plan.evidence["layers"].items():
        worst = {m: r["worst"] for m, r in row["candidates"].items()}
        print(
            f"  layer {layer}: {row['chosen']}{' (fallback)' if row['fallback'] else ''}  worst head: "
            + json.dumps(worst)
        )
    return 0
