"""LeapQuant decode ops on a state pool: one decode step (GDN/KDA or general records), prefill hand-off
and materialization, each with a Triton kernel (``fused_recurrent.py``) and a torch reference (``naive.py``).

Shapes (``N`` sequences this step, ``H`` key heads, ``HV`` value heads, ``K``/``V`` head dims):

* ``q, k``: ``[N, H, K]``; ``v``: ``[N, HV, V]``; ``g``: ``[N, HV]`` log decay (GDN) or ``[N, HV, K]`` (KDA);
  ``beta``: ``[N, HV]``; ``slots``: ``[N]`` int32/int64 with -1 for padding.
* outputs: ``[N, HV, V]`` in ``v``'s dtype (zeros for padded rows); all arithmetic is fp32.

``backend="auto"`` runs the Triton kernels when the pool is on a GPU or ``TRITON_INTERPRET=1`` is set, and
the reference otherwise.
"""

from __future__ import annotations

import torch

from ...errors import LeapQuantError
from ..checks import check_step_inputs, check_token, use_triton
from ..pool import LeapQuantPool
from . import naive
from .launch import LaunchConfig, launch_boundary, launch_step, resolve_close

__all__ = ["leapquant_decode", "leapquant_step_records", "load_states", "materialize_states"]


def _check_decay(pool: LeapQuantPool, g: torch.Tensor, n: int) -> None:
    cfg = pool.config
    shape = (n, cfg.heads) if cfg.decay == "scalar" else (n, cfg.heads, cfg.d_k)
    check_token(pool.device, "g", g, shape)


def leapquant_decode(
    pool: LeapQuantPool,
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
    boundary: bool = True,
    launch: LaunchConfig | None = None,
) -> torch.Tensor:
    """One GDN (``g [N, HV]``) or KDA (``g [N, HV, K]``) decode token for every sequence in ``slots``.

    As FLA's ``fused_recurrent_gated_delta_rule`` / ``fused_recurrent_kda`` with ``T=1``: decay before the
    delta read, q/k L2-normalised in the kernel (``use_qk_l2norm``), ``scale = K**-0.5`` by default.  With
    ``A_log`` the gate ``g`` is raw and activated in the kernel (``g = -exp(A_log) * softplus(g + dt_bias)``;
    ``dt_bias`` is ``[HV]`` for GDN, ``[HV*K]`` for KDA); ``beta_sigmoid`` applies ``sigmoid`` to ``beta``.
    Updates ``pool`` in place (only ``slots``) and returns ``o [N, HV, V]`` in ``v``'s dtype (the kernels
    compute in fp32).  ``validate=False`` skips the checks that synchronize with the GPU (for CUDA graphs);
    ``boundary=False`` runs only the step kernel (benchmark breakdowns: positions then never advance).
    ``launch`` sets the launch shapes (:class:`LaunchConfig`).
    """
    cfg = pool.config
    n = slots.shape[0]
    if validate:
        pool.check_slots(slots)
        check_step_inputs(pool.device, n, cfg.heads, cfg.d_k, cfg.d_v, cfg.decay == "vector",
                          q, k, v, g, beta, A_log, dt_bias)  # fmt: skip
    qk_scale = cfg.d_k**-0.5 if scale is None else float(scale)
    if use_triton(pool.device, backend):
        launch = launch or LaunchConfig.tuned(cfg.decay, cfg.compensators, cfg.residual)
        close = resolve_close(pool, launch) if boundary else None
        pool.close_list()[1].zero_()
        return launch_step(
            pool, slots, q, k, v, g, beta, None, A_log, dt_bias, qk_scale,
            True, use_qk_l2norm, beta_sigmoid, False, launch, boundary, close=close,
        )  # fmt: skip
    if not boundary:
        raise LeapQuantError("boundary=False (the step kernel alone, for timing) needs the Triton backend")
    if A_log is not None:
        g = naive.activate_gate(g, A_log, dt_bias)
    if beta_sigmoid:
        beta = torch.sigmoid(beta)
    gen = naive.native_to_general(q.float(), k.float(), v.float(), g.float(), beta.float(),
                                  scale=qk_scale, use_qk_l2norm=use_qk_l2norm)  # fmt: skip
    out = naive.step_ref(pool, slots, *gen)
    naive.close_ref(pool, slots)
    return out.to(v.dtype)


def leapquant_step_records(
    pool: LeapQuantPool,
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
    """One step of general-form records (paper eq. 1): log decay ``g``, write key ``kw``, read vector ``b``,
    query ``q`` (``[N, HV, K]``; ``g`` ``[N, HV]`` for a scalar-decay pool), value ``v [N, HV, V]``."""
    cfg = pool.config
    n = slots.shape[0]
    pool.check_slots(slots)
    _check_decay(pool, g, n)
    for name, x in (("kw", kw), ("b", b), ("q", q)):
        check_token(pool.device, name, x, (n, cfg.heads, cfg.d_k))
    check_token(pool.device, "v", v, (n, cfg.heads, cfg.d_v))
    if readout not in ("post", "pre"):
        raise LeapQuantError(f"readout must be 'post' or 'pre', got {readout!r}")
    if use_triton(pool.device, backend):
        launch = LaunchConfig.tuned(cfg.decay, cfg.compensators, cfg.residual)
        pool.close_list()[1].zero_()
        out = launch_step(
            pool,
            slots,
            q,
            kw,
            v,
            g,
            None,
            b,
            None,
            None,
            1.0,
            False,
            False,
            False,
            readout == "pre",
            launch,
            True,
            close=resolve_close(pool, launch),
        )
        return out
    out = naive.step_ref(pool, slots, g.float(), kw.float(), b.float(), v.float(), q.float(), readout=readout)
    naive.close_ref(pool, slots)
    return out


def load_states(
    pool: LeapQuantPool,
    slots: torch.Tensor,
    states: torch.Tensor,
    *,
    layout: str = "kv",
    backend: str = "auto",
) -> None:
    """Prefill hand-off: quantize full-precision ``states`` into ``slots`` (window position 0).

    ``states`` is ``[N, HV, K, V]`` (``layout="kv"``, FLA's and transformers' ``initial_state``) or
    ``[N, HV, V, K]`` (``"vk"``); float32/bf16/fp16, finite.
    """
    cfg = pool.config
    n = slots.shape[0]
    pool.check_slots(slots)
    if layout not in ("kv", "vk"):
        raise LeapQuantError(f"layout must be 'kv' ([N, HV, K, V]) or 'vk' ([N, HV, V, K]), got {layout!r}")
    dims = (cfg.d_k, cfg.d_v) if layout == "kv" else (cfg.d_v, cfg.d_k)
    check_token(pool.device, "states", states, (n, cfg.heads, *dims))
    if not torch.isfinite(states).all():
        raise LeapQuantError("states has a NaN or Inf")
    if use_triton(pool.device, backend):
        from .close import MODE_LOAD

        launch_boundary(pool, slots, states.float().contiguous(), MODE_LOAD, layout == "kv")
    else:
        naive.load_ref(pool, slots, states.float(), layout=layout)


def materialize_states(
    pool: LeapQuantPool, slots: torch.Tensor, *, layout: str = "kv", backend: str = "auto"
) -> torch.Tensor:
    """Dense fp32 states of ``slots`` at their current position (``[N, HV, K, V]`` for ``layout="kv"``)."""
    cfg = pool.config
    pool.check_slots(slots)
    if layout not in ("kv", "vk"):
        raise LeapQuantError(f"layout must be 'kv' or 'vk', got {layout!r}")
    if use_triton(pool.device, backend):
        dims = (cfg.d_k, cfg.d_v) if layout == "kv" else (cfg.d_v, cfg.d_k)
        from .close import MODE_MATERIALIZE

        out = torch.empty(slots.shape[0], cfg.heads, *dims, dtype=torch.float32, device=pool.device)
        launch_boundary(pool, slots, out, MODE_MATERIALIZE, layout == "kv")
        return out
    return naive.materialize_ref(pool, slots, layout=layout)
