"""Per-step decode kernels (the baselines of the paper's Table 2): the state is re-quantized every token.

``per_step_kernel`` (grid ``N*HV`` x ``V/BV``) loads a tile of value rows of one head from a ``[S, HV, V, K]``
pool (fp32, bf16, or int8 with per-value-channel fp32 scales), applies the GDN/KDA update exactly as FLA's
``fused_recurrent`` kernels do (decay, delta read, rank-one write, output), and stores the tile back in the
same format.  Per-value-channel scales reduce along the key axis, which is inside the tile, so value tiles
stay independent.  Not autotuned: it updates the pool in place (see ``leapquant_decode``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common import bf16_grid, native_token, rint

__all__ = ["per_step_kernel"]

# ``STATE`` codes: leapquant.formats.residual.RESIDUAL_FORMATS[fmt].per_step_code (0 fp32, 1 bf16, 2 int8)


@triton.heuristics(
    {
        "VECTOR_DECAY": lambda args: args["g"].ndim == 3,
        "HAS_DT_BIAS": lambda args: args["dt_bias"] is not None,
        "GATE_IN_KERNEL": lambda args: args["A_log"] is not None,
    }
)
@triton.jit(do_not_specialize=["qk_scale"])
def per_step_kernel(
    q,
    k,
    v,
    g,
    beta,
    b_read,
    A_log,
    dt_bias,
    o,
    slots,
    state,
    scale_v,
    qk_scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    STATE: tl.constexpr,
    NATIVE: tl.constexpr,
    READ_PRE: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr,
    VECTOR_DECAY: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    GATE_IN_KERNEL: tl.constexpr,
):
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    p_o = o + i_nh.to(tl.int64) * V + o_v
    slot = tl.load(slots + i_n).to(tl.int64)
    if slot < 0:
        tl.store(p_o, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty))
        return
    i_s = slot * HV + i_hv
    p_h = state + i_s * V * K + o_v[:, None] * K + o_k[None, :]

    b_v = tl.load(v + i_nh * V + o_v).to(tl.float32)
    b_h = tl.load(p_h).to(tl.float32)
    if STATE == 2:
        b_h = b_h * tl.load(scale_v + i_s * V + o_v)[:, None]
    if NATIVE:  # FLA's update: decay, then delta read with k, write beta * (v - S k) along k
        b_q, b_k, b_g, b_beta = native_token(
            q, k, g, beta, A_log, dt_bias, i_n, i_h, i_nh, i_hv, qk_scale,
            H, K, USE_QK_L2NORM, VECTOR_DECAY, GATE_IN_KERNEL, HAS_DT_BIAS, BETA_SIGMOID,
        )  # fmt: skip
        if VECTOR_DECAY:
            b_h = b_h * tl.exp(b_g)[None, :]
        else:
            b_h = b_h * tl.exp(b_g)
        b_u = b_beta * (b_v - tl.sum(b_h * b_k[None, :], 1))
        b_h += b_u[:, None] * b_k[None, :]
        tl.store(p_o, tl.sum(b_h * b_q[None, :], 1).to(p_o.dtype.element_ty))
    else:  # general records (paper eq. 1): read S_{t-1} with b, decay, write kw along u
        if VECTOR_DECAY:
            b_g = tl.load(g + i_nh * K + o_k).to(tl.float32)
        else:
            b_g = tl.load(g + i_nh).to(tl.float32)
        b_q = tl.load(q + i_nh * K + o_k).to(tl.float32)
        b_kw = tl.load(k + i_nh * K + o_k).to(tl.float32)
        b_b = tl.load(b_read + i_nh * K + o_k).to(tl.float32)
        b_u = b_v - tl.sum(b_h * b_b[None, :], 1)
        if READ_PRE:
            tl.store(p_o, tl.sum(b_h * b_q[None, :], 1).to(p_o.dtype.element_ty))
        if VECTOR_DECAY:
            b_h = b_h * tl.exp(b_g)[None, :]
        else:
            b_h = b_h * tl.exp(b_g)
        b_h += b_u[:, None] * b_kw[None, :]
        if not READ_PRE:
            tl.store(p_o, tl.sum(b_h * b_q[None, :], 1).to(p_o.dtype.element_ty))

    if STATE == 0:
        tl.store(p_h, b_h)
    elif STATE == 1:
        tl.store(p_h, bf16_grid(b_h).to(tl.bfloat16))
    else:
        b_scale = tl.math.div_rn(tl.max(tl.abs(b_h), 1), 127.0)
        b_scale = tl.where(b_scale == 0.0, 1.0, b_scale)
        tl.store(scale_v + i_s * V + o_v, b_scale)
        # one division per row, then multiplies: the baseline should not pay an IEEE division per element
        b_inv = 1.0 / b_scale
        b_x = tl.minimum(tl.maximum(rint(b_h * b_inv[:, None]), -127.0), 127.0)
        tl.store(p_h, b_x.to(tl.int32).to(tl.int8))
