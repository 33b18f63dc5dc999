"""Kernel launches of the LeapQuant decode ops: launch shapes, the step, the window close and the boundary.

:func:`launch_step` runs one step of every head it is given (Triton ``step_kernel`` on CUDA cores or
``step_tc_kernel`` on tensor cores) and, when asked, the window closes it leads to, by the CUDA close
(``close.cu``) or the Triton close (``close.py``); :func:`launch_boundary` runs the prefill hand-off and
materialization.  Launch shapes are hand-tuned and never autotuned: every kernel updates the pool in
place, and an autotuner's trial launches would apply the update more than once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ...errors import LeapQuantError
from ..checks import check_kernel_head_dims, pow2
from ..pool import LeapQuantPool

__all__ = ["CLOSE_IMPLS", "LaunchConfig", "launch_boundary", "launch_close", "launch_step", "resolve_close",
           "tensor_core_step"]  # fmt: skip

CLOSE_IMPLS = ("auto", "cuda", "triton")


@dataclass(frozen=True)
class LaunchConfig:
    """Launch shape of the kernels (hand-tuned, never autotuned: the kernels update the pool in place).

    Attributes:
        step_bv: value rows per chunk of the step kernel (one program per head walks ``V / step_bv`` chunks).
        step_warps: warps per step program.
        step_stages: software-pipelining depth of the step kernel's loop over value chunks.
        fast_cvt: int8 -> fp32 through exponent bits (integer add + fp add) instead of the conversion unit
            (CUDA-core reads only).
        step_mma: run the step on tensor cores (``step_tc_kernel``: one program per head, whole state)
            where it applies: integer residuals (int8, int6, int4) with fp16 records, ``d_k`` a multiple of
            32 (64 for int4, two products over half the keys); the read vectors go in as exact fixed-point
            limbs, so accuracy is fp32-level.  Otherwise (and for fp8, bf16, fp32 residuals) the CUDA-core
            ``step_kernel`` with the ``step_*`` shape.
        step_tc_bv: value rows per chunk of the tensor-core step (at least 16).
        step_tc_warps: warps per tensor-core step program (one: a head's per-token work is vectors and
            small tiles that more warps would replicate, not share).
        step_tc_stages: software-pipelining depth of its loop over value chunks.
        step_tc_maxnreg: register cap per thread of the tensor-core step (``None``: the compiler's choice,
            ~200 for GDN and 255 for KDA, which limits a multiprocessor to 8-10 warps of a memory-bound
            kernel).
        close_bv: value rows per chunk of the window close (``close.py``: the state streamed through
            registers in value-row chunks, rebuilt from the pool at each pass), and of prefill hand-off and
            materialization.
        close_warps: warps per close program.
        close_programs_per_sm: persistent close programs per multiprocessor.
        overlap_close: the window closes of a step run on a side stream, beside the step of the heads that
            do not close (:func:`launch_step`); False: step, then close; ``None``: overlap with the Triton
            close only (the CUDA close fills every register file it runs on, so the step waits for SMs
            either way, and the split costs a second step launch: slower in BENCHMARKS.md's runs).
        close_maxnreg: register cap per thread of the close (``None``: the compiler's choice); a lower cap
            lets more close programs share a multiprocessor, at the price of a few spills.
        close_token_scratch: with smoothing, the close's smoothing pass keeps the token values it computes
            in a per-program scratch (``[programs, R, V]`` fp16, ``LeapQuantPool.close_scratch``) and its
            quantization pass reads them back instead of computing them again (the same values, bit for bit).
        close_impl: which window close runs on a GPU: ``"cuda"`` (``close.cu``, built by NVRTC: a head's
            state held whole in one block's registers, rebuilt once), ``"triton"`` (``close.py``: streamed
            through registers, rebuilt at each pass; the one the CPU interpreter tests) or ``"auto"``:
            CUDA where it applies (``close_cuda.unsupported``), else Triton.  The ``close_*`` shapes above
            are the Triton close's.
        close_cuda_blocks_per_sm: persistent blocks per multiprocessor of the CUDA close (256 threads of
            at most 128 registers each: two fill the register file).
    """

    step_bv: int = 32
    step_warps: int = 4
    step_stages: int = 2
    fast_cvt: bool = True
    step_mma: bool = True
    step_tc_bv: int = 64
    step_tc_warps: int = 1
    step_tc_stages: int = 2
    step_tc_maxnreg: int | None = None
    close_bv: int = 32
    close_warps: int = 4
    close_programs_per_sm: int = 4
    overlap_close: bool | None = None
    close_maxnreg: int | None = 128
    close_token_scratch: bool = True
    close_impl: str = "auto"
    close_cuda_blocks_per_sm: int = 2

    @classmethod
    def tuned(cls, decay: str, compensators: int = 4, codec: str = "int8") -> LaunchConfig:
        """The shapes ``bench kernel --tune`` picked (BENCHMARKS.md) for GDN or KDA pools with
        ``compensators`` tokens and residual ``codec`` (``PoolConfig.residual``): the close defaults for up
        to 4 tokens; with 8, three close programs per SM at 168 registers (their token tiles would spill at
        128).  Packed int4 codes: the tensor-core step prefetches both value chunks of a head (three
        stages) at 168 registers (12 warps an SM instead of 8): a chunk of nibbles is half the bytes of an
        int8 chunk, so it needs more of them in flight to keep the memory busy."""
        if decay == "scalar":
            launch = cls(step_bv=8, step_warps=1, step_stages=4)
        else:
            launch = cls(step_bv=32, step_warps=4, step_stages=4)
        if compensators > 4:
            launch = replace(launch, close_programs_per_sm=3, close_maxnreg=168)
        if codec == "int4":
            launch = replace(launch, step_tc_stages=3, step_tc_maxnreg=168)
        return launch

    def __post_init__(self) -> None:
        for name in ("step_bv", "step_warps", "step_tc_bv", "step_tc_warps", "close_bv", "close_warps"):
            x = getattr(self, name)
            if x < 1 or x & (x - 1):
                raise LeapQuantError(f"launch: {name} must be a power of two, got {x}")
        if self.step_tc_bv < 16:
            raise LeapQuantError(f"launch: step_tc_bv must be >= 16 (a tl.dot tile), got {self.step_tc_bv}")
        if self.close_bv < 16:
            raise LeapQuantError(f"launch: close_bv must be >= 16 (a tl.dot operand), got {self.close_bv}")
        for name in ("step_tc_maxnreg", "close_maxnreg"):
            x = getattr(self, name)
            if x is not None and not 32 <= x <= 255:
                raise LeapQuantError(f"launch: {name} must be in 32..255, got {x}")
        if self.close_impl not in CLOSE_IMPLS:
            raise LeapQuantError(
                f"launch: unknown close_impl {self.close_impl!r}: use {', '.join(CLOSE_IMPLS)}"
            )
        if self.close_cuda_blocks_per_sm < 1:
            raise LeapQuantError(
                f"launch: close_cuda_blocks_per_sm must be >= 1, got {self.close_cuda_blocks_per_sm}"
            )
        if self.close_programs_per_sm < 1:
            raise LeapQuantError(
                f"launch: close_programs_per_sm must be >= 1, got {self.close_programs_per_sm}"
            )


def tensor_core_step(cfg, launch: LaunchConfig) -> bool:
    """Whether the step runs on tensor cores (``step_tc_kernel``): integer residual codes, fp16 records,
    and head dims the products tile (int8 products take 32 keys at a time, at least 16 value rows; packed
    int4 codes are two products over half the keys each)."""
    return (
        launch.step_mma
        and cfg.format.integer
        and cfg.records == "fp16"
        and cfg.d_k % (32 * cfg.format.keys_per_element) == 0
        and cfg.d_v >= 16
    )


def launch_step(
    pool, slots, q, k, v, g, beta, b_read, a_log, dt_bias, qk_scale, native, l2norm, sigmoid, pre, launch,
    advance, *, close: str | None = None,
):  # fmt: skip
    """One step of every head in ``slots``; with ``close`` (``"cuda"`` or ``"triton"``, from
    :func:`resolve_close`), also the window closes it leads to, by that kernel.

    With ``launch.overlap_close`` the heads that fill their window this step (a snapshot of the window
    positions says which) step and close on a side stream while the others step on the current one: the
    close is compute-bound and the step memory-bound, so they share the GPU instead of taking turns.  The
    two step launches touch disjoint heads (one decides by the snapshot, not by positions the other
    changes), so the result is the same as one launch followed by the close.
    """
    from .fused_recurrent import (
        SUBSET_ALL,
        SUBSET_CLOSING,
        SUBSET_OTHERS,
        step_kernel,
        step_tc_kernel,
    )  # fmt: skip

    cfg = pool.config
    check_kernel_head_dims(cfg.d_k, cfg.d_v)
    n = slots.shape[0]
    out = torch.empty(n, cfg.heads, cfg.d_v, dtype=v.dtype, device=pool.device)
    t = pool.tensors
    dummy = t["pos"]
    list_, count = pool.close_list()
    overlap = launch.overlap_close
    if overlap is None:
        overlap = close != "cuda"
    split = close is not None and advance and overlap
    closing = (t["pos"] == cfg.window - 1).to(torch.int8) if split else dummy
    args = (
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
        beta.contiguous() if beta is not None else dummy,
        b_read.contiguous() if b_read is not None else dummy,
        a_log, dt_bias, out, slots,
        t["payload"], t.get("scale", dummy), t.get("smooth", dummy), t.get("comp_k", dummy),
        t.get("comp_u", dummy), t["rec_g"], t["rec_k"], t["rec_u"], t["pos"], *pool.slot_shift(), list_,
        count, closing, qk_scale,
    )  # fmt: skip
    shape = dict(
        H=q.shape[1] if native else cfg.heads, HV=cfg.heads, K=cfg.d_k, V=cfg.d_v, P=cfg.window,
        R=cfg.compensators, BP=pow2(cfg.window), NATIVE=native, USE_QK_L2NORM=l2norm, BETA_SIGMOID=sigmoid,
        RESIDUAL=cfg.format.code, SMOOTH=cfg.smoothing, READ_PRE=pre, ADVANCE=advance,
        PAGED=pool.paged,
    )  # fmt: skip
    grid = (n * cfg.heads,)

    def step(subset) -> None:
        if tensor_core_step(cfg, launch):
            step_tc_kernel[grid](
                *args, BV=min(cfg.d_v, launch.step_tc_bv), STAGES=launch.step_tc_stages, SUBSET=subset,
                num_warps=launch.step_tc_warps, maxnreg=launch.step_tc_maxnreg,
                **dict(shape, BP=pow2(cfg.window, 16)),  # a tl.dot operand
            )  # fmt: skip
        else:
            step_kernel[grid](
                *args, BV=min(cfg.d_v, launch.step_bv), BR=pow2(cfg.compensators), STAGES=launch.step_stages,
                FAST_CVT=launch.fast_cvt, SUBSET=subset, num_warps=launch.step_warps, **shape,
            )  # fmt: skip

    if not split:
        step(SUBSET_ALL)
        if close is not None:
            launch_close(pool, n, launch, close)
    elif pool.device.type != "cuda":  # the interpreter: same launches, one after the other
        step(SUBSET_CLOSING)
        launch_close(pool, n, launch, close)
        step(SUBSET_OTHERS)
    else:
        main, side = torch.cuda.current_stream(pool.device), pool.side_stream()
        side.wait_stream(main)
        if not torch.cuda.is_current_stream_capturing():  # a graph's memory stays its own until freed
            for x in args:
                if isinstance(x, torch.Tensor):
                    x.record_stream(side)  # allocated on the main stream, used on both
        with torch.cuda.stream(side):
            step(SUBSET_CLOSING)
            launch_close(pool, n, launch, close)
        step(SUBSET_OTHERS)
        main.wait_stream(side)
    return out


def close_grid(pool: LeapQuantPool, n: int, programs_per_sm: int) -> int:
    """Persistent close programs: a few per SM, never more than the heads that could close this step."""
    if pool.device.type == "cuda":
        sms = torch.cuda.get_device_properties(pool.device).multi_processor_count
    else:
        sms = 1
    return max(1, min(n * pool.config.heads, sms * programs_per_sm))


def close_args(pool: LeapQuantPool) -> tuple[tuple, dict]:
    """Pool tensors and shape constants every close-path kernel takes."""
    from ...methods.smoothing import SMOOTHING_FLOOR

    cfg = pool.config
    t = pool.tensors
    dummy = t["pos"]
    tensors = (
        t["payload"], t.get("scale", dummy), t.get("smooth", dummy), t.get("comp_k", dummy),
        t.get("comp_u", dummy), t["rec_g"], t["rec_k"], t["rec_u"], t["pos"], *pool.slot_shift(),
        SMOOTHING_FLOOR, cfg.format.qmax or 0.0,
    )  # fmt: skip
    shape = dict(HV=cfg.heads, K=cfg.d_k, V=cfg.d_v, P=cfg.window, R=cfg.compensators,
                 RESIDUAL=cfg.format.code, SMOOTH=cfg.smoothing, VECTOR_DECAY=cfg.decay == "vector",
                 PAGED=pool.paged, LS=cfg.method.least_squares_scales)  # fmt: skip
    return tensors, shape


def close_shape(pool: LeapQuantPool, launch: LaunchConfig) -> dict:
    cfg = pool.config
    return dict(BV=min(cfg.d_v, launch.close_bv), BR=pow2(cfg.compensators), BP=pow2(cfg.window, 16),
                REC16=cfg.records == "fp16", num_warps=launch.close_warps)  # fmt: skip


def resolve_close(pool: LeapQuantPool, launch: LaunchConfig) -> str:
    """The window close ``pool`` runs, ``"cuda"`` or ``"triton"`` (``launch.close_impl``), decided once per
    step, before any launch: a ``"cuda"`` that cannot run fails here, before the step changes the pool."""
    from .close_cuda import unavailable, unsupported, unsupported_layout

    if launch.close_impl == "triton":
        return "triton"
    if pool.device.type != "cuda":
        reason = "the pool is not on a GPU"
    else:
        reason = unsupported(pool.config) or unsupported_layout(pool) or unavailable()
    if launch.close_impl == "cuda" and reason is not None:
        raise LeapQuantError(f"launch: close_impl='cuda' does not apply: {reason}")
    return "triton" if reason is not None else "cuda"


def launch_close(pool: LeapQuantPool, n: int, launch: LaunchConfig, impl: str) -> None:
    """Close the windows of the heads the step kernel listed, by the ``impl`` close."""
    from .close import close_kernel

    cfg = pool.config
    if impl == "cuda":
        from .close_cuda import launch_cuda_close

        launch_cuda_close(pool, close_grid(pool, n, launch.close_cuda_blocks_per_sm))
        return
    tensors, shape = close_args(pool)
    list_, count = pool.close_list()
    grid = close_grid(pool, n, launch.close_programs_per_sm)
    scratch = launch.close_token_scratch and cfg.smoothing and cfg.compensators > 0
    close_kernel[(grid,)](
        list_, count, *tensors, pool.close_scratch(grid * cfg.compensators * cfg.d_v) if scratch else list_,
        ITERS=cfg.power_iters, TOKEN_SCRATCH=scratch, maxnreg=launch.close_maxnreg, **shape,
        **close_shape(pool, launch),
    )  # fmt: skip


def launch_boundary(pool: LeapQuantPool, slots: torch.Tensor, dense: torch.Tensor, mode: int, kv: bool):
    from .close import boundary_kernel

    cfg = pool.config
    check_kernel_head_dims(cfg.d_k, cfg.d_v)
    tensors, shape = close_args(pool)
    launch = LaunchConfig()
    boundary_kernel[(slots.shape[0] * cfg.heads,)](
        slots, dense, *tensors, MODE=mode, DENSE_KV=kv, ITERS=cfg.cold_iters, **shape,
        **close_shape(pool, launch),
    )  # fmt: skip
