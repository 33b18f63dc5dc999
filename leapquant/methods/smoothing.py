"""Residual smoothing (paper section 3.4, eq. 7).

Each key row of the residual is divided by ``c_i = sqrt(mean_j |R_ij|)`` before per-value-channel
quantization, which balances row magnitudes (a row ``m`` times larger ends up only ``sqrt(m)`` times larger),
and multiplied back after dequantization.  The scales are stored in fp32 beside the residual.
"""

from __future__ import annotations

import torch

__all__ = ["SMOOTHING_FLOOR", "smoothing_scales"]

# Scales never go below FLOOR, so a zero row does not divide by zero: a row whose mean magnitude is under
# FLOOR**2 is divided by FLOOR (the scale is continuous at the threshold and such rows carry nothing a
# quantizer could lose).
SMOOTHING_FLOOR = 1e-6


def smoothing_scales(residual: torch.Tensor, floor: float = SMOOTHING_FLOOR) -> torch.Tensor:
    """Smoothing scales ``c`` of a residual ``[..., d_k, d_v]``: ``[..., d_k]``, rounded to fp32."""
    c = residual.abs().mean(dim=-1).sqrt().clamp_min(floor)
    return c.to(torch.float32).to(residual.dtype)
