"""Roofline model of one ``bench decode`` step: bytes and FLOPs per kernel, an ideal time, a speedup ceiling.

The step is the one :class:`~leapquant.bench.decode.DecodeModel` runs (``B`` sequences, one token each,
``context`` tokens of KV cache), kernel by kernel as ``decode.py`` writes it:

* **weights** (read once per step; shapes from :func:`~leapquant.bench.decode.build_weights` on the meta
  device, the one source of the bench's weight shapes): every ``F.linear`` / per-head ``bmm`` is a GEMM of
  ``2 B n`` FLOPs for ``n`` weights, moving its weights, its input and its output; the MoE router runs in
  fp32; the LM head writes ``[B, vocab]`` bf16 logits;
* **routed experts**: ``moe="grouped"`` (``torch._grouped_mm``) reads the weights of every expert some
  token hits, ``E (1 - (1 - k/E)^B)`` of them for uniform routing (all 256 at B=512, k=8), and computes
  ``B k`` rows; ``moe="padded"`` reads every expert and computes ``E * capacity`` rows
  (:func:`~leapquant.bench.decode.expert_capacity`), plus its scatter/gather buffers;
* **attention core**: GQA through one flash-attention kernel that reads the bf16 K and V caches once; MLA
  in the bench's absorbed form, two ``bmm`` over the latent cache (read twice: scores, then values) with
  the ``[B, heads, context]`` scores written, soft-maxed and read back;
* **state**: per linear-attention layer, the state bytes of the backend's kernel from
  :func:`leapquant.bench.kernel.state_bytes_per_step` (the one byte model of the state kernels: fp32/bf16/
  int8 per-step states read and written whole; a LeapQuant pool's boundary, records and amortised window
  close) plus the kernel's q, k, v, gate, beta reads and o write (:meth:`KernelCase.io_bytes`), and
  ``8 K V`` FLOPs per head and step (decay, delta read, rank-one write, readout);
* **conv** (the ``[B, C, W]`` conv-state update) and **elementwise** work (norms, gates, residual adds,
  RoPE, cache writes, MoE routing shuffles): every torch op as written, unfused, one read of each input
  and one write of its output in its dtype.

A kernel's time is ``max(bytes / copy bandwidth, FLOPs / bf16 GEMM throughput)`` and the step's is the sum
over kernels.  The max is taken per kernel, not once over the step's totals, because the step's kernels run
one after another on one stream (one CUDA graph): a compute-bound GEMM cannot hide a memory-bound state or
attention kernel that runs before or after it, so a global ``max(sum bytes / BW, sum FLOPs / peak)`` would
assume an overlap the step does not have and understate the ideal time.  Not in the model: launch gaps,
L2 reuse, tail effects of small kernels, the fp32 router's lower (CUDA-core) compute roof, and the close's
power-iteration FLOPs (small against its bytes).

The ceiling of a backend's speedup is the ideal step time of ``fp32:fla`` over the backend's: what the state
change alone could buy if every kernel ran at its roof.  Bytes in B, FLOPs in FLOP, times in ms, bandwidth
in GB/s (1e9 B/s, read + write), GEMM throughput in TFLOP/s (1e12).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import LeapQuantError
from . import H200_COPY_GBPS, H200_GEMM_TFLOPS
from .decode import ModelSpec, build_weights, expert_capacity
from .kernel import KernelCase, state_bytes_per_step
from .variants import Variant, parse_variant

__all__ = [
    "CLASSES",
    "H200_COPY_GBPS",
    "H200_GEMM_TFLOPS",
    "Kernel",
    "Machine",
    "StepRoofline",
    "ceiling",
    "roofline_markdown",
    "step_kernels",
    "step_roofline",
]

CLASSES = {
    "embed": "embedding rows gathered",
    "lin-proj": "linear-attention projections (in, out; KDA's low-rank gates)",
    "attn-proj": "full-attention projections (GQA qkv, o; MLA q, kv_a, W_UK, W_UV, o)",
    "mlp": "dense MLP and shared expert",
    "router": "MoE router (fp32)",
    "experts": "routed experts",
    "lm-head": "LM head (bf16 logits written)",
    "attention": "attention core over the KV cache",
    "state": "linear-attention state kernel (state bytes + q, k, v, gate, beta, o)",
    "conv": "conv-state update of the linear-attention layers",
    "elementwise": "norms, gates, residual adds, RoPE, cache writes, MoE routing shuffles",
}
"""Kernel classes of the step, in table order, with what each holds."""

BF16, FP32 = 2, 4
FP32_FLA = "fp32:fla"  # the baseline every ceiling is over


@dataclass(frozen=True)
class Machine:
    """The two roofs: copy bandwidth (GB/s, read + write) and bf16 GEMM throughput (TFLOP/s).

    ``measured`` says whether they were measured in this run (else assumed, e.g. the H200 defaults)."""

    copy_gbps: float = H200_COPY_GBPS
    gemm_tflops: float = H200_GEMM_TFLOPS
    measured: bool = False

    def __post_init__(self) -> None:
        for what, value, unit in (("copy bandwidth", self.copy_gbps, "GB/s"),
                                  ("GEMM throughput", self.gemm_tflops, "TFLOP/s")):  # fmt: skip
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise LeapQuantError(f"roofline: {what} must be a positive number of {unit}, got {value!r}")

    def describe(self) -> str:
        how = "measured" if self.measured else "assumed: H200 defaults unless given"
        return f"copy {self.copy_gbps:.0f} GB/s, bf16 GEMM {self.gemm_tflops:.0f} TFLOP/s ({how})"


@dataclass(frozen=True)
class Kernel:
    """One kernel (or a group of memory-bound ones) of the step: bytes moved and FLOPs computed."""

    name: str
    kind: str  # a key of CLASSES
    bytes: float
    flops: float = 0.0

    def seconds(self, machine: Machine) -> float:
        """The kernel's roofline time: the slower of moving its bytes and computing its FLOPs."""
        return max(self.bytes / (machine.copy_gbps * 1e9), self.flops / (machine.gemm_tflops * 1e12))

    def compute_bound(self, machine: Machine) -> bool:
        return self.flops / (machine.gemm_tflops * 1e12) > self.bytes / (machine.copy_gbps * 1e9)


@dataclass(frozen=True)
class StepRoofline:
    """The kernels of one step under one backend, on one machine."""

    kernels: tuple[Kernel, ...]
    machine: Machine

    @property
    def ms(self) -> float:
        """Ideal step time (ms): the sum of every kernel's roofline time."""
        return 1e3 * sum(k.seconds(self.machine) for k in self.kernels)

    def by_class(self) -> dict[str, dict]:
        """Per class of :data:`CLASSES` present: ``bytes``, ``flops``, ``ms``, ``share`` of the step and
        ``bound`` (``memory``, ``compute`` or ``mixed`` over its kernels)."""
        out: dict[str, dict] = {}
        total = self.ms
        for kind in CLASSES:
            mine = [k for k in self.kernels if k.kind == kind]
            if not mine:
                continue
            ms = 1e3 * sum(k.seconds(self.machine) for k in mine)
            bound = {k.compute_bound(self.machine) for k in mine}
            out[kind] = {
                "bytes": sum(k.bytes for k in mine),
                "flops": sum(k.flops for k in mine),
                "ms": ms,
                "share": ms / total if total else 0.0,
                "bound": "mixed" if len(bound) > 1 else ("compute" if True in bound else "memory"),
            }
        return out

    def to_dict(self) -> dict:
        """JSON-ready: the step's ideal ms, the machine and the per-class breakdown."""
        return {"ideal_ms": self.ms, "copy_gbps": self.machine.copy_gbps,
                "gemm_tflops": self.machine.gemm_tflops, "classes": self.by_class()}  # fmt: skip


# ------------------------------------------------------------------------------------------ the kernels


def _check(spec: ModelSpec, batch: int, context: int, moe: str) -> None:
    if not isinstance(spec, ModelSpec):
        raise LeapQuantError(f"roofline: expected a bench.decode.ModelSpec, got {type(spec).__name__}")
    if batch < 1 or context < 1:
        raise LeapQuantError(f"roofline: batch and context must be >= 1, got {batch}, {context}")
    if moe not in ("grouped", "padded"):
        raise LeapQuantError(f"roofline: moe must be grouped or padded, got {moe!r}")


def _gemm(name: str, kind: str, shape: tuple[int, ...], rows: int, wbytes: int = BF16) -> Kernel:
    """``rows`` tokens through a ``[*lead, out, in]`` (linear) or ``[lead, in, out]`` (bmm) weight: the
    weights, the input and the output each moved once; ``2 rows n`` FLOPs for ``n`` weights."""
    n, lead = math.prod(shape), math.prod(shape[:-2])
    act = rows * lead * (shape[-1] + shape[-2]) * (FP32 if wbytes == FP32 else BF16)
    return Kernel(name, kind, n * wbytes + act, 2.0 * rows * n)


_PROJ = {"in": "lin-proj", "out": "lin-proj", "f_b": "lin-proj", "g_b": "lin-proj", "qkv": "attn-proj",
         "o": "attn-proj", "q": "attn-proj", "kv_a": "attn-proj", "w_uk": "attn-proj", "w_uv": "attn-proj",
         "gate_up": "mlp", "down": "mlp"}  # fmt: skip


def _layer_weights(spec: ModelSpec, lw: dict, i: int, b: int, moe: str, cap: int) -> list[Kernel]:
    """The GEMMs of layer ``i``: projections, dense MLP / shared expert, router and routed experts."""
    out = []
    for key, t in lw.items():
        shape = tuple(t.shape)
        if key in _PROJ:
            out.append(_gemm(f"layer {i} {key}", _PROJ[key], shape, b))
        elif key == "router":  # x.float() @ router.T in fp32
            out.append(_gemm(f"layer {i} router", "router", shape, b, wbytes=FP32))
    if "experts_gate_up" in lw:
        e, d, two_i = lw["experts_gate_up"].shape
        inter, k = two_i // 2, spec.top_k
        if moe == "grouped":  # the weights of every expert some token hits; B k rows
            hit, rows = e * (1 - (1 - k / e) ** b), b * k
        else:  # one bmm over [E, capacity, d]: every expert, E * capacity rows
            hit, rows = e, e * cap
        for key, (n_in, n_out) in (("experts_gate_up", (d, two_i)), ("experts_down", (inter, d))):
            nbytes = hit * n_in * n_out * BF16 + rows * (n_in + n_out) * BF16
            out.append(Kernel(f"layer {i} {key}", "experts", nbytes, 2.0 * rows * n_in * n_out))
    return out


def _elementwise(spec: ModelSpec, kind: str, mlp: str, i: int, b: int, moe: str, cap: int) -> list[Kernel]:
    """Memory-bound torch ops of layer ``i`` outside the GEMMs, attention and state (decode.py, op by op:
    each reads its inputs and writes its output once; bytes per sequence below, times ``b``)."""
    d, hv, kd = spec.hidden, spec.lin_value_heads, spec.lin_head_dim
    vd = hv * kd
    ew = 20 * d  # two RMSNorms (read + write d bf16: 4d each) and two residual adds (6d each)
    out = []
    if kind == "linear":
        conv = 2 * spec.lin_key_heads * kd + vd
        w = spec.conv_kernel
        # cat (4CW), copy_ into the state (4CW), window * weight (4CW), sum (2CW + 2C), SiLU (4C)
        out.append(Kernel(f"layer {i} conv", "conv", b * (14 * conv * w + 6 * conv)))
        # gated fp32 RMSNorm of o: o.float() 6, norm 8, * gate 12, to bf16 6 (per value)
        ew += 32 * vd
        if spec.family == "gdn":  # silu(z.float()) 14 per value; g from a: float, + dt_bias, softplus, *
            ew += 14 * vd + 30 * hv + 4 * hv
        else:  # f: float 6, + dt_bias 8, softplus 8, * 8; gate: float 6, sigmoid 8; beta sigmoid
            ew += 30 * vd + 14 * vd + 4 * hv
    elif spec.attn == "gqa":
        nq, nkv, hd, r = spec.attn_heads, spec.attn_kv_heads, spec.attn_head_dim, spec.rope_dim
        rope = 14 * r + 4 * hd  # per head: 4 muls (8r), sub and add (6r), cat (4hd)
        # q/k norms, RoPE, K/V cache writes, sigmoid output gate
        ew += 4 * (nq + nkv) * hd + (nq + nkv) * rope + 8 * nkv * hd + 10 * nq * hd
    else:
        nh, lat, rd = spec.attn_heads, spec.kv_lora_rank, spec.qk_rope_dim
        # latent norm, cat and cache write; q cat and scale; o back to [B, nh * v]
        ew += 4 * lat + 8 * (lat + rd) + 8 * nh * (lat + rd) + 4 * nh * spec.v_head_dim
    if mlp == "dense":
        ew += 10 * spec.intermediate  # silu(a) * u
    else:
        e, k, inter = spec.experts, spec.top_k, spec.moe_intermediate
        # x.float(), sigmoid, top-k, renormalise, gather B k rows, scatter back, fp32 weighted sum, + shared
        ew += 22 * d + 8 * e + 28 * k + 26 * k * d + 10 * spec.shared_experts * inter
        if moe == "grouped":
            ew += 10 * k * inter  # silu(a) * u over the B k rows
        else:
            # a capacity row: its zero fill (2d), the cat with a zero row (4d), silu * u (10 inter); a routed
            # pair: the scatter into the buffer, the gather back and the keep mask, 4d each
            out.append(Kernel(f"layer {i} padded MoE buffers", "elementwise",
                              e * cap * (6 * d + 10 * inter) + b * k * 12 * d))  # fmt: skip
    out.append(Kernel(f"layer {i} elementwise", "elementwise", b * ew))
    return out


def _attention(spec: ModelSpec, i: int, b: int, ctx: int) -> list[Kernel]:
    """The attention core of full-attention layer ``i`` over ``ctx`` cached tokens."""
    if spec.attn == "gqa":
        nq, nkv, hd = spec.attn_heads, spec.attn_kv_heads, spec.attn_head_dim
        nbytes = b * (2 * nkv * ctx * hd + 2 * nq * hd) * BF16  # K and V once; q in, o out
        return [Kernel(f"layer {i} flash attention", "attention", nbytes, 4.0 * b * nq * ctx * hd)]
    nh, lat, rd = spec.attn_heads, spec.kv_lora_rank, spec.qk_rope_dim
    scores = b * nh * ctx * BF16
    return [
        Kernel(f"layer {i} scores bmm", "attention", b * (nh * (lat + rd) + ctx * (lat + rd)) * BF16 + scores,
               2.0 * b * nh * ctx * (lat + rd)),
        Kernel(f"layer {i} softmax", "attention", 2 * scores),
        Kernel(f"layer {i} values bmm", "attention", scores + b * (ctx * lat + nh * lat) * BF16,
               2.0 * b * nh * ctx * lat),
    ]  # fmt: skip


def step_kernels(spec: ModelSpec, batch: int, context: int, variant: Variant, *, moe: str = "grouped",
                 weights: dict | None = None) -> list[Kernel]:  # fmt: skip
    """Every kernel of one decode step of ``spec`` for ``batch`` sequences at ``context`` tokens, the linear
    layers' state under ``variant`` (see the module docstring).  ``weights``: the step's weights or their
    meta-device shapes (built here when not given)."""
    _check(spec, batch, context, moe)
    if not isinstance(variant, Variant):
        raise LeapQuantError(f"roofline: expected a bench.variants.Variant, got {type(variant).__name__}")
    b, d = batch, spec.hidden
    w = weights if weights is not None else build_weights(spec, "meta")
    cap = expert_capacity(spec, b)
    case = KernelCase(family=spec.family, n=b, heads=spec.lin_value_heads, key_heads=spec.lin_key_heads,
                      d_k=spec.lin_head_dim, d_v=spec.lin_head_dim)  # fmt: skip
    state = Kernel("", "state", state_bytes_per_step(variant, case) + case.io_bytes(),
                   8.0 * b * spec.lin_value_heads * spec.lin_head_dim**2)  # fmt: skip
    out = [Kernel("embedding gather", "embed", b * d * 2 * BF16)]
    for i, (kind, mlp) in enumerate(zip(spec.layer_types, spec.mlp_types)):
        out += _layer_weights(spec, w["layers"][i], i, b, moe, cap)
        out += _elementwise(spec, kind, mlp, i, b, moe, cap)
        if kind == "linear":
            out.append(Kernel(f"layer {i} state ({variant.label})", "state", state.bytes, state.flops))
        else:
            out += _attention(spec, i, b, context)
    out.append(Kernel("final norm", "elementwise", b * d * 2 * BF16))
    out.append(_gemm("lm_head", "lm-head", tuple(w["lm_head"].shape), b))
    return out


def step_roofline(spec: ModelSpec, batch: int, context: int, variant: Variant, machine: Machine, *,
                  moe: str = "grouped", weights: dict | None = None) -> StepRoofline:  # fmt: skip
    """The ideal step of ``spec`` under ``variant`` on ``machine`` (:func:`step_kernels`)."""
    if not isinstance(machine, Machine):
        raise LeapQuantError(f"roofline: expected a Machine, got {type(machine).__name__}")
    kernels = step_kernels(spec, batch, context, variant, moe=moe, weights=weights)
    return StepRoofline(tuple(kernels), machine)


def ceiling(spec: ModelSpec, batch: int, context: int, variant: Variant, machine: Machine, *,
            moe: str = "grouped", weights: dict | None = None) -> float:  # fmt: skip
    """The speedup of ``variant`` over ``fp32:fla`` if every kernel of both steps ran at its roof: the
    ideal ``fp32:fla`` step time over the ideal step time under ``variant`` (1.0 for the baseline)."""
    w = weights if weights is not None else build_weights(spec, "meta")
    base = step_roofline(spec, batch, context, parse_variant(FP32_FLA), machine, moe=moe, weights=w)
    return base.ms / step_roofline(spec, batch, context, variant, machine, moe=moe, weights=w).ms


# ----------------------------------------------------------------------------------------------- tables


def roofline_markdown(spec: ModelSpec, batch: int, context: int, variants: list[Variant], machine: Machine,
                      *, moe: str = "grouped") -> str:  # fmt: skip
    """Where the ideal step's time goes, per kernel class, for ``fp32:fla`` and each of ``variants``:
    GB moved, GFLOP, ideal ms and share of the step per backend, then each backend's ceiling."""
    w = build_weights(spec, "meta")
    names = list(dict.fromkeys([FP32_FLA, *(v.label for v in variants)]))
    steps = {}
    for name in names:
        v = next((x for x in variants if x.label == name), None) or parse_variant(name)
        steps[name] = step_roofline(spec, batch, context, v, machine, moe=moe, weights=w)
    n_lin, n_full = spec.layer_types.count("linear"), spec.layer_types.count("full")
    moe_note = f", {moe} MoE" if spec.experts else ""
    lines = [
        f"**{spec.name}** ({spec.layers} layers: {n_lin} {spec.family.upper()} + {n_full} "
        f"{spec.attn.upper()}{moe_note}), B={batch}, context {context}; {machine.describe()}",
        "",
        "| kernel class | bound | GFLOP | " + " | ".join(f"`{n}` GB | ms | %" for n in names) + " |",
        "| --- | --- | ---: |" + " ---: | ---: | ---: |" * len(names),
    ]
    tables = {n: s.by_class() for n, s in steps.items()}
    base = tables[FP32_FLA]
    for kind in CLASSES:
        if kind not in base:
            continue
        cells = []
        for n in names:
            c = tables[n][kind]
            cells.append(f"{c['bytes'] / 1e9:.2f} | {c['ms']:.3f} | {100 * c['share']:.1f}")
        bound = {tables[n][kind]["bound"] for n in names}
        lines.append(f"| {kind} | {bound.pop() if len(bound) == 1 else 'mixed'} | "
                     f"{base[kind]['flops'] / 1e9:,.0f} | " + " | ".join(cells) + " |")  # fmt: skip
    total = [f"{sum(c['bytes'] for c in tables[n].values()) / 1e9:.2f} | **{steps[n].ms:.3f}** | 100"
             for n in names]  # fmt: skip
    flops = sum(c["flops"] for c in base.values()) / 1e9
    lines.append(f"| step | | {flops:,.0f} | " + " | ".join(total) + " |")
    lines.append("")
    all_gb = sum(c["bytes"] for c in base.values()) / 1e9
    for n in names[1:]:
        gb = (tables[FP32_FLA]["state"]["bytes"] / 1e9, tables[n]["state"]["bytes"] / 1e9)
        lines.append(f"Ceiling of `{n}` over `{FP32_FLA}`: **{steps[FP32_FLA].ms / steps[n].ms:.3f}x** "
                     f"(ideal step {steps[FP32_FLA].ms:.3f} -> {steps[n].ms:.3f} ms; state "
                     f"{gb[0]:.2f} -> {gb[1]:.2f} GB of the baseline's {all_gb:.2f} GB).")  # fmt: skip
    return "\n".join(lines) + "\n"
