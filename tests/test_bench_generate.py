"""``bench generate``: the throughput tool runs end to end (on the CPU here; its times mean nothing there) and
times each method through a patched model beside the unpatched FP32 one."""

from __future__ import annotations

import sys

import pytest
import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401  (the module whose globals are timed)

from leapquant.bench.generate import GenerateCase, bench_generate
from leapquant.errors import LeapQuantError

CHECKPOINT = "qwen35-gdn-hybrid-byte"  # a shipped checkpoint, by name


def test_rows_for_each_method_beside_fp32(monkeypatch):
    import leapquant.integrations

    patched = []
    real_patch = leapquant.integrations.patch

    def spy(model, method, *, graphs):
        patched.append((method, graphs))
        return real_patch(model, method, graphs=graphs)

    monkeypatch.setattr(leapquant.integrations, "patch", spy)
    modeling = sys.modules["transformers.models.qwen3_5.modeling_qwen3_5"].__dict__
    recurrent = modeling["torch_recurrent_gated_delta_rule"]
    case = GenerateCase(batch=2, prompt_tokens=4, new_tokens=3, repeats=1)
    rows = bench_generate(CHECKPOINT, ["fp32", "leapquant-int8"], case, device="cpu", graphs=(True, False))
    # the timed layer calls went through a wrapper that is gone again, as is the patch's dispatcher
    assert modeling["torch_recurrent_gated_delta_rule"] is recurrent
    # fp32 is the model's own state; each patched method with graphs and eager, taking turns in the warm-up
    # pass and the one timed repeat
    assert patched == [("leapquant-int8", True), ("leapquant-int8", False)] * 2
    assert [(r["method"], r["graphs"]) for r in rows] == [
        ("fp32", None),
        ("leapquant-int8", True),
        ("leapquant-int8", False),
    ]
    for r in rows:
        assert r["device"] == "cpu" and r["batch"] == 2 and r["new_tokens"] == 3
        assert r["generate_s"] > 0 and r["setup_s"] > 0
        assert r["decode_s"] == pytest.approx(r["generate_s"] - r["setup_s"])
        if r["tokens_per_s"] is not None:
            assert r["tokens_per_s"] == pytest.approx(2 * 2 / r["decode_s"])
        assert r["recurrent_call_us"] > 0  # 2 decode steps x 6 linear-attention layers were timed


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch": 0}, "batch must be >= 1"),
        ({"repeats": 0}, "repeats must be >= 1"),
    ],
    ids=["batch-0", "repeats-0"],
)
def test_bad_cases(kwargs, match):
    with pytest.raises(LeapQuantError, match=match):
        GenerateCase(**kwargs)


def test_one_new_token_has_no_decode_to_time():
    with pytest.raises(LeapQuantError, match="new_tokens must be >= 2"):
        bench_generate(CHECKPOINT, ["fp32"], GenerateCase(new_tokens=1), device="cpu")


@pytest.mark.parametrize("graphs", [(), (1,), ("on",)], ids=["empty", "int", "string"])
def test_bad_graphs_setting(graphs):
    with pytest.raises(LeapQuantError, match="graphs must be a non-empty tuple of booleans"):
        bench_generate(CHECKPOINT, ["fp32"], GenerateCase(), device="cpu", graphs=graphs)


def test_unknown_device():
    with pytest.raises(LeapQuantError, match="device must be cuda or cpu"):
        bench_generate(CHECKPOINT, ["fp32"], GenerateCase(), device="tpu")
