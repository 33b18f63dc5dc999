"""The command line: simulate, synth, methods, demo, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from leapquant.cli.main import main
from leapquant.recurrences.records import Records
from leapquant.traces.io import load_trace, save_trace

REPORT_KEYS = {"output_rel_err", "state_rel_err", "final_state_rel_err", "bytes_per_element"}


def small_records(streams=2, steps=40, d_k=8, d_v=6, seed=0) -> Records:
    g = torch.Generator().manual_seed(seed)
    key = torch.nn.functional.normalize(
        torch.randn(streams, steps, d_k, generator=g, dtype=torch.float64), dim=-1
    )
    a = torch.full((streams, steps, d_k), 0.99, dtype=torch.float64)
    return Records(
        a=a,
        k=0.5 * key,
        b=a * key,
        v=torch.randn(streams, steps, d_v, generator=g, dtype=torch.float64),
        q=torch.randn(streams, steps, d_k, generator=g, dtype=torch.float64),
    )


@pytest.fixture
def trace_path(tmp_path):
    return save_trace(tmp_path / "t.npz", small_records(), meta={"note": "test"})


def test_trace_round_trip(tmp_path):
    rec = small_records()
    s0 = torch.randn(2, 8, 6, dtype=torch.float64)
    path = save_trace(tmp_path / "x.npz", rec, s0, {"model": "m"})
    trace = load_trace(path)
    assert torch.equal(trace.records.k, rec.k) and torch.equal(trace.initial_state, s0)
    assert trace.meta == {"model": "m"} and trace.streams == 2


def test_single_stream_round_trip_and_an_upper_case_suffix(tmp_path):
    """A single stream's records are 2-D: saved as such beside a 3-D S0, they did not load back; and numpy
    wrote X.NPZ to X.NPZ.npz."""
    rec = small_records(streams=1)
    rec = Records(a=rec.a[0], k=rec.k[0], b=rec.b[0], v=rec.v[0], q=rec.q[0])
    s0 = torch.randn(8, 6, dtype=torch.float64)
    path = save_trace(tmp_path / "X.NPZ", rec, s0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["X.NPZ"]
    trace = load_trace(path)
    assert torch.equal(trace.records.k[0], rec.k) and torch.equal(trace.initial_state[0], s0)


def test_simulate_keeps_traces_of_one_name_apart(tmp_path, capsys):
    """a/t.npz and b/t.npz were both 't': the second overwrote the first in per_trace."""
    for folder, seed in (("a", 0), ("b", 1)):
        (tmp_path / folder).mkdir()
        save_trace(tmp_path / folder / "t.npz", small_records(seed=seed))
    paths = [str(tmp_path / f / "t.npz") for f in "ab"]
    out = tmp_path / "r.json"
    assert main(["simulate", *paths, "-m", "int8", "--quiet", "--json", str(out)]) == 0
    per_trace = json.loads(out.read_text())["methods"]["int8"]["per_trace"]
    assert sorted(per_trace) == paths and len({r["output_rel_err"] for r in per_trace.values()}) == 2
    assert main(["simulate", paths[0], paths[0], "-m", "int8", "--quiet"]) == 2
    assert "more than one trace is named" in capsys.readouterr().err


def test_simulate_says_what_it_cannot_measure(tmp_path, capsys):
    """A window longer than the trace has no boundary in it (a warning); a trace whose exact recurrence
    overflows has no reference (an error, where the table showed nan and the JSON bare NaN tokens); a
    trace that emits nothing has no output error (n/a and null, not 0)."""
    trace = save_trace(tmp_path / "t.npz", small_records())
    out = tmp_path / "r.json"
    assert main(["simulate", str(trace), "-m", "int8/w64", "--quiet", "--json", str(out)]) == 0
    assert "window 64 is longer than trace t's 40 records" in capsys.readouterr().out
    assert json.loads(out.read_text())["warnings"]
    rec = small_records()
    huge = Records(a=rec.a * 0 + 1, k=rec.k * 1e160, b=rec.b * 0, v=rec.v * 1e160, q=rec.q)
    assert main(["simulate", str(save_trace(tmp_path / "h.npz", huge)), "-m", "int8", "--quiet"]) == 2
    assert "exact recurrence overflows" in capsys.readouterr().err
    silent = Records(a=rec.a, k=rec.k, b=rec.b, v=rec.v, q=rec.q, emit=torch.zeros(40, dtype=torch.bool))
    path = save_trace(tmp_path / "s.npz", silent)
    assert main(["simulate", str(path), "-m", "int8", "--quiet", "--json", str(out)]) == 0
    assert "n/a" in capsys.readouterr().out
    assert json.loads(out.read_text())["methods"]["int8"]["output_rel_err"] is None
    # values all zero: no reference state either, and the plot skips those points (it raised on None)
    zero = save_trace(tmp_path / "z.npz", Records(a=rec.a, k=rec.k, b=rec.b, v=rec.v * 0, q=rec.q))
    plot = tmp_path / "z.png"
    argv = ["simulate", str(zero), "-m", "int8", "--quiet", "--json", str(out), "--plot", str(plot)]
    assert main(argv) == 0
    assert json.loads(out.read_text())["methods"]["int8"]["final_state_rel_err"] is None and plot.is_file()


def test_single_stream_trace_without_stream_axis(tmp_path):
    rec = small_records(streams=1)
    np.savez(tmp_path / "one.npz", **{n: getattr(rec, n)[0].numpy() for n in "akbvq"})
    trace = load_trace(tmp_path / "one.npz")
    assert trace.streams == 1 and trace.records.steps == 40


def test_simulate_json_has_the_documented_keys(trace_path, tmp_path, capsys):
    out = tmp_path / "r.json"
    plot = tmp_path / "r.png"
    methods = ["-m", "fp32", "-m", "int8", "-m", "leapquant-int8"]
    outputs = ["--json", str(out), "--plot", str(plot), "--quiet", "--checkpoints", "4"]
    code = main(["simulate", str(trace_path), *methods, *outputs])
    assert code == 0
    report = json.loads(out.read_text())
    assert set(report["methods"]) == {"fp32", "int8", "leapquant-int8"}
    for row in report["methods"].values():
        assert set(row) >= REPORT_KEYS
        assert all(len(p) == 2 for p in row["state_rel_err"])
        assert row["state_rel_err"][-1][0] == 40
    assert report["methods"]["fp32"]["output_rel_err"] < 1e-12
    assert report["methods"]["int8"]["output_rel_err"] > 1e-4
    # d_k=8, d_v=6: int8 payload + 6 fp32 value scales + 8 fp32 smoothing scales + 4 fp16 tokens of 8+6
    assert report["methods"]["leapquant-int8"]["bytes_per_element"] == pytest.approx(
        1 + (4 * 6 + 4 * 8 + 4 * (8 + 6) * 2) / 48
    )
    assert plot.stat().st_size > 10_000
    assert "leapquant-int8" in capsys.readouterr().out


def write_npz(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def bad_traces(tmp_path):
    rec = small_records()
    good = {n: getattr(rec, n).numpy() for n in "akbvq"}
    nan = dict(good, v=good["v"].copy())
    nan["v"][1, 3, 2] = np.nan
    return [
        ("missing", write_npz(tmp_path / "m.npz", **{n: good[n] for n in "akvq"}), "missing array(s) b"),
        ("shape", write_npz(tmp_path / "s.npz", **dict(good, q=good["q"][:, :, :5])), "q has shape"),
        ("nan", write_npz(tmp_path / "n.npz", **nan), "NaN or Inf at index (1, 3, 2)"),
        ("int", write_npz(tmp_path / "i.npz", **dict(good, a=np.ones((2, 40, 8), dtype=np.int32))), "dtype"),
        ("s0", write_npz(tmp_path / "z.npz", **dict(good, S0=np.zeros((2, 6, 8)))), "S0 has shape"),
        ("notnpz", str(tmp_path / "t.txt"), "expected a .npz file, got .txt"),
        ("nofile", str(tmp_path / "absent.npz"), "no such file"),
        # FLA's log decay g stored as a: the state was wiped every step and the errors looked excellent
        ("logdecay", write_npz(tmp_path / "g.npz", **dict(good, a=np.log(good["a"]))), "store a = exp(g)"),
        ("growth", write_npz(tmp_path / "x.npz", **dict(good, a=good["a"] + 0.1)), "decays a must lie in"),
    ]


BAD_TRACE_IDS = ["missing", "shape", "nan", "int", "s0", "notnpz", "nofile", "logdecay", "growth"]


@pytest.mark.parametrize("case", range(len(BAD_TRACE_IDS)), ids=BAD_TRACE_IDS)
def test_malformed_trace_gives_one_line_error(case, tmp_path, capsys):
    (tmp_path / "t.txt").write_text("not a trace")
    _, path, message = bad_traces(tmp_path)[case]
    assert main(["simulate", path, "-m", "int8", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err and err.startswith("leapquant: error:")


@pytest.mark.parametrize(
    ("method", "message"), [("int9", "unknown format 'int9'"), ("int8/w16+foo", "unknown option +foo")]
)
def test_unknown_method_gives_one_line_error(trace_path, capsys, method, message):
    assert main(["simulate", str(trace_path), "-m", method, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err


def test_methods_lists_leapquant_int8_at_1_19(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "leapquant-int8" in x)
    assert "1.1875" in line


def test_synth_then_simulate(tmp_path):
    out = tmp_path / "kda.npz"
    assert (
        main(
            [
                "synth",
                "--family",
                "kda",
                "--streams",
                "2",
                "--tokens",
                "64",
                "--dk",
                "16",
                "--dv",
                "8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    trace = load_trace(out)
    assert trace.records.k.shape == (2, 64, 16) and trace.meta["family"] == "kda"


def test_demo_runs_as_a_module(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "leapquant",
            "demo",
            "--tokens",
            "96",
            "--streams",
            "1",
            "--out",
            str(tmp_path),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "demo.json").read_text())
    assert "leapquant-int8" in report["methods"] and (tmp_path / "demo.png").exists()


def test_simulate_triton_backend_agrees_with_reference(tmp_path):
    """``--backend triton`` replays through the decode kernels (interpreted here) and must agree."""
    trace = tmp_path / "gdn.npz"
    assert (
        main(["synth", "--streams", "2", "--tokens", "40", "--dk", "16", "--dv", "32", "--out", str(trace)])
        == 0
    )
    methods = ["-m", "fp32", "-m", "int8", "-m", "leapquant-int8", "-m", "int4/w8+ct8+smooth"]
    reports = {}
    for backend in ("reference", "triton"):
        out = tmp_path / f"{backend}.json"
        assert (
            main(["simulate", str(trace), *methods, "--backend", backend, "--quiet", "--json", str(out)]) == 0
        )
        reports[backend] = json.loads(out.read_text())["methods"]
    assert reports["triton"]["fp32"]["output_rel_err"] < 1e-5
    for m in ("int8", "leapquant-int8", "int4/w8+ct8+smooth"):
        ref, ker = reports["reference"][m]["output_rel_err"], reports["triton"][m]["output_rel_err"]
        assert abs(ker - ref) < 0.2 * ref, (m, ref, ker)


def test_simulate_triton_backend_refuses_methods_without_kernels(trace_path, capsys):
    assert main(["simulate", str(trace_path), "-m", "mxfp4/w16", "--backend", "triton", "--quiet"]) == 2
    assert "no kernel" in capsys.readouterr().err
    # the per-step kernels on heads they cannot tile: a Triton traceback before; now refused up front
    assert main(["simulate", str(trace_path), "-m", "int8", "--backend", "triton", "--quiet"]) == 2
    assert "d_v=6 is not a power of two" in capsys.readouterr().err


@pytest.mark.parametrize("variant", ["nonsense", "int8"])
def test_bench_kernel_refuses_a_tune_variant_without_a_pool(variant, capsys):
    """``--tune-variant`` names the pool method the launch shapes are timed on; anything else is refused
    before any timing (on any machine)."""
    assert main(["bench", "kernel", "--tune", "close", "--tune-variant", variant]) == 2
    err = capsys.readouterr().err
    assert f"--tune-variant {variant!r}: not a pool method" in err


def test_bench_report_rebuilds_the_benchmark_tables_from_a_shipped_run(capsys, tmp_path):
    """``bench report`` turns a shipped ``bench kernel`` JSON into BENCHMARKS.md's tables (the numbers the
    README quotes) and the plot, and shows the profiled steps of a ``--breakdown`` run."""
    results = Path(__file__).resolve().parents[1] / "results"
    assert (
        main(["bench", "report", str(results / "kernel-h200-1646.json"), "--plot", str(tmp_path / "k.png")])
        == 0
    )
    text = capsys.readouterr().out
    assert "| `leapquant-int8` | 313 | 107 | 2.32x | 364 | 128 | 1.82x |" in text
    assert "**Window / rank sweep (paper Table 3)**" in text and (tmp_path / "k.png").stat().st_size > 0
    assert main(["bench", "report", str(results / "kernel-breakdown-h200-1645.json")]) == 0
    text = capsys.readouterr().out
    assert "**Profiled steps**" in text and "| close_kernel (stream 7) | 202.2 | 40.9 - 243.1 |" in text
    # launches summed per stream in that file's form: the other heads' step lasts 281 us a launch
    assert "| step_tc_kernel (stream 175) | 281.3 | 20.7 - 302.0 |" in text
    # a run at another batch size than --n: its variants stay in the batch-size tables, the shape is the run's
    assert main(["bench", "report", str(results / "kernel-h200-n128-0251.json")]) == 0
    text = capsys.readouterr().out
    assert "(no rows at N=512; the run has N=128)" in text and "HV=32, K=128, V=128" in text
    assert "| `int8/w16` | 3.56x |" in text and "| `leapquant-int8:triton-close` | 1.04x |" in text


def test_bench_report_shows_each_launch_of_a_profiled_step(capsys, tmp_path):
    """A ``--breakdown`` row of today's form (launches told apart by order) in ``bench report``'s table."""
    results = Path(__file__).resolve().parents[1] / "results"
    report = json.loads((results / "kernel-h200-1646.json").read_text())
    row = next(r for r in report["rows"] if r["variant"] == "leapquant-int8" and r["n"] == 512)
    close = {"kernel": "close_kernel", "launch": 1, "streams": [7], "us": 202.2, "start_us": 40.9,
             "end_us": 243.1}  # fmt: skip
    others = {"kernel": "step_tc_kernel", "launch": 2, "streams": [175, 176], "us": 281.0, "start_us": 21.0,
              "end_us": 302.0}  # fmt: skip
    row["breakdown"] = {"mode": "graph", "steps": 4, "span_us": 301.6, "kernels": [close, others]}
    path = tmp_path / "bd.json"
    path.write_text(json.dumps(report))
    assert main(["bench", "report", str(path)]) == 0
    text = capsys.readouterr().out
    assert f"| {row['family']} | 512 | `leapquant-int8` | graph | 301.6 | close_kernel (1) | 202.2 |" in text
    assert "|  | | | | | step_tc_kernel (2) | 281.0 | 21.0 - 302.0 |" in text


def test_bench_report_names_a_file_that_is_not_a_report(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": 3}')
    assert main(["bench", "report", str(bad)]) == 2
    assert "not a bench kernel report" in capsys.readouterr().err
    assert main(["bench", "report", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_simulate_counts_one_decay_a_record_for_gdn_and_one_per_channel_for_kda():
    """A GDN trace stores its scalar decay expanded over the key channels; its record buffer still holds one
    decay a record, as the pool does (``MethodConfig.record_buffer_bytes``)."""
    from leapquant.eval.simulate import simulate
    from leapquant.methods import parse_method
    from leapquant.traces.synth import SynthConfig, synthesize

    cfg = parse_method("leapquant-int8")
    for family, decays in (("gdn", 1), ("kda", 16)):
        trace = synthesize(SynthConfig(family=family, streams=2, tokens=40, d_k=16, d_v=8, seed=3))
        report = simulate([trace], ["leapquant-int8"], checkpoints=2)
        got = report["methods"]["leapquant-int8"]["record_buffer_bytes_per_head"]
        assert got == cfg.record_buffer_bytes(16, 8, decays), family
    assert cfg.record_buffer_bytes(16, 8, 1) < cfg.record_buffer_bytes(16, 8, 16)


def test_provenance_names_the_commit_of_a_checkout():
    """Every results file carries the git commit it was made at (and whether the package's code differed
    from it); an installed wheel, which has no checkout, says so with None."""
    import re

    import leapquant
    from leapquant.eval.provenance import provenance

    info = provenance()
    if (Path(leapquant.__file__).resolve().parents[1] / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{40}", info["git_commit"]) and isinstance(info["git_dirty"], bool)
    else:
        assert info["git_commit"] is None and info["git_dirty"] is None


def test_version_and_a_reader_that_leaves_early(capsys):
    """``--version`` is answered (main's docstring promised it), and ``leapquant methods | head -1`` ends
    without a BrokenPipeError traceback."""
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("leapquant ")
    code = "import sys; from leapquant.cli.main import main; sys.exit(main(['methods']))"
    pipe = subprocess.run(
        f'{sys.executable} -c "{code}" | head -c 10', shell=True, capture_output=True, text=True, check=True
    )
    assert len(pipe.stdout) == 10 and "Traceback" not in pipe.stderr and "BrokenPipe" not in pipe.stderr


@pytest.mark.parametrize("method", ["leapquant-int8", "int8"], ids=["pool", "per-step"])
def test_simulate_api_with_triton_on_cpu_tensors_without_the_interpreter_is_refused(
    tmp_path, method, monkeypatch
):
    """``simulate(..., backend="triton")`` from Python ran the torch reference where Triton could not run
    and still reported ``backend: triton``; the kernels' device check now refuses it."""
    from leapquant.errors import LeapQuantError
    from leapquant.eval.simulate import simulate
    from leapquant.traces.io import load_trace

    trace = tmp_path / "t.npz"
    assert (
        main(["synth", "--streams", "1", "--tokens", "8", "--dk", "16", "--dv", "16", "--out", str(trace)])
        == 0
    )
    if torch.cuda.is_available():
        pytest.skip("simulate runs its kernels on the GPU here")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(LeapQuantError, match="the kernels take CUDA tensors"):
        simulate([load_trace(trace)], [method], backend="triton")
