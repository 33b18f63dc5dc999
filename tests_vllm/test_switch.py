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
