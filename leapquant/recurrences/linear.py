"""Records for the recurrences without a delta read (``b = 0``), and native references.

Families: linear attention, RetNet, Mamba2 (SSD), GLA, RWKV6, HGRN2.  Every ``*_records`` function turns a
model's native per-token tensors into general-form :class:`~leapquant.recurrences.records.Records` of the
paper's eq. 1; every ``naive_*`` function runs the model's own recurrence as its reference implementation
writes it, so the two can be checked against each other.

Layouts follow FLA: inputs are ``[B, T, H, D]`` (batch, time, head, channel), gates are log-space, and the
native state is ``[B, H, K, V]`` (key rows, as FLA's raw ops and transformers keep it) except Mamba2, whose
native state is mamba_ssm's ``[B, H, P, N]`` (head dim first, d_state last).  Records have leading dims
``[B, H]``: tensors ``[B, H, T, d]``.  Everything is computed in the inputs' dtype (the FLA references upcast
to float32; pass float64 for a reference).

This module also holds the small shape and layout helpers that ``delta.py`` and ``rwkv7.py`` share.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import LeapQuantError
from .records import Records

__all__ = [
    "gla_records",
    "hgrn2_gates",
    "hgrn2_records",
    "l2norm",
    "linear_attention_records",
    "mamba2_gates",
    "mamba2_records",
    "mamba2_skip",
    "naive_recurrent_gla",
    "naive_recurrent_hgrn2",
    "naive_recurrent_linear_attention",
    "naive_recurrent_mamba2",
    "naive_recurrent_retnet",
    "naive_recurrent_rwkv6",
    "retnet_gammas",
    "retnet_records",
    "rwkv6_bonus",
    "rwkv6_records",
]


# --- Shared helpers (also used by delta.py and rwkv7.py) ----------------------------------------------------


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis, as FLA's ``l2norm_fwd`` kernel computes it.

    transformers writes the same thing as ``x * rsqrt(sum(x*x) + eps)`` with the same eps (1e-6); the two
    differ only in the last bit of rounding.
    """
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def _shape_error(fn: str, arg: str, x: torch.Tensor, expected: str) -> LeapQuantError:
    return LeapQuantError(f"{fn}: {arg} has shape {tuple(x.shape)}, expected {expected}")


def _check_shape(fn: str, arg: str, x: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(x.shape) != tuple(expected):
        raise _shape_error(fn, arg, x, str(tuple(expected)))


def _check_qkv(
    fn: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grouped: bool,
    names: tuple[str, str, str] = ("q", "k", "v"),
) -> tuple[int, int, int, int, int, int]:
    """Check ``q, k: [B, T, H, K]`` and ``v: [B, T, HV, V]``; return ``(B, T, H, K, HV, V)``.

    Grouped value heads (``HV`` a multiple of ``H``) are allowed only where ``grouped`` is true; ``names``
    are the argument names the messages use.
    """
    nq, nk, nv = names
    if q.ndim != 4:
        raise _shape_error(fn, nq, q, "[B, T, H, K]")
    B, T, H, K = q.shape
    _check_shape(fn, nk, k, (B, T, H, K))
    if v.ndim != 4 or v.shape[:2] != (B, T):
        raise _shape_error(fn, nv, v, f"({B}, {T}, HV, V)")
    HV, V = v.shape[2], v.shape[3]
    if grouped and HV % H != 0:
        raise LeapQuantError(f"{fn}: value heads HV={HV} must be a multiple of key heads H={H}")
    if not grouped and HV != H:
        raise LeapQuantError(f"{fn}: {nv} has {HV} heads, expected H={H} like {nq} and {nk}")
    return B, T, H, K, HV, V


def _check_state(fn: str, state: torch.Tensor | None, expected: tuple[int, ...]) -> None:
    if state is not None:
        _check_shape(fn, "initial_state", state, expected)


def _heads_first(x: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """``[B, T, H, D] -> [B, H*groups, T, D]``; key head ``h`` serves value heads ``h*groups .. +groups-1``.

    That is FLA's grouped-value convention (``repeat_interleave`` over heads): value head ``i`` reads key
    head ``i // groups``.
    """
    if groups > 1:
        x = x.repeat_interleave(groups, dim=2)
    return x.transpose(1, 2).contiguous()


def _scalar_decay(g: torch.Tensor, d_k: int) -> torch.Tensor:
    """Log-space scalar gate ``[B, T, H]`` -> decay ``[B, H, T, d_k]`` (the scalar broadcast over keys)."""
    return g.exp().transpose(1, 2)[..., None].expand(-1, -1, -1, d_k).contiguous()


def _resolve_scale(scale: float | None, d_k: int) -> float:
    return d_k**-0.5 if scale is None else scale


def _state_or_zeros(
    initial_state: torch.Tensor | None, like: torch.Tensor, shape: tuple[int, ...]
) -> torch.Tensor:
    if initial_state is None:
        return like.new_zeros(shape)
    return initial_state.to(like.dtype).clone()


# --- Linear attention (Katharopoulos et al. 2020; FLA fused_recurrent_linear_attn without normalisation) ----


def linear_attention_records(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> Records:
    """Linear attention ``S_t = S_{t-1} + k_t v_t^T``, ``o_t = S_t^T (scale q_t)`` as records.

    Args:
        q, k: ``[B, T, H, K]`` (any feature map already applied).
        v: ``[B, T, H, V]``.
        scale: query scale, ``K**-0.5`` by default (FLA's default).

    Returns:
        Records ``[B, H, T, .]`` with ``a = 1`` and ``b = 0``.
    """
    _, _, _, K, _, _ = _check_qkv("linear_attention_records", q, k, v, grouped=False)
    kt = _heads_first(k)
    return Records(
        a=torch.ones_like(kt),
        k=kt,
        b=torch.zeros_like(kt),
        v=_heads_first(v),
        q=_heads_first(q) * _resolve_scale(scale, K),
    )


def naive_recurrent_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Native linear attention, token by token (FLA ``naive_recurrent_linear_attn`` without normaliser).

    Returns ``(o [B, T, H, V], S [B, H, K, V])``.
    """
    B, T, H, K, _, V = _check_qkv("naive_recurrent_linear_attention", q, k, v, grouped=False)
    _check_state("naive_recurrent_linear_attention", initial_state, (B, H, K, V))
    scale = _resolve_scale(scale, K)
    S = _state_or_zeros(initial_state, v, (B, H, K, V))
    o = v.new_zeros(B, T, H, V)
    for t in range(T):
        S = S + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = (S * (q[:, t] * scale)[..., None]).sum(-2)
    return o, S


# --- RetNet (Sun et al. 2023): a constant decay gamma per head ----------------------------------------------


def retnet_gammas(
    num_heads: int, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None
) -> torch.Tensor:
    """RetNet's per-head decays ``gamma_h = 1 - 2**(-5 - h)`` (the paper's and FLA's schedule), ``[H]``."""
    h = torch.arange(num_heads, dtype=dtype, device=device)
    return 1 - torch.pow(torch.tensor(2.0, dtype=dtype, device=device), -5.0 - h)


def _check_gamma(fn: str, gamma: torch.Tensor | None, like: torch.Tensor, H: int) -> torch.Tensor:
    if gamma is None:
        return retnet_gammas(H, dtype=like.dtype, device=like.device)
    _check_shape(fn, "gamma", gamma, (H,))
    if not ((gamma >= 0) & (gamma <= 1)).all():
        raise LeapQuantError(f"{fn}: gamma holds decays in [0, 1] (not log decays), got {gamma.tolist()}")
    return gamma.to(like.dtype)


def retnet_records(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor | None = None,
    scale: float | None = None,
) -> Records:
    """Retention ``S_t = gamma_h S_{t-1} + k_t v_t^T``, ``o_t = S_t^T (scale q_t)`` as records.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        gamma: ``[H]`` decays (not log-space); ``retnet_gammas(H)`` by default.
        scale: query scale, ``K**-0.5`` by default (FLA's retention ops).
    """
    B, T, H, K, _, _ = _check_qkv("retnet_records", q, k, v, grouped=False)
    gamma = _check_gamma("retnet_records", gamma, q, H)
    kt = _heads_first(k)
    return Records(
        a=gamma[None, :, None, None].expand(B, H, T, K).contiguous(),
        k=kt,
        b=torch.zeros_like(kt),
        v=_heads_first(v),
        q=_heads_first(q) * _resolve_scale(scale, K),
    )


def naive_recurrent_retnet(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Native recurrent retention (RetNet eq. 1 with the decay per head). Returns ``(o, S [B, H, K, V])``."""
    B, T, H, K, _, V = _check_qkv("naive_recurrent_retnet", q, k, v, grouped=False)
    gamma = _check_gamma("naive_recurrent_retnet", gamma, q, H)
    _check_state("naive_recurrent_retnet", initial_state, (B, H, K, V))
    scale = _resolve_scale(scale, K)
    S = _state_or_zeros(initial_state, v, (B, H, K, V))
    o = v.new_zeros(B, T, H, V)
    for t in range(T):
        S = gamma[None, :, None, None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = (S * (q[:, t] * scale)[..., None]).sum(-2)
    return o, S


# --- Mamba2 (Dao and Gu 2024), the SSD recurrence with a scalar A per head ----------------------------------


def mamba2_gates(
    dt_raw: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's step size and decay rate: ``dt = softplus(dt_raw + dt_bias)``, ``A = -exp(A_log)``.

    Args:
        dt_raw: ``[B, T, H]`` projected step sizes; dt_bias, A_log: ``[H]``.

    Returns:
        ``(dt [B, T, H], A [H])``.  (mamba_ssm also clamps ``dt`` to ``dt_limit``, default unbounded.)
    """
    H = dt_raw.shape[-1]
    _check_shape("mamba2_gates", "dt_bias", dt_bias, (H,))
    _check_shape("mamba2_gates", "A_log", A_log, (H,))
    return F.softplus(dt_raw + dt_bias), -torch.exp(A_log)


def _check_mamba2(
    fn: str, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, Bm: torch.Tensor, Cm: torch.Tensor
) -> tuple[int, int, int, int, int, int]:
    if x.ndim != 4:
        raise _shape_error(fn, "x", x, "[B, T, H, P]")
    B, T, H, P = x.shape
    _check_shape(fn, "dt", dt, (B, T, H))
    _check_shape(fn, "A", A, (H,))
    if not (A <= 0).all():
        raise LeapQuantError(f"{fn}: A must be <= 0 (decays exp(dt * A) <= 1; -exp(A_log)), got {A.tolist()}")
    if Bm.ndim != 4 or Bm.shape[:2] != (B, T):
        raise _shape_error(fn, "B", Bm, f"({B}, {T}, G, N)")
    G, N = Bm.shape[2], Bm.shape[3]
    _check_shape(fn, "C", Cm, (B, T, G, N))
    if H % G != 0:
        raise LeapQuantError(f"{fn}: heads H={H} must be a multiple of B/C groups G={G}")
    return B, T, H, P, G, N


def mamba2_records(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> Records:
    """Mamba2's SSD recurrence ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T``, ``y_t = h_t^T C_t``.

    Mapping: ``d_k = N`` (d_state), ``d_v = P`` (head dim); ``a = exp(dt*A)`` broadcast over ``N``,
    ``k = dt*B``, ``v = x``, ``q = C``, ``b = 0``.  The ``D x`` skip does not touch the state and is left
    out of the records: add :func:`mamba2_skip` to the replayed outputs to get the layer's ``y``.

    Args:
        x: ``[B, T, H, P]``; dt: ``[B, T, H]`` step sizes after softplus (see :func:`mamba2_gates`);
        A: ``[H]`` (negative); B, C: ``[B, T, G, N]`` with ``H`` a multiple of ``G`` (head ``h`` reads group
        ``h // (H // G)``, mamba_ssm's ``repeat(B, "b g n -> b (g h) n")``).

    Returns:
        Records ``[B, H, T, .]`` with ``d_k = N``, ``d_v = P``.  The state is the transpose of mamba_ssm's
        ``[B, H, P, N]`` ssm_state.
    """
    _, _, H, _, G, N = _check_mamba2("mamba2_records", x, dt, A, B, C)
    dt_h = dt.transpose(1, 2)[..., None]  # [B, H, T, 1]
    kt = _heads_first(B, H // G) * dt_h
    return Records(
        a=torch.exp(dt_h * A[None, :, None, None]).expand(-1, -1, -1, N).contiguous(),
        k=kt,
        b=torch.zeros_like(kt),
        v=_heads_first(x),
        q=_heads_first(C, H // G),
    )


def mamba2_skip(x: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """Mamba2's skip term ``D_h x_t`` (``x: [B, T, H, P]``, ``D: [H]``), returned as ``[B, T, H, P]``."""
    if x.ndim != 4:
        raise _shape_error("mamba2_skip", "x", x, "[B, T, H, P]")
    _check_shape("mamba2_skip", "D", D, (x.shape[2],))
    return x * D[:, None]


def naive_recurrent_mamba2(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Native Mamba2 SSD recurrence, step by step as mamba_ssm's ``selective_state_update_ref`` writes it.

    Per step: ``dA = exp(dt A)``, ``state = state * dA + (dt B) x`` (outer product), ``y = state C + D x``
    (no ``z`` gate here).  The state keeps mamba_ssm's layout ``[B, H, P, N]`` (head dim, d_state).

    Returns:
        ``(y [B, T, H, P], state [B, H, P, N])``.
    """
    Bsz, T, H, P, G, N = _check_mamba2("naive_recurrent_mamba2", x, dt, A, B, C)
    _check_state("naive_recurrent_mamba2", initial_state, (Bsz, H, P, N))
    Bh = B.repeat_interleave(H // G, dim=2)  # [B, T, H, N]
    Ch = C.repeat_interleave(H // G, dim=2)
    state = _state_or_zeros(initial_state, x, (Bsz, H, P, N))
    y = x.new_zeros(Bsz, T, H, P)
    for t in range(T):
        dA = torch.exp(dt[:, t] * A)[..., None, None]  # [B, H, 1, 1]
        dB = dt[:, t, :, None, None] * Bh[:, t, :, None, :]  # [B, H, 1, N]
        state = state * dA + dB * x[:, t, :, :, None]
        y[:, t] = torch.einsum("bhpn,bhn->bhp", state, Ch[:, t])
        if D is not None:
            y[:, t] = y[:, t] + x[:, t] * D[:, None]
    return y, state


# --- GLA (Yang et al. 2023): data-dependent decay per key channel -------------------------------------------


def gla_records(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor, scale: float | None = None
) -> Records:
    """GLA ``S_t = Diag(exp(gk_t)) S_{t-1} + k_t v_t^T``, ``o_t = S_t^T (scale q_t)`` as records.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; gk: ``[B, T, H, K]`` log-space decay (FLA's ``gk``).
        scale: ``K**-0.5`` by default (FLA).
    """
    B, T, H, K, _, _ = _check_qkv("gla_records", q, k, v, grouped=False)
    _check_shape("gla_records", "gk", gk, (B, T, H, K))
    kt = _heads_first(k)
    return Records(
        a=_heads_first(gk).exp(),
        k=kt,
        b=torch.zeros_like(kt),
        v=_heads_first(v),
        q=_heads_first(q) * _resolve_scale(scale, K),
    )


def naive_recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Native GLA recurrence as FLA's ``naive_recurrent_gla``: ``h = h * exp(gk)[..., None] + k v^T``,
    ``o = (h * scale q[..., None]).sum(-2)``.  Returns ``(o [B, T, H, V], S [B, H, K, V])``."""
    B, T, H, K, _, V = _check_qkv("naive_recurrent_gla", q, k, v, grouped=False)
    _check_shape("naive_recurrent_gla", "gk", gk, (B, T, H, K))
    _check_state("naive_recurrent_gla", initial_state, (B, H, K, V))
    scale = _resolve_scale(scale, K)
    S = _state_or_zeros(initial_state, v, (B, H, K, V))
    o = v.new_zeros(B, T, H, V)
    for t in range(T):
        S = S * gk[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = (S * (q[:, t] * scale)[..., None]).sum(-2)
    return o, S


# --- RWKV6 (Peng et al. 2024): vector decay, readout of the previous state plus a bonus ---------------------


def _check_rwkv6(
    fn: str, r: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, u: torch.Tensor
) -> tuple[int, int, int, int, int, int]:
    B, T, H, K, HV, V = _check_qkv(fn, r, k, v, grouped=False, names=("r", "k", "v"))
    _check_shape(fn, "w", w, (B, T, H, K))
    _check_shape(fn, "u", u, (H, K))
    return B, T, H, K, HV, V


def rwkv6_records(
    r: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    scale: float | None = None,
) -> Records:
    """RWKV6 ``S_t = Diag(exp(w_t)) S_{t-1} + k_t v_t^T`` with ``readout="pre"`` (``o_t`` reads ``S_{t-1}``).

    Args:
        r, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; w: ``[B, T, H, K]`` log-space decay as FLA's RWKV6 ops
        take it (the layer passes ``w = -exp(w_raw)``, so the decay is ``exp(-exp(w_raw))``); u: ``[H, K]``
        bonus, used only by :func:`rwkv6_bonus`; scale: ``K**-0.5`` by default (FLA's ops; the RWKV6
        layer passes 1.0).

    Returns:
        Records ``[B, H, T, .]``.  Replayed outputs are ``S_{t-1}^T (scale r_t)`` and EXCLUDE the bonus
        ``(scale r_t . (u ⊙ k_t)) v_t``, which does not touch the state: add :func:`rwkv6_bonus`.
    """
    _, _, _, K, _, _ = _check_rwkv6("rwkv6_records", r, k, v, w, u)
    kt = _heads_first(k)
    return Records(
        a=_heads_first(w).exp(),
        k=kt,
        b=torch.zeros_like(kt),
        v=_heads_first(v),
        q=_heads_first(r) * _resolve_scale(scale, K),
        readout="pre",
    )


def rwkv6_bonus(
    r: torch.Tensor, k: torch.Tensor, v: torch.Tensor, u: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """RWKV6's current-token bonus ``(scale r_t . (u ⊙ k_t)) v_t`` as ``[B, T, H, V]``."""
    _, _, H, K, _, _ = _check_qkv("rwkv6_bonus", r, k, v, grouped=False, names=("r", "k", "v"))
    _check_shape("rwkv6_bonus", "u", u, (H, K))
    weight = (r * _resolve_scale(scale, K) * u * k).sum(-1, keepdim=True)
    return weight * v


def naive_recurrent_rwkv6(
    r: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Native RWKV6 as FLA's ``naive_recurrent_rwkv6``: ``o_t = (h + u k_t v_t^T)^T (scale r_t)``, then
    ``h = h * exp(w_t)[..., None] + k_t v_t^T``.  Returns ``(o [B, T, H, V] with the bonus, S [B, H, K, V])``.
    """
    B, T, H, K, _, V = _check_rwkv6("naive_recurrent_rwkv6", r, k, v, w, u)
    _check_state("naive_recurrent_rwkv6", initial_state, (B, H, K, V))
    scale = _resolve_scale(scale, K)
    S = _state_or_zeros(initial_state, v, (B, H, K, V))
    o = v.new_zeros(B, T, H, V)
    for t in range(T):
        kv = k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = ((S + u[None, :, :, None] * kv) * (r[:, t] * scale)[..., None]).sum(-2)
        S = S * w[:, t].exp()[..., None] + kv
    return o, S


# --- HGRN2 (Qin et al. 2024): GLA with the key tied to the forget gate, k = 1 - f ---------------------------


def hgrn2_gates(f: torch.Tensor, lower_bound: torch.Tensor | None = None) -> torch.Tensor:
    """HGRN2's log forget gate from the ``f_proj`` output, as FLA's ``HGRN2Attention`` computes it.

    ``g = logsigmoid(f)``; with a layer lower bound ``lb`` (layers after the first),
    ``g = logaddexp(log(lb), log1p(-lb) + g)``, i.e. ``forget = lb + (1 - lb) sigmoid(f)``.
    Shapes: ``f [..., H, K]``, ``lower_bound`` broadcastable to ``[H, K]`` (FLA passes ``[H*K]`` flat;
    reshape it first).
    """
    g = F.logsigmoid(f)
    if lower_bound is not None:
        g = torch.logaddexp(lower_bound.log(), torch.log1p(-lower_bound) + g)
    return g


def hgrn2_records(q: torch.Tensor, g: torch.Tensor, i: torch.Tensor, scale: float | None = None) -> Records:
    """HGRN2 ``h_t = Diag(f_t) h_{t-1} + (1 - f_t) i_t^T``, ``o_t = h_t^T (scale q_t)`` with ``f = exp(g)``.

    FLA's HGRN2 layer runs this as GLA with ``k = 1 - exp(g)``, ``v = i``, ``gk = g``.

    Args:
        q: ``[B, T, H, K]`` (swish already applied); g: ``[B, T, H, K]`` log forget gate
        (:func:`hgrn2_gates`); i: ``[B, T, H, V]`` input; scale: ``K**-0.5`` by default (GLA's default, which
        the HGRN2 layer keeps).
    """
    _, _, _, K, _, _ = _check_qkv("hgrn2_records", q, g, i, grouped=False, names=("q", "g", "i"))
    kt = _heads_first(1 - g.exp())
    return Records(
        a=_heads_first(g).exp(),
        k=kt,
        b=torch.zeros_like(kt),
        v=_heads_first(i),
        q=_heads_first(q) * _resolve_scale(scale, K),
    )


def naive_recurrent_hgrn2(
    q: torch.Tensor,
    g: torch.Tensor,
    i: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Native HGRN2 from its definition (paper eq. for the state-expanded gated linear RNN):
    ``h_t = f_t[:, None] * h_{t-1} + (1 - f_t) i_t^T``, ``o_t = h_t^T (scale q_t)``.

    Returns ``(o [B, T, H, V], h [B, H, K, V])``.
    """
    B, T, H, K, _, V = _check_qkv("naive_recurrent_hgrn2", q, g, i, grouped=False, names=("q", "g", "i"))
    _check_state("naive_recurrent_hgrn2", initial_state, (B, H, K, V))
    scale = _resolve_scale(scale, K)
    h = _state_or_zeros(initial_state, i, (B, H, K, V))
    o = i.new_zeros(B, T, H, V)
    for t in range(T):
        f = g[:, t].exp()
        h = f[..., None] * h + (1 - f)[..., None] * i[:, t, :, None, :]
        o[:, t] = (h * (q[:, t] * scale)[..., None]).sum(-2)
    return o, h
