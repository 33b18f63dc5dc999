"""The long-memory recall task: prompt generator, training windows, and the scorer decoding through states."""

from __future__ import annotations

import json
import random

import pytest

from leapquant import LeapQuantError
from leapquant.eval.recall import METHOD_PRESETS, RecallConfig, resolve_methods
from leapquant.eval.recall_tasks import TASKS, make_examples, training_sequence
from leapquant.methods import parse_method


def encode(s: str) -> list[int]:
    return [b + 3 for b in s.encode()]


def decode(ids) -> str:
    return bytes(i - 3 for i in ids).decode()


TEXT = encode("def f(x):\n    return x + 1\n" * 400)  # 10,800 tokens of ordinary text
TEXT_STD = __import__("inspect").getsource(json)  # real source for the model tests


@pytest.mark.parametrize("task", list(TASKS))
def test_examples_are_deterministic_and_seeded(task):
    a = make_examples(task, 300, 4, TEXT, encode, seed=1, prefix=20)
    assert a == make_examples(task, 300, 4, TEXT, encode, seed=1, prefix=20)
    b = make_examples(task, 300, 4, TEXT, encode, seed=2, prefix=20)
    assert [ex.values for ex in a] != [ex.values for ex in b]
    assert len({tuple(ex.values) for ex in a}) == 4  # the examples of one call differ from each other


@pytest.mark.parametrize(
    ("task", "distance"), [("passkey", 17), ("passkey", 1000), ("mqar", 60), ("mqar", 2500)]
)
def test_keys_are_planted_at_the_distance(task, distance):
    for ex in make_examples(task, distance, 3, TEXT, encode, seed=0, prefix=33):
        assert ex.planted_at == ex.prefix == 33
        assert len(ex.context) - ex.planted_at == ex.distance == distance  # first query starts here
        block = decode(ex.context[ex.planted_at :])
        lines = block.split("\n")[1 : 1 + TASKS[task].pairs]
        planted = dict(line.split(" = ") for line in lines)
        assert planted == dict(zip(ex.keys, ex.values))  # every key asked, with its planted value
        for (prompt, answer), key, value in zip(ex.queries, ex.keys, ex.values):
            assert decode(prompt) == f"\n{key} = " and decode(answer) == value
            assert len(value) == TASKS[task].digits and value.isdigit()
        full, mask = ex.tokens(), ex.answer_mask()
        assert len(full) == len(mask) and decode([t for t, m in zip(full, mask) if m]) == "".join(ex.values)


def test_bad_examples_are_refused():
    with pytest.raises(LeapQuantError, match="unknown task"):
        make_examples("needle", 100, 1, TEXT, encode)
    with pytest.raises(LeapQuantError, match="shorter than"):
        make_examples("mqar", 20, 1, TEXT, encode)
    with pytest.raises(LeapQuantError, match="fewer than"):
        make_examples("passkey", 20_000, 1, TEXT, encode)


def test_training_sequence_has_exact_length_and_marks_answers():
    rng = random.Random(0)
    for _ in range(5):
        ids, mask = training_sequence(512, TEXT, encode, rng, max_distance=200)
        assert len(ids) == len(mask) == 512
        answers = decode([t for t, m in zip(ids, mask) if m])
        assert answers and answers.isdigit()
        text = decode(ids)
        # every answer follows its query prompt: the bytes before each answer run end in " = "
        starts = [i for i in range(1, 512) if mask[i] and not mask[i - 1]]
        assert starts and all(text[:s].endswith(" = ") for s in starts)


def test_presets_expand_and_configs_validate():
    assert resolve_methods(["smoke", "int8", "fp32"]) == METHOD_PRESETS["smoke"]
    assert {"leapquant-int8", "int8", "kvquant-int8", "int4"} <= set(resolve_methods(["paper-table"]))
    for preset in METHOD_PRESETS:  # a preset never hides a method of the same name
        with pytest.raises(LeapQuantError):
            parse_method(preset)
    with pytest.raises(LeapQuantError):
        RecallConfig(methods=("int9",))
    with pytest.raises(LeapQuantError, match="distances"):
        RecallConfig(distances=(0,))
    with pytest.raises(LeapQuantError, match="unknown task"):
        RecallConfig(task="needle")


def test_cli_rejects_bad_input_in_one_line(capsys, tmp_path):
    from leapquant.cli.main import main

    assert main(["recall", "--model", str(tmp_path), "--distances", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("leapquant: error:") and "\n" not in err
    bad = tmp_path / "r.json"
    bad.write_text(json.dumps({"x": 1}))
    assert main(["recall-report", str(bad)]) == 2


# --- the scorer decodes through each method's state (the shipped tiny recall model, CPU, ~150 tokens) -------


@pytest.fixture(scope="module")
def recall_model():
    """``qwen35-gdn-tiny-recall-byte``: 4 GDN layers and no attention, trained on passkey recall (its model
    card), so the planted key reaches the query only through the recurrent state."""
    import leapquant
    from leapquant.eval.model_eval import load_model

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    return load_model(leapquant.checkpoint_path("qwen35-gdn-tiny-recall-byte"), "cpu")


class _Wiped:
    """The model's own fp32 state, wiped after every token: what a broken quantizer does to long memory."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self, *args):
        out = self.inner.step(*args)
        self.inner.state = self.inner.state * 0
        return out


def test_scores_come_from_decoding_through_each_state(recall_model, monkeypatch):
    """Keys planted 128 tokens before their query, scored against the planted answers: FP32 finds at least
    7 of 8; rows holding an exact copy of the FP32 state answer exactly as FP32 (every row group decodes
    through its own state), rows whose state is wiped after every token lose the answers, and LeapQuant
    INT8 decodes FP32's answers."""
    import leapquant.integrations.row_groups as hf
    from leapquant.eval.recall import score_examples

    model, tok = recall_model
    text = tok(TEXT_STD, add_special_tokens=False)["input_ids"]
    encode_ = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    examples = make_examples("passkey", 128, 8, text, encode_, seed=3, prefix=16)
    real = hf.make_state

    def states(config, **kw):  # "bf16" rows: an exact fp32 copy; "fp16" rows: wiped after every token
        if config.name in ("bf16", "fp16"):
            st = real(parse_method("fp32"), **kw)
            return st if config.name == "bf16" else _Wiped(st)
        return real(config, **kw)

    monkeypatch.setattr(hf, "make_state", states)
    config = RecallConfig(methods=("bf16", "fp16", "leapquant-int8"), chunk=64)
    report = score_examples(model, examples, config)
    fp32, copy, wiped, lq = (report[m] for m in ("fp32", "bf16", "fp16", "leapquant-int8"))
    assert all(r["nonfinite"] == 0 for r in (fp32, copy, wiped, lq))
    assert fp32["accuracy"] >= 7 / 8
    assert copy["answers"] == fp32["answers"] and copy["state_rel_err"] < 1e-5
    assert wiped["accuracy"] <= 0.25 and wiped["agree_fp32"] <= 0.25 and wiped["state_rel_err"] > 0.5
    assert lq["agree_fp32"] == 1.0 and lq["accuracy"] == fp32["accuracy"] and 0 < lq["state_rel_err"] < 0.05


def test_a_layer_plan_is_a_row_of_its_own(recall_model, tmp_path):
    """A saved layer plan (``leapquant calibrate --out``) scores as a row named by its file: a plan giving
    every layer ``int8`` decodes exactly as the ``int8`` row, a mixed plan differs from both of its
    methods (each layer really gets its own method), and its bytes are the layers' average."""
    from leapquant.eval.recall import score_examples
    from leapquant.methods import LayerPlan

    model, tok = recall_model
    text = tok(TEXT_STD, add_special_tokens=False)["input_ids"]
    encode_ = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    examples = make_examples("passkey", 96, 4, text, encode_, seed=5, prefix=16)
    int8, int4 = parse_method("int8"), parse_method("int4")
    uniform = LayerPlan(tuple((i, int8) for i in range(4)), None).save(tmp_path / "all-int8.json")
    mixed = LayerPlan(((0, int4), (1, int8), (2, int8), (3, int4)), None).save(tmp_path / "mixed.json")
    config = RecallConfig(methods=("int8", "int4", str(uniform), str(mixed)), chunk=32)
    report = score_examples(model, examples, config)
    same, mix = report[str(uniform)], report[str(mixed)]
    # the two groups' rows sit at other batch positions, where a many-core host's GEMMs may round the
    # model's own activations differently (1.4e-9 relative in the error on a 16-core H100 host)
    assert same["answers"] == report["int8"]["answers"]
    assert same["state_rel_err"] == pytest.approx(report["int8"]["state_rel_err"], rel=1e-6)
    errs = {report[m]["state_rel_err"] for m in ("int8", "int4")}
    assert mix["state_rel_err"] not in errs and min(errs) < mix["state_rel_err"] < max(errs)
    assert config.config_of(str(mixed)).bytes_per_element(32, 32) == pytest.approx(
        (int8.bytes_per_element(32, 32) + int4.bytes_per_element(32, 32)) / 2
    )
    with pytest.raises(LeapQuantError, match="does not exist"):
        RecallConfig(methods=(str(tmp_path / "missing.json"),))


def test_recall_cli_runs_a_real_method_and_reports(tmp_path, capsys):
    """`leapquant recall` end to end on a shipped checkpoint by name (CPU, ~60 tokens): JSON, table, plot."""
    from leapquant.cli.main import main

    out = tmp_path / "r.json"
    argv = [
        "recall",
        "--model",
        "qwen35-gdn-tiny-recall-byte",
        "-m",
        "int8",
        "--distances",
        "24",
        "40",
        "--examples",
        "1",
    ]
    argv += ["--prefix", "8", "--device", "cpu", "--json", str(out), "--plot", str(tmp_path / "r.png")]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert (
        report["complete"] and report["distances"] == [24, 40] and set(report["methods"]) == {"fp32", "int8"}
    )
    row = report["methods"]["int8"]
    assert row["nonfinite"] == {"24": 0, "40": 0} and 0 < row["state_rel_err"]["40"] < 1
    assert report["provenance"]["device"] == "cpu" and (tmp_path / "r.png").stat().st_size > 0
    capsys.readouterr()
    assert main(["recall-report", str(out), str(out)]) == 2  # the same method twice: refused
    assert main(["recall-report", str(out)]) == 0
    md = capsys.readouterr().out
    assert "| `int8` | 1.125 | 100.0 | 100.0 |" in md  # 32x32 heads: 1 + 4 / 32
    err = row["state_rel_err"]
    assert (
        f"| `int8` | {round(row['agree_fp32']['24'])}/1 | {round(row['agree_fp32']['40'])}/1 "
        f"| {err['24']:.2g} | {err['40']:.2g} |"
        in md
        and "| `fp32` | 1/1 | 1/1 | 0 | 0 |" in md
    )

    # a process cut short before the longest distance: merged, its cell "not reached", the plot drawn;
    # the same gap in a report that claims to be complete is a missing file, refused
    short = json.loads(out.read_text())
    row = short["methods"].pop("int8")
    short["methods"]["int6"] = {k: ({"24": v["24"]} if isinstance(v, dict) else v) for k, v in row.items()}
    for complete, code in ((False, 0), (True, 2)):
        short["complete"] = complete
        (tmp_path / "short.json").write_text(json.dumps(short))
        merged = tmp_path / f"merged-{complete}.json"
        argv = ["recall-report", str(out), str(tmp_path / "short.json"), "--merge", str(merged)]
        assert main([*argv, "--plot", str(tmp_path / "m.png")]) == code
        text = capsys.readouterr()
        if code:
            assert "'int6' has no result at distances [40]" in text.err and not merged.exists()
            continue
        assert "| `int6` | 1.125 | 100.0 | not reached |" in text.out and "cut short" in text.out
        joined = json.loads(merged.read_text())
        assert not joined["complete"] and (tmp_path / "m.png").stat().st_size > 0
        assert [r["methods"] for r in joined["seconds_by_run"]] == [["int8"], ["int6"]]

    # distances measured on several machines: the header names each machine with its distances, and a
    # merged report merged again keeps every run's machine
    reports = {}
    for dist, dev in (("24", "cpu"), ("40", "NVIDIA H100 80GB HBM3"), ("56", "NVIDIA H200")):
        rep = json.loads(out.read_text())
        rep["distances"], rep["seconds"] = [int(dist)], {dist: 1.0}
        rep["provenance"] = {**rep["provenance"], "device": dev}
        for m in rep["methods"].values():
            for key, value in m.items():
                if isinstance(value, dict):
                    m[key] = {dist: value[min(dist, "40")]}
        reports[dist] = tmp_path / f"at-{dist}.json"
        reports[dist].write_text(json.dumps(rep))
    first, both = tmp_path / "first.json", tmp_path / "both.json"
    assert main(["recall-report", str(reports["24"]), str(reports["40"]), "--merge", str(first)]) == 0
    capsys.readouterr()
    assert main(["recall-report", str(first), str(reports["56"]), "--merge", str(both)]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "; cpu (24 tokens, " in header and "; NVIDIA H100 80GB HBM3 (40 tokens, " in header
    assert "; NVIDIA H200 (56 tokens, " in header
    runs = json.loads(both.read_text())["seconds_by_run"]
    assert [r["device"] for r in runs] == ["cpu", "NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    # one row name, two configurations (a plan path holding another plan on the other machine): refused
    other = json.loads(reports["56"].read_text())
    other["methods"]["int8"]["bytes_per_element"] = 0.5
    reports["56"].write_text(json.dumps(other))
    assert main(["recall-report", str(first), str(reports["56"])]) == 2
    assert "merge: method 'int8' has bytes_per_element" in capsys.readouterr().err
    # the planted values of every distance survive a merge
    assert set(json.loads(first.read_text())["values"]) == {"24", "40"}
    # prompts cut from another text: another filler source, or one distance asked on a text of another
    # length (a run whose longest distance differed), are refused
    cases = (("source", "filler.txt", "filler text"), ("tokens", 123, "distance 24 was asked"))
    for key, value, message in cases:
        other = json.loads(reports["24"].read_text())
        other["text"][key] = value
        other["methods"] = {"fp32": other["methods"]["fp32"]}
        (tmp_path / "other.json").write_text(json.dumps(other))
        assert main(["recall-report", str(reports["24"]), str(tmp_path / "other.json")]) == 2
        assert message in capsys.readouterr().err
    # a merged report keeps each distance's text: merged again with a run of one of its distances on the
    # same text it is accepted, on another text refused; one merged before it kept them (a single count)
    # says nothing about its distances, and merges as it did
    run = json.loads(out.read_text())  # both distances, as one run asked them
    run["methods"] = {"fp32": run["methods"]["fp32"], "int4": run["methods"]["int8"]}
    (tmp_path / "run.json").write_text(json.dumps(run))
    tokens = run["text"]["tokens"]
    assert json.loads(first.read_text())["text"]["tokens"] == {"24": tokens, "40": tokens}
    assert main(["recall-report", str(first), str(tmp_path / "run.json")]) == 0, capsys.readouterr().err
    run["text"]["tokens"] += 1
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert main(["recall-report", str(first), str(tmp_path / "run.json")]) == 2
    assert "distance 24 was asked" in capsys.readouterr().err
    old = json.loads(first.read_text())
    old["text"]["tokens"] = 99
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert main(["recall-report", str(tmp_path / "old.json"), str(tmp_path / "run.json")]) == 0


def test_recall_on_a_text_file_writes_its_report(tmp_path):
    """``--text FILE`` with ``--json``: the report names the file (a path object once stopped the first
    partial write, and with it the run's results)."""
    from leapquant.cli.main import main

    filler = tmp_path / "filler.txt"
    filler.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(60)))
    out = tmp_path / "r.json"
    argv = ["recall", "--model", "qwen35-gdn-tiny-recall-byte", "-m", "int8", "--distances", "24", "40"]
    argv += ["--examples", "1", "--prefix", "8", "--device", "cpu", "--text", str(filler), "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["complete"] and report["text"]["source"] == str(filler) and report["distances"] == [24, 40]
