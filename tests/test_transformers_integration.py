"""leapquant.patch on tiny random-weight Qwen3.5 / Qwen3.5-MoE / Qwen3-Next / Kimi-Linear models (CPU)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHS, KERNEL_DEVICE, dense_states, tiny_model

import leapquant
from leapquant import LeapQuantError
from leapquant.integrations import linear_attention_layers


def _teacher_forced(model, ids: torch.Tensor, prefill: int):
    """Logits of every decode step after a ``prefill``-token prompt, and the cache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(ids[:, :prefill], past_key_values=cache, use_cache=True)
        logits = [out.logits[:, -1]]
        for t in range(prefill, ids.shape[1]):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    return torch.stack(logits, 1), cache


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_is_the_unpatched_model(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    ref_logits, _ = _teacher_forced(model, ids, 8)
    ref_gen = model.generate(ids[:, :8], max_new_tokens=12, do_sample=False)
    patched = leapquant.patch(model, "fp32")
    logits, cache = _teacher_forced(model, ids, 8)
    assert torch.equal(logits, ref_logits)
    assert torch.equal(model.generate(ids[:, :8], max_new_tokens=12, do_sample=False), ref_gen)
    assert set(patched.states(cache)) == {idx for idx, _ in linear_attention_layers(model)}
    patched.unpatch()
    assert torch.equal(_teacher_forced(model, ids, 8)[0], ref_logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_leapquant_state_tracks_fp32(arch):
    """The decode path really goes through the quantized state: close to FP32, never identical."""
    model = tiny_model(arch, d=32, decay_scale=0.05)
    ids = torch.randint(3, 64, (2, 40), generator=torch.Generator().manual_seed(2))
    ref_logits, ref_cache = _teacher_forced(model, ids, 8)
    ref_states = dense_states(model, ref_cache)
    patched = leapquant.patch(model, "leapquant-int8", backend="reference64")
    logits, cache = _teacher_forced(model, ids, 8)
    states = patched.states(cache)
    for idx, ref in ref_states.items():
        err = ((states[idx] - ref).norm() / ref.norm()).item()
        assert 0 < err < 2e-2, (idx, err)
    rel = ((logits - ref_logits).norm() / ref_logits.norm()).item()
    assert 0 < rel < 1e-2


def test_per_step_int8_drifts_more_than_leapquant():
    model = tiny_model("qwen3_5", d=32, decay_scale=0.02)
    ids = torch.randint(3, 64, (1, 8 + 96), generator=torch.Generator().manual_seed(3))
    _, ref_cache = _teacher_forced(model, ids, 8)
    ref = dense_states(model, ref_cache)
    errs = {}
    for method in ("int8", "leapquant-int8"):
        patched = leapquant.patch(model, method, backend="reference64")
        _, cache = _teacher_forced(model, ids, 8)
        st = patched.states(cache)
        errs[method] = (
            sum((st[i] - ref[i]).norm() ** 2 for i in ref) ** 0.5
            / sum(r.norm() ** 2 for r in ref.values()) ** 0.5
        )
    assert errs["int8"] > 3 * errs["leapquant-int8"], errs


@pytest.mark.parametrize("arch", ["qwen3_5", "kimi_linear"])
def test_methods_side_by_side_rows(arch):
    """A sequence of methods splits the batch: each group equals that method run alone."""
    model = tiny_model(arch)
    ids = torch.randint(3, 64, (1, 20), generator=torch.Generator().manual_seed(4))
    ref_logits, _ = _teacher_forced(model, ids.repeat(2, 1), 6)
    leapquant.patch(model, "int4/w4+ct2", backend="reference64")
    alone, _ = _teacher_forced(model, ids.repeat(2, 1), 6)
    leapquant.patch(model, ["fp32", "int4/w4+ct2"], backend="reference64")
    both, _ = _teacher_forced(model, ids.repeat(2, 1), 6)
    assert torch.equal(both[0], ref_logits[0])
    assert torch.equal(both[1], alone[1])
    assert (both[1] - both[0]).abs().max() > 1e-6  # the int4 rows really differ from fp32
    leapquant.unpatch(model)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next", "kimi_linear"])
def test_generate_sampling_padded_batches_and_beams(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, 64, (3, 10), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    leapquant.patch(model, "leapquant-int8", backend="reference")
    torch.manual_seed(0)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=True, top_k=8)
    assert out.shape == (3, 30)
    leapquant.patch(model, "fp32")
    beams = model.generate(ids, attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False)
    leapquant.unpatch(model)
    assert torch.equal(
        beams, model.generate(ids, attention_mask=mask, max_new_tokens=8, num_beams=3, do_sample=False)
    )


@pytest.mark.parametrize("arch", ["qwen3_5", "kimi_linear"])
def test_cache_reordering_moves_quantized_rows(arch):
    """reorder_cache (beam search) permutes and duplicates the quantized rows like the dense ones."""
    model = tiny_model(arch)
    ids = torch.randint(3, 64, (3, 12), generator=torch.Generator().manual_seed(6))
    order = torch.tensor([2, 0, 0])
    leapquant.patch(model, "bf16/w4+ct2", backend="reference64")
    from transformers import DynamicCache

    def run(prompt, reorder):
        cache = DynamicCache(config=model.config)
        model(prompt[:, :9], past_key_values=cache, use_cache=True)
        if reorder is not None:
            cache.reorder_cache(reorder)
        nxt = prompt[:, 9:10] if reorder is None else prompt[reorder, 9:10]
        return model(nxt, past_key_values=cache, use_cache=True).logits[:, -1]

    moved = run(ids, order)
    fresh = run(ids[order], None)
    leapquant.unpatch(model)
    torch.testing.assert_close(moved, fresh, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_patch_takes_over_a_cache_filled_before_it(arch):
    """A cache prefilled by the unpatched model: the patch quantizes its dense state instead of restarting
    from zeros (multi-token continuation and single decode steps alike)."""
    from transformers import DynamicCache

    model = tiny_model(arch, d=32, decay_scale=0.05)
    ids = torch.randint(3, 64, (2, 16), generator=torch.Generator().manual_seed(11))

    def continued(patch_method):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :8], past_key_values=cache, use_cache=True)
            if patch_method is not None:
                leapquant.patch(model, patch_method, backend="reference64")
            logits = [model(ids[:, 8:12], past_key_values=cache, use_cache=True).logits]
            logits += [
                model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in (12, 13)
            ]
        leapquant.unpatch(model)
        return torch.cat(logits, 1)

    ref = continued(None)
    torch.testing.assert_close(continued("fp32"), ref, rtol=0, atol=1e-5)
    rel = ((continued("leapquant-int8") - ref).norm() / ref.norm()).item()
    assert 0 < rel < 1e-2


@pytest.mark.parametrize("arch", ["qwen3_5", "kimi_linear"])
def test_a_new_patch_takes_over_the_states_an_earlier_patch_left(arch):
    """Re-patching between calls on one cache: the next call runs the new method from the old method's
    state (read back dense), not the old method. Re-patched to fp32, it is the unpatched model continued
    from that dense state with the rest of the cache as it was."""
    import copy

    from transformers import DynamicCache

    from leapquant.integrations.transformers import _STATES_ATTR

    model = tiny_model(arch, d=32, decay_scale=0.05)
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(12))
    old = leapquant.patch(model, "int4/w2+ct2", backend="reference64")  # a boundary in rest()
    cache = DynamicCache(config=model.config)

    def rest(c):
        return torch.cat(
            [model(ids[:, t : t + 1], past_key_values=c, use_cache=True).logits for t in (9, 10)], 1
        )

    with torch.no_grad():
        model(ids[:, :8], past_key_values=cache, use_cache=True)
        model(ids[:, 8:9], past_key_values=cache, use_cache=True)
        handed_over = old.states(cache)
        dense_cache = copy.deepcopy(cache)
        kept = rest(copy.deepcopy(cache))  # the old method, had it stayed (a copy shares the patch)
        new = leapquant.patch(model, "fp32")
        got = rest(cache)
        assert set(new.states(cache)) == set(handed_over)
        leapquant.unpatch(model)
        delattr(dense_cache, _STATES_ATTR)
        for idx, state in handed_over.items():
            dense_cache.layers[idx].recurrent_states[0] = state.clone()
        ref = rest(dense_cache)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    assert (got - kept).abs().max() > 1e-4


def test_triton_backend_matches_reference():
    model = tiny_model("qwen3_5", d=16).to(KERNEL_DEVICE)
    ids = torch.randint(3, 64, (2, 14), generator=torch.Generator().manual_seed(7)).to(KERNEL_DEVICE)
    leapquant.patch(model, "int8/w4+ct2+smooth", backend="reference")
    ref, _ = _teacher_forced(model, ids, 6)
    leapquant.patch(model, "int8/w4+ct2+smooth", backend="triton")
    got, _ = _teacher_forced(model, ids, 6)
    leapquant.unpatch(model)
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)


def test_bad_input():
    import transformers as tf

    model = tiny_model("qwen3_5")
    with pytest.raises(LeapQuantError, match="unknown"):
        leapquant.patch(model, "int9")
    with pytest.raises(LeapQuantError, match="backend"):
        leapquant.patch(model, "int8", backend="cuda-magic")
    leapquant.patch(model, ["fp32", "int8"])
    with pytest.raises(LeapQuantError, match="split evenly"):
        model(torch.randint(3, 64, (3, 5)), use_cache=True)
    leapquant.unpatch(model)
    llama = tf.LlamaForCausalLM(
        tf.LlamaConfig(
            vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
        )
    )
    with pytest.raises(LeapQuantError, match="no supported linear-attention layers"):
        leapquant.patch(llama, "int8")


def test_what_the_patched_state_cannot_follow_raises_instead_of_going_around_it():
    """Packed sequences on the state path, and kernel calls with positional arguments (another
    transformers version), would otherwise bypass or misread the quantized state."""
    from transformers import DynamicCache

    from leapquant.integrations.transformers import _ACTIVE, _dispatcher

    model = tiny_model("qwen3_5")
    ids = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(4))
    leapquant.patch(model, "int8/w4", backend="reference")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :8], past_key_values=cache, use_cache=True)
        with pytest.raises(LeapQuantError, match="packed sequences"):
            cu = torch.tensor([0, 2], dtype=torch.int32)
            model(ids[:, 8:10], past_key_values=cache, use_cache=True, cu_seq_lens_q=cu)
    leapquant.unpatch(model)
    dispatch = _dispatcher(lambda q, k, v, *rest, **kw: (q, None), chunked=False)
    x = torch.zeros(1)
    assert dispatch(x, x, x, 1.0)[0] is x  # no patched layer running: the original, as called
    token = _ACTIVE.set((None, None))
    try:
        with pytest.raises(LeapQuantError, match="positional arguments"):
            dispatch(x, x, x, 1.0)
    finally:
        _ACTIVE.reset(token)


@pytest.mark.parametrize("method", ["int8", "mxfp4", "turboquant-4"])
@pytest.mark.parametrize("arch", ["qwen3_5", "kimi_linear"])
def test_per_step_fast_path_matches_reference(arch, method):
    """auto runs per-step methods as the model's step + the format's round trip; same as the reference."""
    from leapquant.integrations.backends import DequantizedState

    model = tiny_model(arch, d=32, decay_scale=0.05)
    ids = torch.randint(3, 64, (2, 30), generator=torch.Generator().manual_seed(8))
    patched = leapquant.patch(model, method, backend="reference64")
    ref, ref_cache = _teacher_forced(model, ids, 6)
    ref_states = patched.states(ref_cache)
    patched = leapquant.patch(model, method)
    got, cache = _teacher_forced(model, ids, 6)
    layer = patched.layers[0]
    assert isinstance(cache._leapquant_states[layer].states[0], DequantizedState)
    states = patched.states(cache)
    leapquant.unpatch(model)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    for idx, st in states.items():
        assert ((st - ref_states[idx]).norm() / ref_states[idx].norm()) < 1e-3


def test_last_unpatch_restores_the_modeling_functions():
    import sys

    model = tiny_model("qwen3_5")
    module = sys.modules[type(model.model.layers[0].linear_attn).__module__]
    before = module.torch_recurrent_gated_delta_rule
    first, second = leapquant.patch(model, "int8"), leapquant.patch(tiny_model("qwen3_5", seed=1), "int8")
    assert module.torch_recurrent_gated_delta_rule is not before
    first.unpatch()
    assert module.torch_recurrent_gated_delta_rule is not before  # the second patch still needs it
    second.unpatch()
    assert module.torch_recurrent_gated_delta_rule is before


@pytest.mark.parametrize("arch", ["qwen3_5", "kimi_linear"])
@pytest.mark.parametrize("method", ["fp32", "int8", "leapquant-int8"])
def test_a_cpu_model_runs_torch_kernels_where_fla_would_be_picked(arch, method, monkeypatch):
    """Where FLA imports, transformers' kernel functions call its Triton kernels whatever the tensors'
    device (GPU machines: ``leapquant eval --device cpu`` failed inside FLA). Here transformers' own wrapper
    (``use_kernel_func_from_hub_with_fallback``) is built around each torch function with a stand-in package
    whose kernels refuse CPU tensors, as FLA's launcher does: a patched CPU model never calls them, and
    computes what it computes with the torch functions. A wrapper of the user's (a profiler made with
    ``functools.wraps``) is still called (around FLA it would still fail: it calls what it wraps)."""
    import functools
    import sys
    import types

    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    from leapquant.integrations.transformers import SUPPORTED_LAYERS, _torch_kernel

    model = tiny_model(arch)
    ids = torch.randint(3, 64, (2, 14), generator=torch.Generator().manual_seed(3))
    patched = leapquant.patch(model, method, backend="reference64")
    expected, _ = _teacher_forced(model, ids, 6)
    patched.unpatch()

    def refuse_cpu(query, key, value, g=None, beta=None, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, **kwargs):  # fmt: skip
        if query.device.type == "cpu":
            raise ValueError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")
        raise AssertionError("the tests run on the CPU")

    layer = linear_attention_layers(model)[0][1]
    module = sys.modules[type(layer).__module__]
    kind = SUPPORTED_LAYERS[type(layer).__name__]
    torch_fns = {name: _torch_kernel(getattr(module, name)) for name in (kind.chunk_fn, kind.recurrent_fn)}
    for name, fn in torch_fns.items():
        package = f"fla_like_{name}"
        monkeypatch.setitem(sys.modules, package, types.SimpleNamespace(**{name: refuse_cpu}))
        monkeypatch.setattr(module, name, use_kernel_func_from_hub_with_fallback(name, package)(fn))
    with pytest.raises(ValueError, match="cpu tensor"):  # the stand-in is what transformers would call
        _teacher_forced(model, ids, 6)
    patched = leapquant.patch(model, method, backend="reference64")
    logits, _ = _teacher_forced(model, ids, 6)
    patched.unpatch()
    assert torch.equal(logits, expected)

    calls = []  # without FLA (transformers falls back to the torch function), a profiler of the user's
    for name, fn in torch_fns.items():
        hub = use_kernel_func_from_hub_with_fallback(name, "no_package_of_this_name")(fn)

        @functools.wraps(hub)
        def profiled(*args, _fn=hub, **kwargs):
            calls.append(1)
            return _fn(*args, **kwargs)

        monkeypatch.setattr(module, name, profiled)
    patched = leapquant.patch(model, method, backend="reference64")
    logits, _ = _teacher_forced(model, ids, 6)
    patched.unpatch()
    assert torch.equal(logits, expected) and calls  # is not stepped over


PER_STEP_BASELINES = [
    "bf16", "int8", "int6", "int4", "mxfp8", "mxfp6-e2m3", "mxfp4", "nvfp6", "nvfp4", "kvquant-int8",
    "kvquant-int4", "quarot-int8", "quarot-int4", "turboquant-8", "turboquant-4",
]  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the H200)")
@pytest.mark.parametrize("method", PER_STEP_BASELINES)
def test_per_step_round_trip_graph_equals_eager(method):
    """On CUDA the per-step round trip replays a captured graph: every format captures, and each replay on
    fresh states gives the eager round trip's values bit for bit."""
    from leapquant.integrations.backends import DequantizedState
    from leapquant.methods import parse_method

    graphed = DequantizedState(parse_method(method), recurrent_fn=None)
    eager = DequantizedState(parse_method(method), recurrent_fn=None)
    gen = torch.Generator(device="cuda").manual_seed(5)
    for _ in range(3):
        state = torch.randn(2, 4, 128, 128, device="cuda", generator=gen) * torch.rand(
            2, 4, 1, 128, device="cuda", generator=gen
        )
        got = graphed._round_trip(state).clone()
        assert graphed._graph not in (None, False), f"{method}: the round trip was not captured"
        assert torch.equal(got, eager._eager_round_trip(state))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the H200)")
@pytest.mark.parametrize("decay", ["scalar", "vector"], ids=["gdn", "kda"])
@pytest.mark.parametrize("method", ["leapquant-int8", "leapquant-int4", "int8/w4+ct2", "int8"])
def test_kernel_state_graph_replays_equal_eager_steps(method, decay):
    """On CUDA a kernel pool's step replays a captured graph from the second step of each shape: over
    several windows, a row reorder (beam search) and a shape change, outputs and states equal the eager
    steps' bit for bit, and the graph really was captured."""
    from leapquant.integrations.backends import KernelState
    from leapquant.methods import parse_method

    cfg = parse_method(method)
    graphed, eager = KernelState(cfg, decay), KernelState(cfg, decay, graphs=False)
    gen = torch.Generator(device="cuda").manual_seed(11)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    b, hv, d = 3, 4, 128
    state = randn(b, hv, d, d) * 0.1
    graphed.load(state)
    eager.load(state)
    for t in range(40):
        if t == 20:  # generate() reorders and drops rows: the pools' tensors are replaced
            rows = torch.tensor([2, 0], device="cuda")
            graphed.select_rows(rows)
            eager.select_rows(rows)
            b = 2
        q, k = randn(b, hv, d).bfloat16(), randn(b, hv, d).bfloat16()
        v = randn(b, hv, d).bfloat16()
        g = -torch.rand(b, hv, *((d,) if decay == "vector" else ()), device="cuda", generator=gen) * 0.1
        beta = torch.rand(b, hv, device="cuda", generator=gen)
        got, want = graphed.step(q, k, v, g, beta), eager.step(q, k, v, g, beta)
        assert torch.equal(got, want), f"step {t}: outputs differ"
        assert torch.equal(graphed.materialize(), eager.materialize()), f"step {t}: states differ"
        if t in (5, 25):
            assert graphed._graph not in (None, False), f"step {t}: no graph was captured"


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_patch_graphs_setting_reaches_every_state(graphs):
    """``patch(..., graphs=)`` reaches the kernel pools' and the per-step round trips' states (``bench
    generate --graphs both`` compares the two in one process); anything but a bool is refused."""
    from transformers import DynamicCache

    from leapquant.integrations.backends import KernelState

    model = tiny_model("qwen3_5", d=16).to(KERNEL_DEVICE)
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0)).to(KERNEL_DEVICE)
    cache = DynamicCache(config=model.config)
    patched = leapquant.patch(model, "int8/w4+ct2+smooth", backend="triton", graphs=graphs)
    model(ids, past_key_values=cache, use_cache=True)
    states = [st for groups in cache._leapquant_states.values() for st in groups.states]
    assert states and all(isinstance(st, KernelState) and st.graphs is graphs for st in states)
    patched.unpatch()
    with pytest.raises(LeapQuantError, match="graphs must be True or False"):
        leapquant.patch(model, "int8", graphs="no")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the H200)")
def test_kernel_state_steps_inside_a_callers_graph():
    """A caller that captures the decode step in its own CUDA graph (static cache, "reduce-overhead")
    captures our launches with it: the state does not try a capture of its own inside theirs, and the
    caller's replays advance the state as eager steps do."""
    from leapquant.integrations.backends import KernelState
    from leapquant.methods import parse_method

    cfg = parse_method("leapquant-int8")
    outer, eager = KernelState(cfg, "scalar"), KernelState(cfg, "scalar", graphs=False)
    gen = torch.Generator(device="cuda").manual_seed(3)
    state = torch.randn(2, 4, 128, 128, device="cuda", generator=gen) * 0.1
    outer.load(state)
    eager.load(state)
    static = [torch.randn(2, 4, 128, device="cuda", generator=gen) for _ in range(3)]
    static += [-torch.rand(2, 4, device="cuda", generator=gen) * 0.1]  # g
    static += [torch.rand(2, 4, device="cuda", generator=gen)]  # beta
    outer.step(*static)  # the first step compiles and allocates, outside any capture
    eager.step(*static)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin()
        out = outer.step(*static)
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    assert outer._graph is None  # no capture of its own was attempted
    for t in range(20):  # over a window close
        graph.replay()
        assert torch.equal(out, eager.step(*static)), f"step {t}"
    assert torch.equal(outer.materialize(), eager.materialize())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run on the H200)")
@pytest.mark.parametrize("arch", ["qwen3_5", "kimi_linear"], ids=["gdn", "kda"])
def test_multi_token_calls_replay_a_chunk_graph_equal_to_eager(arch):
    """A multi-token call on an existing state (the recall evaluator's context chunks, chunked prefill)
    replays one graph per layer and input shape from the second call of that shape on: over several
    chunks, a remainder chunk and single decode tokens, every group (FP32, a per-step round trip, kernel
    pools across window closes) gives the eager run's logits and states bit for bit."""
    from transformers import DynamicCache

    methods = ["fp32", "int8", "leapquant-int8", "int8/w4+ct2+smooth"]
    runs = []
    for graphs in (True, False):
        model = tiny_model(arch, d=32).cuda()
        ids = torch.randint(0, 64, (len(methods) * 2, 64), generator=torch.Generator().manual_seed(2)).cuda()
        cache = DynamicCache(config=model.config)
        patched = leapquant.patch(model, methods, graphs=graphs)
        logits = []
        with torch.inference_mode():
            logits.append(model(ids[:, :8], past_key_values=cache, use_cache=True).logits)
            for s, e in ((8, 20), (20, 32), (32, 44), (44, 56), (56, 61), (61, 62), (62, 63), (63, 64)):
                logits.append(model(ids[:, s:e], past_key_values=cache, use_cache=True).logits)
        store = cache._leapquant_states
        captured = [bool(groups._chunk_graphs) for groups in store.values()]
        runs.append((torch.cat(logits, 1), patched.states(cache), captured))
        patched.unpatch()
    (got, got_states, captured), (want, want_states, _) = runs
    assert all(captured), "a layer never replayed a chunk graph"
    assert torch.equal(got, want)
    for idx in want_states:
        assert torch.equal(got_states[idx], want_states[idx]), f"layer {idx}: states differ"


class _ReplayingGraph:
    """Stands in for a captured CUDA graph on the CPU: a replay runs the captured function on the static
    inputs into the static output, as a real replay would (the bookkeeping around it is what is tested)."""

    def __init__(self, fn, static_in, static_out):
        self.fn, self.static_in, self.static_out = fn, static_in, static_out

    def replay(self):
        self.static_out.copy_(self.fn(*self.static_in))


def test_chunk_graph_bookkeeping(monkeypatch):
    """The chunk graphs' cache without a GPU (the capture replaced by a replaying stand-in): a shape is
    captured at its second call and replayed after, at most four graphs are kept (the least recently
    replayed goes, and runs eagerly once more before its recapture), a shape whose capture failed is never
    tried again, calls past 512 tokens stay eager, a row reorder drops every graph, and the logits equal
    an eager run's throughout."""
    from transformers import DynamicCache

    import leapquant.integrations.backends as backends
    import leapquant.integrations.row_groups as row_groups

    captures = []

    def fake_capture(fn, static_in, warmup=0):
        lengths = static_in[0].shape[1]
        captures.append(lengths)
        if lengths == 7:  # as if a host synchronisation broke this shape's capture
            return False
        graph = _ReplayingGraph(fn, static_in, torch.empty(static_in[2].shape, dtype=torch.float32))
        return graph, static_in, graph.static_out

    def run(graphs: bool):
        model = tiny_model("qwen3_5", d=16)
        ids = torch.randint(0, 64, (4, 220), generator=torch.Generator().manual_seed(4))
        cache = DynamicCache(config=model.config)
        patched = leapquant.patch(model, ["fp32", "int8"], graphs=graphs)
        lengths = [2, 2, 3, 3, 4, 4, 5, 5, 2, 6, 6, 3, 7, 7, 7, 9, 9, 3, 2]  # 3: evicted by 6, seen again
        out, s = [model(ids[:, :4], past_key_values=cache, use_cache=True).logits], 4
        for n in lengths:
            out.append(model(ids[:, s : s + n], past_key_values=cache, use_cache=True).logits)
            s += n
        groups = cache._leapquant_states[0]
        state = (groups._chunk_graphs.copy(), set(groups._chunk_seen), set(groups._chunk_uncapturable))
        groups.select_rows(torch.tensor([1, 0, 3, 2]))
        assert not (groups._chunk_graphs or groups._chunk_seen or groups._chunk_uncapturable)
        patched.unpatch()
        return torch.cat(out, 1), state

    want, _ = run(graphs=False)
    monkeypatch.setattr(backends, "_capture", fake_capture)
    monkeypatch.setattr(row_groups, "_CHUNK_GRAPH_MAX_TOKENS", 8)  # 9 tokens: eager however often
    monkeypatch.setattr(
        row_groups.RowGroups, "_chunk_graphable", lambda self, q: self.graphs
    )  # as if on CUDA
    got, (graphs, seen, failed) = run(graphs=True)
    assert torch.equal(got, want)
    layers = len(linear_attention_layers(tiny_model("qwen3_5", d=16)))
    # one layer's story: 2-5 captured at their second call; a hit on 2 makes 3 the oldest, so 6 evicts it;
    # 3 then runs eagerly once and is recaptured (evicting 4); 7's capture fails once and is never retried;
    # 9 is past the token limit
    assert captures == [n for n in (2, 3, 4, 5, 6, 7, 3) for _ in range(layers)]
    assert [key[0][0][0][1] for key in graphs] == [5, 6, 3, 2]  # least recently replayed first
    assert {key[0][0][0][1] for key in failed} == {7}
    assert {key[0][0][0][1] for key in seen} == {2, 3, 5, 6, 7}


@pytest.mark.parametrize("methods", [["int8"], ["fp32", "int8"]], ids=["one-group", "two-groups"])
def test_step_outputs_in_reused_buffers_are_copied_out_in_time(monkeypatch, methods):
    """A replayed KernelState step returns its graph's output buffer, which its next step overwrites. Each
    state here returns one reused buffer per step, as a replay does: multi-token calls and decode steps
    must still give an ordinary run's logits (each step's output copied out before the next step). One
    method group is the case that matters (two are concatenated, which copies)."""
    from transformers import DynamicCache

    import leapquant.integrations.backends as backends

    def run():
        model = tiny_model("qwen3_5", d=16)
        ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(5))
        cache = DynamicCache(config=model.config)
        patched = leapquant.patch(model, methods, graphs=False)
        out, s = [model(ids[:, :4], past_key_values=cache, use_cache=True).logits], 4
        for n in (5, 1, 1, 3, 1):
            out.append(model(ids[:, s : s + n], past_key_values=cache, use_cache=True).logits)
            s += n
        patched.unpatch()
        return torch.cat(out, 1)

    want = run()
    buffers = {}
    for cls in (backends.NativeState, backends.DequantizedState):
        original = cls.step

        def step(self, *args, _original=original, **kwargs):
            o = _original(self, *args, **kwargs)
            buf = buffers.setdefault(id(self), torch.empty_like(o))
            buf.copy_(o)
            return buf

        monkeypatch.setattr(cls, "step", step)
    got = run()
    assert buffers  # the stand-in ran
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("method", "backend", "capturable"),
    [
        ("int8/w4+ct2+smooth", "triton", True),
        ("int8", "auto", False),
        ("int8/w4+ct2+smooth", "reference", False),
    ],
    ids=["kernel-pool", "per-step-round-trip", "reference"],
)
def test_only_kernel_pools_may_run_inside_a_callers_graph(method, backend, capturable):
    """A state that replaces its tensor every step would be frozen by a caller's graph replay: the layer
    refuses such a capture by name instead of returning stale outputs (the check the CUDA path runs when
    ``torch.cuda.is_current_stream_capturing()``)."""
    from transformers import DynamicCache

    device = KERNEL_DEVICE if backend == "triton" else "cpu"  # on a GPU "auto" would pick a kernel pool
    model = tiny_model("qwen3_5", d=16).to(device)
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1)).to(device)
    cache = DynamicCache(config=model.config)
    patched = leapquant.patch(model, method, backend=backend)
    model(ids, past_key_values=cache, use_cache=True)
    for groups in cache._leapquant_states.values():
        if capturable:
            groups._check_capturable()
        else:
            with pytest.raises(LeapQuantError, match="is not a kernel pool"):
                groups._check_capturable()
    patched.unpatch()


@pytest.mark.parametrize(("d_k", "d_v"), [(128, 128), (96, 128), (128, 80)], ids=["128x128", "dk96", "dv80"])
def test_auto_backend_keeps_heads_the_kernels_cannot_tile_on_the_reference(d_k, d_v):
    """The choice is made before a state exists (no CUDA needed): ``auto`` picks the kernel pool only for
    heads it can tile, and ``triton`` refuses the others up front."""
    from leapquant.integrations.backends import KernelState, ReferenceState, make_state
    from leapquant.methods.config import parse_method

    tileable = d_k == 128 and d_v == 128
    args = dict(device=torch.device("cuda"), decay="scalar", recurrent_fn=None, head_dims=(d_k, d_v))
    st = make_state(parse_method("leapquant-int8"), backend="auto", **args)
    assert isinstance(st, KernelState if tileable else ReferenceState)
    if tileable:
        assert isinstance(make_state(parse_method("leapquant-int8"), backend="triton", **args), KernelState)
    else:
        with pytest.raises(LeapQuantError, match=r"backend 'triton'.*not a power of two"):
            make_state(parse_method("leapquant-int8"), backend="triton", **args)


def test_triton_backend_on_cpu_tensors_without_the_interpreter_is_refused_by_name(monkeypatch):
    """Compiled Triton kernels take CUDA tensors only: on the CPU without ``TRITON_INTERPRET=1`` the
    ``triton`` backend is refused before anything runs, not with Triton's pointer error mid-step (a GPU
    machine running a CPU model); ``auto`` keeps such tensors on the reference."""
    from leapquant.integrations.backends import KernelState, make_state
    from leapquant.methods.config import parse_method
    from leapquant.ops.checks import use_triton

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = dict(device=torch.device("cpu"), decay="scalar", recurrent_fn=None, head_dims=(128, 128))
    with pytest.raises(LeapQuantError, match="the kernels take CUDA tensors, these are on cpu"):
        make_state(parse_method("leapquant-int8"), backend="triton", **args)
    with pytest.raises(LeapQuantError, match="TRITON_INTERPRET=1"):
        use_triton(torch.device("cpu"), "triton")
    assert not isinstance(make_state(parse_method("leapquant-int8"), backend="auto", **args), KernelState)
    assert use_triton(torch.device("cpu"), "auto") is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert isinstance(make_state(parse_method("leapquant-int8"), backend="triton", **args), KernelState)
    assert use_triton(torch.device("cpu"), "triton") is True
