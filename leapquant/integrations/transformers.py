"""LeapQuant state inside transformers' hybrid models: one call, ``generate()`` unchanged.

``patch(model, method="leapquant-int8")`` reroutes the recurrent state of every linear-attention layer of a
loaded model (Qwen3.5 dense and MoE, including the text path of ``Qwen3_5ForConditionalGeneration``,
Qwen3-Next, Kimi-Linear) through a LeapQuant (or any other method's) state:

* **Prefill** runs the model's own chunked kernel; its final fp32 state is quantized into the method's
  state (the prefill hand-off).
* **Every decode token** goes through the method's state (:mod:`leapquant.integrations.backends`): the
  Triton kernels on CUDA when the method has one, the float reference otherwise. A multi-token call on an
  existing state (chunked prefill, assisted decoding) steps through it token by token; on CUDA that loop
  replays as one captured graph per layer and input shape (:meth:`RowGroups.step_chunk`).
* ``method="fp32"`` keeps the model's own state and recurrent function: identical to the unpatched model.

Design (why it survives transformers' cache API changes): transformers' layers call module-level kernel
functions (``torch_recurrent_gated_delta_rule`` and friends, FLA's when installed) with keyword arguments
that match FLA's API. We wrap those module globals once with a dispatcher that passes through unless a
patched layer is running (a context variable set by the patched layer's ``forward``), so unpatched models
in the same process are untouched; the last ``unpatch`` puts the original functions back. The cache keeps,
in place of each dense ``[B, HV, K, V]`` fp32 state, a ``[B, 1, 1, 1]`` tensor of row ids: the cache's own
``reorder_cache``/``batch_select_indices`` permute it, and the next step applies the same permutation to the
quantized state. The quantized states themselves are
held on the cache object (``cache._leapquant_states``), so every ``generate()`` call, which builds a new
cache, starts fresh.

``method`` may also be a sequence of names: the batch is split into that many equal groups of rows, group
``i`` under method ``i`` (the evaluation harness runs FP32 and every method side by side this way).  Any of
them may be a :class:`~leapquant.methods.LayerPlan` (or its ``.json`` file): each layer then gets the
plan's method for that layer (``leapquant calibrate`` writes one).
"""

from __future__ import annotations

import contextvars
import copy
import os
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..checks import require_triton
from ..errors import LeapQuantError
from ..methods import LayerPlan, MethodConfig, as_layer_methods, as_method
from .row_groups import RowGroups

__all__ = ["SUPPORTED_LAYERS", "LeapQuantPatch", "linear_attention_layers", "patch", "unpatch"]


@dataclass(frozen=True)
class _LayerKind:
    chunk_fn: str
    recurrent_fn: str
    decay: str  # "scalar" (GDN) or "vector" (KDA)


_GDN = _LayerKind("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "scalar")
SUPPORTED_LAYERS: dict[str, _LayerKind] = {
    "Qwen3_5GatedDeltaNet": _GDN,
    "Qwen3_5MoeGatedDeltaNet": _GDN,
    "Qwen3NextGatedDeltaNet": _GDN,
    "KimiLinearDeltaAttention": _LayerKind(
        "chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "vector"
    ),
}

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("leapquant_active_layer", default=None)
_STATES_ATTR = "_leapquant_states"


def linear_attention_layers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """``(layer_idx, module)`` of every supported linear-attention layer of ``model``, in order."""
    found = []
    for module in model.modules():
        if type(module).__name__ in SUPPORTED_LAYERS:
            found.append((int(module.layer_idx), module))
    return found


def linear_head_dims(model: torch.nn.Module) -> tuple[int, int]:
    """``(d_k, d_v)`` of the model's linear-attention heads (GDN names both; KDA has one ``head_dim``)."""
    _, first = linear_attention_layers(model)[0]
    if hasattr(first, "head_k_dim"):
        return first.head_k_dim, first.head_v_dim
    return first.head_dim, first.head_dim


# -- the module-global dispatchers -------------------------------------------------------------------


# (modeling module name) -> number of live patches using its dispatchers; at zero the originals come back
_DISPATCH_USERS: dict[str, int] = {}
_LIVE_PATCHES: weakref.WeakSet = weakref.WeakSet()


def _install_dispatchers(module_name: str, kind: _LayerKind) -> None:
    namespace = sys.modules[module_name].__dict__
    for name, chunked in ((kind.chunk_fn, True), (kind.recurrent_fn, False)):
        current = namespace.get(name)
        if current is None:
            raise LeapQuantError(f"{module_name} has no {name}: this transformers version is not supported")
        if not getattr(current, "_leapquant_dispatcher", False):
            namespace[name] = _dispatcher(current, chunked)
    _DISPATCH_USERS[module_name] = _DISPATCH_USERS.get(module_name, 0) + 1


def _release_dispatchers(module_name: str, kind: _LayerKind) -> None:
    _DISPATCH_USERS[module_name] -= 1
    if _DISPATCH_USERS[module_name] == 0:
        namespace = sys.modules[module_name].__dict__
        for name in (kind.chunk_fn, kind.recurrent_fn):
            if getattr(namespace.get(name), "_leapquant_dispatcher", False):
                namespace[name] = namespace[name].__wrapped__
        del _DISPATCH_USERS[module_name]


def _torch_kernel(fn: Callable) -> Callable:
    """The torch function under transformers' wrappers of ``fn`` (``use_kernel_func_from_hub_with_fallback``
    keeps it as ``__wrapped__``); ``fn`` itself if it is no transformers wrapper (a timing wrapper, a
    profiler).  A wrapper is transformers' if its code is: ``functools.wraps`` copies ``__module__``, not
    ``__code__``."""
    import transformers

    root = os.path.dirname(transformers.__file__) + os.sep
    while hasattr(fn, "__wrapped__") and getattr(fn, "__code__", None) is not None:
        if not fn.__code__.co_filename.startswith(root):
            break
        fn = fn.__wrapped__
    return fn


def _for_device(fn: Callable, device: torch.device) -> Callable:
    """``fn``, one of transformers' linear-attention kernel functions, or on the CPU its torch function:
    where FLA imports, transformers calls FLA's Triton kernels for tensors on any device, and those take
    CUDA tensors only."""
    return _torch_kernel(fn) if device.type == "cpu" else fn


def _dispatcher(original: Callable, chunked: bool) -> Callable:
    reference = _torch_kernel(original)

    def dispatch(query, key, value, *args, **kwargs):
        kernel = reference if query.device.type == "cpu" else original
        active = _ACTIVE.get()
        if active is None:
            return kernel(query, key, value, *args, **kwargs)
        if args:  # going around the patch would leave the state unquantized without a word
            raise LeapQuantError(
                f"{getattr(original, '__name__', 'the kernel')} was called with positional arguments past "
                "query, key and value: this transformers version is not supported by leapquant.patch"
            )
        layer, cache = active
        return layer.run(kernel, chunked, cache, query, key, value, **kwargs)

    dispatch._leapquant_dispatcher = True
    dispatch.__wrapped__ = original
    dispatch.__name__ = getattr(original, "__name__", "dispatch")
    return dispatch


# -- per-layer state (row_groups.RowGroups) and the patched layers -----------------------------------


class _StateStore(dict):
    """A cache's ``{layer_idx: RowGroups}`` (``cache._leapquant_states``).  A deep copy of the cache (to
    reuse a prompt) registers the copy with the patches owning its states, so unpatch() reaches it too."""

    def __init__(self, cache) -> None:
        super().__init__()
        self._cache = weakref.ref(cache)

    def __deepcopy__(self, memo: dict) -> _StateStore:
        new_cache = memo.get(id(self._cache()))  # copy.deepcopy(cache) made the new cache first
        new = _StateStore.__new__(_StateStore)
        memo[id(self)] = new
        new._cache = self._cache if new_cache is None else weakref.ref(new_cache)
        for idx, groups in self.items():
            new[idx] = copy.deepcopy(groups, memo)
            if new_cache is not None and groups.owner in _LIVE_PATCHES:
                groups.owner._caches.add(new_cache)
        return new


def _followed(cache, layer_idx: int, groups: RowGroups) -> RowGroups:
    """``groups`` in the row order of ``cache`` now (after a ``reorder_cache`` since the last step)."""
    groups.follow(cache.layers[layer_idx].recurrent_states[0])
    return groups


class _PatchedLayer:
    def __init__(self, patched: LeapQuantPatch, layer_idx: int, module: torch.nn.Module) -> None:
        self.patched = patched
        self.layer_idx = layer_idx
        self.module = module
        self.kind = SUPPORTED_LAYERS[type(module).__name__]
        self.recorder: Callable | None = None
        self.original_forward = module.forward
        layer = self

        def forward(*args, **kwargs):
            cache = kwargs.get("cache_params", args[1] if len(args) > 1 else None)
            token = _ACTIVE.set((layer, cache))
            try:
                return layer.original_forward(*args, **kwargs)
            finally:
                _ACTIVE.reset(token)

        module.forward = forward

    def restore(self) -> None:
        self.module.forward = self.original_forward

    def _new_groups(self, cache, store: _StateStore, state: torch.Tensor) -> RowGroups:
        """This patch's states for the dense ``state [B, HV, K, V]`` (fp32), kept in ``cache``'s store; the
        patch learns of the cache here, once, rather than at every step (unpatch writes states back)."""
        recurrent = sys.modules[type(self.module).__module__].__dict__[self.kind.recurrent_fn].__wrapped__
        recurrent = _for_device(recurrent, state.device)
        groups = store[self.layer_idx] = RowGroups(self.patched, self.layer_idx, self.kind, recurrent, state)
        self.patched._caches.add(cache)
        return groups

    def run(self, original, chunked, cache, query, key, value, *, g, beta, initial_state=None,
            output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):  # fmt: skip
        if self.recorder is not None:
            self.recorder(self.layer_idx, query, key, value, g, beta, use_qk_l2norm_in_kernel)
        if cache is None:  # a forward without a cache keeps no state: nothing to quantize
            return original(
                query,
                key,
                value,
                g=g,
                beta=beta,
                initial_state=initial_state,
                output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                **kwargs,
            )
        store = cache.__dict__.get(_STATES_ATTR)
        if store is None:
            store = cache.__dict__[_STATES_ATTR] = _StateStore(cache)
        groups = store.get(self.layer_idx)
        if groups is None and initial_state is not None:
            # a cache filled before this patch (or by the unpatched model) holds the dense state: it is the
            # prefill's hand-off, quantized here rather than dropped
            if initial_state.ndim != 4 or initial_state.shape[2:] == (1, 1):
                raise LeapQuantError(
                    "this cache's linear-attention state was written by a patch whose states it lost"
                )
            groups = self._new_groups(cache, store, initial_state.float())
            groups.handle_seen = initial_state  # its rows are in batch order: nothing to select
        if initial_state is None:
            if not chunked:
                raise LeapQuantError("a decode step reached a patched layer without a prefilled state")
            out, final = original(
                query,
                key,
                value,
                g=g,
                beta=beta,
                initial_state=None,
                output_final_state=True,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                **kwargs,
            )
            groups = self._new_groups(cache, store, final.float())
            return out, groups.row_handle(query.shape[0], query.device)
        if kwargs.get("cu_seqlens") is not None:
            raise LeapQuantError(
                "packed sequences (cu_seqlens) reached a patched layer's state, which keeps one row per "
                "batch row: pass a padded batch"
            )
        groups.follow(initial_state)
        if groups.owner is not self.patched:
            # states an earlier patch of the model left in this cache: read back as dense rows, they are
            # the hand-off to this patch's methods (as a cache filled before any patch, above)
            groups = self._new_groups(cache, store, groups.materialize())
            groups.handle_seen = initial_state
        out = groups.step_chunk(query, key, value, g, beta, use_qk_l2norm_in_kernel, out_dtype=query.dtype)
        return out, groups.row_handle(query.shape[0], query.device)


class LeapQuantPatch:
    """What :func:`patch` did to a model; :meth:`unpatch` undoes it.

    Attributes:
        methods: the :class:`LayerPlan` of each group of batch rows (one unless a sequence was given);
            a plain method is the plan giving every layer that method.
        backend: ``auto``, ``reference``, ``reference64`` or ``triton``.
        graphs: whether CUDA steps replay captured graphs (:func:`patch`).
        layers: the patched layer indices.
    """

    def __init__(
        self, model: torch.nn.Module, methods: tuple[LayerPlan, ...], backend: str, graphs: bool = True
    ) -> None:
        self.model = model
        self.methods = methods
        self.backend = backend
        self.graphs = graphs
        self._layers = [_PatchedLayer(self, idx, mod) for idx, mod in linear_attention_layers(model)]
        self._modules = {type(layer.module).__module__: layer.kind for layer in self._layers}
        for module_name, kind in self._modules.items():
            _install_dispatchers(module_name, kind)
        _LIVE_PATCHES.add(self)
        self._caches: weakref.WeakSet = weakref.WeakSet()  # caches holding these states (unpatch)

    def __deepcopy__(self, memo: dict):
        # the layers' forwards are closures over this model's modules: a copy would run the original's
        # weights, and unpatching it would switch the original's states off
        raise LeapQuantError("a patched model cannot be copied: leapquant.unpatch(model), copy, patch both")

    @property
    def layers(self) -> list[int]:
        return [layer.layer_idx for layer in self._layers]

    def states(self, cache) -> dict[int, torch.Tensor]:
        """Dense fp32 states ``[B, HV, K, V]`` that each layer's quantized state in ``cache`` stands for."""
        store = getattr(cache, _STATES_ATTR, None)
        if not store:
            raise LeapQuantError(
                "this cache holds no LeapQuant state (run a prefill through the patched model)"
            )
        return {idx: _followed(cache, idx, groups).materialize() for idx, groups in sorted(store.items())}

    def snapshot(self, cache) -> dict[int, dict]:
        """Every patched layer's method states in ``cache`` (tensors not copied): what :meth:`restore`
        needs to go on bit for bit (``leapquant eval --checkpoint`` saves it)."""
        store = getattr(cache, _STATES_ATTR, None)
        if not store:
            raise LeapQuantError(
                "this cache holds no LeapQuant state (run a prefill through the patched model)"
            )
        return {idx: _followed(cache, idx, groups).snapshot() for idx, groups in sorted(store.items())}

    def restore(self, cache, snap: dict[int, dict]) -> None:
        """Put a :meth:`snapshot` back into ``cache``, whose states a prefill of the same batch under the
        same methods built (their tensors are overwritten in place)."""
        store = getattr(cache, _STATES_ATTR, None) or {}
        if sorted(store) != sorted(snap):
            raise LeapQuantError(f"snapshot: saved layers {sorted(snap)}, this cache's {sorted(store)}")
        for idx, saved in snap.items():
            store[idx].restore(saved)

    def set_recorder(self, recorder: Callable | None) -> None:
        """Call ``recorder(layer_idx, q, k, v, g, beta, use_qk_l2norm)`` on every kernel call (traces)."""
        for layer in self._layers:
            layer.recorder = recorder

    def unpatch(self) -> None:
        """Restore the model.  Every cache these states live in gets them back as dense fp32 states, in its
        own row order, so the unpatched model (or a later patch) goes on from them."""
        for cache in list(self._caches):
            store = cache.__dict__.get(_STATES_ATTR, {})
            for idx, groups in list(store.items()):
                if groups.owner is self:
                    dense = _followed(cache, idx, groups).materialize()
                    cache.layers[idx].recurrent_states[0] = dense
                    del store[idx]
        self._caches = weakref.WeakSet()
        for layer in self._layers:
            layer.restore()
        self._layers = []
        for module_name, kind in self._modules.items():
            _release_dispatchers(module_name, kind)
        self._modules = {}
        _LIVE_PATCHES.discard(self)
        if getattr(self.model, "_leapquant_patch", None) is self:
            del self.model._leapquant_patch


def patch(
    model: torch.nn.Module,
    method: str | MethodConfig | LayerPlan | Sequence[str | MethodConfig | LayerPlan] = "leapquant-int8",
    *,
    backend: str = "auto",
    graphs: bool = True,
) -> LeapQuantPatch:
    """Route every linear-attention layer's decode state of ``model`` through ``method``.

    Args:
        model: a loaded transformers model with Gated DeltaNet or KDA layers (``Qwen3_5ForCausalLM``,
            ``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForCausalLM``, ``Qwen3NextForCausalLM``,
            ``KimiLinearForCausalLM``).
        method: a method name (``leapquant methods`` lists them), a :class:`MethodConfig`, a
            :class:`LayerPlan` or the path of a saved plan (``*.json``: a method per layer), or a sequence
            of them, one per equal group of batch rows.
        backend: ``"auto"`` (Triton kernels on CUDA where the method has one, else the reference),
            ``"reference"`` (float32), ``"reference64"`` (float64) or ``"triton"``.
        graphs: on CUDA, replay each layer's decode step as a CUDA graph captured at its second step
            (a step is a few launches whose host work outweighs the GPU work at small batches); False
            launches them eagerly. Inside a graph the caller captures, kernel methods launch into it;
            other states (fp32 rows, per-step formats through the model's step, the reference) raise.

    Returns:
        A :class:`LeapQuantPatch`; call ``.unpatch()`` to restore the model. Patching a patched model
        replaces the previous patch. A cache filled before the patch, or under an earlier one, goes on
        from the state it holds (read back dense, then kept in this patch's methods).
    """
    if isinstance(method, os.PathLike):
        method = os.fspath(method)
    if isinstance(method, (str, MethodConfig, LayerPlan)):
        method = (method,)
    elif not isinstance(method, Sequence):
        as_method(method, "patch: method")  # raises, naming what it got
    # names become configs here, once: an unknown name fails before the model is touched
    methods = tuple(as_layer_methods(m, "patch: method") for m in method)
    if not methods:
        raise LeapQuantError("patch: no method given")
    if not isinstance(model, torch.nn.Module):
        hint = " (load it with AutoModelForCausalLM.from_pretrained)" if isinstance(model, str) else ""
        raise LeapQuantError(
            f"patch: model must be a loaded transformers model (torch.nn.Module), got {type(model).__name__}"
            + hint
        )
    if not isinstance(graphs, bool):
        raise LeapQuantError(f"patch: graphs must be True or False, got {graphs!r}")
    if backend not in ("auto", "reference", "reference64", "triton"):
        raise LeapQuantError(f"unknown backend {backend!r}; expected auto, reference, reference64 or triton")
    if backend == "triton":
        require_triton("patch: backend 'triton'")
    if not linear_attention_layers(model):
        raise LeapQuantError(
            f"{type(model).__name__} has no supported linear-attention layers "
            f"(supported: {', '.join(SUPPORTED_LAYERS)})"
        )
    linear = [idx for idx, _ in linear_attention_layers(model)]
    for plan in methods:
        plan.check_layers(linear)
    unpatch(model)
    patched = LeapQuantPatch(model, methods, backend, graphs)
    model._leapquant_patch = patched
    return patched


def unpatch(model: torch.nn.Module) -> None:
    """Undo :func:`patch` (no-op on a model that is not patched)."""
    previous = getattr(model, "_leapquant_patch", None)
    if previous is not None:
        previous.unpatch()
