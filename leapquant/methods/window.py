"""Per-window quantized state (paper sections 3.2-3.4, Appendix B): the reference every kernel matches.

A :class:`WindowedState` holds, for a batch of ``B`` heads:

* the boundary representation ``S_0 = C dequant(R^C) + K U^T`` (quantized residual, smoothing scales ``c``,
  ``r`` compensator tokens), fixed for the whole window;
* the window's records ``(a_i, k_i, u_i)``, buffered at the record precision.

Every read ``S_l^T x`` goes through eq. 10 without forming a state::

    S_l^T x = dequant(R^C)^T (c * G_0 x) + U (K^T G_0 x) + sum_j u_j (k_j^T G_j x)

with ``G_0 = Gamma_{1:l}`` and ``G_j = Gamma_{j+1:l}`` the cumulative decays after record ``j`` (compensator
tokens enter with identity decay before the first record, so they decay with the residual).  After ``p``
records the state is reconstructed, compensators are refitted, the residual is smoothed and quantized: one
quantization per window.  A window of 1 is the per-step baseline of eq. 2.
"""

from __future__ import annotations

import torch

from ..checks import check_count
from ..errors import LeapQuantError
from .compensators import fit_compensators
from .config import MethodConfig
from .scale_fit import boundary_fake_quantize
from .smoothing import smoothing_scales

__all__ = ["WindowedState"]


def _rounder(precision: str):
    """Rounding of a stored tensor; the simulator treats fp32 storage as full precision."""
    if precision == "fp32":
        return lambda x: x
    from ..formats import get_format

    fmt = get_format(precision)
    return fmt.fake_quantize


# |U| up to 2^15 stays as fitted, so states of ordinary size keep exactly the paper's tokens.
_FP16_HEADROOM_EXP = 14


def balance_for_fp16(k: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``K [..., d_k, r]``, ``U [..., d_v, r]`` with a power of two moved from each ``U`` column to
    its ``K`` column where ``U`` would pass fp16's 65504: ``U = S^T K`` grows with the state (linear attention
    without decay grows with the context), and saturated tokens stop taking the outliers out of the residual.
    ``K`` has unit columns, so the pair fits while ``|U| < 2^30``; the product ``K U^T`` is unchanged (powers
    of two scale exactly).  The kernels' families (GDN, KDA) keep unit keys: their states stay bounded, and
    the kernels do not balance, so ``simulate --backend triton`` departs from the reference where a trace's
    ``|U|`` reaches 2^15."""
    amax = u.abs().amax(dim=-2, keepdim=True)
    shift = (torch.floor(torch.log2(amax.clamp_min(1.0))) - _FP16_HEADROOM_EXP).clamp_min(0)
    if not bool((shift > 0).any()):
        return k, u
    scale = torch.pow(torch.full_like(shift, 2.0), shift)
    return k * scale, u / scale


class WindowedState:
    """The quantized state of ``batch`` heads of shape ``[d_k, d_v]`` under one method.

    Args:
        config: the method.
        batch, d_k, d_v: number of heads and their state shape.
        dtype: working precision (float64 in the simulator).
        generator: random generator for stochastic rounding.
    """

    def __init__(
        self,
        config: MethodConfig,
        batch: int,
        d_k: int,
        d_v: int,
        *,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str = "cpu",
        generator: torch.Generator | None = None,
    ) -> None:
        if not isinstance(config, MethodConfig):
            raise LeapQuantError(
                f"WindowedState: config must be a MethodConfig (leapquant.parse_method(name)), "
                f"got {type(config).__name__}"
            )
        for name, value in (("batch", batch), ("d_k", d_k), ("d_v", d_v)):
            check_count(f"WindowedState: {name}", value)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise LeapQuantError(f"WindowedState: dtype must be a floating-point torch dtype, got {dtype}")
        if config.compensators > min(d_k, d_v):
            raise LeapQuantError(
                f"WindowedState: {config.name} fits {config.compensators} compensator tokens to heads of "
                f"{d_k}x{d_v}, whose rank is at most {min(d_k, d_v)}"
            )
        self.config = config
        self.batch, self.d_k, self.d_v = batch, d_k, d_v
        self.dtype, self.device = dtype, torch.device(device)
        self.generator = generator
        self._round_record = _rounder(config.records)
        self._round_comp = _rounder(config.compensator_precision)
        p, r = config.window, config.compensators
        self.rec_a = torch.ones(batch, p, d_k, dtype=dtype, device=self.device)
        self.rec_k = torch.zeros(batch, p, d_k, dtype=dtype, device=self.device)
        self.rec_u = torch.zeros(batch, p, d_v, dtype=dtype, device=self.device)
        self.comp_k = torch.zeros(batch, d_k, r, dtype=dtype, device=self.device)
        self.comp_u = torch.zeros(batch, d_v, r, dtype=dtype, device=self.device)
        self.count = 0  # records in the current window
        self.quantizations = 0  # boundary quantizations so far
        self.load(None)

    # -- boundaries ---------------------------------------------------------------------------------
    def load(self, state: torch.Tensor | None) -> None:
        """Start from a full-precision state ``[batch, d_k, d_v]`` (prefill hand-off) or zeros."""
        if state is None:
            state = torch.zeros(self.batch, self.d_k, self.d_v, dtype=self.dtype, device=self.device)
        elif state.shape != (self.batch, self.d_k, self.d_v):
            raise LeapQuantError(
                f"initial state has shape {tuple(state.shape)}, expected {(self.batch, self.d_k, self.d_v)}"
            )
        self.count = 0
        self._compress(state.to(self.dtype), warm=None)

    def _compress(self, state: torch.Tensor, warm: torch.Tensor | None) -> None:
        cfg = self.config
        residual = state
        if cfg.compensators:
            k, u = fit_compensators(
                state,
                cfg.compensators,
                method=cfg.fit,
                warm=warm,
                iters=cfg.power_iters,
                cold_iters=cfg.cold_iters,
            )
            if cfg.compensator_precision == "fp16":
                k, u = balance_for_fp16(k, u)
            self.comp_k, self.comp_u = self._round_comp(k), self._round_comp(u)
            residual = state - self.comp_k @ self.comp_u.transpose(-1, -2)
        if cfg.smoothing:
            self.smooth = smoothing_scales(residual)
            residual = residual / self.smooth[..., None]
        else:
            self.smooth = None
        self.residual = boundary_fake_quantize(cfg, residual, generator=self.generator)
        self.quantizations += 1

    def take(self, heads: torch.Tensor) -> None:
        """Keep ``heads`` (a 1-D index, repeats allowed) in that order: generate()'s row reordering."""
        for name in ("rec_a", "rec_k", "rec_u", "comp_k", "comp_u", "residual", "smooth"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value[heads])
        self.batch = heads.numel()

    _SNAPSHOT = (
        "rec_a",
        "rec_k",
        "rec_u",
        "comp_k",
        "comp_u",
        "residual",
        "smooth",
        "count",
        "quantizations",
    )

    def snapshot(self) -> dict:
        """Everything that evolves as tokens arrive (records, tokens, boundary, counters, the rounding
        generator's state): what :meth:`restore` needs to go on bit for bit.  Tensors are not copied."""
        snap = {name: getattr(self, name) for name in self._SNAPSHOT}
        snap["batch"] = self.batch
        snap["generator"] = None if self.generator is None else self.generator.get_state()
        return snap

    def restore(self, snap: dict) -> None:
        """Take the state :meth:`snapshot` saved (from a state of the same method and head size)."""
        for name in self._SNAPSHOT:
            value, now = snap[name], getattr(self, name)
            if isinstance(value, torch.Tensor):
                if isinstance(now, torch.Tensor) and now.shape != value.shape:
                    raise LeapQuantError(
                        f"snapshot: saved {name} is {tuple(value.shape)}, this state's {tuple(now.shape)}"
                    )
                value = value.to(self.device, self.dtype, copy=True)
            setattr(self, name, value)
        self.batch = snap["batch"]
        if (snap["generator"] is None) != (self.generator is None):
            raise LeapQuantError(
                "snapshot: the saved state's rounding is not this state's (stochastic or not)"
            )
        if self.generator is not None:
            self.generator.set_state(snap["generator"])

    # -- reads --------------------------------------------------------------------------------------
    def _decays(self) -> torch.Tensor:
        """``[batch, count + 1, d_k]``: entry 0 is Gamma_{1:l}, entry j is Gamma_{j+1:l} (j = 1..l)."""
        a = self.rec_a[:, : self.count]
        suffix = torch.flip(torch.cumprod(torch.flip(a, [1]), dim=1), [1])
        return torch.cat([suffix, torch.ones_like(self.rec_a[:, :1])], dim=1)

    def read(self, x: torch.Tensor) -> torch.Tensor:
        """``S_l^T x`` for ``x [batch, d_k]`` at the current position ``l`` (eq. 10)."""
        g = self._decays()
        y = g[:, 0] * x
        z = y if self.smooth is None else self.smooth * y
        out = torch.einsum("bkv,bk->bv", self.residual, z)
        if self.config.compensators:
            out = out + torch.einsum("bvr,br->bv", self.comp_u, torch.einsum("bkr,bk->br", self.comp_k, y))
        if self.count:
            w = torch.einsum("bjk,bjk->bj", self.rec_k[:, : self.count], g[:, 1:] * x[:, None, :])
            out = out + torch.einsum("bjv,bj->bv", self.rec_u[:, : self.count], w)
        return out

    def materialize(self) -> torch.Tensor:
        """The dense state ``S_l [batch, d_k, d_v]`` the representation stands for (eq. 4 / eq. 7)."""
        g = self._decays()
        boundary = self.residual if self.smooth is None else self.smooth[..., None] * self.residual
        if self.config.compensators:
            boundary = boundary + self.comp_k @ self.comp_u.transpose(-1, -2)
        state = g[:, 0, :, None] * boundary
        if self.count:
            keys = g[:, 1:] * self.rec_k[:, : self.count]
            state = state + torch.einsum("bjk,bjv->bkv", keys, self.rec_u[:, : self.count])
        return state

    # -- the step -----------------------------------------------------------------------------------
    def _check_step(self, a, k, b, v, q, readout) -> None:
        # Broadcasting would take a per-head scalar decay ``[batch]`` along the keys when batch == d_k (or a
        # ``[batch]`` value along the values): a wrong state with no error, so every shape is exact.
        if readout not in ("post", "pre"):
            raise LeapQuantError(f"WindowedState.step: readout must be 'post' or 'pre', got {readout!r}")
        want = {"a": (self.batch, self.d_k), "k": (self.batch, self.d_k), "b": (self.batch, self.d_k),
                "v": (self.batch, self.d_v), "q": (self.batch, self.d_k)}  # fmt: skip
        for name, x in zip("akbvq", (a, k, b, v, q)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != want[name]:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise LeapQuantError(
                    f"WindowedState.step: {name} has shape {got}, expected {want[name]} (batch, "
                    f"{'d_v' if name == 'v' else 'd_k'}); a per-head scalar decay is expanded over d_k"
                )

    def step(
        self,
        a: torch.Tensor,
        k: torch.Tensor,
        b: torch.Tensor,
        v: torch.Tensor,
        q: torch.Tensor,
        readout: str = "post",
    ) -> torch.Tensor:
        """One record for every head: ``a, k, b, q [batch, d_k]``, ``v [batch, d_v]``; returns ``o``.

        The delta read and the output both come from the window representation; the new record is
        stored at the record precision before the output reads it, exactly as a kernel that writes the
        record and reads it back.
        """
        self._check_step(a, k, b, v, q, readout)
        out = self.read(q) if readout == "pre" else None
        u = v - self.read(b)
        i = self.count
        self.rec_a[:, i] = a
        self.rec_k[:, i] = self._round_record(k)
        self.rec_u[:, i] = self._round_record(u)
        self.count += 1
        if out is None:
            out = self.read(q)
        if self.count == self.config.window:
            state = self.materialize()
            self.count = 0
            self._compress(state, warm=self.comp_u if self.config.compensators else None)
        return out
