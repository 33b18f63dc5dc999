"""``leapquant bench decode`` on the CPU: tiny hybrid models, every state backend, the CLI and its JSON."""

from __future__ import annotations

import json
import os

import pytest
import torch
from tiny_models import KERNEL_DEVICE

from leapquant.bench.decode import DecodeModel, build_weights, model_spec
from leapquant.bench.decode_run import decode_markdown
from leapquant.bench.state_backends import make_backend
from leapquant.bench.variants import parse_variant
from leapquant.cli.main import main

BACKENDS = ("fp32:fla", "bf16", "int8", "leapquant-int8")
MODELS = ("qwen3.5-9b", "kimi-linear-48b-a3b")
B, CTX = 3, 8


def _tiny(name: str, long_memory: bool = True, device: str = "cpu"):
    spec = model_spec(name, 8, tiny=True)
    weights = build_weights(spec, device, seed=0)
    if long_memory:  # decays near 1 (exp(-0.02 softplus(.))): the state, not the current token, drives o
        for lw in weights["layers"]:
            if "A_log" in lw:
                lw["A_log"].fill_(-4.0)
    return spec, weights


def _states(spec, seed: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hv, kd = spec.lin_value_heads, spec.lin_head_dim
    n = spec.layer_types.count("linear")
    return [0.5 * torch.randn(B, hv, kd, kd, generator=gen) for _ in range(n)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_specs_have_the_real_dimensions_and_pattern():
    qwen, kimi = model_spec("qwen3.5-9b"), model_spec("kimi-linear-48b-a3b")
    assert qwen.layer_types == ("linear", "linear", "linear", "full") * 2 and qwen.mlp_types == ("dense",) * 8
    assert (qwen.hidden, qwen.lin_key_heads, qwen.lin_value_heads, qwen.lin_head_dim) == (4096, 16, 32, 128)
    assert (qwen.attn_heads, qwen.attn_kv_heads, qwen.attn_head_dim, qwen.vocab) == (16, 4, 256, 248320)
    assert kimi.layer_types == qwen.layer_types and kimi.mlp_types == ("dense",) + ("moe",) * 7
    assert (kimi.hidden, kimi.lin_value_heads, kimi.experts, kimi.top_k, kimi.kv_lora_rank) == (
        2304,
        32,
        256,
        8,
        512,
    )
    # parameter counts of the full-depth models from the shapes alone: Qwen3.5-9B's language model holds
    # 8.95B parameters; Kimi-Linear-48B-A3B about 48-49B, ~3B of them active per token
    full = build_weights(model_spec("qwen35-9b", 32), "meta")
    assert _count(full) == pytest.approx(8.95e9, rel=0.01)
    kw = build_weights(model_spec("kimi-linear-48b", 27), "meta")
    routed = sum(lw[k].numel() for lw in kw["layers"] for k in lw if k.startswith("experts_"))
    assert _count(kw) == pytest.approx(48.5e9, rel=0.03)
    assert 2.8e9 < _count(kw) - routed + routed * 8 / 256 < 3.6e9


def test_specs_come_from_the_plan_presets_under_one_name():
    """The bench builds the plan's presets: canonical names, the old bench spellings as aliases, one spec."""
    from leapquant.bench.decode import MODELS as BENCH_MODELS
    from leapquant.errors import LeapQuantError
    from leapquant.plan import PRESETS

    assert BENCH_MODELS == MODELS and set(MODELS) <= set(PRESETS)
    for alias, name in (("qwen35-9b", "qwen3.5-9b"), ("kimi-linear-48b", "kimi-linear-48b-a3b")):
        assert model_spec(alias, 8, tiny=True) == model_spec(name, 8, tiny=True)
        assert model_spec(alias).name == name and model_spec(alias, tiny=True).name == name + "-tiny"
    qwen, kimi = PRESETS["qwen3.5-9b"], model_spec("kimi-linear-48b-a3b", 27)
    assert model_spec("qwen3.5-9b", 32).rope_dim == qwen.rotary_dim == 64 and qwen.rms_norm_eps == 1e-6
    assert (kimi.routed_scale, kimi.eps, kimi.gate_rank, kimi.real_layers) == (2.446, 1e-5, 128, 27)
    assert kimi.real_pattern == "20 KDA + 7 MLA (every 4th and the last)"
    assert model_spec("qwen3.5-9b").real_pattern == "24 GDN + 8 full (every 4th)"
    with pytest.raises(LeapQuantError, match=r"did you mean 'qwen3\.5-9b'"):
        model_spec("qwen3.5-9")
    with pytest.raises(LeapQuantError, match="not a hybrid the step models"):
        model_spec("qwen3.5-35b-a3b")


def _count(weights: dict) -> int:
    return sum(t.numel() for lw in weights["layers"] for t in lw.values()) + sum(
        t.numel() for k, t in weights.items() if k != "layers"
    )


@pytest.mark.parametrize("name", MODELS)
def test_a_step_runs_for_every_backend_and_stays_finite(name):
    spec, weights = _tiny(name, long_memory=False)
    model = DecodeModel(spec, weights, B, CTX, "cpu")
    for backend in BACKENDS:
        model.backend = make_backend(parse_variant(backend), spec, B, "cpu", kernel_backend="reference")
        for _ in range(3):  # the state, conv state and KV cache are updated in place
            logits = model.step()
        assert logits.shape == (B, spec.vocab) and logits.dtype == torch.bfloat16
        assert torch.isfinite(logits).all(), backend
    for skip in ({"state"}, {"attention"}, {"mlp"}, {"state", "lm_head"}):
        model.skip = skip
        out = model.step()
        assert torch.isfinite(out).all()
        assert out.shape == ((B, spec.hidden) if "lm_head" in skip else (B, spec.vocab))


@pytest.mark.parametrize("name", MODELS)
def test_quantized_states_agree_with_fp32_from_the_same_state(name):
    """Every linear layer's state output on identical inputs: LeapQuant/bf16/int8 states loaded from the fp32
    states differ only by their quantization; the control (a zero state) shows the check can fail."""
    spec, weights = _tiny(name)
    states = _states(spec)
    model = DecodeModel(spec, weights, B, CTX, "cpu", seed=1)
    model.backend = make_backend(parse_variant("fp32:fla"), spec, B, "cpu", kernel_backend="reference")
    model.backend.load(states)
    model.record_state_inputs = []
    model.step()
    inputs = model.record_state_inputs
    assert len(inputs) == spec.layer_types.count("linear")

    def outputs(backend: str, loaded: list[torch.Tensor]) -> list[torch.Tensor]:
        be = make_backend(parse_variant(backend), spec, B, "cpu", kernel_backend="reference")
        be.load(loaded)
        return [be(j, *x) for j, x in enumerate(inputs)]

    ref = outputs("fp32:fla", states)
    for backend, tol in (("leapquant-int8", 1.5e-2), ("bf16", 1e-2), ("int8", 1.5e-2)):
        errs = [_rel(o, r) for o, r in zip(outputs(backend, states), ref)]
        assert max(errs) < tol, (backend, errs)
    control = [_rel(o, r) for o, r in zip(outputs("leapquant-int8", [0 * s for s in states]), ref)]
    assert min(control) > 0.3, control


def test_logits_of_leapquant_and_fp32_agree_on_the_dense_model():
    """Whole-step logits (Qwen3.5-shaped, dense: no routing flips) from the same state."""
    spec, weights = _tiny("qwen3.5-9b")
    states = _states(spec)

    def logits(backend: str, loaded) -> torch.Tensor:
        model = DecodeModel(spec, weights, B, CTX, "cpu", seed=1)  # same tokens, conv states and caches
        model.backend = make_backend(parse_variant(backend), spec, B, "cpu", kernel_backend="reference")
        model.backend.load(loaded)
        return model.step().float()

    ref = logits("fp32:fla", states)
    assert _rel(logits("leapquant-int8", states), ref) < 0.05
    assert _rel(logits("leapquant-int8", [0 * s for s in states]), ref) > 0.3


@pytest.mark.parametrize("backend", ["leapquant-int8", "int8"])
def test_triton_kernels_in_the_step_match_the_reference(backend):
    """The path a GPU runs (Triton kernels, ``validate=False``; through the interpreter on the CPU), on every
    layer's recorded inputs of one step of the Qwen3.5-shaped model."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 on the CPU")
    spec, weights = _tiny("qwen3.5-9b", device=KERNEL_DEVICE)
    states = [s[:2].to(KERNEL_DEVICE) for s in _states(spec)]
    model = DecodeModel(spec, weights, 2, CTX, KERNEL_DEVICE, seed=1)
    model.skip, model.record_state_inputs = {"state"}, []
    model.step()
    out = {}
    for key in ("reference", "triton", "fp32"):
        name, impl = ("fp32:fla", "reference") if key == "fp32" else (backend, key)
        be = make_backend(parse_variant(name), spec, 2, KERNEL_DEVICE, kernel_backend=impl)
        be.load(states)
        out[key] = [be(j, *x) for j, x in enumerate(model.record_state_inputs)]
    for tri, ref, exact in zip(out["triton"], out["reference"], out["fp32"]):
        assert _rel(tri, ref) < 5e-3 and _rel(tri, exact) < 1.5e-2


def test_grouped_and_padded_moe_agree():
    spec, weights = _tiny("kimi-linear-48b-a3b")
    out = {}
    for moe in ("grouped", "padded"):
        model = DecodeModel(spec, weights, B, CTX, "cpu", seed=1, moe=moe, moe_capacity=B * spec.top_k)
        model.backend = make_backend(parse_variant("fp32:fla"), spec, B, "cpu", kernel_backend="reference")
        out[moe] = model.step().float()
    assert _rel(out["padded"], out["grouped"]) < 1e-2


def test_cli_writes_json_markdown_and_plot(tmp_path, capsys):
    out = tmp_path / "decode.json"
    args = "bench decode --tiny --model both --batch 2 --context 8,16 "
    args += "--backends leapquant-int8 fp32:fla fp32 --state-impl reference --repeats 1 --warmup 0 --profile"
    args = [*args.split(), "--json", str(out), "--markdown", str(tmp_path / "d.md")]
    args += ["--plot", str(tmp_path / "d.png")]
    assert main(args) == 0
    printed = capsys.readouterr().out
    # a GPU times the tiny models for real; a CPU run says its timings mean nothing
    assert ("NOT meaningful" in printed) != torch.cuda.is_available(), printed
    report = json.loads(out.read_text())
    assert {"rows", "configs", "models", "settings", "timing_note", "provenance"} <= report.keys()
    assert len(report["configs"]) == 4 and len(report["rows"]) == 12  # 2 models x 2 contexts x 3 backends
    row_keys = {"model", "batch", "context", "backend", "impl", "ms", "tokens_per_s", "speedup_vs_fp32",
                "state_ms", "state_share", "state_ms_isolated", "state_share_isolated", "finite",
                "extrapolated_full_depth_speedup", "ceiling_vs_fp32", "fraction_of_ceiling"}  # fmt: skip
    for row in report["rows"]:
        assert row_keys <= row.keys(), row_keys - row.keys()
        assert row["finite"] and row["tokens_per_s"] > 0
    # the baseline runs first; our per-step fp32 kernel is not it
    assert [(r["backend"], r["baseline"]) for r in report["rows"][:3]] == [
        ("fp32:fla", True), ("leapquant-int8", False), ("fp32", False),
    ]  # fmt: skip
    assert report["rows"][0]["speedup_vs_fp32"] == 1.0 and report["rows"][0]["impl"] == "reference-fp32"
    cfg = report["configs"][0]
    assert {"no_state", "lm_head_ms", "attention_ms", "mlp_ms", "kv_cache_bytes"} <= cfg.keys()
    assert report["models"]["kimi-linear-48b-a3b-tiny"]["mlp_types"][0] == "dense"
    md = (tmp_path / "d.md").read_text()
    assert "| context | batch |" in md
    for line in (x for x in md.splitlines() if x.startswith(("| 8 | 2 |", "| 16 | 2 |"))):
        # each method but the baseline beside its ceiling, and in the full-depth column
        assert line.count("x of ") == 2 and "fp32 " in line.rsplit("|", 2)[1], line
    assert (tmp_path / "d.png").stat().st_size > 1000


def test_cli_refuses_real_sizes_without_a_gpu_and_bad_numbers(capsys):
    if not torch.cuda.is_available():
        assert main(["bench", "decode", "--model", "qwen35-9b"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
    assert main(["bench", "decode", "--tiny", "--batch", "0"]) == 2
    assert "argument --batch: expected positive numbers" in capsys.readouterr().err
    assert main(["bench", "decode", "--tiny", "--backends", "fp32:fla", "int3"]) == 2
    assert "int3: no kernel" in capsys.readouterr().err
    assert main(["bench", "decode", "--tiny", "--backends", "int9/w16"]) == 2
    assert "unknown format 'int9'" in capsys.readouterr().err
    assert main(["bench", "decode", "--tiny", "--backends", "fp32:foo"]) == 2
    assert "unknown option :foo" in capsys.readouterr().err


def test_where_the_time_goes_table_shows_measured_and_ideal(tmp_path):
    """A profiled run (CPU, or a GPU that measures its roofs): every row carries its roofline and ceiling;
    the Markdown shows them."""
    out = tmp_path / "r.json"
    args = "bench decode --tiny --model qwen35-9b --batch 2 --context 8 --backends fp32:fla leapquant-int8 "
    args += f"--state-impl reference --repeats 1 --warmup 0 --profile --json {out}"
    assert main(args.split()) == 0
    report = json.loads(out.read_text())
    if torch.cuda.is_available():
        assert report["roofs_measured"] is True and report["copy_gbps"] > 100
    else:  # the H200's nominal roofs
        assert report["roofs_measured"] is False and report["copy_gbps"] == 4240.0
    base, lq = report["rows"]
    assert base["ceiling_vs_fp32"] == 1.0 and base["fraction_of_ceiling"] == 1.0
    assert lq["ceiling_vs_fp32"] > 1.0
    assert lq["fraction_of_ceiling"] == pytest.approx(lq["speedup_vs_fp32"] / lq["ceiling_vs_fp32"])
    assert set(lq["roofline"]["classes"]) >= {"state", "attention", "mlp", "lm-head", "conv"}
    for row in report["rows"]:
        row["profile"] = {"by_class_ms": {"gemm": 0.5}, "gaps_ms": 0.1}
    text = decode_markdown(report)
    assert "Where the time goes" in text and text.count("| qwen3.5-9b-tiny | 8 | 2 |") == 2
    assert f"of {lq['ceiling_vs_fp32']:.2f}x, {100 * lq['fraction_of_ceiling']:.0f}%" in text
    assert ("assumed: the H200's" in text) != torch.cuda.is_available()


def test_kernel_breakdown_reports_each_launch_of_a_step(monkeypatch):
    """``bench kernel --breakdown``: a profiled trace of several steps becomes, per launch of a step (told
    apart by order, since a graph replay moves a captured stream's kernels between streams), its duration
    and where in the step it runs."""
    from leapquant.bench import timing

    spans, t = [], 0.0
    for i in range(3):  # three steps: a side-stream kernel overlapping a main-stream one, then another
        spans += [
            {"name": "step", "stream": 7, "start": t, "end": t + 10.0},
            {"name": "close", "stream": 14, "start": t + 2.0, "end": t + 14.0},
            {"name": "step", "stream": 20 + i % 2, "start": t + 14.0, "end": t + 16.0},
        ]
        t += 20.0
    monkeypatch.setattr(timing, "profiled_kernels", lambda fn, use_graph: ("graph", spans))
    bd = timing.kernel_breakdown(lambda i: None, 3)
    assert bd["mode"] == "graph" and bd["span_us"] == pytest.approx(56.0 / 3)
    assert [(k["kernel"], k["launch"]) for k in bd["kernels"]] == [("close", 1), ("step", 1), ("step", 2)]
    close, first, second = bd["kernels"]
    assert close["us"] == 12.0 and (close["start_us"], close["end_us"]) == (2.0, 14.0)
    assert first["us"] == 10.0 and first["streams"] == [7]
    assert second["us"] == 2.0 and second["streams"] == [20, 21] and second["start_us"] == 14.0
    assert bd["steps"] == 3
    # two steps that launch their kernels in different orders are not told apart: the trace's launches
    other = [
        {"name": "close", "stream": 14, "start": 20.0, "end": 30.0},
        {"name": "step", "stream": 7, "start": 32.0, "end": 33.0},
        {"name": "step", "stream": 20, "start": 34.0, "end": 35.0},
    ]
    monkeypatch.setattr(timing, "profiled_kernels", lambda fn, use_graph: ("eager", spans[:3] + other))
    bd = timing.kernel_breakdown(lambda i: None, 2)
    assert bd["steps"] == 1 and bd["span_us"] == 17.5
    launches = {(k["kernel"], k["launch"]): k["start_us"] for k in bd["kernels"]}
    assert launches == {("step", 1): 0.0, ("close", 1): 2.0, ("step", 2): 14.0, ("close", 2): 20.0,
                        ("step", 3): 32.0, ("step", 4): 34.0}  # fmt: skip


def test_trace_spans_keep_the_gpu_lanes_in_microseconds():
    """Kernels, copies and memsets of a chrome trace, in start order; CPU-side events dropped."""
    from leapquant.bench.timing import trace_spans

    events = [
        {"cat": "kernel", "name": "b", "ts": 5.5, "dur": 2.0, "args": {"stream": 7}},
        {"cat": "cpu_op", "name": "aten::copy_", "ts": 0.0, "dur": 50.0},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 1.0, "dur": 3.25, "args": {"stream": 14}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0.5, "dur": 1.0},
        {"cat": "gpu_memset", "name": "Memset", "ts": 9.0, "dur": 1.0},
    ]
    assert trace_spans(events) == [
        {"name": "Memcpy DtoD", "stream": 14, "start": 1.0, "end": 4.25},
        {"name": "b", "stream": 7, "start": 5.5, "end": 7.5},
        {"name": "Memset", "stream": -1, "start": 9.0, "end": 10.0},
    ]


def test_variant_options_reach_the_timed_kernel(monkeypatch):
    """``:step``, ``:triton-close`` and ``:paged`` change what ``bench decode`` times, as in ``bench kernel``:
    the step alone (no window closes; the roofline counts it so), the close it names, vLLM's page layout."""
    from dataclasses import replace

    import leapquant.ops.leapquant_decode as ops
    from leapquant.ops.leapquant_decode import LaunchConfig

    spec, weights = _tiny("qwen3.5-9b", device=KERNEL_DEVICE)
    calls = []
    real = ops.leapquant_decode

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "leapquant_decode", spy)
    moved = {}
    for name in ("leapquant-int8", *(f"leapquant-int8:{o}" for o in ("step", "triton-close", "paged"))):
        model = DecodeModel(spec, weights, B, CTX, KERNEL_DEVICE, seed=1)
        model.backend = make_backend(parse_variant(name), spec, B, KERNEL_DEVICE, kernel_backend="triton")
        pools = model.backend.states
        assert all(p.paged for p in pools) == name.endswith(":paged")
        calls.clear()
        before = [p.pos.clone() for p in pools]
        assert torch.isfinite(model.step()).all()
        moved[name] = any(not torch.equal(p.pos, b) for p, b in zip(pools, before))
        assert all(c["boundary"] == (not name.endswith(":step")) for c in calls)
        launch = calls[0]["launch"]
        assert (launch is not None) == name.endswith(":triton-close")
        if launch is not None:  # the tuned launch of the default rows, with the close it names
            cfg = pools[0].config
            assert launch == replace(
                LaunchConfig.tuned(cfg.decay, cfg.compensators, cfg.residual), close_impl="triton"
            )
    # the step alone keeps every window where it was (the kernels' boundary=False), the others advance
    assert moved == {name: not name.endswith(":step") for name in moved}
