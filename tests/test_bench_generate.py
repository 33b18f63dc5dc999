"""``bench generate``: the throughput tool runs end to end (on the CPU here; its times mean nothing there) and
times each method through a patched model beside the unpatched FP32 one."""

from __future__ import annotations

import sys

import pytest
import torch
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


def test_a_repeated_method_is_one_row():
    case = GenerateCase(batch=1, prompt_tokens=4, new_tokens=2, repeats=1)
    rows = bench_generate(CHECKPOINT, ["fp32", "int8", "int8"], case, device="cpu")
    assert [r["method"] for r in rows] == ["fp32", "int8"]


def test_timed_calls_leave_the_module_as_they_found_it():
    """The timing wrappers come off after an error in the timed block; a patch made and undone inside the
    block still finds the model's own function behind them; one made inside and kept keeps working."""
    import leapquant
    from leapquant.bench.generate import _timed_recurrent_calls
    from leapquant.eval.model_eval import load_model

    model, _ = load_model(leapquant.checkpoint_path(CHECKPOINT), "cpu")
    modeling = sys.modules["transformers.models.qwen3_5.modeling_qwen3_5"].__dict__
    own = modeling["torch_recurrent_gated_delta_rule"]
    samples: list[float] = []
    with pytest.raises(RuntimeError, match="inside"), _timed_recurrent_calls(model, samples):
        assert modeling["torch_recurrent_gated_delta_rule"] is not own
        raise RuntimeError("inside")
    assert modeling["torch_recurrent_gated_delta_rule"] is own
    with _timed_recurrent_calls(model, samples):
        handle = leapquant.patch(model, "int8")
        try:
            ids = torch.tensor([[5, 6, 7, 8]])
            model.generate(input_ids=ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        finally:
            handle.unpatch()
    assert modeling["torch_recurrent_gated_delta_rule"] is own
    assert len(samples) == 2 * 6  # two decode steps of the six linear-attention layers
    # a patch made inside the block and kept after it: it keeps working, its unpatch restores the module,
    # and nothing is timed after the block
    with _timed_recurrent_calls(model, samples):
        handle = leapquant.patch(model, "int8")
    try:
        out = model.generate(input_ids=ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        assert out.shape == (1, 7)
    finally:
        handle.unpatch()
        restored = modeling["torch_recurrent_gated_delta_rule"] is own
        modeling["torch_recurrent_gated_delta_rule"] = own  # never leave the module altered for later tests
    assert restored and len(samples) == 2 * 6
