"""The leapquant-auto policy (methods/auto.py), layer plans (methods/layer_plan.py), the planner's bytes of a
mixed plan and patch() honouring a method per layer."""

from __future__ import annotations

import json

import pytest
import torch

from leapquant import LeapQuantError
from leapquant.methods import AutoPolicy, LayerPlan, WindowedState, as_layer_methods, calibrate, load_plan
from leapquant.methods import parse_method as pm
from leapquant.methods.auto import boundary_errors, error_gain, predicted_error

INT4, INT8 = "int4/w16+ct8+smooth+ls", "int8/w16+ct4+smooth"  # leapquant-int4, leapquant-int8
PAPER_INT4 = "int4/w16+ct8+smooth"  # max-scale rounding: the error the noise model predicts compounds


def _layer(decay: float, beta: float, t: int = 512, heads: int = 2, d: int = 32, seed: int = 0):
    """General-form GDN records ``(a, k, b, v)``: unit keys times ``beta``, read vector ``decay * key``."""
    g = torch.Generator().manual_seed(seed)
    key = torch.nn.functional.normalize(torch.randn(heads, t, d, generator=g, dtype=torch.float64), dim=-1)
    a = torch.full((heads, t, d), decay, dtype=torch.float64)
    v = torch.randn(heads, t, d, generator=g, dtype=torch.float64)
    return a, beta * key, decay * key, v


# a short-memory layer (decay 0.5, full erase): an error lives one window; a long-memory layer (decay 1, a
# 2% step): each direction is erased ~1/1600 per record, so boundary errors pile up for thousands of tokens
SHORT, LONG = _layer(0.5, 1.0), _layer(1.0, 0.02, seed=1)


def test_error_gain_closed_form():
    """Without keys the error map is the decay: G = sum_n a^(2 p n) over the windows of the horizon."""
    a, k, b, _ = _layer(0.99, 0.0, t=64, heads=1, d=8)
    shape = torch.eye(8, dtype=torch.float64)[None] / 8
    for horizon in (16, 40, 64, 1000, 65536):
        windows = -(-horizon // 16)  # the windows the horizon spans, the 64-token trace cycled (4 a cycle)
        expected = sum(0.99 ** (2 * 16 * n) for n in range(windows))
        assert error_gain(a, k, b, 16, shape, horizon).item() == pytest.approx(expected, rel=1e-9)
    ones = torch.ones_like(a)
    assert error_gain(ones, k, b, 16, shape, 1600).item() == pytest.approx(100)  # decay 1: G = windows
    # with keys: window by window, the trace cycled, for horizons that end inside a pass over it
    a, k, b, _ = _layer(0.9, 0.5, t=48, heads=2, d=8, seed=3)
    shape = torch.eye(8, dtype=torch.float64).expand(2, 8, 8) / 8
    acc = torch.zeros(2, 8, 8, dtype=torch.float64)
    for w in range(11):  # 11 windows of 8 tokens: one pass of 6 and 5 more
        m = torch.eye(8, dtype=torch.float64).expand(2, 8, 8)
        for i in range((w % 6) * 8, (w % 6 + 1) * 8):
            m = a[:, i, :, None] * m - k[:, i, :, None] * torch.einsum("sk,skj->sj", b[:, i], m)[:, None, :]
        acc = m @ acc @ m.transpose(-1, -2) + shape
        if w + 1 in (1, 5, 6, 11):
            got = error_gain(a, k, b, 8, shape, 8 * w + 3)  # a horizon inside window w + 1
            torch.testing.assert_close(got, acc.diagonal(dim1=-2, dim2=-1).sum(-1), rtol=1e-12, atol=0)
    assert predicted_error(torch.tensor([0.1, 0.1]), torch.tensor([50.0, 100.0])).tolist() == [
        pytest.approx((0.5 / 0.5) ** 0.5),
        float("inf"),
    ]


def test_prediction_matches_the_simulated_error_and_int4_cannot_hold_long_memory():
    """The noise model predicts the state error a real replay reaches (within 30%), and on the long-memory
    layer INT4's error grows to tens of percent and keeps growing while INT8's stays at a few percent."""
    a, k, b, v = LONG
    t = a.shape[1]
    for name in (PAPER_INT4, INT8):
        cfg = pm(name)
        rho, shape = boundary_errors(cfg, a, k, b, v)
        predicted = predicted_error(rho, error_gain(a, k, b, cfg.window, shape, t))
        state = WindowedState(cfg, 2, 32, 32)
        exact = torch.zeros(2, 32, 32, dtype=torch.float64)
        errs = []
        for i in range(t):
            state.step(a[:, i], k[:, i], b[:, i], v[:, i], b[:, i])
            exact = (
                a[:, i, :, None] * exact
                + k[:, i, :, None] * (v[:, i] - torch.einsum("skv,sk->sv", exact, b[:, i]))[:, None, :]
            )
            if (i + 1) % 128 == 0:
                diff = (state.materialize() - exact).flatten(1).norm(dim=1)
                errs.append(diff / exact.flatten(1).norm(dim=1))
        assert torch.allclose(errs[-1], predicted, rtol=0.3), (name, errs[-1], predicted)
        if name == PAPER_INT4:
            assert errs[-1].min() > 0.2 and (errs[-1] > errs[0]).all()
        else:
            assert errs[-1].max() < 0.05


def test_auto_keeps_int4_where_it_holds_and_falls_back_to_int8_where_it_cannot():
    plan = calibrate(AutoPolicy(budget=0.35), {0: SHORT, 3: LONG})
    assert plan.for_layer(0) == pm(INT4) and plan.for_layer(3) == pm(INT8)
    ev = plan.evidence["layers"]
    assert ev["0"]["chosen"] == INT4 and ev["3"]["chosen"] == INT8
    assert not ev["0"]["fallback"] and not ev["3"]["fallback"]  # INT8 met the budget: no fallback needed
    assert ev["3"]["candidates"][INT4]["worst"] > 0.35 >= ev["3"]["candidates"][INT8]["worst"]
    # a budget nothing meets: the most accurate candidate, not the dearest (w32 costs more than INT8)
    strict = calibrate(AutoPolicy(candidates=(INT4, "int4/w32+ct8+smooth", INT8), budget=1e-6), {0: SHORT})
    assert strict.for_layer(0) == pm(INT8) and strict.evidence["layers"]["0"]["fallback"]


def test_plan_round_trip_and_lookup(tmp_path):
    plan = LayerPlan(((0, pm("leapquant-int4")), (6, pm("leapquant-int8"))), evidence={"budget": 0.35})
    path = plan.save(tmp_path / "plan.json")
    back = load_plan(path)
    assert back == plan and back.evidence == {"budget": 0.35}
    assert json.loads(path.read_text())["layers"] == {"0": INT4, "6": INT8}
    assert as_layer_methods(str(path)) == plan
    assert plan.name == f"layers(0={INT4};6={INT8})" and not plan.is_uniform
    assert as_layer_methods("leapquant-int8") == LayerPlan.uniform(INT8)
    assert LayerPlan.uniform("leapquant-int8").for_layer(5) == pm(INT8)
    with pytest.raises(LeapQuantError, match="no method for layer 1"):
        plan.for_layer(1)
    with pytest.raises(LeapQuantError, match=r"lists layers \[6\], which are not"):
        plan.check_layers([0, 1])


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"layers": {}}', "not a layer plan"),
        ('{"plan": "leapquant-layer-plan/1", "layers": {"x": "int8"}}', "must map layer indices"),
        ('{"plan": "leapquant-layer-plan/1", "layers": {"0": "int9"}}', "int9"),
        ("{", "is not JSON"),
    ],
)
def test_bad_plans_raise_one_line_errors(tmp_path, text, match):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(LeapQuantError, match=match) as err:
        load_plan(path)
    assert "\n" not in str(err.value)


def test_auto_needs_calibration_and_policies_validate():
    from leapquant.methods import POLICIES
    from leapquant.methods.config import POLICY_NAMES

    assert tuple(POLICIES) == POLICY_NAMES
    for name in POLICY_NAMES:
        with pytest.raises(LeapQuantError, match="leapquant calibrate"):
            as_layer_methods(name)
    with pytest.raises(LeapQuantError, match="names a layer plan, not one method"):
        pm("plans/gdn.json")  # entry points that take one method (vLLM, simulate) say so
    with pytest.raises(LeapQuantError, match="budget"):
        AutoPolicy(budget=0)
    with pytest.raises(LeapQuantError):
        AutoPolicy(candidates=("int4/w16+ct8+smoth",))
    with pytest.raises(LeapQuantError, match="must share"):
        calibrate(AutoPolicy(), {0: (SHORT[0], SHORT[1][:, :8], SHORT[2], SHORT[3])})
    with pytest.raises(LeapQuantError, match="shorter than a window"):
        calibrate(AutoPolicy(), {0: tuple(x[:, :8] for x in SHORT)})
    with pytest.raises(LeapQuantError, match="listed once"):
        LayerPlan(((1, pm(INT8)), (1, pm(INT4))))


def test_planner_counts_a_mixed_plan_exactly():
    """State bytes of a plan = the sum of each layer's own method; checkpoints likewise."""
    from leapquant.plan import plan_memory, shape_from_config
    from leapquant.plan.presets import byte_hybrid_config

    shape = shape_from_config(byte_hybrid_config("qwen35"))  # the shipped GDN checkpoint: linear 0-2, 4-6
    linear = [i for i, t in enumerate(shape.layer_types) if t == "linear"]
    mixed = LayerPlan(tuple((i, pm(INT8 if i == 6 else INT4)) for i in linear))
    kw = dict(context=4096, gpu_memory_gib=80, prefix_interval=1024)
    p4, p8, pm_ = (plan_memory(shape, m, **kw) for m in (INT4, INT8, mixed))
    n = shape.linear_layers
    assert pm_.state_bytes == (p4.state_bytes * (n - 1) + p8.state_bytes) // n
    assert (
        pm_.checkpoint_bytes - pm_.conv_bytes
        == ((p4.checkpoint_bytes - p4.conv_bytes) * (n - 1) + p8.checkpoint_bytes - p8.conv_bytes) // n
    )
    per_head = {m: pm(m).bytes_per_element(128, 128) * 128 * 128 + pm(m).record_buffer_bytes(128, 128, 1)
                for m in (INT4, INT8)}  # fmt: skip
    assert pm_.state_bytes == shape.heads_v * (5 * per_head[INT4] + per_head[INT8])
    assert sum(pm_.state_breakdown.values()) == pm_.state_bytes
    assert f"payload[{INT8}]" in pm_.state_breakdown
    assert pm_.bytes_per_element == pytest.approx((5 * p4.bytes_per_element + p8.bytes_per_element) / 6)
    with pytest.raises(LeapQuantError, match="not linear-attention layers"):
        plan_memory(shape, LayerPlan(((3, pm(INT8)),), default=pm(INT4)), **kw)
    with pytest.raises(LeapQuantError, match="layer pattern is not known"):
        plan_memory(shape.reduced(6, 2), mixed, **kw)


def test_patch_gives_each_layer_its_plan_method():
    from tiny_models import tiny_model
    from transformers import DynamicCache

    from leapquant.integrations import linear_attention_layers, patch

    model = tiny_model("qwen3_5", d=16)
    layers = [i for i, _ in linear_attention_layers(model)]
    plan = LayerPlan(((layers[1], pm("int8/w4")),), default=pm("int4/w4+ct2"))
    patched = patch(model, ["fp32", plan], backend="reference")
    cache = DynamicCache(config=model.config)
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids[:, :8], past_key_values=cache, use_cache=True)
        model(ids[:, 8:9], past_key_values=cache, use_cache=True)
    store = cache._leapquant_states
    for i in layers:
        assert store[i].states[1].config == plan.for_layer(i)
    assert type(store[layers[0]].states[0]).__name__ == "NativeState"
    patched.unpatch()
    with pytest.raises(LeapQuantError, match="not linear-attention layers"):
        patch(model, LayerPlan(((3, pm(INT8)),), default=pm(INT4)))


def test_calibrate_model_plans_every_linear_layer_and_patch_takes_it(tmp_path):
    from tiny_models import tiny_model

    from leapquant.integrations import calibrate_model, linear_attention_layers, patch

    def tokenizer(text, add_special_tokens=False):  # a byte tokenizer for the tiny vocabulary
        return {"input_ids": [3 + b % 60 for b in text.encode()]}

    model = tiny_model("kimi_linear", d=16)
    policy = AutoPolicy(candidates=("int4/w4+ct2", "int8/w4"), horizon=256)
    plan = calibrate_model(model, tokenizer, policy, tokens=64)
    layers = [i for i, _ in linear_attention_layers(model)]
    assert [i for i, _ in plan.layers] == layers and plan.default is None
    assert set(plan.evidence["layers"]) == {str(i) for i in layers}
    assert plan.evidence["calibration_tokens"] == 64 and plan.evidence["policy"] == "custom"
    patch(model, str(plan.save(tmp_path / "plan.json"))).unpatch()
    # the default policy built by hand (as `leapquant calibrate` does) is named as such, not "custom"
    default = calibrate_model(model, tokenizer, AutoPolicy(), tokens=32)
    assert default.evidence["policy"] == "leapquant-auto"
    with pytest.raises(LeapQuantError, match="unknown policy"):
        calibrate_model(model, tokenizer, "leapquant-autp")


def test_calibrating_a_patched_model_keeps_its_patch():
    """The calibration trace runs under FP32 through the caller's patch and leaves it as it was: same
    object, same methods, the same logits after as before, and the same trace as an unpatched model's."""
    from tiny_models import tiny_model

    from leapquant.eval.model_eval import record_trace
    from leapquant.integrations import patch

    def tokenizer(text, add_special_tokens=False):
        return {"input_ids": [3 + b % 60 for b in text.encode()]}

    model = tiny_model("qwen3_5", d=16)
    ids = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(3))
    plain_trace = record_trace(model, tokenizer, 48)
    patched = patch(model, "int4/w4+ct2", backend="reference")
    with torch.no_grad():
        before = model(ids, use_cache=True).logits
    patched_trace = record_trace(model, tokenizer, 48)
    assert model._leapquant_patch is patched and patched.layers
    assert [m.default.name for m in patched.methods] == ["int4/w4+ct2"]
    with torch.no_grad():
        assert torch.equal(model(ids, use_cache=True).logits, before)
    for name in ("a", "k", "b", "v", "q"):
        assert torch.equal(getattr(plain_trace[0], name), getattr(patched_trace[0], name)), name
    patched.unpatch()


@pytest.mark.parametrize(
    ("extra", "match"),
    [(["--out", "plan.txt"], "expected a .json file"), (["--out", "p.json", "--budget", "0"], "budget")],
)
def test_calibrate_cli_errors_exit_2_with_one_line(extra, match, capsys):
    from leapquant.cli.main import main

    assert main(["calibrate", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("leapquant: error:") and match in err and "\n" not in err


def test_calibration_measures_the_least_squares_quantizer():
    """``+ls`` candidates are measured with the scales they store: without smoothing, each channel's
    least-squares scale leaves no more fresh error than its max scale (less, summed), on both layers."""
    for a, k, b, v in (SHORT, LONG):
        plain, _ = boundary_errors(pm("int4/w16+ct2"), a, k, b, v)
        fitted, _ = boundary_errors(pm("int4/w16+ct2+ls"), a, k, b, v)
        assert (fitted < plain).all(), (fitted, plain)


def test_candidates_are_ranked_by_the_bytes_their_pools_hold():
    """int6 codes take a byte each in the kernel pool, so an int6 candidate costs what int8's does and is
    not ranked as the cheaper one; int4 codes are packed and cost less."""
    from leapquant.methods.auto import head_bytes

    names = ("int4/w16+ct8+smooth+ls", "int6/w16+ct4+smooth", "int8/w16+ct4+smooth")
    int4, int6, int8 = (pm(m) for m in names)
    for decay_values in (1, 128):
        cost = {c.name: head_bytes(c, 128, 128, decay_values) for c in (int4, int6, int8)}
        assert cost[int6.name] == cost[int8.name] > cost[int4.name]
