"""The state-format interface every storage format (and every baseline codec) implements.

Layout convention.  A state is a tensor ``[..., d_k, d_v]`` in the paper's orientation (``S`` with key rows
and value columns; leading dimensions are independent heads).  Granularities name state axes:

* ``tensor``: one scale per head state;
* ``row``: one scale per key row (reduced over the value axis);
* ``col``: one scale per value column (reduced over the key axis), LeapQuant's residual granularity;
* a group size ``G``: one scale per ``G`` consecutive key entries of a value column.

Blocks of the MX and NVFP formats run along the key axis like groups do, which is the contiguous axis of the
V-first ``[d_v, d_k]`` layout serving engines use, so a kernel reads each block with one vector load.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from ..errors import LeapQuantError

__all__ = [
    "Granularity",
    "QuantizedState",
    "StateFormat",
    "amax_blocks",
    "expand_blocks",
    "parse_granularity",
    "to_blocks",
]

Granularity = str | int  # "tensor" | "row" | "col" | group size along the key axis


@dataclass(frozen=True)
class QuantizedState:
    """A quantized state: the format's name, the original shape and its named parts (codes and scales)."""

    format: str
    shape: torch.Size
    parts: dict[str, torch.Tensor] = field(default_factory=dict)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.parts[key]


class StateFormat(ABC):
    """A way to store a ``[..., d_k, d_v]`` state.

    Subclasses are small frozen dataclasses.  ``quantize`` returns the stored representation,
    ``_dequantize`` inverts it in float32 or float64 (``dequantize`` checks the dtype and casts),
    ``bits_per_element`` is the exact storage cost including every scale.
    """

    name: str
    lossless: bool = False

    @abstractmethod
    def quantize(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> QuantizedState:
        """Quantize a float32/float64 state ``[..., d_k, d_v]``."""

    def dequantize(self, q: QuantizedState, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Inverse of :meth:`quantize`, returning ``dtype`` (any floating-point dtype).

        Codes and scales are decoded in float64 for a float64 result and in float32 otherwise, then cast:
        a scale of 2^-30 is exact in float32 but zero in float16, so a narrow ``dtype`` rounds only the
        values, once.
        """
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise LeapQuantError(f"{self.name}: dequantize needs a floating-point dtype, got {dtype}")
        work = torch.float64 if dtype == torch.float64 else torch.float32
        return self._dequantize(q, work).to(dtype)

    @abstractmethod
    def _dequantize(self, q: QuantizedState, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`dequantize` in ``dtype``, float32 or float64."""

    @abstractmethod
    def bits_per_element(self, d_k: int, d_v: int) -> float:
        """Exact storage bits per state element for one ``d_k x d_v`` head, metadata included."""

    def bytes_per_element(self, d_k: int, d_v: int) -> float:
        return self.bits_per_element(d_k, d_v) / 8

    def fake_quantize(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """``dequantize(quantize(x))`` in ``x``'s dtype; formats override it with a faster equivalent."""
        return self.dequantize(self.quantize(x, generator=generator), dtype=x.dtype)

    def _check(self, x: torch.Tensor) -> None:
        if x.ndim < 2:
            raise LeapQuantError(f"{self.name}: a state needs shape [..., d_k, d_v], got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise LeapQuantError(f"{self.name}: a state must be a float tensor, got {x.dtype}")


def parse_granularity(text: str) -> Granularity:
    """``tensor``/``row``/``col`` or ``gG`` (a group of G key entries), as written in format names."""
    if text in ("tensor", "row", "col"):
        return text
    if text.startswith("g") and text[1:].isdigit() and int(text[1:]) > 0:
        return int(text[1:])
    raise LeapQuantError(f"unknown granularity {text!r}: use tensor, row, col or gG (e.g. g32)")


def amax_blocks(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """Max |x| over each scale's elements, shaped to broadcast against ``x`` after :func:`expand_blocks`.

    For ``tensor``/``row``/``col`` the result broadcasts against ``x`` directly.  For a group size ``G``
    it has shape ``[..., ceil(d_k / G), 1, d_v]`` (key axis split into blocks; a short last block is padded
    with zeros, which never raise a maximum); :func:`expand_blocks` spreads it back over ``[..., d_k, d_v]``.
    """
    ax = x.abs()
    if granularity == "tensor":
        return ax.amax(dim=(-2, -1), keepdim=True)
    if granularity == "row":
        return ax.amax(dim=-1, keepdim=True)
    if granularity == "col":
        return ax.amax(dim=-2, keepdim=True)
    return to_blocks(ax, int(granularity)).amax(dim=-2, keepdim=True)


def to_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``[..., d_k, d_v]`` to ``[..., ceil(d_k/block), block, d_v]``, zero-padding the key axis."""
    d_k = x.shape[-2]
    n = math.ceil(d_k / block)
    pad = n * block - d_k
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    return x.reshape(*x.shape[:-2], n, block, x.shape[-1])


def expand_blocks(scale: torch.Tensor, block: int, d_k: int) -> torch.Tensor:
    """Per-block scales ``[..., n_blocks, 1, d_v]`` to per-element ``[..., d_k, d_v]``."""
    n, d_v = scale.shape[-3], scale.shape[-1]
    rep = scale.expand(*scale.shape[:-3], n, block, d_v)
    return rep.reshape(*scale.shape[:-3], n * block, d_v)[..., :d_k, :]
