"""Triton step kernel of the LeapQuant decode (GDN and KDA) on a :class:`~leapquant.ops.pool.LeapQuantPool`,
and the row helpers the window-close kernels share.

One decode step is two launches (plus a 4-byte memset):

1. ``step_kernel`` (grid ``N*HV``, one program per head): computes the token's read vectors once, the
   compensator and record weights once (``[R, K]`` and ``[P, K]`` tiles), then walks the value rows in
   chunks of ``BV``: each chunk of the fixed boundary residual is read once for both the delta read and the
   output read (paper eq. 10).  It writes the output and the new record ``(g_i, k_i, u_i)``, advances the
   window position, and appends heads that complete a window to a list.
2. ``close_kernel`` (``close.py``) walks that list: for each head it reconstructs the
   state from the boundary and the ``P`` records, refits the compensator tokens by power iteration
   warm-started from the previous ones, recomputes the smoothing and per-value-channel scales, and writes
   the new quantized boundary.  Only heads that close a window cost anything.

The kernels are not autotuned: they update the pool in place, and an autotuner would replay them on the same
pool while timing (mamba_ssm's ``selective_state_update`` makes the same choice; see ``LaunchConfig``).
Slots given as -1 are padding: their output rows are zero and no byte of the pool is touched.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common import native_token

__all__ = ["RESIDUAL_CODES", "step_kernel"]

# residual format -> (code in the kernels, element max)
RESIDUAL_CODES = {
    "fp32": (0, 0.0),
    "bf16": (1, 0.0),
    "int8": (2, 127.0),
    "int6": (2, 31.0),  # int8 bytes holding 6-bit codes
    "fp8-e4m3": (3, 448.0),
    "int4": (4, 7.0),
}


@triton.jit
def _residual_rows(payload, i_s, o_v, o_k, K: tl.constexpr, V: tl.constexpr, RESIDUAL: tl.constexpr):
    """Residual codes of value rows ``o_v`` as fp32 ``[BV, K]`` (int4 unpacked, keys in natural order).

    Unmasked: row chunks always divide V (the wrappers check it), and fp8 has no masked-load fill value.
    """
    if RESIDUAL == 4:
        o_k2 = tl.arange(0, K // 2)
        b_word = tl.load(payload + i_s * V * (K // 2) + o_v[:, None] * (K // 2) + o_k2[None, :]).to(tl.int32)
        b_lo = ((b_word << 28) >> 28).to(tl.float32)  # arithmetic shifts sign-extend each nibble
        b_hi = ((b_word << 24) >> 28).to(tl.float32)
        return tl.reshape(tl.join(b_lo, b_hi), (o_v.shape[0], K))
    else:
        return tl.load(payload + i_s * V * K + o_v[:, None] * K + o_k[None, :]).to(tl.float32)


@triton.heuristics(
    {
        "VECTOR_DECAY": lambda args: args["g"].ndim == 3,
        "HAS_DT_BIAS": lambda args: args["dt_bias"] is not None,
        "GATE_IN_KERNEL": lambda args: args["A_log"] is not None,
    }
)
@triton.jit(do_not_specialize=["qk_scale"])
def step_kernel(
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
    payload,
    scale_v,
    smooth,
    comp_k,
    comp_u,
    rec_g,
    rec_k,
    rec_u,
    pos,
    close_list,
    close_count,
    qk_scale,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    P: tl.constexpr,
    R: tl.constexpr,
    BV: tl.constexpr,
    BP: tl.constexpr,
    BR: tl.constexpr,
    NATIVE: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr,
    RESIDUAL: tl.constexpr,
    SMOOTH: tl.constexpr,
    READ_PRE: tl.constexpr,
    ADVANCE: tl.constexpr,
    STAGES: tl.constexpr,
    FAST_CVT: tl.constexpr,
    VECTOR_DECAY: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    GATE_IN_KERNEL: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, K)
    o_b = tl.arange(0, BV)
    p_o = o + i_nh.to(tl.int64) * V

    slot = tl.load(slots + i_n).to(tl.int64)
    if slot < 0:  # padding: zero output, no pool access at all
        for v0 in tl.range(0, V, BV):
            tl.store(p_o + v0 + o_b, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty))
        return
    i_s = slot * HV + i_hv  # (slot, head) index into every pool tensor
    i_pos = tl.load(pos + i_s)

    # -- the token: general-form read vector b, write key kw, query q and log decay g -----------------
    if NATIVE:
        b_q, b_k, b_g, b_beta = native_token(
            q, k, g, beta, A_log, dt_bias, i_n, i_h, i_nh, i_hv, qk_scale,
            H, K, USE_QK_L2NORM, VECTOR_DECAY, GATE_IN_KERNEL, HAS_DT_BIAS, BETA_SIGMOID,
        )  # fmt: skip
        b_kw = b_beta * b_k
        b_b = tl.exp(b_g) * b_k
    else:
        b_q = tl.load(q + i_nh * K + o_k).to(tl.float32)
        b_kw = tl.load(k + i_nh * K + o_k).to(tl.float32)
        b_b = tl.load(b_read + i_nh * K + o_k).to(tl.float32)
        if VECTOR_DECAY:
            b_g = tl.load(g + i_nh * K + o_k).to(tl.float32)
        else:
            b_g = tl.load(g + i_nh).to(tl.float32)

    # -- cumulative decays G_{i-1} (read before the update) and G_i, and the two read vectors ----------
    if VECTOR_DECAY:
        b_gprev = tl.load(rec_g + (i_s * P + i_pos - 1) * K + o_k, mask=(o_k * 0 + i_pos) > 0, other=0.0)
    else:
        b_gprev = tl.load(rec_g + i_s * P + i_pos - 1, mask=i_pos > 0, other=0.0)
    b_gnow = b_gprev + b_g
    b_yb = tl.exp(b_gprev) * b_b
    if READ_PRE:
        b_yq = tl.exp(b_gprev) * b_q
    else:
        b_yq = tl.exp(b_gnow) * b_q
    if SMOOTH:  # C acts on key rows: fold it into the vectors the residual is read with
        b_c = tl.load(smooth + i_s * K + o_k)
        b_rb = b_c * b_yb
        b_rq = b_c * b_yq
    else:
        b_rb = b_yb
        b_rq = b_yq

    # -- weights of the compensator tokens (identity decay, before the first record) and of the records --
    if R > 0:
        o_r = tl.arange(0, BR)
        mask_r = o_r < R
        b_ck = tl.load(comp_k + (i_s * R + o_r[:, None]) * K + o_k[None, :], mask=mask_r[:, None], other=0)
        b_cwb = tl.sum(b_ck.to(tl.float32) * b_yb[None, :], 1)
        b_cwq = tl.sum(b_ck.to(tl.float32) * b_yq[None, :], 1)
    o_p = tl.arange(0, BP)
    mask_p = o_p < i_pos
    b_rk = tl.load(rec_k + (i_s * P + o_p[:, None]) * K + o_k[None, :], mask=mask_p[:, None], other=0)
    b_rk = b_rk.to(tl.float32)
    if VECTOR_DECAY:
        b_gj = tl.load(rec_g + (i_s * P + o_p[:, None]) * K + o_k[None, :], mask=mask_p[:, None], other=0.0)
        b_wb = tl.sum(b_rk * tl.exp(b_gprev[None, :] - b_gj) * b_b[None, :], 1)
        if READ_PRE:
            b_wq = tl.sum(b_rk * tl.exp(b_gprev[None, :] - b_gj) * b_q[None, :], 1)
        else:
            b_wq = tl.sum(b_rk * tl.exp(b_gnow[None, :] - b_gj) * b_q[None, :], 1)
    else:
        b_gj = tl.load(rec_g + i_s * P + o_p, mask=mask_p, other=0.0)
        b_wb = tl.exp(b_gprev - b_gj) * tl.sum(b_rk * b_b[None, :], 1)
        if READ_PRE:
            b_wq = tl.exp(b_gprev - b_gj) * tl.sum(b_rk * b_q[None, :], 1)
        else:
            b_wq = tl.exp(b_gnow - b_gj) * tl.sum(b_rk * b_q[None, :], 1)
    b_wb = tl.where(mask_p, b_wb, 0.0)
    b_wq = tl.where(mask_p, b_wq, 0.0)
    b_kw = b_kw.to(rec_k.dtype.element_ty)  # stored precision; the output reads the record back
    b_kwq = tl.sum(b_kw.to(tl.float32) * b_q)
    if RESIDUAL == 4:
        b_rb_even, b_rb_odd = tl.split(tl.reshape(b_rb, (K // 2, 2)))
        b_rq_even, b_rq_odd = tl.split(tl.reshape(b_rq, (K // 2, 2)))

    # -- value rows in chunks: the residual is read once for both vectors --------------------------------
    for v0 in tl.range(0, V, BV, num_stages=STAGES):
        o_v = v0 + o_b
        if RESIDUAL == 4:
            o_k2 = tl.arange(0, K // 2)
            b_word = tl.load(payload + i_s * V * (K // 2) + o_v[:, None] * (K // 2) + o_k2[None, :]).to(
                tl.int32
            )
            b_lo = ((b_word << 28) >> 28).to(tl.float32)
            b_hi = ((b_word << 24) >> 28).to(tl.float32)
            b_accb = tl.sum(b_lo * b_rb_even[None, :] + b_hi * b_rb_odd[None, :], 1)
            b_accq = tl.sum(b_lo * b_rq_even[None, :] + b_hi * b_rq_odd[None, :], 1)
        else:
            b_r = tl.load(payload + i_s * V * K + o_v[:, None] * K + o_k[None, :])
            if FAST_CVT and RESIDUAL == 2:  # int8 -> fp32 by exponent bits: integer add + fp add, no I2F
                b_r = (b_r.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
            else:
                b_r = b_r.to(tl.float32)
            b_accb = tl.sum(b_r * b_rb[None, :], 1)
            b_accq = tl.sum(b_r * b_rq[None, :], 1)
        if RESIDUAL >= 2:
            b_scale = tl.load(scale_v + i_s * V + o_v)
            b_accb = b_accb * b_scale
            b_accq = b_accq * b_scale
        if R > 0:
            b_cu = tl.load(
                comp_u + (i_s * R + o_r[:, None]) * V + o_v[None, :], mask=mask_r[:, None], other=0
            )
            b_accb += tl.sum(b_cu.to(tl.float32) * b_cwb[:, None], 0)
            b_accq += tl.sum(b_cu.to(tl.float32) * b_cwq[:, None], 0)
        b_ru = tl.load(rec_u + (i_s * P + o_p[:, None]) * V + o_v[None, :], mask=mask_p[:, None], other=0)
        b_accb += tl.sum(b_ru.to(tl.float32) * b_wb[:, None], 0)
        b_accq += tl.sum(b_ru.to(tl.float32) * b_wq[:, None], 0)
        p_ru = rec_u + (i_s * P + i_pos) * V + o_v
        b_u = (tl.load(v + i_nh * V + o_v).to(tl.float32) - b_accb).to(p_ru.dtype.element_ty)
        if READ_PRE:
            b_o = b_accq
        else:
            b_o = b_accq + b_u.to(tl.float32) * b_kwq
        tl.store(p_o + o_v, b_o.to(p_o.dtype.element_ty))
        tl.store(p_ru, b_u)
    tl.store(rec_k + (i_s * P + i_pos) * K + o_k, b_kw)
    if VECTOR_DECAY:
        tl.store(rec_g + (i_s * P + i_pos) * K + o_k, b_gnow)
    else:
        tl.store(rec_g + i_s * P + i_pos, b_gnow)
    if ADVANCE:  # one program per head: nobody else reads this position during the step
        if i_pos + 1 < P:
            tl.store(pos + i_s, i_pos + 1)
        else:
            tl.store(close_list + tl.atomic_add(close_count, 1), i_s)
