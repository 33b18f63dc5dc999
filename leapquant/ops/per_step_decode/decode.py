"""Per-step state pools and decode (fp32/bf16/int8 re-quantized after every token): the kernel baselines.

:class:`PerStepPool` holds ``state [S, HV, V, K]`` (V-first like vLLM/SGLang) and, for int8, per-value-channel
fp32 ``scale [S, HV, V]``.  :func:`per_step_decode` takes the same inputs as
:func:`leapquant.ops.leapquant_decode.leapquant_decode`; its reference is the window-1 case of
:class:`~leapquant.methods.WindowedState` (``naive.py`` writes it out for the pool layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import LeapQuantError
from ...formats.residual import PER_STEP_RESIDUALS, RESIDUAL_FORMATS
from ...methods.config import MethodConfig
from ..checks import cdiv, check_kernel_head_dims, check_slots, check_step_inputs, use_triton
from . import naive

__all__ = ["PerStepPool", "per_step_decode", "per_step_records", "per_step_unsupported"]


def per_step_unsupported(method: MethodConfig) -> str | None:
    """Why no per-step kernel runs ``method`` (``None``: ``PerStepPool`` does)."""
    if method.codec not in PER_STEP_RESIDUALS:
        return f"per-step kernels store {', '.join(PER_STEP_RESIDUALS)}, not {method.codec!r}"
    if method.compensators or method.smoothing or method.stochastic or method.least_squares_scales:
        return "per-step kernels take no compensators, smoothing, least-squares scales or stochastic rounding"
    return None


@dataclass
class PerStepPool:
    """``state [S, HV, V, K]`` in ``fmt`` (fp32, bf16, int8) plus int8's ``scale [S, HV, V]`` fp32."""

    fmt: str
    state: torch.Tensor
    scale: torch.Tensor | None

    @classmethod
    def allocate(cls, fmt: str, slots: int, heads: int, d_k: int, d_v: int, device="cpu") -> PerStepPool:
        if fmt not in PER_STEP_RESIDUALS:
            raise LeapQuantError(
                f"per-step pool: format must be one of {', '.join(PER_STEP_RESIDUALS)}, got {fmt!r}"
            )
        row = RESIDUAL_FORMATS[fmt]
        state = torch.zeros(slots, heads, d_v, d_k, dtype=row.payload_dtype, device=device)
        scale = torch.ones(slots, heads, d_v, device=device) if row.scaled else None
        return cls(fmt, state, scale)

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def slots(self) -> int:
        return self.state.shape[0]

    def load(self, slots: torch.Tensor, states: torch.Tensor) -> None:
        """Store full-precision ``states [N, HV, K, V]`` into ``slots`` (quantized for int8/bf16)."""
        naive.store_ref(self, slots.long(), states.transpose(-1, -2).float())

    def materialize(self, slots: torch.Tensor) -> torch.Tensor:
        """Dequantized ``[N, HV, K, V]`` fp32 states."""
        return naive.dequant_ref(self, slots.long()).transpose(-1, -2)


def per_step_decode(
    pool: PerStepPool,
    slots: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    beta_sigmoid: bool = False,
    backend: str = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """One GDN/KDA decode token on a per-step pool (same arguments as ``leapquant_decode``; ``g`` is
    ``[N, HV]`` or ``[N, HV, K]``).  ``validate=False`` skips the checks that synchronize with the GPU
    (for CUDA graphs)."""
    n, heads, d_v, d_k = slots.shape[0], pool.state.shape[1], pool.state.shape[2], pool.state.shape[3]
    if validate:
        check_slots(slots, pool.slots, pool.device)
        check_step_inputs(pool.device, n, heads, d_k, d_v, g.ndim == 3, q, k, v, g, beta, A_log, dt_bias)
    qk_scale = d_k**-0.5 if scale is None else float(scale)
    if use_triton(pool.device, backend):
        check_kernel_head_dims(d_k, d_v)
        from .fused_recurrent import per_step_kernel

        out = torch.empty(n, heads, d_v, dtype=v.dtype, device=pool.device)
        bv = min(d_v, 32)
        per_step_kernel[(n * heads, cdiv(d_v, bv))](
            q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), beta, A_log,
            dt_bias, out, slots, pool.state, pool.scale if pool.scale is not None else pool.state, qk_scale,
            H=q.shape[1], HV=heads, K=d_k, V=d_v, BV=bv, STATE=RESIDUAL_FORMATS[pool.fmt].per_step_code,
            NATIVE=True, READ_PRE=False, USE_QK_L2NORM=use_qk_l2norm, BETA_SIGMOID=beta_sigmoid, num_warps=4,
        )  # fmt: skip
        return out
    from ..leapquant_decode.naive import activate_gate

    if A_log is not None:
        g = activate_gate(g.float(), A_log, dt_bias)
    if beta_sigmoid:
        beta = torch.sigmoid(beta)
    out = naive.step_ref(pool, slots, q.float(), k.float(), v.float(), g.float(), beta.float(), qk_scale,
                         use_qk_l2norm)  # fmt: skip
    return out.to(v.dtype)


def per_step_records(
    pool: PerStepPool,
    slots: torch.Tensor,
    g: torch.Tensor,
    kw: torch.Tensor,
    b: torch.Tensor,
    v: torch.Tensor,
    q: torch.Tensor,
    *,
    readout: str = "post",
    backend: str = "auto",
) -> torch.Tensor:
    """One step of general-form records (as ``leapquant_step_records``) on a per-step pool."""
    n, heads, d_v, d_k = slots.shape[0], pool.state.shape[1], pool.state.shape[2], pool.state.shape[3]
    if use_triton(pool.device, backend):
        from .fused_recurrent import per_step_kernel

        out = torch.empty(n, heads, d_v, dtype=v.dtype, device=pool.device)
        bv = min(d_v, 32)
        per_step_kernel[(n * heads, cdiv(d_v, bv))](
            q.contiguous(), kw.contiguous(), v.contiguous(), g.contiguous(), v, b.contiguous(), None, None,
            out, slots, pool.state, pool.scale if pool.scale is not None else pool.state, 1.0,
            H=heads, HV=heads, K=d_k, V=d_v, BV=bv, STATE=RESIDUAL_FORMATS[pool.fmt].per_step_code,
            NATIVE=False, READ_PRE=readout == "pre", USE_QK_L2NORM=False, BETA_SIGMOID=False, num_warps=4,
        )  # fmt: skip
        return out
    return naive.records_ref(pool, slots, g.float(), kw.float(), b.float(), v.float(), q.float(), readout).to(
        v.dtype
    )
