"""KVQuant (Hooper et al., 2024) adapted to the recurrent state: per-channel integers plus sparse outliers.

Dense-and-sparse split.  In each head's ``[d_k, d_v]`` state the ``ceil(outlier_fraction * d_k * d_v)``
largest-magnitude entries (1% by default, KVQuant's setting) are stored exactly as fp16 values in a COO
list with a flat index ``i * d_v + j``; they are zeroed in the dense part, which then no longer carries
their magnitude into its scales.  An outlier costs 16 (value) + 16 (index) bits; heads of more than 2^16
entries need a 32-bit index, so an outlier costs 48 bits there.  Outlier values beyond fp16's range
saturate at +-65504 rather than becoming inf.  As in KVQuant the outliers are fp16: a state whose
largest entries are outside fp16's normal range (6e-5 to 65504) loses them, where the formats' fp32
scales do not care.

Per-channel scales.  KVQuant quantizes keys per channel (one scale per key channel, shared over tokens)
because key outliers live in fixed channels.  A state ``S = sum_t k_t v_t^T`` sums the token axis away
and keeps the key channel as its row axis, so the adaptation is one fp32 scale per key row (``row``
granularity, reduced over the value axis).

Non-uniform datatype (``nuq=True``).  KVQuant's NUQ fits a per-layer codebook to calibration data with
sensitivity-weighted k-means.  No calibration data exists for a state replayed from a trace, so this is
the calibration-free variant: a fixed NormalFloat codebook (QLoRA's NF4 construction, any bit width) and
per-row scale = amax.  The codebook is symmetric with an exact zero, so it has ``2^bits - 1`` levels and
one code is unused, exactly as in the symmetric integer grid; the two variants differ only in where the
levels sit.  (NF4 itself is asymmetric, with one extra positive level; at 4 bits our codebook is NF4's
negative half mirrored.)

Symmetric and asymmetric grids.  Published KVQuant (and QuaRot) quantize the KV cache asymmetrically: a
min/max range with ``2^bits`` levels.  By default these adaptations use symmetric grids with ``2^bits - 1``
levels and no offset, as every format here does (the state is signed and centred); ``asymmetric=True``
(``-asym`` in the name) is the published grid, over each row's dense entries, with an fp32 offset beside
each scale (0.25 bits more an element at 128x128).
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

import torch

from ...errors import LeapQuantError
from ...formats.base import QuantizedState, StateFormat
from ...formats.elements import IntElement
from .quarot import (
    asymmetric_grid,
    asymmetric_values,
    check_bool,
    check_int,
    check_parts,
    check_state,
    encode_levels,
    safe_divisor,
    stored_scale,
)

__all__ = ["KVQuant", "normal_float_codebook"]

_FP16_MAX = 65504.0


@functools.lru_cache(maxsize=16)
def _nf_levels(bits: int) -> tuple[float, ...]:
    m = 2 ** (bits - 1) - 1  # levels per side
    # QLoRA's offset: the outermost level sits at the probability halfway between the centres of the outer
    # bins of 2^b - 1 and 2^b equal-mass bins (0.9677 for 4 bits); the others are spaced linearly in
    # probability from 1/2 (exclusive) to it.  NF4's 7-level negative half is exactly this construction.
    top = 1 - (1 / (2 * (2**bits - 1)) + 1 / (2 * 2**bits)) / 2
    nd = statistics.NormalDist()
    pos = [nd.inv_cdf(0.5 + (top - 0.5) * (i + 1) / m) for i in range(m)]
    pos = [p / pos[-1] for p in pos]
    return (*(-p for p in reversed(pos)), 0.0, *pos)


def normal_float_codebook(
    bits: int, *, dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Sorted NormalFloat levels ``[2^bits - 1]`` in ``[-1, 1]``: normal quantiles, exact 0 and +-1."""
    check_int("normal_float_codebook", "bits", bits, 2, 8)
    return _nf_torch(bits, dtype, torch.device(device))


@functools.lru_cache(maxsize=64)
def _nf_torch(bits: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(_nf_levels(bits), dtype=torch.float64).to(device=device, dtype=dtype)


def _round_codebook(
    y: torch.Tensor, levels: torch.Tensor, stochastic: bool, generator: torch.Generator | None
) -> torch.Tensor:
    """Index (int64) of the level nearest to ``y``, or, stochastically, one of the two neighbours with
    probabilities that make the expected level equal ``y`` (within ``[-1, 1]``)."""
    if not stochastic:
        return torch.bucketize(y, (levels[1:] + levels[:-1]) / 2)
    lo = (torch.bucketize(y, levels, right=True) - 1).clamp(0, levels.numel() - 2)
    a, b = levels[lo], levels[lo + 1]
    p = ((y - a) / (b - a)).clamp(0, 1)
    u = torch.rand(y.shape, generator=generator, dtype=y.dtype, device=y.device)
    return lo + (u < p).long()


@dataclass(frozen=True)
class KVQuant(StateFormat):
    """Per-key-row ``int{bits}`` (or NormalFloat) with the top entries kept as fp16 outliers.

    Parts of the :class:`QuantizedState`:

    * ``codes``: ``[..., d_k, d_v]`` int8 grid values (uniform), uint8 codebook indices (``nuq``) or uint8
      level indices (``asymmetric``);
    * ``scale``: float32 ``[..., d_k, 1]``, ``amax / qmax`` (uniform) or ``amax`` (``nuq``) of the dense row,
      ``(max - min) / (2^bits - 1)`` (``asymmetric``); there also ``offset``, float32 ``[..., d_k, 1]``,
      the dense row's min;
    * ``outlier_values``: float16 ``[..., n_out]`` and ``outlier_index``: int16 ``[..., n_out]`` flat index
      ``row * d_v + col`` (read as unsigned; int32 when ``d_k * d_v > 2^16``).

    Storage: ``bits + 32 / d_v + (16 + index bits) * n_out / (d_k * d_v)`` bits per element, plus
    ``32 / d_v`` for the offsets of an asymmetric grid.

    Attributes:
        bits: element width, 2..8.
        nuq: NormalFloat codebook instead of the uniform integer grid.
        outlier_fraction: share of each head's entries kept exactly, 0 or in ``[1e-6, 0.5]``; the count
            is rounded up.
        stochastic: stochastic rounding (unbiased between the two neighbouring grid values).
        asymmetric: ``2^bits`` uniform levels from each row's min to its max (published KVQuant's grid,
            :func:`~.quarot.asymmetric_grid`); not with ``nuq``.
    """

    bits: int = 8
    nuq: bool = False
    outlier_fraction: float = 0.01
    stochastic: bool = False
    asymmetric: bool = False

    def __post_init__(self) -> None:
        check_int("kvquant", "bits", self.bits, 2, 8)
        check_bool("kvquant", "nuq", self.nuq)
        check_bool("kvquant", "stochastic", self.stochastic)
        check_bool("kvquant", "asymmetric", self.asymmetric)
        if self.nuq and self.asymmetric:
            raise LeapQuantError("kvquant: the NormalFloat codebook (nuq) is symmetric; asymmetric needs int")
        f = self.outlier_fraction
        # under 1e-6 a head of 2^18 entries keeps no outlier, and the count rounds to 9 digits before it
        # is rounded up: such a fraction would silently be 0; past half, the "outliers" are the state
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not (f == 0 or 1e-6 <= f <= 0.5):
            raise LeapQuantError(f"kvquant: outlier_fraction must be 0 or in [1e-6, 0.5], got {f!r}")

    @property
    def name(self) -> str:
        kind = "nuq" if self.nuq else "int"
        frac = "" if self.outlier_fraction == 0.01 else f"-o{float(self.outlier_fraction)!r}"
        return f"kvquant-{kind}{self.bits}{frac}{'-asym' if self.asymmetric else ''}"

    def n_outliers(self, d_k: int, d_v: int) -> int:
        """Outliers per head; the product is rounded to 9 digits first so 0.07 * 100 gives 7, not 8."""
        return math.ceil(round(self.outlier_fraction * d_k * d_v, 9))

    @staticmethod
    def _index_bits(d_k: int, d_v: int) -> int:
        return 16 if d_k * d_v <= 2**16 else 32

    def bits_per_element(self, d_k: int, d_v: int) -> float:
        n = d_k * d_v
        outliers = self.n_outliers(d_k, d_v) * (16 + self._index_bits(d_k, d_v))
        return self.bits + (64 if self.asymmetric else 32) / d_v + outliers / n

    def _split(
        self, x: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Outlier flat indices (int64), their fp16 values, and the dense part's grid values/codes (``codes``)
        with its fp32 row ``scale`` (and ``offset``, asymmetric)."""
        flat = x.flatten(-2)
        idx = flat.abs().topk(self.n_outliers(x.shape[-2], x.shape[-1]), dim=-1).indices
        values = flat.gather(-1, idx)
        values = torch.where(values.isinf(), values, values.clamp(-_FP16_MAX, _FP16_MAX)).to(torch.float16)
        dense = flat.scatter(-1, idx, 0.0).view_as(x)
        if self.asymmetric:  # the range spans the dense entries only, not the zeros left by the outliers
            covered = torch.ones_like(flat, dtype=torch.bool).scatter(-1, idx, False).view_as(x)
            grid, scale, offset = asymmetric_grid(dense, self.bits, -1, self.stochastic, generator, covered)
            return idx, values, {"codes": grid, "scale": scale, "offset": offset}
        amax = dense.abs().amax(dim=-1, keepdim=True)
        if self.nuq:
            scale = stored_scale(amax)
            levels = _nf_torch(self.bits, x.dtype, x.device)
            y = dense / safe_divisor(scale.to(x.dtype))
            grid = _round_codebook(y, levels, self.stochastic, generator)  # indices into levels
        else:
            elem = IntElement(self.bits)
            scale = stored_scale(amax / elem.max_value)
            y = dense / safe_divisor(scale.to(x.dtype))
            grid = elem.round(y, stochastic=self.stochastic, generator=generator)
        return idx, values, {"codes": grid, "scale": scale}

    def _assemble(
        self, dense: dict[str, torch.Tensor], idx: torch.Tensor, values: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """The state from the dense part (``_split``'s dict, codes as values or stored) and the outliers."""
        grid, scale = dense["codes"], dense["scale"]
        if self.asymmetric:
            x = asymmetric_values(grid, scale, dense["offset"], dtype)
        elif self.nuq:
            x = _nf_torch(self.bits, dtype, grid.device)[grid.long()] * scale.to(dtype)
        else:
            x = grid.to(dtype) * scale.to(dtype)
        # Overwrite (not add): the dense part is exactly 0 there, and overwriting keeps the fp16 value exact.
        return x.flatten(-2).scatter(-1, idx, values.to(dtype)).view_as(x)

    def quantize(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> QuantizedState:
        check_state(self, x)
        idx, values, dense = self._split(x, generator)
        if self.asymmetric or self.nuq:  # level / codebook indices
            codes = encode_levels(dense["codes"])
        else:
            codes = IntElement(self.bits).encode(dense["codes"])
        if self._index_bits(x.shape[-2], x.shape[-1]) == 16:
            stored_idx = torch.where(idx >= 2**15, idx - 2**16, idx).to(torch.int16)  # unsigned in int16
        else:
            stored_idx = idx.to(torch.int32)
        parts = {**dense, "codes": codes, "outlier_values": values, "outlier_index": stored_idx}
        return QuantizedState(self.name, x.shape, parts)

    def _dequantize(self, q: QuantizedState, dtype: torch.dtype) -> torch.Tensor:
        check_parts(self, q)
        idx = q["outlier_index"].long()
        if q["outlier_index"].dtype == torch.int16:
            idx = idx & 0xFFFF
        dense = {k: q[k] for k in ("codes", "scale", "offset") if k in q.parts}
        return self._assemble(dense, idx, q["outlier_values"], dtype)

    def fake_quantize(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        check_state(self, x)
        idx, values, dense = self._split(x, generator)
        return self._assemble(dense, idx, values, x.dtype)
