"""Pool configs for the kernel tests, by their knobs (window, rank, residual, ...), built as the library does:
a :class:`MethodConfig` plus the layout."""

from __future__ import annotations

from leapquant.methods import MethodConfig
from leapquant.ops import PoolConfig


def pool_config(heads, d_k=128, d_v=128, *, window=16, compensators=4, smoothing=True, residual="int8",
                records=None, decay="scalar", power_iters=1, ls=False) -> PoolConfig:  # fmt: skip
    method = MethodConfig(codec=residual, window=window, compensators=compensators, smoothing=smoothing,
                          record_precision=records, power_iters=power_iters,
                          least_squares_scales=ls)  # fmt: skip
    return PoolConfig(method, heads=heads, d_k=d_k, d_v=d_v, decay=decay)
