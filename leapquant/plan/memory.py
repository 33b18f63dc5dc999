"""The byte model of a serving deployment and the requests that fit on one GPU.

Per request (one decode slot) a hybrid model holds, for a state method ``M`` and a context of ``T`` tokens:

* **recurrent state**: per linear-attention layer and value head, the state in ``M``'s storage.  The bytes
  are the library's own accounting, never re-derived here: the tensors of
  :class:`~leapquant.ops.pool.PoolConfig` when a LeapQuant kernel runs ``M`` (``leapquant-int8``:
  int8 payload, fp32 value-channel scales, fp32 smoothing scales, fp16 compensator tokens, then the record
  buffer of ``P`` records and the position; int6 codes take a byte each there, as the pool stores them),
  the per-step pool layout for ``fp32``/``bf16``/``int8``, and otherwise
  :meth:`MethodConfig.bytes_per_element` plus :meth:`MethodConfig.record_buffer_bytes`;
* **conv state**: ``conv_dim x (kernel - 1)`` values per linear layer (bf16), as vLLM and SGLang keep it;
* **KV cache**: ``T`` tokens on every full-attention layer: K and V heads for GQA, the
  ``kv_lora_rank + qk_rope_head_dim`` latent for MLA (bf16 unless ``kv_dtype`` says otherwise);
* **prefix-cache checkpoints** (with ``prefix_interval``): ``T // interval`` copies of the recurrent and
  conv state, one per cached block (vLLM/SGLang "align" mode).  A checkpoint of a LeapQuant method is the
  whole slot, record buffer and window position included (``checkpoint="slot"``), as the vLLM plugin copies
  it: windows start where a sequence's prefill ends, so a block boundary generally falls inside a window
  whose records are live.  ``checkpoint="boundary"`` counts the boundary state alone (payload, scales,
  smoothing, compensator tokens), what an engine that closed a window on every block boundary would keep:
  the paper's accounting, not what this library's plugin does.

``method`` may be a :class:`~leapquant.methods.LayerPlan` (or its ``.json`` file: ``leapquant calibrate``):
each linear layer is then counted under its own method, with the same accounting, and the state buffers of a
mixed plan are named ``NAME[METHOD]`` with ``count`` the number of layers under that method.

The requests that fit are ``floor((gpu_memory - weights - reserve) / per_request)``; ``reserve`` stands for
activations, CUDA graphs and allocator slack (default 10% of the GPU, vLLM's default
``--gpu-memory-utilization 0.9``).  Sizes in bytes; ``gpu_memory_gib`` and ``reserve_gib`` in GiB (2**30).
:func:`buffer_plan` lists every buffer (shape, dtype, count) so a script can allocate them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from ..errors import LeapQuantError
from .models import HybridShape

if TYPE_CHECKING:  # the method grammar imports torch: the planner loads it on first use
    from ..methods.config import MethodConfig
    from ..methods.layer_plan import LayerPlan

__all__ = [
    "DTYPE_BYTES",
    "BufferSpec",
    "MemoryPlan",
    "buffer_plan",
    "layer_methods",
    "plan_memory",
    "state_layout",
]

GIB = 2**30
DTYPE_BYTES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn"}
DEFAULT_RESERVE_FRACTION = 0.1
CHECKPOINTS = ("slot", "boundary")
BOUNDARY = ("payload", "scale", "smooth", "comp_k", "comp_u")  # what checkpoint="boundary" keeps of a pool


@dataclass(frozen=True)
class BufferSpec:
    """``count`` tensors of ``shape`` and ``dtype`` (a torch dtype name) in one group of the plan.

    Groups: ``weights``, ``state`` (live recurrent state), ``conv``, ``kv``, ``checkpoint_state`` and
    ``checkpoint_conv``.  ``count`` is the number of layers (or weight tensors) holding one such tensor.
    """

    group: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    count: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise LeapQuantError(f"buffer {self.name}: unknown dtype {self.dtype!r}")
        if self.count < 0 or any(d < 0 for d in self.shape):
            raise LeapQuantError(f"buffer {self.name}: negative size {self.shape} x {self.count}")

    @property
    def nbytes(self) -> int:
        """Bytes of all ``count`` tensors."""
        return self.count * math.prod(self.shape) * DTYPE_BYTES[self.dtype]


def _dtype(name: str, what: str) -> str:
    d = DTYPE_ALIASES.get(name, name)
    if d not in ("float32", "bfloat16", "float16", "float8_e4m3fn"):
        raise LeapQuantError(f"{what} must be fp32, bf16, fp16 or fp8, got {name!r}")
    return d


def state_layout(
    shape: HybridShape, method: str | MethodConfig, slots: int
) -> tuple[str, list[tuple[str, tuple, str]]]:
    """How one linear-attention layer stores ``slots`` states: ``(kind, [(name, shape, dtype), ...])``.

    ``kind`` is ``pool`` (a LeapQuant kernel pool: its tensors, what a deployment allocates, int6 codes a
    byte each), ``per-step`` (the per-step fp32/bf16/int8 pool) or ``bytes`` (no kernel yet: boundary and
    record bytes from :class:`MethodConfig`, as uint8).  Raises :class:`LeapQuantError` for a name the
    method grammar rejects.
    """
    from ..formats.residual import RESIDUAL_FORMATS
    from ..methods.config import as_method
    from ..ops.per_step_decode import per_step_unsupported
    from ..ops.pool import PoolConfig, pool_unsupported

    cfg = as_method(method)
    hv, k, v = shape.heads_v, shape.d_k, shape.d_v
    pool = None
    if cfg.window > 1 and pool_unsupported(cfg) is None:
        pool = PoolConfig(cfg, heads=hv, d_k=k, d_v=v, decay=shape.decay)
    if pool is not None:
        specs = [(n, s, str(dt).removeprefix("torch.")) for n, (s, dt) in pool.shapes(slots).items()]
        kind = "pool"
    elif cfg.window == 1 and per_step_unsupported(cfg) is None:
        fmt = RESIDUAL_FORMATS[cfg.codec]
        specs = [("state", (slots, hv, v, k), str(fmt.payload_dtype).removeprefix("torch."))]
        if fmt.scaled:
            specs.append(("scale", (slots, hv, v), "float32"))
        kind = "per-step"
    else:
        boundary = cfg.boundary_bytes(k, v)
        records = cfg.record_buffer_bytes(k, v, 1 if shape.decay == "scalar" else k)
        specs = [("payload", (slots, hv, boundary), "uint8")]
        if records:
            specs.append(("records", (slots, hv, records), "uint8"))
        kind = "bytes"
    _check_accounting(shape, cfg.name, cfg, specs, slots, pool)
    return kind, specs


def _check_accounting(shape, method, cfg, specs, slots, pool) -> None:
    """The layout must hold exactly what the pool allocates, and (formats stored at their own width) what
    MethodConfig counts (an internal invariant, not user input)."""
    k, v, hv = shape.d_k, shape.d_v, shape.heads_v
    got = sum(math.prod(s) * DTYPE_BYTES[d] for _, s, d in specs)
    counts = {"MethodConfig": None, "the pool": None}
    if pool is None or pool.packed:
        expected = cfg.boundary_bytes(k, v)
        expected += cfg.record_buffer_bytes(k, v, 1 if shape.decay == "scalar" else k)
        counts["MethodConfig"] = expected * hv * slots
    if pool is not None:
        counts["the pool"] = pool.bytes_per_slot() * slots
    for who, expected in counts.items():
        if expected is not None and got != expected:
            raise RuntimeError(f"{method}: state layout holds {got} B, {who} counts {expected} B")


def buffer_plan(
    shape: HybridShape,
    method: str | MethodConfig | LayerPlan,
    *,
    batch: int,
    context: int,
    prefix_interval: int | None = None,
    kv_dtype: str = "bf16",
    conv_dtype: str = "bf16",
    weight_dtype: str = "bf16",
    weights: bool = True,
    checkpoint: str = "slot",
) -> list[BufferSpec]:
    """Every buffer of ``batch`` requests at ``context`` tokens: weights, state, conv, KV, checkpoints
    (``checkpoint``: ``"slot"`` or ``"boundary"``, see the module docstring)."""
    if checkpoint not in CHECKPOINTS:
        raise LeapQuantError(f"checkpoint must be one of {', '.join(CHECKPOINTS)}, got {checkpoint!r}")
    groups = layer_methods(shape, method)
    for name, value in (("batch", batch), ("context", context)):
        if value < 1:
            raise LeapQuantError(f"{name} must be >= 1, got {value}")
    if prefix_interval is not None and prefix_interval < 1:
        raise LeapQuantError(f"prefix-cache interval must be >= 1, got {prefix_interval}")
    kv_t, conv_t, w_t = (
        _dtype(kv_dtype, "kv dtype"),
        _dtype(conv_dtype, "conv dtype"),
        _dtype(weight_dtype, "weights"),
    )
    n_lin, n_full = shape.linear_layers, shape.full_layers
    out: list[BufferSpec] = []
    if weights:
        out += [BufferSpec("weights", n, s, w_t) for n, s in shape.weight_tensors()]
    mixed = len(groups) > 1
    kinds = {}
    for cfg, layers in groups.items():
        kinds[cfg], specs = state_layout(shape, cfg, batch)
        out += [BufferSpec("state", _tag(n, cfg, mixed), s, d, layers) for n, s, d in specs]
    conv = (shape.conv_dim, shape.conv_kernel - 1)
    out.append(BufferSpec("conv", "conv", (batch, *conv), conv_t, n_lin))
    if n_full:
        if shape.attention == "mla":
            out.append(BufferSpec("kv", "latent", (batch, context, shape.kv_values_per_token), kv_t, n_full))
        else:
            kv = (batch, context, shape.kv_heads, shape.head_dim)
            out += [BufferSpec("kv", "k", kv, kv_t, n_full), BufferSpec("kv", "v", kv, kv_t, n_full)]
    n_ckpt = context // prefix_interval if prefix_interval else 0
    if n_ckpt:
        slots = batch * n_ckpt
        for cfg, layers in groups.items():
            _, cspecs = state_layout(shape, cfg, slots)
            if checkpoint == "boundary" and cfg.window > 1:
                cspecs = [x for x in cspecs if x[0] in (BOUNDARY if kinds[cfg] == "pool" else ("payload",))]
            out += [BufferSpec("checkpoint_state", _tag(n, cfg, mixed), s, d, layers) for n, s, d in cspecs]
        out.append(BufferSpec("checkpoint_conv", "conv", (slots, *conv), conv_t, n_lin))
    return out


def layer_methods(shape: HybridShape, method: str | MethodConfig | LayerPlan) -> dict[MethodConfig, int]:
    """``{method: number of linear layers under it}`` for ``shape``'s linear-attention layers.

    A plan that differs between layers needs the model's layer pattern (``shape.full_layer_ids``) to know
    which layer is which; it must name a method for every linear layer and no other layer.
    """
    from ..methods.layer_plan import as_layer_methods

    plan = as_layer_methods(method)
    if plan.is_uniform:
        return {plan.methods()[0]: shape.linear_layers}
    if not shape.layer_types:
        raise LeapQuantError(
            f"model {shape.name}: its layer pattern is not known, so a plan with a method per layer "
            f"({plan.name}) cannot be placed; use a preset or a config.json"
        )
    linear = [i for i, t in enumerate(shape.layer_types) if t == "linear"]
    plan.check_layers(linear)
    counts: dict[MethodConfig, int] = {}
    for i in linear:
        cfg = plan.for_layer(i)
        counts[cfg] = counts.get(cfg, 0) + 1
    return counts


def _tag(name: str, cfg: MethodConfig, mixed: bool) -> str:
    return f"{name}[{cfg.name}]" if mixed else name


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per request and requests that fit for one model, method and context (all sizes in bytes).

    ``state_bytes`` is the live recurrent state of one request over all linear layers (records included),
    ``state_breakdown`` splits it by tensor; ``checkpoint_bytes`` is one prefix-cache checkpoint (the
    recurrent state as the plan's ``checkpoint`` counts it, whole slot or boundary state, + conv state, all
    linear layers) and ``checkpoints`` how many a request holds.  ``bytes_per_element`` is the method's
    nominal boundary bytes per element (int6 at 6 bits, though its pool stores a byte a code: the byte
    counts are the pool's).
    """

    model: str
    method: str
    config: str
    layout: str
    bytes_per_element: float
    context: int
    prefix_interval: int | None
    checkpoints: int
    state_bytes: int
    state_breakdown: dict[str, int]
    conv_bytes: int
    kv_bytes: int
    checkpoint_bytes: int
    weights_bytes: int
    gpu_bytes: int
    reserve_bytes: int
    extra: dict = field(default_factory=dict)

    @property
    def checkpoints_bytes(self) -> int:
        """All checkpoints of one request."""
        return self.checkpoints * self.checkpoint_bytes

    @property
    def per_request_bytes(self) -> int:
        return self.state_bytes + self.conv_bytes + self.kv_bytes + self.checkpoints_bytes

    @property
    def budget_bytes(self) -> int:
        """GPU memory left for requests after weights and the reserve (may be negative)."""
        return self.gpu_bytes - self.weights_bytes - self.reserve_bytes

    @property
    def max_requests(self) -> int:
        """Concurrent requests that fit (0 when the weights alone do not)."""
        return max(0, self.budget_bytes // self.per_request_bytes)

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("checkpoints_bytes", "per_request_bytes", "budget_bytes", "max_requests"):
            d[name] = getattr(self, name)
        return d


def plan_memory(
    shape: HybridShape,
    method: str | MethodConfig | LayerPlan,
    *,
    context: int,
    gpu_memory_gib: float,
    prefix_interval: int | None = None,
    reserve_gib: float | None = None,
    kv_dtype: str = "bf16",
    weight_dtype: str = "bf16",
    checkpoint: str = "slot",
) -> MemoryPlan:
    """The :class:`MemoryPlan` of ``method`` (a name, a :class:`MethodConfig` or a layer plan) on ``shape``
    (see the module docstring for what is counted; ``checkpoint``: what a prefix-cache checkpoint holds)."""

    if not gpu_memory_gib > 0:
        raise LeapQuantError(f"gpu memory must be > 0 GiB, got {gpu_memory_gib}")
    if reserve_gib is None:
        reserve_gib = DEFAULT_RESERVE_FRACTION * gpu_memory_gib
    if not 0 <= reserve_gib < gpu_memory_gib:
        raise LeapQuantError(f"reserve must be in [0, gpu memory) GiB, got {reserve_gib}")
    from ..methods.layer_plan import as_layer_methods

    plan = as_layer_methods(method)
    name = method if isinstance(method, str) else plan.name
    by_method = layer_methods(shape, plan)
    buffers = buffer_plan(
        shape, plan, batch=1, context=context, prefix_interval=prefix_interval,
        kv_dtype=kv_dtype, weight_dtype=weight_dtype, checkpoint=checkpoint,
    )  # fmt: skip
    groups: dict[str, int] = {}
    for b in buffers:
        groups[b.group] = groups.get(b.group, 0) + b.nbytes
    n_ckpt = context // prefix_interval if prefix_interval else 0
    ckpt_total = groups.get("checkpoint_state", 0) + groups.get("checkpoint_conv", 0)
    decay_values = 1 if shape.decay == "scalar" else shape.d_k
    records = {c.name: c.record_buffer_bytes(shape.d_k, shape.d_v, decay_values) for c in by_method}
    return MemoryPlan(
        model=shape.name,
        method=name,
        config=plan.name,
        layout="+".join(dict.fromkeys(state_layout(shape, c, 1)[0] for c in by_method)),
        # boundary bytes per element over all linear layers (each layer's own method)
        bytes_per_element=sum(c.bytes_per_element(shape.d_k, shape.d_v) * n for c, n in by_method.items())
        / shape.linear_layers,
        context=context,
        prefix_interval=prefix_interval,
        checkpoints=n_ckpt,
        state_bytes=groups["state"],
        state_breakdown={b.name: b.nbytes for b in buffers if b.group == "state"},
        conv_bytes=groups["conv"],
        kv_bytes=groups.get("kv", 0),
        checkpoint_bytes=(
            ckpt_total // n_ckpt if n_ckpt else _checkpoint_bytes(shape, plan, kv_dtype, checkpoint)
        ),
        weights_bytes=groups["weights"],
        gpu_bytes=int(gpu_memory_gib * GIB),
        reserve_bytes=int(reserve_gib * GIB),
        extra={
            # one number for one method; per method for a mixed plan
            "record_buffer_bytes_per_head": next(iter(records.values())) if len(records) == 1 else records,
            "state_elements": shape.linear_layers * shape.heads_v * shape.d_k * shape.d_v,
        },
    )


def _checkpoint_bytes(
    shape: HybridShape, method: MethodConfig | LayerPlan, kv_dtype: str, checkpoint: str
) -> int:
    """One checkpoint's bytes when the request holds none (context shorter than the interval, or none)."""
    bufs = buffer_plan(
        shape, method, batch=1, context=1, prefix_interval=1, kv_dtype=kv_dtype, weights=False,
        checkpoint=checkpoint,
    )  # fmt: skip
    return sum(b.nbytes for b in bufs if b.group.startswith("checkpoint"))
