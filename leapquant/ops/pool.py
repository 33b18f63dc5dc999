"""The LeapQuant state pool: one slot per sequence, the layout every decode kernel reads and writes.

Layout (``S`` slots, ``HV`` value heads, ``K``/``V`` head dims, ``P`` window, ``R`` compensator tokens),
V-first like vLLM and SGLang: the state of a head is stored ``[V, K]`` with keys innermost, so

* a program that owns a tile of value rows reads contiguous 128-byte key rows (coalesced);
* the per-value-channel scales of the residual are reductions along the contiguous axis;
* pools are drop-in for engines that already keep ``[slots, HV, V, K]`` states.

===========  ===============================  ====================================================
tensor       shape                            contents
===========  ===============================  ====================================================
payload      ``[S, HV, V, K]``                residual ``C^-1 R`` in the residual format (int8,
             (int4: ``[S, HV, V, K/2]``)      float8_e4m3fn, bf16 or fp32; int4 packs two keys a
                                              byte, even key in the low nibble; int6 keeps its
                                              codes -31..31 one per byte, unpacked)
scale        ``[S, HV, V]`` fp32              per-value-channel scale (int8/int6/fp8/int4 only)
smooth       ``[S, HV, K]`` fp32              smoothing scales ``c`` (when smoothing)
comp_k       ``[S, HV, R, K]`` fp16           compensator keys ``K~`` (orthonormal columns)
comp_u       ``[S, HV, R, V]`` fp16           compensator values ``U~ = S^T K~``
rec_g        ``[S, HV, P]`` fp32 (GDN)        GDN: cumulative log decay ``G_j = g_1 + ... + g_j`` since
             ``[S, HV, P, K]`` fp16/fp32      the window start; KDA: record ``j``'s own log decay ``g_j``
             (KDA)                            per key channel, at the record precision; each ``g_j``
                                              clamped at ``LOG_DECAY_FLOOR``
rec_k        ``[S, HV, P, K]`` fp16/fp32      write keys ``k_j`` (beta folded in)
rec_u        ``[S, HV, P, V]`` fp16/fp32      corrections ``u_j = v_j - S_{j-1}^T b_j``
pos          ``[S, HV]`` int32                records in the current window, ``0 <= pos < P``
===========  ===============================  ====================================================

A read needs ``Gamma_{j+1:l} = exp(G_l - G_j)`` per record: one subtraction and one ``exp``, no running
product.  GDN keeps the running sums ``G_j`` in fp32: a scalar a record (4 of its 516 bytes), read as
stored.  KDA keeps 128 decays a record, half its bytes in fp32, so it stores each token's own log decay at
the record precision and a read sums them (one product with a triangular 0/1 matrix on tensor cores).  In
fp16 a token's log decay then carries a rounding error relative to itself, as small as its key's; fp16
running sums would round recent records' decays to the precision of the window's total.  A KDA record is
768 B, not 1,024 (the simulator, :class:`~leapquant.methods.WindowedState`, keeps exact decays).  The position
is kept per head so the kernel that closes windows can advance it without racing other heads of the same slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import LeapQuantError
from ..formats.residual import RESIDUAL_FORMATS, ResidualFormat
from ..methods.config import MethodConfig
from .checks import check_slots

__all__ = ["LOG_DECAY_FLOOR", "LeapQuantPool", "PoolConfig", "pool_unsupported"]

DECAYS = ("scalar", "vector")
# Records take each token's log decay clamped to this floor: exp of anything below it underflows fp32 (whose
# smallest subnormal is about e^-103) however it is summed, so the clamp changes no fp32 result; KDA's fp16
# decays stay finite (fp16 ends at -65504) and GDN's fp32 running sums stay small enough to subtract (after
# a gate of -1e6 they would carry errors of 0.06 in the later records' decays).
LOG_DECAY_FLOOR = -128.0
MAX_COMPENSATORS = 16
# the pool tensors in the order the kernels take them (and their slot shifts, LeapQuantPool.slot_shift)
SHIFT_ORDER = ("payload", "scale", "smooth", "comp_k", "comp_u", "rec_g", "rec_k", "rec_u", "pos")


def pool_unsupported(method: MethodConfig) -> str | None:
    """Why no pool (and no kernel) runs ``method`` (``None``: one does).

    Pools run ``CODEC/wP[+ctR][+itN][+smooth][+ls][+rec16|+rec32]`` with ``CODEC`` a residual format
    (:data:`~leapquant.formats.residual.RESIDUAL_FORMATS`), ``P >= 2`` and at most 16 fp16 compensator
    tokens fitted by power iteration; per-step methods run on ``PerStepPool``.
    """
    if method.codec not in RESIDUAL_FORMATS:
        return f"residual {method.codec!r} has no kernel (kernels store {', '.join(RESIDUAL_FORMATS)})"
    if method.window < 2:
        return "a per-step method (window 1) runs on PerStepPool, not a LeapQuant pool"
    if method.fit != "power":
        return "compensators fitted by exact SVD (+svd) have no kernel (power iteration only)"
    if method.stochastic:
        return "stochastic rounding (+sr) has no kernel"
    if method.records not in ("fp16", "fp32"):
        return f"{method.records} records have no kernel (+rec16 or +rec32)"
    if method.compensator_precision != "fp16":
        return "fp32 compensator tokens have no kernel (the pool keeps them in fp16)"
    if method.compensators > MAX_COMPENSATORS:
        return f"{method.compensators} compensator tokens (kernels take 0..{MAX_COMPENSATORS})"
    return None


@dataclass(frozen=True)
class PoolConfig:
    """A pool's method and layout.

    Attributes:
        method: the method the pool runs (its reference is :class:`~leapquant.methods.WindowedState` of the
            same config); :func:`pool_unsupported` says which methods have a pool.
        heads: value heads ``HV`` per slot.
        d_k, d_v: head dims (powers of two for the Triton kernels).
        decay: ``scalar`` (GDN, one decay per head) or ``vector`` (KDA, one per key channel).

    ``window``, ``compensators``, ``smoothing``, ``residual`` (the codec), ``records`` (fp16 or fp32),
    ``power_iters`` and ``cold_iters`` read through to ``method``.
    """

    method: MethodConfig
    heads: int
    d_k: int = 128
    d_v: int = 128
    decay: str = "scalar"

    def __post_init__(self) -> None:
        if not isinstance(self.method, MethodConfig):
            raise LeapQuantError(
                f"pool: method must be a MethodConfig (leapquant.parse_method(name)), got {type(self.method)}"
            )
        reason = pool_unsupported(self.method)
        if reason is not None:
            raise LeapQuantError(f"pool: no kernel for method {self.method.name!r}: {reason}")
        if self.decay not in DECAYS:
            raise LeapQuantError(f"pool: decay must be 'scalar' (GDN) or 'vector' (KDA), got {self.decay!r}")
        for name in ("heads", "d_k", "d_v"):
            if getattr(self, name) < 1:
                raise LeapQuantError(f"pool: {name} must be >= 1, got {getattr(self, name)}")
        if self.d_k % self.format.keys_per_element:
            raise LeapQuantError(
                f"pool: {self.residual} packs {self.format.keys_per_element} keys an element, d_k must be a "
                f"multiple, got {self.d_k}"
            )

    @property
    def format(self) -> ResidualFormat:
        return RESIDUAL_FORMATS[self.method.codec]

    @property
    def residual(self) -> str:
        return self.method.codec

    @property
    def window(self) -> int:
        return self.method.window

    @property
    def compensators(self) -> int:
        return self.method.compensators

    @property
    def smoothing(self) -> bool:
        return self.method.smoothing

    @property
    def records(self) -> str:
        return self.method.records

    @property
    def power_iters(self) -> int:
        return self.method.power_iters

    @property
    def cold_iters(self) -> int:
        return self.method.cold_iters

    @property
    def packed(self) -> bool:
        """Whether the payload holds the residual format at its own width (not int6's codes in bytes)."""
        return self.format.packed

    @property
    def has_scale(self) -> bool:
        return self.format.scaled

    @property
    def record_dtype(self) -> torch.dtype:
        return torch.float16 if self.records == "fp16" else torch.float32

    @property
    def decay_dtype(self) -> torch.dtype:
        """``rec_g``'s dtype: fp32 running sums for a scalar decay, the record precision per key channel."""
        return torch.float32 if self.decay == "scalar" else self.record_dtype

    def shapes(self, slots: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every tensor of a pool of ``slots`` slots: name -> (shape, dtype)."""
        s, h, k, v, p, r = slots, self.heads, self.d_k, self.d_v, self.window, self.compensators
        out = {"payload": ((s, h, v, k // self.format.keys_per_element), self.format.payload_dtype)}
        if self.has_scale:
            out["scale"] = ((s, h, v), torch.float32)
        if self.smoothing:
            out["smooth"] = ((s, h, k), torch.float32)
        if r:
            out["comp_k"] = ((s, h, r, k), torch.float16)
            out["comp_u"] = ((s, h, r, v), torch.float16)
        out["rec_g"] = ((s, h, p) if self.decay == "scalar" else (s, h, p, k), self.decay_dtype)
        out["rec_k"] = ((s, h, p, k), self.record_dtype)
        out["rec_u"] = ((s, h, p, v), self.record_dtype)
        out["pos"] = ((s, h), torch.int32)
        return out

    def boundary_bytes_per_head(self) -> int:
        """Bytes of the quantized boundary state of one head (what the paper's 1.19 B/element counts)."""
        sizes = self.shapes(1)
        keys = ("payload", "scale", "smooth", "comp_k", "comp_u")
        return sum(_nbytes(*sizes[n]) for n in keys if n in sizes) // self.heads

    def bytes_per_slot(self) -> int:
        """Bytes of one slot: boundary state, record buffer and position for all heads."""
        return sum(_nbytes(*spec) for spec in self.shapes(1).values())


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


@dataclass
class LeapQuantPool:
    """A pool of ``slots`` LeapQuant states (see the module docstring for the layout).

    Create with :meth:`allocate`; kernels in :mod:`leapquant.ops.leapquant_decode` update it in place and
    touch only the slots they are given.
    """

    config: PoolConfig
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def allocate(cls, config: PoolConfig, slots: int, device: torch.device | str = "cpu") -> LeapQuantPool:
        """A pool whose every slot holds the zero state (as :meth:`WindowedState.load` of zeros)."""
        if slots < 1:
            raise LeapQuantError(f"pool: slots must be >= 1, got {slots}")
        tensors = {
            name: torch.zeros(shape, dtype=dtype, device=device)
            for name, (shape, dtype) in config.shapes(slots).items()
        }
        pool = cls(config, tensors)
        pool.reset(torch.arange(slots, device=device))
        return pool

    @property
    def slots(self) -> int:
        return self.tensors["pos"].shape[0]

    def close_list(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Kernel workspace: ``[slots * HV]`` int32 list of the heads that close a window, and its count."""
        if "_close_list" not in self.__dict__:
            self.__dict__["_close_list"] = (
                torch.zeros(self.slots * self.config.heads, dtype=torch.int32, device=self.device),
                torch.zeros(1, dtype=torch.int32, device=self.device),
            )
        return self.__dict__["_close_list"]

    def close_scratch(self, numel: int) -> torch.Tensor:
        """Kernel workspace: at least ``numel`` fp16 of the window close's per-program token values.  Grown on
        demand; a buffer it outgrows is kept, not freed, because a CUDA graph captured earlier still writes to
        it (a few hundred KB: one head's token values per close program)."""
        have = self.__dict__.get("_close_scratch")
        if have is None or have.numel() < numel:
            if have is not None:
                self.__dict__.setdefault("_close_scratch_outgrown", []).append(have)
            self.__dict__["_close_scratch"] = torch.empty(numel, dtype=torch.float16, device=self.device)
        return self.__dict__["_close_scratch"]

    def side_stream(self) -> torch.cuda.Stream:
        """The high-priority CUDA stream the window closes run on beside the step (``overlap_close``)."""
        if "_side_stream" not in self.__dict__:
            self.__dict__["_side_stream"] = torch.cuda.Stream(self.device, priority=-1)
        return self.__dict__["_side_stream"]

    @property
    def device(self) -> torch.device:
        return self.tensors["pos"].device

    @property
    def paged(self) -> bool:
        """Whether the slot axis is strided past the slot's own tensor (a view over an engine's cache pages,
        :func:`leapquant.integrations.vllm.adapter.pool_view`): the kernels then move each pointer to the
        slot's page (:meth:`slot_shift`)."""
        return any(self.slot_shift())

    def slot_shift(self) -> tuple[int, ...]:
        """Kernel arguments: per tensor (:data:`SHIFT_ORDER`) the elements between one slot's end and the next
        one's start, ``stride(0) - per-slot numel`` (0 everywhere for a contiguous pool)."""
        if "_slot_shift" not in self.__dict__:
            shifts = []
            for name in SHIFT_ORDER:
                t = self.tensors.get(name)
                if t is None:
                    shifts.append(0)
                    continue
                if not t[0].is_contiguous() or t.stride(0) < t[0].numel():
                    raise LeapQuantError(f"pool: tensor {name} must be contiguous within a slot, slots apart")
                shifts.append(t.stride(0) - t[0].numel())
            self.__dict__["_slot_shift"] = tuple(shifts)
        return self.__dict__["_slot_shift"]

    def __getattr__(self, name: str) -> torch.Tensor:
        tensors = self.__dict__.get("tensors", {})
        if name in tensors:
            return tensors[name]
        raise AttributeError(name)

    def reset(self, slots: torch.Tensor) -> None:
        """Set ``slots`` to the zero state (zero residual, unit scales, floor smoothing, no tokens)."""
        from ..methods.smoothing import SMOOTHING_FLOOR

        idx = self.check_slots(slots, allow_padding=False).long()
        for name, t in self.tensors.items():
            value = {"scale": 1.0, "smooth": SMOOTHING_FLOOR}.get(name, 0)
            t[idx] = value

    def check_slots(self, slots: torch.Tensor, *, allow_padding: bool = True) -> torch.Tensor:
        """Validate slot indices (int32/int64, 1-D, in range, no duplicates; -1 is padding if allowed)."""
        check_slots(slots, self.slots, self.device, allow_padding=allow_padding)
        return slots
