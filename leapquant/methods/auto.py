"""The ``leapquant-auto`` policy: per layer, the cheapest method whose state error stays within a budget.

Why a fixed low-bit method can diverge (the model behind the calibration).  Let ``E_n`` be the state error
after window ``n`` (paper eq. 8, summed over one window).  The records of window ``n+1`` carry it forward
through the window's error map ``M = prod_i (Diag(a_i) - k_i b_i^T)`` (a ``d_k x d_k`` matrix acting on
the key side), and the boundary quantization adds a fresh error ``eps`` whose size is a fraction ``rho`` of
the state it rounds, and that state holds the error too::

    E_{n+1} = M E_n + eps_{n+1},    E||eps||^2 = rho^2 (||S||^2 + ||E||^2)

With ``G`` the gain of the error maps over the horizon (the sum over windows of how much of an injected
error, shaped like the measured ``eps``, survives to the end: ``tr A`` with ``A <- M A M^T + C``), the
relative state error settles at::

    e^2 = rho^2 G / (1 - rho^2 G)          and grows without bound once rho^2 G >= 1.

A key direction that decays slowly and that the delta rule rarely erases (decay ~1, keys elsewhere) makes
``G`` large: GDN layer 6 of the shipped checkpoint has a head with median decay 0.99995, so its error is
kept ~20,000 tokens.  Max-scale INT4's ``rho`` (``int4/w16+ct8+smooth``) is ~16x INT8's, which pushes
``rho^2 G`` past 1 there while INT8 stays far below it.  The model treats ``+ls`` candidates the same way,
so it is conservative for them: their boundary is non-expansive (:mod:`.scale_fit`).

:func:`calibrate` measures ``rho`` and the error's key-side shape ``C`` by compressing the exact states at
the window boundaries of a short trace (as the method would, compensators warm-started window to window),
computes ``G`` from the trace's own records, cycled up to ``horizon`` tokens, and predicts ``e`` per head.
Per layer it keeps the cheapest candidate (bytes of boundary state plus record buffer per head) whose worst
head stays within ``budget``, and falls back to the most accurate candidate (8-bit by default) where none
does.  The default budget, 0.35, is ``rho^2 G = 0.11``: a 9x margin to the divergence at 1, kept because a
short trace underestimates ``G`` (on GDN layer 6, 2K calibration tokens predict 0.47 for max-scale INT4 where
64K cycled tokens measure 0.8-1.3).  The result is an explicit
:class:`~leapquant.methods.layer_plan.LayerPlan` with the evidence attached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import LeapQuantError
from .compensators import fit_compensators
from .config import POLICY_NAMES, MethodConfig, parse_method
from .layer_plan import LayerPlan
from .scale_fit import boundary_fake_quantize
from .smoothing import smoothing_scales

__all__ = [
    "AUTO_CANDIDATES",
    "POLICIES",
    "AutoPolicy",
    "boundary_errors",
    "calibrate",
    "error_gain",
    "head_bytes",
    "predicted_error",
]

# Kernel-runnable candidates, cheapest first at 128x128 GDN heads (boundary + fp16 record buffer per head):
# int4/w16+ct8 13.3 + 8.3 KB, int8/w16+ct4 19.5 + 8.3 KB.  Longer INT4 windows lower the error gain but
# their record buffer costs more than INT8's boundary (int4/w32+ct8: 13.3 + 16.5 KB), and 16 compensator
# tokens or group scales cut rho by only 20-30% (RESULTS.md); give them as candidates to weigh them.
# The INT4 candidate is ``leapquant-int4``'s spelling, with least-squares scales (``+ls``): a layer it
# would lose to INT8 without them may stay at 4 bits.
AUTO_CANDIDATES = ("int4/w16+ct8+smooth+ls", "int8/w16+ct4+smooth")


@dataclass(frozen=True)
class AutoPolicy:
    """How :func:`calibrate` chooses a method per layer.

    Attributes:
        candidates: method names, tried cheapest first (re-sorted by bytes per head); where none meets
            the budget, the one with the lowest predicted error is the fallback.
        budget: largest predicted relative state error ``||E|| / ||S||`` allowed for any head of a layer.
        horizon: tokens the prediction covers (the calibration trace's records are cycled up to it).
    """

    candidates: tuple[str, ...] = AUTO_CANDIDATES
    budget: float = 0.35
    horizon: int = 65536

    def __post_init__(self) -> None:
        if not self.candidates:
            raise LeapQuantError("auto policy: give at least one candidate method")
        for name in self.candidates:
            parse_method(name)  # an unknown name fails here
        if not 0 < self.budget < float("inf"):
            raise LeapQuantError(f"auto policy: budget must be a positive error, got {self.budget}")
        if self.horizon < 1:
            raise LeapQuantError(f"auto policy: horizon must be >= 1 token, got {self.horizon}")

    def configs(self, d_k: int, d_v: int, decay_values: int) -> list[MethodConfig]:
        """The candidates as configs, cheapest first (stable for equal bytes)."""
        cfgs = [parse_method(n) for n in self.candidates]
        return sorted(cfgs, key=lambda c: head_bytes(c, d_k, d_v, decay_values))


# the grammar (config.POLICY_NAMES) refuses exactly these names with the calibrate hint
POLICIES = dict(zip(POLICY_NAMES, (AutoPolicy(),), strict=True))


def head_bytes(cfg: MethodConfig, d_k: int, d_v: int, decay_values: int) -> int:
    """Live bytes of one head: boundary state plus record buffer (the planner's count: a kernel pool's
    tensors where one runs ``cfg``, so int6 codes a byte each, as int8's)."""
    from ..ops.pool import PoolConfig, pool_unsupported

    if cfg.window > 1 and pool_unsupported(cfg) is None:
        decay = "scalar" if decay_values == 1 else "vector"
        return PoolConfig(cfg, heads=1, d_k=d_k, d_v=d_v, decay=decay).bytes_per_slot()
    return cfg.boundary_bytes(d_k, d_v) + cfg.record_buffer_bytes(d_k, d_v, decay_values)


def boundary_errors(
    cfg: MethodConfig, a: torch.Tensor, k: torch.Tensor, b: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh boundary errors of ``cfg`` along the exact trajectory of records ``[S, T, d]`` (float64).

    Returns ``(rho [S], C [S, d_k, d_k])``: ``rho^2 = sum ||eps||^2 / sum ||S||^2`` over the boundaries and
    ``C = sum eps eps^T / sum ||eps||^2`` (trace 1), the key-side shape of the error.
    """
    s, t, d_k = k.shape
    d_v = v.shape[-1]
    state = torch.zeros(s, d_k, d_v, dtype=torch.float64)
    warm = None
    err2 = torch.zeros(s, dtype=torch.float64)
    ref2 = torch.zeros(s, dtype=torch.float64)
    shape = torch.zeros(s, d_k, d_k, dtype=torch.float64)
    for i in range(t):
        u = v[:, i] - torch.einsum("skv,sk->sv", state, b[:, i])
        state = a[:, i, :, None] * state + k[:, i, :, None] * u[:, None, :]
        if (i + 1) % cfg.window:
            continue
        residual, comp = state, 0.0
        if cfg.compensators:
            ck, cu = fit_compensators(
                state, cfg.compensators, method=cfg.fit, warm=warm, iters=cfg.power_iters,
                cold_iters=cfg.cold_iters,
            )  # fmt: skip
            ck, cu = ck.half().double(), cu.half().double()  # fp16 tokens, as stored
            warm, comp = cu, ck @ cu.transpose(-1, -2)
            residual = state - comp
        smooth = smoothing_scales(residual)[..., None] if cfg.smoothing else 1.0
        eps = smooth * boundary_fake_quantize(cfg, residual / smooth) + comp - state
        err2 += eps.pow(2).sum((-1, -2))
        ref2 += state.pow(2).sum((-1, -2))
        shape += eps @ eps.transpose(-1, -2)
    rho = (err2 / ref2.clamp_min(1e-300)).sqrt()
    trace = shape.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(1e-300)
    return rho, shape / trace[:, None, None]


def error_gain(
    a: torch.Tensor, k: torch.Tensor, b: torch.Tensor, window: int, shape: torch.Tensor, horizon: int
) -> torch.Tensor:
    """``G [S]``: how much of the boundary errors (key-side shape ``shape [S, d_k, d_k]``, trace 1, one per
    window) survives after ``horizon`` tokens (``ceil(horizon / window)`` windows), the trace's records
    ``[S, T, d_k]`` cycled up to it: whole passes over the trace, then the first windows of one more."""
    s, t, d_k = k.shape
    windows = t // window
    if windows < 1:
        raise LeapQuantError(f"calibration trace of {t} tokens is shorter than a window of {window}")
    cycles, rest = divmod(-(-horizon // window), windows)
    eye = torch.eye(d_k, dtype=torch.float64).expand(s, d_k, d_k)
    phi, acc = eye.clone(), torch.zeros(s, d_k, d_k, dtype=torch.float64)
    part_phi, part_acc = eye.clone(), torch.zeros_like(acc)  # the first ``rest`` windows
    for w in range(windows):
        m = eye.clone()
        for i in range(w * window, (w + 1) * window):
            # (Diag(a) - k b^T) M, applied record by record
            m = a[:, i, :, None] * m - k[:, i, :, None] * torch.einsum("sk,skj->sj", b[:, i], m)[:, None, :]
        acc = m @ acc @ m.transpose(-1, -2) + shape
        phi = m @ phi
        if w + 1 == rest:
            part_phi, part_acc = phi.clone(), acc.clone()
    # one cycle of the trace is (phi, acc); n cycles compose by binary powers (all cycles are the same)
    res_acc = torch.zeros_like(acc)
    while cycles:
        if cycles & 1:
            res_acc = phi @ res_acc @ phi.transpose(-1, -2) + acc
        phi, acc = phi @ phi, phi @ acc @ phi.transpose(-1, -2) + acc
        cycles >>= 1
    res_acc = part_phi @ res_acc @ part_phi.transpose(-1, -2) + part_acc
    return res_acc.diagonal(dim1=-2, dim2=-1).sum(-1)


def predicted_error(rho: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """Relative state error ``sqrt(rho^2 G / (1 - rho^2 G))`` (``inf`` where ``rho^2 G >= 1``)."""
    x = rho.pow(2) * gain
    return torch.where(x < 1, (x / (1 - x).clamp_min(1e-300)).sqrt(), torch.full_like(x, float("inf")))


def calibrate(
    policy: AutoPolicy, records: dict[int, Sequence[torch.Tensor]], *, name: str = "leapquant-auto"
) -> LayerPlan:
    """Choose a method per layer from calibration records.

    Args:
        policy: the candidates, the error budget and the horizon.
        records: ``{layer_idx: (a, k, b, v)}``, each ``[heads, T, d]`` general-form records of that
            layer's heads on a calibration text (``a`` per key channel), from the exact trajectory.
        name: the policy name the plan records.

    Returns:
        A :class:`LayerPlan` listing every layer, with the measured ``rho``, gain and predicted error of
        every candidate and head in its evidence.
    """
    if not records:
        raise LeapQuantError("calibrate: no layers in the calibration records")
    chosen, evidence = {}, {}
    for layer, recs in sorted(records.items()):
        if len(recs) != 4 or any(x.ndim != 3 for x in recs):
            raise LeapQuantError(f"calibrate: layer {layer} needs (a, k, b, v), each [heads, T, d]")
        a, k, b, v = (x.to(torch.float64) for x in recs)
        if not a.shape == k.shape == b.shape or v.shape[:2] != k.shape[:2]:
            raise LeapQuantError(
                f"calibrate: layer {layer}: a, k, b must share [heads, T, d_k] and v [heads, T, d_v], got "
                f"{[tuple(x.shape) for x in recs]}"
            )
        d_k, d_v = k.shape[-1], v.shape[-1]
        scalar = bool((a == a[..., :1]).all())
        rows, pick = {}, None
        configs = policy.configs(d_k, d_v, 1 if scalar else d_k)
        for cfg in configs:
            rho, shape = boundary_errors(cfg, a, k, b, v)
            gain = error_gain(a, k, b, cfg.window, shape, policy.horizon)
            err = predicted_error(rho, gain)
            worst = float(err.max())
            rows[cfg.name] = {
                "rho": [round(float(x), 6) for x in rho],
                "gain": [round(float(x), 3) for x in gain],
                "predicted_error": [float(f"{float(x):.4g}") for x in err],
                "worst": float(f"{worst:.4g}"),
                "head_bytes": head_bytes(cfg, d_k, d_v, 1 if scalar else d_k),
            }
            if pick is None and worst <= policy.budget:
                pick = cfg  # the cheapest that meets the budget; the dearer ones stay in the evidence
        fallback = pick is None
        if fallback:  # the lowest predicted error, cheapest among equals
            pick = min(configs, key=lambda c: rows[c.name]["worst"])
        chosen[layer] = pick
        evidence[str(layer)] = {"chosen": chosen[layer].name, "fallback": fallback, "candidates": rows}
    meta = {
        "policy": name,
        "budget": policy.budget,
        "horizon": policy.horizon,
        "calibration_tokens": int(next(iter(records.values()))[1].shape[1]),
        "layers": evidence,
    }
    return LayerPlan(tuple(sorted(chosen.items())), evidence=meta)
