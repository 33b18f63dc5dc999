"""One patched layer's states for the rows of a batch (:mod:`leapquant.integrations.transformers`).

A cache holds a :class:`RowGroups` per patched layer: the batch split into equal groups of rows, each
under its method's state (:mod:`leapquant.integrations.backends`), following the cache's row order and
replaying multi-token calls as CUDA graphs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..errors import LeapQuantError
from .backends import make_state

if TYPE_CHECKING:
    from .transformers import LeapQuantPatch, _LayerKind

__all__ = ["RowGroups"]

# per layer: the multi-token shapes whose step loop is kept as a CUDA graph (a recall run uses three: the
# context chunk, its remainder and the query prompt)
_CHUNK_GRAPHS_KEPT = 4
# longer calls run eagerly: a graph holds a few nodes per token and group, and its capture costs an eager run
_CHUNK_GRAPH_MAX_TOKENS = 512


class RowGroups:
    """One layer's states for the rows of a batch: ``len(methods)`` equal groups of rows."""

    def __init__(
        self,
        patched: LeapQuantPatch,
        layer_idx: int,
        kind: _LayerKind,
        recurrent_fn: Callable,
        state: torch.Tensor,
    ):
        b = state.shape[0]
        groups = len(patched.methods)
        if b % groups:
            raise LeapQuantError(
                f"a batch of {b} rows cannot be split evenly over {groups} methods "
                f"({', '.join(m.name for m in patched.methods)})"
            )
        self.size = b // groups
        self.owner = patched  # a later patch of the model takes these states over (_PatchedLayer.run)
        self.handle_seen: torch.Tensor | None = None  # the cache tensor whose rows were last read
        self.states = []
        for i, plan in enumerate(patched.methods):
            st = make_state(
                plan.for_layer(layer_idx),
                backend=patched.backend,
                graphs=patched.graphs,
                device=state.device,
                decay=kind.decay,
                recurrent_fn=recurrent_fn,
                head_dims=(state.shape[2], state.shape[3]),
            )
            st.load(state[i * self.size : (i + 1) * self.size])
            self.states.append(st)
        self.graphs = patched.graphs
        # multi-token calls on CUDA: {key: (graph, static inputs, static output)}, the keys that have run
        # eagerly once, and those whose capture failed (see step_chunk)
        self._chunk_graphs: dict[tuple, tuple] = {}  # least recently replayed first
        self._chunk_seen: set[tuple] = set()
        self._chunk_uncapturable: set[tuple] = set()
        self._own_capture = False
        self._handle: torch.Tensor | None = None  # row_handle's tensor

    def __deepcopy__(self, memo: dict) -> RowGroups:
        """A copied cache (transformers' way to reuse a prompt) shares the patch and its model, and copies
        the states: copying the owner would copy the model, and the copy's states would then count as an
        earlier patch's and be quantized again."""
        memo[id(self.owner)] = self.owner
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        graphs = ("_chunk_graphs", "_chunk_seen", "_chunk_uncapturable")  # they address our tensors
        for name, value in self.__dict__.items():
            setattr(new, name, type(value)() if name in graphs else copy.deepcopy(value, memo))
        return new

    def row_handle(self, batch: int, device: torch.device) -> torch.Tensor:
        """Row ids ``0..batch-1`` as ``[batch, 1, 1, 1]`` fp32: what the patched layer gives the cache in
        place of its dense state (:meth:`follow` reads them back).  The cache copies it into a tensor of its
        own (a static address for CUDA graphs) and reorders only that, so one tensor serves every step."""
        h = self._handle
        if h is None or h.shape[0] != batch or h.device != device:
            h = self._handle = torch.arange(batch, dtype=torch.float32, device=device).view(batch, 1, 1, 1)
        return h

    def step(self, q, k, v, g, beta, use_qk_l2norm: bool) -> torch.Tensor:
        """One token: ``o [B, HV, V]`` fp32. It may be a state's reused output buffer (a replayed
        :class:`KernelState` step), which the next step overwrites: copy it out before then."""
        if q.is_cuda and not self._own_capture and torch.cuda.is_current_stream_capturing():
            self._check_capturable()
        if len(self.states) == 1:  # no slicing, no concatenation: host time is a decode step's cost
            return self.states[0].step(q, k, v, g, beta, use_qk_l2norm)
        outs = []
        for i, st in enumerate(self.states):
            rows = slice(i * self.size, (i + 1) * self.size)
            outs.append(st.step(q[rows], k[rows], v[rows], g[rows], beta[rows], use_qk_l2norm))
        return torch.cat(outs)

    def step_chunk(
        self, q, k, v, g, beta, use_qk_l2norm: bool, out_dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """``T`` tokens (inputs ``[B, T, HV, ...]``) through the states one after another: ``[B, T, HV, V]``
        in ``out_dtype`` (the outputs are copied out of the states' buffers once, converted on the way).

        A multi-token call on an existing state (chunked prefill, assisted decoding, the recall evaluator's
        context) is ``T`` steps of a few launches each, bound by host work. On CUDA with graphs on, the
        whole loop replays one graph per input shape, captured at the second call of that shape (the
        first runs eagerly: it compiles, autotunes and allocates, and advances the states as every call
        must). Capturing launches nothing, so the states advance only by the replay that follows; every
        state updates its tensors in place, so each replay continues from the last. A shape that cannot
        be captured (a host synchronisation somewhere) stays eager.
        """
        if q.shape[1] == 1:  # a decode step: its host time is its cost (views, one copy out)
            q, k, v, g, beta = q.squeeze(1), k.squeeze(1), v.squeeze(1), g.squeeze(1), beta.squeeze(1)
            o = self.step(q, k, v, g, beta, use_qk_l2norm)
            return o.unsqueeze(1).to(out_dtype, copy=True)
        inputs = (q, k, v, g, beta)
        if not 1 < q.shape[1] <= _CHUNK_GRAPH_MAX_TOKENS or not self._chunk_graphable(q):
            return self._eager_chunk(*inputs, use_qk_l2norm, out_dtype)
        key = (tuple((x.shape, x.dtype, x.device) for x in inputs), use_qk_l2norm)
        if key in self._chunk_uncapturable:
            return self._eager_chunk(*inputs, use_qk_l2norm, out_dtype)
        entry = self._chunk_graphs.get(key)
        if entry is None:
            if key not in self._chunk_seen:
                self._chunk_seen.add(key)
                return self._eager_chunk(*inputs, use_qk_l2norm, out_dtype)
            entry = self._capture_chunk(inputs, use_qk_l2norm)
            if entry is False:
                self._chunk_uncapturable.add(key)
                return self._eager_chunk(*inputs, use_qk_l2norm, out_dtype)
            if len(self._chunk_graphs) >= _CHUNK_GRAPHS_KEPT:  # each graph holds its own memory pool
                evicted = next(iter(self._chunk_graphs))  # the least recently replayed
                del self._chunk_graphs[evicted]
                self._chunk_seen.discard(evicted)  # seen again: eager once more before a recapture
            self._chunk_graphs[key] = entry
        else:
            self._chunk_graphs[key] = self._chunk_graphs.pop(key)  # most recently used last
        graph, static_in, static_out = entry
        for dst, src in zip(static_in, inputs, strict=True):
            dst.copy_(src)
        graph.replay()
        return static_out.to(out_dtype, copy=True)  # the next replay overwrites static_out

    def _eager_chunk(
        self, q, k, v, g, beta, use_qk_l2norm: bool, out_dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        # each step's output is copied out before the next step, which may overwrite its buffer
        out = None
        for t in range(q.shape[1]):
            o = self.step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], use_qk_l2norm)
            if out is None:
                out = o.new_empty((o.shape[0], q.shape[1], *o.shape[1:]), dtype=out_dtype)
            out[:, t] = o
        return out

    def _chunk_graphable(self, q: torch.Tensor) -> bool:
        """Whether every state of these rows can run inside the layer's chunk graph (CUDA, graphs on)."""
        from .backends import DequantizedState, KernelState, NativeState

        if not (self.graphs and q.is_cuda) or torch.cuda.is_current_stream_capturing():
            return False
        for st in self.states:
            # the reference keeps its window position on the host; stochastic rounding draws host-seeded noise
            if isinstance(st, DequantizedState) and st.config.stochastic:
                return False
            if not isinstance(st, (KernelState, NativeState)):
                return False
        return True

    def _capture_chunk(self, inputs: tuple, use_qk_l2norm: bool) -> tuple | bool:
        from .backends import _capture

        static_in = tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in inputs)
        self._own_capture = True
        try:
            return _capture(lambda *x: self._eager_chunk(*x, use_qk_l2norm), static_in)
        finally:
            self._own_capture = False

    def _check_capturable(self) -> None:
        """Inside a CUDA graph the caller captures, only kernel pools are supported. The reference keeps its
        window position on the host, which a replay would never advance; the fp32 and per-step round-trip
        states update in place but are captured only by the layer's own chunk graph (:meth:`step_chunk`),
        after an eager call has built their buffers."""
        from .backends import KernelState

        for st in self.states:
            if not isinstance(st, KernelState):
                raise LeapQuantError(
                    f"a CUDA graph capture reached a patched layer whose state ({type(st).__name__}) is not "
                    "a kernel pool: only methods with decode kernels (KernelState.unsupported(method) is "
                    "None) can run inside a captured graph"
                )

    def materialize(self) -> torch.Tensor:
        return torch.cat([st.materialize() for st in self.states])

    def snapshot(self) -> dict:
        """Each group's state snapshot, named by its kind (fp32, round trip, reference, kernel pool)."""
        return {
            "size": self.size,
            "kinds": [type(st).__name__ for st in self.states],
            "states": [st.snapshot() for st in self.states],
        }

    def restore(self, snap: dict) -> None:
        """Take a :meth:`snapshot` of a layer with the same groups of rows under the same kinds of state."""
        kinds = [type(st).__name__ for st in self.states]
        if snap["size"] != self.size or snap["kinds"] != kinds:
            raise LeapQuantError(
                f"snapshot: saved {snap['kinds']} over groups of {snap['size']} rows, this layer {kinds} "
                f"over {self.size} (another device or backend?)"
            )
        for st, saved in zip(self.states, snap["states"], strict=True):
            st.restore(saved)

    def follow(self, handle: torch.Tensor) -> None:
        """Take the row order of the cache tensor ``handle`` where it is one not read yet: the first decode
        step, or a cache that replaced its tensor (reorder_cache's index_select for beam search,
        offload/prefetch). Its rows say which of our rows each batch row now is. Reading them synchronizes
        with the GPU, so it is done only then: transformers copies our handle into the same tensor at every
        step (a static address for CUDA graphs), which then holds 0..B-1 again."""
        if handle is self.handle_seen:
            return
        rows = handle.reshape(handle.shape[0], -1)[:, 0].round().long()
        if rows.numel() != self.size * len(self.states) or not torch.equal(
            rows, torch.arange(rows.numel(), device=rows.device)
        ):
            self.select_rows(rows)
        self.handle_seen = handle

    def select_rows(self, rows: torch.Tensor) -> None:
        # the states' tensors are replaced below: graphs addressing them go first, even if a check fails
        self._chunk_graphs.clear()
        self._chunk_seen.clear()
        self._chunk_uncapturable.clear()
        groups = len(self.states)
        if rows.numel() % groups:
            raise LeapQuantError(f"generate() kept {rows.numel()} rows, not a multiple of {groups} methods")
        size = rows.numel() // groups
        for i, st in enumerate(self.states):
            mine = rows[i * size : (i + 1) * size] - i * self.size
            if groups > 1 and ((mine < 0) | (mine >= self.size)).any():
                raise LeapQuantError("generate() moved rows between method groups; use one method per batch")
            st.select_rows(mine)
        self.size = size
