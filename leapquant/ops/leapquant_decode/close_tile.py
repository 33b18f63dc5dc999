"""Window close with the whole state of a head in registers (``LaunchConfig(close="tile")``).

``close_kernel`` builds each closing head's state in a 64 KB scratch tile and walks it in row chunks,
three to five dependent passes per head, one head at a time per program: on the H200 that is latency, not
bandwidth (385 us for the ~1,000 heads that close per step at N=512, for ~40 MB of traffic). Here one
program holds the ``[V, K]`` fp32 state of a head across its warps, so every pass of the close (power
iteration, token values, smoothing sums, quantization) is a register-level product or reduction and the
only memory traffic is the boundary and records read once and the new boundary written once. Programs are
persistent (a few per SM, ``LaunchConfig.close_programs_per_sm``) and walk the close list.

Same arithmetic as ``close_kernel`` (same helpers, same products at ``DOT`` precision); the summation order
inside the products differs, so results agree to rounding, not bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fused_recurrent import _boundary_rows, _orthonormalize_rows, _start_basis, _store_rows, _usable

__all__ = ["close_tile_kernel"]


@triton.jit(do_not_specialize=["smooth_floor", "qmax"])
def close_tile_kernel(
    close_list, close_count, payload, scale_v, smooth, comp_k, comp_u, rec_g, rec_k, rec_u, pos,
    smooth_floor, qmax,
    K: tl.constexpr, V: tl.constexpr, P: tl.constexpr, R: tl.constexpr, BP: tl.constexpr, BR: tl.constexpr,
    ITERS: tl.constexpr, RESIDUAL: tl.constexpr, SMOOTH: tl.constexpr, VECTOR_DECAY: tl.constexpr,
    DOT: tl.constexpr,
):  # fmt: skip
    """Persistent: program ``pid`` closes entries ``pid, pid + grid, ...`` of the list, each in registers."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    o_r = tl.arange(0, BR)
    mask_r = o_r < R
    count = tl.load(close_count)
    for idx in range(pid, count, nprog):
        i_s = tl.load(close_list + idx).to(tl.int64)
        # [V, K]: the state after the window (eq. 7)
        b_s = _boundary_rows(
            i_s, o_v, o_k, P, payload, scale_v, smooth, comp_k, comp_u, rec_g, rec_k, rec_u,
            K, V, P, R, BP, BR, RESIDUAL, SMOOTH, VECTOR_DECAY, DOT,
        )  # fmt: skip
        if R > 0:
            b_usable = _usable(i_s, comp_u, True, V, R, V, BR)
            b_basis = _start_basis(i_s, o_r, o_v, comp_u, b_usable, True, V, R)  # [BR, V]
            b_qk = _orthonormalize_rows(tl.dot(b_basis, b_s, input_precision=DOT), o_r, R)
            for _ in range(ITERS - 1):
                b_u = tl.where(mask_r[:, None], tl.dot(b_qk, tl.trans(b_s), input_precision=DOT), 0.0)
                b_qk = _orthonormalize_rows(tl.dot(b_u, b_s, input_precision=DOT), o_r, R)
            b_ck16 = b_qk.to(tl.float16)
            b_cu16 = tl.dot(b_qk, tl.trans(b_s), input_precision=DOT).to(tl.float16)  # [BR, V]
            tl.store(comp_k + (i_s * R + o_r[:, None]) * K + o_k[None, :], b_ck16, mask=mask_r[:, None])
            tl.store(comp_u + (i_s * R + o_r[:, None]) * V + o_v[None, :], b_cu16, mask=mask_r[:, None])
            b_cu = tl.where(mask_r[:, None], b_cu16.to(tl.float32), 0.0)
            b_s -= tl.dot(tl.trans(b_cu), b_ck16.to(tl.float32), input_precision=DOT)
        if SMOOTH:  # c_k = sqrt(mean_v |R_vk|), stored fp32
            b_c = tl.maximum(tl.sqrt(tl.sum(tl.abs(b_s), 0) / V), smooth_floor)
            tl.store(smooth + i_s * K + o_k, b_c)
            b_s = tl.math.div_rn(b_s, b_c[None, :])
        _store_rows(b_s, payload, scale_v, i_s, o_v, qmax, K, V, V, RESIDUAL)
        tl.store(pos + i_s, 0)
