"""Records of every family, replayed through the exact recurrence, reproduce the family's native reference."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from leapquant.errors import LeapQuantError
from leapquant.recurrences import (
    CONSTANT_SCALAR,
    DATA_SCALAR,
    DATA_VECTOR,
    IDENTITY,
    NATIVE_REFERENCES,
    RECURRENCE_INFO,
    RECURRENCES,
    Records,
    decay_kind,
    deltanet_records,
    deltaproduct_records,
    exact_recurrence,
    gated_deltanet_records,
    gdn_gates,
    gla_records,
    hgrn2_gates,
    hgrn2_records,
    kda_gates,
    kda_records,
    l2norm,
    linear_attention_records,
    mamba2_gates,
    mamba2_records,
    mamba2_skip,
    naive_recurrent_delta_rule,
    naive_recurrent_gated_delta_product,
    naive_recurrent_gated_delta_rule,
    naive_recurrent_gla,
    naive_recurrent_hgrn2,
    naive_recurrent_kda,
    naive_recurrent_linear_attention,
    naive_recurrent_mamba2,
    naive_recurrent_retnet,
    naive_recurrent_rwkv6,
    naive_recurrent_rwkv7,
    retnet_gammas,
    retnet_records,
    rwkv6_bonus,
    rwkv6_records,
    rwkv7_records,
    values_per_record,
)

DT = torch.float64
TOL = 1e-10
FAMILIES = tuple(RECURRENCES)


@dataclass(frozen=True)
class Dims:
    B: int
    T: int
    H: int  # key/query heads (Mamba2: B/C groups)
    HV: int  # value heads (Mamba2: heads)
    K: int
    V: int


DIMS = {
    "K5_V3": Dims(B=2, T=7, H=2, HV=2, K=5, V=3),
    "K3_V6": Dims(B=2, T=6, H=3, HV=3, K=3, V=6),
    "grouped_H2_HV4": Dims(B=2, T=7, H=2, HV=4, K=5, V=3),
}
GROUPED_FAMILIES = ("mamba2", "deltanet", "gated_deltanet", "kda", "deltaproduct")


@dataclass
class Case:
    records: Records
    init: torch.Tensor | None  # [B, HV, K, V], key-first, for exact_recurrence
    out: torch.Tensor  # native outputs [B, T, HV, V]
    state: torch.Tensor  # native final state, transposed to key-first where the model keeps it value-first
    extra: torch.Tensor | None = None  # output terms outside the state (RWKV6 bonus, Mamba2 D skip)


class Inputs:
    """Random float64 inputs from one seeded generator."""

    def __init__(self, seed: int, d: Dims) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.d = d

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=DT)

    def qk(self) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.d
        # keys of norm about 1 keep the delta rule's |1 - beta |k|^2| below 1 without L2 normalisation
        return self.randn(d.B, d.T, d.H, d.K), self.randn(d.B, d.T, d.H, d.K) / math.sqrt(d.K)

    def log_gate(self, *shape: int) -> torch.Tensor:
        return -F.softplus(self.randn(*shape))

    def unit(self, *shape: int) -> torch.Tensor:
        return torch.sigmoid(self.randn(*shape))

    def state(self, with_state: bool, *shape: int) -> torch.Tensor | None:
        return self.randn(*shape) if with_state else None


def _transpose(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.transpose(-1, -2)


def build(family: str, d: Dims, with_state: bool, l2: bool = False, seed: int = 0) -> Case:
    x = Inputs(seed, d)
    B, T, H, HV, K, V = d.B, d.T, d.H, d.HV, d.K, d.V
    if family in ("linear_attention", "retnet", "gla", "rwkv6", "hgrn2"):
        assert H == HV
        q, k = x.qk()
        v = x.randn(B, T, H, V)
        S0 = x.state(with_state, B, H, K, V)
        if family == "linear_attention":
            o, S = naive_recurrent_linear_attention(q, k, v, initial_state=S0)
            return Case(linear_attention_records(q, k, v), S0, o, S)
        if family == "retnet":
            gamma = x.unit(H)
            o, S = naive_recurrent_retnet(q, k, v, gamma, initial_state=S0)
            return Case(retnet_records(q, k, v, gamma), S0, o, S)
        if family == "gla":
            gk = x.log_gate(B, T, H, K)
            o, S = naive_recurrent_gla(q, k, v, gk, initial_state=S0)
            return Case(gla_records(q, k, v, gk), S0, o, S)
        if family == "rwkv6":
            w, u = -torch.exp(0.5 * x.randn(B, T, H, K)), x.randn(H, K)
            o, S = naive_recurrent_rwkv6(q, k, v, w, u, initial_state=S0)
            return Case(rwkv6_records(q, k, v, w, u), S0, o, S, rwkv6_bonus(q, k, v, u))
        g = hgrn2_gates(x.randn(B, T, H, K))
        o, S = naive_recurrent_hgrn2(q, g, v, initial_state=S0)
        return Case(hgrn2_records(q, g, v), S0, o, S)
    if family == "mamba2":
        # H plays the B/C groups and HV the heads; K is d_state (N) and V the head dim (P).
        xs, dt, A = x.randn(B, T, HV, V), F.softplus(x.randn(B, T, HV)), -x.unit(HV) - 0.1
        Bm, Cm, D = x.randn(B, T, H, K), x.randn(B, T, H, K), x.randn(HV)
        S0 = x.state(with_state, B, HV, V, K)  # mamba_ssm's [B, H, P, N]
        y, S = naive_recurrent_mamba2(xs, dt, A, Bm, Cm, D, initial_state=S0)
        return Case(mamba2_records(xs, dt, A, Bm, Cm), _transpose(S0), y, _transpose(S), mamba2_skip(xs, D))
    if family == "rwkv7":
        assert H == HV
        r, k, v = x.randn(B, T, H, K), x.randn(B, T, H, K), x.randn(B, T, H, V)
        w, kk, a = -torch.exp(0.5 * x.randn(B, T, H, K)), l2norm(x.randn(B, T, H, K)), x.unit(B, T, H, K)
        S0 = x.state(with_state, B, H, V, K)  # value-first, as RWKV7 keeps it
        o, S = naive_recurrent_rwkv7(r, w, k, v, kk, a, initial_state=S0)
        return Case(rwkv7_records(r, w, k, v, kk, a), _transpose(S0), o, _transpose(S))
    if family == "deltaproduct":
        n = 3
        q = x.randn(B, T, H, K)
        k = x.randn(B, T * n, H, K) / math.sqrt(K)
        v, beta = x.randn(B, T * n, HV, V), x.unit(B, T * n, HV)
        g, S0 = x.log_gate(B, T, HV), x.state(with_state, B, HV, K, V)
        kw = dict(num_householder=n, use_qk_l2norm_in_kernel=l2)
        o, S = naive_recurrent_gated_delta_product(q, k, v, g, beta, initial_state=S0, **kw)
        return Case(deltaproduct_records(q, k, v, g, beta, **kw), S0, o, S)
    q, k = x.qk()
    v, beta, S0 = x.randn(B, T, HV, V), x.unit(B, T, HV), x.state(with_state, B, HV, K, V)
    kw = dict(use_qk_l2norm_in_kernel=l2)
    if family == "deltanet":
        o, S = naive_recurrent_delta_rule(q, k, v, beta, initial_state=S0, **kw)
        return Case(deltanet_records(q, k, v, beta, **kw), S0, o, S)
    if family == "gated_deltanet":
        g = x.log_gate(B, T, HV)
        o, S = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=S0, **kw)
        return Case(gated_deltanet_records(q, k, v, g, beta, **kw), S0, o, S)
    assert family == "kda"
    g = x.log_gate(B, T, HV, K)
    o, S = naive_recurrent_kda(q, k, v, g, beta, initial_state=S0, **kw)
    return Case(kda_records(q, k, v, g, beta, **kw), S0, o, S)


def replay(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact recurrence over the records: (outputs [B, T, HV, V] of emitting steps, final state)."""
    rec = case.records
    out, saved = exact_recurrence(rec, case.init, checkpoints=(rec.steps,))
    if rec.emit is not None:
        out = out[..., rec.emit, :]
    out = out.transpose(1, 2)
    if case.extra is not None:
        out = out + case.extra
    return out, saved[rec.steps]


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    rel = ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300)).item()
    assert rel < TOL, f"{what}: relative error {rel:.3e}"


def _family_params():
    for family in FAMILIES:
        dims = ("K5_V3", "K3_V6") + (("grouped_H2_HV4",) if family in GROUPED_FAMILIES else ())
        for dim_id in dims:
            for with_state in (False, True):
                state_id = "state" if with_state else "zero_state"
                yield pytest.param(family, dim_id, with_state, id=f"{family}-{dim_id}-{state_id}")


@pytest.mark.parametrize(("family", "dim_id", "with_state"), list(_family_params()))
def test_records_replay_matches_native(family: str, dim_id: str, with_state: bool) -> None:
    case = build(family, DIMS[dim_id], with_state)
    d = DIMS[dim_id]
    per_token = RECURRENCE_INFO[family].records_per_token or 3  # None: DeltaProduct's n (3 in build)
    steps = d.T * per_token
    assert case.records.batch_shape == (d.B, d.HV)
    assert case.records.steps == steps
    assert case.records.readout == RECURRENCE_INFO[family].readout
    out, state = replay(case)
    assert_rel_close(out, case.out, f"{family} outputs")
    assert_rel_close(state, case.state, f"{family} final state")


@pytest.mark.parametrize(
    ("family", "dim_id"),
    [
        pytest.param("deltanet", "grouped_H2_HV4", id="deltanet-grouped"),
        pytest.param("gated_deltanet", "grouped_H2_HV4", id="gated_deltanet-grouped"),
        pytest.param("gated_deltanet", "K3_V6", id="gated_deltanet-K3_V6"),
        pytest.param("kda", "grouped_H2_HV4", id="kda-grouped"),
        pytest.param("deltaproduct", "grouped_H2_HV4", id="deltaproduct-grouped"),
    ],
)
def test_l2norm_in_kernel_matches_native(family: str, dim_id: str) -> None:
    case = build(family, DIMS[dim_id], with_state=True, l2=True)
    out, state = replay(case)
    assert_rel_close(out, case.out, f"{family} outputs")
    assert_rel_close(state, case.state, f"{family} final state")


def test_l2norm_on_equals_prenormalised_inputs_off() -> None:
    x = Inputs(1, DIMS["grouped_H2_HV4"])
    d = x.d
    q, k = x.qk()
    v, g, beta = x.randn(d.B, d.T, d.HV, d.V), x.log_gate(d.B, d.T, d.HV), x.unit(d.B, d.T, d.HV)
    on = gated_deltanet_records(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    off = gated_deltanet_records(l2norm(q), l2norm(k), v, g, beta)
    raw = gated_deltanet_records(q, k, v, g, beta)
    for name in ("a", "k", "b", "v", "q"):
        assert torch.equal(getattr(on, name), getattr(off, name)), name
    assert not torch.allclose(on.k, raw.k)


def test_l2norm_is_flas_definition() -> None:
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0], [1e-4, 0.0]], dtype=DT)
    expected = torch.tensor(
        [
            [3 / math.sqrt(25 + 1e-6), 4 / math.sqrt(25 + 1e-6)],
            [0.0, 0.0],
            [1e-4 / math.sqrt(1e-8 + 1e-6), 0],
        ],
        dtype=DT,
    )
    torch.testing.assert_close(l2norm(x), expected, rtol=1e-15, atol=0)


def test_deltaproduct_ungated_and_emit_layout() -> None:
    x, n = Inputs(2, DIMS["K5_V3"]), 2
    d = x.d
    q, k = x.randn(d.B, d.T, d.H, d.K), x.randn(d.B, d.T * n, d.H, d.K) / math.sqrt(d.K)
    v, beta, S0 = x.randn(d.B, d.T * n, d.HV, d.V), x.unit(d.B, d.T * n, d.HV), x.randn(d.B, d.HV, d.K, d.V)
    rec = deltaproduct_records(q, k, v, None, beta, num_householder=n)
    assert rec.emit.tolist() == [False, True] * d.T
    assert torch.equal(rec.a, torch.ones_like(rec.a))
    assert torch.equal(rec.q[:, :, 0::2], torch.zeros_like(rec.q[:, :, 0::2]))
    o, S = naive_recurrent_gated_delta_product(q, k, v, None, beta, num_householder=n, initial_state=S0)
    out, state = replay(Case(rec, S0, o, S))
    assert_rel_close(out, o, "outputs")
    assert_rel_close(state, S, "final state")


# --- gate helpers against hand computations ------------------------------------------------------------


def _softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_gdn_gates_by_hand() -> None:
    a_raw = torch.tensor([[0.5, -1.0, 2.0]], dtype=DT)
    b_raw = torch.tensor([[0.0, 1.5, -3.0]], dtype=DT)
    A_log = torch.tensor([0.0, math.log(2.0), -1.0], dtype=DT)
    dt_bias = torch.tensor([0.1, 0.2, -0.3], dtype=DT)
    g, beta = gdn_gates(a_raw, b_raw, A_log, dt_bias)
    g_hand = [-math.exp(al) * _softplus(a + b) for a, al, b in zip([0.5, -1.0, 2.0], A_log.tolist(), dt_bias)]
    torch.testing.assert_close(g, torch.tensor([g_hand], dtype=DT), rtol=1e-14, atol=0)
    torch.testing.assert_close(beta, torch.tensor([[0.5, _sigmoid(1.5), _sigmoid(-3.0)]], dtype=DT))


def test_kda_gates_by_hand() -> None:
    HV, K = 2, 3
    g_raw = torch.arange(HV * K, dtype=DT).reshape(1, 1, HV, K) / 4 - 0.5
    A_log = torch.tensor([0.3, -0.7], dtype=DT)
    dt_bias = torch.tensor([0.1, -0.2, 0.3, 0.0, 0.5, -1.0], dtype=DT)  # flat [HV*K], as FLA keeps it
    b_raw = torch.tensor([[[0.25, -2.0]]], dtype=DT)
    g, beta = kda_gates(g_raw, A_log, dt_bias, b_raw)
    bounded, _ = kda_gates(g_raw, A_log, dt_bias, b_raw, lower_bound=-5.0)
    for h in range(HV):
        for c in range(K):
            x = g_raw[0, 0, h, c].item() + dt_bias[h * K + c].item()
            rate = math.exp(A_log[h].item())
            assert g[0, 0, h, c].item() == pytest.approx(-rate * _softplus(x), rel=1e-14)
            assert bounded[0, 0, h, c].item() == pytest.approx(-5.0 * _sigmoid(rate * x), rel=1e-14)
    torch.testing.assert_close(beta, torch.tensor([[[_sigmoid(0.25), _sigmoid(-2.0)]]], dtype=DT))
    g_plain, _ = kda_gates(g_raw, None, None, b_raw)
    torch.testing.assert_close(g_plain, -F.softplus(g_raw))


def test_other_gate_helpers_by_hand() -> None:
    dt, A = mamba2_gates(torch.tensor([[[0.0, 1.0]]], dtype=DT), torch.tensor([0.5, -1.0], dtype=DT),
                         torch.tensor([0.0, math.log(3.0)], dtype=DT))  # fmt: skip
    torch.testing.assert_close(dt, torch.tensor([[[_softplus(0.5), _softplus(0.0)]]], dtype=DT))
    torch.testing.assert_close(A, torch.tensor([-1.0, -3.0], dtype=DT))
    f = torch.tensor([0.7, -1.2], dtype=DT)
    torch.testing.assert_close(hgrn2_gates(f).exp(), torch.sigmoid(f))
    lb = torch.tensor([0.2, 0.5], dtype=DT)
    torch.testing.assert_close(hgrn2_gates(f, lb).exp(), lb + (1 - lb) * torch.sigmoid(f))
    torch.testing.assert_close(
        retnet_gammas(3), torch.tensor([1 - 1 / 32, 1 - 1 / 64, 1 - 1 / 128], dtype=DT)
    )


# --- scale -----------------------------------------------------------------------------------------------


def test_scale_defaults_to_inverse_sqrt_k() -> None:
    x = Inputs(3, DIMS["K5_V3"])
    d = x.d
    q, k = x.qk()
    v, g, beta = x.randn(d.B, d.T, d.HV, d.V), x.log_gate(d.B, d.T, d.HV), x.unit(d.B, d.T, d.HV)
    default = gated_deltanet_records(q, k, v, g, beta)
    torch.testing.assert_close(default.q, q.transpose(1, 2) * d.K**-0.5, rtol=0, atol=0)
    explicit = gated_deltanet_records(q, k, v, g, beta, scale=0.3)
    torch.testing.assert_close(explicit.q, q.transpose(1, 2) * 0.3, rtol=0, atol=0)
    o_default, _ = naive_recurrent_gated_delta_rule(q, k, v, g, beta)
    o_explicit, _ = naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale=d.K**-0.5)
    assert torch.equal(o_default, o_explicit)
    torch.testing.assert_close(gla_records(q, k, v, g[..., None].expand(-1, -1, -1, d.K)).q, default.q)


# --- bad input -------------------------------------------------------------------------------------------


def _bad_calls():
    r = torch.zeros
    good = dict(q=r(2, 7, 2, 5), k=r(2, 7, 2, 5), v=r(2, 7, 4, 3), g=r(2, 7, 4), beta=r(2, 7, 4))
    return [
        ("gdn_g_per_channel", lambda: gated_deltanet_records(**{**good, "g": r(2, 7, 4, 5)}), "g has shape"),
        ("gdn_heads_not_multiple", lambda: gated_deltanet_records(**{**good, "v": r(2, 7, 3, 3)}), "HV=3"),
        ("gdn_k_shape", lambda: gated_deltanet_records(**{**good, "k": r(2, 6, 2, 5)}), "k has shape"),
        ("kda_scalar_gate", lambda: kda_records(**good), "g has shape"),
        ("deltanet_beta", lambda: deltanet_records(good["q"], good["k"], good["v"], r(2, 7, 2)), "beta"),
        (
            "gdn_native_state",
            lambda: naive_recurrent_gated_delta_rule(**good, initial_state=r(2, 4, 3, 5)),
            "initial_state",
        ),
        (
            "deltaproduct_k_steps",
            lambda: deltaproduct_records(good["q"], good["k"], good["v"], None, good["beta"], 2),
            "k has shape",
        ),
        ("gla_grouped", lambda: gla_records(good["q"], good["k"], good["v"], r(2, 7, 2, 5)), "v has 4 heads"),
        ("rwkv6_u", lambda: rwkv6_records(good["q"], good["k"], r(2, 7, 2, 3), r(2, 7, 2, 5), r(5)), "u"),
        (
            "mamba2_groups",
            lambda: mamba2_records(r(2, 7, 3, 4), r(2, 7, 3), r(3), r(2, 7, 2, 5), r(2, 7, 2, 5)),
            "G=2",
        ),
        ("hgrn2_gate", lambda: hgrn2_records(good["q"], r(2, 7, 2, 4), r(2, 7, 2, 3)), "g has shape"),
        ("retnet_gamma", lambda: retnet_records(good["q"], good["k"], r(2, 7, 2, 3), r(3)), "gamma"),
        (
            "rwkv7_kk",
            lambda: rwkv7_records(good["q"], good["q"], good["k"], r(2, 7, 2, 3), r(5), good["q"]),
            "kk",
        ),
        ("gdn_gates_bias", lambda: gdn_gates(r(7, 4), r(7, 4), r(4), r(3)), "dt_bias"),
        ("kda_gates_bias", lambda: kda_gates(r(7, 4, 5), r(4), r(4), r(7, 4)), "dt_bias"),
        ("unknown_family", lambda: values_per_record("mamba3", 128, 128), "unknown recurrence family"),
        # accepted before: log decays or A > 0 grow the state by up to e^(dt A) a step with no error
        (
            "retnet_log_gamma",
            lambda: retnet_records(good["q"], good["k"], r(2, 7, 2, 3), torch.full((2,), -0.03)),
            "decays in [0, 1]",
        ),
        (
            "mamba2_positive_A",
            lambda: mamba2_records(r(2, 7, 2, 4), r(2, 7, 2), torch.ones(2), r(2, 7, 2, 5), r(2, 7, 2, 5)),
            "A must be <= 0",
        ),
        # a [d_k, d_v] state broadcast over every stream
        (
            "exact_recurrence_state",
            lambda: exact_recurrence(gated_deltanet_records(**good), r(5, 3)),
            "initial_state has shape (5, 3), expected (2, 4, 5, 3)",
        ),
    ]


@pytest.mark.parametrize(("call", "needle"), [pytest.param(c, n, id=i) for i, c, n in _bad_calls()])
def test_bad_input_raises_one_line_error(call, needle: str) -> None:
    with pytest.raises(LeapQuantError) as info:
        call()
    message = str(info.value)
    assert needle in message
    assert "\n" not in message


# --- registry --------------------------------------------------------------------------------------------


def test_registry_covers_every_family() -> None:
    expected = {
        "linear_attention", "retnet", "mamba2", "gla", "rwkv6", "hgrn2",
        "deltanet", "gated_deltanet", "kda", "deltaproduct", "rwkv7",
    }  # fmt: skip
    assert set(RECURRENCES) == set(NATIVE_REFERENCES) == set(RECURRENCE_INFO) == expected
    assert {decay_kind(f) for f in expected} == {IDENTITY, CONSTANT_SCALAR, DATA_SCALAR, DATA_VECTOR}


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        pytest.param("linear_attention", 128 + 64, id="identity"),
        pytest.param("retnet", 128 + 64, id="constant_scalar"),
        pytest.param("gated_deltanet", 1 + 128 + 64, id="scalar"),
        pytest.param("mamba2", 1 + 128 + 64, id="mamba2_scalar"),
        pytest.param("kda", 2 * 128 + 64, id="vector"),
        pytest.param("rwkv7", 2 * 128 + 64, id="rwkv7_erase_record"),
    ],
)
def test_values_per_record(family: str, expected: int) -> None:
    assert values_per_record(family, 128, 64) == expected


def _windowed(case: Case, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``replay`` through a :class:`WindowedState` of ``method``: every read from boundary plus records."""
    from leapquant.methods import WindowedState, parse_method

    rec = case.records
    B, HV = rec.batch_shape
    flat = [x.reshape(B * HV, rec.steps, -1) for x in (rec.a, rec.k, rec.b, rec.v, rec.q)]
    state = WindowedState(parse_method(method), B * HV, rec.d_k, rec.d_v)
    if case.init is not None:
        state.load(case.init.reshape(B * HV, rec.d_k, rec.d_v))
    outs = [state.step(*(x[:, t] for x in flat), readout=rec.readout) for t in range(rec.steps)]
    out = torch.stack(outs, 1).reshape(B, HV, rec.steps, rec.d_v)
    if rec.emit is not None:
        out = out[..., rec.emit, :]
    out = out.transpose(1, 2)
    if case.extra is not None:
        out = out + case.extra
    return out, state.materialize().reshape(B, HV, rec.d_k, rec.d_v)


@pytest.mark.parametrize("method", ["fp32/w3", "fp32/w4+ct2+smooth", "fp32/w2+ct3+svd", "fp32+ct1+smooth"])
@pytest.mark.parametrize(("family", "dim_id", "with_state"), list(_family_params()))
def test_every_family_through_the_window_matches_native(family, dim_id, with_state, method) -> None:
    """Each family's own records (RWKV-7's erase records, DeltaProduct's silent sub-steps, RWKV6's read
    before the update) read from a boundary plus a window of records, over several windows (a window may
    close between one token's records): with lossless storage, the native recurrence exactly."""
    case = build(family, DIMS[dim_id], with_state, seed=1)
    out, state = _windowed(case, method)
    assert_rel_close(out, case.out, f"{family} outputs under {method}")
    assert_rel_close(state, case.state, f"{family} final state under {method}")
