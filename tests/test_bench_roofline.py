"""The roofline model of a ``bench decode`` step (CPU only): bytes and FLOPs by hand, ceilings, the CLI."""

from __future__ import annotations

import pytest

from leapquant.bench.decode import ModelSpec, model_spec
from leapquant.bench.roofline import (
    CLASSES,
    Kernel,
    Machine,
    StepRoofline,
    ceiling,
    step_kernels,
    step_roofline,
)
from leapquant.bench.variants import parse_variant
from leapquant.cli.main import main
from leapquant.errors import LeapQuantError

FLA, LQ = parse_variant("fp32:fla"), parse_variant("leapquant-int8")
# one GDN layer and one gated-GQA layer, dense MLPs: small enough to count by hand
TINY = ModelSpec(name="hand", hidden=8, vocab=16, layer_types=("linear", "full"),
                 mlp_types=("dense", "dense"), family="gdn", lin_key_heads=1, lin_value_heads=2,
                 lin_head_dim=4, conv_kernel=2, attn="gqa", attn_heads=2, attn_kv_heads=1, attn_head_dim=4,
                 rope_dim=2, intermediate=6)  # fmt: skip
B, CTX = 3, 5


def _by_name(kernels: list[Kernel]) -> dict[str, Kernel]:
    return {k.name: k for k in kernels}


def test_bytes_and_flops_of_a_tiny_step_by_hand():
    k = _by_name(step_kernels(TINY, B, CTX, FLA))
    # LM head [16, 8] bf16: weights 256 B, input 3 x 8 and logits 3 x 16 bf16 = 144 B; 2 B n FLOPs
    assert (k["lm_head"].bytes, k["lm_head"].flops, k["lm_head"].kind) == (400, 2 * 3 * 128, "lm-head")
    # GDN in-projection: conv channels 2*1*4 + 2*4 = 16, width 16 + z 8 + b, a 2 + 2 = 28: [28, 8]
    assert (k["layer 0 in"].bytes, k["layer 0 in"].flops) == (224 * 2 + 3 * (8 + 28) * 2, 2 * 3 * 224)
    # attention core: K and V of 1 KV head x 5 tokens x 4 dims read once, q in and o out for 2 heads
    att = k["layer 1 flash attention"]
    assert att.kind == "attention" and att.flops == 4 * 3 * 2 * 5 * 4
    assert att.bytes == 3 * (2 * 5 * 4 + 2 * 2 * 4) * 2
    # FLA fp32 state: 6 heads x 4 x 4 fp32 read and written (768 B); q, k (1 head) and v, o (2 heads) bf16,
    # fp32 gate per value head, bf16 beta: 60 B per sequence; 8 K V FLOPs per head
    st = k["layer 0 state (fp32:fla)"]
    assert (st.bytes, st.flops, st.kind) == (768 + 3 * 60, 8 * 6 * 16, "state")
    # dense MLP [12, 8] and [8, 6]; the elementwise and conv kernels are memory-only
    assert k["layer 1 gate_up"].flops == 2 * 3 * 96 and k["layer 1 down"].kind == "mlp"
    assert all(x.flops == 0 for x in k.values() if x.kind in ("conv", "elementwise", "embed"))
    # the conv-state update of [3, 16, 2] bf16: cat, copy, multiply, sum, SiLU (14 C W + 6 C per sequence)
    assert k["layer 0 conv"].bytes == 3 * (14 * 16 * 2 + 6 * 16)
    assert {x.kind for x in k.values()} <= set(CLASSES)


def test_each_kernel_takes_the_slower_of_its_bytes_and_flops_and_the_step_sums_them():
    """A compute-bound and a memory-bound kernel one after the other: 1 s + 1 s, not max(1 s, 1 s)."""
    m = Machine(copy_gbps=1.0, gemm_tflops=1.0)
    step = StepRoofline((Kernel("a", "mlp", 1e9, 0.0), Kernel("b", "mlp", 1.0, 1e12)), m)
    assert step.ms == pytest.approx(2000.0)
    table = step.by_class()["mlp"]
    assert table["bound"] == "mixed" and table["share"] == 1.0 and table["bytes"] == 1e9 + 1


def test_grouped_experts_read_the_experts_some_token_hits():
    spec = model_spec("kimi-linear-48b-a3b", 8, tiny=True)  # 8 experts, top 2, width 64, expert width 32
    k = _by_name(step_kernels(spec, B, CTX, FLA, moe="grouped"))
    hit = 8 * (1 - (1 - 2 / 8) ** B)
    up = k["layer 1 experts_gate_up"]
    assert up.bytes == pytest.approx(hit * 64 * 64 * 2 + B * 2 * (64 + 64) * 2)
    assert up.flops == 2 * B * 2 * 64 * 64
    padded = _by_name(step_kernels(spec, B, CTX, FLA, moe="padded"))["layer 1 experts_gate_up"]
    assert padded.flops > up.flops and padded.bytes > up.bytes  # every expert, E x capacity rows
    # MLA: the latent cache (512 + 64 rope dims... tiny: 32 + 16) read twice, by the scores and values bmm
    scores, values = k["layer 3 scores bmm"], k["layer 3 values bmm"]
    assert scores.bytes > B * CTX * (32 + 16) * 2 and values.bytes > B * CTX * 32 * 2


def test_the_ceiling_is_one_for_the_baseline_and_falls_as_state_bytes_grow():
    spec, m = model_spec("qwen3.5-9b"), Machine()
    assert ceiling(spec, 512, 4096, FLA, m) == 1.0
    c = {v: ceiling(spec, 512, 4096, parse_variant(v), m) for v in ("fp32", "bf16", "int8", "leapquant-int8")}
    assert c["fp32"] == pytest.approx(1.0)  # our per-step fp32 moves FLA's bytes
    assert 1.0 < c["bf16"] < c["int8"] < c["leapquant-int8"] < 1.5
    # the same state at a longer context is a smaller share of the step: a lower ceiling
    assert ceiling(spec, 512, 1024, LQ, m) > c["leapquant-int8"] > ceiling(spec, 512, 8192, LQ, m)
    # the state bytes come from bench.kernel's byte model, one source for the kernel bench and this model
    from leapquant.bench.kernel import KernelCase, state_bytes_per_step

    case = KernelCase(n=512)
    st = step_roofline(spec, 512, 4096, LQ, m).by_class()["state"]
    assert st["bytes"] == pytest.approx(6 * (state_bytes_per_step(LQ, case) + case.io_bytes()))


def test_bad_inputs_are_one_line_errors():
    for bad in (-1.0, 0.0, float("nan"), float("inf")):
        with pytest.raises(LeapQuantError, match="copy bandwidth must be a positive number of GB/s"):
            Machine(copy_gbps=bad)
    with pytest.raises(LeapQuantError, match="GEMM throughput"):
        Machine(gemm_tflops=-5)
    with pytest.raises(LeapQuantError, match="batch and context must be >= 1"):
        step_kernels(TINY, 0, CTX, FLA)
    with pytest.raises(LeapQuantError, match="moe must be grouped or padded"):
        step_kernels(TINY, B, CTX, FLA, moe="dense")
    with pytest.raises(LeapQuantError, match=r"expected a bench\.variants\.Variant"):
        step_kernels(TINY, B, CTX, "fp32:fla")


def test_cli_roofline_only_prints_the_table_on_the_cpu(tmp_path, capsys):
    import json

    out = tmp_path / "roof.json"
    args = "bench decode --roofline-only --model qwen3.5-9b --batch 512 --context 1024,4096 --grid cross "
    args += f"--backends fp32:fla leapquant-int8 --json {out} --markdown {tmp_path / 'roof.md'}"
    assert main(args.split()) == 0
    text = capsys.readouterr().out
    assert text.count("| kernel class | bound | GFLOP |") == 2 and "| state | memory |" in text
    assert "copy 4240 GB/s, bf16 GEMM 790 TFLOP/s" in text and "Ceiling of `leapquant-int8`" in text
    report = json.loads(out.read_text())
    assert [(c["batch"], c["context"]) for c in report["configs"]] == [(512, 1024), (512, 4096)]
    ceil = {c["context"]: c["rows"][1]["ceiling_vs_fp32"] for c in report["configs"]}
    assert ceil[1024] > ceil[4096] > 1.0
    assert "| lm-head | compute |" in (tmp_path / "roof.md").read_text()
    args = "bench decode --roofline-only --model kimi-linear-48b --batch 64 --context 1024 --backends bf16 "
    assert main([*args.split(), "--copy-gbps", "3350", "--gemm-tflops", "700"]) == 0
    assert "copy 3350 GB/s, bf16 GEMM 700 TFLOP/s" in capsys.readouterr().out


def test_cli_roofline_only_rejects_bad_input(capsys):
    cases = [
        ("--roofline-only --copy-gbps -1", "copy bandwidth must be a positive number of GB/s, got -1.0"),
        ("--roofline-only --gemm-tflops 0", "GEMM throughput must be a positive number of TFLOP/s"),
        ("--roofline-only --model qwen3.5-9 --batch 8", "did you mean 'qwen3.5-9b'"),
        ("--tiny --copy-gbps 4000", "--copy-gbps apply to --roofline-only"),
        ("--roofline-only --plot x.png", "--plot needs timings"),
    ]
    for args, message in cases:
        assert main(["bench", "decode", *args.split()]) == 2, args
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err
