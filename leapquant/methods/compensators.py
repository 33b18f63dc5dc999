"""Compensator tokens (paper section 3.3, eqs. 5-6): the top-r rank-one structure of a state.

``fit_compensators`` returns ``K [..., d_k, r]`` and ``U [..., d_v, r]`` with ``K U^T`` the best rank-r
approximation of ``S`` within the subspace found: ``K`` has orthonormal columns and ``U = S^T K``, so
``K U^T = K K^T S`` is the projection of ``S`` onto that key subspace (the least-squares optimum for it).

Power iteration is subspace iteration warm-started from the previous window's value vectors ``U``: the
state changes little in one window, so one iteration per boundary tracks the dominant subspace, and the
iterations accumulate across windows.  Columns without a warm start (a zero state, a new sequence) start
from fixed pseudo-random +-1 vectors that a kernel can regenerate from indices alone.
"""

from __future__ import annotations

import torch

__all__ = ["DROP_FRACTION", "fit_compensators", "orthonormalize", "start_vectors"]

_EPS = 1e-30
# A column whose part orthogonal to the earlier ones is below this fraction of its own norm is rounding
# noise (the state has fewer independent directions than tokens): normalized, it would be a unit vector far
# from orthogonal to them, and K U^T no longer a projection; it becomes zero instead.  fp32 noise sits near
# 1e-6 of the norm, genuine directions this faint carry under 1e-8 of the column's energy.
DROP_FRACTION = 1e-4


def start_vectors(d_v: int, rank: int, *, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Fixed ``[d_v, rank]`` matrix of +-1 from an integer hash of (row, column): no RNG state needed."""
    j = torch.arange(d_v, device=device, dtype=torch.int64)[:, None]
    h = torch.arange(rank, device=device, dtype=torch.int64)[None, :]
    x = (j * 0x9E3779B1 + (h + 1) * 0x85EBCA77) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
    x = x ^ (x >> 12)
    return torch.where((x & 1) == 1, 1.0, -1.0).to(dtype)


def orthonormalize(x: torch.Tensor) -> torch.Tensor:
    """Modified Gram-Schmidt on the columns of ``[..., n, r]``: orthonormal columns, and zero ones where a
    column vanishes or keeps less than :data:`DROP_FRACTION` of its norm once the earlier ones are taken
    out (so that the nonzero columns stay orthonormal when ``x`` has rank below ``r``)."""
    cols = []
    for h in range(x.shape[-1]):
        c = x[..., h]
        before = c.norm(dim=-1, keepdim=True)
        for prev in cols:
            c = c - (prev * c).sum(-1, keepdim=True) * prev
        norm = c.norm(dim=-1, keepdim=True)
        keep = (norm > _EPS) & (norm > DROP_FRACTION * before)
        cols.append(torch.where(keep, c / norm.clamp_min(_EPS), torch.zeros_like(c)))
    return torch.stack(cols, dim=-1)


def fit_compensators(
    state: torch.Tensor,
    rank: int,
    *,
    method: str = "power",
    warm: torch.Tensor | None = None,
    iters: int = 1,
    cold_iters: int = 8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fit ``rank`` compensator tokens to ``state [..., d_k, d_v]``.

    Args:
        method: ``"power"`` (subspace iteration) or ``"svd"`` (exact truncated SVD, for reference).
        warm: ``[..., d_v, rank]`` value vectors of the previous tokens, or ``None``.
        iters: iterations from a warm start; columns of ``warm`` that are zero restart from
            :func:`start_vectors` with these ``iters`` too (the kernels' rule: one iteration count a head).
        cold_iters: iterations without a warm start (``warm=None``: a state loaded from prefill).

    Returns:
        ``(K [..., d_k, rank], U [..., d_v, rank])`` in the state's dtype.
    """
    if method == "svd":
        left, _, _ = torch.linalg.svd(state, full_matrices=False)
        k = left[..., :rank]
    else:
        d_v = state.shape[-1]
        start = start_vectors(d_v, rank, dtype=state.dtype, device=state.device)
        start = start.expand(*state.shape[:-2], d_v, rank)
        if warm is None:
            v, n = start, cold_iters
        else:
            # Per column, so that a stream's result never depends on the rest of its batch.
            usable = warm.norm(dim=-2, keepdim=True) > _EPS
            v, n = torch.where(usable, warm, start), iters
        for _ in range(n):
            k = orthonormalize(state @ v)
            v = state.transpose(-1, -2) @ k
    u = state.transpose(-1, -2) @ k
    return k, u
