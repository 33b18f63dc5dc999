"""``leapquant bench decode``: whole decode steps of the hybrid models in :mod:`.decode`, per state backend.

For each model and (batch, context) configuration it times, each as the median of CUDA-graph replays of
``graph_steps`` decode steps (CUDA events; :func:`leapquant.bench.timing.time_steps`):

* the full step for every backend (tokens/s = batch / step time, speedup over ``fp32`` in the same run);
* ablations, backend-independent: the step without the state kernels (``no_state``: the state share is
  ``(full - no_state) / full``) and without the LM head; with ``profile`` also without the attention core and
  without the MLP/MoE;
* the state kernels alone, in a graph of their own over the inputs of one step (``state_ms_isolated``);
* with ``profile``: one ``torch.profiler`` trace of a graph replay per backend, kernel time split by name
  into state / attention / GEMM / other and the idle time between kernels (launch gaps).

Every row carries its roofline (:mod:`.roofline`: the ideal step from bytes and FLOPs per kernel, on the copy
bandwidth and bf16 GEMM throughput measured at the start of the run) and the ceiling of its speedup over
``fp32:fla``, printed beside the measured speedup with the fraction reached.  ``roofline_only`` prints the
model's breakdown per configuration instead, on the CPU, for a given machine (nothing is timed).

Without CUDA (``tiny`` models only) the same code runs eagerly on the CPU; those timings are not meaningful,
and the ceilings assume the H200's roofs.
"""

from __future__ import annotations

import gc
import json
import re
import statistics
import time
from pathlib import Path

import torch

from ..errors import LeapQuantError
from .decode import MODELS, DecodeModel, build_weights, kv_cache_bytes, model_spec
from .roofline import Machine, roofline_markdown, step_roofline
from .state_backends import make_backend
from .variants import Variant, parse_variant

__all__ = ["decode_markdown", "plot_decode", "run_decode"]

KERNEL_CLASSES = (
    (
        "state",
        re.compile(
            r"fused_recurrent|step_kernel|close_kernel|leapquant_close|per_step_kernel|boundary_kernel"
        ),
    ),
    ("attention", re.compile(r"flash|fmha|attention|attn|softmax", re.I)),
    ("gemm", re.compile(r"gemm|gemv|cutlass|nvjet|xmma|cublas|matmul|sm90_|sm80_|grouped", re.I)),
)


def _free(collect: bool = False) -> None:
    """Give cached GPU memory back between backends (and collect cycles between configurations)."""
    if torch.cuda.is_available():
        if collect:
            gc.collect()
        torch.cuda.empty_cache()


def _time(fn, device: torch.device, opts: dict) -> dict:
    """Median ms per call of ``fn``: CUDA-graph replays on a GPU, eager wall clock on the CPU."""
    if device.type == "cuda":
        from .timing import time_steps

        return time_steps(lambda _i: fn(), 1, graph_steps=opts["graph_steps"], warmup=opts["warmup"],
                          repeats=opts["repeats"])  # fmt: skip
    fn()
    times = []
    for _ in range(max(1, opts["repeats"])):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"ms": statistics.median(times), "ms_min": min(times), "ms_max": max(times), "graph": False}


def classify(name: str) -> str:
    """Kernel name -> ``state``, ``attention``, ``gemm`` or ``other``."""
    for cls, pattern in KERNEL_CLASSES:
        if pattern.search(name):
            return cls
    return "other"


def profile_step(fn) -> dict:
    """Kernel time of one step by class, busy time and the gaps between kernels (one profiled graph replay;
    an eager step if the trace of the replay holds no kernels)."""
    from .timing import profiled_kernels

    mode, traced = profiled_kernels(fn)
    spans = [(sp["start"], sp["end"], sp["name"]) for sp in traced]
    if not spans:
        return {"error": "the profiler recorded no kernels"}
    by_class: dict[str, float] = {}
    by_name: dict[str, float] = {}
    busy, cursor = 0.0, spans[0][0]
    for start, end, name in spans:
        by_class[classify(name)] = by_class.get(classify(name), 0.0) + (end - start) / 1e3
        by_name[name] = by_name.get(name, 0.0) + (end - start) / 1e3
        busy += max(0.0, end - max(start, cursor))
        cursor = max(cursor, end)
    span = (max(e for _, e, _ in spans) - spans[0][0]) / 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return {"mode": mode, "kernels": len(spans), "span_ms": span, "busy_ms": busy / 1e3,
            "gaps_ms": span - busy / 1e3, "by_class_ms": by_class,
            "top_kernels": [{"name": n[:120], "ms": ms, "class": classify(n)} for n, ms in top]}  # fmt: skip


def state_pool_bytes(variant: Variant, spec, batch: int) -> int:
    """Bytes of every linear layer's state for ``batch`` sequences under ``variant``."""
    hv, kd, n_lin = spec.lin_value_heads, spec.lin_head_dim, spec.layer_types.count("linear")
    if variant.per_step:
        return n_lin * batch * hv * variant.state_bytes_per_head(kd, kd)
    cfg = variant.pool_config(hv, kd, kd, "vector" if spec.family == "kda" else "scalar")
    return n_lin * batch * cfg.bytes_per_slot()


def _is_baseline(row: dict) -> bool:
    """Whether a result row is the fp32 baseline (``fp32:fla``; reports made before variants were named
    ``METHOD:OPTION`` called it ``fp32`` and carry no ``baseline`` field)."""
    return row.get("baseline", row["backend"] == "fp32")


def _grid(batches: list[int], contexts: list[int], grid: str, main: int) -> list[tuple[int, int]]:
    if grid == "cross":
        return [(b, c) for c in contexts for b in batches]
    star = [(b, main) for b in batches]
    return star + [(max(batches), c) for c in contexts if c != main]


def _models_and_grid(args) -> tuple[list[str], list[tuple[int, int]], int]:
    """The models, the (batch, context) configurations a run covers (defaults per ``--tiny``) and the
    context of its batch sweep."""
    models = list(MODELS) if args.model == "both" else [args.model]
    batches = args.batch or ([2, 4] if args.tiny else [64, 128, 256, 512])
    contexts = args.context or ([16, 32] if args.tiny else [1024, 2048, 4096, 8192])
    main = args.main_context or (4096 if 4096 in contexts else contexts[-1])
    return models, _grid(batches, contexts, args.grid, main), main


def _machine(report: dict) -> Machine:
    return Machine(report["copy_gbps"], report["gemm_tflops"], measured=report["roofs_measured"])


def _run_roofline_only(args) -> int:
    """``--roofline-only``: the roofline breakdown of every configuration and backend on a given machine,
    printed as Markdown tables (nothing is timed; no GPU needed)."""
    from ..eval.provenance import provenance

    machine = Machine(args.copy_gbps, args.gemm_tflops)
    moe = "grouped" if args.moe == "auto" else args.moe  # auto: what a Hopper or Blackwell run picks
    models, grid, _ = _models_and_grid(args)
    report: dict = {
        "roofline_only": True, "copy_gbps": machine.copy_gbps, "gemm_tflops": machine.gemm_tflops,
        "roofs_measured": False, "configs": [], "provenance": provenance(cuda=False),
        "settings": {"layers": args.layers, "moe": moe, "tiny": args.tiny,
                     "backends": [v.label for v in args.backends]},
    }  # fmt: skip
    texts = []
    for name in models:
        spec = model_spec(name, args.layers, tiny=args.tiny)
        weights = build_weights(spec, "meta")
        base = parse_variant("fp32:fla")
        for batch, context in grid:
            texts.append(roofline_markdown(spec, batch, context, args.backends, machine, moe=moe))
            print(texts[-1], flush=True)
            steps = {v.label: step_roofline(spec, batch, context, v, machine, moe=moe, weights=weights)
                     for v in [base, *args.backends]}  # fmt: skip
            report["configs"].append({
                "model": spec.name, "batch": batch, "context": context,
                "rows": [{"backend": label, "roofline": st.to_dict(),
                          "ceiling_vs_fp32": steps["fp32:fla"].ms / st.ms} for label, st in steps.items()],
            })  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.markdown:
        Path(args.markdown).write_text("\n".join(texts))
        print(f"wrote {args.markdown}")
    return 0


def _memory_reason(spec, batch: int, context: int, backends: list[Variant], device) -> str | None:
    """Why a configuration cannot run here (None if it fits in free GPU memory with a 4 GiB margin)."""
    if device.type != "cuda":
        return None
    kv = kv_cache_bytes(spec, batch, context)
    pools = max(state_pool_bytes(n, spec, batch) for n in backends)
    hv, kd = spec.lin_value_heads, spec.lin_head_dim
    transient = 4 * batch * hv * kd * kd + 2 * batch * spec.vocab * 3
    if spec.attn == "mla":
        transient += batch * spec.attn_heads * context * 8
    need = kv + pools + transient
    free = torch.cuda.mem_get_info()[0]
    if need > free - (4 << 30):
        return (f"needs ~{need / 2**30:.1f} GiB (KV cache {kv / 2**30:.1f}, states {pools / 2**30:.1f}) "
                f"but {free / 2**30:.1f} GiB are free")  # fmt: skip
    return None


def run_decode(args) -> int:
    """The ``leapquant bench decode`` command (arguments in :func:`leapquant.cli.bench.add_parsers`)."""
    from ..eval.provenance import provenance

    if args.roofline_only:
        return _run_roofline_only(args)
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        raise LeapQuantError("bench decode needs a CUDA GPU for real model sizes (use --tiny on the CPU)")
    device = torch.device("cuda" if cuda else "cpu")
    models, grid, main = _models_and_grid(args)
    backends = sorted(args.backends, key=lambda v: v.kernel != "fla")  # the baseline first
    moe = args.moe
    if moe == "auto":
        major = torch.cuda.get_device_capability()[0] if cuda else 0
        moe = "grouped" if (not cuda or major in (9, 10)) and hasattr(torch, "_grouped_mm") else "padded"
    opts = {"graph_steps": args.graph_steps, "warmup": args.warmup, "repeats": args.repeats}
    report: dict = {
        "rows": [], "configs": [], "models": {},
        "settings": {"layers": args.layers, "backends": [v.label for v in backends], "grid": args.grid,
                     "main_context": main,
                     "moe": moe, "state_impl": args.state_impl, "tiny": args.tiny, **opts, "seed": args.seed},
        "timing_note": "CUDA-graph replays, median" if cuda else
        "CPU eager wall clock: NOT meaningful (torch references or the Triton interpreter)",
        "provenance": provenance(cuda=cuda),
    }  # fmt: skip

    def say(text: str) -> None:
        print(text, flush=True)

    def save() -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")

    if not cuda:
        say(
            "CPU run: timings are NOT meaningful (torch references or the Triton interpreter); ceilings "
            "assume the H200's roofs"
        )
        machine = Machine()
    else:
        from .timing import copy_bandwidth, gemm_tflops

        machine = Machine(copy_bandwidth(), gemm_tflops(), measured=True)
        say(f"{report['provenance'].get('device')}: copy {machine.copy_gbps:.0f} GB/s (read + write), "
            f"bf16 GEMM {machine.gemm_tflops:.0f} TFLOP/s")  # fmt: skip
    report.update(
        copy_gbps=machine.copy_gbps, gemm_tflops=machine.gemm_tflops, roofs_measured=machine.measured
    )
    for name in models:
        spec = model_spec(name, args.layers, tiny=args.tiny)
        weights = build_weights(spec, device, args.seed)
        wbytes = sum(t.numel() * t.element_size() for t in _tensors(weights))
        report["models"][spec.name] = {**spec.to_dict(), "weight_bytes": wbytes}
        n_lin, n_full = spec.layer_types.count("linear"), spec.layer_types.count("full")
        say(
            f"{spec.name}: {spec.layers} layers ({n_lin} {spec.family.upper()} + {n_full} "
            f"{spec.attn.upper()}), weights {wbytes / 2**30:.2f} GiB"
        )
        for batch, context in grid:
            cfg = {"model": spec.name, "batch": batch, "context": context}
            report["configs"].append(cfg)
            reason = _memory_reason(spec, batch, context, backends, device)
            if reason:
                cfg["skipped"] = reason
                say(f"{spec.name} B={batch} ctx={context}: skipped: {reason}")
            else:
                model = DecodeModel(spec, weights, batch, context, device, seed=args.seed, moe=moe)
                _bench_config(model, cfg, backends, device, opts, args, report, say, save)
                if cfg.get("moe_fallback"):  # keep the padded MoE for the remaining configurations
                    moe = report["settings"]["moe"] = "padded"
                model = None
                _free(collect=True)
            save()
        del weights
        _free(collect=True)
    save()
    if args.json:
        say(f"wrote {args.json}")
    if args.markdown:
        Path(args.markdown).write_text(decode_markdown(report))
        say(f"wrote {args.markdown}")
    if args.plot:
        say(f"wrote {plot_decode(report, args.plot)}")
    return 0


def _time_skipping(model: DecodeModel, skip: set, device, opts: dict, cfg: dict, say) -> dict:
    """Time the step without ``skip``; a grouped-GEMM MoE that fails (or cannot be captured) falls back to
    the padded ``bmm`` MoE for the rest of the configuration."""
    model.skip = set(skip)
    grouped = model.moe == "grouped" and model.spec.experts and device.type == "cuda"
    try:
        res = _time(model.step, device, opts)
        if not grouped or res["graph"]:
            return res
        why = "CUDA-graph capture failed"
    except Exception as exc:
        if not grouped:
            raise
        why = f"{type(exc).__name__}: {exc}"
    say(f"  torch._grouped_mm MoE: {why}; falling back to the padded bmm MoE")
    model.moe = cfg["moe"] = "padded"
    cfg["moe_fallback"] = why
    return _time(model.step, device, opts)


def _bench_config(model: DecodeModel, cfg: dict, backends, device, opts, args, report, say, save) -> None:
    """Ablations (backend-independent) and every backend on one (model, batch, context)."""
    spec, cuda = model.spec, device.type == "cuda"
    cfg["moe"] = model.moe if spec.experts else None
    cfg["kv_cache_bytes"] = kv_cache_bytes(spec, model.batch, model.context)
    tag = f"{spec.name} B={model.batch:4d} ctx={model.context:5d}"
    ablations = {"no_state": {"state"}, "no_state_no_lm_head": {"state", "lm_head"}}
    if args.profile:
        ablations["no_state_no_attention"] = {"state", "attention"}
        ablations["no_state_no_mlp"] = {"state", "mlp"}
    for key, skip in ablations.items():
        try:
            cfg[key] = _time_skipping(model, skip, device, opts, cfg, say)
        except Exception as exc:  # e.g. no attention kernel: record it, go on with the next configuration
            cfg["error"] = f"{key}: {type(exc).__name__}: {exc}"
            say(f"{tag}: {cfg['error']}")
            return
        finally:
            model.skip = set()
            _free()
    base = cfg["no_state"]["ms"]
    cfg["lm_head_ms"] = base - cfg["no_state_no_lm_head"]["ms"]
    cfg["roofline_fp32_ms"] = step_roofline(spec, model.batch, model.context, parse_variant("fp32:fla"),
                                            _machine(report), moe=model.moe, weights=model.w).ms  # fmt: skip
    if args.profile:
        cfg["attention_ms"] = base - cfg["no_state_no_attention"]["ms"]
        cfg["mlp_ms"] = base - cfg["no_state_no_mlp"]["ms"]
    fp32_row = None
    for variant in backends:
        row = _bench_backend(variant, model, cfg, device, opts, args, report)
        _free()
        report["rows"].append(row)
        if "error" in row:
            say(f"{tag} {variant.label}: {row['error']}")
            save()
            continue
        row["baseline"] = variant.kernel == "fla"  # every new row says (our per-step "fp32" is not it)
        if row["baseline"]:
            fp32_row = row
        if fp32_row is not None:
            row["speedup_vs_fp32"] = fp32_row["ms"] / row["ms"]
            row["extrapolated_full_depth_speedup"] = (
                fp32_row["extrapolated_full_depth_ms"] / row["extrapolated_full_depth_ms"]
            )
            row["fraction_of_ceiling"] = row["speedup_vs_fp32"] / row["ceiling_vs_fp32"]
        flag = "" if row["graph"] or not cuda else "  [no graph]"
        reached = f" ({100 * row['fraction_of_ceiling']:.0f}%)" if "fraction_of_ceiling" in row else ""
        say(
            f"{tag} {variant.label:16s} {row['ms']:8.3f} ms {row['tokens_per_s']:9.0f} tok/s  "
            f"{row.get('speedup_vs_fp32', 1.0):.2f}x fp32 of {row['ceiling_vs_fp32']:.2f}x ceiling{reached}  "
            f"state {100 * row['state_share']:4.1f}% "
            f"({row['state_ms']:.3f} ms; alone {row['state_ms_isolated']:.3f} ms){flag}"
        )
        save()


def _tensors(weights: dict):
    for key, value in weights.items():
        if key == "layers":
            for lw in value:
                yield from lw.values()
        else:
            yield value


def _bench_backend(variant: Variant, model: DecodeModel, cfg: dict, device, opts: dict, args, report) -> dict:
    """One backend on one configuration: full step, the state kernels alone, optional profile."""
    spec = model.spec
    row = {"model": spec.name, "batch": model.batch, "context": model.context, "backend": variant.label}
    try:
        backend = make_backend(
            variant, spec, model.batch, device, seed=args.seed, kernel_backend=args.state_impl
        )
    except LeapQuantError as exc:
        return {**row, "error": str(exc)}
    row["impl"] = backend.impl
    row["state_pool_bytes"] = backend.nbytes()
    model.backend = backend
    try:
        logits = model.step()
        row["finite"] = bool(torch.isfinite(logits).all())
        row.update(_time(model.step, device, opts))
        model.record_state_inputs = []
        model.step()
        inputs, model.record_state_inputs = model.record_state_inputs, None
        iso = _time(lambda: [backend(j, *x) for j, x in enumerate(inputs)], device, opts)
        if args.profile and device.type == "cuda":
            row["profile"] = profile_step(model.step)
    except Exception as exc:  # one failing backend must not hide the others' numbers
        model.backend = None
        return {**row, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        model.record_state_inputs = None
    model.backend = None
    row["tokens_per_s"] = model.batch / (row["ms"] * 1e-3)
    row["state_ms"] = row["ms"] - cfg["no_state"]["ms"]
    row["state_share"] = row["state_ms"] / row["ms"]
    row["state_ms_isolated"] = iso["ms"]
    row["state_share_isolated"] = iso["ms"] / row["ms"]
    layers_ms = row["ms"] - cfg["lm_head_ms"]
    row["extrapolated_full_depth_ms"] = layers_ms * spec.real_layers / spec.layers + cfg["lm_head_ms"]
    # the ideal step under this backend and the ceiling of its speedup (the baseline's ideal over it)
    roof = step_roofline(spec, model.batch, model.context, variant, _machine(report), moe=model.moe,
                         weights=model.w)  # fmt: skip
    row["roofline"] = roof.to_dict()
    row["ceiling_vs_fp32"] = cfg["roofline_fp32_ms"] / roof.ms
    return row


# ----------------------------------------------------------------------------------------------- report


def _ok(report: dict) -> list[dict]:
    return [r for r in report["rows"] if "error" not in r]


def decode_markdown(report: dict) -> str:
    """Throughput tables per model and, with a profile, the roofline note, from a ``bench decode`` report."""
    prov = report["provenance"]
    out = [f"Device: {prov.get('device')} (driver {prov.get('driver')}, CUDA {prov.get('cuda')}), torch "
           f"{prov['torch']}, triton {prov['triton']}, fla {prov.get('fla')}; {prov['date_utc']}; "
           f"{report['timing_note']}.", f"Command: `{prov['command']}`."]  # fmt: skip
    if "copy_gbps" in report:
        how = "" if report.get("roofs_measured", True) else " (assumed: the H200's, not measured)"
        out.append(f"Copy bandwidth {report['copy_gbps']:.0f} GB/s, bf16 GEMM {report['gemm_tflops']:.0f} "
                   f"TFLOP/s{how}. Ceiling: the speedup over fp32 of the roofline model of the step "
                   "(`leapquant/bench/roofline.py`) on these roofs; % = measured speedup / ceiling."
                   )  # fmt: skip
    rows = _ok(report)
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        out += ["", f"**{model}** ({report['models'][model]['layers']} layers): tokens/s, speedup over fp32 "
                "(of its roofline ceiling, % reached), share of the step in the state kernels (ablation / "
                "alone)", ""]  # fmt: skip
        out.append("| context | batch | " + " | ".join(backends) + " | full-depth speedup (extrapolated) |")
        out.append("| ---: | ---: | " + " | ".join("---:" for _ in backends) + " | ---: |")
        for ctx, b in dict.fromkeys((r["context"], r["batch"]) for r in mine):
            cells, full = [], []
            for name in backends:
                r = next(
                    (x for x in mine if (x["context"], x["batch"], x["backend"]) == (ctx, b, name)), None
                )
                if r is None:
                    cells.append("")
                    continue
                sp = r.get("speedup_vs_fp32")
                ceil = (f" of {r['ceiling_vs_fp32']:.2f}x, {100 * r['fraction_of_ceiling']:.0f}%"
                        if "fraction_of_ceiling" in r and not _is_baseline(r) else "")  # fmt: skip
                shares = f"{100 * r['state_share']:.0f}% / {100 * r['state_share_isolated']:.0f}%"
                cells.append(f"{r['tokens_per_s']:,.0f} ({sp or 1:.2f}x{ceil}; {shares})")
                if sp and not _is_baseline(r):
                    old = r.get("roofline_speedup_vs_fp32")  # reports before the roofline module
                    full.append(
                        f"{name} {r['extrapolated_full_depth_speedup']:.2f}x"
                        + (f" (8-layer roofline {old:.2f}x)" if old else "")
                    )
            out.append(f"| {ctx} | {b} | " + " | ".join(cells) + f" | {', '.join(full)} |")
    prof = [r for r in rows if "profile" in r and "classes" in r.get("roofline", {})]
    if prof:
        out += [
            "",
            "**Where the time goes** (ms per step, measured (ideal); measured: the ablations (state, "
            "attention core, MLP/MoE, LM head) and the rest, the profile's GEMM kernel time and idle gaps; "
            "ideal: the roofline model's classes (MLP/MoE: mlp, router and experts))",
            "",
            "| model | ctx | batch | backend | step | state | attn | mlp | lm head | rest | gemm | gaps "
            "| % of ideal |",
            "| --- | ---: | ---: | --- |" + " ---: |" * 9,
        ]
        for r in prof:
            cfg = next(c for c in report["configs"] if (c["model"], c["batch"], c["context"]) ==
                       (r["model"], r["batch"], r["context"]))  # fmt: skip
            parts = [r["state_ms"], cfg.get("attention_ms", 0.0), cfg.get("mlp_ms", 0.0), cfg["lm_head_ms"]]
            p, rl = r["profile"], r["roofline"]
            ideal = {k: c["ms"] for k, c in rl["classes"].items()}
            ideals = [
                ideal.get("state", 0.0),
                ideal.get("attention", 0.0),
                sum(ideal.get(k, 0.0) for k in ("mlp", "router", "experts")),
                ideal.get("lm-head", 0.0),
            ]
            cells = [r["ms"], *parts, r["ms"] - sum(parts)]
            cells_ideal = [rl["ideal_ms"], *ideals, rl["ideal_ms"] - sum(ideals)]
            out.append(
                f"| {r['model']} | {r['context']} | {r['batch']} | {r['backend']} | "
                + " | ".join(f"{x:.2f} ({y:.2f})" for x, y in zip(cells, cells_ideal))
                + f" | {p.get('by_class_ms', {}).get('gemm', 0):.2f} | {p.get('gaps_ms', 0):.2f} | "
                f"{100 * rl['ideal_ms'] / r['ms']:.0f}% |"
            )  # fmt: skip
    return "\n".join(out) + "\n"


def plot_decode(report: dict, path: str | Path) -> Path:
    """Decode throughput per configuration, one panel per model, bars per backend, speedup over fp32 on top
    (the paper's Figure 8 at the main context and Figure 10's contexts at the largest batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _ok(report)
    models = list(dict.fromkeys(r["model"] for r in rows)) or ["(no rows)"]
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    fig, axes = plt.subplots(
        1, len(models), figsize=(max(6.0, 7.0 * len(models)), 4.4), dpi=130, squeeze=False
    )
    colors = plt.get_cmap("tab10").colors
    width = 0.8 / max(1, len(backends))
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        groups = list(dict.fromkeys((r["context"], r["batch"]) for r in mine))
        for j, name in enumerate(backends):
            for g, key in enumerate(groups):
                r = next(
                    (x for x in mine if (x["context"], x["batch"]) == key and x["backend"] == name), None
                )
                if r is None:
                    continue
                x = g + (j - (len(backends) - 1) / 2) * width
                ax.bar(
                    x, r["tokens_per_s"] / 1e3, width, color=colors[j % 10], label=name if g == 0 else None
                )
                if r.get("speedup_vs_fp32") and not _is_baseline(r):
                    ax.annotate(
                        f"{r['speedup_vs_fp32']:.2f}x",
                        (x, r["tokens_per_s"] / 1e3),
                        ha="center",
                        va="bottom",
                        fontsize=6,
                        rotation=90,
                        xytext=(0, 2),
                        textcoords="offset points",
                    )
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"B={b}\n{c // 1024}K" if c >= 1024 else f"B={b}\n{c}" for c, b in groups],
                           fontsize=7)  # fmt: skip
        ax.set_ylabel("decode throughput (k tokens/s)")
        layers = report["models"].get(model, {}).get("layers", "?")
        ax.set_title(f"{model} ({layers} layers, bf16), {report['provenance'].get('device')}", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.margins(y=0.15)
        ax.legend(fontsize=7)
    from ..eval.plot import save_figure

    return save_figure(fig, path)
