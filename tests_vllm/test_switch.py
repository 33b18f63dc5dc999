"""The switch itself, without an engine: how the plugin reads additional_config and what it refuses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import leapquant.integrations.vllm as plugin
from leapquant.errors import LeapQuantError


def config(extra):
    return SimpleNamespace(additional_config=extra)


def test_the_switch_is_read_from_additional_config():
    assert plugin.configured_method(config({})) is None
    assert plugin.configured_method(config({"gdn_prefill_backend": "auto"})) is None
    method = plugin.configured_method(config({"leapquant_method": "leapquant-int8"}))
    assert method.name == "int8/w16+ct4+smooth"
    with pytest.raises(LeapQuantError, match="must be a method name string"):
        plugin.configured_method(config({"leapquant_method": 8}))


def test_register_is_idempotent_and_puts_the_classes_in_place():
    from vllm.model_executor.custom_op import op_registry_oot

    from leapquant.integrations.vllm.layer import LeapQuantGatedDeltaNetAttention

    plugin.register()  # as vLLM does in each process (through the entry point)
    plugin.register()
    assert op_registry_oot["QwenGatedDeltaNetAttention"] is LeapQuantGatedDeltaNetAttention


def test_layers_without_a_leapquant_state_refuse_the_switch():
    calls = []
    guarded = plugin._refuse_other_layers(lambda layer, cfg: calls.append(layer) or "spec")
    mamba_layer = SimpleNamespace()  # e.g. a KDA or Mamba2 layer: no ``leapquant`` attribute
    assert guarded(mamba_layer, config({})) == "spec"
    with pytest.raises(LeapQuantError, match="have no LeapQuant state in vLLM"):
        guarded(mamba_layer, config({"leapquant_method": "leapquant-int8"}))
    ours = SimpleNamespace(leapquant=object())
    assert guarded(ours, config({"leapquant_method": "leapquant-int8"})) == "spec"
    assert len(calls) == 2


def test_a_vllm_the_layer_cannot_load_still_starts_engines_without_the_switch(monkeypatch, caplog):
    """vLLM runs the entry point unguarded in every engine: where our layer's imports fail (another vLLM
    moved a private name), register() must not raise, and only an engine with the switch is refused."""
    import sys

    from vllm.model_executor.layers.mamba.abstract import MambaBase

    monkeypatch.setitem(sys.modules, "leapquant.integrations.vllm.layer", None)  # its import now fails
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(MambaBase, "get_kv_cache_spec", lambda layer, cfg: "spec")
    with caplog.at_level("WARNING", logger="leapquant.integrations.vllm"):
        plugin.register()
    assert "its vLLM layer does not load against vllm" in caplog.text
    ours = SimpleNamespace(leapquant=object())  # even a layer that looks like ours: the plugin is off
    assert MambaBase.get_kv_cache_spec(ours, config({})) == "spec"
    with pytest.raises(LeapQuantError, match="plugin is off: its vLLM layer does not load"):
        MambaBase.get_kv_cache_spec(ours, config({"leapquant_method": "leapquant-int8"}))


def test_lora_is_refused_with_the_switch():
    from leapquant.integrations.vllm.layer import _gdn_pool

    cfg = SimpleNamespace(additional_config={"leapquant_method": "leapquant-int8"}, lora_config=object())
    with pytest.raises(LeapQuantError, match="LoRA adapters"):
        _gdn_pool(cfg)
    assert _gdn_pool(SimpleNamespace(additional_config={}, lora_config=object())) is None
