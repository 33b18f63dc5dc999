"""Triton helpers shared by the decode kernels: exact rounding, the model-native token preamble, the pool's
page bases and the records' cumulative decays."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "bf16_grid",
    "divide_by_reciprocal",
    "e4m3_grid",
    "native_token",
    "page_bases",
    "record_decays",
    "rint",
    "tf32_split",
]


@triton.jit
def rint(x):
    """Round half to even for |x| < 2^22 (the fp32 add rounds; no libdevice needed, works interpreted)."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def tf32_split(x):
    """``x = hi + lo`` with ``hi`` exact in tf32 (low 13 mantissa bits cleared): tf32 products of both
    halves against an exact operand give fp32-level accuracy."""
    hi = (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def divide_by_reciprocal(a, b, y):
    """``a / b`` correctly rounded, from ``y = div_rn(1, b)``, in one multiply and four FMAs.

    ``q = a y`` is within 1.5 ulp of ``a / b``; one Newton correction ``q + (a - b q) y`` brings it within
    one ulp, and a second is then the correctly rounded quotient (Markstein's theorem: ``y`` correctly
    rounded, ``q`` within one ulp, the remainder exact by the FMA).  Valid while ``a``, ``b``, the quotient
    and the remainders stay normal: callers check the range and fall back to ``div_rn``, which costs a
    reciprocal on the multifunction unit and a branch to a slow path per element.
    """
    q = a * y
    q = tl.fma(tl.fma(-q, b, a), y, q)
    return tl.fma(tl.fma(-q, b, a), y, q)


@triton.jit
def bf16_grid(x):
    """fp32 -> nearest-even bf16 value (still fp32): bit arithmetic, so the GPU and the interpreter (whose
    bf16 cast truncates) agree; the cast that follows is then exact."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_grid(x):
    """fp32 in [-448, 448] -> nearest-even E4M3 value (still fp32), subnormals included.

    Scaled onto the grid by multiplying with the exact power of two ``1 / step``: on the GPU ``x / step``
    compiles to an approximate division (up to 2 ulp), which can move a value across a rounding boundary.
    The sign is copied back from ``x``: :func:`rint` rounds small negatives to +0, the format to -0.
    """
    bits = x.to(tl.uint32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF).to(tl.int32) - 127
    exponent = tl.maximum(exponent, -6) - 3  # grid step 2^(e-3); subnormals share 2^-9
    step = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    y = tl.minimum(tl.maximum(rint(x * inv_step) * step, -448.0), 448.0)
    return (y.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def native_token(
    q, k, g, beta, A_log, dt_bias, i_n, i_h, i_nh, i_hv, qk_scale,
    H: tl.constexpr, K: tl.constexpr, USE_QK_L2NORM: tl.constexpr, VECTOR_DECAY: tl.constexpr,
    GATE_IN_KERNEL: tl.constexpr, HAS_DT_BIAS: tl.constexpr, BETA_SIGMOID: tl.constexpr,
):  # fmt: skip
    """GDN/KDA inputs of one token as FLA's fused_recurrent kernels take them.

    Returns ``(q * scale, k, g, beta)`` in fp32: q/k L2-normalised as FLA (``x / sqrt(sum x^2 + 1e-6)``),
    ``g`` the log decay (``[K]`` for KDA, a scalar for GDN), activated in the kernel when ``A_log`` is given
    (``-exp(A_log) * softplus(g + dt_bias)``, softplus with PyTorch's threshold of 20).
    """
    o_k = tl.arange(0, K)
    b_q = tl.load(q + (i_n * H + i_h) * K + o_k).to(tl.float32)
    b_k = tl.load(k + (i_n * H + i_h) * K + o_k).to(tl.float32)
    if USE_QK_L2NORM:
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    b_q = b_q * qk_scale
    if VECTOR_DECAY:
        b_g = tl.load(g + i_nh * K + o_k).to(tl.float32)
    else:
        b_g = tl.load(g + i_nh).to(tl.float32)
    if GATE_IN_KERNEL:
        if HAS_DT_BIAS:
            if VECTOR_DECAY:
                b_g = b_g + tl.load(dt_bias + i_hv * K + o_k).to(tl.float32)
            else:
                b_g = b_g + tl.load(dt_bias + i_hv).to(tl.float32)
        b_g = -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * tl.where(
            b_g > 20.0, b_g, tl.log(1.0 + tl.exp(b_g))
        )
    b_beta = tl.load(beta + i_nh).to(tl.float32)
    if BETA_SIGMOID:
        b_beta = tl.sigmoid(b_beta)
    return b_q, b_k, b_g, b_beta


@triton.jit
def page_bases(
    slot, payload, scale_v, smooth, comp_k, comp_u, rec_g, rec_k, rec_u, pos, shift_payload, shift_scale,
    shift_smooth, shift_comp_k, shift_comp_u, shift_rec_g, shift_rec_k, shift_rec_u, shift_pos,
    PAGED: tl.constexpr,
):  # fmt: skip
    """The pool pointers for ``slot``: unchanged for a contiguous pool; for a paged one (an engine's cache,
    every tensor's slot axis strided by its page) moved by ``slot * shift_X``, ``shift_X = stride_X(slot) -
    per-slot numel`` (``LeapQuantPool.slot_shift``), so the kernels' ``(slot * HV + head) * per-head numel``
    offsets land in the slot's page. The shifts are integer arguments, not loads: Triton specializes them on
    divisibility by 16, so the moved pointers keep the alignment that vectorized loads need."""
    if PAGED:
        payload += slot * shift_payload
        scale_v += slot * shift_scale
        smooth += slot * shift_smooth
        comp_k += slot * shift_comp_k
        comp_u += slot * shift_comp_u
        rec_g += slot * shift_rec_g
        rec_k += slot * shift_rec_k
        rec_u += slot * shift_rec_u
        pos += slot * shift_pos
    return payload, scale_v, smooth, comp_k, comp_u, rec_g, rec_k, rec_u, pos


@triton.jit
def record_decays(rec_g, i_s, count, K: tl.constexpr, P: tl.constexpr, BP: tl.constexpr):
    """KDA's cumulative log decays for head ``i_s``'s first ``count`` records, from the records' own ones
    (``rec_g [.., P, K]``: KDA records keep each token's decays, GDN records their running sums).

    Returns fp32 ``(total, since)``: ``total [K] = G_count = g_1 + ... + g_count`` and ``since [BP, K]``, row
    ``j`` the log decay after record ``j`` up to record ``count`` (``g_{j+1} + ... + g_count``), zero from
    row ``count - 1`` on.  ``since`` is one product with a strictly triangular 0/1 matrix, not a scan: a scan
    along the records axis of a ``[BP, K]`` tile goes through shared memory and cost the KDA step 15-34%
    (H100, e62f7e6).  On tensor cores (``BP >= 16``) fp16 decays are exact operands; fp32 ones are split
    into two tf32 halves.
    """
    o_p = tl.arange(0, BP)
    o_k = tl.arange(0, K)
    mask_p = o_p < count
    b_after = (o_p[None, :] > o_p[:, None]) & mask_p[None, :]  # [j, i]: record i counts toward row j
    b_g = tl.load(rec_g + (i_s * P + o_p[:, None]) * K + o_k[None, :], mask=mask_p[:, None], other=0.0)
    b_total = tl.sum(b_g.to(tl.float32), 0)
    if BP < 16:  # too small for a tensor-core product
        b_since = tl.sum(tl.where(b_after[:, :, None], b_g.to(tl.float32)[None, :, :], 0.0), 1)
    elif b_g.dtype == tl.float16:
        b_since = tl.dot(b_after.to(tl.float16), b_g, out_dtype=tl.float32)
    else:
        b_hi, b_lo = tf32_split(b_g)
        b_ones = b_after.to(tl.float32)
        b_since = tl.dot(b_ones, b_hi, input_precision="tf32")
        b_since = tl.dot(b_ones, b_lo, acc=b_since, input_precision="tf32")
    return b_total, b_since
