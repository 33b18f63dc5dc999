"""A patched model's caches: deep copies, unpatch writing states back, row reorders, plans as paths."""

from __future__ import annotations

import pytest
import torch
from tiny_models import dense_states, tiny_model

import leapquant
from leapquant import LeapQuantError
from leapquant.integrations import linear_attention_layers


@pytest.mark.parametrize("arch", ["qwen3_5", "kimi_linear"])
def test_copies_of_a_cache_and_of_a_patched_model(arch):
    """A deep copy of a cache (transformers' way to reuse a prompt) goes on exactly as the cache would:
    it copied the whole model and quantized its states again.  A patched model cannot be copied: the
    copy ran the original's weights, and unpatching it switched the original's states off."""
    import copy

    from transformers import DynamicCache

    model = tiny_model(arch, d=32, decay_scale=0.05)
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(13))
    patched = leapquant.patch(model, "int4/w8+ct2", backend="reference64")
    cache = DynamicCache(config=model.config)

    def rest(c):
        return torch.cat(
            [model(ids[:, t : t + 1], past_key_values=c, use_cache=True).logits for t in (9, 10)], 1
        )

    with torch.no_grad():
        model(ids[:, :9], past_key_values=cache, use_cache=True)
        copied = copy.deepcopy(cache)
        store = copied.__dict__["_leapquant_states"]
        assert all(groups.owner is patched for groups in store.values())
        assert torch.equal(rest(copied), rest(cache))
        unused = copy.deepcopy(cache)  # copied, never run under the patch: unpatch reaches it all the same
        want = patched.states(unused)
    with pytest.raises(LeapQuantError, match="a patched model cannot be copied"):
        copy.deepcopy(model)
    leapquant.unpatch(model)
    for idx, state in dense_states(model, unused).items():
        assert torch.equal(state, want[idx])


@pytest.mark.parametrize("arch", ["qwen3_5", "kimi_linear"])
def test_unpatch_gives_every_cache_its_states_back(arch):
    """After unpatch a cache held row ids where its states were: the unpatched model crashed on it or,
    on a cache prefilled before the patch, read [[0, 0, 0], [1, 1, 1]] as a state.  Now unpatch writes each
    state back dense, in the cache's row order (a reorder since the last step included), and so do
    states() and snapshot()."""
    from transformers import DynamicCache

    model = tiny_model(arch, d=32, decay_scale=0.05)
    ids = torch.randint(3, 64, (3, 12), generator=torch.Generator().manual_seed(14))
    order = torch.tensor([2, 0, 0])
    for prefilled_before in (False, True):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            if prefilled_before:
                model(ids[:, :8], past_key_values=cache, use_cache=True)
            patched = leapquant.patch(model, "int8/w4+ct2", backend="reference64")
            if not prefilled_before:
                model(ids[:, :8], past_key_values=cache, use_cache=True)
            model(ids[:, 8:9], past_key_values=cache, use_cache=True)
            before = patched.states(cache)
            cache.reorder_cache(order)
            dense = patched.states(cache)
            for idx, state in dense.items():
                assert torch.equal(state, before[idx][order])
            leapquant.unpatch(model)
            assert dense_states(model, cache).keys() == dense.keys()
            for idx, state in dense_states(model, cache).items():
                assert torch.equal(state, dense[idx])
            got = model(ids[order, 9:10], past_key_values=cache, use_cache=True).logits
        assert torch.isfinite(got).all()


def test_patch_takes_a_plan_as_a_path(tmp_path):
    from pathlib import Path

    from leapquant.methods import LayerPlan, parse_method

    model = tiny_model("qwen3_5")
    layers = [i for i, _ in linear_attention_layers(model)]
    plan = LayerPlan(tuple((i, parse_method("int8/w4")) for i in layers))
    path = plan.save(tmp_path / "plan.json")
    patched = leapquant.patch(model, Path(path))
    assert patched.methods[0].for_layer(layers[0]).name == "int8/w4"
    leapquant.unpatch(model)
