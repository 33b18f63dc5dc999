"""Row-parallel window closes: the alternative to ``close_kernel`` selected by ``LaunchConfig(close="rows")``.

``close_kernel`` closes each head in one program that walks a 64 KB scratch tile four times, one program
per SM (240 registers): on the H200 it is latency-bound (BENCHMARKS.md).  Here every closing head is split
into ``V / BV`` value-row chunks that run as independent work items of five short persistent launches:

1. ``fit``:    rebuild the chunk's rows of ``S``; partial ``z = U_prev^T S_rows`` per chunk;
2. ``orth``:   per head, sum the partials in a fixed order and orthonormalise: the new keys ``Q``;
3. ``resid``:  rebuild the rows again; the rows' token values ``U = Q S_rows^T`` (fp16) and the residual's
               per-key column sums of ``|R|``, per chunk;
4. ``quant``:  rebuild the rows again, subtract the tokens, smooth with ``c = sqrt(sum / V)`` and quantize the
               rows into the pool (each chunk reads and then writes only its own rows);
5. ``commit``: per head, write the new smoothing scales and tokens (read by every chunk until now) and reset
               the position.

Partials go to per-chunk slots and are summed in a fixed order, so results do not depend on scheduling.
Workspace is sized by the heads that can close in one step (``N * HV``): ``(NC * R + R) * K`` fp32,
``R * V`` fp16 and ``NC * K`` fp32 per head, about 8 KB at r=4, K=V=128 and two chunks.
Rebuilding rows three times re-reads ~8 KB per chunk from L2 instead of keeping 64 KB live per head.  One
power iteration per boundary only (``+itN`` with N > 1 uses ``close_kernel``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fused_recurrent import _boundary_rows, _orthonormalize_rows, _start_basis, _store_rows, _usable

__all__ = ["close_rows_commit", "close_rows_fit", "close_rows_orth", "close_rows_quant", "close_rows_resid"]


@triton.jit
def close_rows_fit(
    close_list, close_count, zpart, payload, scale_v, smooth, comp_k, comp_u, rec_g, rec_k, rec_u,
    K: tl.constexpr, V: tl.constexpr, P: tl.constexpr, R: tl.constexpr, BV: tl.constexpr, BP: tl.constexpr,
    BR: tl.constexpr, RESIDUAL: tl.constexpr, SMOOTH: tl.constexpr, VECTOR_DECAY: tl.constexpr,
    DOT: tl.constexpr,
):  # fmt: skip
    """Work item ``w = idx * NC + c``: ``zpart[idx, c] = U_prev^T S`` over the value rows of chunk ``c``."""
    NC: tl.constexpr = V // BV
    o_k = tl.arange(0, K)
    o_r = tl.arange(0, BR)
    count = tl.load(close_count)
    for w in range(tl.program_id(0), count * NC, tl.num_programs(0)):
        idx, c = w // NC, w % NC
        i_s = tl.load(close_list + idx).to(tl.int64)
        o_v = c * BV + tl.arange(0, BV)
        b_rows = _boundary_rows(
            i_s, o_v, o_k, P, payload, scale_v, smooth, comp_k, comp_u, rec_g, rec_k, rec_u,
            K, V, P, R, BP, BR, RESIDUAL, SMOOTH, VECTOR_DECAY, DOT,
        )  # fmt: skip
        b_usable = _usable(i_s, comp_u, True, V, R, BV, BR)
        b_basis = _start_basis(i_s, o_r, o_v, comp_u, b_usable, True, V, R)
        b_z = tl.dot(b_basis, b_rows, input_precision=DOT)
        tl.store(zpart + ((idx * NC + c) * R + o_r[:, None]) * K + o_k[None, :], b_z, mask=(o_r < R)[:, None])


@triton.jit
def close_rows_orth(
    close_count, zpart, qbuf, K: tl.constexpr, V: tl.constexpr, R: tl.constexpr, BV: tl.constexpr,
    BR: tl.constexpr,
):  # fmt: skip
    """Per head: ``Q = orth(sum_c zpart[idx, c])`` into ``qbuf[idx]``."""
    NC: tl.constexpr = V // BV
    o_k = tl.arange(0, K)
    o_r = tl.arange(0, BR)
    count = tl.load(close_count)
    for idx in range(tl.program_id(0), count, tl.num_programs(0)):
        b_z = tl.zeros([BR, K], dtype=tl.float32)
        for c in range(NC):
            p_z = zpart + ((idx * NC + c) * R + o_r[:, None]) * K + o_k[None, :]
            b_z += tl.load(p_z, mask=(o_r < R)[:, None], other=0.0)
        b_q = _orthonormalize_rows(b_z, o_r, R)
        tl.store(qbuf + (idx * R + o_r[:, None]) * K + o_k[None, :], b_q, mask=(o_r < R)[:, None])


@triton.jit
def close_rows_resid(
    close_list, close_count, qbuf, ubuf, cpart, payload, scale_v, smooth, comp_k, comp_u, rec_g, rec_k, rec_u,
    K: tl.constexpr, V: tl.constexpr, P: tl.constexpr, R: tl.constexpr, BV: tl.constexpr, BP: tl.constexpr,
    BR: tl.constexpr, RESIDUAL: tl.constexpr, SMOOTH: tl.constexpr, VECTOR_DECAY: tl.constexpr,
    DOT: tl.constexpr,
):  # fmt: skip
    """Work item (head, chunk): new token values of the chunk's rows (fp16, ``ubuf``) and the residual's
    per-key sums of ``|R|`` over those rows (``cpart``)."""
    NC: tl.constexpr = V // BV
    o_k = tl.arange(0, K)
    o_r = tl.arange(0, BR)
    count = tl.load(close_count)
    for w in range(tl.program_id(0), count * NC, tl.num_programs(0)):
        idx, c = w // NC, w % NC
        i_s = tl.load(close_list + idx).to(tl.int64)
        o_v = c * BV + tl.arange(0, BV)
        b_rows = _boundary_rows(
            i_s, o_v, o_k, P, payload, scale_v, smooth, comp_k, comp_u, rec_g, rec_k, rec_u,
            K, V, P, R, BP, BR, RESIDUAL, SMOOTH, VECTOR_DECAY, DOT,
        )  # fmt: skip
        if R > 0:
            b_q = tl.load(
                qbuf + (idx * R + o_r[:, None]) * K + o_k[None, :], mask=(o_r < R)[:, None], other=0.0
            )
            b_u16 = tl.dot(b_q, tl.trans(b_rows), input_precision=DOT).to(tl.float16)  # [BR, BV]
            tl.store(ubuf + (idx * R + o_r[:, None]) * V + o_v[None, :], b_u16, mask=(o_r < R)[:, None])
            b_u = tl.where((o_r < R)[:, None], b_u16.to(tl.float32), 0.0)
            b_rows -= tl.dot(tl.trans(b_u), b_q.to(tl.float16).to(tl.float32), input_precision=DOT)
        tl.store(cpart + (idx * NC + c) * K + o_k, tl.sum(tl.abs(b_rows), 0))


@triton.jit
def _column_sums(cpart, idx, K: tl.constexpr, NC: tl.constexpr):
    """``sum_v |R_vk|`` from the per-chunk sums, added in chunk order (deterministic)."""
    o_k = tl.arange(0, K)
    b_sum = tl.zeros([K], dtype=tl.float32)
    for c in range(NC):
        b_sum += tl.load(cpart + (idx * NC + c) * K + o_k)
    return b_sum


@triton.jit(do_not_specialize=["smooth_floor", "qmax"])
def close_rows_quant(
    close_list, close_count, qbuf, ubuf, cpart, payload, scale_v, smooth, comp_k, comp_u, rec_g, rec_k, rec_u,
    smooth_floor, qmax,
    K: tl.constexpr, V: tl.constexpr, P: tl.constexpr, R: tl.constexpr, BV: tl.constexpr, BP: tl.constexpr,
    BR: tl.constexpr, RESIDUAL: tl.constexpr, SMOOTH: tl.constexpr, VECTOR_DECAY: tl.constexpr,
    DOT: tl.constexpr,
):  # fmt: skip
    """Work item (head, chunk): the chunk's residual rows, smoothed, quantized into the pool."""
    NC: tl.constexpr = V // BV
    o_k = tl.arange(0, K)
    o_r = tl.arange(0, BR)
    count = tl.load(close_count)
    for w in range(tl.program_id(0), count * NC, tl.num_programs(0)):
        idx, c = w // NC, w % NC
        i_s = tl.load(close_list + idx).to(tl.int64)
        o_v = c * BV + tl.arange(0, BV)
        b_rows = _boundary_rows(
            i_s, o_v, o_k, P, payload, scale_v, smooth, comp_k, comp_u, rec_g, rec_k, rec_u,
            K, V, P, R, BP, BR, RESIDUAL, SMOOTH, VECTOR_DECAY, DOT,
        )  # fmt: skip
        if R > 0:
            mask_r = (o_r < R)[:, None]
            b_q16 = tl.load(qbuf + (idx * R + o_r[:, None]) * K + o_k[None, :], mask=mask_r, other=0.0)
            b_q16 = b_q16.to(tl.float16).to(tl.float32)
            b_u = tl.load(ubuf + (idx * R + o_r[:, None]) * V + o_v[None, :], mask=mask_r, other=0.0)
            b_u = b_u.to(tl.float32)
            b_rows -= tl.dot(tl.trans(b_u), b_q16, input_precision=DOT)
        if SMOOTH:
            b_c = tl.maximum(tl.sqrt(_column_sums(cpart, idx, K, NC) / V), smooth_floor)
            b_rows = tl.math.div_rn(b_rows, b_c[None, :])
        _store_rows(b_rows, payload, scale_v, i_s, o_v, qmax, K, V, BV, RESIDUAL)


@triton.jit(do_not_specialize=["smooth_floor"])
def close_rows_commit(
    close_list, close_count, qbuf, ubuf, cpart, smooth, comp_k, comp_u, pos, smooth_floor,
    K: tl.constexpr, V: tl.constexpr, R: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr,
    SMOOTH: tl.constexpr,
):  # fmt: skip
    """Per head: write what every chunk read until now (smoothing scales, tokens) and reset the position."""
    NC: tl.constexpr = V // BV
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    o_r = tl.arange(0, BR)
    mask_r = (o_r < R)[:, None]
    count = tl.load(close_count)
    for idx in range(tl.program_id(0), count, tl.num_programs(0)):
        i_s = tl.load(close_list + idx).to(tl.int64)
        if SMOOTH:
            b_c = tl.maximum(tl.sqrt(_column_sums(cpart, idx, K, NC) / V), smooth_floor)
            tl.store(smooth + i_s * K + o_k, b_c)
        if R > 0:
            b_q16 = tl.load(qbuf + (idx * R + o_r[:, None]) * K + o_k[None, :], mask=mask_r, other=0.0)
            tl.store(comp_k + (i_s * R + o_r[:, None]) * K + o_k[None, :], b_q16.to(tl.float16), mask=mask_r)
            b_u = tl.load(ubuf + (idx * R + o_r[:, None]) * V + o_v[None, :], mask=mask_r, other=0.0)
            tl.store(comp_u + (i_s * R + o_r[:, None]) * V + o_v[None, :], b_u, mask=mask_r)
        tl.store(pos + i_s, 0)
