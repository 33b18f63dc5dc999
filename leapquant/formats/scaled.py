"""Full precision, plain casts, and integer / small-float elements with fp32 scales at a chosen granularity.

Every format here stores a state ``[..., d_k, d_v]`` (key rows, value columns; leading dimensions are
independent heads).  Computation runs in the input's dtype (float32 or float64); only stored scales are
rounded to their storage dtype (fp32), so the float64 simulator sees exactly the values a kernel would store.
Stochastic rounding, where enabled, applies to the elements; scales are always round-to-nearest-even.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import LeapQuantError
from .base import Granularity, QuantizedState, StateFormat, amax_blocks, expand_blocks, parse_granularity
from .constants import BF16, E2M1, E2M3, E3M2, E4M3, E5M2, FP16, SCALE_BITS_FP32
from .elements import Element, IntElement, MinifloatElement

__all__ = [
    "CastFormat",
    "FullPrecision",
    "ScaledFormat",
    "check_flag",
    "check_parts",
    "check_state",
    "exact_div",
    "fp32_scale",
    "pow2",
]

FP32_MAX = torch.finfo(torch.float32).max

# Names of scaled minifloat element families, as written in format names (``fp8-e4m3-row``).
MINIFLOAT_PREFIX = {E4M3: "fp8-e4m3", E5M2: "fp8-e5m2", E2M3: "fp6-e2m3", E3M2: "fp6-e3m2", E2M1: "fp4-e2m1"}
# Casts store their values in the matching torch dtype (exact: the values are already on its grid).
CAST_DTYPES = {BF16: torch.bfloat16, FP16: torch.float16, E4M3: torch.float8_e4m3fn, E5M2: torch.float8_e5m2}
CAST_NAMES = {BF16: "bf16", FP16: "fp16", E4M3: "fp8-e4m3-none", E5M2: "fp8-e5m2-none"}


def check_state(fmt: StateFormat, x: torch.Tensor) -> None:
    """Shape ``[..., d_k, d_v]`` and dtype float32/float64, else :class:`LeapQuantError`."""
    fmt._check(x)
    if x.dtype not in (torch.float32, torch.float64):
        raise LeapQuantError(f"{fmt.name}: a state must be float32 or float64, got {x.dtype}")


def check_flag(fmt_kind: str, stochastic: object) -> None:
    if not isinstance(stochastic, bool):
        raise LeapQuantError(f"{fmt_kind}: stochastic must be True or False, got {stochastic!r}")


def check_parts(fmt: StateFormat, q: QuantizedState, parts: tuple[str, ...]) -> None:
    if q.format != fmt.name or any(p not in q.parts for p in parts):
        raise LeapQuantError(
            f"{fmt.name}: cannot dequantize a {q.format!r} state with parts {sorted(q.parts)}"
        )


def exact_div(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor`` correctly rounded on every device.

    A Python-scalar divisor would let PyTorch's CUDA kernel multiply by its reciprocal instead, which can
    differ in the last bit from the quotient the CPU (and our kernels) compute.
    """
    return x / torch.full((), divisor, dtype=x.dtype, device=x.device)


def fp32_scale(s: torch.Tensor) -> torch.Tensor:
    """Round a scale to its fp32 storage value, back in ``s``'s dtype (clamped first: never inf)."""
    return s.clamp(max=FP32_MAX).to(torch.float32).to(s.dtype)


def pow2(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exact ``2**e`` for integer exponents in [-1022, 1023], built from float64 bits then cast.

    Casting to float32 is exact for ``e`` in [-149, 127]; this avoids relying on ``exp2``/``pow`` being
    correctly rounded, and covers 2^-127 (an fp32 subnormal, the smallest E8M0 scale).
    """
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64).to(dtype)


@dataclass(frozen=True)
class FullPrecision(StateFormat):
    """The full-precision container (``fp32``).

    ``quantize`` keeps float32 and float64 values unrounded: the float64 simulator treats fp32 storage as
    the reference precision, so errors it reports are quantization errors alone.  32 bits per element.
    Part ``values``: the input, copied, in its own dtype.
    """

    lossless: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return "fp32"

    def quantize(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> QuantizedState:
        check_state(self, x)
        return QuantizedState(self.name, x.shape, {"values": x.clone()})

    def _dequantize(self, q: QuantizedState, dtype: torch.dtype) -> torch.Tensor:
        check_parts(self, q, ("values",))
        return q["values"].to(dtype)

    def fake_quantize(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        check_state(self, x)
        return x.clone()

    def bits_per_element(self, d_k: int, d_v: int) -> float:
        return 32.0

    def part_bits(self) -> dict[str, int]:
        """Storage bits of one entry of each part (for exact accounting in tests and reports)."""
        return {"values": 32}


@dataclass(frozen=True)
class CastFormat(StateFormat):
    """A plain cast without any scale: ``bf16``, ``fp16``, and ``fp8-e4m3-none`` / ``fp8-e5m2-none``.

    Rounding is correctly rounded RNE (or stochastic) from the input dtype, saturating at the largest
    finite value instead of producing inf (torch's float64->half cast rounds twice; this one does not).
    A NaN or an Inf in the input stays one: Inf where the storage type has it, NaN in ``fp8-e4m3-none``.
    Part ``values``: the state in the matching torch dtype (bfloat16, float16, float8_e4m3fn, float8_e5m2).
    """

    element: MinifloatElement
    stochastic: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.element, MinifloatElement) or self.element.spec not in CAST_DTYPES:
            raise LeapQuantError(
                f"cast formats take a bf16, fp16, e4m3 or e5m2 element, got {self.element!r}"
            )
        check_flag("cast format", self.stochastic)

    @property
    def name(self) -> str:
        return CAST_NAMES[self.element.spec]

    def quantize(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> QuantizedState:
        v = self.fake_quantize(x, generator=generator)
        return QuantizedState(self.name, x.shape, {"values": v.to(CAST_DTYPES[self.element.spec])})

    def _dequantize(self, q: QuantizedState, dtype: torch.dtype) -> torch.Tensor:
        check_parts(self, q, ("values",))
        return q["values"].to(dtype)

    def fake_quantize(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        check_state(self, x)
        # Values on the grid cast to the storage dtype and back exactly, so this equals the round trip.
        v = self.element.round(x, stochastic=self.stochastic, generator=generator)
        if CAST_DTYPES[self.element.spec] == torch.float8_e4m3fn:  # no Inf (torch's cast saturates it)
            special = torch.full_like(x, math.nan)
        else:
            special = x
        return torch.where(x.isfinite(), v, special)

    def bits_per_element(self, d_k: int, d_v: int) -> float:
        return float(self.element.bits)

    def part_bits(self) -> dict[str, int]:
        return {"values": self.element.bits}


def _scaled_element_ok(element: Element) -> bool:
    if isinstance(element, IntElement):
        return True
    return isinstance(element, MinifloatElement) and element.spec in MINIFLOAT_PREFIX


@dataclass(frozen=True)
class ScaledFormat(StateFormat):
    """Integer or small-float elements with one fp32 scale per tensor, row, column or key group.

    ``scale = amax / element.max_value`` over the scale's elements, rounded to fp32 (an all-zero block, or
    one whose scale underflows fp32, gets scale 1.0 so its codes are 0; a block holding a NaN or an Inf
    gets a NaN scale and decodes to NaN); ``codes = element.encode(element.round(x / scale))``, saturating.

    Parts: ``codes`` ``[..., d_k, d_v]`` (int8 for integer elements, uint8 bit codes for minifloats; one
    code per byte, ``bits_per_element`` counts the packed width) and ``scale`` float32 shaped
    ``[..., 1, 1]`` (tensor), ``[..., d_k, 1]`` (row), ``[..., 1, d_v]`` (col) or ``[..., ceil(d_k/G), d_v]``
    (group G along keys; the last group is zero-padded when ``d_k % G != 0``).
    """

    element: Element
    granularity: Granularity = "col"
    stochastic: bool = False

    def __post_init__(self) -> None:
        if not _scaled_element_ok(self.element):
            raise LeapQuantError(
                f"scaled formats take an intN or e4m3/e5m2/e2m3/e3m2/e2m1 element, got {self.element!r}"
            )
        check_flag("scaled format", self.stochastic)
        g = self.granularity
        if isinstance(g, str) and g not in ("tensor", "row", "col"):
            object.__setattr__(self, "granularity", parse_granularity(g))
        elif not isinstance(g, str) and (not isinstance(g, int) or isinstance(g, bool) or g <= 0):
            raise LeapQuantError(f"granularity must be tensor, row, col or a group size > 0, got {g!r}")

    @property
    def name(self) -> str:
        e = self.element
        prefix = e.name if isinstance(e, IntElement) else MINIFLOAT_PREFIX[e.spec]
        g = self.granularity
        if g == "col":  # per value channel: LeapQuant's residual granularity, the default
            return prefix
        return f"{prefix}-{g}" if isinstance(g, str) else f"{prefix}-g{g}"

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        """fp32-valued scales in ``x``'s dtype, shaped like :func:`amax_blocks`."""
        amax = amax_blocks(x, self.granularity)
        s = fp32_scale(exact_div(amax, self.element.max_value))
        s = torch.where(s == 0, torch.ones_like(s), s)
        # a NaN or an Inf makes its scale NaN: every value it scales decodes to NaN (an Inf's scale would
        # clamp to fp32's max and zero the block's finite values, with no sign of it)
        return torch.where(amax.isfinite(), s, torch.full_like(s, math.nan))

    def _expand(self, s: torch.Tensor, d_k: int) -> torch.Tensor:
        g = self.granularity
        return s if isinstance(g, str) else expand_blocks(s, g, d_k)

    def _values(
        self, x: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_state(self, x)
        s = self._scale(x)
        v = self.element.round(
            x / self._expand(s, x.shape[-2]), stochastic=self.stochastic, generator=generator
        )
        return v, s

    def quantize(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> QuantizedState:
        v, s = self._values(x, generator)
        stored = s if isinstance(self.granularity, str) else s.squeeze(-2)
        parts = {"codes": self.element.encode(v), "scale": stored.to(torch.float32)}
        return QuantizedState(self.name, x.shape, parts)

    def _dequantize(self, q: QuantizedState, dtype: torch.dtype) -> torch.Tensor:
        check_parts(self, q, ("codes", "scale"))
        s = q["scale"].to(dtype)
        if not isinstance(self.granularity, str):
            s = s.unsqueeze(-2)
        return self.element.decode(q["codes"], dtype) * self._expand(s, q.shape[-2])

    def fake_quantize(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        v, s = self._values(x, generator)
        out = v * self._expand(s, x.shape[-2])
        # Integer codes have no negative zero; adding +0.0 maps -0.0 to +0.0 like the decoded codes.
        return out + 0.0 if isinstance(self.element, IntElement) else out

    def n_scales(self, d_k: int, d_v: int) -> int:
        """Number of fp32 scales one ``d_k x d_v`` head stores."""
        g = self.granularity
        if g == "tensor":
            return 1
        if g == "row":
            return d_k
        if g == "col":
            return d_v
        return math.ceil(d_k / g) * d_v

    def bits_per_element(self, d_k: int, d_v: int) -> float:
        return self.element.bits + SCALE_BITS_FP32 * self.n_scales(d_k, d_v) / (d_k * d_v)

    def part_bits(self) -> dict[str, int]:
        return {"codes": self.element.bits, "scale": SCALE_BITS_FP32}
