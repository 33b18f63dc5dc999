"""Every command through a table of bad inputs: exit status 2, one line on stderr that names the problem,
no traceback, and no file or folder created (the checks run before any work)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from leapquant import checks
from leapquant.cli.main import main
from leapquant.traces import save_trace

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A folder of good and bad inputs, the current folder during the test."""
    from test_cli import small_records

    save_trace(tmp_path / "t.npz", small_records())
    np.save(tmp_path / "x.npy", np.zeros(3))
    (tmp_path / "x.npy").rename(tmp_path / "npy.npz")  # a .npy under a .npz name
    np.save(tmp_path / "x.npy", np.zeros(3))
    garbage = bytes(range(256)) * 4  # not UTF-8, not a zip
    for name in ("garbage.npz", "garbage.json"):
        (tmp_path / name).write_bytes(garbage)
    for name in ("empty.npz", "empty.json", "empty.txt"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "broken.json").write_text('{"methods": ')
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "memory.json").write_text(json.dumps({"model": {"name": "m"}, "gpu_memory_gib": 80}))
    (tmp_path / "text.txt").write_text("def main():\n    pass\n")
    (tmp_path / "folder.npz").mkdir()
    (tmp_path / "folder.json").mkdir()
    (tmp_path / "no-config").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


T = "t.npz"
GONE = "gone/out"  # a folder that does not exist
MEM = ["memory", "--model", "qwen3.5-9b", "--gpu-memory", "8", "--context", "8"]
TRITON = "pip install 'leapquant[triton]'"
# (id, argv, words the one line must contain)
CASES = [
    ("no-command", [], "required: COMMAND"),
    ("unknown-command", ["simulat"], "invalid choice: 'simulat'"),
    ("unknown-option", ["methods", "--dkk", "4"], "unrecognized arguments: --dkk"),
    # simulate
    ("sim-npy", ["simulate", "x.npy", "-m", "int8"], "expected a .npz file, got .npy"),
    ("sim-npy-renamed", ["simulate", "npy.npz", "-m", "int8"], "single .npy array, not a .npz trace"),
    ("sim-garbage", ["simulate", "garbage.npz", "-m", "int8"], "not a readable .npz file"),
    ("sim-empty", ["simulate", "empty.npz", "-m", "int8"], "empty.npz: the file is empty"),
    ("sim-missing", ["simulate", "absent.npz", "-m", "int8"], "absent.npz: no such file"),
    ("sim-folder", ["simulate", "folder.npz", "-m", "int8"], "folder.npz: not a file"),
    ("sim-no-method", ["simulate", T], "required: --method/-m"),
    ("sim-method", ["simulate", T, "-m", "leapqant-int8"], "did you mean 'leapquant-int8'"),
    ("sim-option", ["simulate", T, "-m", "int8/w16+smoth"], "did you mean 'smooth'"),
    ("sim-json-dir", ["simulate", T, "-m", "int8", "--json", f"{GONE}.json"], "gone does not exist"),
    ("sim-json-ext", ["simulate", T, "-m", "int8", "--json", "r.txt"], "expected a .json file, got .txt"),
    ("sim-json-folder", ["simulate", T, "-m", "int8", "--json", "folder.json"], "is a folder"),
    ("sim-plot-ext", ["simulate", T, "-m", "int8", "--plot", "r.json"], "expected a .png or .pdf or .svg"),
    ("sim-checkpoints", ["simulate", T, "-m", "int8", "--checkpoints", "0"], "--checkpoints: must be >= 1"),
    ("sim-backend", ["simulate", T, "-m", "int8", "--backend", "cuda"], "invalid choice: 'cuda'"),
    ("sim-no-triton", ["simulate", T, "-m", "int8", "--backend", "triton"], TRITON),
    # synth
    ("synth-dir", ["synth", "--out", f"{GONE}.npz"], "the folder gone does not exist"),
    ("synth-file-parent", ["synth", "--out", "text.txt/x.npz"], "the folder text.txt does not exist"),
    ("synth-ext", ["synth", "--out", "x.npy"], "expected a .npz file, got .npy"),
    ("synth-tokens", ["synth", "--out", "s.npz", "--tokens", "0"], "--tokens: must be >= 1, got 0"),
    ("synth-streams", ["synth", "--out", "s.npz", "--streams", "-1"], "--streams: must be >= 1, got -1"),
    ("synth-dk", ["synth", "--out", "s.npz", "--dk", "abc"], "expected a whole number, got 'abc'"),
    ("synth-family", ["synth", "--out", "s.npz", "--family", "gdm"], "invalid choice: 'gdm'"),
    # methods
    ("methods-dk0", ["methods", "--dk", "0"], "--dk: must be >= 1, got 0"),
    ("methods-dk-neg", ["methods", "--dk", "-4"], "--dk: must be >= 1, got -4"),
    ("methods-dv", ["methods", "--dv", "1.5"], "expected a whole number, got '1.5'"),
    ("methods-json", ["methods", "--json", f"{GONE}.json"], "gone does not exist"),
    # demo
    ("demo-tokens", ["demo", "--tokens", "0"], "--tokens: must be >= 1"),
    ("demo-out-file", ["demo", "--out", "text.txt"], "exists and is not a folder"),
    ("demo-out-deep", ["demo", "--out", "gone/demo"], "the folder gone does not exist"),
    # eval (every check runs before the model loads)
    ("eval-device-gpu", ["eval", "--device", "cuda:99"], "CUDA"),
    ("eval-device", ["eval", "--device", "tpu"], "unknown device 'tpu'"),
    ("eval-model-name", ["eval", "--model", "qwen35-gdn-hybrid-bite"], "'qwen35-gdn-hybrid-byte'?"),
    ("eval-model-file", ["eval", "--model", "text.txt"], "expected a folder holding config.json"),
    ("eval-model-dir", ["eval", "--model", "no-config"], "the folder has no config.json"),
    ("eval-method", ["eval", "-m", "leapqant-int8"], "did you mean 'leapquant-int8'"),
    ("eval-generate", ["eval", "--generate", "int9"], "unknown format 'int9'"),
    ("eval-tokens", ["eval", "--tokens", "0"], "--tokens: must be >= 1"),
    ("eval-prefill", ["eval", "--prefill", "-3"], "--prefill: must be >= 1"),
    ("eval-json", ["eval", "--json", f"{GONE}.json"], "gone does not exist"),
    ("eval-json-ext", ["eval", "--json", "out.npz"], "expected a .json file"),
    ("eval-plot", ["eval", "--plot", f"{GONE}.png"], "gone does not exist"),
    ("eval-text", ["eval", "--text", "absent.txt"], "absent.txt: no such file"),
    ("eval-text-empty", ["eval", "--text", "empty.txt"], "the file is empty"),
    ("eval-no-triton", ["eval", "--backend", "triton"], TRITON),
    # eval-report
    ("report-garbage", ["eval-report", "garbage.json"], "not a text file (not UTF-8)"),
    ("report-empty", ["eval-report", "empty.json"], "the file is empty"),
    ("report-broken", ["eval-report", "broken.json"], "not valid JSON"),
    ("report-list", ["eval-report", "list.json"], "not a `leapquant eval` JSON report"),
    ("report-memory", ["eval-report", "memory.json"], "(a `leapquant memory` report)"),
    ("report-ext", ["eval-report", "garbage.npz"], "expected a .json file, got .npz"),
    ("report-merge", ["eval-report", "memory.json", "--merge", f"{GONE}.json"], "gone does not exist"),
    # trace
    ("trace-out", ["trace", "--out", f"{GONE}.npz"], "gone does not exist"),
    ("trace-ext", ["trace", "--out", "t.json"], "expected a .npz file, got .json"),
    ("trace-no-out", ["trace"], "required: --out"),
    ("trace-tokens", ["trace", "--out", "r.npz", "--tokens", "1"], "--tokens: must be >= 2"),
    ("trace-huge", ["trace", "--out", "r.npz", "--tokens", "100000"], "pass --allow-large"),
    ("trace-layers", ["trace", "--out", "r.npz", "--layers", "a,b"], "--layers must be comma-separated"),
    ("trace-device", ["trace", "--out", "r.npz", "--device", "cuda:99"], "CUDA"),
    ("trace-model", ["trace", "--out", "r.npz", "--model", "kimi-kda-hybrid"], "'kimi-kda-hybrid-byte'?"),
    # memory
    ("mem-model", [*MEM, "--model", "qwen3.5-9c"], "did you mean 'qwen3.5-9b'"),
    ("mem-gpu", [*MEM, "--gpu-memory", "0"], "> 0, got 0"),
    ("mem-ckpt-alone", [*MEM, "--checkpoint", "boundary"], "it needs --prefix-cache-interval"),
    ("mem-gpu-nan", [*MEM, "--gpu-memory", "nan"], "got nan"),
    ("mem-context", [*MEM, "--context", "-1"], "--context: must be >= 1"),
    ("mem-config", [*MEM, "--model", "garbage.json"], "not valid JSON"),
    ("mem-json", [*MEM, "--json", f"{GONE}.json"], "gone does not exist"),
    ("mem-method", [*MEM, "-m", "in8"], "unknown method 'in8'"),
    # bench
    ("kernel-variant", ["bench", "kernel", "-v", "leapqant-int8"], "did you mean 'leapquant-int8'"),
    ("kernel-family", ["bench", "kernel", "--family", "gdm"], "unknown family 'gdm'"),
    ("kernel-n", ["bench", "kernel", "--n", "0"], "--n must list positive numbers"),
    ("kernel-heads", ["bench", "kernel", "--heads", "0"], "--heads: must be >= 1"),
    ("kernel-json", ["bench", "kernel", "--json", f"{GONE}.json"], "gone does not exist"),
    ("decode-model", ["bench", "decode", "--model", "qwen3.5-9c", "--tiny"], "did you mean 'qwen3.5-9b'"),
    ("decode-batch", ["bench", "decode", "--batch", "0"], "expected positive numbers"),
    ("decode-backend", ["bench", "decode", "--backends", "leapqant-int8", "--tiny"], "'leapquant-int8'"),
    ("decode-repeats", ["bench", "decode", "--repeats", "0"], "--repeats: must be >= 1"),
    ("decode-markdown", ["bench", "decode", "--markdown", "out.txt"], "expected a .md file"),
    ("bench-report-garbage", ["bench", "report", "garbage.json"], "not a text file (not UTF-8)"),
    ("bench-report-memory", ["bench", "report", "memory.json"], "not a bench kernel report"),
    ("bench-report-ext", ["bench", "report", "garbage.npz"], "expected a .json file, got .npz"),
    ("bench-report-missing", ["bench", "report", "absent.json"], "absent.json: no such file"),
    ("roofline-copy", ["bench", "decode", "--roofline-only", "--copy-gbps", "-1"], "copy bandwidth must be"),
    ("roofline-gpu-run", ["bench", "decode", "--tiny", "--gemm-tflops", "9"], "apply to --roofline-only"),
    ("generate-model", ["bench", "generate", "--model", "kimi-kda-hybrid"], "'kimi-kda-hybrid-byte'?"),
    ("generate-method", ["bench", "generate", "-m", "leapqant-int8"], "did you mean 'leapquant-int8'"),
    ("generate-batch", ["bench", "generate", "--batch", "0"], "--batch: must be >= 1"),
    ("generate-tokens", ["bench", "generate", "--new-tokens", "1"], "--new-tokens: must be >= 2"),
    ("generate-json", ["bench", "generate", "--json", f"{GONE}.json"], "gone does not exist"),
    ("generate-graphs", ["bench", "generate", "--graphs", "yes"], "invalid choice: 'yes'"),
    # recall
    ("recall-model", ["recall", "--model", "kimi-kda-hybrid"], "'kimi-kda-hybrid-byte'?"),
    ("recall-distance", ["recall", "--model", "no-config"], "the folder has no config.json"),
    ("recall-distances", ["recall", "--distances", "0"], "--distances: must be >= 1"),
    ("recall-examples", ["recall", "--examples", "-1"], "--examples: must be >= 1"),
    ("recall-json", ["recall", "--json", f"{GONE}.json"], "gone does not exist"),
    ("recall-plot-ext", ["recall", "--plot", "out.json"], "expected a .png"),
    ("recall-device", ["recall", "--device", "tpu"], "unknown device 'tpu'"),
    ("recall-triton", ["recall", "--backend", "triton"], TRITON),
    ("recall-text", ["recall", "--text", "empty.txt"], "the file is empty"),
    ("recall-report-garbage", ["recall-report", "garbage.json"], "not a text file (not UTF-8)"),
    ("recall-report-missing", ["recall-report", "absent.json"], "absent.json: no such file"),
    ("recall-report-merge", ["recall-report", "memory.json", "--merge", f"{GONE}.json"], "gone does not"),
    # calibrate
    ("calibrate-no-out", ["calibrate"], "required: --out"),
    ("calibrate-out", ["calibrate", "--out", f"{GONE}.json"], "gone does not exist"),
    ("calibrate-ext", ["calibrate", "--out", "plan.npz"], "expected a .json file"),
    (
        "calibrate-model",
        ["calibrate", "--out", "p.json", "--model", "kimi-kda-hybrid"],
        "'kimi-kda-hybrid-byte'?",
    ),
    ("calibrate-tokens", ["calibrate", "--out", "p.json", "--tokens", "5"], "--tokens: must be >= 16"),
    ("calibrate-budget", ["calibrate", "--out", "p.json", "--budget", "-1"], "finite number > 0"),
    ("calibrate-text", ["calibrate", "--out", "p.json", "--text", "absent.txt"], "absent.txt: no such file"),
    ("calibrate-candidate", ["calibrate", "--out", "p.json", "-c", "int9"], "unknown format 'int9'"),
    ("calibrate-device", ["calibrate", "--out", "p.json", "--device", "tpu"], "unknown device 'tpu'"),
]


@pytest.mark.parametrize(("argv", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_touches_nothing(argv, words, workdir, capsys, monkeypatch):
    monkeypatch.setattr(checks, "_triton_installed", lambda: False)  # as after the quick-start install
    before = _tree(workdir)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("leapquant: error: ") and words in lines[0], lines[0]
    assert "Traceback" not in out + err
    assert _tree(workdir) == before


def test_the_installed_command_prints_one_line(workdir):
    """The real entry point, in its own process: one line, status 2, nothing else (no library noise)."""
    run = subprocess.run(
        [sys.executable, "-m", "leapquant", "simulate", "npy.npz", "-m", "int8"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == [
        "leapquant: error: trace npy.npz: holds a single .npy array, not a .npz trace (see save_trace)"
    ]
