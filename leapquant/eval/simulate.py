"""Trace replay: run every stream of every trace through each method and measure its drift.

The reference is the exact recurrence in float64 (:func:`exact_recurrence`); each method runs in float64
too (:class:`WindowedState`), so the error reported is the error its storage introduces.  Errors are pooled
over all streams and traces: ``||X - X_ref||_F / ||X_ref||_F`` with the sums taken over everything.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from ..checks import require_triton
from ..errors import LeapQuantError
from ..methods.config import MethodConfig, as_method
from ..methods.window import WindowedState
from ..recurrences.records import exact_recurrence
from ..traces.io import Trace

__all__ = ["checkpoint_steps", "replay", "simulate"]


def checkpoint_steps(steps: int, count: int) -> list[int]:
    """``count`` evenly spaced step numbers in ``1..steps``, always including ``steps``."""
    count = max(1, min(count, steps))
    return sorted({max(1, round(steps * (i + 1) / count)) for i in range(count)})


def replay(
    config: MethodConfig,
    trace: Trace,
    checkpoints: Sequence[int],
    *,
    seed: int = 0,
    on_step: Callable[[int], None] | None = None,
    backend: str = "reference",
) -> tuple[torch.Tensor, dict[int, torch.Tensor], int]:
    """Run one trace through one method: float64 reference, or the Triton kernels (``backend="triton"``).

    Returns ``(outputs [S, T, d_v], {step: state [S, d_k, d_v]}, quantizations)``; outputs of records that
    emit nothing are zero.
    """
    if backend == "triton":
        return _replay_kernels(config, trace, checkpoints, on_step)
    if backend != "reference":
        raise LeapQuantError(f"unknown backend {backend!r}: use reference or triton")
    rec = trace.records
    state = WindowedState(
        config,
        trace.streams,
        rec.d_k,
        rec.d_v,
        dtype=torch.float64,
        generator=torch.Generator().manual_seed(seed),
    )
    if trace.initial_state is not None:
        state.load(trace.initial_state)
    wanted = set(checkpoints)
    outputs = torch.zeros(trace.streams, rec.steps, rec.d_v, dtype=torch.float64)
    saved = {}
    for t in range(rec.steps):
        outputs[:, t] = state.step(
            rec.a[:, t], rec.k[:, t], rec.b[:, t], rec.v[:, t], rec.q[:, t], readout=rec.readout
        )
        if t + 1 in wanted:
            saved[t + 1] = state.materialize()
        if on_step is not None and (t + 1) % 64 == 0:
            on_step(64)
    if on_step is not None:
        on_step(rec.steps % 64)
    if rec.emit is not None:
        outputs = outputs * rec.emit[:, None].to(outputs.dtype)
    return outputs, saved, state.quantizations


def _replay_kernels(
    config: MethodConfig, trace: Trace, checkpoints: Sequence[int], on_step: Callable[[int], None] | None
) -> tuple[torch.Tensor, dict[int, torch.Tensor], int]:
    """The trace through the decode kernels: each stream is one head of one pool slot, fp32 arithmetic.

    Runs on the GPU when there is one, else on the CPU through the Triton interpreter (slow: small traces).
    """
    from ..ops import kernel_unsupported
    from ..ops.leapquant_decode import leapquant_step_records, load_states, materialize_states
    from ..ops.per_step_decode import PerStepPool, per_step_records
    from ..ops.pool import LeapQuantPool, PoolConfig

    rec = trace.records
    device = "cuda" if torch.cuda.is_available() else "cpu"
    s, d_k, d_v = trace.streams, rec.d_k, rec.d_v
    slots = torch.zeros(1, dtype=torch.int32, device=device)
    s0 = trace.initial_state
    per_step = config.window == 1
    reason = kernel_unsupported(config)
    if reason is not None:
        raise LeapQuantError(f"no Triton kernel for {config.name!r}: {reason}")
    if per_step:
        pool = PerStepPool.allocate(config.codec, 1, s, d_k, d_v, device)
        if s0 is not None:
            pool.load(slots, s0[None].float().to(device))
        step_fn, read_fn = partial(per_step_records, backend="triton"), lambda: pool.materialize(slots)[0]
    else:
        pool = LeapQuantPool.allocate(PoolConfig(config, s, d_k, d_v, "vector"), 1, device)
        if s0 is not None:
            load_states(pool, slots, s0[None].float().to(device), backend="triton")
        step_fn = partial(leapquant_step_records, backend="triton")  # refused where Triton cannot run
        read_fn = lambda: materialize_states(pool, slots, backend="triton")[0]  # noqa: E731
    # log decays; a decay of exactly 0 (a hard reset) becomes e^-69, which is 0 after one more product
    g_all = rec.a.clamp_min(1e-30).log().float().to(device)
    x = {n: getattr(rec, n).float().to(device) for n in ("k", "b", "v", "q")}
    wanted = set(checkpoints)
    outputs = torch.zeros(s, rec.steps, d_v, dtype=torch.float64)
    saved = {}
    for t in range(rec.steps):
        token = [x[n][None, :, t] for n in ("k", "b", "v", "q")]
        o = step_fn(pool, slots, g_all[None, :, t], *token, readout=rec.readout)
        outputs[:, t] = o[0].double().cpu()
        if t + 1 in wanted:
            saved[t + 1] = read_fn().double().cpu()
        if on_step is not None and (t + 1) % 64 == 0:
            on_step(64)
    if on_step is not None:
        on_step(rec.steps % 64)
    if rec.emit is not None:
        outputs = outputs * rec.emit[:, None].to(outputs.dtype)
    return outputs, saved, 1 + int(s0 is not None) + rec.steps // config.window  # as WindowedState counts


@dataclass
class _Pool:
    """Running sums of squared error and squared reference, per quantity."""

    out: list[float] = field(default_factory=lambda: [0.0, 0.0])
    final: list[float] = field(default_factory=lambda: [0.0, 0.0])
    states: dict[int, list[float]] = field(default_factory=dict)

    @staticmethod
    def add(acc: list[float], x: torch.Tensor, ref: torch.Tensor) -> None:
        acc[0] += float(((x - ref) ** 2).sum())
        acc[1] += float((ref**2).sum())

    @staticmethod
    def ratio(acc: list[float]) -> float | None:
        """sqrt(error energy / reference energy); ``None`` without a reference (no record emits)."""
        if acc[1] == 0.0:
            return None if acc[0] == 0.0 else float("inf")
        return (acc[0] / acc[1]) ** 0.5


def simulate(
    traces: Sequence[Trace],
    methods: Sequence[str] | Mapping[str, MethodConfig],
    *,
    checkpoints: int = 32,
    seed: int = 0,
    on_step: Callable[[int], None] | None = None,
    backend: str = "reference",
) -> dict:
    """Replay ``traces`` through ``methods``; returns the JSON-ready report ``{"methods": {...}, ...}``.

    ``methods``: method names, or ``{label: MethodConfig}`` when the caller has parsed them (the report is
    keyed by the names or labels).

    ``backend="triton"`` runs the methods through the decode kernels instead of the float64 reference
    (the exact trajectory stays float64).

    Per method: ``output_rel_err``, ``state_rel_err`` (``[[step, value], ...]`` at ``checkpoints`` evenly
    spaced steps of the longest trace; each point pools the traces that reach it, so with traces of
    different lengths its late points cover the long ones only), ``final_state_rel_err`` (each trace's
    last state), errors ``None`` where nothing emits, ``bytes_per_element`` (boundary storage, weighted
    over the traces' head shapes), plus the canonical configuration, record-buffer bytes (one decay a
    record where a trace's decays are equal across its key channels, as GDN's are; else one per channel),
    quantization count, seconds and a per-trace breakdown.  ``warnings`` names windows longer than a
    trace (no boundary inside it)."""
    if not traces:
        raise LeapQuantError("simulate: no traces given")
    if not methods:
        raise LeapQuantError("simulate: no methods given")
    if isinstance(methods, Mapping):
        configs = {m: as_method(c, f"simulate: method {m!r}") for m, c in methods.items()}
    else:
        if len(set(methods)) != len(methods):
            raise LeapQuantError("simulate: a method is listed twice")
        configs = {m: as_method(m, "simulate: method") for m in methods}
    methods = list(configs)
    names = [t.name for t in traces]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise LeapQuantError(
            f"simulate: more than one trace is named {', '.join(map(repr, twice))} (Trace.name)"
        )
    if backend == "triton":
        require_triton("simulate: backend 'triton'")  # before the exact trajectories, not after them
        _check_kernels(configs, traces)
    for trace in traces:
        trace.records.check_finite()
        s0 = trace.initial_state
        shape = (trace.streams, trace.records.d_k, trace.records.d_v)
        if s0 is not None and (tuple(s0.shape) != shape or not torch.isfinite(s0).all()):
            raise LeapQuantError(f"trace {trace.name}: initial state must be finite with shape {shape}")
    longest = max(t.records.steps for t in traces)
    steps = checkpoint_steps(longest, checkpoints)
    pools = {m: _Pool() for m in methods}
    per_trace: dict[str, dict] = {m: {} for m in methods}
    seconds = dict.fromkeys(methods, 0.0)
    quantizations = dict.fromkeys(methods, 0)
    weights, heads = 0.0, 0
    warnings: list[str] = []
    bpe, buffer = dict.fromkeys(methods, 0.0), dict.fromkeys(methods, 0.0)
    for trace in traces:
        rec = trace.records
        # a scalar decay (GDN) is stored expanded over the key channels; a pool keeps one value a record
        decay_values = 1 if bool((rec.a == rec.a[..., :1]).all()) else rec.d_k
        wanted = [s for s in steps if s <= rec.steps] + [rec.steps]
        ref_out, ref_states = exact_recurrence(rec, trace.initial_state, checkpoints=wanted)
        if not (ref_out.isfinite().all() and all(x.isfinite().all() for x in ref_states.values())):
            raise LeapQuantError(
                f"trace {trace.name}: the exact recurrence overflows float64 (its decays and keys let the "
                "state grow without bound): no reference to measure against"
            )
        if rec.emit is not None:
            ref_out = ref_out * rec.emit[:, None].to(ref_out.dtype)
        weight = trace.streams * rec.d_k * rec.d_v
        weights += weight
        heads += trace.streams
        for name, cfg in configs.items():
            start = time.perf_counter()
            out, states, count = replay(cfg, trace, wanted, seed=seed, on_step=on_step, backend=backend)
            seconds[name] += time.perf_counter() - start
            quantizations[name] += count
            pool = pools[name]
            _Pool.add(pool.out, out, ref_out)
            for s in wanted[:-1]:
                _Pool.add(pool.states.setdefault(s, [0.0, 0.0]), states[s], ref_states[s])
            _Pool.add(pool.final, states[rec.steps], ref_states[rec.steps])
            single = _Pool()
            _Pool.add(single.out, out, ref_out)
            _Pool.add(single.final, states[rec.steps], ref_states[rec.steps])
            per_trace[name][trace.name] = {
                "output_rel_err": _Pool.ratio(single.out),
                "final_state_rel_err": _Pool.ratio(single.final),
            }
            if cfg.window > rec.steps:
                warnings.append(
                    f"{name}: window {cfg.window} is longer than trace {trace.name}'s {rec.steps} records, "
                    "so no boundary falls inside it (only the load and the record rounding are measured)"
                )
            bpe[name] += weight * cfg.bytes_per_element(rec.d_k, rec.d_v)
            buffer[name] += trace.streams * cfg.record_buffer_bytes(rec.d_k, rec.d_v, decay_values)
    report = {}
    for name, cfg in configs.items():
        pool = pools[name]
        report[name] = {
            "output_rel_err": _Pool.ratio(pool.out),
            "state_rel_err": [[s, _Pool.ratio(pool.states[s])] for s in sorted(pool.states)],
            "final_state_rel_err": _Pool.ratio(pool.final),
            "bytes_per_element": bpe[name] / weights,
            "config": cfg.name,
            "window": cfg.window,
            "compensators": cfg.compensators,
            "smoothing": cfg.smoothing,
            "record_precision": cfg.records if cfg.window > 1 else None,
            "record_buffer_bytes_per_head": buffer[name] / heads,
            "quantizations": quantizations[name],
            "seconds": round(seconds[name], 3),
            "per_trace": per_trace[name],
        }
    return {
        "methods": report,
        "traces": [
            {
                "name": t.name,
                "streams": t.streams,
                "steps": t.records.steps,
                "d_k": t.records.d_k,
                "d_v": t.records.d_v,
                "meta": t.meta,
            }
            for t in traces
        ],
        "reference": "exact recurrence in float64",
        "backend": backend,
        "checkpoints": steps,
        "warnings": warnings,
    }


def _check_kernels(configs: Mapping[str, MethodConfig], traces: Sequence[Trace]) -> None:
    """Every method has a kernel and every trace's heads tile, before any trajectory is computed."""
    from ..ops import kernel_unsupported
    from ..ops.checks import untileable_head_dims

    for name, cfg in configs.items():
        reason = kernel_unsupported(cfg)
        if reason is not None:
            raise LeapQuantError(f"simulate: no Triton kernel for {name!r}: {reason}")
    for trace in traces:
        reason = untileable_head_dims(trace.records.d_k, trace.records.d_v)
        if reason is not None:
            raise LeapQuantError(f"simulate: trace {trace.name}: {reason}")
