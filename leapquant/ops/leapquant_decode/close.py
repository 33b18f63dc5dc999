"""Window close, prefill hand-off and materialization, the state streamed through registers by value rows.

A closing head's dense state ``S [V, K]`` (eq. 7, V-first) is never held whole, neither in registers nor in a
scratch tile.  It is a cheap function of what the pool already stores,

    S[v, k] = scale_v[v] * codes[v, k] * col[k]  +  sum_j vals[j, v] * keys[j, k],

where ``col`` is the smoothing scale times the decay to the window's end and the ``R + P`` rank-one terms
are the compensator tokens (``R`` rank-one updates) and the records (one small matrix product per chunk of
rows).  So every pass over the state (start the fit, ``ITERS - 1`` further iterations, smoothing sums,
quantization) rebuilds its ``[BV, K]`` chunk from the int8 codes and the fp16 records instead of reading a
64 KB fp32 copy: the head's factors ``col`` and ``keys`` are computed once, the codes and values of a chunk
are ~6 KB that stay in L1/L2.  A program then needs a ``[BV, K]`` tile of registers, not ``[V, K]``, so four
close programs share a multiprocessor (a Triton close holding the whole state in registers fit two, and was
slower; BENCHMARKS.md's tried-and-dropped list has it).

Write order: a chunk's rows of the payload, scales and token values are read only while that chunk is
rebuilt, so the last pass overwrites them chunk by chunk; the token keys and smoothing scales are read by
every chunk and are written after a barrier at the end.

The records term is a tensor-core product with one exact operand: GDN's stored fp16 keys (its decay is a
scalar per record, folded into the values) or KDA's fp16 values (its decays act on the keys), so two tf32
products of the other operand's high and low halves give fp32-level accuracy (``_tf32_split``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...methods.compensators import DROP_FRACTION
from ..common import bf16_grid, divide_by_reciprocal, e4m3_grid, page_bases, record_decays, rint
from .fused_recurrent import _residual_rows

__all__ = ["MODE_LOAD", "MODE_MATERIALIZE", "boundary_kernel", "close_kernel"]

MODE_LOAD = tl.constexpr(1)  # tl.constexpr: a jit function may read it as a global
MODE_MATERIALIZE = tl.constexpr(2)
FAST_MIN = tl.constexpr(2.0**-60)  # row scales where dividing by a reciprocal is exact (``_store_rows``)
FAST_MAX = tl.constexpr(2.0**60)
FAST_C_MIN = tl.constexpr(2.0**-30)  # and column (smoothing) scales
DROP = tl.constexpr(DROP_FRACTION)  # a fit column this far inside the earlier ones' span becomes zero


@triton.jit
def _start_vectors(o_r, o_v):
    """The +-1 hash of :func:`leapquant.methods.compensators.start_vectors`, ``[BR, BV]``, in uint32 (the
    reference's ``& 0xFFFFFFFF`` is the wrap of a 32-bit multiply; half the registers of int64)."""
    j = o_v.to(tl.uint32)[None, :]
    h = o_r.to(tl.uint32)[:, None]
    x = j * 0x9E3779B1 + (h + 1) * 0x85EBCA77
    x = (x ^ (x >> 15)) * 0x2C1B3C6D
    x = x ^ (x >> 12)
    return tl.where((x & 1) == 1, 1.0, -1.0)


@triton.jit
def _orthonormalize_rows(b_z, o_r, R: tl.constexpr):
    """Gram-Schmidt on the first ``R`` rows of ``[BR, K]`` (classical, twice: as stable as modified); a row
    left with less than ``DROP`` of its norm becomes zero, as in ``methods.compensators.orthonormalize``."""
    b_q = tl.zeros_like(b_z)
    for h in range(R):
        b_row = tl.sum(tl.where(o_r[:, None] == h, b_z, 0.0), 0)
        b_before = tl.sqrt(tl.sum(b_row * b_row))
        b_coef = tl.sum(b_q * b_row[None, :], 1)
        b_row = b_row - tl.sum(b_coef[:, None] * b_q, 0)
        b_coef = tl.sum(b_q * b_row[None, :], 1)
        b_row = b_row - tl.sum(b_coef[:, None] * b_q, 0)
        b_norm = tl.sqrt(tl.sum(b_row * b_row))
        b_keep = (b_norm > 1e-30) & (b_norm > DROP * b_before)
        b_row = tl.where(b_keep, b_row / tl.maximum(b_norm, 1e-30), 0.0)
        b_q = tl.where(o_r[:, None] == h, b_row[None, :], b_q)
    return b_q


@triton.jit
def _exact_scales(b_x, qmax):
    """Per-value-channel scales of ``[BV, K]`` rows, ``max |row| / qmax`` (``qmax`` a runtime value: a
    constant divisor gets folded into a reciprocal multiply, not the correctly rounded quotient the formats
    and the tests define), 1 for zero rows; and whether all of them lie in the range where dividing by a
    reciprocal (``divide_by_reciprocal``) gives the codes ``div_rn`` gives."""
    b_scale = tl.math.div_rn(tl.max(tl.abs(b_x), 1), qmax)
    b_fast = (b_scale == 0.0) | ((b_scale >= FAST_MIN) & (b_scale <= FAST_MAX))  # NaN, Inf: False
    return tl.where(b_scale == 0.0, 1.0, b_scale), tl.min(b_fast.to(tl.int32)) > 0


@triton.jit
def _store_rows(b_rows, b_c, b_rc, c_fast, payload, scale_v, i_s, o_v, qmax, K: tl.constexpr, V: tl.constexpr,
                BV: tl.constexpr, RESIDUAL: tl.constexpr, SMOOTH: tl.constexpr,
                LS: tl.constexpr):  # fmt: skip
    """Smooth (divide by ``b_c``, ``b_rc = 1 / b_c``) and quantize value rows ``o_v`` of a residual into
    the pool's payload and scales; per-value-channel symmetric scales reduce along the keys of each row.

    Both divisions go through the reciprocals where that is exact for the codes: the column scales in
    ``[2^-30, 2^60]`` (``c_fast``, once per head) and every row's scale in ``[2^-60, 2^60]`` (once per chunk).
    Then every element whose code can be non-zero (quotient >= 2^-10, the smallest e4m3 midpoint) has a
    normal dividend >= 2^-100, so its quotients are correctly rounded, the row maxima included; the rest
    stay below 2^-10 and round to zero either way.  Otherwise (tiny or huge or non-finite rows) the chunk
    is divided again with ``div_rn``.  ``LS`` (integer codes): each row's stored scale is then refitted to
    its codes, ``s <c, q> / <c, c>`` with ``q = x / s`` (``methods.scale_fit``; a row of zero codes, or a
    non-finite one, keeps its max scale).
    """
    o_k = tl.arange(0, K)
    p_rows = payload + i_s * V * K + o_v[:, None] * K + o_k[None, :]
    if RESIDUAL < 2:  # the smoothed values are stored as they are: every one must be correctly rounded
        if SMOOTH:
            b_rows = tl.math.div_rn(b_rows, b_c[None, :])
        if RESIDUAL == 0:
            tl.store(p_rows, b_rows)
        else:
            tl.store(p_rows, bf16_grid(b_rows).to(tl.bfloat16))
    else:
        b_xs = b_rows
        if SMOOTH:
            b_xs = divide_by_reciprocal(b_rows, b_c[None, :], b_rc[None, :])
        b_scale, fast = _exact_scales(b_xs, qmax)
        if fast & c_fast:
            b_rcp = tl.math.div_rn(tl.full([BV], 1.0, tl.float32), b_scale)
            b_x = divide_by_reciprocal(b_xs, b_scale[:, None], b_rcp[:, None])
        else:
            if SMOOTH:  # the scales came from reciprocal quotients: recompute both exactly
                b_xs = tl.math.div_rn(b_rows, b_c[None, :])
                b_scale, fast = _exact_scales(b_xs, qmax)
            b_x = tl.math.div_rn(b_xs, b_scale[:, None])
        if RESIDUAL == 3:
            tl.store(scale_v + i_s * V + o_v, b_scale)
            b_x = e4m3_grid(tl.minimum(tl.maximum(b_x, -qmax), qmax))
            tl.store(p_rows, b_x.to(tl.float8e4nv))
        else:
            b_q = b_x
            b_x = tl.minimum(tl.maximum(rint(b_q), -qmax), qmax).to(tl.int32)
            if LS:  # the refit as a ratio of the quotients (|q| <= qmax): no sum can overflow
                b_cf = b_x.to(tl.float32)
                b_den = tl.sum(b_cf * b_cf, 1)
                b_ratio = tl.math.div_rn(tl.sum(b_cf * b_q, 1), tl.where(b_den > 0, b_den, 1.0))
                b_scale = tl.where((b_den > 0) & (b_ratio > 0), b_scale * b_ratio, b_scale)
            tl.store(scale_v + i_s * V + o_v, b_scale)
            if RESIDUAL == 2:
                tl.store(p_rows, b_x.to(tl.int8))
            else:
                b_lo, b_hi = tl.split(tl.reshape(b_x, (BV, K // 2, 2)))
                b_byte = ((b_lo & 0xF) | ((b_hi & 0xF) << 4)).to(tl.uint8)
                o_k2 = tl.arange(0, K // 2)
                tl.store(payload + i_s * V * (K // 2) + o_v[:, None] * (K // 2) + o_k2[None, :], b_byte)


@triton.jit
def _usable(i_s, comp_u, WARM: tl.constexpr, V: tl.constexpr, R: tl.constexpr, BV: tl.constexpr,
            BR: tl.constexpr):  # fmt: skip
    """Which previous value vectors can warm-start the fit (non-zero), ``[BR]`` bool."""
    o_r = tl.arange(0, BR)
    b_norm = tl.zeros([BR], dtype=tl.float32)
    if WARM:
        o_b = tl.arange(0, BV)
        for v0 in tl.range(0, V, BV):
            b_u = tl.load(
                comp_u + (i_s * R + o_r[:, None]) * V + v0 + o_b[None, :], mask=(o_r < R)[:, None], other=0
            )
            b_norm += tl.sum(b_u.to(tl.float32) * b_u.to(tl.float32), 1)
    return tl.sqrt(b_norm) > 1e-30


@triton.jit
def _row(b_x, o_r, r):
    """Row ``r`` of a small ``[BR, D]`` register tile, ``[D]``."""
    return tl.sum(tl.where(o_r[:, None] == r, b_x, 0.0), 0)


@triton.jit
def _tf32_split(x):
    """``x = hi + lo`` with ``hi`` exact in tf32 (low 13 mantissa bits cleared): two tf32 products against
    an exact operand give fp32-level accuracy, where ``tf32x3`` needs three and splits both operands."""
    hi = (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def _window_factors(
    i_s, count, smooth, rec_g, rec_k, K: tl.constexpr, P: tl.constexpr, BP: tl.constexpr,
    SMOOTH: tl.constexpr, VECTOR_DECAY: tl.constexpr, REC16: tl.constexpr,
):  # fmt: skip
    """The head's factors of the state after ``count`` records (loop invariants of every pass):

    * ``end [K]``: the decay to the window's end (applied to the tokens), ``col = c * end [K]``;
    * ``w [BP]``, ``keys_hi/keys_lo [BP, K]``: record ``j`` adds ``w_j u_j k_j^T``.  GDN's decay is a scalar
      per record, so it goes into ``w`` and the keys stay the stored fp16 ones (exact in tf32: ``keys_hi``
      is the key and ``keys_lo`` unused); KDA's decays act on key channels, so its keys carry them, split
      as ``k_j = keys_hi + keys_lo`` (fp32 records: ``keys_hi`` unsplit).  Zero rows beyond ``count``.
    """
    o_k = tl.arange(0, K)
    o_p = tl.arange(0, BP)
    mask_p = o_p < count
    b_keys = tl.load(rec_k + (i_s * P + o_p[:, None]) * K + o_k[None, :], mask=mask_p[:, None], other=0)
    b_keys = b_keys.to(tl.float32)
    if VECTOR_DECAY:  # each record's own decays (pool.py), summed
        b_gend, b_since = record_decays(rec_g, i_s, count, K, P, BP)
        b_keys = tl.where(mask_p[:, None], b_keys * tl.exp(b_since), 0.0)
        b_end = tl.exp(b_gend)
        b_w = tl.where(mask_p, 1.0, 0.0)
    else:  # running sums
        b_gend = tl.load(rec_g + i_s * P + count - 1, mask=count > 0, other=0.0)
        b_gj = tl.load(rec_g + i_s * P + o_p, mask=mask_p, other=0.0)
        b_end = tl.exp(b_gend) + tl.zeros([K], dtype=tl.float32)
        b_w = tl.where(mask_p, tl.exp(b_gend - b_gj), 0.0)
    if VECTOR_DECAY and REC16:
        b_khi, b_klo = _tf32_split(b_keys)
    else:
        b_khi, b_klo = b_keys, b_keys
    if SMOOTH:
        b_col = tl.load(smooth + i_s * K + o_k) * b_end
    else:
        b_col = b_end
    return b_end, b_col, b_w, b_khi, b_klo


@triton.jit
def _records_term(b_vals, b_w, b_khi, b_klo, VECTOR_DECAY: tl.constexpr, REC16: tl.constexpr):
    """``sum_j w_j u_j k_j^T`` of a chunk, ``[BV, K]``, from the values ``[BP, BV]`` of its rows."""
    b_a = tl.trans(b_vals.to(tl.float32) * b_w[:, None])
    if not REC16:  # fp32 records: neither operand is exact in tf32
        return tl.dot(b_a, b_khi, input_precision="tf32x3")
    elif VECTOR_DECAY:  # fp16 values (exact) against the split decayed keys
        return tl.dot(b_a, b_klo, acc=tl.dot(b_a, b_khi, input_precision="tf32"), input_precision="tf32")
    else:  # the split weighted values against the fp16 keys (exact)
        b_ahi, b_alo = _tf32_split(b_a)
        return tl.dot(b_alo, b_khi, acc=tl.dot(b_ahi, b_khi, input_precision="tf32"), input_precision="tf32")


@triton.jit
def _rows(
    i_s, o_v, p_dense, b_end, b_col, b_w, b_khi, b_klo, count, payload, scale_v, comp_k, comp_u, rec_u,
    K: tl.constexpr, V: tl.constexpr, P: tl.constexpr, R: tl.constexpr, BP: tl.constexpr,
    RESIDUAL: tl.constexpr, DENSE: tl.constexpr, DENSE_KV: tl.constexpr, VECTOR_DECAY: tl.constexpr,
    REC16: tl.constexpr,
):  # fmt: skip
    """Rows ``o_v`` of the state, ``[BV, K]`` fp32: read from ``p_dense`` (``DENSE``: a prefill state,
    ``[K, V]`` when ``DENSE_KV``) or rebuilt from the pool through the head's factors."""
    o_k = tl.arange(0, K)
    if DENSE:
        if DENSE_KV:
            return tl.load(p_dense + o_k[None, :] * V + o_v[:, None])
        else:
            return tl.load(p_dense + o_v[:, None] * K + o_k[None, :])
    else:
        b_s = _residual_rows(payload, i_s, o_v, o_k, K, V, RESIDUAL)
        if RESIDUAL >= 2:
            b_s = b_s * tl.load(scale_v + i_s * V + o_v)[:, None]
        b_s = b_s * b_col[None, :]
        for r in range(R):  # tokens: R rank-one updates (identity decay, before the first record)
            b_tk = tl.load(comp_k + (i_s * R + r) * K + o_k).to(tl.float32) * b_end
            b_tu = tl.load(comp_u + (i_s * R + r) * V + o_v).to(tl.float32)
            b_s += b_tu[:, None] * b_tk[None, :]
        o_p = tl.arange(0, BP)
        p_vals = rec_u + (i_s * P + o_p[:, None]) * V + o_v[None, :]
        b_vals = tl.load(p_vals, mask=(o_p < count)[:, None], other=0)
        return b_s + _records_term(b_vals, b_w, b_khi, b_klo, VECTOR_DECAY, REC16)


@triton.jit
def _start_value(
    i_s, r, o_v, comp_u, b_usable, b_hashed, o_r, WARM: tl.constexpr, V: tl.constexpr, R: tl.constexpr
):
    """Starting value vector ``r`` of the fit on rows ``o_v``, ``[BV]``: the previous token's values, or row
    ``r`` of the chunk's hashed +-1 vectors ``b_hashed [BR, BV]`` where that token is zero (or absent)."""
    b_hash = _row(b_hashed, o_r, r)
    if WARM:
        b_old = tl.load(comp_u + (i_s * R + r) * V + o_v).to(tl.float32)
        usable = tl.sum(tl.where(o_r == r, b_usable.to(tl.int32), 0)) > 0
        return tl.where(usable, b_old, b_hash)
    else:
        return b_hash


@triton.jit
def _minus_tokens(b_rows, b_qk, o_r, o_v, p_u, R: tl.constexpr, V: tl.constexpr, STORE: tl.constexpr,
                  LOAD: tl.constexpr):  # fmt: skip
    """``S - U16 Q16^T`` on a chunk: token ``r``'s values ``U_r = S Q_r`` (from the unmodified rows, fp16)
    times its fp16 key, subtracted.  ``STORE`` writes ``U_r`` to ``p_u + r V + o_v``; ``LOAD`` reads it from
    there instead of computing it (an earlier pass stored it from the same rows: bit for bit the same
    values, and no reductions).  Each value vector stays in the rows' own layout: no small tiles to
    assemble or take apart."""
    b_res = b_rows
    for r in tl.static_range(R):
        b_q = _row(b_qk, o_r, r)
        if LOAD:
            b_cu16 = tl.load(p_u + r * V + o_v)
        else:
            b_cu16 = tl.sum(b_rows * b_q[None, :], 1).to(tl.float16)
        b_res -= b_cu16.to(tl.float32)[:, None] * b_q.to(tl.float16).to(tl.float32)[None, :]
        if STORE:
            tl.store(p_u + r * V + o_v, b_cu16)
    return b_res


@triton.jit
def _requantize(
    i_s, p_dense, b_end, b_col, b_w, b_khi, b_klo, count, payload, scale_v, smooth, comp_k, comp_u, rec_u,
    p_tok, smooth_floor, qmax, K: tl.constexpr, V: tl.constexpr, P: tl.constexpr, R: tl.constexpr,
    BV: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr, ITERS: tl.constexpr, RESIDUAL: tl.constexpr,
    SMOOTH: tl.constexpr, DENSE: tl.constexpr, DENSE_KV: tl.constexpr, WARM: tl.constexpr,
    VECTOR_DECAY: tl.constexpr, REC16: tl.constexpr, TOKEN_SCRATCH: tl.constexpr, LS: tl.constexpr,
):  # fmt: skip
    """Fit the tokens, smooth and quantize the state of head ``i_s`` into its own pool entries.

    Subspace iteration warm-started from the previous token values (``WARM``; hashed +-1 where zero):
    ``Q = orth(S_kv U0)``, then ``ITERS - 1`` times ``Q = orth(S_kv S_kv^T Q)``; token values
    ``U = S_kv^T Q`` from the unmodified state, both stored fp16; the residual ``S - Q16^T U16`` smoothed by
    ``c_k = sqrt(mean_v |R_vk|)`` and quantized with per-value-channel scales.  Same arithmetic as
    ``naive._compress``; sums run in other orders.  ``TOKEN_SCRATCH`` (with smoothing): the smoothing pass
    writes the token values to ``p_tok [R, V]`` fp16 and the quantization pass reads them back instead of
    computing them again.
    """
    o_k = tl.arange(0, K)
    o_b = tl.arange(0, BV)
    o_r = tl.arange(0, BR)
    mask_r = o_r < R
    b_qk = tl.zeros([BR, K], dtype=tl.float32)
    b_c = tl.zeros([K], dtype=tl.float32)
    b_rc = b_c
    c_fast = tl.full([], 1, tl.int1)  # no smoothing: no column division
    if R > 0:
        b_usable = _usable(i_s, comp_u, WARM, V, R, BV, BR)
        b_z = tl.zeros([BR, K], dtype=tl.float32)
        for v0 in tl.range(0, V, BV):
            o_v = v0 + o_b
            b_rows = _rows(
                i_s, o_v, p_dense, b_end, b_col, b_w, b_khi, b_klo, count, payload, scale_v, comp_k, comp_u,
                rec_u, K, V, P, R, BP, RESIDUAL, DENSE, DENSE_KV, VECTOR_DECAY, REC16,
            )  # fmt: skip
            b_hashed = _start_vectors(o_r, o_v)  # once per chunk, for all tokens
            for r in tl.static_range(R):
                b_start = _start_value(i_s, r, o_v, comp_u, b_usable, b_hashed, o_r, WARM, V, R)
                b_zr = tl.sum(b_rows * b_start[:, None], 0)
                b_z += tl.where(o_r[:, None] == r, b_zr[None, :], 0.0)
        b_qk = _orthonormalize_rows(b_z, o_r, R)
        for _ in range(ITERS - 1):
            b_z = tl.zeros([BR, K], dtype=tl.float32)
            for v0 in tl.range(0, V, BV):
                o_v = v0 + o_b
                b_rows = _rows(
                    i_s, o_v, p_dense, b_end, b_col, b_w, b_khi, b_klo, count, payload, scale_v, comp_k,
                    comp_u, rec_u, K, V, P, R, BP, RESIDUAL, DENSE, DENSE_KV, VECTOR_DECAY, REC16,
                )  # fmt: skip
                for r in tl.static_range(R):
                    b_u = tl.sum(b_rows * _row(b_qk, o_r, r)[None, :], 1)
                    b_zr = tl.sum(b_rows * b_u[:, None], 0)
                    b_z += tl.where(o_r[:, None] == r, b_zr[None, :], 0.0)
            b_qk = _orthonormalize_rows(b_z, o_r, R)
    if SMOOTH:
        b_csum = tl.zeros([K], dtype=tl.float32)
        for v0 in tl.range(0, V, BV):
            o_v = v0 + o_b
            b_rows = _rows(
                i_s, o_v, p_dense, b_end, b_col, b_w, b_khi, b_klo, count, payload, scale_v, comp_k, comp_u,
                rec_u, K, V, P, R, BP, RESIDUAL, DENSE, DENSE_KV, VECTOR_DECAY, REC16,
            )  # fmt: skip
            if R > 0:
                b_rows = _minus_tokens(b_rows, b_qk, o_r, o_v, p_tok, R, V, TOKEN_SCRATCH, False)
            b_csum += tl.sum(tl.abs(b_rows), 0)
        if TOKEN_SCRATCH:
            tl.debug_barrier()  # the scratch's token values, written by other threads, are read below
        b_c = tl.maximum(tl.sqrt(b_csum / V), smooth_floor)
        b_rc = tl.math.div_rn(tl.full([K], 1.0, tl.float32), b_c)
        c_fast = (tl.min(b_c) >= FAST_C_MIN) & (tl.max(b_c) <= FAST_MAX)
    for v0 in tl.range(0, V, BV):
        o_v = v0 + o_b
        b_rows = _rows(
            i_s, o_v, p_dense, b_end, b_col, b_w, b_khi, b_klo, count, payload, scale_v, comp_k, comp_u,
            rec_u, K, V, P, R, BP, RESIDUAL, DENSE, DENSE_KV, VECTOR_DECAY, REC16,
        )  # fmt: skip
        if R > 0:
            if TOKEN_SCRATCH and SMOOTH:  # the pool's values are copied after the last rebuild (below)
                b_rows = _minus_tokens(b_rows, b_qk, o_r, o_v, p_tok, R, V, False, True)
            else:
                b_rows = _minus_tokens(b_rows, b_qk, o_r, o_v, comp_u + i_s * R * V, R, V, True, False)
        _store_rows(
            b_rows, b_c, b_rc, c_fast, payload, scale_v, i_s, o_v, qmax, K, V, BV, RESIDUAL, SMOOTH, LS
        )
    tl.debug_barrier()  # every chunk has been rebuilt with the old token keys (and values, for the scratch)
    if R > 0:
        p_ck = comp_k + (i_s * R + o_r[:, None]) * K + o_k[None, :]
        tl.store(p_ck, b_qk.to(tl.float16), mask=mask_r[:, None])
        if TOKEN_SCRATCH and SMOOTH:
            o_vv = tl.arange(0, V)
            b_cu = tl.load(p_tok + o_r[:, None] * V + o_vv[None, :], mask=mask_r[:, None], other=0)
            tl.store(comp_u + (i_s * R + o_r[:, None]) * V + o_vv[None, :], b_cu, mask=mask_r[:, None])
    if SMOOTH:
        tl.store(smooth + i_s * K + o_k, b_c)


@triton.jit(do_not_specialize=["smooth_floor", "qmax"])
def close_kernel(
    close_list, close_count, payload, scale_v, smooth, comp_k, comp_u, rec_g, rec_k, rec_u, pos,
    shift_payload, shift_scale, shift_smooth, shift_comp_k, shift_comp_u, shift_rec_g, shift_rec_k,
    shift_rec_u, shift_pos, smooth_floor, qmax, token_scratch,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, P: tl.constexpr, R: tl.constexpr, BV: tl.constexpr,
    BR: tl.constexpr, BP: tl.constexpr, ITERS: tl.constexpr, RESIDUAL: tl.constexpr, SMOOTH: tl.constexpr,
    VECTOR_DECAY: tl.constexpr, REC16: tl.constexpr, TOKEN_SCRATCH: tl.constexpr, PAGED: tl.constexpr,
    LS: tl.constexpr,
):  # fmt: skip
    """Persistent: program ``pid`` closes list entries ``pid, pid + grid, ...`` (heads that just filled their
    window; ``BR``: ``R`` rounded up to a power of two; ``BP``: ``P`` rounded up, at least 16);
    ``token_scratch``: ``[grid, R, V]`` fp16, one head's token values per program (``TOKEN_SCRATCH``)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    count = tl.load(close_count)
    for idx in range(pid, count, nprog):
        i_s = tl.load(close_list + idx).to(tl.int64)
        p_payload, p_scale, p_smooth, p_comp_k, p_comp_u, p_rec_g, p_rec_k, p_rec_u, p_pos = page_bases(
            i_s // HV, payload, scale_v, smooth, comp_k, comp_u, rec_g, rec_k, rec_u, pos, shift_payload,
            shift_scale, shift_smooth, shift_comp_k, shift_comp_u, shift_rec_g, shift_rec_k, shift_rec_u,
            shift_pos, PAGED,
        )  # fmt: skip
        b_end, b_col, b_w, b_khi, b_klo = _window_factors(
            i_s, P, p_smooth, p_rec_g, p_rec_k, K, P, BP, SMOOTH, VECTOR_DECAY, REC16
        )
        _requantize(
            i_s, p_payload, b_end, b_col, b_w, b_khi, b_klo, P, p_payload, p_scale, p_smooth, p_comp_k,
            p_comp_u, p_rec_u, token_scratch + pid * R * V, smooth_floor, qmax, K, V, P, R, BV, BR, BP, ITERS,
            RESIDUAL, SMOOTH, False, False, True, VECTOR_DECAY, REC16, TOKEN_SCRATCH, LS,
        )  # fmt: skip
        tl.store(p_pos + i_s, 0)
        tl.debug_barrier()  # the next head's first loads must not pass this head's last stores


@triton.jit(do_not_specialize=["smooth_floor", "qmax"])
def boundary_kernel(
    slots, dense, payload, scale_v, smooth, comp_k, comp_u, rec_g, rec_k, rec_u, pos, shift_payload,
    shift_scale, shift_smooth, shift_comp_k, shift_comp_u, shift_rec_g, shift_rec_k, shift_rec_u, shift_pos,
    smooth_floor, qmax, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, P: tl.constexpr, R: tl.constexpr,
    BV: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr, MODE: tl.constexpr, DENSE_KV: tl.constexpr,
    ITERS: tl.constexpr, RESIDUAL: tl.constexpr, SMOOTH: tl.constexpr, VECTOR_DECAY: tl.constexpr,
    REC16: tl.constexpr, PAGED: tl.constexpr, LS: tl.constexpr,
):  # fmt: skip
    """One program per (sequence, head): ``MODE_LOAD`` quantizes ``dense`` into the slot with a cold-started
    fit; ``MODE_MATERIALIZE`` writes the slot's dense state at its current position into ``dense``."""
    i_nh = tl.program_id(0)
    i_n, i_hv = i_nh // HV, i_nh % HV
    o_k = tl.arange(0, K)
    o_b = tl.arange(0, BV)
    p_dense = dense + i_nh.to(tl.int64) * K * V
    slot = tl.load(slots + i_n).to(tl.int64)
    if slot < 0:
        if MODE == MODE_MATERIALIZE:
            for v0 in tl.range(0, V, BV):
                o_v = v0 + o_b
                tl.store(p_dense + o_v[:, None] * K + o_k[None, :], tl.zeros([BV, K], dtype=tl.float32))
        return
    i_s = slot * HV + i_hv
    payload, scale_v, smooth, comp_k, comp_u, rec_g, rec_k, rec_u, pos = page_bases(
        slot, payload, scale_v, smooth, comp_k, comp_u, rec_g, rec_k, rec_u, pos, shift_payload, shift_scale,
        shift_smooth, shift_comp_k, shift_comp_u, shift_rec_g, shift_rec_k, shift_rec_u, shift_pos, PAGED,
    )  # fmt: skip
    if MODE == MODE_LOAD:
        b_0 = tl.zeros([K], dtype=tl.float32)  # no factors: rows come from the dense state
        _requantize(
            i_s, p_dense, b_0, b_0, b_0, b_0, b_0, 0, payload, scale_v, smooth, comp_k, comp_u, rec_u,
            comp_u, smooth_floor, qmax, K, V, P, R, BV, BR, BP, ITERS, RESIDUAL, SMOOTH, True, DENSE_KV,
            False, VECTOR_DECAY, REC16, False, LS,
        )  # fmt: skip
        tl.store(pos + i_s, 0)
    else:
        count = tl.load(pos + i_s)
        b_end, b_col, b_w, b_khi, b_klo = _window_factors(
            i_s, count, smooth, rec_g, rec_k, K, P, BP, SMOOTH, VECTOR_DECAY, REC16
        )
        for v0 in tl.range(0, V, BV):
            o_v = v0 + o_b
            b_rows = _rows(
                i_s, o_v, p_dense, b_end, b_col, b_w, b_khi, b_klo, count, payload, scale_v, comp_k, comp_u,
                rec_u, K, V, P, R, BP, RESIDUAL, False, False, VECTOR_DECAY, REC16,
            )  # fmt: skip
            if DENSE_KV:
                tl.store(p_dense + o_k[None, :] * V + o_v[:, None], b_rows)
            else:
                tl.store(p_dense + o_v[:, None] * K + o_k[None, :], b_rows)
