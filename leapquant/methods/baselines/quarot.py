"""QuaRot (Ashkboos et al., 2024) adapted to the recurrent state: rotate both sides, then quantize per column.

QuaRot removes activation and KV-cache outliers by multiplying with randomized Hadamard matrices that the
network absorbs.  A state ``S`` (``[d_k, d_v]``) has a key side and a value side, so we rotate both:

    S' = H_k S H_v^T,    H = W_n Diag(s)

with ``W_n`` the normalized Walsh-Hadamard matrix (entries +-1/sqrt(n)) and ``s`` random +-1 signs drawn
from ``seed``.  The rotations are fixed functions of ``(dim, seed)``, regenerated on demand and never
stored, so they cost no bits.  ``S'`` is quantized with a symmetric integer grid and one fp32 scale per
value column (``col``, reduced over keys); dequantization rotates back, ``S = H_k^T S' H_v``.  The grid is
symmetric with no zero point, where QuaRot's KV cache is asymmetric (see :mod:`.kvquant` for the cost).

Dimensions that are not powers of two have no Sylvester Hadamard matrix.  QuaRot itself composes a
power-of-two Hadamard with a few hand-tabulated orders (12, 20, 28, ...); we use a seeded Haar-random
orthogonal matrix instead (QR of a Gaussian, signs fixed by ``diag(R)``), which spreads outliers at least
as well and covers every size, at the cost of a dense ``O(n^2)`` product rather than a fast transform.

This module also hosts the helpers the three baselines share (rotations, input and config checks).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...errors import LeapQuantError
from ...formats.base import QuantizedState, StateFormat
from ...formats.elements import IntElement, round_to_integers
from ...formats.scaled import FP32_MAX, fp32_scale

__all__ = ["QuaRot", "random_orthogonal", "randomized_hadamard"]

_SEED_LIMIT = 2**63


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@functools.lru_cache(maxsize=64)
def _orthogonal64(kind: str, dim: int, seed: int) -> torch.Tensor:
    """A ``[dim, dim]`` float64 CPU orthogonal matrix, the master of every dtype/device copy."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "hadamard" and _is_power_of_two(dim):
        w = torch.ones(1, 1, dtype=torch.float64)
        while w.shape[0] < dim:  # Sylvester: W_2n = [[W, W], [W, -W]]
            w = torch.cat([torch.cat([w, w], 1), torch.cat([w, -w], 1)], 0)
        signs = torch.randint(0, 2, (dim,), generator=gen).to(torch.float64) * 2 - 1
        return w / dim**0.5 * signs  # W_n @ Diag(s): scales column j by s_j
    g = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    # Without the sign fix QR's output is not Haar-distributed (it depends on LAPACK's sign convention).
    return q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0).to(torch.float64)


@functools.lru_cache(maxsize=256)
def _cached(kind: str, dim: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    return _orthogonal64(kind, dim, seed).to(device=device, dtype=dtype)


def _check_dim_seed(dim: int, seed: int) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise LeapQuantError(f"rotation dimension must be a positive int, got {dim!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _SEED_LIMIT:
        raise LeapQuantError(f"rotation seed must be an int in [0, 2^63), got {seed!r}")


def randomized_hadamard(
    dim: int,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """QuaRot's rotation ``[dim, dim]``: ``W_n Diag(s)`` for a power of two, else :func:`random_orthogonal`.

    Cached per ``(dim, dtype, device, seed)``; the returned tensor is shared, do not modify it in place.
    """
    _check_dim_seed(dim, seed)
    return _cached("hadamard", dim, dtype, torch.device(device), seed)


def random_orthogonal(
    dim: int,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A seeded Haar-random orthogonal ``[dim, dim]`` matrix (QR of a Gaussian with the sign fix); cached."""
    _check_dim_seed(dim, seed)
    return _cached("haar", dim, dtype, torch.device(device), seed)


def check_state(fmt: StateFormat, x: torch.Tensor) -> None:
    """The base shape/float checks plus the dtypes the baselines compute in (float32, float64)."""
    fmt._check(x)
    if x.dtype not in (torch.float32, torch.float64):
        raise LeapQuantError(f"{fmt.name}: a state must be float32 or float64, got {x.dtype}")


def check_parts(fmt: StateFormat, q: QuantizedState) -> None:
    if q.format != fmt.name:
        raise LeapQuantError(f"{fmt.name}: cannot dequantize a state quantized as {q.format!r}")


def check_int(owner: str, field: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise LeapQuantError(f"{owner}: {field} must be an int in [{lo}, {hi}], got {value!r}")


def check_bool(owner: str, field: str, value: object) -> None:
    if not isinstance(value, bool):
        raise LeapQuantError(f"{owner}: {field} must be a bool, got {value!r}")


def stored_scale(scale: torch.Tensor) -> torch.Tensor:
    """A scale as stored, float32: clamped to its largest finite value (a float64 state past 3.4e38 gave
    inf, then NaN); NaN where the input was not finite, so that the values it scales decode to NaN."""
    finite = fp32_scale(scale).to(torch.float32)
    return torch.where(scale.isfinite(), finite, torch.full_like(finite, float("nan")))


def safe_divisor(scale: torch.Tensor) -> torch.Tensor:
    """All-zero channels get scale 0; divide by 1 there so their codes are 0 instead of NaN."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def asymmetric_grid(
    y: torch.Tensor,
    bits: int,
    dim: int,
    stochastic: bool,
    generator: torch.Generator | None,
    covered: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Published KVQuant's and QuaRot's asymmetric grid: ``2^bits`` levels spanning each slice's min..max
    along ``dim``.  Returns the level indices (``y``'s dtype, integers in ``[0, 2^bits - 1]``) and the
    float32 ``scale = (max - min) / (2^bits - 1)`` and ``offset = min`` that :func:`asymmetric_values`
    decodes them with; the indices are computed against the stored (fp32) offset and scale, so decoding
    is exactly what quantizing saw.

    ``covered`` (bool, ``y``'s shape): the entries the range spans (KVQuant's dense part, without the
    outliers it keeps exactly); the others get indices too, clamped into the range.  A slice with no
    covered entry has offset and scale 0.  A NaN or an Inf in a slice's range makes its scale NaN, so the
    slice decodes to NaN, as the symmetric grids do.
    """
    levels = 2**bits - 1
    if covered is None:
        lo, hi = y.amin(dim, keepdim=True), y.amax(dim, keepdim=True)
    else:
        inf = torch.tensor(float("inf"), dtype=y.dtype, device=y.device)
        lo = torch.where(covered, y, inf).amin(dim, keepdim=True)
        hi = torch.where(covered, y, -inf).amax(dim, keepdim=True)
        empty = ~covered.any(dim, keepdim=True)
        lo, hi = torch.where(empty, 0.0, lo), torch.where(empty, 0.0, hi)
    offset = torch.where(lo.isfinite(), lo.clamp(-FP32_MAX, FP32_MAX), lo).to(torch.float32)
    scale = stored_scale((hi - offset.to(y.dtype)) / levels)
    shifted = (y - offset.to(y.dtype)) / safe_divisor(scale.to(y.dtype))
    grid = round_to_integers(shifted.clamp(0, levels), stochastic, generator).clamp(0, levels)
    return grid, scale, offset


def asymmetric_values(
    grid: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The values of :func:`asymmetric_grid`'s level indices: ``grid * scale + offset`` in ``dtype``."""
    return grid.to(dtype) * scale.to(dtype) + offset.to(dtype)


def encode_levels(grid: torch.Tensor) -> torch.Tensor:
    """Asymmetric level indices as stored: uint8."""
    return grid.to(torch.uint8)


@dataclass(frozen=True)
class QuaRot(StateFormat):
    """Two-sided randomized-Hadamard rotation, then ``int{bits}`` with fp32 per-column scales.

    Parts of the :class:`QuantizedState`: ``codes`` ``[..., d_k, d_v]`` of the rotated state and ``scale``
    float32 ``[..., 1, d_v]``; symmetric: int8 grid values, ``bits + 32 / d_k`` bits per element;
    ``asymmetric`` (QuaRot's own KV-cache grid): uint8 level indices over each column's min..max and an
    ``offset`` float32 ``[..., 1, d_v]`` (the column's min), ``bits + 64 / d_k`` bits per element.

    Attributes:
        bits: integer width, 2..8.
        seed: seed of the rotations' random signs (or Haar matrices); a fixed seed costs no storage.
        stochastic: stochastic rounding onto the grid (uses the ``generator`` passed to ``quantize``).
        asymmetric: ``2^bits`` levels from each column's min to its max (:func:`asymmetric_grid`) instead
            of ``2^bits - 1`` symmetric ones.
    """

    bits: int = 8
    seed: int = 0
    stochastic: bool = False
    asymmetric: bool = False

    def __post_init__(self) -> None:
        check_int("quarot", "bits", self.bits, 2, 8)
        check_int("quarot", "seed", self.seed, 0, _SEED_LIMIT - 1)
        check_bool("quarot", "stochastic", self.stochastic)
        check_bool("quarot", "asymmetric", self.asymmetric)

    @property
    def name(self) -> str:
        seed = f"-seed{self.seed}" if self.seed else ""
        return f"quarot-int{self.bits}{seed}{'-asym' if self.asymmetric else ''}"

    def bits_per_element(self, d_k: int, d_v: int) -> float:
        return self.bits + (64 if self.asymmetric else 32) / d_k

    def _rotations(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        d_k, d_v = x.shape[-2], x.shape[-1]
        return (
            randomized_hadamard(d_k, seed=self.seed, dtype=dtype, device=x.device),
            randomized_hadamard(d_v, seed=self.seed, dtype=dtype, device=x.device),
        )

    def _grid(self, x: torch.Tensor, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """Grid values of the rotated state (input dtype), the fp32 per-column scale and (asymmetric)
        offset."""
        h_k, h_v = self._rotations(x, x.dtype)
        y = h_k @ x @ h_v.T
        if self.asymmetric:
            grid, scale, offset = asymmetric_grid(y, self.bits, -2, self.stochastic, generator)
            return {"codes": grid, "scale": scale, "offset": offset}
        elem = IntElement(self.bits)
        scale = stored_scale(y.abs().amax(dim=-2, keepdim=True) / elem.max_value)
        grid = elem.round(
            y / safe_divisor(scale.to(x.dtype)), stochastic=self.stochastic, generator=generator
        )
        return {"codes": grid, "scale": scale}

    def _unrotate(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The state from grid values (``parts["codes"]`` as values, any dtype) and their scales."""
        h_k, h_v = self._rotations(parts["codes"], dtype)
        if self.asymmetric:
            y = asymmetric_values(parts["codes"], parts["scale"], parts["offset"], dtype)
        else:
            y = parts["codes"].to(dtype) * parts["scale"].to(dtype)
        return h_k.T @ y @ h_v

    def quantize(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> QuantizedState:
        check_state(self, x)
        parts = self._grid(x, generator)
        encode = encode_levels if self.asymmetric else IntElement(self.bits).encode
        return QuantizedState(self.name, x.shape, {**parts, "codes": encode(parts["codes"])})

    def _dequantize(self, q: QuantizedState, dtype: torch.dtype) -> torch.Tensor:
        check_parts(self, q)
        return self._unrotate(dict(q.parts), dtype)  # int8 / uint8 codes are their grid values

    def fake_quantize(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        check_state(self, x)
        return self._unrotate(self._grid(x, generator), x.dtype)  # exact small integers: no byte round trip
