"""Least-squares scale refit (``+ls``): a boundary that stores a projection of what it quantizes.

Per-value-channel symmetric quantization sets each channel's scale to ``s = max |x| / qmax`` and rounds
``x / s`` to codes ``c``.  Its error is nearly independent of ``x``, so the stored channel ``s c`` carries
the energy of ``x`` plus that of the error: ``E ||s c||^2 ~ ||x||^2 + ||e||^2``.  A head that barely
forgets (decay ~1 in directions its keys never correct) keeps that extra energy, and the next window's
scale grows with it: the state's norm compounds by about ``1 + rho^2`` per window (``rho`` the relative
rounding error, ~0.075 for INT4) and diverges, with the error soon larger than the state.

Refitting the scale to the codes, ``s' = <c, x> / <c, c>`` per channel, stores the orthogonal projection
of ``x`` onto its codes: ``||s' c||^2 = ||x||^2 - ||s' c - x||^2 <= ||x||^2``, and the error it leaves
is the smallest any scale gives those codes.  ``x`` is the quantized residual as the codes see it: with
``+smooth`` that is the smoothed residual (key rows divided by ``c_k``), so the guarantee holds for that
weighted norm and for the state itself only without smoothing; with compensators it covers the residual,
not the tokens.  Measured, it is what keeps 4-bit states bounded (RESULTS.md).  The codes are unchanged
(they come from the max scale, so none saturates), and the refit costs two sums per channel at the
window boundary and no stored bytes.  It is computed as ``s * <c, q> / <c, c>`` with the quotients
``q = x / s`` (at most ``qmax`` in magnitude), so no sum overflows where the max scale itself is finite.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import LeapQuantError
from ..formats.base import StateFormat
from ..formats.elements import IntElement
from ..formats.scaled import ScaledFormat, fp32_scale

if TYPE_CHECKING:
    from .config import MethodConfig

__all__ = ["boundary_fake_quantize", "check_scale_fit", "least_squares_fake_quantize", "least_squares_scales"]


def check_scale_fit(fmt: StateFormat, method: str) -> None:
    """``+ls`` needs integer codes with one scale per value channel (``intN``), else LeapQuantError."""
    if not (
        isinstance(fmt, ScaledFormat) and isinstance(fmt.element, IntElement) and fmt.granularity == "col"
    ):
        raise LeapQuantError(
            f"method {method!r}: +ls (least-squares scales) needs an integer format with one scale per "
            f"value channel (int8, int6, int4), got {fmt.name!r}"
        )


def least_squares_fake_quantize(
    fmt: ScaledFormat, x: torch.Tensor, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``dequantize`` of ``x [..., d_k, d_v]`` under ``fmt``'s codes with least-squares channel scales.

    The codes are ``fmt``'s own (max scale, round to nearest or stochastic); each value channel's scale is
    then refitted by :func:`least_squares_scales`.
    Returns a tensor of ``x``'s dtype and shape.
    """
    values, scale = fmt._values(x, generator)  # codes as floats [..., d_k, d_v], scales [..., 1, d_v]
    return values * least_squares_scales(values, x, scale) + 0.0  # +0.0: integer codes have no -0.0


def least_squares_scales(values: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per value channel ``s <c, q> / <c, c>`` over the keys (``q = x / s``), fp32-rounded, in ``x``'s
    dtype, ``[..., 1, d_v]``: the least-squares scale of ``x`` for its codes.

    ``values`` are the codes as floats ``[..., d_k, d_v]`` and ``scale`` the max scales ``s`` they came
    from ``[..., 1, d_v]``.  A channel of zero codes, a non-finite one, or one whose refit underflows fp32
    keeps its max scale.  Codes share ``x``'s signs, so the refit is never negative.
    """
    q = x / scale
    den = (values * values).sum(-2, keepdim=True)
    ratio = (values * q).sum(-2, keepdim=True) / torch.where(den > 0, den, torch.ones_like(den))
    fitted = fp32_scale(scale * ratio)
    return torch.where((den > 0) & (ratio > 0) & (fitted > 0), fitted, scale)


def boundary_fake_quantize(
    cfg: MethodConfig, x: torch.Tensor, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """A window boundary's residual ``x [..., d_k, d_v]`` as ``cfg`` stores it: its format's fake
    quantization, with least-squares scales when ``cfg.least_squares_scales`` (``+ls``)."""
    if cfg.least_squares_scales:
        return least_squares_fake_quantize(cfg.format, x, generator=generator)
    return cfg.format.fake_quantize(x, generator=generator)
