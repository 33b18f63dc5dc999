"""Window close in registers with rank-one arithmetic only (``LaunchConfig(close="rank1")``).

A first register-resident close (``close_tile_kernel``, deleted after it measured 15% slower than this one on
the H200) held a head's ``[V, K]`` fp32 state in registers but built it and fitted the tokens with
``tl.dot``: every product converted the 64 KB state into a tensor-core operand layout through shared memory
(147 KB of it), so one program fit on an SM and each SM closed its heads one after another.  Yet
nothing in the close is a real matrix product: the records and compensator tokens are ``P + R`` rank-one
updates, the power iteration and the token values are ``2R`` matrix-vector products.  Written as such
(broadcast multiply-adds and row/column reductions on the register tile), the close needs only a few KB of
shared memory for cross-warp reductions, no padding of ``R`` to 16, and several programs share an SM, so
one head's reduction latency hides behind another's arithmetic.  (Unrolling the loops over records and
tokens, so that all their loads issue at once, was measured on the H200: no faster for GDN at 8 warps,
slower for KDA, and it spills at 4 warps; the loops stay rolled.)

Same arithmetic as ``close_kernel`` (same order of the state's terms, token values
from the unmodified state, fp16 tokens subtracted); sums run in a different order, so results agree to
rounding, not bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fused_recurrent import _orthonormalize_rows, _residual_rows, _start_vectors, _store_rows

__all__ = ["close_rank1_kernel"]


@triton.jit
def _row(b_x, o_r, r):
    """Row ``r`` of a small ``[BR, D]`` register tile, ``[D]``."""
    return tl.sum(tl.where(o_r[:, None] == r, b_x, 0.0), 0)


@triton.jit(do_not_specialize=["smooth_floor", "qmax"])
def close_rank1_kernel(
    close_list, close_count, payload, scale_v, smooth, comp_k, comp_u, rec_g, rec_k, rec_u, pos,
    smooth_floor, qmax,
    K: tl.constexpr, V: tl.constexpr, P: tl.constexpr, R: tl.constexpr, BR: tl.constexpr,
    ITERS: tl.constexpr, RESIDUAL: tl.constexpr, SMOOTH: tl.constexpr, VECTOR_DECAY: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """Persistent: program ``pid`` closes entries ``pid, pid + grid, ...`` of the list (``BR``: R rounded up
    to a power of two, at least 1)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    o_r = tl.arange(0, BR)
    b_hashed = _start_vectors(o_r, o_v)  # [BR, V]: where a previous token is zero, the fit starts here
    count = tl.load(close_count)
    for idx in range(pid, count, nprog):
        i_s = tl.load(close_list + idx).to(tl.int64)
        # -- [V, K]: the state after the window (eq. 7), term by term as _boundary_rows adds them --------
        b_s = _residual_rows(payload, i_s, o_v, o_k, K, V, RESIDUAL)
        if RESIDUAL >= 2:
            b_s = b_s * tl.load(scale_v + i_s * V + o_v)[:, None]
        if SMOOTH:
            b_s = b_s * tl.load(smooth + i_s * K + o_k)[None, :]
        for r in range(R):
            b_ck = tl.load(comp_k + (i_s * R + r) * K + o_k).to(tl.float32)
            b_cu = tl.load(comp_u + (i_s * R + r) * V + o_v).to(tl.float32)
            b_s += b_cu[:, None] * b_ck[None, :]
        if VECTOR_DECAY:
            b_gend = tl.load(rec_g + (i_s * P + P - 1) * K + o_k)
            b_s = b_s * tl.exp(b_gend)[None, :]
        else:
            b_gend = tl.load(rec_g + i_s * P + P - 1)
            b_s = b_s * tl.exp(b_gend)
        for j in tl.range(0, P, num_stages=STAGES):
            b_kj = tl.load(rec_k + (i_s * P + j) * K + o_k).to(tl.float32)
            if VECTOR_DECAY:
                b_kj = b_kj * tl.exp(b_gend - tl.load(rec_g + (i_s * P + j) * K + o_k))
            else:
                b_kj = b_kj * tl.exp(b_gend - tl.load(rec_g + i_s * P + j))
            b_uj = tl.load(rec_u + (i_s * P + j) * V + o_v).to(tl.float32)
            b_s += b_uj[:, None] * b_kj[None, :]
        if R > 0:
            # -- subspace iteration warm-started from the previous value vectors (hashed +-1 where zero) --
            b_z = tl.zeros([BR, K], dtype=tl.float32)
            for r in range(R):
                b_old = tl.load(comp_u + (i_s * R + r) * V + o_v).to(tl.float32)
                b_usable = tl.sqrt(tl.sum(b_old * b_old)) > 1e-30
                b_start = tl.where(b_usable, b_old, _row(b_hashed, o_r, r))
                b_z = tl.where(o_r[:, None] == r, tl.sum(b_s * b_start[:, None], 0)[None, :], b_z)
            b_qk = _orthonormalize_rows(b_z, o_r, R)
            for _ in range(ITERS - 1):
                b_z = tl.zeros([BR, K], dtype=tl.float32)
                for r in range(R):
                    b_u = tl.sum(b_s * _row(b_qk, o_r, r)[None, :], 1)
                    b_z = tl.where(o_r[:, None] == r, tl.sum(b_s * b_u[:, None], 0)[None, :], b_z)
                b_qk = _orthonormalize_rows(b_z, o_r, R)
            # -- tokens: keys Q and values U = S Q^T from the unmodified state, both stored in fp16 -------
            b_cu = tl.zeros([BR, V], dtype=tl.float32)
            for r in range(R):
                b_q = _row(b_qk, o_r, r)
                b_cu16 = tl.sum(b_s * b_q[None, :], 1).to(tl.float16)
                tl.store(comp_k + (i_s * R + r) * K + o_k, b_q.to(tl.float16))
                tl.store(comp_u + (i_s * R + r) * V + o_v, b_cu16)
                b_cu = tl.where(o_r[:, None] == r, b_cu16.to(tl.float32)[None, :], b_cu)
            for r in range(R):
                b_ck = _row(b_qk, o_r, r).to(tl.float16).to(tl.float32)
                b_s -= _row(b_cu, o_r, r)[:, None] * b_ck[None, :]
        if SMOOTH:  # c_k = sqrt(mean_v |R_vk|), stored fp32
            b_c = tl.maximum(tl.sqrt(tl.sum(tl.abs(b_s), 0) / V), smooth_floor)
            tl.store(smooth + i_s * K + o_k, b_c)
            b_s = tl.math.div_rn(b_s, b_c[None, :])
        _store_rows(b_s, payload, scale_v, i_s, o_v, qmax, K, V, V, RESIDUAL)
        tl.store(pos + i_s, 0)
