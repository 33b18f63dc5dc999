"""vLLM plugin: a LeapQuant recurrent state for the GDN layers of Qwen3-Next, switched on per engine.

Installed with the package, loaded by vLLM in every process through the ``vllm.general_plugins`` entry point
(``leapquant = leapquant.integrations.vllm:register``), and inert unless the engine's ``additional_config``
names a method::

    LLM(model=..., additional_config={"leapquant_method": "leapquant-int8"})
    vllm serve ... --additional-config '{"leapquant_method": "leapquant-int8"}'

Any method with a pool layout (``leapquant-int8``, ``leapquant-int6``, ``leapquant-int4``,
``fp8-e4m3/w16+ct4+smooth``, ...) works; a name without one fails at engine start with one line.

* :mod:`.adapter` (no vLLM import): vLLM's GDN metadata -> pool calls; the state layout vLLM allocates.
* :mod:`.layer` (imports vLLM): the GDN layer and Qwen3-Next model classes registered by :func:`register`.
"""

from __future__ import annotations

from ...errors import LeapQuantError

__all__ = ["CONFIG_KEY", "configured_method", "register"]

CONFIG_KEY = "leapquant_method"
_ARCHITECTURE = "Qwen3NextForCausalLM"


def configured_method(vllm_config) -> str | None:
    """The method named by ``vllm_config.additional_config["leapquant_method"]``, or None when unset."""
    extra = getattr(vllm_config, "additional_config", None)
    method = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
    if method is None:
        return None
    if not isinstance(method, str):
        raise LeapQuantError(f"{CONFIG_KEY} must be a method name string, got {method!r}")
    return method


_registered = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point: put the LeapQuant-aware GDN layer and Qwen3-Next model in
    place of the in-tree ones. Both behave exactly as the in-tree classes unless ``leapquant_method`` is
    set, so an engine without the switch runs unchanged. Safe to call more than once."""
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    from .layer import LeapQuantGatedDeltaNetAttention

    QwenGatedDeltaNetAttention.register_oot(LeapQuantGatedDeltaNetAttention)
    ModelRegistry.register_model(_ARCHITECTURE, "leapquant.integrations.vllm.layer:LeapQuantQwen3NextForCausalLM")
    _registered = True
