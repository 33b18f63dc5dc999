"""Checks and dispatch both decode ops share: which backend runs, and the shapes of a step's inputs."""

from __future__ import annotations

import os

import torch

from ..errors import LeapQuantError

__all__ = ["BACKENDS", "cdiv", "check_token", "pow2", "use_triton"]

BACKENDS = ("auto", "triton", "reference")


def use_triton(device: torch.device, backend: str) -> bool:
    """Whether the Triton kernels run for a pool on ``device``: ``backend="auto"`` picks them on a GPU or
    under ``TRITON_INTERPRET=1``, the torch reference otherwise."""
    if backend not in BACKENDS:
        raise LeapQuantError(f"unknown backend {backend!r}: use {', '.join(BACKENDS)}")
    if backend == "auto":
        return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    return backend == "triton"


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
