"""Built-in model presets, and the one place a model name is looked up (:func:`resolve_preset`,
:func:`load_shape`), so that ``leapquant memory``, the decode-bench model and the vLLM check share names.

Each preset is the subset of a model's published ``config.json`` that shapes its weights, caches and decode
step, parsed by :func:`~leapquant.plan.models.shape_from_config` like a user's file.  The Hugging Face
files themselves could not be fetched here (no network); the values were read from public copies and
cross-checked against at least two independent sources each, listed per preset.  The transformers class
defaults named below are in ``transformers/models/<type>/configuration_<type>.py`` (transformers 5.17).

Published sizes the tests compare against (``tests/test_memory.py``): Qwen3.5-9B's safetensors index
totals 19,306,216,416 bytes of bf16 = 9.653 B parameters including its vision tower and MTP head;
the other three are known only by their names (35 B, 80 B, 48 B total parameters).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..errors import LeapQuantError, did_you_mean
from .models import HybridShape, periodic_layer_types, read_config, shape_from_config

__all__ = ["ALIASES", "BYTE_VOCAB", "PRESETS", "byte_hybrid_config", "load_shape", "resolve_preset"]

_QWEN_VISION = {  # Qwen3.5 vision tower (same for 9B and 35B-A3B, except out_hidden_size = text hidden)
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 2304,
}
_QWEN_GDN = {
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "head_dim": 256,
    "attn_output_gate": True,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

QWEN35_9B = {
    "model_type": "qwen3_5",
    "text_config": {
        "model_type": "qwen3_5_text",
        **_QWEN_GDN,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "vocab_size": 248320,
        "mtp_num_hidden_layers": 1,
    },
    "vision_config": {**_QWEN_VISION, "out_hidden_size": 4096},
}
QWEN35_9B_SOURCE = (
    "Qwen/Qwen3.5-9B config.json text_config (hidden_size 4096, 32 layers, full_attention_interval 4, "
    "linear_num_key_heads 16, linear_num_value_heads 32, linear_key/value_head_dim 128, "
    "linear_conv_kernel_dim 4, num_attention_heads 16, num_key_value_heads 4, head_dim 256, "
    "attn_output_gate true, partial_rotary_factor 0.25, intermediate_size 12288, vocab_size 248320, "
    "untied LM head), as quoted in public test fixtures; equal to transformers 5.17 Qwen3_5TextConfig "
    "defaults ('Qwen3.5-9B style configuration')"
)
"""Qwen/Qwen3.5-9B.  Sources: a test fixture that copies the real config.json (text and vision config,
"run against the real Qwen3.5-9B config", with the checkpoint's 19,306,216,416-byte safetensors total);
transformers' ``Qwen3_5TextConfig`` defaults, documented as "the Qwen3.5-9B style configuration", are
identical (hidden 4096, 32 layers, intermediate 12288, 16/4 heads of 256, 16/32 linear heads of 128)."""

QWEN35_35B_A3B = {
    "model_type": "qwen3_5_moe",
    "text_config": {
        "model_type": "qwen3_5_moe_text",
        **_QWEN_GDN,
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "vocab_size": 248320,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "mtp_num_hidden_layers": 1,
    },
    "vision_config": {**_QWEN_VISION, "out_hidden_size": 2048},
}
"""Qwen/Qwen3.5-35B-A3B.  Sources: THUDM/slime ``scripts/models/qwen3.5-35B-A3B.sh`` (40 layers, hidden
2048, 16/2 heads of 256, 256 experts top-8 of 512, shared expert 512, 16/32 linear heads of 128, kernel 4,
vocab 248320); a test fixture quoting the config.json at revision 59d61f3c; transformers'
``Qwen3_5MoeTextConfig`` defaults ("Qwen3.5-35B-A3B style"), identical.  The vision_config and
``mtp_num_hidden_layers: 1`` were read from the published config of Qwen3.6-35B-A3B, which has the same
text config field for field; we did not see Qwen3.5-35B-A3B's own vision_config."""

QWEN3_NEXT_80B_A3B = {
    "model_type": "qwen3_next",
    **_QWEN_GDN,
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "mtp_num_hidden_layers": 1,
}
"""Qwen/Qwen3-Next-80B-A3B-Instruct.  Sources: THUDM/slime ``scripts/models/qwen3-next-80B-A3B.sh``
(48 layers, hidden 2048, ffn 5120 (unused: every layer is MoE), 16/2 heads of 256, 512 experts top-10 of
512, shared 512, vocab 151936, one MTP layer); a config quotation "48 L, 16 H, 2 KV, head 256, linear 32 V
/ 16 K heads x 128, full_attention_interval 4"; transformers' ``Qwen3NextConfig`` defaults (checkpoint
Qwen/Qwen3-Next-80B-A3B-Instruct) agree except ``intermediate_size`` (5632 there), which no layer uses.
The MTP field name in the real file was not seen (slime's ``--mtp-num-layers 1`` is the source)."""

KIMI_LINEAR_48B_A3B = {
    "model_type": "kimi_linear",
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 163840,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "moe_intermediate_size": 1024,
    "first_k_dense_replace": 1,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
    "mla_use_nope": True,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "head_dim": 128,
        "num_heads": 32,
        "short_conv_kernel_size": 4,
    },
}
KIMI_LINEAR_48B_A3B_SOURCE = (
    "moonshotai/Kimi-Linear-48B-A3B-Instruct config.json (hidden_size 2304, 27 layers, linear_attn_config "
    "full_attn_layers [4,8,12,16,20,24,27] (1-based), KDA num_heads 32 head_dim 128 short_conv 4; MLA "
    "32 heads, kv_lora_rank 512, q_lora_rank null, qk_nope 128, qk_rope 64, v_head_dim 128, mla_use_nope; "
    "num_experts 256, num_experts_per_token 8, num_shared_experts 1, moe_intermediate_size 1024, sigmoid "
    "router, moe_renormalize, routed_scaling_factor 2.446, first_k_dense_replace 1, intermediate_size 9216, "
    "vocab_size 163840, untied), as quoted in public test fixtures (Megatron-Bridge, mlx); transformers "
    "5.17 KimiLinearConfig defaults and modeling_kimi_linear for the layer structure"
)
"""moonshotai/Kimi-Linear-48B-A3B-Instruct.  Sources: three independent quotations of its config.json
(an engine test, a model-config resolver test and a KDA kernel note, all with the same values: 27 layers,
MLA at 1-based layers 4, 8, ..., 24, 27 (7 MLA + 20 KDA), 32 KDA heads of 128, kernel 4, MLA 32 heads with
kv_lora_rank 512, qk_rope 64, qk_nope 128, v 128, no q LoRA, 256 experts top-8 of 1024, one shared expert,
first layer dense 9216, vocab 163840); transformers' ``KimiLinearConfig`` defaults agree on every size but
its default layer pattern (6 MLA layers at 0-based multiples of 4), so the checkpoint's list is kept."""


def _preset(config: dict, name: str, source: str) -> HybridShape:
    return replace(shape_from_config(config, name=name), name=name, source=source)


PRESETS: dict[str, HybridShape] = {
    "qwen3.5-9b": _preset(QWEN35_9B, "Qwen3.5-9B", QWEN35_9B_SOURCE),
    "qwen3.5-35b-a3b": _preset(QWEN35_35B_A3B, "Qwen3.5-35B-A3B", "preset: Qwen/Qwen3.5-35B-A3B config.json"),
    "qwen3-next-80b-a3b": _preset(
        QWEN3_NEXT_80B_A3B, "Qwen3-Next-80B-A3B", "preset: Qwen/Qwen3-Next-80B-A3B-Instruct config.json"
    ),
    "kimi-linear-48b-a3b": _preset(KIMI_LINEAR_48B_A3B, "Kimi-Linear-48B-A3B", KIMI_LINEAR_48B_A3B_SOURCE),
}
"""Presets by canonical lower-case name (``leapquant memory --model qwen3.5-9b``; ``Qwen/Qwen3.5-9B`` works
too, and so do the :data:`ALIASES`)."""

ALIASES = {"qwen35-9b": "qwen3.5-9b", "kimi-linear-48b": "kimi-linear-48b-a3b"}
"""Older spellings (``leapquant bench decode`` used these) and the canonical preset each one names."""


def _key(name: str) -> str:
    """Lower case, without a Hugging Face organisation or an ``-Instruct`` suffix, aliases resolved."""
    key = name.strip().lower().rsplit("/", 1)[-1].removesuffix("-instruct")
    return ALIASES.get(key, key)


def resolve_preset(name: str) -> str:
    """The canonical preset name for ``name`` (case-insensitive; Hugging Face ids and aliases work)."""
    key = _key(name)
    if key not in PRESETS:
        raise LeapQuantError(
            f"unknown model {name!r}{did_you_mean(_key(name), PRESETS)} (presets: {', '.join(PRESETS)})"
        )
    return key


def load_shape(model: str) -> HybridShape:
    """A preset by name (as :func:`resolve_preset`), a shipped checkpoint's name, or a config.json / a
    directory holding one."""
    from ..checkpoints import checkpoint_names, checkpoint_path

    if _key(model) in PRESETS:
        return PRESETS[_key(model)]
    path = Path(model).expanduser()
    if not path.exists() and model in checkpoint_names():
        path = checkpoint_path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise LeapQuantError(
            f"model {model!r}: not a preset ({', '.join(PRESETS)}) and no config.json at {path}"
            + did_you_mean(_key(model), PRESETS)
        )
    return shape_from_config(read_config(path), name=str(path), source=str(path))


BYTE_VOCAB = 256 + 3
"""Vocabulary of the byte-level checkpoints: ids 0-2 special (pad, end of file, unknown), byte b is b + 3."""


def byte_hybrid_config(arch: str, tiny: bool = False) -> dict:
    """The shape fields of the small byte-level hybrids under ``checkpoints/`` (``config.json`` keys).

    ``scripts/train_checkpoints.py`` trains them (``arch`` ``"qwen35"``: Gated DeltaNet + gated attention,
    ``"kimi"``: KDA + MLA, dense MLPs); ``tiny`` is its CPU smoke size.  Both keep 3 linear : 1 full layers
    and real-size linear heads (head dim 128).  Kimi's MoE fields are unused (every MLP is dense).
    """
    layers, hidden, hd = (4, 64, 32) if tiny else (8, 256, 128)
    common = {"vocab_size": BYTE_VOCAB, "hidden_size": hidden, "num_hidden_layers": layers}
    common["layer_types"] = periodic_layer_types(layers, 4)
    if arch == "qwen35":
        return {
            "model_type": "qwen3_5_text",
            **common,
            "intermediate_size": 2 * hidden,
            "num_attention_heads": 2,
            "head_dim": hd,
            "num_key_value_heads": 1,
            "linear_num_key_heads": 1 if tiny else 2,
            "linear_num_value_heads": 2 if tiny else 4,
            "linear_key_head_dim": hd,
            "linear_value_head_dim": hd,
            "tie_word_embeddings": True,
        }
    if arch != "kimi":
        raise LeapQuantError(f"byte hybrid: arch must be 'qwen35' or 'kimi', got {arch!r}")
    return {
        "model_type": "kimi_linear",
        **common,
        "intermediate_size": 3 * hidden // 2,
        "mlp_layer_types": ["dense"] * layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "qk_nope_head_dim": hd // 4,
        "qk_rope_head_dim": hd // 4,
        "v_head_dim": hd // 2,
        "kv_lora_rank": hd,
        "q_lora_rank": None,
        "linear_num_heads": 2 if tiny else 4,
        "linear_head_dim": hd,
        "tie_word_embeddings": False,  # KimiLinearForCausalLM declares no tied weights
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": hidden // 2,
    }
