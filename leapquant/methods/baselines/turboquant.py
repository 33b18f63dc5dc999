"""TurboQuant (Zandieh et al., ICLR 2026) adapted to the recurrent state, MSE variant.

Each value column ``S[:, j]`` (a ``d_k``-vector; the readout ``o_j = S[:, j]^T q`` is its inner product
with the query) is one vector to quantize:

1. store its L2 norm ``r_j`` as fp32 and normalize, ``u = S[:, j] / r_j``;
2. rotate by a fixed seeded Haar-random orthogonal ``Pi`` (``d_k x d_k``, regenerated, never stored); each
   coordinate of ``Pi u`` is then distributed like one coordinate of a uniform point on the unit sphere of
   ``R^d`` (``d = d_k``), density ``proportional to (1 - x^2)^((d-3)/2)`` on ``[-1, 1]``, and coordinates are
   nearly independent for large ``d``;
3. round each coordinate to the nearest level of the Lloyd-Max (MSE-optimal) scalar codebook with
   ``2^bits`` levels for that density;
4. dequantize as ``r_j Pi^T codebook[codes]``.

Storage: ``bits + 32 / d_k`` bits per element.  Rounding is deterministic (there is no grid to dither).

Only the MSE variant is implemented.  TurboQuant's inner-product variant spends one bit per coordinate on
a QJL sign sketch of the residual, which makes ``<q, x_hat>`` unbiased for one query at the price of a
larger variance and a reconstruction it cannot improve.  A state is read through every future query
(``S^T q_t``), read again by the delta rule (``S^T b_t``), and decayed and updated in place, so it must be
materialized as a matrix and what matters is its reconstruction error, which bounds the error of every
read at once (``|(S - S_hat)^T q| <= ||S - S_hat|| ||q||``).  That is exactly what the MSE variant minimizes.

Codebook.  Lloyd-Max levels are computed once per ``(d, bits)`` in float64 numpy by damped Newton steps on
the Lloyd conditions (each level is its cell's centroid, boundaries are midpoints), started from the
high-resolution (Panter-Dite, density^(1/3)) solution and run until no level moves by 1e-10; plain Lloyd
iterations converge too slowly at 256 levels.  Cell probabilities come from a tabulated CDF (midpoint rule
on 2^16 cells over ``[-1, 1]``, or over +-20 standard deviations where that is narrower), first moments
from the closed form ``int x f = -(1 - x^2)^((d-1)/2) / ((d-1) Z)``.  ``d = 2`` (the arcsine law, unbounded at
+-1) uses its closed-form CDF; ``d = 1`` has the two-point law +-1, for which any codebook containing +-1
is exact, so it uses ``2^bits`` evenly spaced levels on ``[-1, 1]`` with zero distortion.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ...formats.base import QuantizedState, StateFormat
from .quarot import check_int, check_parts, check_state, random_orthogonal, safe_divisor, stored_scale

__all__ = ["LloydMaxCodebook", "TurboQuant", "lloyd_max_codebook"]

_GRID = 2**16  # CDF table intervals
_TOL = 1e-10


class LloydMaxCodebook(NamedTuple):
    """``levels``: sorted, symmetric float64 ``[2^bits]`` (read-only); ``distortion``: E[(X - Q(X))^2] of
    one coordinate, so a unit vector's expected squared error is ``d * distortion``."""

    levels: np.ndarray
    distortion: float


def _density(d: int):
    """The coordinate density f, the first-moment primitive G (G' = x f) and the CDF F, as numpy callables."""
    log_z = math.lgamma(0.5) + math.lgamma((d - 1) / 2) - math.lgamma(d / 2)  # int (1-x^2)^((d-3)/2)

    def power(x: np.ndarray, a: float, log_c: float) -> np.ndarray:
        """exp(log_c) * (1 - x^2)^a, with 0 at |x| = 1 (a > 0) and no 0 * inf for a = 0."""
        s = np.clip(1 - x * x, 0.0, 1.0)
        with np.errstate(divide="ignore"):
            return np.exp(a * np.log(s) + log_c) if a else np.full_like(x, math.exp(log_c))

    def f(x: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return power(x, (d - 3) / 2, -log_z)

    def g(x: np.ndarray) -> np.ndarray:
        return -power(x, (d - 1) / 2, -log_z - math.log(d - 1))

    if d == 2:
        return f, g, lambda x: 0.5 + np.arcsin(np.clip(x, -1, 1)) / np.pi
    half_width = min(1.0, 20 / math.sqrt(d))  # the law's standard deviation is 1/sqrt(d)
    xs = np.linspace(-half_width, half_width, _GRID + 1)
    cdf = np.concatenate([[0.0], np.cumsum(f((xs[1:] + xs[:-1]) / 2))])
    cdf /= cdf[-1]
    return f, g, lambda x: np.interp(x, xs, cdf)


@functools.lru_cache(maxsize=128)
def lloyd_max_codebook(d: int, bits: int) -> LloydMaxCodebook:
    """Lloyd-Max codebook with ``2^bits`` levels for one coordinate of a uniform unit vector in ``R^d``."""
    check_int("lloyd_max_codebook", "d", d, 1, 2**31)
    check_int("lloyd_max_codebook", "bits", bits, 1, 8)
    k = 2**bits
    if d == 1:
        levels = np.linspace(-1.0, 1.0, k)
        levels.setflags(write=False)
        return LloydMaxCodebook(levels, 0.0)
    f, g, cdf = _density(d)
    # Panter-Dite start: level density proportional to f^(1/3), placed at the quantiles of that law.
    xs = np.linspace(-1.0, 1.0, _GRID + 1)
    w = np.concatenate([[0.0], np.cumsum(np.cbrt(f((xs[1:] + xs[:-1]) / 2)))])
    c = np.interp((np.arange(k) + 0.5) / k * w[-1], w, xs)
    for _ in range(100):
        t = np.concatenate([[-1.0], (c[:-1] + c[1:]) / 2, [1.0]])
        p = np.diff(cdf(t))
        m = np.diff(g(t)) / p
        r = c - m
        ft = f(t)
        ft[[0, -1]] = 0.0  # outer boundaries are fixed; f may be infinite there (d = 2)
        da = ft[:-1] * (m - t[:-1]) / p  # d m_i / d t_i
        db = ft[1:] * (t[1:] - m) / p  # d m_i / d t_{i+1}
        jac = np.diag(1 - (da + db) / 2) - np.diag(da[1:] / 2, -1) - np.diag(db[:-1] / 2, 1)
        step = np.linalg.solve(jac, r)
        if not np.all(np.isfinite(step)):
            raise RuntimeError(f"Lloyd-Max codebook for d={d}, bits={bits}: an empty cell")
        while True:  # damp until the levels stay sorted inside (-1, 1)
            new = c - step
            if np.all(np.diff(new) > 0) and new[0] > -1 and new[-1] < 1:
                break
            step = step / 2
        c = new
        if np.max(np.abs(step)) < _TOL:
            break
    else:
        raise RuntimeError(f"Lloyd-Max codebook for d={d}, bits={bits} did not converge")
    c = (c - c[::-1]) / 2  # exact symmetry (the density is even)
    t = np.concatenate([[-1.0], (c[:-1] + c[1:]) / 2, [1.0]])
    p = np.diff(cdf(t))
    # E(X - c_i)^2 over cells = E X^2 - 2 sum c_i int x f + sum c_i^2 p_i, and E X^2 = 1/d on the sphere.
    distortion = 1 / d - float(np.sum(2 * c * np.diff(g(t)) - c * c * p))
    c.setflags(write=False)
    return LloydMaxCodebook(c, max(distortion, 0.0))


@functools.lru_cache(maxsize=128)
def _torch_codebook(
    d: int, bits: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Levels ``[2^bits]`` and decision boundaries (midpoints) ``[2^bits - 1]`` in ``dtype`` on ``device``."""
    levels = torch.tensor(lloyd_max_codebook(d, bits).levels, dtype=torch.float64)
    mids = (levels[1:] + levels[:-1]) / 2
    return levels.to(device=device, dtype=dtype), mids.to(device=device, dtype=dtype)


@dataclass(frozen=True)
class TurboQuant(StateFormat):
    """Per-column norm (fp32) + random rotation + Lloyd-Max scalar codes of ``bits`` bits per coordinate.

    Parts of the :class:`QuantizedState`: ``codes`` uint8 ``[..., d_k, d_v]`` (codebook indices of the
    rotated unit columns) and ``norm`` float32 ``[..., 1, d_v]``.

    Attributes:
        bits: bits per coordinate, 1..8 (``2^bits`` levels).
        seed: seed of the rotation ``Pi``.
    """

    bits: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("turboquant", "bits", self.bits, 1, 8)
        check_int("turboquant", "seed", self.seed, 0, 2**63 - 1)

    @property
    def name(self) -> str:
        return f"turboquant-{self.bits}{f'-seed{self.seed}' if self.seed else ''}"

    def bits_per_element(self, d_k: int, d_v: int) -> float:
        return self.bits + 32 / d_k

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d_k = x.shape[-2]
        pi = random_orthogonal(d_k, seed=self.seed, dtype=x.dtype, device=x.device)
        # in float64: a float32 column of entries near 1e19 overflows its norm, one near 1e-30 underflows it
        norm = stored_scale(torch.linalg.vector_norm(x.double(), dim=-2, keepdim=True))
        y = pi @ (x / safe_divisor(norm.to(x.dtype)))
        _, mids = _torch_codebook(d_k, self.bits, x.dtype, x.device)
        return torch.bucketize(y, mids), norm

    def _decode(self, codes: torch.Tensor, norm: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        d_k = codes.shape[-2]
        pi = random_orthogonal(d_k, seed=self.seed, dtype=dtype, device=codes.device)
        levels, _ = _torch_codebook(d_k, self.bits, dtype, codes.device)
        # Index with int64: a uint8 index tensor would be read as a boolean mask.
        return (pi.T @ levels[codes.long()]) * norm.to(dtype)

    def quantize(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> QuantizedState:
        check_state(self, x)
        codes, norm = self._encode(x)
        return QuantizedState(self.name, x.shape, {"codes": codes.to(torch.uint8), "norm": norm})

    def _dequantize(self, q: QuantizedState, dtype: torch.dtype) -> torch.Tensor:
        check_parts(self, q)
        return self._decode(q["codes"], q["norm"], dtype)

    def fake_quantize(self, x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        check_state(self, x)
        codes, norm = self._encode(x)
        return self._decode(codes, norm, x.dtype)
