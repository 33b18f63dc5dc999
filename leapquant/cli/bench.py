"""``leapquant bench kernel``: the decode-kernel benchmark (GPU), one registry of variants and presets."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..bench import H200_COPY_GBPS, H200_GEMM_TFLOPS
from ..checks import read_json
from ..errors import LeapQuantError
from .args import JSON, MD, PLOT, count, input_file, output_file

# Variants that make the paper's Table 2 kernel column, plus our other formats and a step-only breakdown.
MAIN = (
    "fp32:fla",
    "bf16",
    "bf16/w16",
    "int8",
    "int8/w16",
    "int8/w16+ct4",
    "leapquant-int8",
    "leapquant-int8:triton-close",
    "leapquant-int8:step",
    "fp8-e4m3/w16+ct4+smooth",
    "leapquant-int4",
    "int4/w16+ct8+smooth",
)
# The window / rank sweep of the paper's Table 3 (r=4 for the windows, p=16 for the ranks).
SWEEP = (
    "fp32:fla",
    "int8/w8+ct4+smooth",
    "leapquant-int8",
    "int8/w32+ct4+smooth",
    "int8/w16+smooth",
    "int8/w16+ct2+smooth",
    "int8/w16+ct8+smooth",
)
VARIANT_SETS = {"main": MAIN, "sweep": SWEEP}


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="GPU benchmarks (kernel, decode)")
    bsub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    k = bsub.add_parser(
        "kernel",
        help="one decode token of one layer: FLA FP32 vs per-step vs LeapQuant kernels",
        description="Median time per decode step (CUDA graphs, rotated inputs and pool slots), achieved GB/s "
        "against the byte model and the measured copy bandwidth, speedup over FLA FP32 in the same run.",
    )
    k.add_argument("--family", default="gdn,kda", help="comma list of gdn, kda (default both)")
    k.add_argument("--n", default="64,128,256,512,1024", help="comma list of batch sizes")
    k.add_argument("--heads", type=count(), default=32, help="value heads HV (default 32)")
    k.add_argument("--gdn-key-heads", type=count(), default=16, help="GDN query/key heads (Qwen3.5/Next: 16)")
    k.add_argument("--preset", choices=sorted(VARIANT_SETS), default="main", help="the variants to run")
    k.add_argument(
        "--variant", "-v", action="append",
        help="METHOD[:fla|:step|:triton-close|:cuda-close|:paged] instead of the preset (repeatable)",
    )  # fmt: skip
    k.add_argument("--step-bv", type=count(), default=None, help="launch: value rows per step chunk")
    k.add_argument("--step-warps", type=count(), default=None, help="launch: warps per step program")
    k.add_argument("--step-tc-bv", type=count(), default=None, help="launch: rows per tensor-core chunk")
    k.add_argument("--step-tc-warps", type=count(), default=None, help="launch: warps per tensor-core step")
    k.add_argument(
        "--step-tc-stages", type=count(), default=None, help="launch: tensor-core step pipeline depth"
    )
    k.add_argument(
        "--step-tc-maxnreg", type=count(), default=None, help="launch: tensor-core step register cap"
    )
    k.add_argument(
        "--cuda-core-step", action="store_true", help="launch: the CUDA-core step even for integer residuals"
    )
    k.add_argument(
        "--overlap-close", choices=("auto", "on", "off"), default="auto",
        help="launch: closing heads step and close on a side stream beside the others (on), step then "
        "close (off), or the default for the close in use (auto: on for the Triton close only)",
    )  # fmt: skip
    k.add_argument(
        "--close-impl", choices=("auto", "cuda", "triton"), default=None,
        help="launch: the window close (CUDA where it applies by default; a variant's :triton-close or "
        ":cuda-close suffix overrides it)",
    )  # fmt: skip
    k.add_argument(
        "--close-cuda-blocks", type=count(), default=None, help="launch: CUDA close blocks per SM (default 2)"
    )
    k.add_argument("--close-bv", type=count(), default=None, help="launch: value rows per close chunk")
    k.add_argument("--close-warps", type=count(), default=None, help="launch: warps per close program")
    k.add_argument("--close-programs", type=count(), default=None, help="launch: close programs per SM")
    k.add_argument(
        "--close-maxnreg", type=count(), default=None, help="launch: close register cap per thread"
    )
    k.add_argument(
        "--tune",
        nargs="?",
        const="all",
        choices=("all", "step", "close"),
        default=None,
        help="before the variants, time a small grid of launch shapes per family (step-only and full "
        "leapquant-int8 at the first N; 'step' or 'close': only those shapes) and use the fastest; the "
        "kernels are never autotuned in place",
    )
    k.add_argument(
        "--tune-variant",
        default="leapquant-int8",
        metavar="METHOD",
        help="the variant --tune times (default leapquant-int8; the step shapes use its :step form)",
    )
    k.add_argument(
        "--sweep-at",
        type=count(),
        default=None,
        metavar="N",
        help="after the variants, run the window/rank sweep (paper Table 3) at batch N",
    )
    k.add_argument("--no-graph", action="store_true", help="time eager launches instead of CUDA graphs")
    k.add_argument(
        "--breakdown",
        action="store_true",
        help="also profile each variant's steps (PyTorch profiler, one graph replay, or eager with "
        "--no-graph): each kernel launch's duration and place in the step",
    )
    k.add_argument("--json", metavar="OUT", type=output_file("file", JSON), help="write rows and provenance")
    k.add_argument("--markdown", metavar="OUT.md", type=output_file("file", MD), help="write the table")
    k.add_argument(
        "--plot", metavar="OUT.png", type=output_file("file", PLOT), help="speedup over FLA FP32 vs batch"
    )
    k.set_defaults(run=run_kernel)
    _add_decode_parser(bsub)
    _add_generate_parser(bsub)
    r = bsub.add_parser("report", help="Markdown tables (and optionally the plot) from a bench kernel JSON")
    r.add_argument("json_path", metavar="KERNEL.json", type=input_file("report", JSON))
    r.add_argument("--n", type=count(), default=512, help="batch size of the per-variant table (default 512)")
    r.add_argument("--plot", metavar="OUT.png", type=output_file("file", PLOT), help="also redraw the plot")
    r.set_defaults(run=run_report)


def _add_generate_parser(bsub: argparse._SubParsersAction) -> None:
    from ..checkpoints import DEFAULT_CHECKPOINT
    from .model import model_arg

    g = bsub.add_parser(
        "generate",
        help="decode tokens/s of transformers generate() on a checkpoint: FP32 state vs patched methods",
        description="Greedy generate() from --batch prompts of a local transformers checkpoint, each method "
        "in the same run (fp32: the model's own state, unpatched); decode tokens/s with the prefill's time "
        "subtracted, median of --repeats after a warm-up (GPU).",
    )
    g.add_argument(
        "--model", default=DEFAULT_CHECKPOINT, type=model_arg,
        help=f"a shipped checkpoint's name or a local transformers folder (default {DEFAULT_CHECKPOINT})",
    )  # fmt: skip
    g.add_argument(
        "-m", "--method", action="append", dest="methods",
        help="a method to time beside fp32 (repeatable; default leapquant-int8)",
    )  # fmt: skip
    g.add_argument("--batch", type=count(), default=64, help="prompts decoded together (default 64)")
    g.add_argument("--prompt-tokens", type=count(), default=64, help="tokens per prompt (default 64)")
    g.add_argument(
        "--new-tokens", type=count(2), default=256, help="tokens generated per prompt (default 256)"
    )
    g.add_argument("--repeats", type=count(), default=3, help="timed runs per method, median (default 3)")
    g.add_argument(
        "--graphs", choices=("on", "off", "both"), default="on",
        help="patched layers replay per-layer CUDA graphs (on), launch eagerly (off), or both, each a row "
        "(default on)",
    )  # fmt: skip
    g.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda",
        help="where to run (default cuda; cpu checks that it runs, its times mean nothing)",
    )  # fmt: skip
    g.add_argument(
        "--json", metavar="OUT", type=output_file("file", JSON), help="write the rows and provenance"
    )
    g.set_defaults(run=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from ..bench.generate import GenerateCase, bench_generate
    from ..eval.provenance import provenance
    from ..methods import parse_method
    from .simulate import console

    methods = ["fp32", *dict.fromkeys(m for m in args.methods or ["leapquant-int8"] if m != "fp32")]
    for m in methods:
        parse_method(m)  # an unknown name fails before the model loads
    case = GenerateCase(batch=args.batch, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                        repeats=args.repeats)  # fmt: skip
    con = console()
    if args.device == "cpu":
        con.print("running on the CPU: a check that it works; its times say nothing about a GPU")
    graphs = {"on": (True,), "off": (False,), "both": (True, False)}[args.graphs]
    rows = bench_generate(args.model, methods, case, args.device, graphs=graphs)
    for r in rows:
        label = r["method"] + (" (eager)" if r["graphs"] is False else "")
        rate = "within timing noise" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:9.0f} tok/s"
        vs = "" if r["vs_fp32"] is None else f"  {r['vs_fp32']:.2f}x fp32"
        us = r["recurrent_call_us"]
        call = "" if us is None else f"; {us:.0f} us host a layer call"
        con.print(
            f"{Path(args.model).name} B={r['batch']} {label:<26} {rate} "
            f"({r['decode_s'] * 1e3:.0f} ms for {r['new_tokens'] - 1} steps){vs}{call}"
        )
    if args.json:
        on_gpu = args.device == "cuda"
        report = {"rows": rows, "model": str(args.model), "provenance": provenance(cuda=on_gpu)}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _add_decode_parser(bsub: argparse._SubParsersAction) -> None:
    d = bsub.add_parser(
        "decode",
        help="whole decode steps of 8-layer Qwen3.5-9B / Kimi-Linear-48B-shaped hybrids, per state backend",
        description="One decode step of a hybrid model with the real layer dimensions and pattern "
        "(random bf16 weights, a real KV cache of each context length) captured in a CUDA graph; tokens/s "
        "per state backend, speedup over fp32 beside its roofline ceiling (the fraction reached), the share "
        "of the step in the state kernels. Without a GPU use --tiny (timings are then not meaningful) or "
        "--roofline-only.",
    )
    d.add_argument(
        "--model", default="both",
        help="a model preset the step can build (qwen3.5-9b, kimi-linear-48b-a3b: the names `leapquant "
        "memory` takes) or both (default)",
    )  # fmt: skip
    d.add_argument(
        "--batch", nargs="+", type=_int_list, default=None, help="batch sizes (default 64 128 256 512)"
    )
    d.add_argument(
        "--context",
        nargs="+",
        type=_int_list,
        default=None,
        help="context lengths (default 1024 2048 4096 8192)",
    )
    d.add_argument(
        "--grid",
        choices=("star", "cross"),
        default="star",
        help="star (default): every batch at --main-context plus every context at the largest batch (the "
        "paper's Figure 8 and 10); cross: every batch x context",
    )
    d.add_argument(
        "--main-context", type=count(), default=None, help="context of the batch sweep (default 4096)"
    )
    d.add_argument(
        "--backends",
        nargs="+",
        default=["fp32:fla", "bf16", "leapquant-int8"],
        help="fp32:fla (FLA's kernels), per-step methods fp32 / bf16 / int8 (ours) or windowed methods "
        "(leapquant-int8); default fp32:fla bf16 leapquant-int8",
    )
    d.add_argument(
        "--layers", type=count(), default=8, help="layers of the model (default 8, real layer pattern)"
    )
    d.add_argument(
        "--profile", action="store_true", help="torch.profiler split, ablations and roofline per config"
    )
    d.add_argument(
        "--tiny", action="store_true", help="tiny widths (CPU tests); default batch 2 4, context 16 32"
    )
    d.add_argument("--moe", choices=("auto", "grouped", "padded"), default="auto", help="MoE expert compute")
    d.add_argument(
        "--state-impl",
        choices=("auto", "triton", "reference"),
        default="auto",
        help="our kernels: Triton (GPU or TRITON_INTERPRET=1) or the torch reference (auto: as available)",
    )
    d.add_argument("--graph-steps", type=count(), default=2, help="decode steps per CUDA graph (default 2)")
    d.add_argument("--warmup", type=count(0), default=2, help="graph replays before timing (default 2)")
    d.add_argument("--repeats", type=count(), default=10, help="timed graph replays, median (default 10)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--roofline-only", action="store_true",
        help="time nothing (no GPU needed): print the roofline model of each configuration's step per "
        "kernel class (GB moved, GFLOP, ideal ms and share per backend) and each backend's ceiling over "
        "fp32:fla, on the roofs --copy-gbps and --gemm-tflops",
    )  # fmt: skip
    d.add_argument(
        "--copy-gbps", type=float, default=None, metavar="GB/S",
        help=f"with --roofline-only: copy bandwidth, read + write (default {H200_COPY_GBPS:.0f}, the H200's "
        "measured; a GPU run measures its own)",
    )  # fmt: skip
    d.add_argument(
        "--gemm-tflops", type=float, default=None, metavar="TFLOP/S",
        help=f"with --roofline-only: bf16 GEMM throughput (default {H200_GEMM_TFLOPS:.0f}, the H200's "
        "measured 8192^3 matmul; a GPU run measures its own)",
    )  # fmt: skip
    d.add_argument(
        "--json", metavar="OUT", type=output_file("file", JSON), help="rows, ablations, profiles, provenance"
    )
    d.add_argument("--markdown", metavar="OUT.md", type=output_file("file", MD), help="write the tables")
    d.add_argument(
        "--plot", metavar="OUT.png", type=output_file("file", PLOT), help="throughput per configuration"
    )
    d.set_defaults(run=run_decode)


def _int_list(text: str) -> list[int]:
    """Positive whole numbers from one argument, ``512`` or ``64,128`` (argparse type)."""
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def run_decode(args: argparse.Namespace) -> int:
    from ..bench.decode_run import run_decode as run
    from ..bench.variants import parse_variant

    args.backends = [parse_variant(b) for b in dict.fromkeys(args.backends)]
    for name in ("batch", "context"):  # each value may be a comma list: flatten
        values = getattr(args, name)
        if values is not None:
            setattr(args, name, [x for group in values for x in group])
    if args.layers < 1 or min(args.graph_steps, args.repeats) < 1 or args.warmup < 0:
        raise LeapQuantError(
            "bench decode: --layers, --graph-steps and --repeats must be >= 1, --warmup >= 0"
        )
    roofs = {"--copy-gbps": args.copy_gbps, "--gemm-tflops": args.gemm_tflops}
    if not args.roofline_only:
        given = [name for name, value in roofs.items() if value is not None]
        if given:
            raise LeapQuantError(f"bench decode: {' and '.join(given)} apply to --roofline-only (a GPU run "
                                 "measures its roofs)")  # fmt: skip
    else:
        if args.plot:
            raise LeapQuantError(
                "bench decode: --plot needs timings; --roofline-only writes --json and --markdown"
            )
        args.copy_gbps = H200_COPY_GBPS if args.copy_gbps is None else args.copy_gbps
        args.gemm_tflops = H200_GEMM_TFLOPS if args.gemm_tflops is None else args.gemm_tflops
    return run(args)


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise LeapQuantError(f"{what} must be a comma list of whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise LeapQuantError(f"{what} must list positive numbers, got {text!r}")
    return values


def _print_breakdown(con, what: str, bd: dict) -> None:
    if "error" in bd:
        con.print(f"  [red]{what}: no breakdown ({bd['error']})[/red]")
    if "span_us" in bd:
        con.print(f"  {what}: profiled {bd['mode']} step {bd['span_us']:.1f} us")
    for k in bd.get("kernels", ())[:6]:
        con.print(
            f"    {k['kernel'][:40]} (launch {k['launch']}): {k['us']:.1f} us, "
            f"from {k['start_us']:.1f} to {k['end_us']:.1f} us"
        )


def run_kernel(args: argparse.Namespace) -> int:
    from dataclasses import replace

    import torch

    from ..bench.kernel import KernelCase, bench_variant
    from ..bench.timing import copy_bandwidth
    from ..bench.variants import Variant, parse_variant
    from ..eval.provenance import provenance
    from ..ops.leapquant_decode import LaunchConfig
    from .simulate import console

    variants = [parse_variant(v) for v in args.variant or VARIANT_SETS[args.preset]]
    sweep = [parse_variant(v) for v in SWEEP] if args.sweep_at else []
    try:
        tune_variant = parse_variant(args.tune_variant)
        reason = "a per-step method" if tune_variant.per_step or tune_variant.step_only else None
    except LeapQuantError as exc:
        reason = str(exc)
    if reason is not None:
        raise LeapQuantError(f"--tune-variant {args.tune_variant!r}: not a pool method ({reason})")
    families = [f for f in args.family.split(",") if f]
    for family in families if families else [args.family]:
        if family not in ("gdn", "kda"):
            raise LeapQuantError(f"--family: unknown family {family!r}, expected gdn or kda")
    sizes = _ints(args.n, "--n")
    if not torch.cuda.is_available():  # after the checks of the input, which any machine can tell
        raise LeapQuantError(
            "bench kernel needs a CUDA GPU (kernels are tested on the CPU by pytest instead)"
        )
    overrides = {
        "step_bv": args.step_bv,
        "step_warps": args.step_warps,
        "step_tc_bv": args.step_tc_bv,
        "step_tc_warps": args.step_tc_warps,
        "step_tc_stages": args.step_tc_stages,
        "step_tc_maxnreg": args.step_tc_maxnreg,
        "step_mma": False if args.cuda_core_step else None,
        "overlap_close": {"on": True, "off": False}.get(args.overlap_close),
        "close_impl": args.close_impl,
        "close_cuda_blocks_per_sm": args.close_cuda_blocks,
        "close_bv": args.close_bv,
        "close_warps": args.close_warps,
        "close_programs_per_sm": args.close_programs,
        "close_maxnreg": args.close_maxnreg,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    copy_gbps = copy_bandwidth()
    con = console()
    con.print(f"measured device-to-device copy bandwidth: {copy_gbps:.0f} GB/s (read + write)")
    report = {
        "rows": [],
        "tuning": [],
        "copy_gbps": copy_gbps,
        "launch": {},
        "provenance": provenance(cuda=True),
    }

    def save() -> None:  # after every row, so a run cut short still leaves its numbers
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")

    def measure(variant: Variant, case, shape) -> dict:
        try:
            row = bench_variant(variant, case, launch=shape, use_graph=not args.no_graph,
                                breakdown=args.breakdown)  # fmt: skip
        except Exception as exc:  # a failing variant must not hide the others' numbers
            row = {
                "variant": variant.label,
                "family": case.family,
                "n": case.n,
                "error": f"{type(exc).__name__}: {exc}",
            }
            con.print(f"[red]{case.family} n={case.n} {variant.label}: {row['error']}[/red]")
            return row
        row["copy_fraction"] = row["gbps"] / copy_gbps
        row["launch"] = shape.__dict__
        _print_breakdown(con, f"{case.family} n={case.n} {variant.label}", row.get("breakdown", {}))
        return row

    for family in families:
        key_heads = args.gdn_key_heads if family == "gdn" else args.heads
        decay = "scalar" if family == "gdn" else "vector"

        def default_launch(variant: Variant, decay=decay) -> LaunchConfig:
            """Without --tune: the tuned launch for the variant's token count, then the overrides."""
            rank = 4 if variant.per_step else variant.method.compensators
            codec = "int8" if variant.per_step else variant.method.codec
            return replace(LaunchConfig.tuned(decay, rank, codec), **overrides)

        launch = default_launch(tune_variant)
        shape = launch
        if args.tune:
            case = KernelCase(family=family, n=sizes[0], heads=args.heads, key_heads=key_heads)
            shape = _tune(case, launch, measure, report, con, step=args.tune != "close",
                          close=args.tune != "step", variant=tune_variant)  # fmt: skip
            save()
        report["launch"][family] = shape.__dict__
        runs = [(n, variants, "main") for n in sizes]
        if args.sweep_at:
            runs.append((args.sweep_at, sweep, "sweep"))
        for n, names, table in runs:
            case = KernelCase(family=family, n=n, heads=args.heads, key_heads=key_heads)
            base = None
            for variant in names:
                row = measure(variant, case, shape if args.tune else default_launch(variant))
                row["table"] = table
                report["rows"].append(row)
                if "error" in row:
                    save()
                    continue
                if variant.kernel == "fla":
                    base = row["ms"]
                row["speedup_vs_fla_fp32"] = base / row["ms"] if base else None
                save()
                con.print(
                    f"{family} n={n:5d} {variant.label:28s} {row['ms'] * 1e3:9.1f} us  "
                    f"{row['gbps']:7.0f} GB/s  "
                    f"{100 * row['copy_fraction']:5.1f}% of copy"
                    + (f"  {row['speedup_vs_fla_fp32']:.2f}x FLA fp32" if row["speedup_vs_fla_fp32"] else "")
                )
    if args.json:
        print(f"wrote {args.json}")
    if args.markdown:
        from ..bench.report import kernel_markdown

        Path(args.markdown).write_text(kernel_markdown(report))
        print(f"wrote {args.markdown}")
    if args.plot:
        from ..bench.report import plot_kernel

        print(f"wrote {plot_kernel(report, args.plot)}")
    return 0


# Launch shapes tried by --tune: (value rows per chunk, warps, pipeline stages, register cap) of the
# tensor-core step kernel, (value rows per chunk, warps, pipeline stages, fast int8 conversion) of the
# CUDA-core one, then (value rows per chunk, warps, programs per SM, register cap) of the window close.
TC_STEP_SHAPES = (
    (16, 1, 3, None),
    (32, 1, 2, None),
    (32, 1, 3, None),
    (32, 1, 4, None),
    (32, 1, 3, 168),
    (32, 1, 3, 128),
    (64, 1, 2, None),
    (64, 1, 3, 168),
)
STEP_SHAPES = (
    (32, 4, 2, True),
    (32, 4, 4, True),
    (32, 4, 2, False),
    (16, 2, 2, True),
    (16, 2, 4, True),
    (16, 2, 8, True),
    (16, 1, 2, True),
    (8, 1, 4, True),
    (64, 8, 2, True),
)
CLOSE_SHAPES = (
    (32, 4, 1, 128),
    (32, 4, 2, 128),
    (32, 4, 2, None),
    (32, 4, 3, 168),
    (32, 4, 4, 128),
    (16, 4, 2, None),  # r=8: uncapped, the tokens' tiles spill ~800 B a thread at 128 registers
    (64, 8, 1, None),
)


def _tune(case, launch, measure, report, con, *, variant, step: bool = True, close: bool = True):
    """Pick the fastest step shape on ``variant:step`` (tensor-core and CUDA-core kernels), then the close
    shape on ``variant``, then whether its token-value scratch pays."""
    from dataclasses import replace

    step_variant = replace(variant, step_only=True, label=variant.label + ":step")
    best, best_ms = launch, float("inf")
    shapes = [replace(launch, step_mma=True, step_tc_bv=bv, step_tc_warps=w, step_tc_stages=st,
                      step_tc_maxnreg=reg) for bv, w, st, reg in TC_STEP_SHAPES]  # fmt: skip
    shapes += [replace(launch, step_mma=False, step_bv=bv, step_warps=w, step_stages=st, fast_cvt=fast)
               for bv, w, st, fast in STEP_SHAPES]  # fmt: skip
    for shape in shapes if step else ():
        row = measure(step_variant, case, shape)
        report["tuning"].append(row)
        if "error" not in row and row["ms"] < best_ms:
            best, best_ms = shape, row["ms"]
        con.print(f"tune {case.family} step {shape}: {row.get('ms', float('nan')) * 1e3:.1f} us")
    chosen, best_ms = best, float("inf")
    for bv, warps, programs, maxnreg in CLOSE_SHAPES if close else ():
        shape = replace(
            best, close_bv=bv, close_warps=warps, close_programs_per_sm=programs, close_maxnreg=maxnreg
        )
        row = measure(variant, case, shape)
        report["tuning"].append(row)
        if "error" not in row and row["ms"] < best_ms:
            chosen, best_ms = shape, row["ms"]
        con.print(f"tune {case.family} close {shape}: {row.get('ms', float('nan')) * 1e3:.1f} us")
    if close and variant.method.smoothing and variant.method.compensators:  # the chosen shape, no scratch
        shape = replace(chosen, close_token_scratch=False)
        row = measure(variant, case, shape)
        report["tuning"].append(row)
        if "error" not in row and row["ms"] < best_ms:
            chosen, best_ms = shape, row["ms"]
        con.print(f"tune {case.family} close {shape}: {row.get('ms', float('nan')) * 1e3:.1f} us")
    con.print(f"tune {case.family}: chose {chosen}")
    return chosen


def run_report(args: argparse.Namespace) -> int:
    from ..bench.report import kernel_summary_markdown, plot_kernel

    path = args.json_path
    report = read_json(path, "report")
    try:
        text = kernel_summary_markdown(report, args.n)
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise LeapQuantError(f"{path}: not a bench kernel report ({type(exc).__name__}: {exc})") from None
    print(text, end="")
    if args.plot:
        plot_kernel(report, args.plot)
    return 0
