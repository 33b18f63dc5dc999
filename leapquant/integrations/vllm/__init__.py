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

import logging

from ...errors import LeapQuantError

__all__ = ["ARCHITECTURE", "CONFIG_KEY", "TESTED_VLLM", "configured_method", "register"]

CONFIG_KEY = "leapquant_method"
ARCHITECTURE = "Qwen3NextForCausalLM"


def configured_method(vllm_config):
    """The :class:`~leapquant.methods.MethodConfig` named by ``vllm_config.additional_config
    ["leapquant_method"]`` (parsed here, where the name enters), or None when unset."""
    extra = getattr(vllm_config, "additional_config", None)
    method = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
    if method is None:
        return None
    if not isinstance(method, str):
        raise LeapQuantError(f"{CONFIG_KEY} must be a method name string, got {method!r}")
    from ...methods import parse_method

    try:
        return parse_method(method)
    except LeapQuantError as err:
        raise LeapQuantError(
            f"{CONFIG_KEY} {method!r} is not a method (`leapquant methods`): {err}"
        ) from None


# the vLLM the plugin's layer is written against (its private CPU helpers are this version's)
TESTED_VLLM = "0.32.0"
_registered = False
_log = logging.getLogger(__name__)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: put the LeapQuant-aware GDN layer and Qwen3-Next model in
    place of the in-tree ones. Both behave exactly as the in-tree classes unless ``leapquant_method`` is
    set, so an engine without the switch runs unchanged. Safe to call more than once.

    vLLM calls this in every process of every engine, unguarded, so nothing here may raise for an engine
    that never asked for LeapQuant: where the layer cannot load against the installed vLLM (another
    version moved a name it imports), a warning is logged and only engines with the switch are refused."""
    global _registered
    if _registered:
        return
    _registered = True
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    try:
        from vllm.model_executor.layers.mamba.abstract import MambaBase
    except ImportError as err:  # no guard can go in: the switch would be ignored without a word
        _log.error(
            "leapquant: the vLLM plugin is off and %s is ignored (vllm %s): %s", CONFIG_KEY, version, err
        )
        return
    try:
        from vllm import ModelRegistry
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

        from .layer import LeapQuantGatedDeltaNetAttention
    except ImportError as err:
        why = f"its vLLM layer does not load against vllm {version} (tested with {TESTED_VLLM}): {err}"
        _log.warning("leapquant: %s; engines without %s run as usual", why, CONFIG_KEY)
        MambaBase.get_kv_cache_spec = _refuse_other_layers(MambaBase.get_kv_cache_spec, unavailable=why)
        return
    if version != TESTED_VLLM:
        _log.warning("leapquant: the vLLM plugin is tested with vllm %s, this is %s", TESTED_VLLM, version)
    QwenGatedDeltaNetAttention.register_oot(LeapQuantGatedDeltaNetAttention)
    ModelRegistry.register_model(
        ARCHITECTURE, "leapquant.integrations.vllm.layer:LeapQuantQwen3NextForCausalLM"
    )
    MambaBase.get_kv_cache_spec = _refuse_other_layers(MambaBase.get_kv_cache_spec)


def _refuse_other_layers(get_kv_cache_spec, unavailable: str | None = None):
    """Every recurrent layer of vLLM declares its state through ``get_kv_cache_spec`` at engine start: with
    the switch on, a layer that keeps vLLM's own state (KDA, Mamba, a model the plugin does not cover) stops
    the engine there, so a LeapQuant run never silently decodes with a full-precision state.
    ``unavailable``: why the plugin's own layer did not load (every layer is then refused, with that)."""

    def guarded(self, vllm_config):
        method = configured_method(vllm_config)
        if method is not None and unavailable is not None:
            raise LeapQuantError(
                f"{CONFIG_KEY}={method.name!r}: the leapquant vLLM plugin is off: {unavailable}"
            )
        if method is not None and getattr(self, "leapquant", None) is None:
            raise LeapQuantError(
                f"{CONFIG_KEY}={method.name!r}: {type(self).__name__} layers have no LeapQuant state in vLLM "
                f"(the plugin covers the GDN layers of {ARCHITECTURE}); remove the switch for this model"
            )
        return get_kv_cache_spec(self, vllm_config)

    return guarded
