"""Model shapes for capacity planning: layer counts, linear-attention heads, KV cache and weights.

A :class:`HybridShape` is everything the memory planner needs to know about a hybrid model: how many
linear-attention (GDN / KDA) and full-attention (GQA / MLA) layers it has, the head counts and dims of
each, its convolution, its layer pattern, and the shapes of its weights.  It comes from a transformers
``config.json`` (:func:`shape_from_config`, model types ``qwen3_5``, ``qwen3_5_text``, ``qwen3_5_moe``,
``qwen3_5_moe_text``, ``qwen3_next``, ``kimi_linear``); the built-in presets and the name lookup
(``load_shape``) live in :mod:`leapquant.plan.presets`, which imports this module and never the reverse.

Weights are enumerated tensor by tensor (:meth:`HybridShape.weight_tensors`) in transformers' layout
(fused MoE experts ``[E, 2I, H]`` / ``[E, H, I]``), so the parameter count is the sum of real shapes, and
``scripts/memory_check.py`` can allocate them.  The vision tower of the multimodal Qwen3.5 checkpoints is
counted (engines load it) as one block; multi-token-prediction (MTP) weights are counted separately in
:attr:`HybridShape.mtp_params` and are not loaded unless speculative decoding is on.  Nothing here imports
torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import LeapQuantError

__all__ = ["MODEL_TYPES", "HybridShape", "periodic_layer_types", "read_config", "shape_from_config"]

MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "kimi_linear")


@dataclass(frozen=True)
class HybridShape:
    """The shape of a hybrid linear-attention model (all sizes in elements; bytes are the planner's job).

    Attributes:
        name: display name; model_type: the transformers model type it follows (decides weight layout).
        linear_layers, full_layers: number of linear-attention and full-attention layers.
        hidden, vocab: model width and vocabulary; tie_embeddings: lm_head shares the embedding.
        heads_k, heads_v: linear-attention key heads ``HK`` and value heads ``HV`` (the state is one
            ``d_k x d_v`` matrix per value head); d_k, d_v: linear-attention head dims.
        decay: ``"scalar"`` (GDN: one decay per head) or ``"vector"`` (KDA: one per key channel).
        conv_kernel: short-convolution kernel size (the engine keeps ``conv_kernel - 1`` columns).
        attention: ``"gqa"`` or ``"mla"`` for the full-attention layers.
        attn_heads: query heads; kv_heads, head_dim: GQA key/value heads and head dim;
            attn_gate: Qwen's output gate (``q_proj`` is twice as wide).
        rotary_dim: GQA rotary dims of each head (``partial_rotary_factor * head_dim``).
        kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim: MLA dims (the cache holds
            ``kv_lora_rank + qk_rope_head_dim`` values per token and layer).
        intermediate: dense-MLP width; dense_layers: layers with a dense MLP (the rest are MoE).
        experts, moe_intermediate, shared_intermediate, top_k: MoE shape (``experts == 0``: dense model);
            routed_scaling_factor: the factor on the renormalised routed-expert weights.
        rms_norm_eps: the epsilon of every RMSNorm.
        full_layer_ids: 0-based indices of the full-attention layers (``()``: the pattern is not known,
            as in a :meth:`reduced` shape).
        vision_params: parameters of the vision tower engines load with the model (0: text only).
        mtp_params: parameters of the multi-token-prediction head (not loaded by default).
        source: where the numbers come from.
    """

    name: str
    model_type: str
    linear_layers: int
    full_layers: int
    hidden: int
    vocab: int
    heads_k: int
    heads_v: int
    d_k: int = 128
    d_v: int = 128
    decay: str = "scalar"
    conv_kernel: int = 4
    attention: str = "gqa"
    attn_heads: int = 16
    kv_heads: int = 2
    head_dim: int = 256
    attn_gate: bool = True
    rotary_dim: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    intermediate: int = 0
    dense_layers: int = 0
    experts: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    top_k: int = 0
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    full_layer_ids: tuple[int, ...] = ()
    tie_embeddings: bool = False
    vision_params: int = 0
    mtp_params: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise LeapQuantError(f"model {self.name}: model_type must be one of {MODEL_TYPES}")
        if self.decay not in ("scalar", "vector"):
            raise LeapQuantError(f"model {self.name}: decay must be 'scalar' or 'vector', got {self.decay!r}")
        if self.attention not in ("gqa", "mla"):
            raise LeapQuantError(
                f"model {self.name}: attention must be 'gqa' or 'mla', got {self.attention!r}"
            )
        positive = ["hidden", "vocab", "heads_k", "heads_v", "d_k", "d_v", "conv_kernel", "attn_heads"]
        positive += (
            ["kv_lora_rank", "qk_rope_head_dim"] if self.attention == "mla" else ["kv_heads", "head_dim"]
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise LeapQuantError(f"model {self.name}: {name} must be >= 1, got {getattr(self, name)}")
        if self.linear_layers < 1 or self.full_layers < 0:
            raise LeapQuantError(
                f"model {self.name}: needs >= 1 linear-attention layer and >= 0 full-attention layers, "
                f"got {self.linear_layers} and {self.full_layers}"
            )
        if not 0 <= self.dense_layers <= self.layers:
            raise LeapQuantError(f"model {self.name}: dense_layers must be in 0..{self.layers}")
        if self.experts == 0 and self.dense_layers != self.layers:
            raise LeapQuantError(f"model {self.name}: a model without experts has only dense MLP layers")
        if self.heads_v % self.heads_k:
            raise LeapQuantError(f"model {self.name}: heads_v ({self.heads_v}) must be a multiple of heads_k")
        ids = self.full_layer_ids
        if ids and (len(ids) != self.full_layers or list(ids) != sorted(set(ids)) or ids[-1] >= self.layers):
            raise LeapQuantError(
                f"model {self.name}: full_layer_ids {ids} are not {self.full_layers} distinct layer indices "
                f"in 0..{self.layers - 1}"
            )

    @property
    def layers(self) -> int:
        """Decoder layers of both kinds."""
        return self.linear_layers + self.full_layers

    @property
    def layer_types(self) -> tuple[str, ...]:
        """``"linear"`` / ``"full"`` per layer (``()`` when :attr:`full_layer_ids` is not known)."""
        if not self.full_layer_ids and self.full_layers:
            return ()
        return tuple("full" if i in self.full_layer_ids else "linear" for i in range(self.layers))

    @property
    def full_attention_interval(self) -> int:
        """``p`` when every ``p``-th layer (1-based) is full attention, allowing one extra full-attention last
        layer (Kimi-Linear); 0 when the pattern has no such period or is not known."""
        ids = self.full_layer_ids
        if not ids:
            return 0
        p = ids[0] + 1
        regular = set(range(p - 1, self.layers, p))
        return p if set(ids) in (regular, regular | {self.layers - 1}) else 0

    @property
    def gate_rank(self) -> int:
        """KDA's low-rank forget/output gate projections (rank ``d_k``); 0 for GDN."""
        return self.d_k if self.decay == "vector" else 0

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: queries, keys (``HK * d_k`` each) and values (``HV * d_v``)."""
        return 2 * self.heads_k * self.d_k + self.heads_v * self.d_v

    @property
    def kv_values_per_token(self) -> int:
        """KV-cache values per token and full-attention layer (GQA: K and V heads; MLA: latent + rope key)."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.kv_heads * self.head_dim

    @property
    def params(self) -> int:
        """Parameters an engine loads: language model (embeddings, layers, lm_head) and vision tower."""
        return sum(math.prod(s) for _, s in self.weight_tensors())

    def reduced(self, linear_layers: int, full_layers: int) -> HybridShape:
        """The same model with fewer layers (for allocation checks on one GPU); vision and MTP dropped."""
        layers = linear_layers + full_layers
        dense = min(self.dense_layers, layers) if self.experts else layers
        return replace(
            self,
            name=f"{self.name} ({linear_layers}+{full_layers} layers)",
            linear_layers=linear_layers,
            full_layers=full_layers,
            dense_layers=dense,
            full_layer_ids=(),
            vision_params=0,
            mtp_params=0,
        )

    def weight_tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every weight tensor as ``(name, shape)``, one entry per layer, transformers' layout.

        The vision tower is one flat entry ``visual`` of :attr:`vision_params` elements.
        """
        h, out = self.hidden, []
        out.append(("embed_tokens", (self.vocab, h)))
        if not self.tie_embeddings:
            out.append(("lm_head", (self.vocab, h)))
        out.append(("norm", (h,)))
        for i in range(self.linear_layers):
            out += [(f"linear.{i}.{n}", s) for n, s in self._linear_attn()]
        for i in range(self.full_layers):
            out += [(f"full.{i}.{n}", s) for n, s in self._full_attn()]
        for i in range(self.layers):
            out.append((f"layer.{i}.norms", (2 * h,)))
            kind = "dense" if i < self.dense_layers else "moe"
            out += [(f"layer.{i}.{n}", s) for n, s in self._mlp(kind)]
        if self.vision_params:
            out.append(("visual", (self.vision_params,)))
        return out

    def _linear_attn(self) -> list[tuple[str, tuple[int, ...]]]:
        h, hv, dv, r = self.hidden, self.heads_v, self.d_v, self.gate_rank
        conv = [("conv1d", (self.conv_dim, 1, self.conv_kernel))]
        if self.model_type == "kimi_linear":  # KDA: HK == HV, per-key-channel forget gate, low-rank gates
            qkv = hv * dv
            return [
                ("q_proj", (qkv, h)), ("k_proj", (qkv, h)), ("v_proj", (qkv, h)), *conv,
                ("f_a_proj", (r, h)), ("f_b_proj", (qkv, r)), ("dt_bias", (qkv,)), ("A_log", (hv,)),
                ("b_proj", (hv, h)), ("g_a_proj", (r, h)), ("g_b_proj", (qkv, r)), ("o_norm", (dv,)),
                ("o_proj", (h, qkv)),
            ]  # fmt: skip
        # GDN (Qwen3.5 in_proj_qkv/z/b/a; Qwen3-Next fuses them as in_proj_qkvz/ba: same count)
        return [
            ("in_proj_qkvz", (self.conv_dim + hv * dv, h)), ("in_proj_ba", (2 * hv, h)), *conv,
            ("dt_bias", (hv,)), ("A_log", (hv,)), ("norm", (dv,)), ("out_proj", (h, hv * dv)),
        ]  # fmt: skip

    def _full_attn(self) -> list[tuple[str, tuple[int, ...]]]:
        h, nh = self.hidden, self.attn_heads
        if self.attention == "mla":  # Kimi-Linear: no q LoRA, shared rope key, latent KV
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            r = self.kv_lora_rank
            return [
                ("q_proj", (nh * qk, h)), ("kv_a_proj_with_mqa", (r + self.qk_rope_head_dim, h)),
                ("kv_a_layernorm", (r,)), ("kv_b_proj", (nh * (self.qk_nope_head_dim + self.v_head_dim), r)),
                ("o_proj", (h, nh * self.v_head_dim)),
            ]  # fmt: skip
        hd, kv = self.head_dim, self.kv_heads
        q = nh * hd * (2 if self.attn_gate else 1)
        return [
            ("q_proj", (q, h)), ("k_proj", (kv * hd, h)), ("v_proj", (kv * hd, h)),
            ("o_proj", (h, nh * hd)), ("q_norm", (hd,)), ("k_norm", (hd,)),
        ]  # fmt: skip

    def _mlp(self, kind: str) -> list[tuple[str, tuple[int, ...]]]:
        h = self.hidden
        if kind == "dense":
            return [
                ("mlp.gate_up_proj", (2 * self.intermediate, h)),
                ("mlp.down_proj", (h, self.intermediate)),
            ]
        e, i, s = self.experts, self.moe_intermediate, self.shared_intermediate
        out = [
            ("mlp.gate", (e, h)),
            ("mlp.experts.gate_up_proj", (e, 2 * i, h)),
            ("mlp.experts.down_proj", (e, h, i)),
            ("mlp.shared.gate_up_proj", (2 * s, h)),
            ("mlp.shared.down_proj", (h, s)),
        ]
        if self.model_type == "kimi_linear":
            out.append(("mlp.gate.e_score_correction_bias", (e,)))
        else:
            out.append(("mlp.shared_expert_gate", (1, h)))
        return out


def _qwen_vision_params(vc: dict) -> int:
    """Parameters of the Qwen3.5 vision tower (transformers' ``Qwen3_5VisionModel``) from its config."""
    d, inter = vc["hidden_size"], vc["intermediate_size"]
    merged = d * vc.get("spatial_merge_size", 2) ** 2
    patch = (
        vc.get("in_channels", 3) * vc.get("temporal_patch_size", 2) * vc.get("patch_size", 16) ** 2 * d + d
    )
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (2 * d * inter + inter + d)
    merger = 2 * d + (merged * merged + merged) + (merged * vc["out_hidden_size"] + vc["out_hidden_size"])
    return patch + vc.get("num_position_embeddings", 2304) * d + vc["depth"] * block + merger


def _mtp_params(shape: HybridShape, layers: int) -> int:
    """Qwen MTP head: per layer one full-attention decoder layer, plus ``fc (2H -> H)`` and three norms."""
    if not layers:
        return 0
    h = shape.hidden
    kind = "dense" if shape.experts == 0 else "moe"
    per_layer = sum(math.prod(s) for _, s in shape._full_attn() + shape._mlp(kind)) + 2 * h
    return layers * per_layer + 2 * h * h + 3 * h


def shape_from_config(config: dict, name: str = "config.json", source: str = "") -> HybridShape:
    """A :class:`HybridShape` from a transformers config dict (multimodal Qwen3.5: ``text_config`` inside)."""
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise LeapQuantError(
            f"{name}: model_type {model_type!r} is not a hybrid linear-attention model this planner knows "
            f"(supported: {', '.join(MODEL_TYPES)})"
        )
    text = config.get("text_config") if model_type in ("qwen3_5", "qwen3_5_moe") else None
    vision = config.get("vision_config")
    cfg = dict(text or config)
    try:
        shape = (
            _kimi(cfg, name, source) if model_type == "kimi_linear" else _qwen(cfg, model_type, name, source)
        )
    except KeyError as exc:
        raise LeapQuantError(f"{name}: config has no {exc.args[0]!r} (model_type {model_type})") from None
    except TypeError as exc:
        raise LeapQuantError(f"{name}: malformed config ({exc})") from None
    extra = {"mtp_params": _mtp_params(shape, int(cfg.get("mtp_num_hidden_layers", 0) or 0))}
    if vision and model_type in ("qwen3_5", "qwen3_5_moe"):
        try:
            extra["vision_params"] = _qwen_vision_params(vision)
        except KeyError as exc:
            raise LeapQuantError(f"{name}: vision_config has no {exc.args[0]!r}") from None
    return replace(shape, **extra)


def periodic_layer_types(layers: int, interval: int = 4) -> list[str]:
    """transformers ``layer_types`` where every ``interval``-th layer (1-based) is full attention (Qwen's
    ``full_attention_interval``; 3 linear : 1 full at the default 4)."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


def _qwen(cfg: dict, model_type: str, name: str, source: str) -> HybridShape:
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or periodic_layer_types(n, cfg.get("full_attention_interval", 4))
    _check_types(types, n, name)
    full = sum(t == "full_attention" for t in types)
    experts = cfg.get("num_experts", 0) if "moe" in model_type or model_type == "qwen3_next" else 0
    if experts:
        step = cfg.get("decoder_sparse_step", 1) or 1
        only = set(cfg.get("mlp_only_layers") or [])
        dense = sum(1 for i in range(n) if i in only or (i + 1) % step)
        if dense and any(i in only or (i + 1) % step for i in range(n - dense, n)):
            raise LeapQuantError(f"{name}: dense MLP layers must come first (mlp_only_layers / sparse step)")
    else:
        dense = n
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rotary = cfg.get("partial_rotary_factor") or (cfg.get("rope_parameters") or {}).get(
        "partial_rotary_factor"
    )
    return HybridShape(
        name=cfg.get("_name_or_path") or name,
        model_type=model_type,
        linear_layers=n - full,
        full_layers=full,
        hidden=cfg["hidden_size"],
        vocab=cfg["vocab_size"],
        heads_k=cfg["linear_num_key_heads"],
        heads_v=cfg["linear_num_value_heads"],
        d_k=cfg["linear_key_head_dim"],
        d_v=cfg["linear_value_head_dim"],
        decay="scalar",
        conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
        attention="gqa",
        attn_heads=cfg["num_attention_heads"],
        kv_heads=cfg["num_key_value_heads"],
        head_dim=head_dim,
        attn_gate=cfg.get("attn_output_gate", True),
        rotary_dim=int(head_dim * (rotary or 0.25)),  # 0.25: transformers' default for every Qwen type here
        intermediate=cfg.get("intermediate_size", 0) if dense else 0,
        dense_layers=dense,
        experts=experts,
        moe_intermediate=cfg.get("moe_intermediate_size", 0) if experts else 0,
        shared_intermediate=cfg.get("shared_expert_intermediate_size", 0) if experts else 0,
        top_k=cfg.get("num_experts_per_tok", 0) if experts else 0,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        full_layer_ids=tuple(i for i, t in enumerate(types) if t == "full_attention"),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        source=source,
    )


def _kimi(cfg: dict, name: str, source: str) -> HybridShape:
    n = cfg["num_hidden_layers"]
    lin = cfg.get("linear_attn_config") or {}
    if cfg.get("layer_types"):
        types = cfg["layer_types"]
    elif "full_attn_layers" in lin:  # 1-based in the checkpoint
        full_ids = set(lin["full_attn_layers"])
        types = ["full_attention" if i + 1 in full_ids else "linear_attention" for i in range(n)]
    else:  # transformers' KimiLinearConfig default
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    _check_types(types, n, name)
    full = sum(t == "full_attention" for t in types)
    heads = lin.get("num_heads", cfg.get("linear_num_heads", 32))
    dim = lin.get("head_dim", cfg.get("linear_head_dim", 128))
    experts = cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0
    dense = min(n, cfg.get("first_k_dense_replace", 1)) if experts else n
    mlp_types = cfg.get("mlp_layer_types")  # transformers' KimiLinearConfig spells the MLP pattern out
    if experts and mlp_types:
        dense = sum(t == "dense" for t in mlp_types)
        if len(mlp_types) != n or any(t == "dense" for t in mlp_types[dense:]):
            raise LeapQuantError(f"{name}: mlp_layer_types must list {n} layers, the dense ones first")
        experts = experts if dense < n else 0  # every MLP dense: the MoE fields are unused
    n_heads = cfg["num_attention_heads"]
    if cfg.get("q_lora_rank"):
        raise LeapQuantError(f"{name}: MLA with q_lora_rank is not modelled (Kimi-Linear has none)")
    shared = cfg.get("num_shared_experts", cfg.get("n_shared_experts", 1))
    return HybridShape(
        name=cfg.get("_name_or_path") or name,
        model_type="kimi_linear",
        linear_layers=n - full,
        full_layers=full,
        hidden=cfg["hidden_size"],
        vocab=cfg["vocab_size"],
        heads_k=heads,
        heads_v=heads,
        d_k=dim,
        d_v=dim,
        decay="vector",
        conv_kernel=lin.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", 4)),
        attention="mla",
        attn_heads=n_heads,
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        v_head_dim=cfg.get("v_head_dim") or cfg["qk_nope_head_dim"],
        intermediate=cfg.get("intermediate_size", 0),
        dense_layers=dense,
        experts=experts,
        moe_intermediate=cfg.get("moe_intermediate_size", 0) if experts else 0,
        shared_intermediate=cfg.get("moe_intermediate_size", 0) * shared if experts else 0,
        top_k=cfg.get("num_experts_per_token", cfg.get("num_experts_per_tok", 0)) if experts else 0,
        routed_scaling_factor=cfg.get("routed_scaling_factor", 2.446)
        if experts
        else 1.0,  # transformers' default
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        full_layer_ids=tuple(i for i, t in enumerate(types) if t == "full_attention"),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        source=source,
    )


def _check_types(types: list, n: int, name: str) -> None:
    if len(types) != n:
        raise LeapQuantError(f"{name}: layer_types has {len(types)} entries for {n} layers")
    bad = sorted({t for t in types if t not in ("linear_attention", "full_attention")})
    if bad:
        raise LeapQuantError(
            f"{name}: unsupported layer types {bad} (linear_attention / full_attention only)"
        )
    if "linear_attention" not in types:
        raise LeapQuantError(f"{name}: no linear_attention layer, nothing for the recurrent-state planner")


def read_config(path: Path) -> dict:
    """A ``config.json`` file as a dict (the caller checks that it exists)."""
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LeapQuantError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LeapQuantError(f"{path}: expected a JSON object")
    return config
