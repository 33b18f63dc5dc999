"""From a serving engine's linear-attention batch metadata to LeapQuant pool calls (no vLLM import).

vLLM keeps a hybrid model's recurrent states in per-layer tensors of ``[slots, ...]``, one slot per cached
block, and describes each forward pass by an attention-metadata object. This module turns that description
into :func:`~leapquant.ops.leapquant_decode.leapquant_decode` (decode tokens), a full-precision prefill over
materialized states, and :func:`~leapquant.ops.leapquant_decode.load_states` (the prefill hand-off). It reads
the metadata by attribute name only, so it runs against vLLM's own objects and against the plain mirror
:class:`LinearAttentionBatch` that tests and other engines build.

The fields read are those of vLLM's ``GDNAttentionMetadata`` (``vllm/v1/attention/backends/gdn_attn.py``),
identical in vLLM 0.32.0 (tested end to end on the CPU) and the vLLM main-branch snapshots of that file we
read: ``num_prefills``, ``num_prefill_tokens``, ``num_decodes``, ``num_decode_tokens``, ``num_spec_decodes``,
``num_actual_tokens``, ``has_initial_state``, ``non_spec_query_start_loc``, ``non_spec_state_indices_tensor``.
vLLM orders a batch decodes first, then prefills. The adapter skips rows whose slot is ``-1``
(``PAD_SLOT_ID``); vLLM 0.32 pads a CUDA-graph decode batch with block 0 instead (``NULL_BLOCK_ID``, a
scratch block), so a CUDA port must map those rows to ``-1`` before the call (the CPU backend the plugin
runs on does not pad).

Token tensors are token-major as vLLM's layers hold them: ``q, k [T, H, K]``, ``v [T, HV, V]``, raw gates
``a [T, HV]`` (GDN) or ``[T, HV, K]`` (KDA), raw ``b [T, HV]``; outputs ``[T, HV, V]``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ...errors import LeapQuantError
from ...methods.config import MethodConfig
from ...ops.pool import LeapQuantPool, PoolConfig, pool_unsupported

_log = logging.getLogger(__name__)

__all__ = [
    "LinearAttentionBatch",
    "PrefillFn",
    "paged_pool",
    "pool_config",
    "pool_view",
    "run_linear_attention",
    "state_dtypes",
    "state_names",
    "state_shapes",
]

# A prefill over full-precision states: ``(q, k, v, a, b, initial [N, HV, K, V] fp32, cu_seqlens [N+1])`` ->
# ``(o [T, HV, V], final [N, HV, K, V] fp32)``, gates raw as the layer holds them.
PrefillFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def pool_config(method: MethodConfig, *, heads: int, d_k: int, d_v: int, decay: str) -> PoolConfig:
    """The pool layout of ``method`` for one layer's ``heads`` local value heads (after tensor-parallel
    sharding). Raises :class:`LeapQuantError` naming the method if it has no pool layout."""
    reason = pool_unsupported(method)
    if reason is not None:
        raise LeapQuantError(f"leapquant_method {method.name!r} has no pool layout: {reason}")
    return PoolConfig(method, heads=heads, d_k=d_k, d_v=d_v, decay=decay)


def state_names(config: PoolConfig) -> tuple[str, ...]:
    """Names of the pool tensors in the order an engine allocates them (``payload, scale, ..., pos``)."""
    return tuple(config.shapes(1))


def state_shapes(config: PoolConfig) -> tuple[tuple[int, ...], ...]:
    """Per-slot shapes of the pool tensors, in :func:`state_names` order."""
    return tuple(shape[1:] for shape, _ in config.shapes(1).values())


def state_dtypes(config: PoolConfig) -> tuple[torch.dtype, ...]:
    """Dtypes of the pool tensors, in :func:`state_names` order."""
    return tuple(dtype for _, dtype in config.shapes(1).values())


def pool_view(config: PoolConfig, tensors: Sequence[torch.Tensor]) -> LeapQuantPool:
    """A :class:`LeapQuantPool` over an engine's state tensors (no copy).

    ``tensors`` are ``[slots, *shape]`` views in :func:`state_shapes` order; the slot axis may be strided
    (vLLM packs every tensor of a slot into one page), the rest of each tensor must be contiguous.
    """
    names = state_names(config)
    if len(tensors) != len(names):
        raise LeapQuantError(f"pool view: {len(tensors)} state tensors given, the layout has {len(names)}")
    slots = tensors[0].shape[0]
    view = {}
    for name, t, (shape, dtype) in zip(names, tensors, config.shapes(slots).values(), strict=True):
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise LeapQuantError(
                f"pool view: state {name} is {t.dtype} {tuple(t.shape)}, the layout needs {dtype} {shape}"
            )
        if not t[0].is_contiguous():
            raise LeapQuantError(f"pool view: state {name} is not contiguous within a slot")
        view[name] = t
    return LeapQuantPool(config, view)


def paged_pool(
    config: PoolConfig, slots: int, *, lead_bytes: int = 0, page_bytes: int | None = None, device="cpu"
) -> tuple[torch.Tensor, LeapQuantPool]:
    """``(pages, pool)``: a pool laid out as vLLM lays out a layer's state (``MambaBase.bind_kv_cache``), for
    tests and benchmarks. ``pages`` is ``[slots, page_bytes]`` int8, zeros; each page holds ``lead_bytes``
    (vLLM's conv state) then the pool tensors of one slot in :func:`state_names` order, then padding up to
    ``page_bytes`` (default: no padding). The pool's slots hold zeros, not a reset state."""
    need = lead_bytes + config.bytes_per_slot()
    page_bytes = need if page_bytes is None else page_bytes
    if page_bytes < need:
        raise LeapQuantError(f"paged pool: a page of {page_bytes} B cannot hold {need} B")
    pages = torch.zeros(slots, page_bytes, dtype=torch.int8, device=device)
    offset, tensors = lead_bytes, []
    for shape, dtype in zip(state_shapes(config), state_dtypes(config), strict=True):
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if offset % torch.empty((), dtype=dtype).element_size():
            raise LeapQuantError(f"paged pool: a {dtype} tensor would start at byte {offset}, misaligned")
        tensors.append(pages[:, offset : offset + nbytes].view(dtype).view(-1, *shape))
        offset += nbytes
    return pages, pool_view(config, tensors)


@dataclass
class LinearAttentionBatch:
    """The fields of vLLM's ``GDNAttentionMetadata`` the adapter reads (same names and meaning).

    ``non_spec_state_indices_tensor``: ``[num_decodes + num_prefills]`` (or longer, padded with -1) int32
    slots; ``non_spec_query_start_loc``: ``[num_decodes + num_prefills + 1]`` int32 token offsets;
    ``has_initial_state``: ``[num_decodes + num_prefills]`` bool (None when there is no prefill).
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_actual_tokens: int
    non_spec_state_indices_tensor: torch.Tensor
    non_spec_query_start_loc: torch.Tensor
    has_initial_state: torch.Tensor | None = None
    num_spec_decodes: int = 0


def run_linear_attention(
    pool: LeapQuantPool,
    batch,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    prefill: PrefillFn,
    out: torch.Tensor,
    backend: str = "auto",
) -> None:
    """One forward pass of a linear-attention layer over ``pool``: writes ``out [T, HV, V]`` in place.

    Decode rows step through the quantized state (window records, compensator tokens, smoothing: the
    method's state as stored); prefill rows start from their slot's materialized state (zeros for a new
    sequence), run ``prefill`` in full precision and hand the final state back in the pool's format, so
    chunked prefill and prefix-cache hits continue from the state as stored. Slots outside the batch and
    padded rows (slot -1) are never touched. A prefill that leaves a head's state non-finite (an overflow
    upstream) logs an error and stores that head as NaN rather than raising, which would end every
    request of the engine: that request's outputs stay non-finite, as with the engine's own fp32 state
    (through window closes on the CPU the plugin runs on; the CUDA close's channel maxima drop NaN, so a
    head without compensator tokens would come out of its next close finite there).
    """
    from ...ops.leapquant_decode import leapquant_decode, load_states, materialize_states

    if batch.num_spec_decodes:
        raise LeapQuantError(
            "leapquant: speculative decoding is not supported (the record ring does not roll back yet)"
        )
    idx = batch.non_spec_state_indices_tensor
    n_dec, t_dec = batch.num_decodes, batch.num_decode_tokens
    if not batch.num_prefills:
        # decode-only: a CUDA-graph batch is padded to num_actual_tokens rows (slot -1 rows are skipped)
        n_dec = t_dec = batch.num_actual_tokens
    if t_dec:
        tokens = [x[:t_dec] for x in (q, k, v, a, b)]
        out[:t_dec] = leapquant_decode(
            pool, idx[:n_dec], *tokens, A_log=A_log, dt_bias=dt_bias, beta_sigmoid=True, backend=backend
        )
    if not batch.num_prefills:
        return
    lo, hi = t_dec, t_dec + batch.num_prefill_tokens
    slots = idx[n_dec : n_dec + batch.num_prefills]
    cu = batch.non_spec_query_start_loc[n_dec : n_dec + batch.num_prefills + 1] - t_dec
    cfg = pool.config
    initial = torch.zeros(slots.shape[0], cfg.heads, cfg.d_k, cfg.d_v, dtype=torch.float32, device=q.device)
    has_initial = batch.has_initial_state[n_dec : n_dec + batch.num_prefills].to(torch.bool)
    if bool(has_initial.any()):
        initial[has_initial] = materialize_states(pool, slots[has_initial], layout="kv", backend=backend)
    o, final = prefill(q[lo:hi], k[lo:hi], v[lo:hi], a[lo:hi], b[lo:hi], initial, cu)
    out[lo:hi] = o
    try:
        load_states(pool, slots, final, layout="kv", backend=backend)  # checks finiteness before any write
        return
    except LeapQuantError:
        bad = ~torch.isfinite(final).flatten(2).all(2)  # [N, HV]
        if not bool(bad.any()):
            raise
    # One request's overflow must not end every request of the engine (load_states refuses a non-finite
    # state): its heads are stored as NaN, so that its outputs stay non-finite from here as an fp32 state's
    # would, and the other heads and slots are stored as usual.
    rows, heads = bad.nonzero(as_tuple=True)
    _log.error(
        "leapquant: the prefill left a non-finite (NaN/Inf) state in slot(s) %s (heads %s); those heads are "
        "stored as NaN and their requests' outputs will not be finite",
        slots[rows].tolist(),
        heads.tolist(),
    )
    load_states(pool, slots, final.masked_fill(bad[:, :, None, None], 0.0), layout="kv", backend=backend)
    poison = pool.tensors["scale"] if "scale" in pool.tensors else pool.tensors["payload"]
    poison[slots[rows].long(), heads] = float("nan")


def reference_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    initial: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A readable fp32 :data:`PrefillFn`: the GDN/KDA recurrence token by token, as FLA computes it (decay
    before the delta read, q/k L2-normalised, ``scale = K**-0.5``). ``initial`` is ``[N, HV, K, V]``."""
    from ...ops.leapquant_decode.naive import activate_gate, native_to_general

    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    final = initial.float().clone()
    bias = None if dt_bias is None else dt_bias.float()
    bounds = cu_seqlens.tolist()
    for n in range(len(bounds) - 1):
        state = final[n]  # [HV, K, V]
        for t in range(bounds[n], bounds[n + 1]):
            g = activate_gate(a[t : t + 1].float(), A_log.float(), bias)
            native = (x[t : t + 1].float() for x in (q, k, v))
            g, kw, rv, vt, qt = native_to_general(*native, g, torch.sigmoid(b[t : t + 1].float()))
            decay = g[0].exp()  # [HV] or [HV, K]
            decay = decay[:, None, None] if decay.ndim == 1 else decay[:, :, None]
            u = vt[0] - torch.einsum("hkv,hk->hv", state, rv[0])  # u = v - S^T b, b = a k
            state = decay * state + kw[0][:, :, None] * u[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", state, qt[0])
        final[n] = state
    return out, final
