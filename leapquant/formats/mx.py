"""OCP Microscaling (MX v1.0): MXFP8 (E4M3/E5M2), MXFP6 (E2M3/E3M2), MXFP4 (E2M1).

Blocks of ``MX_BLOCK = 32`` consecutive key entries of a value column share one E8M0 scale (a power of
two, ``2**(code - 127)``).  The key axis is the contiguous one of the V-first ``[d_v, d_k]`` layout, so this
is exactly torchao's / the hardware's MX layout of the transposed state.  A short last block (``d_k % 32``)
is zero-padded, which never changes its maximum.

Two scale rules:

* ``floor`` (the OCP spec, section 6.3): ``shared_exp = floor(log2(amax)) - emax_elem``.  The largest
  element may exceed the element's max (e.g. amax = 1.9 * 2^k with E4M3 gives 486 > 448) and saturates.
* ``rceil`` (NVIDIA's ``cvt.rp.satfinite.ue8m0`` and torchao's RCEIL): ``scale = 2**ceil(log2(amax /
  max_elem))``, so nothing saturates, at the cost of up to one binade of resolution.

Both exponents are clamped to the E8M0 range [-127, 127]; an all-zero block gets exponent -127 (code 0).
A block holding a NaN or an Inf gets E8M0's NaN code (0xFF) and decodes to NaN: visible, and confined to
its 32 values.

Edge cases where torchao 0.18 (eager) departs from these definitions; we follow the spec / hardware:

* FLOOR, code 0 (block amax below ~2^(emax_elem - 126)): torchao divides by 2^-126 (it clamps the scale
  to the fp32 min normal) but dequantizes with 2^-127, so its round trip halves such blocks.  We use
  2^-127 both ways.
* RCEIL, code 0: torchao multiplies the data by 1.0 instead of 2^127 (mirroring TransformerEngine).  We use
  the true reciprocal 2^127 so the round trip is consistent.
* RCEIL rounding up: torchao's eager fallback takes ``ceil(log2(descale))`` in float32, and the float32
  log2 of a descale a few ulps above a power of two rounds down to the integer (e.g. 2^-10 (1 + 2^-22)),
  giving a scale one binade too small.  We take the exact ceiling from the bits, like the hardware.

Blocks whose amax is above ~2^-117 and whose descale is not within a few ulps above a power of two match
torchao bit for bit (codes, scales and dequantized values), see tests/test_formats_torchao.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import LeapQuantError
from .base import QuantizedState, StateFormat, expand_blocks, to_blocks
from .constants import E2M1, E2M3, E3M2, E4M3, E5M2, E8M0_BIAS, E8M0_MAX_EXP, E8M0_MIN_EXP, MX_BLOCK
from .elements import MinifloatElement
from .scaled import check_flag, check_parts, check_state, exact_div, pow2

__all__ = ["MX_NAMES", "MXFormat"]

# Canonical names per element (the default elements are e4m3 for MXFP8, e2m1 for MXFP4).
MX_NAMES = {E4M3: "mxfp8", E5M2: "mxfp8-e5m2", E2M3: "mxfp6-e2m3", E3M2: "mxfp6-e3m2", E2M1: "mxfp4"}
MX_RULES = ("floor", "rceil")


_NAN_EXP = E8M0_MAX_EXP + 1  # code 0xFF


def _block_scales(exp: torch.Tensor, dtype: torch.dtype, d_k: int) -> torch.Tensor:
    """Per-element scales ``[..., d_k, d_v]`` of exponents ``[..., blocks, d_v]`` (NaN for code 0xFF)."""
    scale = pow2(exp.clamp(max=E8M0_MAX_EXP), dtype)
    scale = torch.where(exp == _NAN_EXP, torch.full_like(scale, math.nan), scale)
    return expand_blocks(scale.unsqueeze(-2), MX_BLOCK, d_k)


@dataclass(frozen=True)
class MXFormat(StateFormat):
    """An OCP MX format with blocks of 32 along keys and an E8M0 shared scale.

    Parts: ``codes`` uint8 ``[..., d_k, d_v]`` (element bit codes, one per byte; ``bits_per_element``
    counts the packed width) and ``scale`` uint8 ``[..., ceil(d_k/32), d_v]`` (E8M0 codes, exponent + 127).
    """

    element: MinifloatElement
    rule: str = "floor"
    stochastic: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.element, MinifloatElement) or self.element.spec not in MX_NAMES:
            raise LeapQuantError(f"MX formats take an e4m3/e5m2/e2m3/e3m2/e2m1 element, got {self.element!r}")
        if self.rule not in MX_RULES:
            raise LeapQuantError(f"MX scale rule must be floor or rceil, got {self.rule!r}")
        check_flag("MX format", self.stochastic)

    @property
    def name(self) -> str:
        base = MX_NAMES[self.element.spec]
        return base + "-rceil" if self.rule == "rceil" else base

    def shared_exponents(self, x: torch.Tensor) -> torch.Tensor:
        """Unbiased block exponents, int64 ``[..., ceil(d_k/32), d_v]`` in [-127, 127], or 128 (the NaN
        code) for a block holding a NaN or an Inf."""
        amax = to_blocks(x.abs(), MX_BLOCK).amax(dim=-2)
        if self.rule == "floor":
            # frexp: amax = m * 2^e with m in [0.5, 1), so floor(log2(amax)) = e - 1 exactly (subnormals too).
            _, e = torch.frexp(amax)
            exp = e.to(torch.int64) - 1 - self.element.spec.max_exponent
            zero = amax == 0
        else:
            # Division in the input dtype: for float32 this is torchao's fp32 ``descale``.
            descale = exact_div(amax, self.element.max_value)
            m, e = torch.frexp(descale)
            exp = e.to(torch.int64) - (m == 0.5).to(torch.int64)  # exact ceil(log2(descale))
            zero = descale == 0  # an all-zero block, or a descale below the dtype's range
        exp = exp.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
        exp = torch.where(zero, torch.full_like(exp, E8M0_MIN_EXP), exp)
        return torch.where(amax.isfinite(), exp, torch.full_like(exp, _NAN_EXP))

    def _values(
        self, x: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Element grid values ``[..., d_k, d_v]`` and the per-element scale, both in ``x``'s dtype."""
        check_state(self, x)
        exp = self.shared_exponents(x)
        scale = _block_scales(exp, x.dtype, x.shape[-2])
        # Dividing by a power of two is exact (or, below the normal range, one correct rounding that the
        # element grid then rounds to zero anyway), so division and torchao's reciprocal multiply agree.
        v = self.element.round(x / scale, stochastic=self.stochastic, generator=generator)
        return v, exp

    def quantize(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> QuantizedState:
        v, exp = self._values(x, generator)
        parts = {"codes": self.element.encode(v), "scale": (exp + E8M0_BIAS).to(torch.uint8)}
        return QuantizedState(self.name, x.shape, parts)

    def _dequantize(self, q: QuantizedState, dtype: torch.dtype) -> torch.Tensor:
        check_parts(self, q, ("codes", "scale"))
        exp = q["scale"].to(torch.int64) - E8M0_BIAS
        return self.element.decode(q["codes"], dtype) * _block_scales(exp, dtype, q.shape[-2])

    def fake_quantize(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        v, exp = self._values(x, generator)
        return v * _block_scales(exp, x.dtype, x.shape[-2])

    def bits_per_element(self, d_k: int, d_v: int) -> float:
        # One 8-bit scale per (block, value column); a padded last block still stores a full scale.
        return self.element.bits + 8 * math.ceil(d_k / MX_BLOCK) / d_k

    def part_bits(self) -> dict[str, int]:
        return {"codes": self.element.bits, "scale": 8}
