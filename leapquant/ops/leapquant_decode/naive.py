"""Readable torch reference of the LeapQuant decode ops on a :class:`~leapquant.ops.pool.LeapQuantPool`.

It stores exactly what the Triton kernels store (same layout, log decays as the pool keeps them, fp16 tokens
and records, codes from :mod:`leapquant.formats`), one slot at a time, so a kernel can be checked against it
code for code; it is in turn checked against :class:`~leapquant.methods.WindowedState`.  ``compute`` sets
the arithmetic precision (float32 mirrors the kernels, float64 mirrors the simulator).

General-form inputs of one decode step for ``N`` sequences (paper eq. 1): log decay ``g`` (``[N, HV]`` for a
scalar decay, ``[N, HV, K]`` per key channel), write key ``kw``, read vector ``b`` and query ``q``
(``[N, HV, K]``), value ``v`` (``[N, HV, V]``); :func:`native_to_general` makes them from GDN/KDA inputs.
"""

from __future__ import annotations

import torch

from ...formats import get_format
from ...methods.compensators import orthonormalize, start_vectors
from ...methods.scale_fit import least_squares_scales
from ...methods.smoothing import smoothing_scales
from ..pool import LOG_DECAY_FLOOR, LeapQuantPool

__all__ = ["activate_gate", "close_ref", "load_ref", "materialize_ref", "native_to_general", "step_ref"]

_EPS = 1e-30


def activate_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """Raw gate to log decay as the kernels do it, through the models' own gate functions.

    ``g`` is ``[N, HV]`` (GDN: :func:`gdn_gates`, ``dt_bias [HV]``) or ``[N, HV, K]`` (KDA: :func:`kda_gates`,
    ``dt_bias [HV*K]``); ``A_log [HV]``.
    """
    from ...recurrences import gdn_gates, kda_gates

    unused_beta = g.new_zeros(g.shape[:2])
    if g.ndim == 3:
        return kda_gates(g, A_log, dt_bias, unused_beta)[0]
    bias = torch.zeros_like(A_log) if dt_bias is None else dt_bias
    return gdn_gates(g, unused_beta, A_log.to(g.dtype), bias.to(g.dtype))[0]


def native_to_general(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, ...]:
    """GDN/KDA decode inputs (``q, k [N, H, K]``, ``v [N, HV, V]``, ``g [N, HV]`` or ``[N, HV, K]`` log
    decay, ``beta [N, HV]``) to ``(g, kw, b, v, q)``: write key ``beta k``, read vector ``exp(g) k``,
    query ``scale q``; q/k L2-normalised as FLA does (``x / sqrt(sum x^2 + 1e-6)``)."""
    from ...recurrences import l2norm

    h, d_k = q.shape[1:]
    hv = v.shape[1]
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q.repeat_interleave(hv // h, dim=1) * (d_k**-0.5 if scale is None else scale)
    k = k.repeat_interleave(hv // h, dim=1)
    decay = g.exp() if g.ndim == 3 else g.exp()[..., None]
    return g, beta[..., None] * k, decay * k, v, q


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).to(x.dtype) if dtype != torch.float32 else x


def _boundary(pool: LeapQuantPool, slot: int, compute: torch.dtype) -> torch.Tensor:
    """``C dequant(R) + K~ U~^T`` of one slot, ``[HV, V, K]`` (V-first)."""
    cfg = pool.config
    payload = pool.payload[slot]
    if cfg.residual == "int4":
        lo = (payload.to(torch.int16) << 12 >> 12).to(compute)  # sign-extend the low nibble
        hi = (payload.to(torch.int16) << 8 >> 12).to(compute)
        codes = torch.stack([lo, hi], dim=-1).flatten(-2)
    else:
        codes = payload.to(compute)
    state = codes * pool.scale[slot].to(compute)[..., None] if cfg.has_scale else codes
    if cfg.smoothing:
        state = state * pool.smooth[slot].to(compute)[:, None, :]
    if cfg.compensators:
        state = state + pool.comp_u[slot].to(compute).transpose(-1, -2) @ pool.comp_k[slot].to(compute)
    return state


def _cumulative(pool: LeapQuantPool, slot: int, count: int, compute: torch.dtype) -> torch.Tensor:
    """``G_1..G_count`` as ``[HV, count, K']`` (K' = 1 for a scalar decay): GDN's as stored, KDA's the
    records' own decays summed."""
    g = pool.rec_g[slot, :, :count].to(compute)
    return g[..., None] if pool.config.decay == "scalar" else g.cumsum(1)


def _read(pool, slot, count, g_ref, x, boundary, compute):
    """``S_count^T x`` read at cumulative decay ``g_ref [HV, K']`` through eq. 10; ``x [HV, K]``."""
    out = boundary @ (torch.exp(g_ref) * x)[..., None]
    out = out[..., 0]
    if count:
        gj = _cumulative(pool, slot, count, compute)
        keys = pool.rec_k[slot, :, :count].to(compute)
        w = (keys * torch.exp(g_ref[:, None, :] - gj) * x[:, None, :]).sum(-1)  # [HV, count]
        out = out + (pool.rec_u[slot, :, :count].to(compute) * w[..., None]).sum(1)
    return out


def step_ref(
    pool: LeapQuantPool,
    slots: torch.Tensor,
    g: torch.Tensor,
    kw: torch.Tensor,
    b: torch.Tensor,
    v: torch.Tensor,
    q: torch.Tensor,
    *,
    readout: str = "post",
    compute: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Append one record per sequence and return outputs ``[N, HV, V]`` (zeros for padded slots).

    Positions are not advanced here: :func:`close_ref` does that (and closes full windows), as the
    kernels split the step in two launches.
    """
    cfg = pool.config
    rec_dtype = cfg.record_dtype
    out = torch.zeros(v.shape, dtype=compute, device=v.device)
    for n, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        pos = int(pool.pos[slot, 0])
        boundary = _boundary(pool, slot, compute)
        gi = g[n].to(compute)
        gi = gi[:, None] if cfg.decay == "scalar" else gi
        g_prev = _cumulative(pool, slot, pos, compute)[:, -1] if pos else torch.zeros_like(gi)
        gi = gi.clamp_min(LOG_DECAY_FLOOR)
        if cfg.decay == "vector":  # the record keeps the token's own log decay at its precision
            gi = _round(gi, cfg.decay_dtype)
        g_now = g_prev + gi
        x_b, x_q = b[n].to(compute), q[n].to(compute)
        u = v[n].to(compute) - _read(pool, slot, pos, g_prev, x_b, boundary, compute)
        key = _round(kw[n].to(compute), rec_dtype)
        u = _round(u, rec_dtype)
        if readout == "pre":
            out[n] = _read(pool, slot, pos, g_prev, x_q, boundary, compute)
        else:
            out[n] = _read(pool, slot, pos, g_now, x_q, boundary, compute) + u * (key * x_q).sum(
                -1, keepdim=True
            )
        pool.rec_g[slot, :, pos] = g_now[:, 0] if cfg.decay == "scalar" else gi.to(cfg.decay_dtype)
        pool.rec_k[slot, :, pos] = key.to(rec_dtype)
        pool.rec_u[slot, :, pos] = u.to(rec_dtype)
    return out


def _reconstruct(pool: LeapQuantPool, slot: int, count: int, compute: torch.dtype) -> torch.Tensor:
    """Dense ``S_count`` of one slot, ``[HV, V, K]``."""
    boundary = _boundary(pool, slot, compute)
    if not count:
        return boundary
    gj = _cumulative(pool, slot, count, compute)
    g_end = gj[:, -1]
    state = boundary * torch.exp(g_end)[:, None, :]
    keys = pool.rec_k[slot, :, :count].to(compute) * torch.exp(g_end[:, None, :] - gj)
    return state + pool.rec_u[slot, :, :count].to(compute).transpose(-1, -2) @ keys


def _compress(pool: LeapQuantPool, slot: int, state: torch.Tensor, warm: bool) -> None:
    """Fit tokens, smooth, quantize ``state [HV, V, K]`` into ``slot`` (the window-boundary work)."""
    cfg = pool.config
    compute = state.dtype
    s_kv = state.transpose(-1, -2)  # K-first, as the paper writes S
    residual = s_kv
    if cfg.compensators:
        r = cfg.compensators
        start = start_vectors(cfg.d_v, r, dtype=compute, device=state.device).expand(cfg.heads, -1, -1)
        if warm:
            prev = pool.comp_u[slot].to(compute).transpose(-1, -2)  # [HV, V, R]
            usable = prev.norm(dim=-2, keepdim=True) > _EPS
            basis, iters = torch.where(usable, prev, start), cfg.power_iters
        else:
            basis, iters = start, cfg.cold_iters
        for _ in range(iters):
            qk = orthonormalize(s_kv @ basis)
            basis = s_kv.transpose(-1, -2) @ qk
        comp_k, comp_u = qk.to(torch.float16), basis.to(torch.float16)
        pool.comp_k[slot] = comp_k.transpose(-1, -2)
        pool.comp_u[slot] = comp_u.transpose(-1, -2)
        residual = s_kv - comp_k.to(compute) @ comp_u.to(compute).transpose(-1, -2)
    if cfg.smoothing:
        c = smoothing_scales(residual)
        pool.smooth[slot] = c.to(torch.float32)
        residual = residual / c[..., None]
    fmt = get_format(cfg.residual)
    stored = fmt.quantize(residual)
    if cfg.has_scale:
        codes = stored["codes"].transpose(-1, -2)  # [HV, V, K]
        pool.scale[slot] = stored["scale"][..., 0, :]
        if cfg.method.least_squares_scales:
            values = stored["codes"].to(compute)
            pool.scale[slot] = least_squares_scales(values, residual, stored["scale"].to(compute))[
                ..., 0, :
            ].to(torch.float32)
        if cfg.residual == "int4":
            pairs = codes.to(torch.int16).reshape(*codes.shape[:-1], -1, 2)
            codes = ((pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)).to(torch.uint8)
        elif cfg.residual == "fp8-e4m3":
            codes = codes.view(torch.float8_e4m3fn)
        pool.payload[slot] = codes
    else:
        pool.payload[slot] = stored["values"].transpose(-1, -2).to(pool.payload.dtype)


def close_ref(pool: LeapQuantPool, slots: torch.Tensor, *, compute: torch.dtype = torch.float32) -> None:
    """Advance the position of ``slots``; those that complete a window are reconstructed and requantized."""
    cfg = pool.config
    for slot in slots.tolist():
        if slot < 0:
            continue
        pos = int(pool.pos[slot, 0]) + 1
        if pos < cfg.window:
            pool.pos[slot] = pos
            continue
        state = _reconstruct(pool, slot, cfg.window, compute)
        _compress(pool, slot, state, warm=True)
        pool.pos[slot] = 0


def load_ref(
    pool: LeapQuantPool,
    slots: torch.Tensor,
    states: torch.Tensor,
    *,
    layout: str = "kv",
    compute: torch.dtype = torch.float32,
) -> None:
    """Prefill hand-off: quantize full-precision ``states`` (``[N, HV, K, V]`` for ``layout="kv"``,
    ``[N, HV, V, K]`` for ``"vk"``) into ``slots`` with a cold start of the compensator fit."""
    for n, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        s = states[n].to(compute)
        _compress(pool, slot, s.transpose(-1, -2) if layout == "kv" else s, warm=False)
        pool.pos[slot] = 0


def materialize_ref(
    pool: LeapQuantPool, slots: torch.Tensor, *, layout: str = "kv", compute: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dense fp32 states of ``slots`` at their current position (zeros for padded slots)."""
    cfg = pool.config
    out = torch.zeros(len(slots), cfg.heads, cfg.d_v, cfg.d_k, dtype=compute, device=pool.device)
    for n, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[n] = _reconstruct(pool, slot, int(pool.pos[slot, 0]), compute)
    return out.transpose(-1, -2) if layout == "kv" else out
