"""General-form records of the paper's eq. 1 and the exact recurrence over them.

One step of a head with state ``S`` of shape ``[d_k, d_v]`` (key rows, value columns):

    u_t = v_t - S_{t-1}^T b_t                 (delta read; b_t = 0 without the delta rule)
    S_t = Diag(a_t) S_{t-1} + k_t u_t^T       (decay, then a rank-one write)
    o_t = S_t^T q_t                           (readout; ``readout="pre"`` reads S_{t-1} instead)

``a`` is the decay, ``k`` the write key (any step size such as beta is folded in), ``b`` the read vector
and ``q`` the query (any scale folded in).  Models with several rank-one sub-steps per token (DeltaProduct,
RWKV7) emit one record per sub-step and set ``emit`` on the sub-step that produces the token's output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..errors import LeapQuantError

__all__ = ["Records", "exact_recurrence"]


@dataclass(frozen=True)
class Records:
    """Records of a batch of streams; every tensor has the same leading dims ``[...]``.

    Attributes:
        a: ``[..., T, d_k]`` decay per key channel (a scalar decay is broadcast over ``d_k``).
        k: ``[..., T, d_k]`` write key.
        b: ``[..., T, d_k]`` read vector of the delta rule (zeros for plain linear attention).
        v: ``[..., T, d_v]`` value.
        q: ``[..., T, d_k]`` query.
        emit: ``[T]`` bool, steps whose output counts (``None``: every step).
        readout: ``"post"`` reads ``S_t`` (every model here but RWKV6), ``"pre"`` reads ``S_{t-1}``.
    """

    a: torch.Tensor
    k: torch.Tensor
    b: torch.Tensor
    v: torch.Tensor
    q: torch.Tensor
    emit: torch.Tensor | None = None
    readout: str = "post"

    def __post_init__(self) -> None:
        lead, (t, d_k) = self.k.shape[:-2], self.k.shape[-2:]
        for name in ("a", "b", "q"):
            if getattr(self, name).shape != self.k.shape:
                raise LeapQuantError(
                    f"records: {name} has shape {tuple(getattr(self, name).shape)}, expected "
                    f"{(*lead, t, d_k)} like k"
                )
        if self.v.shape[:-1] != self.k.shape[:-1]:
            raise LeapQuantError(
                f"records: v has shape {tuple(self.v.shape)}, expected {(*lead, t)} + (d_v,) to match k"
            )
        if self.emit is not None and (self.emit.shape != (t,) or self.emit.dtype != torch.bool):
            raise LeapQuantError(f"records: emit must be a bool tensor of shape ({t},)")
        if self.readout not in ("post", "pre"):
            raise LeapQuantError(f"records: readout must be 'post' or 'pre', got {self.readout!r}")

    @property
    def steps(self) -> int:
        return self.k.shape[-2]

    @property
    def d_k(self) -> int:
        return self.k.shape[-1]

    @property
    def d_v(self) -> int:
        return self.v.shape[-1]

    @property
    def batch_shape(self) -> torch.Size:
        return self.k.shape[:-2]

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> Records:
        def cast(x: torch.Tensor) -> torch.Tensor:
            return x.to(dtype=dtype, device=device)

        emit = None if self.emit is None else self.emit.to(device=device)
        return replace(
            self, a=cast(self.a), k=cast(self.k), b=cast(self.b), v=cast(self.v), q=cast(self.q), emit=emit
        )

    def flatten(self) -> Records:
        """Merge the leading dims into one stream axis ``[B, T, ...]``."""

        def flat(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(-1, *x.shape[-2:])

        return replace(self, a=flat(self.a), k=flat(self.k), b=flat(self.b), v=flat(self.v), q=flat(self.q))

    def check_finite(self) -> None:
        for name in ("a", "k", "b", "v", "q"):
            x = getattr(self, name)
            if not torch.isfinite(x).all():
                bad = (~torch.isfinite(x)).nonzero()[0].tolist()
                raise LeapQuantError(f"records: {name} has a NaN or Inf at index {bad}")


def exact_recurrence(
    records: Records,
    initial_state: torch.Tensor | None = None,
    checkpoints: Sequence[int] = (),
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Run eq. 1 step by step in the records' dtype (use float64 for a reference).

    Args:
        records: records with leading dims ``[...]``.
        initial_state: ``[..., d_k, d_v]`` or ``None`` for zeros.
        checkpoints: step counts ``t`` (1..T) after which to keep a copy of ``S_t``; 0 keeps ``S_0``.

    Returns:
        ``(outputs [..., T, d_v], {t: S_t [..., d_k, d_v]})``.  Outputs of steps with ``emit`` false are 0.
    """
    a, k, b, v, q = records.a, records.k, records.b, records.v, records.q
    lead = records.batch_shape
    if initial_state is None:
        state = a.new_zeros(*lead, records.d_k, records.d_v)
    else:
        want = (*lead, records.d_k, records.d_v)
        if tuple(initial_state.shape) != want:
            raise LeapQuantError(
                f"exact_recurrence: initial_state has shape {tuple(initial_state.shape)}, expected {want}"
            )
        state = initial_state.to(a.dtype).clone()
    wanted = set(checkpoints)
    saved = {0: state.clone()} if 0 in wanted else {}
    outputs = a.new_zeros(*lead, records.steps, records.d_v)
    emit = records.emit
    for t in range(records.steps):
        read = torch.einsum("...kv,...k->...v", state, b[..., t, :])
        if records.readout == "pre":
            outputs[..., t, :] = torch.einsum("...kv,...k->...v", state, q[..., t, :])
        state = a[..., t, :, None] * state + k[..., t, :, None] * (v[..., t, :] - read)[..., None, :]
        if records.readout == "post":
            outputs[..., t, :] = torch.einsum("...kv,...k->...v", state, q[..., t, :])
        if t + 1 in wanted:
            saved[t + 1] = state.clone()
    if emit is not None:
        outputs = outputs * emit[:, None].to(outputs.dtype)
    return outputs, saved
