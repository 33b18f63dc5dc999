"""scripts/train_checkpoints.py: the full configs fit in 15 MiB; the CPU smoke trains, saves and reloads."""

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")


SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_checkpoints.py"


@pytest.fixture(scope="module")
def tc():
    if sys.modules.get("fla") is not None:
        pytest.skip("fla already imported in this process: the script refuses to run then")
    spec = importlib.util.spec_from_file_location("train_checkpoints", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("arch", ["qwen35", "kimi"])
def test_full_config_fits_and_has_real_heads(tc, arch):
    model = tc.build_model(arch, tiny=False)
    cfg = model.config
    n = tc.param_count(model)
    assert n > 5_000_000 and 2 * n + (1 << 16) < 15 * 2**20  # bf16 payload + safetensors header
    assert cfg.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert cfg.vocab_size == tc.VOCAB == 259
    if arch == "qwen35":
        assert (cfg.linear_key_head_dim, cfg.linear_value_head_dim) == (128, 128)
        assert cfg.linear_num_value_heads == 2 * cfg.linear_num_key_heads == 4
    else:
        assert cfg.linear_head_dim == 128 and cfg.linear_num_heads == 4
        assert set(cfg.mlp_layer_types) == {"dense"}
    init = tc.init_gates(model)
    decays = [d for layer in init.values() for d in layer]
    assert len(decays) == 24
    assert sum(d >= 0.99 for d in decays) == 12  # half of the heads start with long memory
    assert all(0.3 < d < 0.9995 for d in decays)
    for i, mod in tc.linear_layers(model):  # the layer's own formula at zero input gives the reported decays
        heads = len(init[str(i)])
        a, dt = mod.A_log.float().flatten().exp(), F.softplus(mod.dt_bias.float().view(heads, -1))
        decay = torch.exp(-a[:, None] * dt).mean(-1)
        assert torch.allclose(decay, torch.tensor(init[str(i)]), atol=1e-4)


def test_torch_path_is_forced(tc):
    assert sys.modules["fla"] is None and sys.modules["causal_conv1d"] is None
    names = tc.check_torch_paths()
    assert "modeling_qwen3_5.torch_chunk_gated_delta_rule" in names
    assert "modeling_kimi_linear.chunk_kimi_delta_attention" in names


def test_band_spans_long_and_short(tc):
    assert math.isclose(tc.band(0.0), 1e-3) and math.isclose(tc.band(0.5), 1e-2)
    assert math.isclose(tc.band(0.999999), 1.0, rel_tol=1e-4)


def test_cpu_smoke_trains_saves_and_reloads(tc, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reports = tc.main(["--device", "cpu", "--tiny", "--max-steps", "2", "--out", str(tmp_path)])
    assert set(reports) == {"qwen35", "kimi"}
    for arch, report in reports.items():
        out = tmp_path / report["name"]
        files = {p.name for p in out.iterdir()}
        expected = {"config.json", "model.safetensors", "tokenizer_config.json", "README.md"}
        expected.add("decay_stats.json")
        assert expected <= files
        stats = json.loads((out / "decay_stats.json").read_text())
        assert stats["train"]["steps"] == 2 and stats["data"]["train_bytes"] > 0
        assert len(stats["decay"]) == 6 and all(0 < row["p50"] < 1 for row in stats["decay"])
        assert 0 < stats["bpb"]["site_packages_holdout"] < 9 and 0 < stats["bpb"]["stdlib_sample"] < 9
        assert "bits per byte" in (out / "README.md").read_text()
        model = AutoModelForCausalLM.from_pretrained(out)
        assert type(model).__name__ == ("Qwen3_5ForCausalLM" if arch == "qwen35" else "KimiLinearForCausalLM")
        assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
        tok = AutoTokenizer.from_pretrained(out)
        text = "def f(x):\n    return 'é</s>🐍'\n"
        ids = tok(text, return_tensors="pt").input_ids  # no special token added, none matched in the text
        assert ids[0].tolist() == [b + 3 for b in text.encode()] and tok.decode(ids[0]) == text
        gen = model.generate(ids, max_new_tokens=4, do_sample=False)
        assert gen.shape == (1, ids.shape[1] + 4)


def test_recall_training_halves_the_batch_when_memory_runs_out(tc, monkeypatch):
    """scripts/train_recall.py: a step that runs out of GPU memory is dropped and the batch halved, and
    training goes on at the smaller batch (a large batch costs little time on the launch-bound torch path)."""
    spec = importlib.util.spec_from_file_location("train_recall", SCRIPT.with_name("train_recall.py"))
    tr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tr)
    model = tr.build("gdn-tiny")
    args = tr.parse_args(["--out", "unused", "--device", "cpu", "--seq", "256", "--batch", "4", "--max-steps",
                          "3", "--min-distance", "8", "--max-distance", "16", "--minutes", "5"])  # fmt: skip
    corpus = torch.randint(3, 200, (20_000,), dtype=torch.uint8)
    forward, calls, batches = model.forward, [0], []

    def forward_that_fails_once(*a, **kw):
        calls[0] += 1
        batches.append(kw["input_ids"].shape[0])
        if calls[0] == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return forward(*a, **kw)

    monkeypatch.setattr(model, "forward", forward_that_fails_once)
    lines = []
    report = tr.train(model, corpus, args, torch.device("cpu"), lines.append)
    assert "  out of memory at step 2: batch now 2" in lines
    assert batches == [4, 4, 2, 2] and report["steps"] == 3 and report["micro_batch"] == 2
    assert report["tokens"] == 256 * (4 + 2 + 2)


@pytest.mark.parametrize(
    ("kernels", "device", "message"),
    [
        ("triton", "cpu", "LEAPQUANT_TRAIN_KERNELS must be one of torch, fla, fla-kda, got 'triton'"),
        ("fla", "cpu", "LEAPQUANT_TRAIN_KERNELS=fla needs a CUDA GPU"),
        ("fla-kda", "cpu", "LEAPQUANT_TRAIN_KERNELS=fla-kda needs a CUDA GPU"),
    ],
    ids=["unknown", "fla-without-gpu", "fla-kda-without-gpu"],
)
def test_training_kernels_setting_is_checked(tmp_path, kernels, device, message):
    """FLA joins the training path only on request and only where its kernels can be measured first; an
    unknown setting is refused before anything loads."""
    import subprocess

    script = SCRIPT.parent / "train_recall.py"
    env = dict(os.environ, LEAPQUANT_TRAIN_KERNELS=kernels)
    run = subprocess.run(
        [sys.executable, str(script), "--model", "gdn-tiny", "--device", device, "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode != 0
    assert message in run.stderr, run.stderr[-2000:]
