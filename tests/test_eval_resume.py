"""`leapquant eval --checkpoint`: a run stopped at curve points and resumed gives the numbers of a run that
never stopped, bit for bit, for every kind of method state (the fp32 state, a per-step format's round trip,
the reference window, a kernel pool) and a hybrid's attention cache; a checkpoint of another run, or no
checkpoint at all, is refused."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import KERNEL_DEVICE

from leapquant.cli.main import main
from leapquant.errors import LeapQuantError
from leapquant.eval.model_eval import EvalConfig, evaluate_model, load_model

SCORES = ("kl", "top1_agreement", "nll", "state_rel_err", "state_rel_err_by_layer")


def _same_scores(a: dict, b: dict) -> None:
    assert a["fp32"] == b["fp32"]
    assert a["curves"] == b["curves"]
    assert a["methods"].keys() == b["methods"].keys()
    for name in a["methods"]:
        for key in SCORES:
            assert a["methods"][name][key] == b["methods"][name][key], (name, key)


def _in_three_calls(model, tok, cfg, checkpoint) -> dict:
    """The run stopped at its first two curve points (a time limit of 0 s), then finished."""
    first = evaluate_model(model, tok, cfg, checkpoint=checkpoint, time_limit=0)
    assert (first["tokens"], first["complete"]) == (cfg.tokens // cfg.curve_points, False)
    second = evaluate_model(model, tok, cfg, checkpoint=checkpoint, time_limit=0)
    assert second["tokens"] == 2 * first["tokens"] and second["resumed_at"] == [first["tokens"]]
    last = evaluate_model(model, tok, cfg, checkpoint=checkpoint)
    assert last["complete"] and last["tokens"] == cfg.tokens
    assert last["resumed_at"] == [first["tokens"], second["tokens"]]
    assert evaluate_model(model, tok, cfg, checkpoint=checkpoint) == last  # done: the saved report
    return last


METHODS = ("leapquant-int8", "int8", "int4/w16+ct8+smooth+ls", "int8+sr", "int8/w16+sr")


@pytest.mark.parametrize("name", ["qwen35-gdn-hybrid-byte", "kimi-kda-hybrid-byte"], ids=["gdn", "kda"])
def test_a_resumed_run_equals_one_that_never_stopped(name, tmp_path):
    model, tok = load_model(name, "cpu")
    # fp32 (the model's own state), the reference window with and without least-squares scales, a per-step
    # format as the model's step plus a round trip, and stochastic rounding (draws from torch's generator)
    # in both; two of the 8 layers are attention. Windows of 16 close before and after each stop.
    cfg = EvalConfig(methods=METHODS, tokens=36, prefill=16, curve_points=3)
    torch.manual_seed(0)
    straight = evaluate_model(model, tok, cfg)
    torch.manual_seed(0)
    _same_scores(straight, _in_three_calls(model, tok, cfg, tmp_path / "run.pt"))


def test_a_resumed_kernel_pool_equals_one_that_never_stopped(tmp_path):
    model, tok = load_model("qwen35-gdn-tiny-recall-byte", KERNEL_DEVICE)
    cfg = EvalConfig(methods=("leapquant-int8",), tokens=36, prefill=8, curve_points=3, backend="triton")
    straight = evaluate_model(model, tok, cfg)
    _same_scores(straight, _in_three_calls(model, tok, cfg, tmp_path / "run.pt"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs of the kernel pools")
def test_a_resumed_run_on_a_gpu_equals_one_that_never_stopped(tmp_path):
    """On CUDA the kernel pools and round trips replay captured graphs that address their tensors: the
    restore must write into those tensors, not replace them."""
    model, tok = load_model("qwen35-gdn-hybrid-byte", "cuda")
    methods = ("leapquant-int8", "leapquant-int4", "int8")
    cfg = EvalConfig(methods=methods, tokens=48, prefill=16, curve_points=3)
    straight = evaluate_model(model, tok, cfg)
    _same_scores(straight, _in_three_calls(model, tok, cfg, tmp_path / "run.pt"))


def test_a_time_limit_at_the_last_curve_point_finishes_the_run(tmp_path):
    model, tok = load_model("qwen35-gdn-tiny-recall-byte", "cpu")
    cfg = EvalConfig(
        methods=("int8",), tokens=8, prefill=8, curve_points=1, generate=("int8",), generate_tokens=4
    )
    report = evaluate_model(model, tok, cfg, checkpoint=tmp_path / "run.pt", time_limit=0)
    assert report["complete"] and report["methods"]["int8"]["generate"]["tokens"] == 4


def test_the_checkpoint_is_what_the_run_goes_on_from(tmp_path):
    """A state changed in the checkpoint changes the resumed run's scores: the run reads it, not a prefill."""
    model, tok = load_model("qwen35-gdn-hybrid-byte", "cpu")
    cfg = EvalConfig(methods=("leapquant-int8",), tokens=12, prefill=16, curve_points=2)
    straight = evaluate_model(model, tok, cfg)
    path = tmp_path / "run.pt"
    evaluate_model(model, tok, cfg, checkpoint=path, time_limit=0)
    saved = torch.load(path, weights_only=True)
    window = saved["states"][0]["states"][1]["window"]  # layer 0, the leapquant-int8 rows
    window["residual"] = window["residual"] * 1.5
    torch.save(saved, path)
    resumed = evaluate_model(model, tok, cfg, checkpoint=path)
    assert resumed["methods"]["leapquant-int8"]["kl"] > 10 * straight["methods"]["leapquant-int8"]["kl"]
    assert resumed["fp32"] == straight["fp32"]  # the fp32 rows were left alone


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    model, tok = load_model("qwen35-gdn-tiny-recall-byte", "cpu")
    path = tmp_path / "run.pt"
    cfg = EvalConfig(methods=("int8",), tokens=8, prefill=8, curve_points=2)
    evaluate_model(model, tok, cfg, checkpoint=path, time_limit=0)
    before = path.read_bytes()
    for other, field in [
        (EvalConfig(methods=("int6",), tokens=8, prefill=8, curve_points=2), "rows"),
        (EvalConfig(methods=("int8",), tokens=16, prefill=8, curve_points=2), "tokens"),
        (EvalConfig(methods=("int8",), tokens=8, prefill=4, curve_points=2), "prefill"),
        (EvalConfig(methods=("int8",), tokens=8, prefill=8, curve_points=2, chunk=3), "chunk"),
        (EvalConfig(methods=("int8",), tokens=8, prefill=8, curve_points=2, generate=("int8",)), "generate"),
    ]:
        with pytest.raises(LeapQuantError, match=f"is of another run: {field}"):
            evaluate_model(model, tok, other, checkpoint=path)
    with pytest.raises(LeapQuantError, match="the token ids differ"):
        evaluate_model(model, tok, cfg, text="x = 1\n" * 200, checkpoint=path)
    weight = next(model.parameters())
    kept = weight.detach().clone()
    with torch.no_grad():
        weight[0] += 1.0  # other weights under the same folder name
        with pytest.raises(LeapQuantError, match="is of another run: weights: they differ"):
            evaluate_model(model, tok, cfg, checkpoint=path)
        weight.copy_(kept)
    assert path.read_bytes() == before  # a refused run leaves the checkpoint as it was
    path.write_text("not a checkpoint")
    with pytest.raises(LeapQuantError, match="not a leapquant eval checkpoint"):
        evaluate_model(model, tok, cfg, checkpoint=path)
    with pytest.raises(LeapQuantError, match="needs a checkpoint"):
        evaluate_model(model, tok, cfg, time_limit=10)


def test_eval_cli_stops_at_the_time_limit_and_goes_on(tmp_path, capsys):
    path, out = tmp_path / "run.pt", tmp_path / "run.json"
    argv = ["eval", "--model", "qwen35-gdn-tiny-recall-byte", "-m", "int8", "--tokens", "8", "--prefill", "8",
            "--device", "cpu", "--checkpoint", str(path), "--json", str(out), "--quiet"]  # fmt: skip
    assert main([*argv, "--time-limit", "0.001"]) == 75
    assert "the same command goes on from" in capsys.readouterr().err
    report = json.loads(out.read_text())
    assert not report["complete"] and report["tokens"] < 8
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["complete"] and report["tokens"] == 8 and report["resumed_at"]
    assert main(["eval", "--model", "qwen35-gdn-tiny-recall-byte", "--time-limit", "5", "--quiet"]) == 2
    assert "--time-limit needs --checkpoint" in capsys.readouterr().err
