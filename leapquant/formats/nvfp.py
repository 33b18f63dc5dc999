"""NVFP4 (E2M1 elements) and our NVFP6 variant (E2M3): blocks of 16 along keys, E4M3 block scales and an
fp32 scale per head.

The recipe is torchao 0.18's two-level ``nvfp4_quantize`` (``torchao/prototype/mx_formats/nvfp4_tensor.py``),
applied to the V-first ``[d_v, d_k]`` view of each head (blocks along keys), in the same order of
operations so float32 input matches it bit for bit:

1. ``tensor_scale = fp32(amax_head / (448 * emax))`` (``per_tensor_amax_to_scale``; emax = 6 for E2M1);
2. ``block_scale = (amax_block / emax) / tensor_scale``, clamped to [2^-6, 448] (torchao clamps to the E4M3
   *min normal*, so block scales are never subnormal or zero) and rounded to E4M3 (RNE);
3. ``elements = round(x * ((1 / tensor_scale) / block_scale))``, saturating at +-emax;
4. dequantize: ``elements * (tensor_scale * block_scale)``.

Edge case (our definition; torchao returns NaN): ``tensor_scale`` is floored at 2^-120.  An all-zero head
(torchao: 0/0) then stores tensor scale 2^-120, block scales 2^-6 and codes 0, and a tiny head keeps
``(1 / tensor_scale) / block_scale <= 2^126`` finite in float32 (torchao overflows it to inf, and 0 * inf
is NaN, once amax < ~5e-34).  Heads with amax >= 448 * emax * 2^-120 (~2e-33) are unaffected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import LeapQuantError
from .base import QuantizedState, StateFormat, expand_blocks, to_blocks
from .constants import E2M1, E2M3, E4M3, NVFP_BLOCK, SCALE_BITS_FP32
from .elements import MinifloatElement
from .scaled import check_flag, check_parts, check_state, exact_div, fp32_scale

__all__ = ["NVFP_NAMES", "NVFPFormat"]

NVFP_NAMES = {E2M1: "nvfp4", E2M3: "nvfp6"}
_E4M3 = MinifloatElement(E4M3)
TENSOR_SCALE_MIN = 2.0**-120  # keeps (1 / tensor_scale) / block_scale finite in float32, see above


@dataclass(frozen=True)
class NVFPFormat(StateFormat):
    """NVFP4 (``E2M1``, max 6) or NVFP6 (``E2M3``, max 7.5), block 16 along keys.

    NVFP6 is our own variant, not an NVIDIA format: the NVFP4 recipe with E2M3 elements (3 mantissa bits,
    max 7.5) and ``tensor_scale = amax / (448 * 7.5)``, so the block holding the head's amax gets the
    largest E4M3 scale, exactly as NVFP4 does with 448 * 6.

    Parts: ``codes`` uint8 ``[..., d_k, d_v]`` (element bit codes, one per byte; ``bits_per_element`` counts
    the packed width), ``block_scale`` float8_e4m3fn ``[..., ceil(d_k/16), d_v]`` and ``tensor_scale``
    float32 ``[..., 1, 1]`` (one per head).
    """

    element: MinifloatElement
    stochastic: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.element, MinifloatElement) or self.element.spec not in NVFP_NAMES:
            raise LeapQuantError(
                f"NVFP formats take an e2m1 (nvfp4) or e2m3 (nvfp6) element, got {self.element!r}"
            )
        check_flag("NVFP format", self.stochastic)

    @property
    def name(self) -> str:
        return NVFP_NAMES[self.element.spec]

    def scales(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored ``(tensor_scale [..., 1, 1], block_scale [..., ceil(d_k/16), d_v])`` in ``x``'s dtype."""
        emax = self.element.max_value
        ax = x.abs()
        ts = fp32_scale(exact_div(ax.amax(dim=(-2, -1), keepdim=True), E4M3.max_normal * emax))
        ts = ts.clamp(min=TENSOR_SCALE_MIN)
        bs = exact_div(to_blocks(ax, NVFP_BLOCK).amax(dim=-2), emax) / ts
        bs = _E4M3.round(bs.clamp(E4M3.min_normal, E4M3.max_normal))
        return ts, bs

    def _values(
        self, x: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        check_state(self, x)
        ts, bs = self.scales(x)
        # torchao multiplies by (1 / tensor_scale) / block_scale to match the MSLK kernel; so do we.
        recip = expand_blocks(((1.0 / ts) / bs).unsqueeze(-2), NVFP_BLOCK, x.shape[-2])
        v = self.element.round(x * recip, stochastic=self.stochastic, generator=generator)
        return v, ts, bs

    def _scale(self, ts: torch.Tensor, bs: torch.Tensor, d_k: int) -> torch.Tensor:
        # torchao's get_hp_scales: tensor_scale * block_scale, one rounding in float32.
        return expand_blocks((ts * bs).unsqueeze(-2), NVFP_BLOCK, d_k)

    def quantize(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> QuantizedState:
        v, ts, bs = self._values(x, generator)
        parts = {
            "codes": self.element.encode(v),
            "block_scale": bs.to(torch.float8_e4m3fn),
            "tensor_scale": ts.to(torch.float32),
        }
        return QuantizedState(self.name, x.shape, parts)

    def _dequantize(self, q: QuantizedState, dtype: torch.dtype) -> torch.Tensor:
        check_parts(self, q, ("codes", "block_scale", "tensor_scale"))
        s = self._scale(q["tensor_scale"].to(dtype), q["block_scale"].to(dtype), q.shape[-2])
        return self.element.decode(q["codes"], dtype) * s

    def fake_quantize(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        v, ts, bs = self._values(x, generator)
        return v * self._scale(ts, bs, x.shape[-2])

    def bits_per_element(self, d_k: int, d_v: int) -> float:
        return self.element.bits + 8 * math.ceil(d_k / NVFP_BLOCK) / d_k + SCALE_BITS_FP32 / (d_k * d_v)

    def part_bits(self) -> dict[str, int]:
        return {"codes": self.element.bits, "block_scale": 8, "tensor_scale": SCALE_BITS_FP32}
