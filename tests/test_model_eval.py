"""`leapquant eval` and `leapquant trace` on a tiny random-weight byte-level model saved to disk."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from leapquant.cli.main import main
from leapquant.errors import LeapQuantError
from leapquant.eval.eval_report import kl_cell, metrics_after, nonfinite_by
from leapquant.eval.model_eval import EvalConfig, evaluate_model, load_model, stdlib_text
from leapquant.traces import load_trace


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    import transformers as tf

    torch.manual_seed(0)
    tok = tf.ByT5Tokenizer()
    cfg = tf.Qwen3_5TextConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
    )
    model = tf.Qwen3_5ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.add_(-4.0)  # long memory, so the state carries history
    path = tmp_path_factory.mktemp("tiny") / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_stdlib_text_is_deterministic():
    a, files_a = stdlib_text(50_000)
    b, files_b = stdlib_text(50_000)
    assert a == b and files_a == files_b and len(a.encode()) >= 50_000
    assert not any("site-packages" in f or f.startswith("test") for f in files_a)


def test_eval_report(tiny_dir):
    model, tok = load_model(tiny_dir, "cpu")
    cfg = EvalConfig(
        methods=("fp32", "int4", "leapquant-int8"),
        tokens=48,
        prefill=8,
        curve_points=4,
        generate=("int4",),
        generate_tokens=8,
        backend="reference",
    )
    partial = []
    rep = evaluate_model(model, tok, cfg, on_partial=partial.append)
    assert [p["tokens"] for p in partial] == [12, 24, 36] and not any(p["complete"] for p in partial)
    assert rep["complete"] and partial[-1]["curves"]["tokens"] == [12, 24, 36]
    assert 0 < partial[0]["decode_seconds"] <= partial[-1]["decode_seconds"] <= rep["decode_seconds"]
    assert set(rep["methods"]) == {"fp32", "int4", "leapquant-int8"}
    fp32, int4, lq = (rep["methods"][m] for m in ("fp32", "int4", "leapquant-int8"))
    # The fp32 row shares the batched projections and convolutions with the other rows; on some CPUs their
    # vector kernels round rows of one batch differently in the last bit (seen: KL 3e-16, 2026-12-02), so
    # here fp32 must equal the baseline to rounding. Bit-exactness of a patch with fp32 alone is tested in
    # test_transformers_integration and test_shipped_checkpoints.
    assert fp32["kl"] < 1e-12 and fp32["top1_agreement"] == 1 and fp32["state_rel_err"] < 1e-6
    assert fp32["nll"] == pytest.approx(rep["fp32"]["nll"])
    assert int4["state_rel_err"] > lq["state_rel_err"] > 0
    assert int4["kl"] > 0 and 0 <= int4["top1_agreement"] <= 1
    assert rep["curves"]["tokens"] == [12, 24, 36, 48]
    assert set(rep["curves"]["layers"]) == {"0", "1", "2"}
    assert all(len(c) == 4 for c in rep["curves"]["layers"]["0"].values())
    # KL and top-1 per stretch of 12 tokens: the stretches make up the run's means, and the late ones are
    # what the run added after a partial report
    for key in ("kl", "top1_agreement"):
        for name in ("int4", "leapquant-int8"):
            seg = rep["curves"][key][name]
            assert len(seg) == 4 and sum(seg) / 4 == pytest.approx(rep["methods"][name][key], rel=1e-9)
            late = metrics_after(rep, 24)[name]
            assert late["from"] == 24 and late["tokens"] == 24
            want = (48 * rep["methods"][name][key] - 24 * partial[1]["methods"][name][key]) / 24
            assert late[key] == pytest.approx(want, rel=1e-9, abs=1e-15)
    assert metrics_after(rep, 13)["int4"]["from"] == 24  # segments start at 0, 12, 24, 36
    with pytest.raises(LeapQuantError, match="no curve segment starts at or after token 37"):
        metrics_after(rep, 37)
    g = int4["generate"]
    assert g["tokens"] == 8 and g["prompts"] == 8 and 0 <= g["agreement"] <= 1
    assert len(g["first_divergence_per_prompt"]) == 8 and 0 <= g["first_divergence"] <= 8
    firsts = [8 if x is None else x for x in g["first_divergence_per_prompt"]]
    assert g["first_divergence"] == statistics.median(firsts)  # of 8 prompts: the middle two averaged
    # NLL computed independently from one full forward of the unpatched model
    ids = torch.tensor(tok(stdlib_text(4 * 57)[0], add_special_tokens=False)["input_ids"][:57])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids[None]).logits[0].double(), -1)
    nll = -logp[torch.arange(8, 56), ids[9:57]].mean()
    assert rep["fp32"]["nll"] == pytest.approx(float(nll), rel=1e-5)


@pytest.mark.parametrize("chunk", [5, 256], ids=["chunk5", "chunk256"])
def test_chunked_calls_score_what_a_call_per_token_scores(tiny_dir, chunk, monkeypatch):
    """Chunks change only how many tokens a model call takes: each method state still steps token by
    token, chunks end at the curve points, and the scores equal a call per token's to rounding (the
    attention layers and MLPs sum in another order over a chunk)."""
    from leapquant.eval import model_eval

    # chunks of up to 14 tokens here: score them in slices of 3 so that every slice offset is exercised
    monkeypatch.setattr(model_eval, "_SCORED_AT_ONCE", 3)
    model, tok = load_model(tiny_dir, "cpu")
    methods = ("int8", "leapquant-int8", "int4/w16+ct8+smooth")
    calls = []
    hook = model.register_forward_pre_hook(
        lambda _m, args, kw: calls.append((args[0] if args else kw["input_ids"]).shape[1]), with_kwargs=True
    )
    try:
        reps = {}
        for c in (1, chunk):
            calls.clear()
            done = []
            cfg = EvalConfig(methods=methods, tokens=40, prefill=8, curve_points=3, backend="reference",
                             chunk=c)  # fmt: skip
            reps[c] = evaluate_model(model, tok, cfg, on_step=done.append)
            assert sum(done) == 40 and calls[0] == 8  # the prefill, then the chunks
            assert sum(calls[1:]) == 40 and max(calls[1:]) <= c
    finally:
        hook.remove()
    # the chunks end at the curve points 13, 27 and 40
    ends = [sum(calls[1 : i + 2]) for i in range(len(calls) - 1)]
    assert {13, 27, 40} <= set(ends) and len(calls) - 1 == (3 if chunk == 256 else 9)
    one, many = reps[1], reps[chunk]
    assert many["chunk"] == chunk and one["chunk"] == 1
    assert many["curves"]["tokens"] == one["curves"]["tokens"] == [13, 27, 40]
    assert many["fp32"]["nll"] == pytest.approx(one["fp32"]["nll"], rel=1e-6)
    for name in methods:
        a, b = one["methods"][name], many["methods"][name]
        assert b["nll"] == pytest.approx(a["nll"], rel=1e-5)
        assert b["state_rel_err"] == pytest.approx(a["state_rel_err"], rel=1e-3)
        assert b["kl"] == pytest.approx(a["kl"], rel=1e-2)
        assert b["top1_agreement"] == pytest.approx(a["top1_agreement"], abs=1 / 40)


def test_a_non_finite_run_says_where_it_stopped_being_finite():
    nan, inf = float("nan"), float("inf")
    report = {
        "methods": {"a": {"kl": nan}, "b": {"kl": 0.5}, "c": {"kl": inf}},
        "curves": {
            "tokens": [100, 200, 300],
            "kl": {"a": [0.1, nan, nan], "b": [0.1, 0.2, 1.2], "c": [inf] * 3},
        },
    }
    assert nonfinite_by(report) == {"a": 200, "b": None, "c": 100}
    assert kl_cell(report, "a") == "nan (non-finite by token 200)" and kl_cell(report, "b") == "5.000e-01"


def test_eval_cli(tiny_dir, tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(
        [
            "eval",
            "--model",
            str(tiny_dir),
            "-m",
            "int8",
            "-m",
            "leapquant-int8",
            "--tokens",
            "24",
            "--prefill",
            "8",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--quiet",
            "--device",
            "cpu",
        ]
    )
    assert rc == 0
    rep = json.loads(out.read_text())
    for m in ("int8", "leapquant-int8"):
        assert {"kl", "top1_agreement", "nll", "state_rel_err"} <= set(rep["methods"][m])
    assert png.stat().st_size > 1000
    assert "KL" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "/nonexistent/model"], "'/nonexistent/model': no such folder"),
        (["-m", "int9"], "unknown format 'int9'"),
        (["--text", "SHORT"], "fewer than the"),
        (["--text", "/nonexistent.txt"], "/nonexistent.txt: no such file"),
        (["--tokens", "0"], "--tokens: must be >= 1"),
        (["-m", "int8", "--generate", "int4"], "--generate int4 needs the method among the evaluated ones"),
    ],
    ids=["missing-model", "unknown-method", "short-text", "missing-text", "zero-tokens", "generate-no-row"],
)
def test_eval_cli_errors(tiny_dir, tmp_path, capsys, argv, message):
    short = tmp_path / "short.txt"
    short.write_text("x = 1\n")
    argv = [str(short) if a == "SHORT" else a for a in argv]
    if "--model" not in argv:
        argv = ["--model", str(tiny_dir), *argv]
    assert main(["eval", "--quiet", *argv]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("leapquant:")]
    assert len(err) == 1 and message in err[0]


def test_eval_rejects_model_without_linear_attention(tmp_path, capsys):
    import transformers as tf

    tf.LlamaForCausalLM(
        tf.LlamaConfig(
            vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
        )
    ).save_pretrained(tmp_path)
    tf.ByT5Tokenizer().save_pretrained(tmp_path)
    assert main(["eval", "--model", str(tmp_path), "--tokens", "4", "--quiet"]) == 2
    assert "no supported linear-attention layers" in capsys.readouterr().err


def test_trace_replays_exactly(tiny_dir, tmp_path):
    """A recorded trace replayed at fp32 reproduces itself, and quantized methods drift from it."""
    from leapquant.eval import simulate

    out = tmp_path / "t.npz"
    assert main(["trace", "--model", str(tiny_dir), "--tokens", "96", "--layers", "0,2", "--heads", "1",
                 "--out", str(out), "--device", "cpu"]) == 0  # fmt: skip
    trace = load_trace(out)
    assert trace.records.k.shape == (2, 96, 32) and trace.meta["layers"] == [0, 2]
    rep = simulate([trace], ["fp32", "int4"])
    assert rep["methods"]["fp32"]["output_rel_err"] < 1e-12
    assert rep["methods"]["int4"]["output_rel_err"] > 1e-4
    assert main(["trace", "--model", str(tiny_dir), "--tokens", "8", "--layers", "3", "--out", str(out)]) == 2


def test_eval_report_markdown(tiny_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["eval", "--model", str(tiny_dir), "-m", "int4", "--tokens", "8", "--prefill", "4",
                 "--json", str(out), "--quiet", "--device", "cpu"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["eval-report", str(out)]) == 0
    md = capsys.readouterr().out
    assert "| `int4` | 0.625 |" in md and "8 teacher-forced tokens" in md
    assert main(["eval-report", str(tmp_path / "missing.json")]) == 2
    # --after: the late stretch of the run (8 tokens make 8 one-token segments)
    report = json.loads(out.read_text())
    assert main(["eval-report", str(out), "--after", "6"]) == 0
    late = sum(report["curves"]["kl"]["int4"][6:]) / 2
    md = capsys.readouterr().out
    assert "tokens 7 to 8 of 8" in md and f"| `int4` | 0.625 | {late:.2e} |" in md
    assert main(["eval-report", str(out), "--after", "8"]) == 2
    assert "no curve segment starts at or after token 8" in capsys.readouterr().err
    # --plot-kl: one panel per model from any number of reports, --only picks lines by name
    png = tmp_path / "kl.png"
    assert main(["eval-report", str(out), str(out), "--plot-kl", str(png), "--only", "int4"]) == 0
    assert png.stat().st_size > 10_000
    assert main(["eval-report", str(out), "--plot-kl", str(png), "--only", "int5"]) == 2
    assert "--only: no report has int5 (they have: int4)" in capsys.readouterr().err
    assert main(["eval-report", str(out), "--only", "int4"]) == 2
    assert "give --plot-kl" in capsys.readouterr().err
    del report["curves"]["kl"]  # a report from before the segment curves
    out.write_text(json.dumps(report))
    assert main(["eval-report", str(out), "--after", "2"]) == 2
    assert "no per-segment KL" in capsys.readouterr().err
    assert main(["eval-report", str(out), "--plot-kl", str(png)]) == 2
    assert "without per-stretch KL" in capsys.readouterr().err


def test_eval_split_over_processes_merges_into_one_report(tiny_dir, tmp_path, capsys):
    """Methods split over runs (one process each on the GPU) merge into the report of one joint run."""
    common = ["eval", "--model", str(tiny_dir), "--tokens", "12", "--prefill", "4", "--quiet",
              "--device", "cpu"]  # fmt: skip
    paths = {name: tmp_path / f"{name}.json" for name in ("joint", "a", "b", "merged")}
    assert main([*common, "-m", "int4", "-m", "int8", "--json", str(paths["joint"])]) == 0
    assert main([*common, "-m", "int4", "--json", str(paths["a"])]) == 0
    assert main([*common, "-m", "int8", "--json", str(paths["b"])]) == 0
    capsys.readouterr()
    png = tmp_path / "merged.png"
    merge = ["eval-report", str(paths["a"]), str(paths["b"]), "--merge", str(paths["merged"])]
    assert main([*merge, "--plot", str(png)]) == 0
    assert capsys.readouterr().out.count("| `int") == 2  # one table with both methods
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["eval-report", str(paths["a"]), str(paths["b"]), "--plot", str(png)]) == 2
    joint, merged = (json.loads(paths[n].read_text()) for n in ("joint", "merged"))
    assert merged["complete"] and list(merged["methods"]) == ["int4", "int8"]
    for name in ("int4", "int8"):
        for key in ("kl", "nll", "state_rel_err", "top1_agreement"):
            got, want = merged["methods"][name][key], joint["methods"][name][key]
            assert got == pytest.approx(want, rel=1e-5, abs=1e-9)
        for layer, curves in joint["curves"]["layers"].items():
            assert merged["curves"]["layers"][layer][name] == pytest.approx(curves[name], rel=1e-5, abs=1e-9)
    # the same method twice, or runs of another length, are not one evaluation
    assert main(["eval-report", str(paths["a"]), str(paths["a"]), "--merge", str(paths["merged"])]) == 2
    assert "in two reports" in capsys.readouterr().err
    b = json.loads(paths["b"].read_text())
    older = {k: v for k, v in b.items() if k != "chunk"}  # a report made before the chunk was recorded
    other_marks = b | {"curves": {**b["curves"], "tokens": [4, 8, 12]}}
    cases = [("'chunk'", b | {"chunk": 1}), ("'chunk'", older), ("'tokens'", b | {"tokens": 6})]
    cases += [("'backend'", b | {"backend": "reference64"}), ("curve points", other_marks)]
    for key, report in cases:
        paths["b"].write_text(json.dumps(report))
        assert main(["eval-report", str(paths["a"]), str(paths["b"]), "--merge", str(paths["merged"])]) == 2
        assert f"differ in {key}" in capsys.readouterr().err


def test_a_model_without_attention_layers_runs_every_command(tmp_path):
    """An all-linear-attention model (the shipped recall checkpoint) through eval, generate, trace and
    calibrate: transformers 5.17 asks the cache for its length when no positions are given, and only
    attention layers have one (it raised 'get_seq_length can only be called on Attention layers')."""
    import leapquant

    path = leapquant.checkpoint_path("qwen35-gdn-tiny-recall-byte")
    model, tok = load_model(path, "cpu")
    assert "full_attention" not in model.config.layer_types
    cfg = EvalConfig(methods=("fp32", "int8"), tokens=16, prefill=8, curve_points=2, generate=("int8",),
                     generate_tokens=4, backend="reference")  # fmt: skip
    rep = evaluate_model(model, tok, cfg)
    assert rep["complete"] and rep["methods"]["int8"]["state_rel_err"] > 0
    assert rep["methods"]["int8"]["generate"]["tokens"] == 4
    out = tmp_path / "t.npz"
    assert main(["trace", "--model", str(path), "--tokens", "24", "--layers", "0", "--out", str(out)]) == 0
    assert load_trace(out).records.k.shape == (2, 24, 32)
    plan = tmp_path / "plan.json"
    assert main(["calibrate", "--model", str(path), "--tokens", "64", "--out", str(plan)]) == 0
    assert plan.stat().st_size > 0


def test_text_is_gathered_until_the_tokenizer_makes_enough_tokens():
    """A tokenizer packing more than 4 bytes a token (large BPE vocabularies on source) still gets its
    tokens: the text grows until it holds them, and a corpus that runs out, or given text that is too
    short, says so."""
    from leapquant.eval.model_eval import token_ids

    asked = []

    def gather(min_bytes):  # exactly what is asked for, as a corpus of small files could give
        asked.append(min_bytes)
        if min_bytes > 4096:
            raise LeapQuantError(f"corpus holds 4096 bytes, fewer than the {min_bytes} asked for")
        return "x" * min_bytes, ["f.py"]

    def tokenizer(bytes_per_token):
        return lambda text, add_special_tokens=False: {"input_ids": list(range(len(text) // bytes_per_token))}

    ids, text, files = token_ids(tokenizer(1), 100, "corpus", gather=gather)
    assert (ids, len(text), files, asked) == (list(range(100)), 400, ["f.py"], [400])
    asked.clear()
    ids, text, _ = token_ids(tokenizer(10), 100, "corpus", gather=gather)
    assert ids == list(range(100)) and len(text) == 1600 and asked == [400, 800, 1600]
    with pytest.raises(LeapQuantError, match="fewer than the 6400"):
        token_ids(tokenizer(40), 100, "corpus", gather=gather)
    with pytest.raises(LeapQuantError, match="given text has 99 tokens, fewer than the 100"):
        token_ids(tokenizer(1), 100, "given text", text="y" * 99, gather=gather)


def test_bytes_per_element_of_a_plan_counts_the_layers_its_default_covers(tiny_dir, tmp_path):
    """A plan that lists one layer and gives the rest a default: its bytes per element average every linear
    layer of the model, not the listed one alone; at the model's own head size (32x32 here: the column was
    counted for 128x128 heads whatever the model)."""
    from leapquant.methods import parse_method
    from leapquant.methods.layer_plan import PLAN_FORMAT

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"plan": PLAN_FORMAT, "layers": {"0": "int4"}, "default": "int8"}))
    model, tok = load_model(tiny_dir, "cpu")
    cfg = EvalConfig(methods=(str(plan),), tokens=8, prefill=8, curve_points=1, backend="reference")
    rep = evaluate_model(model, tok, cfg)
    layers = len(rep["curves"]["layers"])
    int4, int8 = (parse_method(m).bytes_per_element(32, 32) for m in ("int4", "int8"))
    assert layers > 1
    want = (int4 + (layers - 1) * int8) / layers
    assert rep["methods"][str(plan)]["bytes_per_element"] == pytest.approx(want)


def test_a_broken_model_folder_is_one_line(tiny_dir, tmp_path, capsys):
    """No weights, a bad config.json, an unknown model type: transformers' tracebacks (exit 1); no
    tokenizer files: an empty tokenizer and, after 35 s, an error about the standard library's size."""
    import json
    import shutil

    from leapquant.cli.main import main

    cases = {}
    for name in ("no_weights", "bad_json", "unknown_type", "no_tokenizer"):
        cases[name] = tmp_path / name
        shutil.copytree(tiny_dir, cases[name])
    (cases["no_weights"] / "model.safetensors").unlink()
    (cases["bad_json"] / "config.json").write_text("{not json")
    config = json.loads((cases["unknown_type"] / "config.json").read_text())
    (cases["unknown_type"] / "config.json").write_text(json.dumps(config | {"model_type": "qwen9"}))
    for f in cases["no_tokenizer"].iterdir():
        if "token" in f.name:
            f.unlink()
    words = {
        "no_weights": "no file named model.safetensors",
        "bad_json": "not a valid JSON file",
        "unknown_type": "qwen9",
        "no_tokenizer": "its tokenizer makes no tokens",
    }
    for name, folder in cases.items():
        assert main(["eval", "--model", str(folder), "--tokens", "32", "--quiet"]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()[-1]  # after the CPU note
        assert err.startswith(f"leapquant: error: model {folder}") and words[name] in err
