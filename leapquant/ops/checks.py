"""Checks and dispatch both decode ops share: which backend runs, and the shapes of a step's inputs."""

from __future__ import annotations

import os

import torch

from ..errors import LeapQuantError

__all__ = [
    "BACKENDS",
    "cdiv",
    "check_kernel_head_dims",
    "check_slots",
    "check_step_inputs",
    "check_token",
    "pow2",
    "triton_cannot_run_on",
    "untileable_head_dims",
    "use_triton",
]

BACKENDS = ("auto", "triton", "reference")


def use_triton(device: torch.device, backend: str) -> bool:
    """Whether the Triton kernels run for a pool on ``device``: ``backend="auto"`` picks them on a GPU or
    under ``TRITON_INTERPRET=1``, the torch reference otherwise; ``"triton"`` raises where they cannot run
    (:func:`triton_cannot_run_on`)."""
    if backend not in BACKENDS:
        raise LeapQuantError(f"unknown backend {backend!r}: use {', '.join(BACKENDS)}")
    if backend == "auto":
        return triton_cannot_run_on(device) is None
    if backend == "triton" and (problem := triton_cannot_run_on(device)) is not None:
        raise LeapQuantError(f"backend 'triton': {problem}")
    return backend == "triton"


def triton_cannot_run_on(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on tensors on ``device`` (``None``: they can): compiled kernels
    take CUDA tensors only, and CPU tensors need the interpreter, which Triton reads from
    ``TRITON_INTERPRET`` when each kernel is defined, i.e. when leapquant's kernel modules are first
    imported (``tests/conftest.py`` sets it on machines without a GPU; ``simulate --backend triton`` before
    any import)."""
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return (
        f"the kernels take CUDA tensors, these are on {device}: move the model or pool to a GPU, start "
        "Python with TRITON_INTERPRET=1 (the CPU interpreter: slow), or use backend 'reference'"
    )


def pow2(n: int, floor: int = 1) -> int:
    """The smallest power of two ``>= n`` (and ``>= floor``): Triton block shapes."""
    return max(floor, 1 << max(0, (n - 1).bit_length()))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_token(device: torch.device, name: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    """``x`` is a float tensor of ``shape`` on ``device`` (else a :class:`LeapQuantError` naming ``name``)."""
    if tuple(x.shape) != shape:
        raise LeapQuantError(f"{name} has shape {tuple(x.shape)}, expected {shape}")
    if x.device != device:
        raise LeapQuantError(f"{name} is on {x.device}, the pool on {device}")
    if not x.is_floating_point():
        raise LeapQuantError(f"{name} must be a float tensor, got {x.dtype}")


def check_slots(
    slots: torch.Tensor, n_slots: int, device: torch.device, *, allow_padding: bool = True
) -> None:
    """``slots`` index a pool of ``n_slots`` on ``device``: 1-D int32/int64, in range, no slot twice (-1 is
    padding if allowed).  The kernels write every slot they are given in place, so a bad index would touch
    a slot (or memory) the caller never named.  Reads the values: synchronizes with the GPU."""
    if slots.ndim != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise LeapQuantError(
            f"slots must be a 1-D int32/int64 tensor, got {slots.dtype} {tuple(slots.shape)}"
        )
    if slots.device != device:
        raise LeapQuantError(f"slots are on {slots.device}, the pool on {device}")
    lo = -1 if allow_padding else 0
    if slots.numel() and (int(slots.min()) < lo or int(slots.max()) >= n_slots):
        raise LeapQuantError(f"slots must be in [{lo}, {n_slots}), got {slots.tolist()[:16]}")
    real = slots[slots >= 0]
    if real.numel() != real.unique().numel():
        raise LeapQuantError("slots: a slot appears twice in one batch")


def check_step_inputs(
    device: torch.device,
    n: int,
    heads: int,
    d_k: int,
    d_v: int,
    vector_decay: bool,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
) -> None:
    """One decode token's inputs for ``n`` rows of a pool of ``heads`` value heads of ``d_k x d_v``:
    ``q``/``k`` ``[N, H, K]`` with H dividing HV, ``v`` ``[N, HV, V]``, ``g`` ``[N, HV]`` (scalar decay) or
    ``[N, HV, K]`` (vector decay), ``beta`` ``[N, HV]``, ``A_log`` ``[HV]``, ``dt_bias`` ``[HV]`` (scalar) or
    ``HV*K`` values (vector).  The kernels read these by offset, unchecked: a wrong shape would read past
    a tensor's end instead of failing."""
    if q.ndim != 3 or q.shape[0] != n or q.shape[2] != d_k or q.shape[1] == 0 or heads % q.shape[1]:
        raise LeapQuantError(
            f"q has shape {tuple(q.shape)}, expected [N={n}, H, K={d_k}], H dividing HV={heads}"
        )
    check_token(device, "q", q, tuple(q.shape))
    check_token(device, "k", k, tuple(q.shape))
    check_token(device, "v", v, (n, heads, d_v))
    check_token(device, "g", g, (n, heads, d_k) if vector_decay else (n, heads))
    check_token(device, "beta", beta, (n, heads))
    if A_log is not None:
        check_token(device, "A_log", A_log, (heads,))
    if dt_bias is not None:
        if vector_decay:  # [HV*K] as the models keep it, or [HV, K]
            if tuple(dt_bias.shape) not in ((heads * d_k,), (heads, d_k)):
                raise LeapQuantError(
                    f"dt_bias has shape {tuple(dt_bias.shape)}, expected ({heads * d_k},) or ({heads}, {d_k})"
                )
            check_token(device, "dt_bias", dt_bias, tuple(dt_bias.shape))
            if not dt_bias.is_contiguous():
                raise LeapQuantError("dt_bias must be contiguous (the kernels read it by offset)")
        else:
            check_token(device, "dt_bias", dt_bias, (heads,))
        if A_log is None:
            raise LeapQuantError("dt_bias was given without A_log: the gate is activated only with A_log")


def untileable_head_dims(d_k: int, d_v: int) -> str | None:
    """Why the Triton kernels cannot tile heads of ``d_k x d_v`` (``None``: they can): they tile whole
    heads with ``tl.arange``, which needs powers of two."""
    for name, d in (("d_k", d_k), ("d_v", d_v)):
        if d != pow2(d):
            return (
                f"{name}={d} is not a power of two, which the Triton kernels need (use backend='reference')"
            )
    return None


def check_kernel_head_dims(d_k: int, d_v: int) -> None:
    """:func:`untileable_head_dims` as an error."""
    why = untileable_head_dims(d_k, d_v)
    if why is not None:
        raise LeapQuantError(why)
