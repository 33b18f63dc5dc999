"""Readable torch reference of the per-step decode on a :class:`PerStepPool` (paper eq. 2, FLA's update)."""

from __future__ import annotations

import torch

from ...formats import get_format

__all__ = ["dequant_ref", "records_ref", "step_ref", "store_ref"]


def dequant_ref(pool, slots: torch.Tensor) -> torch.Tensor:
    """``[N, HV, V, K]`` fp32 states of ``slots`` (V-first, as stored)."""
    state = pool.state[slots].float()
    if pool.fmt == "int8":
        state = state * pool.scale[slots][..., None]
    return state


def store_ref(pool, slots: torch.Tensor, states: torch.Tensor) -> None:
    """Quantize V-first fp32 ``states [N, HV, V, K]`` into ``slots`` with the pool's format."""
    kv = states.transpose(-1, -2)  # the formats take the paper's [K, V] orientation
    if pool.fmt == "fp32":
        pool.state[slots] = states
    elif pool.fmt == "bf16":
        pool.state[slots] = get_format("bf16").quantize(kv)["values"].transpose(-1, -2)
    else:
        stored = get_format("int8").quantize(kv)  # per value channel, fp32 scales
        pool.state[slots] = stored["codes"].transpose(-1, -2)
        pool.scale[slots] = stored["scale"][..., 0, :]


def step_ref(pool, slots, q, k, v, g, beta, qk_scale: float, use_qk_l2norm: bool) -> torch.Tensor:
    """FLA's GDN/KDA step on dequantized states, then re-quantization; returns ``o [N, HV, V]``."""
    from ...recurrences import l2norm

    heads = v.shape[1]
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q.repeat_interleave(heads // q.shape[1], dim=1) * qk_scale
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    out = torch.zeros_like(v)
    real = slots >= 0
    idx = slots[real].long()
    h = dequant_ref(pool, idx)  # [n', HV, V, K]
    decay = g[real].exp()
    h = h * (decay[..., None, :] if g.ndim == 3 else decay[..., None, None])
    kr, qr = k[real], q[real]
    u = beta[real][..., None] * (v[real] - (h * kr[..., None, :]).sum(-1))
    h = h + u[..., None] * kr[..., None, :]
    out[real] = (h * qr[..., None, :]).sum(-1)
    store_ref(pool, idx, h)
    return out


def records_ref(pool, slots, g, kw, b, v, q, readout: str = "post") -> torch.Tensor:
    """General records (paper eq. 2): ``u = v - S^T b``, ``S = Diag(a) S + kw u^T``, then re-quantization."""
    out = torch.zeros_like(v)
    real = slots >= 0
    idx = slots[real].long()
    h = dequant_ref(pool, idx)  # [n', HV, V, K]
    u = v[real] - (h * b[real][..., None, :]).sum(-1)
    if readout == "pre":
        out[real] = (h * q[real][..., None, :]).sum(-1)
    decay = g[real].exp()
    h = h * (decay[..., None, :] if g.ndim == 3 else decay[..., None, None])
    h = h + u[..., None] * kw[real][..., None, :]
    if readout != "pre":
        out[real] = (h * q[real][..., None, :]).sum(-1)
    store_ref(pool, idx, h)
    return out
