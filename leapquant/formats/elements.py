"""Element codecs: round a (pre-scaled) tensor onto a format's grid, and convert grid values to bit codes.

Rounding is round-to-nearest-even unless ``stochastic`` is set; magnitudes beyond the largest finite value
are clamped (saturation) before rounding, so no element ever becomes inf.  Both codecs compute in the
input's dtype (float32 or float64): every operation on the grid is exact in either, so the result does not
depend on which one the caller uses, except for the division that produced the input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .constants import MinifloatSpec, int_qmax

__all__ = ["Element", "IntElement", "MinifloatElement", "round_to_integers"]


def round_to_integers(y: torch.Tensor, stochastic: bool, generator: torch.Generator | None) -> torch.Tensor:
    """Nearest integer (half to even), or stochastically the floor or the ceiling with probabilities that
    make the expected value ``y``."""
    if not stochastic:
        return torch.round(y)  # half to even
    noise = torch.rand(y.shape, generator=generator, dtype=y.dtype, device=y.device)
    return torch.floor(y + noise)


@dataclass(frozen=True)
class IntElement:
    """Symmetric signed integer: codes in ``[-qmax, qmax]`` (the most negative code is unused)."""

    bits: int

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise ValueError(f"integer elements need 2..8 bits, got {self.bits}")

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    @property
    def max_value(self) -> float:
        return float(int_qmax(self.bits))

    def round(
        self, x: torch.Tensor, *, stochastic: bool = False, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Nearest code value of ``x`` (already divided by its scale), as a float tensor."""
        q = self.max_value
        return round_to_integers(x.clamp(-q, q), stochastic, generator).clamp(-q, q)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """Grid values to ``int8`` codes."""
        return values.to(torch.int8)

    def decode(self, codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return codes.to(dtype)


@dataclass(frozen=True)
class MinifloatElement:
    """A sign-exponent-mantissa element (FP8, FP6, FP4, and fp16/bf16 for stochastic rounding)."""

    spec: MinifloatSpec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def bits(self) -> int:
        return self.spec.bits

    @property
    def max_value(self) -> float:
        return self.spec.max_normal

    def _step(self, ax: torch.Tensor) -> torch.Tensor:
        """Grid spacing at each magnitude: 2^(exponent - mantissa_bits), subnormals share the smallest."""
        _, e = torch.frexp(ax)  # ax = m * 2^e with m in [0.5, 1)
        exponent = (e - 1).clamp(min=self.spec.min_exponent)
        return torch.ldexp(torch.ones_like(ax), exponent - self.spec.mantissa_bits)

    def round(
        self, x: torch.Tensor, *, stochastic: bool = False, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Nearest representable value of ``x`` (already divided by its scale), saturating at max_normal."""
        ax = x.abs().clamp(max=self.spec.max_normal)
        step = self._step(ax)
        q = (round_to_integers(ax / step, stochastic, generator) * step).clamp(max=self.spec.max_normal)
        return torch.copysign(q, x)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """Grid values to bit codes ``sign | exponent | mantissa`` (uint8 for <= 8 bits, else int32)."""
        s = self.spec
        av = values.abs().to(torch.float64)
        sign = torch.signbit(values).to(torch.int64)
        _, e = torch.frexp(av)
        exponent = (e - 1).clamp(min=s.min_exponent)
        normal = av >= s.min_normal
        field_e = torch.where(normal, exponent + s.bias, torch.zeros_like(exponent))
        frac = torch.where(normal, av / torch.ldexp(torch.ones_like(av), exponent) - 1.0, av / s.min_normal)
        field_m = torch.round(frac * 2**s.mantissa_bits).to(torch.int64)
        code = (sign << (s.exponent_bits + s.mantissa_bits)) | (field_e << s.mantissa_bits) | field_m
        return code.to(torch.uint8 if s.bits <= 8 else torch.int32)

    def decode(self, codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        s = self.spec
        c = codes.to(torch.int64)
        field_m = c & ((1 << s.mantissa_bits) - 1)
        field_e = (c >> s.mantissa_bits) & ((1 << s.exponent_bits) - 1)
        sign = (c >> (s.exponent_bits + s.mantissa_bits)) & 1
        m = field_m.to(torch.float64) / 2**s.mantissa_bits
        normal = field_e > 0
        exponent = torch.where(normal, field_e - s.bias, torch.full_like(field_e, s.min_exponent))
        mag = torch.ldexp(torch.where(normal, 1.0 + m, m), exponent)
        return torch.where(sign.bool(), -mag, mag).to(dtype)


Element = IntElement | MinifloatElement
