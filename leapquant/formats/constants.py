"""Bit-level constants of every element and scale encoding leapquant uses, in one place.

Element layouts follow the OCP Microscaling (MX) v1.0 specification for FP8/FP6/FP4 and IEEE 754 for
fp16/bf16.  ``max_normal`` is the largest finite magnitude; values beyond it saturate (we clamp before
rounding, never produce inf).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "BF16",
    "E2M1",
    "E2M3",
    "E3M2",
    "E4M3",
    "E5M2",
    "E8M0_BIAS",
    "E8M0_MAX_EXP",
    "E8M0_MIN_EXP",
    "E8M0_NAN_CODE",
    "FP16",
    "MINIFLOATS",
    "MX_BLOCK",
    "NVFP_BLOCK",
    "SCALE_BITS_FP32",
    "MinifloatSpec",
    "int_qmax",
]


@dataclass(frozen=True)
class MinifloatSpec:
    """A sign-exponent-mantissa float with subnormals.

    ``has_inf`` marks IEEE-style encodings whose top exponent field is reserved for inf/NaN (e5m2, fp16,
    bf16); the others (e4m3fn and the MX FP6/FP4 types) use every exponent field for finite values.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max_normal: float
    has_inf: bool

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def min_exponent(self) -> int:
        """Unbiased exponent of the smallest normal; subnormals share its step."""
        return 1 - self.bias

    @property
    def min_normal(self) -> float:
        return 2.0**self.min_exponent

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.min_exponent - self.mantissa_bits)

    @property
    def max_exponent(self) -> int:
        """Unbiased exponent of ``max_normal`` (the MX spec's ``emax_elem``)."""
        return math.floor(math.log2(self.max_normal))


E4M3 = MinifloatSpec("e4m3", 4, 3, 7, 448.0, False)
E5M2 = MinifloatSpec("e5m2", 5, 2, 15, 57344.0, True)
E2M3 = MinifloatSpec("e2m3", 2, 3, 1, 7.5, False)
E3M2 = MinifloatSpec("e3m2", 3, 2, 3, 28.0, False)
E2M1 = MinifloatSpec("e2m1", 2, 1, 1, 6.0, False)
FP16 = MinifloatSpec("fp16", 5, 10, 15, 65504.0, True)
BF16 = MinifloatSpec("bf16", 8, 7, 127, float.fromhex("0x1.fep127"), True)

MINIFLOATS = {s.name: s for s in (E4M3, E5M2, E2M3, E3M2, E2M1, FP16, BF16)}

# E8M0: an unsigned power-of-two exponent, bias 127, code 0xFF is NaN (OCP MX v1.0, section 5.4).
E8M0_BIAS = 127
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127
E8M0_NAN_CODE = 0xFF

MX_BLOCK = 32  # OCP MX block size
NVFP_BLOCK = 16  # NVFP4 block size (and of our NVFP6 variant)
SCALE_BITS_FP32 = 32


def int_qmax(bits: int) -> int:
    """Largest code of a symmetric signed integer format: 127 for int8, 31 for int6, 7 for int4."""
    return 2 ** (bits - 1) - 1
