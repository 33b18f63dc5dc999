"""A compact decode-step model of two hybrid LLMs, for end-to-end decode benchmarks (paper Figure 8).

One :class:`DecodeModel` step decodes one token for each of ``B`` sequences through an ``L``-layer hybrid with
the real layer dimensions and layer pattern of Qwen3.5-9B (Gated DeltaNet + gated GQA attention, dense MLP)
or Kimi-Linear-48B-A3B (KDA + MLA, MoE with a shared expert), taken from the :mod:`leapquant.plan` presets
(:func:`model_spec`, :data:`MODELS`), random bf16 weights, in plain torch so that
the whole step can be captured in one CUDA graph.  The state of the linear-attention layers lives in a
:class:`StateBackend` (the thing compared): FLA's fp32 kernels, our per-step bf16/int8 kernels or a
LeapQuant pool.  Per step:

* embedding lookup of one token per sequence;
* per layer ``x += mixer(rmsnorm(x)); x += mlp(rmsnorm(x))``;
* linear-attention mixer: one merged in-projection, causal conv1d update (conv state ``[B, C, W]``, plain
  torch), gates (GDN ``g [B, HV]``, KDA ``g [B, HV, K]``, computed in torch for every backend), the state
  kernel, gated RMSNorm, out-projection;
* full attention over a static bf16 KV cache of ``context`` tokens per sequence (the new token is written at
  the last position): GQA through ``scaled_dot_product_attention`` with the query heads of one KV head
  folded into the query length (one read of each KV head), q/k RMSNorm, 1-D RoPE on the rotary dims (the
  real model's 3-section mRoPE degenerates to it for text), sigmoid output gate; MLA in the absorbed form
  over a cache of the compressed latent (``kv_lora_rank + qk_rope_dim`` per token, no RoPE: Kimi-Linear's
  MLA is NoPE) as two batched matmuls (so the latent cache is read twice, once for scores and once for
  values, where a FlashMLA kernel reads it once);
* dense SwiGLU MLP (merged gate/up) or MoE: sigmoid top-k router with renormalisation and routed scaling,
  tokens sorted by expert and run through ``torch._grouped_mm`` (``moe="grouped"``) or a padded per-expert
  ``bmm`` with capacity ``2 B k / E`` (``moe="padded"``), plus the shared expert;
* final RMSNorm and the LM head (``[B, vocab]`` logits), included in the step time.

``skip`` removes parts of the step for ablation timings: ``"state"`` (the state kernel call, its output
replaced by a preallocated tensor), ``"attention"`` (the attention core over the KV cache), ``"mlp"`` (MLP or
MoE) and ``"lm_head"`` (final norm and LM head).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..errors import LeapQuantError
from ..plan.models import HybridShape, periodic_layer_types
from ..plan.presets import PRESETS, resolve_preset

__all__ = [
    "MODELS",
    "DecodeModel",
    "ModelSpec",
    "build_weights",
    "expert_capacity",
    "kv_cache_bytes",
    "kv_shapes",
    "model_spec",
]


@dataclass(frozen=True)
class ModelSpec:
    """The bench's view of a :class:`~leapquant.plan.models.HybridShape`: the dims one decode step needs and
    the pattern of the built layers (``layer_types``/``mlp_types``); :func:`model_spec` derives it."""

    name: str
    hidden: int
    vocab: int
    layer_types: tuple[str, ...]  # "linear" | "full"
    mlp_types: tuple[str, ...]  # "dense" | "moe"
    family: str  # "gdn" | "kda"
    lin_key_heads: int  # H
    lin_value_heads: int  # HV
    lin_head_dim: int  # K = V
    conv_kernel: int
    attn: str  # "gqa" | "mla"
    attn_heads: int
    attn_kv_heads: int = 0  # gqa
    attn_head_dim: int = 0  # gqa
    rope_dim: int = 0  # gqa: rotary dims of each head
    kv_lora_rank: int = 0  # mla
    qk_nope_dim: int = 0  # mla
    qk_rope_dim: int = 0  # mla
    v_head_dim: int = 0  # mla
    intermediate: int = 0  # dense MLP
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    shared_experts: int = 0
    routed_scale: float = 1.0
    gate_rank: int = 0  # kda: low-rank forget/output gate projections (head_dim)
    eps: float = 1e-6
    real_layers: int = 0
    real_pattern: str = ""
    source: str = ""

    @property
    def layers(self) -> int:
        return len(self.layer_types)

    def to_dict(self) -> dict:
        from dataclasses import asdict

        out = asdict(self)
        out["layer_types"] = list(self.layer_types)
        out["mlp_types"] = list(self.mlp_types)
        out["layers"] = self.layers
        return out


_TINY = {  # --tiny: every width shrunk, the structure kept (CPU tests)
    "common": dict(hidden=64, vocab=128, lin_head_dim=32, attn_heads=4, intermediate=96),
    "gdn": dict(lin_key_heads=2, lin_value_heads=4, attn_kv_heads=2, attn_head_dim=32, rope_dim=8),
    "kda": dict(lin_key_heads=4, lin_value_heads=4, kv_lora_rank=32, qk_nope_dim=16, qk_rope_dim=16,
                v_head_dim=16, experts=8, top_k=2, moe_intermediate=32, gate_rank=32),
}  # fmt: skip


def _buildable(shape: HybridShape) -> bool:
    """The two hybrids the step models: GDN + gated GQA with dense MLPs (Qwen3.5 dense), or KDA + MLA with a
    sigmoid-routed MoE and shared expert (Kimi-Linear); both need K = V and a periodic layer pattern."""
    kind = (shape.decay, shape.attention, bool(shape.experts), shape.model_type == "kimi_linear")
    return (
        kind in (("scalar", "gqa", False, False), ("vector", "mla", True, True))
        and shape.d_k == shape.d_v
        and shape.full_attention_interval > 0
        and (shape.attention == "mla" or shape.attn_gate)
    )


MODELS = tuple(name for name, shape in PRESETS.items() if _buildable(shape))
"""The canonical names (:data:`leapquant.plan.presets.PRESETS`) of the presets the step can build."""


def _real_pattern(shape: HybridShape) -> str:
    """``"24 GDN + 8 full (every 4th)"``: the full-depth model's layers, described."""
    every = shape.full_attention_interval
    lin, full = ("KDA", "MLA") if shape.attention == "mla" else ("GDN", "full")
    last = " and the last" if shape.layers - 1 in shape.full_layer_ids and shape.layers % every else ""
    return f"{shape.linear_layers} {lin} + {shape.full_layers} {full} (every {every}th{last})"


def model_spec(name: str, layers: int = 8, tiny: bool = False) -> ModelSpec:
    """The ``layers``-layer version of a preset (any name :func:`~leapquant.plan.presets.resolve_preset`
    takes); ``tiny`` shrinks every width for CPU tests.

    The layers repeat the real model's period (every 4th is full attention; Kimi-Linear's extra full-attention
    last layer is not repeated); MoE models keep their leading dense layers."""
    if layers < 1:
        raise LeapQuantError(f"bench decode: layers must be >= 1, got {layers}")
    try:
        key = resolve_preset(name)
    except LeapQuantError as exc:
        raise LeapQuantError(f"bench decode: {exc}; the step builds {', '.join(MODELS)}") from None
    shape = PRESETS[key]
    if key not in MODELS:
        raise LeapQuantError(
            f"bench decode: {key} is not a hybrid the step models; use one of {', '.join(MODELS)}"
        )
    types = tuple(t.split("_")[0] for t in periodic_layer_types(layers, shape.full_attention_interval))
    mla = shape.attention == "mla"
    spec = ModelSpec(
        name=key,
        hidden=shape.hidden,
        vocab=shape.vocab,
        layer_types=types,
        mlp_types=tuple(
            "moe" if shape.experts and i >= shape.dense_layers else "dense" for i in range(layers)
        ),
        family="kda" if shape.decay == "vector" else "gdn",
        lin_key_heads=shape.heads_k,
        lin_value_heads=shape.heads_v,
        lin_head_dim=shape.d_k,
        conv_kernel=shape.conv_kernel,
        attn=shape.attention,
        attn_heads=shape.attn_heads,
        attn_kv_heads=0 if mla else shape.kv_heads,
        attn_head_dim=0 if mla else shape.head_dim,
        rope_dim=0 if mla else shape.rotary_dim,
        kv_lora_rank=shape.kv_lora_rank,
        qk_nope_dim=shape.qk_nope_head_dim,
        qk_rope_dim=shape.qk_rope_head_dim,
        v_head_dim=shape.v_head_dim,
        intermediate=shape.intermediate,
        experts=shape.experts,
        top_k=shape.top_k,
        moe_intermediate=shape.moe_intermediate,
        shared_experts=shape.shared_intermediate // shape.moe_intermediate if shape.experts else 0,
        routed_scale=shape.routed_scaling_factor,
        gate_rank=shape.gate_rank,
        eps=shape.rms_norm_eps,
        real_layers=shape.layers,
        real_pattern=_real_pattern(shape),
        source=shape.source,
    )
    if tiny:
        spec = replace(spec, name=spec.name + "-tiny", **_TINY["common"], **_TINY[spec.family])
    return spec


def _lin_dims(spec: ModelSpec) -> tuple[int, int, int]:
    """(conv channels, in-projection width, value width) of a linear-attention layer."""
    kd = spec.lin_key_heads * spec.lin_head_dim
    vd = spec.lin_value_heads * spec.lin_head_dim
    conv = 2 * kd + vd
    if spec.family == "gdn":  # [q k v | z | b | a]
        return conv, conv + vd + 2 * spec.lin_value_heads, vd
    return conv, conv + 2 * spec.gate_rank + spec.lin_value_heads, vd  # [q k v | f_a | g_a | b]


def build_weights(spec: ModelSpec, device, seed: int = 0) -> dict:
    """Random bf16 weights (``[out, in]``, std ``1/sqrt(in)`` so activations keep unit scale).

    ``device="meta"`` gives the shapes alone (parameter counts)."""
    device = torch.device(device)
    gen = None if device.type == "meta" else torch.Generator(device=device).manual_seed(seed)
    bf = torch.bfloat16

    def lin(out_f: int, in_f: int, *lead: int) -> torch.Tensor:
        w = torch.empty(*lead, out_f, in_f, dtype=bf, device=device)
        return w.normal_(0.0, in_f**-0.5, generator=gen)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=bf, device=device)

    d, hv, kd = spec.hidden, spec.lin_value_heads, spec.lin_head_dim
    w: dict = {
        "embed": torch.empty(spec.vocab, d, dtype=bf, device=device).normal_(generator=gen),
        "lm_head": lin(spec.vocab, d),
        "final_norm": ones(d),
        "layers": [],
    }
    for kind, mlp in zip(spec.layer_types, spec.mlp_types):
        lw: dict = {"norm1": ones(d), "norm2": ones(d)}
        if kind == "linear":
            conv, width, vd = _lin_dims(spec)
            lw["in"] = lin(width, d)
            lw["conv"] = torch.empty(conv, spec.conv_kernel, dtype=bf, device=device).normal_(
                0.0, spec.conv_kernel**-0.5, generator=gen
            )
            lw["A_log"] = torch.empty(hv, device=device).uniform_(1.0, 16.0, generator=gen).log()
            lw["o_norm"] = torch.ones(kd, device=device)  # fp32: the gated norm runs in fp32
            lw["out"] = lin(d, vd)
            if spec.family == "gdn":
                lw["dt_bias"] = torch.ones(hv, device=device)
            else:
                lw["dt_bias"] = torch.empty(hv * kd, device=device).uniform_(-4.0, -1.0, generator=gen)
                lw["f_b"] = lin(vd, spec.gate_rank)
                lw["g_b"] = lin(vd, spec.gate_rank)
        elif spec.attn == "gqa":
            hd = spec.attn_head_dim
            lw["qkv"] = lin(2 * spec.attn_heads * hd + 2 * spec.attn_kv_heads * hd, d)  # [q | gate | k | v]
            lw["q_norm"], lw["k_norm"] = ones(hd), ones(hd)
            lw["o"] = lin(d, spec.attn_heads * hd)
        else:
            nh, lat = spec.attn_heads, spec.kv_lora_rank
            lw["q"] = lin(nh * (spec.qk_nope_dim + spec.qk_rope_dim), d)
            lw["kv_a"] = lin(lat + spec.qk_rope_dim, d)
            lw["kv_norm"] = ones(lat)
            lw["w_uk"] = lin(lat, spec.qk_nope_dim, nh).transpose(1, 2).contiguous()  # [nh, nope, lat]
            lw["w_uv"] = lin(spec.v_head_dim, lat, nh).transpose(1, 2).contiguous()  # [nh, lat, v]
            lw["o"] = lin(d, nh * spec.v_head_dim)
        if mlp == "dense":
            lw["gate_up"] = lin(2 * spec.intermediate, d)
            lw["down"] = lin(d, spec.intermediate)
        else:
            e, inter = spec.experts, spec.moe_intermediate
            lw["router"] = torch.empty(e, d, device=device).normal_(0.0, d**-0.5, generator=gen)
            lw["experts_gate_up"] = lin(2 * inter, d, e).transpose(1, 2).contiguous()  # [E, d, 2I]
            lw["experts_down"] = lin(d, inter, e).transpose(1, 2).contiguous()  # [E, I, d]
            shared = inter * spec.shared_experts
            lw["gate_up"] = lin(2 * shared, d)
            lw["down"] = lin(d, shared)
        w["layers"].append(lw)
    return w


# ----------------------------------------------------------------------------------------------- model


def kv_shapes(spec: ModelSpec, batch: int, context: int) -> list[tuple[int, ...]]:
    """Shapes of one full-attention layer's cache tensors: GQA ``K, V [B, kv_heads, ctx, head_dim]``; MLA one
    latent ``[B, ctx, kv_lora_rank + qk_rope_dim]``."""
    if spec.attn == "gqa":
        return [(batch, spec.attn_kv_heads, context, spec.attn_head_dim)] * 2
    return [(batch, context, spec.kv_lora_rank + spec.qk_rope_dim)]


def kv_cache_bytes(spec: ModelSpec, batch: int, context: int) -> int:
    """bf16 bytes of the KV caches of every full-attention layer."""
    per_layer = sum(math.prod(s) for s in kv_shapes(spec, batch, context))
    return 2 * spec.layer_types.count("full") * per_layer


def expert_capacity(spec: ModelSpec, batch: int) -> int:
    """Rows per expert of the padded MoE: twice the mean load ``2 B k / E``, rounded up to 16, at most
    ``B k`` (pairs past it are dropped)."""
    pairs = batch * max(spec.top_k, 1)
    return min(pairs, 16 * math.ceil(2 * pairs / max(spec.experts, 1) / 16))


class DecodeModel:
    """Weights, caches and static inputs for one decode step of ``batch`` sequences at ``context`` tokens.

    ``step()`` returns logits ``[B, vocab]`` (or the final hidden state ``[B, hidden]`` when ``"lm_head"``
    is skipped).  Every tensor it reads is allocated here, so the step can be captured in a CUDA graph.
    """

    def __init__(self, spec: ModelSpec, weights: dict, batch: int, context: int, device, *, seed: int = 0,
                 moe: str = "grouped", moe_capacity: int | None = None):  # fmt: skip
        if context < 1 or batch < 1:
            raise LeapQuantError(f"bench decode: batch and context must be >= 1, got {batch}, {context}")
        if moe not in ("grouped", "padded"):
            raise LeapQuantError(f"bench decode: moe must be grouped or padded, got {moe!r}")
        self.spec, self.w, self.batch, self.context = spec, weights, batch, context
        self.device = torch.device(device)
        self.moe, self.skip = moe, set()
        self.backend = None  # a bench.state_backends.StateBackend
        self.record_state_inputs: list | None = None  # set to [] to record each state call's inputs
        self.moe_capacity = moe_capacity or expert_capacity(spec, batch)
        gen = torch.Generator(device=self.device).manual_seed(seed + 1)
        bf = torch.bfloat16
        self.tokens = torch.randint(0, spec.vocab, (batch,), generator=gen, device=self.device)
        self.conv_states, self.caches = [], []
        conv, _, _ = _lin_dims(spec)
        for kind in spec.layer_types:
            if kind == "linear":
                self.conv_states.append(
                    torch.randn(batch, conv, spec.conv_kernel, generator=gen, device=self.device).to(bf)
                )
                self.caches.append(None)
            else:
                self.conv_states.append(None)
                shape = self.kv_shape()
                self.caches.append(tuple(torch.empty(s, dtype=bf, device=self.device).normal_(generator=gen)
                                         for s in shape))  # fmt: skip
        hv, kd = spec.lin_value_heads, spec.lin_head_dim
        self._zero_o = torch.zeros(batch, hv, kd, dtype=bf, device=self.device)
        if spec.attn == "gqa":
            self._zero_attn = torch.zeros(
                batch, spec.attn_heads * spec.attn_head_dim, dtype=bf, device=device
            )
            half = spec.rope_dim // 2
            inv = 1e7 ** (-torch.arange(half, device=self.device, dtype=torch.float32) / half)
            ang = (context - 1) * inv  # every sequence decodes its token at position context - 1
            self._cos, self._sin = ang.cos().to(bf), ang.sin().to(bf)
        else:
            self._zero_attn = torch.zeros(batch, spec.attn_heads, spec.kv_lora_rank, dtype=bf, device=device)
        self._zero_x = torch.zeros(batch, spec.hidden, dtype=bf, device=self.device)

    def kv_shape(self) -> list[tuple[int, ...]]:
        return kv_shapes(self.spec, self.batch, self.context)

    # -- pieces ------------------------------------------------------------------------------------

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.spec.eps)

    def _conv(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv1d update: shift the ``[B, C, W]`` window by one token, dot, SiLU."""
        st = self.conv_states[i]
        win = torch.cat([st[:, :, 1:], x[:, :, None]], dim=-1)
        st.copy_(win)
        return F.silu((win * self.w["layers"][i]["conv"]).sum(-1))

    def _linear_mixer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        s, lw = self.spec, self.w["layers"][i]
        b, h, hv, kd = x.shape[0], s.lin_key_heads, s.lin_value_heads, s.lin_head_dim
        conv, _, vd = _lin_dims(s)
        proj = F.linear(x, lw["in"])
        y = self._conv(i, proj[:, :conv])
        q, k, v = y.split([h * kd, h * kd, vd], dim=-1)
        q, k, v = q.view(b, h, kd), k.view(b, h, kd), v.view(b, hv, kd)
        a_log = lw["A_log"].float().exp()
        if s.family == "gdn":
            z, beta, a = proj[:, conv:].split([vd, hv, hv], dim=-1)
            g = -a_log * F.softplus(a.float() + lw["dt_bias"])
            gate = F.silu(z.float())
        else:
            f_a, g_a, beta = proj[:, conv:].split([s.gate_rank, s.gate_rank, hv], dim=-1)
            f = F.linear(f_a, lw["f_b"]).float() + lw["dt_bias"]
            g = -a_log[:, None] * F.softplus(f.view(b, hv, kd))
            gate = torch.sigmoid(F.linear(g_a, lw["g_b"]).float())
        beta = torch.sigmoid(beta)
        if self.record_state_inputs is not None:
            self.record_state_inputs.append((q, k, v, g, beta))
        if "state" in self.skip:
            o = self._zero_o
        else:
            o = self.backend(self._lin_index[i], q, k, v, g, beta)
        o = F.rms_norm(o.float(), (kd,), lw["o_norm"], s.eps) * gate.view(b, hv, kd)
        return F.linear(o.to(x.dtype).view(b, vd), lw["out"])

    def _gqa(self, i: int, x: torch.Tensor) -> torch.Tensor:
        s, lw = self.spec, self.w["layers"][i]
        b, nq, nkv, hd = x.shape[0], s.attn_heads, s.attn_kv_heads, s.attn_head_dim
        q, gate, k, v = F.linear(x, lw["qkv"]).split([nq * hd, nq * hd, nkv * hd, nkv * hd], dim=-1)
        q, k = (
            self._rope(self._rms(q.view(b, nq, hd), lw["q_norm"])),
            self._rope(self._rms(k.view(b, nkv, hd), lw["k_norm"])),
        )
        kc, vc = self.caches[i]
        kc[:, :, -1] = k
        vc[:, :, -1] = v.view(b, nkv, hd)
        if "attention" in self.skip:
            out = self._zero_attn
        else:  # the query heads of one KV head ride in the query-length axis: each KV head is read once
            qg = q.view(b, nkv, nq // nkv, hd)
            out = self._sdpa(qg, kc, vc).reshape(b, nq * hd)
        return F.linear(out * torch.sigmoid(gate), lw["o"])

    def _sdpa(self, q, k, v) -> torch.Tensor:
        if self.device.type != "cuda":
            return F.scaled_dot_product_attention(q, k, v)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v)

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        half = self.spec.rope_dim // 2
        x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
        c, s = self._cos, self._sin
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)

    def _mla(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Absorbed MLA decode: ``q_nope W_UK`` against the latent cache, values read back as latents."""
        s, lw = self.spec, self.w["layers"][i]
        b, nh, lat = x.shape[0], s.attn_heads, s.kv_lora_rank
        q = F.linear(x, lw["q"]).view(b, nh, s.qk_nope_dim + s.qk_rope_dim)
        kv = F.linear(x, lw["kv_a"])
        (cache,) = self.caches[i]
        cache[:, -1] = torch.cat([self._rms(kv[:, :lat], lw["kv_norm"]), kv[:, lat:]], dim=-1)
        if "attention" in self.skip:
            out = self._zero_attn
        else:
            scale = (s.qk_nope_dim + s.qk_rope_dim) ** -0.5
            q_lat = torch.bmm(q[..., : s.qk_nope_dim].transpose(0, 1), lw["w_uk"]).transpose(0, 1)
            qf = torch.cat([q_lat, q[..., s.qk_nope_dim :]], dim=-1) * scale  # [B, nh, lat + rope]
            p = torch.softmax(torch.bmm(qf, cache.transpose(1, 2)), dim=-1)  # bf16 out, fp32 inside
            out = torch.bmm(p, cache[:, :, :lat])  # [B, nh, lat]
        o = torch.bmm(out.transpose(0, 1), lw["w_uv"]).transpose(0, 1)  # [B, nh, v]
        return F.linear(o.reshape(b, nh * s.v_head_dim), lw["o"])

    def _mlp(self, x: torch.Tensor, lw: dict) -> torch.Tensor:
        a, u = F.linear(x, lw["gate_up"]).chunk(2, dim=-1)
        return F.linear(F.silu(a) * u, lw["down"])

    def _moe(self, x: torch.Tensor, lw: dict) -> torch.Tensor:
        """Sigmoid top-k routing, experts over tokens sorted by expert, plus the shared expert."""
        s = self.spec
        b, e, k = x.shape[0], s.experts, s.top_k
        scores = torch.sigmoid(F.linear(x.float(), lw["router"]))
        weight, idx = scores.topk(k, dim=-1)
        weight = weight / (weight.sum(-1, keepdim=True) + 1e-20) * s.routed_scale
        flat = idx.flatten()
        expert, order = flat.sort(stable=True)
        counts = torch.zeros(e, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32)
        )
        xs = x[order // k]  # [B*k, d], grouped by expert
        if self.moe == "grouped":
            grouped = getattr(F, "grouped_mm", None) or torch._grouped_mm
            offs = counts.cumsum(0, dtype=torch.int32)
            a, u = grouped(xs, lw["experts_gate_up"], offs=offs).chunk(2, dim=-1)
            ys = grouped((F.silu(a) * u).contiguous(), lw["experts_down"], offs=offs)
        else:
            ys = self._moe_padded(xs, expert, counts, lw)
        out = torch.empty_like(ys)
        out[order] = ys
        routed = (out.view(b, k, -1).float() * weight[..., None]).sum(1).to(x.dtype)
        return routed + self._mlp(x, lw)

    def _moe_padded(self, xs, expert, counts, lw) -> torch.Tensor:
        """Experts as one ``bmm`` over ``[E, capacity, d]`` buffers; pairs past the capacity are dropped."""
        e, cap, d = self.spec.experts, self.moe_capacity, xs.shape[1]
        n = xs.shape[0]
        start = counts.cumsum(0) - counts
        rank = torch.arange(n, device=xs.device) - start[expert]
        keep = rank < cap
        dest = torch.where(keep, expert * cap + rank, e * cap)  # dropped pairs go to a spare row
        buf = xs.new_zeros(e * cap + 1, d)
        buf[dest] = xs
        a, u = torch.bmm(buf[:-1].view(e, cap, d), lw["experts_gate_up"]).chunk(2, dim=-1)
        h = torch.bmm(F.silu(a) * u, lw["experts_down"]).view(e * cap, d)
        return torch.cat([h, h.new_zeros(1, d)])[dest] * keep[:, None].to(h.dtype)

    # -- the step --------------------------------------------------------------------------------

    @property
    def _lin_index(self) -> dict[int, int]:
        if not hasattr(self, "_lin_map"):
            lin = [i for i, t in enumerate(self.spec.layer_types) if t == "linear"]
            self._lin_map = {layer: j for j, layer in enumerate(lin)}
        return self._lin_map

    def step(self) -> torch.Tensor:
        """One decode token for every sequence: logits ``[B, vocab]`` (bf16)."""
        if self.backend is None and "state" not in self.skip:
            raise LeapQuantError("bench decode: no state backend set (or skip 'state')")
        s, w = self.spec, self.w
        x = w["embed"][self.tokens]
        for i, (kind, mlp) in enumerate(zip(s.layer_types, s.mlp_types)):
            lw = w["layers"][i]
            h = self._rms(x, lw["norm1"])
            if kind == "linear":
                x = x + self._linear_mixer(i, h)
            else:
                x = x + (self._gqa(i, h) if s.attn == "gqa" else self._mla(i, h))
            h = self._rms(x, lw["norm2"])
            if "mlp" in self.skip:
                x = x + self._zero_x
            else:
                x = x + (self._mlp(h, lw) if mlp == "dense" else self._moe(h, lw))
        if "lm_head" in self.skip:
            return x
        return F.linear(self._rms(x, w["final_norm"]), w["lm_head"])
