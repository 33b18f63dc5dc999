"""Synthetic GDN and KDA traces with the structure trained models show.

What makes state quantization hard in real hybrids, and what these traces reproduce:

* **long memory**: many heads decay slowly (per-token decay 0.99-0.9995), so errors persist and the state
  is a sum of thousands of small updates (each below an INT8 or BF16 step: per-step rounding drops them);
* **heavy key rows and value columns**: a few key channels and value channels carry several times the
  typical magnitude, which widens per-channel quantization ranges;
* **low-rank energy**: keys and values follow a few slowly drifting "topics" and values have a persistent
  mean, so a few singular values carry most of the state's energy.

Native model inputs (q, k, v, gate, beta) are drawn first and converted by the model's own adapter, so a
synthetic trace exercises the same path as a trace recorded from a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import LeapQuantError
from ..recurrences.records import Records
from .io import Trace

__all__ = ["SynthConfig", "synthesize"]

FAMILIES = ("gdn", "kda")


@dataclass(frozen=True)
class SynthConfig:
    """Shape and structure of a synthetic trace.

    Attributes:
        family: ``"gdn"`` (scalar decay per head) or ``"kda"`` (per-key-channel decay).
        streams: number of heads (each an independent stream).
        tokens: records per stream.
        d_k, d_v: head dimensions.
        long_memory: fraction of heads (GDN) or key channels (KDA) with decay in [0.99, 0.9995].
        topics: rank of the slowly drifting key/value structure.
        heavy_keys, heavy_values: number of heavy key channels and value channels.
        seed: everything is reproducible from it.
    """

    family: str = "gdn"
    streams: int = 8
    tokens: int = 4096
    d_k: int = 128
    d_v: int = 128
    long_memory: float = 0.75
    topics: int = 4
    heavy_keys: int = 4
    heavy_values: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise LeapQuantError(f"synth: unknown family {self.family!r}; use one of {', '.join(FAMILIES)}")
        for name in ("streams", "tokens", "d_k", "d_v"):
            if getattr(self, name) < 1:
                raise LeapQuantError(f"synth: {name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.long_memory <= 1.0:
            raise LeapQuantError(f"synth: long_memory must be in [0, 1], got {self.long_memory}")


def _drifting(gen: torch.Generator, streams: int, tokens: int, rank: int, rho: float = 0.995) -> torch.Tensor:
    """``[streams, tokens, rank]`` AR(1) coefficients with unit stationary variance (slow topic drift)."""
    noise = torch.randn(streams, tokens, rank, generator=gen, dtype=torch.float64)
    z = torch.empty_like(noise)
    z[:, 0] = noise[:, 0]
    innovation = math.sqrt(1 - rho**2)
    for t in range(1, tokens):
        z[:, t] = rho * z[:, t - 1] + innovation * noise[:, t]
    return z


def _structured(
    gen: torch.Generator, cfg: SynthConfig, dim: int, heavy: int, z: torch.Tensor, noise: float
) -> torch.Tensor:
    """Vectors ``[streams, tokens, dim]``: topic mixture + noise, with ``heavy`` channels amplified."""
    basis = torch.randn(cfg.streams, z.shape[-1], dim, generator=gen, dtype=torch.float64)
    x = z @ basis + noise * torch.randn(cfg.streams, cfg.tokens, dim, generator=gen, dtype=torch.float64)
    gain = torch.ones(cfg.streams, dim, dtype=torch.float64)
    for s in range(cfg.streams):
        idx = torch.randperm(dim, generator=gen)[:heavy]
        gain[s, idx] = 3.0 + 5.0 * torch.rand(len(idx), generator=gen, dtype=torch.float64)
    return x * gain[:, None, :]


def _decays(gen: torch.Generator, cfg: SynthConfig) -> torch.Tensor:
    """Per-token decays ``[streams, tokens, d]`` (d = 1 for GDN, d_k for KDA) with jitter around a base."""
    width = 1 if cfg.family == "gdn" else cfg.d_k
    u = torch.rand(cfg.streams, width, generator=gen, dtype=torch.float64)
    long = torch.rand(cfg.streams, width, generator=gen, dtype=torch.float64) < cfg.long_memory
    # log10 of (1 - decay): long memory in [-3.3, -2] (0.9995..0.99), short in [-2, -0.3] (0.99..0.5)
    log_gap = torch.where(long, -3.3 + 1.3 * u, -2.0 + 1.7 * u)
    base = -(10.0**log_gap)  # log-decay ~ -(1 - a) for a near 1
    jitter = torch.randn(cfg.streams, cfg.tokens, width, generator=gen, dtype=torch.float64)
    return base[:, None, :] * torch.exp(0.3 * jitter)  # log-space gate g (a = exp(g))


def synthesize(cfg: SynthConfig) -> Trace:
    """A synthetic trace of ``cfg.streams`` heads, through the GDN or KDA adapter."""
    from ..recurrences import gated_deltanet_records, kda_records

    gen = torch.Generator().manual_seed(cfg.seed)
    zk = _drifting(gen, cfg.streams, cfg.tokens, cfg.topics)
    k = _structured(gen, cfg, cfg.d_k, cfg.heavy_keys, zk, noise=0.5)
    q = _structured(
        gen, cfg, cfg.d_k, cfg.heavy_keys, zk + 0.5 * _drifting(gen, cfg.streams, cfg.tokens, cfg.topics), 0.5
    )
    zv = _drifting(gen, cfg.streams, cfg.tokens, cfg.topics)
    v = _structured(gen, cfg, cfg.d_v, cfg.heavy_values, zv, noise=0.5)
    v = v + torch.randn(cfg.streams, 1, cfg.d_v, generator=gen, dtype=torch.float64)  # persistent mean
    beta = torch.sigmoid(torch.randn(cfg.streams, cfg.tokens, generator=gen, dtype=torch.float64) - 1.0)
    g = _decays(gen, cfg)
    # native FLA layout: [B=1, T, H, K] with one head per stream
    q, k, v = (x.permute(1, 0, 2).unsqueeze(0) for x in (q, k, v))
    beta = beta.T.unsqueeze(0)
    if cfg.family == "gdn":
        records: Records = gated_deltanet_records(
            q, k, v, g[..., 0].T.unsqueeze(0), beta, use_qk_l2norm_in_kernel=True
        )
    else:
        records = kda_records(q, k, v, g.permute(1, 0, 2).unsqueeze(0), beta, use_qk_l2norm_in_kernel=True)
    records = records.flatten()
    meta = {"synthetic": True, **{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}}
    return Trace(records=records, initial_state=None, meta=meta, name=f"synth-{cfg.family}-seed{cfg.seed}")
