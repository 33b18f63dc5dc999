"""Good runs as a new user sees them: a quiet CPU eval, an interrupted eval that keeps its numbers, a trace
that states its size first, the methods table's record buffers per family; and the API's own input checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import KERNEL_DEVICE

import leapquant
from leapquant.checks import resolve_device
from leapquant.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


def test_eval_on_a_cpu_prints_one_line_of_stderr(tmp_path):
    """No library noise (torchao's CUDA extensions, pytree notices, transformers' kernel hints): at most
    the one line saying what is slower on a CPU."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "leapquant",
            "eval",
            "--tokens",
            "4",
            "-m",
            "int8",
            "--quiet",
            "--json",
            "r.json",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert run.returncode == 0, run.stderr
    lines = run.stderr.splitlines()
    if not torch.cuda.is_available():
        assert len(lines) == 1 and lines[0].startswith("CPU run: "), run.stderr
    else:
        assert lines == [], run.stderr
    assert "int8" in run.stdout and json.loads((tmp_path / "r.json").read_text())["complete"]


def test_interrupted_eval_shows_and_keeps_its_partial_report(tmp_path, monkeypatch, capsys):
    from leapquant.eval import model_eval

    real = model_eval.evaluate_model

    def interrupted_after_six_tokens(model, tokenizer, config, **kwargs):
        steps = []

        def on_step(n):
            steps.append(n)
            if sum(steps) == 6:  # tokens, not calls: a call may score a chunk of several
                raise KeyboardInterrupt

        return real(model, tokenizer, config, **{**kwargs, "on_step": on_step})

    monkeypatch.setattr(model_eval, "evaluate_model", interrupted_after_six_tokens)
    out = tmp_path / "r.json"
    argv = ["eval", "--tokens", "8", "-m", "int8", "--quiet", "--device", "cpu", "--json", str(out)]
    assert main(argv) == 130
    stdout, stderr = capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["complete"] is False and report["tokens"] == 6
    assert "(interrupted: 6 of 8)" in stdout and "int8" in stdout
    assert f"interrupted after 6 of 8 tokens; {out} holds this partial report" in stderr


def test_trace_states_its_size_before_recording(tmp_path, capsys):
    out = tmp_path / "r.npz"
    argv = ["trace", "--tokens", "16", "--layers", "0", "--heads", "0", "--device", "cpu", "--out", str(out)]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    first, *_, last = stdout.strip().splitlines()
    assert first.startswith(f"recording 16 tokens into {out} (up to ") and "MiB" in first
    assert last.startswith(f"wrote {out} (1 streams x 16 records") and out.is_file()


def test_methods_names_the_family_of_each_record_buffer(tmp_path, capsys):
    """A record holds one fp32 running sum of decays for GDN and d_k fp16 decays for KDA: 8,260 and 12,292
    bytes for leapquant-int8's 16 records and position."""
    out = tmp_path / "m.json"
    assert main(["methods", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["d_k"], report["d_v"]) == (128, 128) and "date_utc" in report["provenance"]
    row = next(r for r in report["methods"] if r["method"] == "leapquant-int8")
    assert row["record_buffer_bytes_per_head_gdn"] == 16 * (4 + 2 * 256) + 4
    assert row["record_buffer_bytes_per_head_kda"] == 16 * 2 * (128 + 256) + 4
    assert "records B/head GDN" in capsys.readouterr().out


METHOD = leapquant.parse_method("int8")
API_CASES = [
    ("state-batch", lambda: leapquant.WindowedState(METHOD, batch=-1, d_k=4, d_v=4), "batch must be"),
    ("state-empty", lambda: leapquant.WindowedState(METHOD, batch=0, d_k=4, d_v=4), "got 0"),
    ("state-dk", lambda: leapquant.WindowedState(METHOD, batch=1, d_k=0, d_v=4), "d_k must be"),
    ("state-float", lambda: leapquant.WindowedState(METHOD, batch=2.0, d_k=4, d_v=4), "got 2.0"),
    ("state-dtype", lambda: leapquant.WindowedState(METHOD, 1, 4, 4, dtype=torch.int32), "floating-point"),
    ("state-name", lambda: leapquant.WindowedState("int8", 1, 4, 4), "parse_method(name)"),
    ("patch-none", lambda: leapquant.patch(torch.nn.Linear(2, 2), None), "got NoneType"),
    ("patch-path", lambda: leapquant.patch("checkpoints/x"), "model must be a loaded transformers model"),
    ("bytes-dk", lambda: METHOD.bytes_per_element(0, 128), "d_k must be a whole number >= 1"),
    ("method-typo", lambda: leapquant.parse_method("leapqant-int8"), "did you mean 'leapquant-int8'"),
    (
        "checkpoint",
        lambda: leapquant.checkpoint_path("kimi-kda-hybrid"),
        "did you mean 'kimi-kda-hybrid-byte'",
    ),
    ("checkpoint-cut", lambda: leapquant.checkpoint_path("qwen35"), "one of 'qwen35-gdn-hybrid-byte', 'qwen"),
    ("device", lambda: resolve_device("tpu"), "unknown device 'tpu'"),
    ("device-gpu", lambda: resolve_device("cuda:99"), "CUDA"),
    ("trace-npy", lambda: leapquant.load_trace(ROOT / "README.md"), "not a readable .npz"),
]


@pytest.mark.parametrize(("call", "words"), [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_api_input_errors_name_the_problem(call, words):
    with pytest.raises(leapquant.LeapQuantError) as info:
        call()
    assert words in str(info.value) and "\n" not in str(info.value)


def test_save_trace_never_creates_folders(tmp_path):
    from test_cli import small_records

    with pytest.raises(leapquant.LeapQuantError, match="does not exist"):
        leapquant.save_trace(tmp_path / "new" / "t.npz", small_records())
    assert list(tmp_path.iterdir()) == []


def test_bench_generate_graphs_both_gives_a_row_pair_per_method(tmp_path, capsys):
    """``--graphs both``: each patched method once with per-layer graphs and once eager, beside one FP32 row,
    printed and in the JSON (it checks that the tool runs, not its times; on the GPU when there is one:
    transformers hands a CPU model to FLA's CUDA-only kernels where FLA is installed)."""
    out = tmp_path / "g.json"
    args = ["bench", "generate", "--device", KERNEL_DEVICE, "--batch", "2", "--prompt-tokens", "4"]
    assert main([*args, "--new-tokens", "3", "--repeats", "1", "--graphs", "both", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "leapquant-int8 (eager)" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["graphs"]) for r in rows] == [
        ("fp32", None),
        ("leapquant-int8", True),
        ("leapquant-int8", False),
    ]
