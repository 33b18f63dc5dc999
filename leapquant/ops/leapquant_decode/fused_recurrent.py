"""Triton step kernels of the LeapQuant decode (GDN and KDA) on a :class:`~leapquant.ops.pool.LeapQuantPool`,
and the row helpers the window-close kernels share.

One decode step is a step launch and a close launch (``launch_step`` in ``launch.py``):

1. a step kernel (grid ``N*HV``, one program per head) computes the token's read vectors once, the
   compensator and record weights once (``[R, K]`` and ``[P, K]`` tiles), then walks the value rows in
   chunks of ``BV``: each chunk of the fixed boundary residual is read once for both the delta read and the
   output read (paper eq. 10).  It writes the output and the new record ``(g_i, k_i, u_i)``, advances the
   window position, and appends heads that complete a window to a list.  ``step_tc_kernel`` does it on
   tensor cores for integer residuals with fp16 records (the codes are a product operand as they are
   stored); ``step_kernel`` on CUDA cores for every format.
2. ``close_kernel`` (``close.py``) walks that list: for each head it reconstructs the
   state from the boundary and the ``P`` records, refits the compensator tokens by power iteration
   warm-started from the previous ones, recomputes the smoothing and per-value-channel scales, and writes
   the new quantized boundary.  Only heads that close a window cost anything.  With ``overlap_close`` the
   heads that close step and close on a side stream beside the others (``SUBSET_*``).

The kernels are not autotuned: they update the pool in place, and an autotuner would replay them on the same
pool while timing (mamba_ssm's ``selective_state_update`` makes the same choice; see ``LaunchConfig``).
Slots given as -1 are padding: their output rows are zero and no byte of the pool is touched.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common import native_token, page_bases, record_decays, rint, tf32_split
from ..pool import LOG_DECAY_FLOOR

__all__ = ["SUBSET_ALL", "SUBSET_CLOSING", "SUBSET_OTHERS", "step_kernel", "step_tc_kernel"]

# Which heads a step launch takes: all of them, or one side of a split by the ``closing`` snapshot (heads
# that fill their window this step, whose close runs on a side stream while the others step).
SUBSET_ALL = tl.constexpr(0)
SUBSET_OTHERS = tl.constexpr(1)
SUBSET_CLOSING = tl.constexpr(2)
_LOG_DECAY_FLOOR = tl.constexpr(LOG_DECAY_FLOOR)

# ``RESIDUAL`` codes: leapquant.formats.residual.RESIDUAL_FORMATS (0 fp32, 1 bf16, 2 int8/int6, 3 fp8-e4m3,
# 4 int4 packed two keys a byte)


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


@triton.jit
def _residual_codes(payload, i_s, o_v, o_k, K: tl.constexpr, V: tl.constexpr):
    """Integer residual codes of value rows ``o_v`` as int8 ``[BV, K]`` (int8/int6 storage): the
    tensor-core operand, no conversion to float."""
    return tl.load(payload + i_s * V * K + o_v[:, None] * K + o_k[None, :])


@triton.jit
def _residual_nibbles(payload, i_s, o_v, K: tl.constexpr, V: tl.constexpr):
    """The int4 codes of value rows ``o_v`` as two int8 ``[BV, K/2]`` planes, the even keys (low nibbles)
    and the odd keys (high nibbles), as they are stored: each plane is a product operand against the
    matching half of the read vector, so no code is moved into key order.

    Each plane is one bitwise operation on the bytes (the compiler does those four bytes at a time; shifts
    it does byte by byte): the even plane is ``code + 8`` (the low nibble with its sign bit flipped, 0..15),
    the odd plane ``16 * code`` (the high nibble in place).  ``_nibble_sums`` undoes both, exactly.
    """
    o_k2 = tl.arange(0, K // 2)
    b_byte = tl.load(payload + i_s * V * (K // 2) + o_v[:, None] * (K // 2) + o_k2[None, :])
    b_byte = b_byte.to(tl.int8, bitcast=True)
    return (b_byte & 15) ^ 8, b_byte & -16


@triton.jit
def _nibble_sums(b_acc_even, b_acc_odd, b_offset):
    """The products of the int4 codes from those of ``_residual_nibbles``' planes: ``[BV, 16]`` int32
    products of the even plane (``code + 8``) and of the odd one (``16 * code``) with the limbs, and
    ``b_offset [16]`` = 8 x the even limbs' sums.  Exact: every term is an integer below 2^24 in fp32."""
    return (b_acc_even - b_offset[None, :]).to(tl.float32) + b_acc_odd.to(tl.float32) * 0.0625


@triton.jit
def _pow2(e):
    """``2^e`` for an int32 ``e`` in [-126, 127], exact (built from exponent bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _limb_exponent(x):
    """The power of two ``e`` that puts ``max |x| 2^e`` in [64, 128) (clamped: vectors below 2^-94 lose
    their low bits, zero vectors give zero limbs)."""
    m = tl.max(tl.abs(x))
    e_m = ((m.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
    return tl.minimum(tl.maximum(6 - e_m, -100), 100)


@triton.jit
def _fixed_point_limbs(x, e):
    """Four int8 limbs of an fp32 vector in a shared fixed-point scale: ``x * 2^e = l0 + l1/64 + l2/64^2 +
    l3/64^3``, exact for entries within a factor 2 of ``max|x|`` (24 significant bits from 2^6 down to
    2^-18) and to 2^-24 of ``max|x|`` for the rest.

    Integer codes times these limbs are exact int32 sums on the int8 tensor cores (below 2^24, so exact in
    fp32 too, for int8 codes and K <= 1024): a residual read costs no float conversion per element and
    is as accurate as an fp32 one.  ``e`` from ``_limb_exponent``; returns ``(l0, l1, l2, l3)``, int8 ``[K]``.
    """
    a = x * _pow2(e)
    l0 = tl.minimum(tl.maximum(rint(a), -127.0), 127.0)
    r = (a - l0) * 64.0  # exact: |a - l0| <= 1 is a multiple of a's last bit
    l1 = rint(r)
    r = (r - l1) * 64.0
    l2 = rint(r)
    l3 = rint((r - l2) * 64.0)
    return l0.to(tl.int8), l1.to(tl.int8), l2.to(tl.int8), l3.to(tl.int8)


@triton.jit
def _pack4(b0, b1, b2, b3):
    """Four int8 vectors as the bytes of one int32 vector (``b0`` lowest)."""
    return ((b0.to(tl.int32) & 0xFF) | ((b1.to(tl.int32) & 0xFF) << 8) | ((b2.to(tl.int32) & 0xFF) << 16)
            | (b3.to(tl.int32) << 24))  # fmt: skip


@triton.jit
def _limb_rows(x, y, ex, ey):
    """The ``[16, J]`` int8 operand whose rows are the limbs of ``x`` (rows 0-3) and ``y`` (rows 4-7; rows
    8-15 zero: ``tl.dot`` needs 16) in the fixed-point scales ``2^ex``, ``2^ey`` (``_limb_exponent`` of
    the whole vectors, so the two key halves of an int4 read share them); ``_limb_weights`` undoes them.

    Each key's four limbs are packed into one int32 word, so row ``n`` is one byte shift of a word (a
    select chain over eight limbs costs seven instructions an element).  Rows, not columns: Triton keeps
    a ``[K, 16]`` operand built in registers in a byte-gathered shared layout that it reloads at every use.
    """
    x0, x1, x2, x3 = _fixed_point_limbs(x, ex)
    y0, y1, y2, y3 = _fixed_point_limbs(y, ey)
    w_x = _pack4(x0, x1, x2, x3)
    w_y = _pack4(y0, y1, y2, y3)
    n = tl.arange(0, 16)
    b_word = tl.where((n < 4)[:, None], w_x[None, :], w_y[None, :])
    return tl.where((n < 8)[:, None], b_word >> (8 * (n & 3))[:, None], 0).to(tl.int8)  # low byte


@triton.jit
def _limb_weights(x, y):
    """The ``[16]`` weights that turn row ``n`` of a product with ``_limb_rows(x, y)`` back into
    ``codes @ x`` and ``codes @ y`` (NaN when a vector holds Inf/NaN, so it propagates)."""
    n = tl.arange(0, 16)
    nan_x = 0.0 * tl.max(tl.abs(x))
    nan_y = 0.0 * tl.max(tl.abs(y))
    w_x = tl.where(n < 4, _pow2(-_limb_exponent(x) - 6 * (n & 3)), 0.0) + nan_x
    w_y = tl.where((n >= 4) & (n < 8), _pow2(-_limb_exponent(y) - 6 * (n & 3)), 0.0) + nan_y
    return w_x, w_y


@triton.jit
def _exponent(m):
    """The power of two ``e`` that puts ``m`` in [2^14, 2^15): the scale of ``_fp16_pieces`` (clamped;
    NaN/Inf give a large ``e`` and NaN weights downstream)."""
    e_m = ((m.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
    return tl.minimum(tl.maximum(14 - e_m, -100), 100)


@triton.jit
def _fp16_pieces(x, e):
    """``x [J] = 2^-e (p0 + p1 + p2)`` with fp16 pieces (33 significant bits when ``max |x| 2^e`` is in
    [2^14, 2^15), see ``_exponent``): fp16 tensor-core products against exact fp16 operands then sum to
    fp32 accuracy."""
    a = x * _pow2(e)
    p0 = a.to(tl.float16)
    r = a - p0.to(tl.float32)
    p1 = r.to(tl.float16)
    p2 = (r - p1.to(tl.float32)).to(tl.float16)
    return p0, p1, p2, _pow2(-e) + 0.0 * tl.max(tl.abs(x))


@triton.jit
def _tf32_columns(x, y):
    """``[K, 16]`` fp32 operand: columns 0-1 the tf32 halves of ``x``, 2-3 those of ``y``, the rest zero
    (built as rows and transposed: the layout Triton gives a row-built operand tiles without gathers)."""
    x_hi, x_lo = tf32_split(x)
    y_hi, y_lo = tf32_split(y)
    n = tl.arange(0, 16)[:, None]
    b_rows = tl.where(n == 0, x_hi[None, :], tl.where(n == 1, x_lo[None, :], 0.0))
    b_rows = tl.where(n == 2, y_hi[None, :], tl.where(n == 3, y_lo[None, :], b_rows))
    return tl.trans(b_rows)


@triton.jit
def _column_pairs(b_dots):
    """Rows of a product with ``_tf32_columns(x, y)``: ``(rows @ x, rows @ y)``, ``[J]`` each."""
    o_c = tl.arange(0, 16)[None, :]
    return tl.sum(tl.where(o_c < 2, b_dots, 0.0), 1), tl.sum(tl.where((o_c >= 2) & (o_c < 4), b_dots, 0.0), 1)


@triton.jit
def _piece_columns(x, y, ex, ey):
    """``[J, 16]`` fp16 operand: columns 0-2 the pieces of ``x`` (scale ``2^ex``), 3-5 those of ``y``, the
    rest zero; and the ``[16]`` weights that sum a product's columns back into ``vals @ x`` and
    ``vals @ y``."""
    x0, x1, x2, sx = _fp16_pieces(x, ex)
    y0, y1, y2, sy = _fp16_pieces(y, ey)
    c = tl.arange(0, 16)[None, :]
    z = tl.zeros_like(x0)[:, None]
    b_pieces = tl.where(c == 0, x0[:, None], tl.where(c == 1, x1[:, None], tl.where(c == 2, x2[:, None], z)))
    b_pieces = tl.where(
        c == 3, y0[:, None], tl.where(c == 4, y1[:, None], tl.where(c == 5, y2[:, None], b_pieces))
    )
    o_c = tl.arange(0, 16)
    return b_pieces, tl.where(o_c < 3, sx, 0.0), tl.where((o_c >= 3) & (o_c < 6), sy, 0.0)


@triton.jit
def _token_reads(
    q, k, g, beta, b_read, A_log, dt_bias, smooth, rec_g, qk_scale, i_n, i_h, i_nh, i_hv, i_s, i_pos,
    H: tl.constexpr, K: tl.constexpr, P: tl.constexpr, BP: tl.constexpr, NATIVE: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, SMOOTH: tl.constexpr, READ_PRE: tl.constexpr,
    VECTOR_DECAY: tl.constexpr, HAS_DT_BIAS: tl.constexpr, GATE_IN_KERNEL: tl.constexpr,
):  # fmt: skip
    """The token in general form and the vectors the head's state is read with, fp32 ``[K]``.

    Returns ``(q, kw, b, g, gprev, gnow, since, yb, yq, rb, rq)``: query, write key (beta folded in), read
    vector, the token's log decay (KDA: as its record stores it), the cumulative log decays before and
    after this token, KDA's log decays ``G_{i-1} - G_j`` from each earlier record ``j`` to the previous token
    (``[BP, K]``, zero from row ``i_pos - 1`` on; GDN reads its running sums as stored), the read vectors
    decayed to the window start (``yb``, ``yq``: what the tokens and records are read with) and the same
    times the smoothing scales (``rb``, ``rq``: what the residual is read with).
    """
    o_k = tl.arange(0, K)
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
    # the floor (pool.py) keeps fp16 finite and GDN's running sums small; a NaN gate stays NaN (the state
    # shows it) rather than becoming the floor
    b_g = tl.maximum(b_g, _LOG_DECAY_FLOOR, propagate_nan=tl.PropagateNan.ALL)
    if VECTOR_DECAY:  # KDA records keep each token's own decays at their precision: sum them
        b_gprev, b_since = record_decays(rec_g, i_s, i_pos, K, P, BP)
        b_g = b_g.to(rec_g.dtype.element_ty)
        b_gnow = b_gprev + b_g.to(tl.float32)
    else:  # GDN records keep the running sums
        b_gprev = tl.load(rec_g + i_s * P + i_pos - 1, mask=i_pos > 0, other=0.0)
        b_gnow = b_gprev + b_g
        b_since = 0.0  # unused
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

    return b_q, b_kw, b_b, b_g, b_gprev, b_gnow, b_since, b_yb, b_yq, b_rb, b_rq


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
    shift_payload,
    shift_scale,
    shift_smooth,
    shift_comp_k,
    shift_comp_u,
    shift_rec_g,
    shift_rec_k,
    shift_rec_u,
    shift_pos,
    close_list,
    close_count,
    closing,
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
    SUBSET: tl.constexpr,
    STAGES: tl.constexpr,
    FAST_CVT: tl.constexpr,
    VECTOR_DECAY: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    GATE_IN_KERNEL: tl.constexpr,
    PAGED: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, K)
    o_b = tl.arange(0, BV)
    p_o = o + i_nh.to(tl.int64) * V

    slot = tl.load(slots + i_n).to(tl.int64)
    if slot < 0:  # padding: zero output, no pool access at all
        if SUBSET != SUBSET_CLOSING:
            for v0 in tl.range(0, V, BV):
                tl.store(p_o + v0 + o_b, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty))
        return
    i_s = slot * HV + i_hv  # (slot, head) index into every pool tensor
    payload, scale_v, smooth, comp_k, comp_u, rec_g, rec_k, rec_u, pos = page_bases(
        slot, payload, scale_v, smooth, comp_k, comp_u, rec_g, rec_k, rec_u, pos, shift_payload, shift_scale,
        shift_smooth, shift_comp_k, shift_comp_u, shift_rec_g, shift_rec_k, shift_rec_u, shift_pos, PAGED,
    )  # fmt: skip
    # one of two launches over disjoint heads: the snapshot says whose head this is (nested: a constexpr
    # test must not be and-ed with a tensor one)
    if SUBSET != SUBSET_ALL:  # noqa: SIM102
        if (tl.load(closing + i_s) != 0) != (SUBSET == SUBSET_CLOSING):
            return
    i_pos = tl.load(pos + i_s)

    b_q, b_kw, b_b, b_g, b_gprev, b_gnow, b_since, b_yb, b_yq, b_rb, b_rq = _token_reads(
        q, k, g, beta, b_read, A_log, dt_bias, smooth, rec_g, qk_scale, i_n, i_h, i_nh, i_hv, i_s, i_pos,
        H, K, P, BP, NATIVE, USE_QK_L2NORM, BETA_SIGMOID, SMOOTH, READ_PRE, VECTOR_DECAY, HAS_DT_BIAS,
        GATE_IN_KERNEL,
    )  # fmt: skip

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
        b_wb = tl.sum(b_rk * tl.exp(b_since) * b_b[None, :], 1)
        if READ_PRE:
            b_wq = tl.sum(b_rk * tl.exp(b_since) * b_q[None, :], 1)
        else:
            b_wq = tl.sum(b_rk * tl.exp(b_since + b_g.to(tl.float32)[None, :]) * b_q[None, :], 1)
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
        tl.store(rec_g + (i_s * P + i_pos) * K + o_k, b_g)
    else:
        tl.store(rec_g + i_s * P + i_pos, b_gnow)
    if ADVANCE:  # one program per head: nobody else reads this position during the step
        if i_pos + 1 < P:
            tl.store(pos + i_s, i_pos + 1)
        else:
            tl.store(close_list + tl.atomic_add(close_count, 1), i_s)


@triton.heuristics(
    {
        "VECTOR_DECAY": lambda args: args["g"].ndim == 3,
        "HAS_DT_BIAS": lambda args: args["dt_bias"] is not None,
        "GATE_IN_KERNEL": lambda args: args["A_log"] is not None,
    }
)
@triton.jit(do_not_specialize=["qk_scale"])
def step_tc_kernel(
    q, k, v, g, beta, b_read, A_log, dt_bias, o, slots, payload, scale_v, smooth, comp_k, comp_u, rec_g,
    rec_k, rec_u, pos, shift_payload, shift_scale, shift_smooth, shift_comp_k, shift_comp_u, shift_rec_g,
    shift_rec_k, shift_rec_u, shift_pos, close_list, close_count, closing, qk_scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, P: tl.constexpr, R: tl.constexpr,
    BV: tl.constexpr, BP: tl.constexpr, NATIVE: tl.constexpr, USE_QK_L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, RESIDUAL: tl.constexpr, SMOOTH: tl.constexpr, READ_PRE: tl.constexpr,
    ADVANCE: tl.constexpr, SUBSET: tl.constexpr, STAGES: tl.constexpr, VECTOR_DECAY: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, GATE_IN_KERNEL: tl.constexpr, PAGED: tl.constexpr,
):  # fmt: skip
    """The step on tensor cores, one program (one warp) per head walking the value rows in chunks of
    ``BV`` (integer residuals, fp16 records; same inputs, outputs and pool updates as ``step_kernel``).

    Two products give both reads (delta read and output) of all value rows:

    * the residual: int8 codes ``[V, K]`` times the fixed-point limbs of the two read vectors
      (``_limb_rows``): exact int32 sums, no per-element conversion;
    * records and tokens: their fp16 values (``[V, BP]``, ``BP >= 16`` rows the window's records, and
      ``[V, 16]``, ``R`` tokens) times the fp16 pieces of their weights (``_piece_columns``): exact
      products, fp32 sums.

    What is left per element is loading it; the per-row work is a 16-column weighted sum.  One warp, not
    four: a head's per-token work (its vectors, the ``[P, K]`` record tiles) would be replicated by more
    warps, not shared.
    """
    i_nh = tl.program_id(0)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, K)
    o_b = tl.arange(0, BV)
    p_o = o + i_nh.to(tl.int64) * V

    slot = tl.load(slots + i_n).to(tl.int64)
    if slot < 0:  # padding: zero output, no pool access at all
        if SUBSET != SUBSET_CLOSING:
            for v0 in tl.range(0, V, BV):
                tl.store(p_o + v0 + o_b, tl.zeros([BV], dtype=tl.float32).to(p_o.dtype.element_ty))
        return
    i_s = slot * HV + i_hv
    payload, scale_v, smooth, comp_k, comp_u, rec_g, rec_k, rec_u, pos = page_bases(
        slot, payload, scale_v, smooth, comp_k, comp_u, rec_g, rec_k, rec_u, pos, shift_payload, shift_scale,
        shift_smooth, shift_comp_k, shift_comp_u, shift_rec_g, shift_rec_k, shift_rec_u, shift_pos, PAGED,
    )  # fmt: skip
    # one of two launches over disjoint heads: the snapshot says whose head this is (nested: a constexpr
    # test must not be and-ed with a tensor one)
    if SUBSET != SUBSET_ALL:  # noqa: SIM102
        if (tl.load(closing + i_s) != 0) != (SUBSET == SUBSET_CLOSING):
            return
    i_pos = tl.load(pos + i_s)
    b_q, b_kw, b_b, b_g, b_gprev, b_gnow, b_since, b_yb, b_yq, b_rb, b_rq = _token_reads(
        q, k, g, beta, b_read, A_log, dt_bias, smooth, rec_g, qk_scale, i_n, i_h, i_nh, i_hv, i_s, i_pos,
        H, K, P, BP, NATIVE, USE_QK_L2NORM, BETA_SIGMOID, SMOOTH, READ_PRE, VECTOR_DECAY, HAS_DT_BIAS,
        GATE_IN_KERNEL,
    )  # fmt: skip

    # -- records (rows 0..i_pos-1 of a [BP, .] tile) and tokens (rows 0..R-1 of a [16, .] tile) ------------
    # Their weights are keys times both read vectors, tf32 products with the vectors split into tf32
    # halves: the fp16 keys are exact; KDA's record keys carry their decays and are split too.  Tokens
    # read with the decay to the window start (folded into the vectors), records with the decay since
    # they were written.
    o_p = tl.arange(0, BP)
    mask_p = o_p < i_pos
    b_rk = tl.load(rec_k + (i_s * P + o_p[:, None]) * K + o_k[None, :], mask=mask_p[:, None], other=0)
    b_rk = b_rk.to(tl.float32)
    if VECTOR_DECAY:
        if READ_PRE:
            b_vecs = _tf32_columns(b_b, b_q)
        else:
            b_vecs = _tf32_columns(b_b, tl.exp(b_g.to(tl.float32)) * b_q)
        b_ahi, b_alo = tf32_split(b_rk * tl.exp(b_since))
        b_dots = tl.dot(b_ahi, b_vecs, input_precision="tf32")
        b_dots = tl.dot(b_alo, b_vecs, acc=b_dots, input_precision="tf32")
        b_wb, b_wq = _column_pairs(b_dots)
    else:
        b_wb, b_wq = _column_pairs(tl.dot(b_rk, _tf32_columns(b_b, b_q), input_precision="tf32"))
        b_gj = tl.load(rec_g + i_s * P + o_p, mask=mask_p, other=0.0)
        b_wb = tl.exp(b_gprev - b_gj) * b_wb
        if READ_PRE:
            b_wq = tl.exp(b_gprev - b_gj) * b_wq
        else:
            b_wq = tl.exp(b_gnow - b_gj) * b_wq
    b_wb = tl.where(mask_p, b_wb, 0.0)
    b_wq = tl.where(mask_p, b_wq, 0.0)
    if R > 0:
        o_r = tl.arange(0, 16)
        mask_r = o_r < R
        b_ck = tl.load(comp_k + (i_s * R + o_r[:, None]) * K + o_k[None, :], mask=mask_r[:, None], other=0)
        b_cwb, b_cwq = _column_pairs(
            tl.dot(b_ck.to(tl.float32), _tf32_columns(b_yb, b_yq), input_precision="tf32")
        )
        # one fixed-point scale for records and tokens, so both products share an accumulator
        e_b = _exponent(tl.maximum(tl.max(tl.abs(b_wb)), tl.max(tl.abs(b_cwb))))
        e_q = _exponent(tl.maximum(tl.max(tl.abs(b_wq)), tl.max(tl.abs(b_cwq))))
        b_tpieces, b_pwb, b_pwq = _piece_columns(b_cwb, b_cwq, e_b, e_q)
    else:
        e_b = _exponent(tl.max(tl.abs(b_wb)))
        e_q = _exponent(tl.max(tl.abs(b_wq)))
    b_pieces, b_pwb, b_pwq = _piece_columns(b_wb, b_wq, e_b, e_q)
    e_rb = _limb_exponent(b_rb)
    e_rq = _limb_exponent(b_rq)
    if RESIDUAL == 4:  # limbs of the even and the odd keys, to meet the two nibble planes
        b_rb_even, b_rb_odd = tl.split(tl.reshape(b_rb, (K // 2, 2)))
        b_rq_even, b_rq_odd = tl.split(tl.reshape(b_rq, (K // 2, 2)))
        b_limbs_even = _limb_rows(b_rb_even, b_rq_even, e_rb, e_rq)
        b_limbs_odd = _limb_rows(b_rb_odd, b_rq_odd, e_rb, e_rq)
        b_even_offset = 8 * tl.sum(b_limbs_even.to(tl.int32), 1)  # the even plane's +8, per limb row
    else:
        b_limbs = _limb_rows(b_rb, b_rq, e_rb, e_rq)
    b_lwb, b_lwq = _limb_weights(b_rb, b_rq)
    b_kw = b_kw.to(rec_k.dtype.element_ty)  # stored precision; the output reads the record back
    b_kwq = tl.sum(b_kw.to(tl.float32) * b_q)

    # -- value rows in chunks: residual, records and tokens, each one product ----------------------------
    for v0 in tl.range(0, V, BV, num_stages=STAGES):
        o_v = v0 + o_b
        if RESIDUAL == 4:
            b_even, b_odd = _residual_nibbles(payload, i_s, o_v, K, V)
            b_acc_even = tl.dot(b_even, tl.trans(b_limbs_even), out_dtype=tl.int32)
            b_acc_odd = tl.dot(b_odd, tl.trans(b_limbs_odd), out_dtype=tl.int32)
            b_accs = _nibble_sums(b_acc_even, b_acc_odd, b_even_offset)
        else:
            b_codes = _residual_codes(payload, i_s, o_v, o_k, K, V)
            b_accs = tl.dot(b_codes, tl.trans(b_limbs), out_dtype=tl.int32).to(tl.float32)  # [BV, 16]
        b_ru = tl.load(rec_u + (i_s * P + o_p[:, None]) * V + o_v[None, :], mask=mask_p[:, None], other=0)
        b_accr = tl.dot(tl.trans(b_ru), b_pieces)  # [BV, 16] fp32
        if R > 0:
            p_cu = comp_u + (i_s * R + o_r[:, None]) * V + o_v[None, :]
            b_cu = tl.load(p_cu, mask=mask_r[:, None], other=0)
            b_accr = tl.dot(tl.trans(b_cu), b_tpieces, acc=b_accr)
        b_scale = tl.load(scale_v + i_s * V + o_v)
        b_readb = b_scale * tl.sum(b_accs * b_lwb[None, :], 1) + tl.sum(b_accr * b_pwb[None, :], 1)
        b_readq = b_scale * tl.sum(b_accs * b_lwq[None, :], 1) + tl.sum(b_accr * b_pwq[None, :], 1)
        p_ru = rec_u + (i_s * P + i_pos) * V + o_v
        b_u = (tl.load(v + i_nh * V + o_v).to(tl.float32) - b_readb).to(p_ru.dtype.element_ty)
        if READ_PRE:
            b_o = b_readq
        else:
            b_o = b_readq + b_u.to(tl.float32) * b_kwq
        tl.store(p_o + o_v, b_o.to(p_o.dtype.element_ty))
        tl.store(p_ru, b_u)
    tl.store(rec_k + (i_s * P + i_pos) * K + o_k, b_kw)
    if VECTOR_DECAY:
        tl.store(rec_g + (i_s * P + i_pos) * K + o_k, b_g)
    else:
        tl.store(rec_g + i_s * P + i_pos, b_gnow)
    if ADVANCE:
        if i_pos + 1 < P:
            tl.store(pos + i_s, i_pos + 1)
        else:
            tl.store(close_list + tl.atomic_add(close_count, 1), i_s)
