"""Tiny random-weight hybrid models of every supported architecture (tests only)."""

from __future__ import annotations

import torch

# Where tests run the Triton kernels on a model: the GPU when there is one; otherwise the CPU, through the
# interpreter conftest.py turns on (compiled kernels take CUDA tensors only).
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def _quiet_ids() -> dict:
    return dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_model(arch: str, *, seed: int = 0, d: int = 16, value_groups: int = 2, decay_scale: float = 1.0):
    """A 4-layer (3 linear : 1 full attention) model with heads of ``d x d`` states, float32, eval mode
    (``qwen3_5_vl``: Qwen3_5ForConditionalGeneration with a one-block vision tower).

    ``decay_scale`` < 1 shrinks ``A_log``'s exp (longer memory) so quantization error can accumulate.
    """
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        layer_types=LAYERS,
        **_quiet_ids(),
    )
    if arch in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        gdn = dict(
            linear_num_key_heads=1,
            linear_num_value_heads=value_groups,
            linear_key_head_dim=d,
            linear_value_head_dim=d,
            linear_conv_kernel_dim=4,
        )
        if arch == "qwen3_5":
            model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**common, **gdn))
        elif arch == "qwen3_5_moe":
            moe = dict(
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
            )
            model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**common, **gdn, **moe))
        else:
            moe = dict(
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
            )
            model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**common, **gdn, **moe))
    elif arch == "qwen3_5_vl":  # the multimodal model: its text path holds the GDN layers
        gdn = dict(linear_num_key_heads=1, linear_num_value_heads=value_groups, linear_key_head_dim=d,
                   linear_value_head_dim=d, linear_conv_kernel_dim=4)  # fmt: skip
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      patch_size=4, temporal_patch_size=1, spatial_merge_size=1)  # fmt: skip
        cfg = tf.Qwen3_5Config(text_config=dict(**common, **gdn), vision_config=vision)
        model = tf.Qwen3_5ForConditionalGeneration(cfg)
    elif arch == "kimi_linear":
        cfg = tf.KimiLinearConfig(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=2,
            layer_types=LAYERS,
            mlp_layer_types=["dense"] * 4,
            linear_num_heads=2,
            linear_head_dim=d,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            num_experts=4,
            num_experts_per_token=2,
            moe_intermediate_size=32,
            **_quiet_ids(),
        )
        model = tf.KimiLinearForCausalLM(cfg)
    else:
        raise ValueError(arch)
    if decay_scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("A_log"):
                    p.add_(torch.log(torch.tensor(decay_scale)))
    return model.float().eval()


ARCHS = ("qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_next", "kimi_linear")


def dense_states(model, cache) -> dict[int, torch.Tensor]:
    """Each linear-attention layer's dense state in ``cache`` (fp32), as the unpatched model keeps it."""
    from leapquant.integrations import linear_attention_layers

    return {idx: cache.layers[idx].recurrent_states[0].float() for idx, _ in linear_attention_layers(model)}
