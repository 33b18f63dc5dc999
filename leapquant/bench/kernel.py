"""Kernel benchmark: one decode token of one linear-attention layer, every state format, one registry.

A *variant* (:class:`~leapquant.bench.variants.Variant`) is a method with a kernel plus named options:
``fp32:fla`` (FLA's ``fused_recurrent_*`` with an fp32 state: the baseline), a per-step method (``fp32``,
``bf16``, ``int8``: our per-step kernels) or a windowed method (``leapquant-int8``, ``int8/w16``,
``fp8-e4m3/w16+ct4+smooth``, ...), optionally with ``:step`` (the step kernel alone, positions frozen),
``:triton-close`` / ``:cuda-close`` (which window close) or ``:paged`` (vLLM's page layout).  Each reports
the median time per step from CUDA-graph replays over rotated inputs and pool slots, the bytes it must move
(byte model below), the achieved bandwidth and its fraction of the measured copy bandwidth.

Byte model per step (what a perfect kernel reads and writes once): the state format's boundary bytes read,
the records before the current position read (positions are uniform over the window, so ``(P-1)/2`` on
average), the new record written, and at the ``1/P`` of heads that close a window the boundary and all ``P``
records read again and the new boundary written; plus q, k, v, gate, beta read and o written.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import LeapQuantError
from .variants import Variant

__all__ = ["KernelCase", "bench_variant", "state_bytes_per_step"]

L2_BYTES = 60 << 20


@dataclass(frozen=True)
class KernelCase:
    """One layer's decode step: ``n`` sequences, ``heads`` value heads (``key_heads`` query/key heads)."""

    family: str = "gdn"
    n: int = 512
    heads: int = 32
    key_heads: int = 16
    d_k: int = 128
    d_v: int = 128
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.family not in ("gdn", "kda"):
            raise LeapQuantError(f"bench: family must be gdn or kda, got {self.family!r}")
        if self.heads % self.key_heads:
            raise LeapQuantError(f"bench: key heads {self.key_heads} must divide value heads {self.heads}")

    def io_bytes(self) -> int:
        """q, k, v, gate and beta read, o written, for all sequences."""
        es = torch.empty((), dtype=self.dtype).element_size()
        gate = self.heads * (self.d_k if self.family == "kda" else 1) * 4
        per_seq = 2 * self.key_heads * self.d_k * es + 2 * self.heads * self.d_v * es + gate + self.heads * es
        return self.n * per_seq


def state_bytes_per_step(variant: Variant, case: KernelCase) -> float:
    """State bytes one step must move for ``case.n * case.heads`` heads (see the module docstring)."""
    heads = case.n * case.heads
    if variant.per_step:  # read and write the whole state
        return heads * 2 * variant.state_bytes_per_head(case.d_k, case.d_v)
    cfg = variant.pool_config(case.heads, case.d_k, case.d_v, "vector" if case.family == "kda" else "scalar")
    boundary = cfg.boundary_bytes_per_head()
    # a record: key and correction at the record precision, and log decay(s) (pool.PoolConfig.decay_dtype)
    decays = case.d_k if cfg.decay == "vector" else 1
    record = cfg.record_dtype.itemsize * (case.d_k + case.d_v) + cfg.decay_dtype.itemsize * decays
    p = cfg.window
    # read boundary, records and position, write one record
    per_head = boundary + (p - 1) / 2 * record + record + 4
    if not variant.step_only:
        # the window close amortized over its P steps: boundary and records read, boundary written; the
        # position advanced in P - 1 steps of P, and at the close the list entry written and read and the
        # position reset (4 B each)
        per_head += (boundary + p * record + boundary) / p + 4 * (p - 1) / p + 12 / p
    return heads * per_head


def _inputs(case: KernelCase, rotations: int, device: str, gen: torch.Generator) -> list[dict]:
    """Rotated decode-token inputs: unit-scale q/k, log decays in [-0.1, 0), beta in (0, 1)."""
    out = []
    for _ in range(rotations):

        def rnd(*shape, scale=1.0):
            return (scale * torch.randn(*shape, generator=gen, device=device)).to(case.dtype)

        g_shape = (case.n, case.heads, case.d_k) if case.family == "kda" else (case.n, case.heads)
        out.append(
            {
                "q": rnd(case.n, case.key_heads, case.d_k),
                "k": rnd(case.n, case.key_heads, case.d_k),
                "v": rnd(case.n, case.heads, case.d_v),
                "g": -0.1 * torch.rand(g_shape, generator=gen, device=device),
                "beta": torch.rand(case.n, case.heads, generator=gen, device=device).to(case.dtype),
            }
        )
    return out


def allocate_pool(variant: Variant, cfg, slots: int, key_heads: int, device):
    """A pool of ``slots`` for ``variant``: contiguous, or (``:paged``) laid out in vLLM's state pages, the
    conv state (bf16, kernel width 4) first in each page and padding to 4 KiB after."""
    from ..ops.pool import LeapQuantPool

    if not variant.paged:
        return LeapQuantPool.allocate(cfg, slots, device)
    from ..integrations.vllm.adapter import paged_pool

    conv = 2 * 3 * (2 * key_heads * cfg.d_k + cfg.heads * cfg.d_v)
    page = -(-(conv + cfg.bytes_per_slot()) // 4096) * 4096
    return paged_pool(cfg, slots, lead_bytes=conv, page_bytes=page, device=device)[1]


def _randomize(pool, gen: torch.Generator) -> None:
    """Fill a pool with plausible content and positions spread uniformly over the window."""
    cfg = pool.config
    t = pool.tensors
    dev = pool.device
    fmt = cfg.format
    if fmt.keys_per_element > 1:  # packed codes: any byte is two valid codes
        t["payload"].copy_(
            torch.randint(0, 256, t["payload"].shape, generator=gen, device=dev).to(fmt.payload_dtype)
        )
    elif fmt.integer:
        q = int(fmt.qmax)
        t["payload"].copy_(
            torch.randint(-q, q + 1, t["payload"].shape, generator=gen, device=dev).to(fmt.payload_dtype)
        )
    else:
        t["payload"].copy_(torch.randn(t["payload"].shape, generator=gen, device=dev).to(t["payload"].dtype))
    if "scale" in t:
        t["scale"].copy_(0.01 + 0.01 * torch.rand(t["scale"].shape, generator=gen, device=dev))
    if "smooth" in t:
        t["smooth"].copy_(0.5 + torch.rand(t["smooth"].shape, generator=gen, device=dev))
    for name in ("comp_k", "comp_u", "rec_k", "rec_u"):
        if name in t:
            t[name].copy_((0.1 * torch.randn(t[name].shape, generator=gen, device=dev)).to(t[name].dtype))
    steps = -0.05 * torch.rand(t["rec_g"].shape, generator=gen, device=dev)  # each record's log decay
    t["rec_g"].copy_(steps if cfg.decay == "vector" else steps.cumsum(dim=2))  # GDN: running sums
    t["pos"].copy_(torch.randint(0, cfg.window, t["pos"].shape[:1], generator=gen, device=dev)[:, None].int())


def _fla(case: KernelCase, inputs: list[dict], device: str, gen: torch.Generator) -> Callable[[int], None]:
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        from fla.ops.kda import fused_recurrent_kda
    except ImportError as exc:  # pragma: no cover - GPU only
        raise LeapQuantError(f"bench: fp32:fla needs flash-linear-attention installed ({exc})") from None
    states = [
        torch.randn(case.n, case.heads, case.d_k, case.d_v, generator=gen, device=device)
        for _ in range(len(inputs))
    ]

    def step(i: int) -> None:
        x = inputs[i]
        # FLA wants [B, T, H, .] (grouped value heads allowed): one token per sequence as B=n, T=1; g and
        # beta by keyword, since its positional order puts beta after gk and gv
        q, k, v = x["q"][:, None], x["k"][:, None], x["v"][:, None]
        kwargs = dict(initial_state=states[i], output_final_state=True, use_qk_l2norm_in_kernel=True)
        if case.family == "gdn":
            fused_recurrent_gated_delta_rule(q, k, v, g=x["g"][:, None], beta=x["beta"][:, None], **kwargs)
        else:
            fused_recurrent_kda(q, k, v, g=x["g"][:, None], beta=x["beta"][:, None], **kwargs)

    return step


def bench_variant(
    variant: Variant,
    case: KernelCase,
    *,
    launch=None,
    device: str = "cuda",
    seed: int = 0,
    use_graph: bool = True,
    breakdown: bool = False,
) -> dict:
    """Time one variant on one case; returns a JSON-ready row (``breakdown``: with each kernel's device
    time and place in a profiled step, ``timing.kernel_breakdown``)."""
    from .timing import kernel_breakdown, time_steps

    gen = torch.Generator(device=device).manual_seed(seed)
    state_bytes = state_bytes_per_step(variant, case)
    rotations = max(2, min(8, math.ceil(4 * L2_BYTES / state_bytes)))
    inputs = _inputs(case, rotations, device, gen)
    slot_sets = [
        torch.arange(i * case.n, (i + 1) * case.n, device=device, dtype=torch.int32) for i in range(rotations)
    ]
    if variant.kernel == "fla":
        step = _fla(case, inputs, device, gen)
        io = case.io_bytes()
    elif variant.per_step:
        from ..ops.per_step_decode import PerStepPool, per_step_decode

        pool = PerStepPool.allocate(
            variant.method.codec, case.n * rotations, case.heads, case.d_k, case.d_v, device
        )
        pool.state.copy_(torch.randn(pool.state.shape, generator=gen, device=device).to(pool.state.dtype))

        def step(i: int) -> None:
            per_step_decode(pool, slot_sets[i], **inputs[i], validate=False)

        io = case.io_bytes()
    else:
        from dataclasses import replace

        from ..ops.leapquant_decode import LaunchConfig, leapquant_decode

        step_only = variant.step_only
        if variant.close != "auto":
            launch = replace(launch or LaunchConfig(), close_impl=variant.close)
        decay = "vector" if case.family == "kda" else "scalar"
        cfg = variant.pool_config(case.heads, case.d_k, case.d_v, decay)
        pool = allocate_pool(variant, cfg, case.n * rotations, case.key_heads, device)
        _randomize(pool, gen)

        def step(i: int) -> None:
            leapquant_decode(
                pool, slot_sets[i], **inputs[i], validate=False, boundary=not step_only, launch=launch
            )

        io = case.io_bytes()
    timing = time_steps(step, rotations, use_graph=use_graph)
    if breakdown:  # a failing profile must not cost the row its timing
        try:
            timing["breakdown"] = kernel_breakdown(step, rotations, use_graph=use_graph)
        except Exception as exc:  # pragma: no cover - GPU only
            timing["breakdown"] = {"error": f"{type(exc).__name__}: {exc}"}
    total = state_bytes + io
    return {
        "variant": variant.label,
        "family": case.family,
        "n": case.n,
        "heads": case.heads,
        "key_heads": case.key_heads,
        "d_k": case.d_k,
        "d_v": case.d_v,
        **timing,
        "state_bytes": state_bytes,
        "io_bytes": io,
        "gbps": total / (timing["ms"] * 1e-3) / 1e9,
        "rotations": rotations,
    }
