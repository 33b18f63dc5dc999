"""The residual-format table is the one source of layout and kernel facts: every consumer agrees with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from leapquant.errors import LeapQuantError
from leapquant.formats.residual import CUDA_CLOSE_RESIDUALS, PER_STEP_RESIDUALS, RESIDUAL_FORMATS
from leapquant.methods import MethodConfig
from leapquant.ops import LeapQuantPool, PoolConfig, pool_unsupported
from leapquant.ops.leapquant_decode.close_cuda import SOURCE, compile_options, unsupported
from leapquant.ops.per_step_decode import PerStepPool, per_step_unsupported
from leapquant.plan import load_shape
from leapquant.plan.memory import state_layout

NAMES = tuple(RESIDUAL_FORMATS)


@pytest.mark.parametrize("name", NAMES)
def test_the_pool_lays_out_what_the_table_says(name):
    row = RESIDUAL_FORMATS[name]
    cfg = PoolConfig(MethodConfig(name, window=4, compensators=2, smoothing=True), heads=3, d_k=32, d_v=16)
    pool = LeapQuantPool.allocate(cfg, 2)
    assert pool.payload.dtype == row.payload_dtype
    assert pool.payload.shape == (2, 3, 16, 32 // row.keys_per_element)
    assert ("scale" in pool.tensors) == row.scaled
    assert cfg.packed == row.packed


@pytest.mark.parametrize("name", NAMES)
def test_scales_and_codes_follow_the_state_format(name):
    row = RESIDUAL_FORMATS[name]
    fmt = row.state_format
    if row.scaled:  # per value channel of a [d_k, d_v] state: its columns
        assert fmt.granularity == "col"
        assert row.qmax == fmt.element.max_value
    else:
        assert row.qmax is None
    # formats share a kernel code only when they share its code path: same payload dtype and packing
    for other in RESIDUAL_FORMATS.values():
        if other.code == row.code:
            assert (other.payload_dtype, other.keys_per_element) == (row.payload_dtype, row.keys_per_element)


@pytest.mark.parametrize("name", NAMES)
def test_the_cuda_close_takes_the_formats_the_table_gives_it(name):
    cfg = PoolConfig(MethodConfig(name, window=16, compensators=4, smoothing=True), heads=32)
    reason = unsupported(cfg)
    assert (reason is None) == (name in CUDA_CLOSE_RESIDUALS)
    if reason is None:
        assert f"-DLQ_RESIDUAL={RESIDUAL_FORMATS[name].code}" in compile_options(cfg)
    else:
        assert name in reason


def test_close_cu_branches_only_on_codes_the_table_gives_the_cuda_close():
    codes = {int(c) for c in re.findall(r"LQ_RESIDUAL == (\d+)", SOURCE.read_text())}
    assert codes <= {RESIDUAL_FORMATS[n].code for n in CUDA_CLOSE_RESIDUALS}


@pytest.mark.parametrize("name", NAMES)
def test_per_step_pools_exist_exactly_for_the_per_step_formats(name):
    row = RESIDUAL_FORMATS[name]
    method = MethodConfig(name)
    if name in PER_STEP_RESIDUALS:
        assert per_step_unsupported(method) is None
        pool = PerStepPool.allocate(name, 2, 3, 8, 4)
        assert pool.state.dtype == row.payload_dtype
        assert (pool.scale is not None) == row.scaled
    else:
        assert name in per_step_unsupported(method)
        with pytest.raises(LeapQuantError, match="per-step pool"):
            PerStepPool.allocate(name, 2, 3, 8, 4)
    codes = [RESIDUAL_FORMATS[n].per_step_code for n in PER_STEP_RESIDUALS]
    assert len(set(codes)) == len(codes)


@pytest.mark.parametrize("name", NAMES)
def test_the_planner_counts_the_table_layout(name):
    shape = load_shape("qwen3.5-9b")
    kind, specs = state_layout(shape, MethodConfig(name, window=16, compensators=4, smoothing=True), 2)
    row = RESIDUAL_FORMATS[name]
    assert kind == "pool"  # every residual format has a pool, counted by its tensors (int6: a byte a code)
    payload = dict((n, (s, d)) for n, s, d in specs)["payload"]
    assert payload[1] == str(row.payload_dtype).removeprefix("torch.")
    if name in PER_STEP_RESIDUALS:
        kind, specs = state_layout(shape, MethodConfig(name), 2)
        assert kind == "per-step" and specs[0][2] == str(row.payload_dtype).removeprefix("torch.")
        assert len(specs) == (2 if row.scaled else 1)


def test_methods_without_a_kernel_are_refused_with_the_kernel_formats_named():
    reason = pool_unsupported(MethodConfig("mxfp4", window=16))
    assert all(n in reason for n in NAMES)
    with pytest.raises(LeapQuantError, match="no kernel for method 'mxfp4/w16'"):
        PoolConfig(MethodConfig("mxfp4", window=16), heads=1)


def test_no_module_keeps_its_own_residual_table():
    """Format facts live in formats/residual.py; another dict or tuple literal keyed by residual names is a
    second table that can drift."""
    root = Path(__file__).resolve().parents[1] / "leapquant"
    name = r'"(?:int8|int6|int4|fp8-e4m3)"'
    literal = re.compile(rf"^\s*{name}\s*:|[{{(]\s*{name}\s*[:,]\s*{name}|in \({name}")
    found = []
    for path in root.rglob("*.py"):
        # formats/ defines the formats themselves; methods/ lists the paper's baselines by name; the planner's
        # DTYPE_BYTES is keyed by torch dtype names (it must not import torch)
        if (
            path.parent.name in ("formats", "methods")
            or path.relative_to(root).as_posix() == "plan/memory.py"
        ):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if literal.search(line):
                found.append(f"{path.relative_to(root)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_table_rows_are_torch_dtypes():
    for row in RESIDUAL_FORMATS.values():
        assert isinstance(row.payload_dtype, torch.dtype)
