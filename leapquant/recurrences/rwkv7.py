"""RWKV7 (Peng et al. 2025) as two general-form records per token, and its native reference.

RWKV7 keeps its state value-first, ``S: [V, K]`` (FLA's kernels index it ``[K, V]`` in memory but compute
the same map), and updates it as a diagonal-plus-low-rank (DPLR) transition:

    S_t = S_{t-1} (Diag(w_t) + a_t b_t^T) + v_t k_t^T,     o_t = S_t (scale r_t)

with ``a = -kk`` and ``b = kk ⊙ a_rwkv`` (``kk`` the normalised removal key kappa_hat, ``a_rwkv`` the
in-context learning rate), exactly as FLA's ``naive_recurrent_rwkv7`` and ``fused_mul_recurrent_rwkv7``
compute it: the low-rank read ``S_{t-1} a_t`` uses the state before the decay.

In the key-first orientation ``X = S^T: [K, V]`` of the paper's eq. 1 this is

    X'_t = Diag(w_t) X_{t-1} + (kk ⊙ a_rwkv)(0 - X_{t-1}^T kk)^T        (erase: decay w, write key
                                                                          kk ⊙ a_rwkv, read vector kk)
    X_t  = X'_t + k_t v_t^T                                              (pure write: a = 1, b = 0)

so each token contributes two records; only the second emits (``q = scale r``).
"""

from __future__ import annotations

import torch

from .linear import _check_qkv, _check_shape, _check_state, _heads_first, _resolve_scale, _state_or_zeros
from .records import Records

__all__ = ["naive_recurrent_rwkv7", "rwkv7_records"]


def _check(
    fn: str,
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kk: torch.Tensor,
    a: torch.Tensor,
) -> tuple[int, int, int, int, int]:
    B, T, H, K, _, V = _check_qkv(fn, r, k, v, grouped=False, names=("r", "k", "v"))
    for name, x in (("w", w), ("kk", kk), ("a", a)):
        _check_shape(fn, name, x, (B, T, H, K))
    return B, T, H, K, V


def rwkv7_records(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kk: torch.Tensor,
    a: torch.Tensor,
    scale: float | None = None,
) -> Records:
    """RWKV7 as ``2T`` records: an erase sub-step then a pure write sub-step per token.

    Sub-step 1: ``a = exp(w_t)``, write key ``kk_t ⊙ a_t``, read vector ``kk_t``, ``v = 0``, ``q = 0``.
    Sub-step 2: ``a = 1``, write key ``k_t``, read vector ``0``, ``v = v_t``, ``q = scale r_t``, emits.

    Args:
        r, k: ``[B, T, H, K]`` receptance and (replacement) key; v: ``[B, T, H, V]``;
        w: ``[B, T, H, K]`` log decay, as FLA's ``fused_recurrent_rwkv7`` takes it (decay ``exp(w)``);
        kk: ``[B, T, H, K]`` normalised removal key (kappa_hat); a: ``[B, T, H, K]`` in-context learning
        rate (the DPLR factors are ``-kk`` and ``kk ⊙ a``); scale: ``K**-0.5`` by default (FLA's
        ``fused_recurrent_rwkv7``; the RWKV7 layers pass 1.0).

    Returns:
        Records ``[B, H, 2T, .]`` with ``emit`` true on odd steps.  Their state is ``X = S^T: [K, V]``, the
        transpose of the native reference's ``S``.
    """
    B, T, H, K, _ = _check("rwkv7_records", r, w, k, v, kk, a)

    def interleave(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        return torch.stack((first, second), dim=3).view(B, H, 2 * T, first.shape[-1])

    kk_t = _heads_first(kk)
    zeros_k = torch.zeros_like(kk_t)
    v_t = _heads_first(v)
    emit = torch.zeros(T, 2, dtype=torch.bool, device=r.device)
    emit[:, 1] = True
    return Records(
        a=interleave(_heads_first(w).exp(), torch.ones_like(kk_t)),
        k=interleave(kk_t * _heads_first(a), _heads_first(k)),
        b=interleave(kk_t, zeros_k),
        v=interleave(torch.zeros_like(v_t), v_t),
        q=interleave(zeros_k, _heads_first(r) * _resolve_scale(scale, K)),
        emit=emit.view(2 * T),
    )


def naive_recurrent_rwkv7(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kk: torch.Tensor,
    a: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Native RWKV7 in its value-first orientation, as FLA's ``naive_recurrent_rwkv7`` writes it:

    ``sab = einsum('bhik,bhk,bhj->bhij', S, -kk, kk ⊙ a)``;
    ``S = S * exp(w)[..., None, :] + sab + einsum('bhj,bhi->bhij', k, v)``;
    ``o = einsum('bhj,bhij->bhi', scale r, S)``.

    FLA's naive takes the decay pre-activation ``w_raw`` and applies ``exp(-exp(w_raw))``; here ``w`` is the
    log decay (``-exp(w_raw)``), the form FLA's fused/chunk RWKV7 ops take.

    Args:
        as :func:`rwkv7_records`; initial_state: ``[B, H, V, K]`` (value-first) or ``None``.

    Returns:
        ``(o [B, T, H, V], S [B, H, V, K])``.
    """
    B, T, H, K, V = _check("naive_recurrent_rwkv7", r, w, k, v, kk, a)
    _check_state("naive_recurrent_rwkv7", initial_state, (B, H, V, K))
    scale = _resolve_scale(scale, K)
    S = _state_or_zeros(initial_state, v, (B, H, V, K))
    o = v.new_zeros(B, T, H, V)
    for t in range(T):
        a_t, b_t = -kk[:, t], kk[:, t] * a[:, t]
        sab = torch.einsum("bhik,bhk,bhj->bhij", S, a_t, b_t)
        S = S * w[:, t].exp()[..., None, :] + sab + torch.einsum("bhj,bhi->bhij", k[:, t], v[:, t])
        o[:, t] = torch.einsum("bhj,bhij->bhi", r[:, t] * scale, S)
    return o, S
