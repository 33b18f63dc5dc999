"""Where one layer's recurrent state lives during decoding: one object per (layer, group of batch rows).

Every backend takes the model-native decode inputs that transformers hands its recurrent kernel
(``q, k [B, HV, K]`` already repeated to the value heads, ``v [B, HV, V]``, log decay ``g [B, HV]`` (GDN)
or ``[B, HV, K]`` (KDA), ``beta [B, HV]`` after its sigmoid) and returns ``o [B, HV, V]``:

* :class:`NativeState` keeps the dense fp32 state and calls the model's own recurrent function: the
  ``fp32`` method, bit-identical to the unpatched model by construction.
* :class:`DequantizedState` keeps the dequantized dense state of a per-step method and re-quantizes it
  after the model's own step (eq. 2), a fast path for the many per-step baselines (one CUDA graph replay
  per layer and token on a GPU).
* :class:`ReferenceState` keeps a :class:`~leapquant.methods.WindowedState` (any method name): the readable
  reference, on any device.
* :class:`KernelState` keeps a :class:`~leapquant.ops.pool.LeapQuantPool` or per-step pool and runs the
  Triton kernels (CUDA, or the CPU interpreter when ``TRITON_INTERPRET=1``).

All of them take the prefill's final state ``[B, HV, K, V]`` (K-first, as transformers keeps it) in
:meth:`load`, give a dense fp32 copy back from :meth:`materialize` and follow generate()'s row reordering
(beam search, contrastive search) in :meth:`select_rows`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from ..errors import LeapQuantError
from ..methods import MethodConfig, WindowedState
from ..ops.graphs import clear_failed_capture

__all__ = ["DequantizedState", "KernelState", "NativeState", "ReferenceState", "make_state"]


def _copy_without_graphs(state, memo: dict):
    """``copy.deepcopy`` of a state without its captured CUDA graphs (they address the original's tensors;
    the copy captures its own): a cache copied to reuse a prompt (transformers' documented pattern)."""
    new = state.__class__.__new__(state.__class__)
    memo[id(state)] = new
    for name, value in state.__dict__.items():
        setattr(new, name, None if name in ("_graph", "_seen") else copy.deepcopy(value, memo))
    return new


class NativeState:
    """The model's own fp32 state and recurrent function (method ``fp32``)."""

    def __init__(self, recurrent_fn: Callable) -> None:
        self.recurrent_fn = recurrent_fn
        self.state: torch.Tensor | None = None

    def load(self, state: torch.Tensor) -> None:
        self.state = state.float().clone()

    def step(self, q, k, v, g, beta, use_qk_l2norm: bool = True) -> torch.Tensor:
        out, final = self.recurrent_fn(
            q[:, None],
            k[:, None],
            v[:, None],
            g=g[:, None],
            beta=beta[:, None],
            initial_state=self.state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm,
        )
        # in place: the state keeps its address, so a CUDA graph of several steps (the layer's chunk
        # graph) chains its replays through it
        self.state.copy_(final)
        return out[:, 0].float()

    def materialize(self) -> torch.Tensor:
        return self.state.clone()

    def snapshot(self) -> dict:
        """What :meth:`restore` needs to go on bit for bit (tensors not copied)."""
        return {"state": self.state}

    def restore(self, snap: dict) -> None:
        """Take a :meth:`snapshot` of a state of the same method and shape: in place, so that a captured
        graph reading this state's tensors stays valid."""
        _copy_into(self.state, snap["state"], "state")

    def select_rows(self, rows: torch.Tensor) -> None:
        self.state = self.state[rows]


class DequantizedState(NativeState):
    """A per-step method (window 1, no compensators) as the model's recurrent function followed by the
    format's round trip: ``S_t = dequant(quant(decay * S_{t-1} + k u^T))`` (paper eq. 2).

    The same arithmetic as :class:`ReferenceState` at window 1, in a few launches instead of dozens (the
    evaluation harness runs a dozen such methods side by side on the GPU).
    """

    def __init__(self, config: MethodConfig, recurrent_fn: Callable, *, graphs: bool = True) -> None:
        super().__init__(recurrent_fn)
        self.config = config
        self.graphs = graphs
        self._window: WindowedState | None = None
        # CUDA: the round trip is dozens of small launches per layer and token (a format's scales, rounding,
        # rotations), replayed as one CUDA graph per state shape; None until captured, False if a format
        # cannot be captured (then it runs eagerly)
        self._graph: tuple | bool | None = None

    def _eager_round_trip(self, state: torch.Tensor) -> torch.Tensor:
        b, hv, d_k, d_v = state.shape
        window = self._window
        if window is None or window.batch != b * hv or window.device != state.device:
            # built once per shape, not per token: load() quantizes, the buffers are reused
            window = WindowedState(self.config, b * hv, d_k, d_v, dtype=torch.float32, device=state.device)
            self._window = window
        window.load(state.reshape(b * hv, d_k, d_v))
        return window.materialize().reshape(b, hv, d_k, d_v)

    def _round_trip(self, state: torch.Tensor) -> torch.Tensor:
        if (
            not self.graphs
            or state.device.type != "cuda"
            or self._graph is False
            or self.config.stochastic
            or torch.cuda.is_current_stream_capturing()  # inside the layer's chunk graph: part of it
        ):
            return self._eager_round_trip(state)
        if self._graph is None or self._graph[1][0].shape != state.shape:
            # two warm-up runs off the capture: lazily built constants, cuBLAS workspaces
            self._graph = _capture(self._eager_round_trip, (state.clone(),), warmup=2)
            if self._graph is False:
                return self._eager_round_trip(state)
        graph, (static_in,), static_out = self._graph
        static_in.copy_(state)
        graph.replay()
        # static_out is overwritten by the next replay, after the model's step has consumed it
        return static_out

    __deepcopy__ = _copy_without_graphs

    def load(self, state: torch.Tensor) -> None:
        self.state = self._round_trip(state.float()).clone()  # its own tensor, updated in place from now

    def step(self, q, k, v, g, beta, use_qk_l2norm: bool = True) -> torch.Tensor:
        out = super().step(q, k, v, g, beta, use_qk_l2norm)
        self.state.copy_(self._round_trip(self.state))
        return out


def _copy_into(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise LeapQuantError(
            f"snapshot: saved {name} is {tuple(src.shape)} {src.dtype}, "
            f"this state's {tuple(dst.shape)} {dst.dtype}"
        )
    dst.copy_(src)


def _capture(fn: Callable, static_in: tuple, warmup: int = 0):
    """``(graph, static_in, static_out)`` replaying ``fn(*static_in)``, or False if ``fn`` cannot be captured
    (a host synchronisation inside it). ``warmup`` runs of ``fn`` go first, off the capture (only for a
    ``fn`` without side effects: a stateful step must not run twice).

    capture_begin/end on a side stream, not the ``torch.cuda.graph`` context: that one runs gc.collect() and
    empties the allocator's cache at every capture, which happens once per layer and ``generate()`` call,
    inside the decode a user times."""
    device = static_in[0].device
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn(*static_in)
            graph.capture_begin()
            try:
                static_out = fn(*static_in)
            finally:
                graph.capture_end()
    except RuntimeError:
        clear_failed_capture(device)  # synchronizes the device first
        return False
    finally:
        torch.cuda.current_stream(device).wait_stream(side)
    return graph, static_in, static_out


class ReferenceState:
    """A :class:`WindowedState` over ``B * HV`` heads (``dtype`` float32 by default, float64 for checks)."""

    def __init__(self, config: MethodConfig, *, dtype: torch.dtype = torch.float32) -> None:
        self.config = config
        self.dtype = dtype
        self.window: WindowedState | None = None
        self.shape: tuple[int, int, int, int] | None = None

    def load(self, state: torch.Tensor) -> None:
        b, hv, d_k, d_v = state.shape
        self.shape = (b, hv, d_k, d_v)
        self.window = WindowedState(self.config, b * hv, d_k, d_v, dtype=self.dtype, device=state.device)
        self.window.load(state.reshape(b * hv, d_k, d_v))

    def step(self, q, k, v, g, beta, use_qk_l2norm: bool = True) -> torch.Tensor:
        from ..ops.leapquant_decode.naive import native_to_general

        b, hv, d_k, d_v = self.shape
        native = (x.to(self.dtype) for x in (q, k, v, g, beta))
        _, kw, rv, v, q = native_to_general(*native, use_qk_l2norm=use_qk_l2norm)
        decay = g.to(self.dtype).exp()
        decay = decay[..., None].expand(b, hv, d_k) if decay.ndim == 2 else decay
        flat = [x.reshape(b * hv, -1) for x in (decay, kw, rv, v, q)]
        return self.window.step(*flat).reshape(b, hv, d_v).float()

    def materialize(self) -> torch.Tensor:
        return self.window.materialize().reshape(self.shape).float()

    def snapshot(self) -> dict:
        """The windowed state's evolving tensors and counters (:meth:`WindowedState.snapshot`)."""
        return {"shape": self.shape, "window": self.window.snapshot()}

    def restore(self, snap: dict) -> None:
        """Take a :meth:`snapshot` of a state of the same method and shape."""
        if tuple(snap["shape"]) != self.shape:
            raise LeapQuantError(
                f"snapshot: saved state of shape {tuple(snap['shape'])}, this one {self.shape}"
            )
        self.window.restore(snap["window"])

    def select_rows(self, rows: torch.Tensor) -> None:
        _, hv, d_k, d_v = self.shape
        heads = (
            rows.to(self.window.device)[:, None] * hv + torch.arange(hv, device=self.window.device)
        ).flatten()
        self.window.take(heads)
        self.shape = (rows.numel(), hv, d_k, d_v)


class KernelState:
    """A Triton-kernel pool, one slot per batch row (LeapQuant pool, or per-step pool for bf16/int8).

    On CUDA a step is a few kernel launches whose host-side work (argument packing for ~35 arguments,
    input conversion, launch-shape resolution) costs more than the GPU work at small batches, so from the
    second step on the step replays a CUDA graph captured for the inputs' shapes and dtypes. The first
    step of each shape runs eagerly: it compiles the kernels and creates the pool's workspaces, and it
    advances the state as every step must (a warm-up run off the capture would apply the in-place update
    twice). The kernels keep every host-side decision fixed between steps (window positions, the close
    list and its count live on the GPU), so a replay is the eager step bit for bit.
    """

    def __init__(self, method: MethodConfig, decay: str, *, graphs: bool = True) -> None:
        self.method = method
        self.decay = decay
        self.graphs = graphs
        self.pool = None
        self.slots: torch.Tensor | None = None
        # (key, graph, static inputs, static output) once captured; False where capture failed (eager
        # from then on); None until the shape has run eagerly once
        self._graph: tuple | bool | None = None
        self._seen: tuple | None = None

    @staticmethod
    def unsupported(method: MethodConfig) -> str | None:
        """Why no kernel runs ``method`` (``None``: a per-step or a LeapQuant pool does)."""
        from ..ops import kernel_unsupported

        return kernel_unsupported(method)

    __deepcopy__ = _copy_without_graphs

    def load(self, state: torch.Tensor) -> None:
        from ..ops.leapquant_decode import load_states
        from ..ops.per_step_decode import PerStepPool
        from ..ops.pool import LeapQuantPool, PoolConfig

        self._forget_graph()
        b, hv, d_k, d_v = state.shape
        self.slots = torch.arange(b, dtype=torch.int32, device=state.device)
        if self.method.window == 1:
            self.pool = PerStepPool.allocate(self.method.codec, b, hv, d_k, d_v, device=state.device)
            self.pool.load(self.slots, state.float())
        else:
            cfg = PoolConfig(self.method, heads=hv, d_k=d_k, d_v=d_v, decay=self.decay)
            self.pool = LeapQuantPool.allocate(cfg, b, device=state.device)
            load_states(self.pool, self.slots, state.float())

    def _eager_step(self, q, k, v, g, beta, use_qk_l2norm: bool) -> torch.Tensor:
        from ..ops.leapquant_decode import leapquant_decode
        from ..ops.per_step_decode import PerStepPool, per_step_decode

        f32 = [x.float().contiguous() for x in (q, k, v, g, beta)]
        if isinstance(self.pool, PerStepPool):
            return per_step_decode(self.pool, self.slots, *f32, use_qk_l2norm=use_qk_l2norm, validate=False)
        return leapquant_decode(self.pool, self.slots, *f32, use_qk_l2norm=use_qk_l2norm, validate=False)

    def step(self, q, k, v, g, beta, use_qk_l2norm: bool = True) -> torch.Tensor:
        """One token of every row: ``o [B, HV, V]`` fp32. A replayed step returns the graph's output buffer,
        which this state's next step overwrites: the caller copies it out before then (a decode step's host
        time is its cost, so no clone here)."""
        inputs = (q, k, v, g, beta)
        if (
            not self.graphs
            or self.slots.device.type != "cuda"
            or self._graph is False
            or torch.cuda.is_current_stream_capturing()  # inside the caller's own graph: be part of it
        ):
            return self._eager_step(*inputs, use_qk_l2norm)
        key = (q.shape, k.shape, v.shape, g.shape, beta.shape, q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype,
               use_qk_l2norm)  # fmt: skip
        if self._graph is None or self._graph[0] != key:
            if self._seen != key:  # the first step of this shape: eager (compiles, allocates, advances)
                self._graph, self._seen = None, key
                return self._eager_step(*inputs, use_qk_l2norm)
            self._graph = self._capture(key, inputs, use_qk_l2norm)
            if self._graph is False:
                return self._eager_step(*inputs, use_qk_l2norm)
        _, graph, static_in, static_out = self._graph
        torch._foreach_copy_(static_in, inputs)  # one launch for the five inputs (dtypes match)
        graph.replay()
        return static_out

    def _capture(self, key: tuple, inputs: tuple, use_qk_l2norm: bool):
        """``(key, graph, static inputs, static output)`` of one step, or False if it cannot be captured.
        Capturing launches nothing: the pool is unchanged until the first replay (so no warm-up runs)."""
        # the inputs' own dtypes: the conversion to fp32 is captured, and the copy in stays one launch
        static_in = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in inputs)
        captured = _capture(lambda *x: self._eager_step(*x, use_qk_l2norm), static_in)
        return False if captured is False else (key, *captured)

    def _forget_graph(self) -> None:
        """The pool's tensors were replaced (load, select_rows): a graph would address the old ones."""
        self._graph = None if self._graph is not False else False
        self._seen = None

    def materialize(self) -> torch.Tensor:
        from ..ops.leapquant_decode import materialize_states
        from ..ops.per_step_decode import PerStepPool

        if isinstance(self.pool, PerStepPool):
            return self.pool.materialize(self.slots)
        return materialize_states(self.pool, self.slots)

    def _pool_tensors(self) -> dict[str, torch.Tensor]:
        from ..ops.per_step_decode import PerStepPool

        if isinstance(self.pool, PerStepPool):
            return {
                "state": self.pool.state,
                **({"scale": self.pool.scale} if self.pool.scale is not None else {}),
            }
        return dict(self.pool.tensors)

    def snapshot(self) -> dict:
        """The pool's tensors (codes, scales, records, tokens, window positions) and slots."""
        return {"slots": self.slots, "pool": self._pool_tensors()}

    def restore(self, snap: dict) -> None:
        """Take a :meth:`snapshot` of a pool of the same method and shape, in place: the captured step
        graph keeps addressing the pool's tensors."""
        _copy_into(self.slots, snap["slots"], "slots")
        mine = self._pool_tensors()
        if set(mine) != set(snap["pool"]):
            raise LeapQuantError(
                f"snapshot: saved pool tensors {sorted(snap['pool'])}, this pool {sorted(mine)}"
            )
        for name, t in mine.items():
            _copy_into(t, snap["pool"][name], name)

    def select_rows(self, rows: torch.Tensor) -> None:
        from ..ops.per_step_decode import PerStepPool

        # Rows may repeat (beam search keeps a beam twice): copy slots, never alias them.
        self._forget_graph()
        rows = rows.to(self.slots.device).long()
        if isinstance(self.pool, PerStepPool):
            self.pool.state = self.pool.state[rows].clone()
            if self.pool.scale is not None:
                self.pool.scale = self.pool.scale[rows].clone()
        else:
            for name, t in list(self.pool.tensors.items()):
                self.pool.tensors[name] = t[rows].clone()
            for key in [k for k in self.pool.__dict__ if k not in ("config", "tensors")]:
                del self.pool.__dict__[key]  # workspaces are sized by the slot count
        self.slots = torch.arange(rows.numel(), dtype=torch.int32, device=self.slots.device)


def make_state(
    config: MethodConfig,
    *,
    backend: str,
    device: torch.device,
    decay: str,
    recurrent_fn: Callable,
    graphs: bool = True,
    head_dims: tuple[int, int] | None = None,
):
    """The state object for method ``config`` on ``device``.

    ``backend``: ``"auto"`` (kernels on CUDA when the method has one; per-step methods as the model's own
    step plus the format's round trip; the reference otherwise),
    ``"reference"``, ``"triton"`` (error if the method has no kernel) or ``"reference64"`` (float64).
    ``graphs``: on CUDA, replay each step (kernel pools) or round trip (per-step formats) as a captured
    CUDA graph; False launches eagerly every time.
    ``head_dims``: ``(d_k, d_v)`` of the states it will load, where known: ``"auto"`` then keeps heads the
    kernels cannot tile (sizes that are not powers of two) on the reference, and ``"triton"`` refuses them
    here rather than at the first load.
    """
    from ..ops.checks import triton_cannot_run_on, untileable_head_dims

    if config.name == "fp32":
        return NativeState(recurrent_fn)
    untileable = None if head_dims is None else untileable_head_dims(*head_dims)
    if untileable is not None and backend == "triton":
        raise LeapQuantError(f"backend 'triton': {untileable}")
    if backend == "auto":
        if device.type == "cuda" and untileable is None and KernelState.unsupported(config) is None:
            return KernelState(config, decay, graphs=graphs)
        if config.window == 1 and not config.compensators:
            return DequantizedState(config, recurrent_fn, graphs=graphs)
        backend = "reference"
    if backend == "triton":
        reason = KernelState.unsupported(config)
        if reason is not None:
            raise LeapQuantError(f"backend 'triton': no kernel for method {config.name!r}: {reason}")
        if (problem := triton_cannot_run_on(device)) is not None:
            raise LeapQuantError(f"backend 'triton': {problem}")
        return KernelState(config, decay, graphs=graphs)
    if backend in ("reference", "reference64"):
        return ReferenceState(config, dtype=torch.float64 if backend == "reference64" else torch.float32)
    raise LeapQuantError(f"unknown backend {backend!r}; expected auto, reference, reference64 or triton")
