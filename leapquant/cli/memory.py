"""``leapquant memory``: bytes per request and concurrent requests that fit, per state method."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from ..errors import LeapQuantError
from .args import JSON, count, output_file, positive_float

DEFAULT_METHODS = ("fp32", "bf16", "leapquant-int8")
MIB = 2**20
GIB = 2**30


def add_parsers(sub: argparse._SubParsersAction) -> None:
    from ..plan.presets import ALIASES, PRESETS

    p = sub.add_parser(
        "memory",
        help="capacity planner: state, conv, KV and checkpoint bytes per request, requests that fit",
        description="Per request and per prefix-cache checkpoint: bytes of recurrent state (by method, with "
        "scales, compensator tokens and record buffer), conv state and KV cache; weights; and the "
        "concurrent requests that fit in --gpu-memory. Requests = floor((gpu - weights - reserve) / "
        "per-request bytes).",
    )
    p.add_argument(
        "--model",
        required=True,
        metavar="CONFIG_OR_PATH",
        help=f"preset ({', '.join(PRESETS)}; also {', '.join(ALIASES)}), a shipped checkpoint's name, or a "
        "transformers config.json / a directory holding one",
    )
    p.add_argument(
        "--gpu-memory", type=positive_float, required=True, metavar="GiB", help="GPU memory in GiB"
    )
    p.add_argument("--context", type=count(), required=True, metavar="N", help="tokens per request")
    p.add_argument(
        "--prefix-cache-interval",
        type=count(),
        metavar="TOKENS",
        help="keep one recurrent + conv state checkpoint per TOKENS cached tokens (vLLM/SGLang use 1024 "
        "in their default mode); off by default",
    )
    p.add_argument(
        "--checkpoint",
        choices=("slot", "boundary"),
        help="what a prefix-cache checkpoint of a windowed method holds: the whole slot, records included, "
        "as the vLLM plugin copies it (default), or the boundary state alone, as the paper counts it (an "
        "engine that closed a window on every block boundary); needs --prefix-cache-interval",
    )
    p.add_argument(
        "--method",
        "-m",
        action="append",
        help="state method; repeat for more (default: fp32, bf16, leapquant-int8)",
    )
    p.add_argument(
        "--reserve",
        type=float,
        metavar="GiB",
        help="memory kept for activations, CUDA graphs and allocator slack (default: 10%% of --gpu-memory, "
        "vLLM's default --gpu-memory-utilization 0.9)",
    )
    p.add_argument(
        "--kv-dtype", default="bf16", choices=("bf16", "fp16", "fp8", "fp32"), help="KV cache dtype"
    )
    p.add_argument(
        "--weight-dtype",
        default="bf16",
        choices=("bf16", "fp16", "fp8"),
        help="weight storage (fp8: one byte per parameter, scales not counted)",
    )
    p.add_argument("--text-only", action="store_true", help="do not load the vision tower (Qwen3.5)")
    p.add_argument("--json", metavar="OUT", type=output_file("file", JSON), help="write the plan as JSON")
    p.set_defaults(run=run_memory)


def _mib(n: int) -> str:
    return f"{n / MIB:,.2f}"


def run_memory(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from rich.table import Table

    from ..plan import load_shape, plan_memory
    from .simulate import console

    shape = load_shape(args.model)
    if args.text_only:
        shape = replace(shape, vision_params=0)
    methods = list(dict.fromkeys(args.method or DEFAULT_METHODS))
    if args.checkpoint is not None and not args.prefix_cache_interval:
        raise LeapQuantError("memory: --checkpoint says what a prefix-cache checkpoint holds; it needs "
                             "--prefix-cache-interval")  # fmt: skip
    args.checkpoint = args.checkpoint or "slot"
    common = dict(
        context=args.context,
        gpu_memory_gib=args.gpu_memory,
        prefix_interval=args.prefix_cache_interval,
        reserve_gib=args.reserve,
        kv_dtype=args.kv_dtype,
        weight_dtype=args.weight_dtype,
        checkpoint=args.checkpoint,
    )
    plans = {m: plan_memory(shape, m, **common) for m in methods}
    base = plans.get("fp32") or plan_memory(shape, "fp32", **common)
    first = next(iter(plans.values()))

    attn = (
        f"MLA latent {shape.kv_lora_rank}+{shape.qk_rope_head_dim}"
        if shape.attention == "mla"
        else f"GQA {shape.kv_heads}x{shape.head_dim}"
    )
    ckpt = (
        f", a checkpoint per {args.prefix_cache_interval} tokens ({first.checkpoints} per request, "
        f"{'whole slots' if args.checkpoint == 'slot' else 'boundary states'})"
        if args.prefix_cache_interval
        else ", no prefix caching"
    )
    kind = "KDA" if shape.decay == "vector" else "GDN"
    title = (
        f"leapquant memory: {shape.name}, {shape.linear_layers} {kind} "
        f"layers x {shape.heads_v} heads of {shape.d_k}x{shape.d_v} + {shape.full_layers} full-attention "
        f"layers ({attn}), context {args.context}{ckpt}"
    )
    table = Table(title=title, title_justify="left")
    cols = [
        "method",
        "B/elem",
        "state MiB",
        "conv MiB",
        "KV MiB",
        "ckpt MiB",
        "checkpoints MiB",
        "request MiB",
    ]
    for col in [*cols, "requests", "vs fp32"]:
        table.add_column(col, justify="left" if col == "method" else "right")
    for name, plan in plans.items():
        table.add_row(
            name,
            f"{plan.bytes_per_element:.4f}",
            _mib(plan.state_bytes),
            _mib(plan.conv_bytes),
            _mib(plan.kv_bytes),
            _mib(plan.checkpoint_bytes),
            _mib(plan.checkpoints_bytes),
            _mib(plan.per_request_bytes),
            f"{plan.max_requests:,}",
            f"{plan.max_requests / base.max_requests:.2f}x" if base.max_requests else "-",
        )
    console().print(table)
    print(
        f"budget: {args.gpu_memory:g} GiB GPU - {first.weights_bytes / GIB:.2f} GiB weights "
        f"({shape.params / 1e9:.2f} B params, {args.weight_dtype}) "
        f"- {first.reserve_bytes / GIB:.2f} GiB reserve "
        f"= {first.budget_bytes / GIB:.2f} GiB for requests"
    )
    if first.budget_bytes <= 0:
        print("the weights and reserve do not fit: no request fits (try --weight-dtype fp8 or a larger GPU)")
    if args.json:
        _write_json(args, shape, plans, base)
    return 0


def _write_json(args, shape, plans, base) -> None:
    from ..eval.provenance import provenance

    report = {
        "model": {**asdict(shape), "params": shape.params, "conv_dim": shape.conv_dim},
        "gpu_memory_gib": args.gpu_memory,
        "context": args.context,
        "prefix_cache_interval": args.prefix_cache_interval,
        "checkpoint": args.checkpoint,
        "reserve_gib": next(iter(plans.values())).reserve_bytes / GIB,
        "kv_dtype": args.kv_dtype,
        "weight_dtype": args.weight_dtype,
        "methods": {
            name: {
                **plan.to_dict(),
                "requests_vs_fp32": plan.max_requests / base.max_requests if base.max_requests else None,
                "request_bytes_vs_fp32": plan.per_request_bytes / base.per_request_bytes,
            }
            for name, plan in plans.items()
        },
        "provenance": provenance(),
    }
    path = Path(args.json)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
