"""Per-step decode kernels (fp32/bf16/int8 baselines) against their reference and the simulator's method."""

from __future__ import annotations

import pytest
import torch

from leapquant import LeapQuantError
from leapquant.methods.config import parse_method
from leapquant.methods.window import WindowedState
from leapquant.ops.leapquant_decode.naive import native_to_general
from leapquant.ops.per_step_decode import PerStepPool, per_step_decode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
K, V = (128, 128) if DEVICE == "cuda" else (16, 32)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("family", ["gdn", "kda"])
def test_per_step_kernel_matches_the_window_one_method(fmt, family):
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    n, h, hv = 3, 1, 2
    pools = {b: PerStepPool.allocate(fmt, 5, hv, K, V, DEVICE) for b in ("triton", "reference")}
    slots = torch.tensor([3, -1, 0], dtype=torch.int32, device=DEVICE)
    real = slots >= 0
    s0 = torch.randn(n, hv, K, V, generator=gen, device=DEVICE)
    for pool in pools.values():
        pool.load(slots[real], s0[real])
    method = WindowedState(parse_method(fmt), int(real.sum()) * hv, K, V, dtype=torch.float64, device=DEVICE)
    method.load(pools["reference"].materialize(slots[real]).double().reshape(-1, K, V))
    for _ in range(6):
        q, k = (torch.randn(n, h, K, generator=gen, device=DEVICE) for _ in range(2))
        v = torch.randn(n, hv, V, generator=gen, device=DEVICE)
        g_shape = (n, hv, K) if family == "kda" else (n, hv)
        g = -0.05 * torch.rand(g_shape, generator=gen, device=DEVICE)
        beta = torch.rand(n, hv, generator=gen, device=DEVICE)
        outs = {b: per_step_decode(p, slots, q, k, v, g, beta, backend=b) for b, p in pools.items()}
        assert torch.equal(outs["triton"][~real], torch.zeros_like(outs["triton"][~real]))
        gg, kw, b, vv, qq = (x[real].double() for x in native_to_general(q, k, v, g, beta))
        a = gg.exp() if family == "kda" else gg.exp()[..., None].expand(-1, -1, K)
        expected = method.step(*(x.reshape(-1, x.shape[-1]) for x in (a, kw, b, vv, qq)))
        for o in outs.values():
            err = (o[real].double().reshape(-1, V) - expected).norm() / expected.norm()
            assert err < (1e-5 if fmt == "fp32" else 2e-3)
    diff = pools["triton"].materialize(slots[real]) - pools["reference"].materialize(slots[real])
    scale = pools["reference"].materialize(slots[real]).abs().max()
    assert float(diff.abs().max()) <= (1e-5 if fmt == "fp32" else 0.02) * float(scale)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("slot-out-of-range", "must be in"),
        ("slot-twice", "appears twice"),
        ("v-too-short", "v has shape"),
        ("g-per-key-of-other-size", "g has shape"),
    ],
)
def test_bad_input_is_rejected_before_the_pool_changes(case, message, backend):
    """The per-step kernel writes every slot it is given in place: bad slots or shapes fail first."""
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    pool = PerStepPool.allocate("int8", 3, 2, K, V, DEVICE)
    pool.load(torch.arange(3, device=DEVICE), torch.randn(3, 2, K, V, generator=gen, device=DEVICE))
    before = pool.state.clone(), pool.scale.clone()
    slots = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    q, k = (torch.randn(2, 1, K, generator=gen, device=DEVICE) for _ in range(2))
    v = torch.randn(2, 2, V, generator=gen, device=DEVICE)
    g = -0.05 * torch.rand(2, 2, generator=gen, device=DEVICE)
    beta = torch.rand(2, 2, generator=gen, device=DEVICE)
    if case == "slot-out-of-range":
        slots = torch.tensor([3, 0], dtype=torch.int32, device=DEVICE)
    elif case == "slot-twice":
        slots = torch.tensor([0, 0], dtype=torch.int32, device=DEVICE)
    elif case == "v-too-short":
        v = v[..., :-1]
    else:
        g = torch.zeros(2, 2, K + 1, device=DEVICE)
    with pytest.raises(LeapQuantError, match=message):
        per_step_decode(pool, slots, q, k, v, g, beta, backend=backend)
    assert torch.equal(pool.state, before[0]) and torch.equal(pool.scale, before[1])
