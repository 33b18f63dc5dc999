"""Records for the delta-rule recurrences, and native references.

Families: DeltaNet, Gated DeltaNet (GDN), KDA and gated DeltaProduct.  FLA and transformers apply the decay
BEFORE the delta read (``S' = a S; u = beta (v - S'^T k); S = S' + k u^T; o = S^T (scale q)``), which in
the paper's general form (eq. 1, Appendix A) is write key ``beta k``, read vector ``a ⊙ k`` and decay ``a``.

Layouts follow FLA: ``q, k: [B, T, H, K]``, ``v: [B, T, HV, V]`` with ``HV`` a multiple of ``H`` (value
head ``i`` reads key/query head ``i // (HV // H)``), gates ``[B, T, HV]`` (scalar per head) or
``[B, T, HV, K]`` (per key channel), ``beta: [B, T, HV]``, log-space gates (``a = exp(g)``), native state
``[B, HV, K, V]``.  Records have leading dims ``[B, HV]``.  Everything is computed in the inputs' dtype (FLA
upcasts to float32; pass float64 for a reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import LeapQuantError
from .linear import (
    _check_qkv,
    _check_shape,
    _check_state,
    _heads_first,
    _resolve_scale,
    _scalar_decay,
    _state_or_zeros,
    l2norm,
)
from .records import Records

__all__ = [
    "deltanet_records",
    "deltaproduct_records",
    "gated_deltanet_records",
    "gdn_gates",
    "kda_gates",
    "kda_records",
    "naive_recurrent_delta_rule",
    "naive_recurrent_gated_delta_product",
    "naive_recurrent_gated_delta_rule",
    "naive_recurrent_kda",
]


# --- Gates from raw model parameters ------------------------------------------------------------------------


def gdn_gates(
    a_raw: torch.Tensor, b_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next / Qwen3.5 GDN gates: ``g = -exp(A_log) softplus(a_raw + dt_bias)``, ``beta = sigmoid(b)``.

    Args:
        a_raw, b_raw: ``[..., HV]`` outputs of the ``a`` and ``b`` projections.
        A_log, dt_bias: ``[HV]``.

    Returns:
        ``(g, beta)``, both ``[..., HV]``; ``g`` is the log-space decay (``a = exp(g)``).
    """
    HV = a_raw.shape[-1]
    if b_raw.shape != a_raw.shape:
        raise LeapQuantError(
            f"gdn_gates: b_raw has shape {tuple(b_raw.shape)}, expected {tuple(a_raw.shape)}"
        )
    _check_shape("gdn_gates", "A_log", A_log, (HV,))
    _check_shape("gdn_gates", "dt_bias", dt_bias, (HV,))
    return -A_log.exp() * F.softplus(a_raw + dt_bias), torch.sigmoid(b_raw)


def kda_gates(
    g_raw: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    b_raw: torch.Tensor,
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kimi-Linear KDA gates, as FLA's ``naive_kda_gate`` / ``fused_kda_gate``, and ``beta = sigmoid(b_raw)``.

    ``g = -exp(A_log_h) softplus(g_raw + dt_bias)`` per key channel; with ``lower_bound`` set (FLA's
    bounded variant) ``g = lower_bound * sigmoid(exp(A_log_h) (g_raw + dt_bias))``.  ``A_log = None`` means a
    unit scale and ``dt_bias = None`` no bias, as in FLA.

    Args:
        g_raw: ``[..., HV, K]``; A_log: ``HV`` elements (any shape); dt_bias: ``HV*K`` elements (FLA keeps it
        flat ``[HV*K]``); b_raw: ``[..., HV]``.

    Returns:
        ``(g [..., HV, K], beta [..., HV])``.
    """
    if g_raw.ndim < 2:
        raise LeapQuantError(f"kda_gates: g_raw has shape {tuple(g_raw.shape)}, expected [..., HV, K]")
    HV, K = g_raw.shape[-2:]
    if b_raw.shape != g_raw.shape[:-1]:
        raise LeapQuantError(
            f"kda_gates: b_raw has shape {tuple(b_raw.shape)}, expected {tuple(g_raw.shape[:-1])}"
        )
    if A_log is not None and A_log.numel() != HV:
        raise LeapQuantError(f"kda_gates: A_log has {A_log.numel()} elements, expected HV={HV}")
    if dt_bias is not None and dt_bias.numel() != HV * K:
        raise LeapQuantError(f"kda_gates: dt_bias has {dt_bias.numel()} elements, expected HV*K={HV * K}")
    x = g_raw if dt_bias is None else g_raw + dt_bias.reshape(HV, K)
    rate = 1.0 if A_log is None else A_log.reshape(HV, 1).exp()
    g = -rate * F.softplus(x) if lower_bound is None else lower_bound * torch.sigmoid(rate * x)
    return g, torch.sigmoid(b_raw)


# --- Shared checks and preprocessing ------------------------------------------------------------------------


def _prepare(
    fn: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    use_qk_l2norm_in_kernel: bool,
) -> tuple[torch.Tensor, torch.Tensor, float, tuple[int, int, int, int, int, int]]:
    dims = _check_qkv(fn, q, k, v, grouped=True)
    B, T, _, K, HV, _ = dims
    _check_shape(fn, "beta", beta, (B, T, HV))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return q, k, _resolve_scale(scale, K), dims


def _decayed_delta_records(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, beta: torch.Tensor, scale: float
) -> Records:
    """Records of the gated delta rule with the decay applied before the read (GDN and KDA, as FLA):
    write key ``beta k``, read vector ``a ⊙ k``, query ``scale q``; ``a`` is ``[B, HV, T, K]``."""
    H, HV = q.shape[2], v.shape[2]
    kt = _heads_first(k, HV // H)
    return Records(
        a=a,
        k=beta.transpose(1, 2)[..., None] * kt,
        b=a * kt,
        v=_heads_first(v),
        q=_heads_first(q, HV // H) * scale,
    )


# --- Gated DeltaNet (Yang et al. 2025): scalar decay per head -----------------------------------------------


def gated_deltanet_records(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> Records:
    """GDN as records: ``a = exp(g)`` over keys, write key ``beta k``, read vector ``a k``, query ``scale q``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g: ``[B, T, HV]`` log decay; beta: ``[B, T, HV]``.
        scale: ``K**-0.5`` by default.
        use_qk_l2norm_in_kernel: L2-normalise ``q`` and ``k`` first (eps 1e-6), as FLA's kernels do.

    Returns:
        Records ``[B, HV, T, .]``.
    """
    q, k, scale, (B, T, _, K, HV, _) = _prepare(
        "gated_deltanet_records", q, k, v, beta, scale, use_qk_l2norm_in_kernel
    )
    _check_shape("gated_deltanet_records", "g", g, (B, T, HV))
    return _decayed_delta_records(q, k, v, _scalar_decay(g, K), beta, scale)


def naive_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Native GDN step by step, as transformers' ``torch_recurrent_gated_delta_rule`` and FLA's naive GDN:

    ``S = S * exp(g)``; ``kv_mem = (S * k[..., None]).sum(-2)``; ``delta = (v - kv_mem) * beta``;
    ``S = S + k[..., None] * delta[..., None, :]``; ``o = (S * (scale q)[..., None]).sum(-2)``, with ``q, k``
    repeated over grouped value heads as FLA does.

    Returns:
        ``(o [B, T, HV, V], S [B, HV, K, V])``.
    """
    fn = "naive_recurrent_gated_delta_rule"
    q, k, scale, (B, T, H, K, HV, V) = _prepare(fn, q, k, v, beta, scale, use_qk_l2norm_in_kernel)
    _check_shape(fn, "g", g, (B, T, HV))
    _check_state(fn, initial_state, (B, HV, K, V))
    q = q.repeat_interleave(HV // H, dim=2) * scale
    k = k.repeat_interleave(HV // H, dim=2)
    S = _state_or_zeros(initial_state, v, (B, HV, K, V))
    o = v.new_zeros(B, T, HV, V)
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        kv_mem = (S * k[:, t, :, :, None]).sum(-2)
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        o[:, t] = (S * q[:, t, :, :, None]).sum(-2)
    return o, S


# --- KDA (Kimi Delta Attention, Team et al. 2025): decay per key channel ------------------------------------


def kda_records(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> Records:
    """KDA as records: ``a = exp(g)`` per key channel, write key ``beta k``, read vector ``a ⊙ k``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g: ``[B, T, HV, K]`` log decay (:func:`kda_gates`);
        beta: ``[B, T, HV]``; scale: ``K**-0.5`` by default; use_qk_l2norm_in_kernel: as in FLA.

    Returns:
        Records ``[B, HV, T, .]``.
    """
    q, k, scale, (B, T, _, K, HV, _) = _prepare("kda_records", q, k, v, beta, scale, use_qk_l2norm_in_kernel)
    _check_shape("kda_records", "g", g, (B, T, HV, K))
    return _decayed_delta_records(q, k, v, _heads_first(g).exp(), beta, scale)


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Native KDA step by step, as FLA's ``naive_recurrent_kda``:

    ``S = S * exp(g)[..., None]``; ``S = S + (beta k) (v - (k[..., None] * S).sum(-2))^T``;
    ``o = einsum(scale q, S)``.

    Returns:
        ``(o [B, T, HV, V], S [B, HV, K, V])``.
    """
    fn = "naive_recurrent_kda"
    q, k, scale, (B, T, H, K, HV, V) = _prepare(fn, q, k, v, beta, scale, use_qk_l2norm_in_kernel)
    _check_shape(fn, "g", g, (B, T, HV, K))
    _check_state(fn, initial_state, (B, HV, K, V))
    q = q.repeat_interleave(HV // H, dim=2) * scale
    k = k.repeat_interleave(HV // H, dim=2)
    S = _state_or_zeros(initial_state, v, (B, HV, K, V))
    o = v.new_zeros(B, T, HV, V)
    for t in range(T):
        k_t = k[:, t]
        S = S * g[:, t].exp()[..., None]
        read = (k_t[..., None] * S).sum(-2)
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k_t, v[:, t] - read)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o, S


# --- DeltaNet (Yang et al. 2024): no decay ------------------------------------------------------------------


def deltanet_records(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> Records:
    """DeltaNet as records: ``a = 1``, write key ``beta k``, read vector ``k``, query ``scale q``.

    Args: as :func:`gated_deltanet_records` without ``g`` (``beta: [B, T, HV]``, scalar per head).
    """
    q, k, scale, (_, _, H, _, HV, _) = _prepare(
        "deltanet_records", q, k, v, beta, scale, use_qk_l2norm_in_kernel
    )
    kt = _heads_first(k, HV // H)
    return Records(
        a=torch.ones_like(kt),
        k=beta.transpose(1, 2)[..., None] * kt,
        b=kt,
        v=_heads_first(v),
        q=_heads_first(q, HV // H) * scale,
    )


def naive_recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Native DeltaNet as FLA's ``naive_recurrent_delta_rule``:
    ``v' = beta (v - (S * k[..., None]).sum(-2))``, ``S = S + k v'^T``, ``o = einsum(scale q, S)``.

    Returns:
        ``(o [B, T, HV, V], S [B, HV, K, V])``.
    """
    fn = "naive_recurrent_delta_rule"
    q, k, scale, (B, T, H, K, HV, V) = _prepare(fn, q, k, v, beta, scale, use_qk_l2norm_in_kernel)
    _check_state(fn, initial_state, (B, HV, K, V))
    q = q.repeat_interleave(HV // H, dim=2) * scale
    k = k.repeat_interleave(HV // H, dim=2)
    S = _state_or_zeros(initial_state, v, (B, HV, K, V))
    o = v.new_zeros(B, T, HV, V)
    for t in range(T):
        k_t = k[:, t]
        v_t = (v[:, t] - (S * k_t[..., None]).sum(-2)) * beta[:, t, :, None]
        S = S + k_t[..., None] * v_t[..., None, :]
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o, S


# --- Gated DeltaProduct (Siems et al. 2025; FLA gated_delta_product): n Householder sub-steps per token -----


def _prepare_product(
    fn: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    num_householder: int,
) -> tuple[int, int, int, int, int, int]:
    if q.ndim != 4:
        raise LeapQuantError(f"{fn}: q has shape {tuple(q.shape)}, expected [B, T, H, K]")
    if num_householder < 1:
        raise LeapQuantError(f"{fn}: num_householder must be >= 1, got {num_householder}")
    B, T, H, K = q.shape
    n = num_householder
    _check_shape(fn, "k", k, (B, T * n, H, K))
    if v.ndim != 4 or v.shape[:2] != (B, T * n) or v.shape[2] % H != 0:
        raise LeapQuantError(
            f"{fn}: v has shape {tuple(v.shape)}, expected ({B}, {T * n}, HV, V) with H={H} | HV"
        )
    HV, V = v.shape[2:]
    _check_shape(fn, "beta", beta, (B, T * n, HV))
    if g is not None:
        _check_shape(fn, "g", g, (B, T, HV))
    return B, T, H, K, HV, V


def deltaproduct_records(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    num_householder: int,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> Records:
    """Gated DeltaProduct as ``T * n`` records, ``n = num_householder`` sub-steps per token.

    Sub-step ``j`` of token ``t`` is one delta-rule step with write key ``beta_{t,j} k_{t,j}``; the token's
    decay ``exp(g_t)`` applies once, on sub-step 0 (FLA places ``g`` there in its interleaved gate), so
    that sub-step has ``a = exp(g_t)`` and read vector ``exp(g_t) k_{t,0}`` and the others ``a = 1``, read
    vector ``k_{t,j}``.  Only the last sub-step emits; it carries ``scale q_t`` and the others a zero query.

    Args:
        q: ``[B, T, H, K]``; k: ``[B, T*n, H, K]``; v: ``[B, T*n, HV, V]``; beta: ``[B, T*n, HV]``
        (sub-step ``j`` of token ``t`` at index ``t*n + j``); g: ``[B, T, HV]`` log decay or ``None``
        (ungated DeltaProduct); scale: ``K**-0.5`` by default; use_qk_l2norm_in_kernel: as in FLA.

    Returns:
        Records ``[B, HV, T*n, .]`` with ``emit`` true on every ``n``-th step.
    """
    fn = "deltaproduct_records"
    B, T, H, K, HV, _ = _prepare_product(fn, q, k, v, g, beta, num_householder)
    n = num_householder
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    kt = _heads_first(k, HV // H)  # [B, HV, T*n, K]
    a = torch.ones_like(kt).view(B, HV, T, n, K)
    if g is not None:
        a[:, :, :, 0] = g.exp().transpose(1, 2)[..., None]
    a = a.view(B, HV, T * n, K)
    qn = kt.new_zeros(B, HV, T, n, K)
    qn[:, :, :, -1] = _heads_first(q, HV // H) * _resolve_scale(scale, K)
    emit = torch.zeros(T, n, dtype=torch.bool, device=q.device)
    emit[:, -1] = True
    return Records(
        a=a,
        k=beta.transpose(1, 2)[..., None] * kt,
        b=a * kt,
        v=_heads_first(v),
        q=qn.view(B, HV, T * n, K),
        emit=emit.view(T * n),
    )


def naive_recurrent_gated_delta_product(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    num_householder: int,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Native gated DeltaProduct, as FLA's ``naive_recurrent_gated_delta_product``: per token
    ``h = h * exp(g_t)``, then for each sub-step ``h = h + k (beta (v - (h * k[..., None]).sum(-2)))^T``,
    then ``o_t = (h * (scale q_t)[..., None]).sum(-2)``.

    FLA's naive version ignores ``scale`` (it reads with the bare ``q``); its chunk kernel, which the layer
    runs, applies ``scale`` (``K**-0.5`` by default), so this reference applies it too.

    Returns:
        ``(o [B, T, HV, V], S [B, HV, K, V])``.
    """
    fn = "naive_recurrent_gated_delta_product"
    B, T, H, K, HV, V = _prepare_product(fn, q, k, v, g, beta, num_householder)
    _check_state(fn, initial_state, (B, HV, K, V))
    n = num_householder
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q.repeat_interleave(HV // H, dim=2) * _resolve_scale(scale, K)
    k = k.repeat_interleave(HV // H, dim=2)
    h = _state_or_zeros(initial_state, v, (B, HV, K, V))
    o = v.new_zeros(B, T, HV, V)
    for i in range(T):
        if g is not None:
            h = h * g[:, i].exp()[..., None, None]
        for j in range(n):
            k_ij, v_ij, beta_ij = k[:, i * n + j], v[:, i * n + j], beta[:, i * n + j]
            delta = (v_ij - (h * k_ij[..., None]).sum(-2)) * beta_ij[..., None]
            h = h + delta[..., None, :] * k_ij[..., None]
        o[:, i] = (h * q[:, i, :, :, None]).sum(-2)
    return o, h
