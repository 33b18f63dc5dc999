"""The states of a decode model's linear-attention layers and the kernel that steps them (``bench decode``).

A :class:`StateBackend` is the thing ``bench decode`` compares: FLA's fp32 kernels, our per-step kernels or a
LeapQuant pool, all behind one call ``backend(layer, q, k, v, g, beta)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import LeapQuantError
from .decode import ModelSpec
from .variants import Variant

__all__ = ["StateBackend", "make_backend"]


@dataclass
class StateBackend:
    """The states of every linear-attention layer for ``batch`` sequences, and the kernel that steps them.

    ``name``: the variant's label (:mod:`.variants`): ``fp32:fla`` (FLA's ``fused_recurrent_*`` on an fp32
    ``[B, HV, K, V]`` state), a per-step method (``fp32``, ``bf16``, ``int8``: our per-step kernels) or a
    windowed method (``leapquant-int8``, ``int8/w16``, ...).  ``impl`` says what ran (``fla``,
    ``reference-fp32``, ``per-step-<fmt>`` or ``leapquant``).  Calling ``backend(layer, q, k, v, g, beta)``
    with ``q, k [B, H, K]``, ``v [B, HV, V]``, ``g [B, HV]`` (GDN) or ``[B, HV, K]`` (KDA) log decays and
    ``beta [B, HV]`` returns ``o [B, HV, V]`` in ``v``'s dtype and updates the layer's state in place (FLA's
    public op writes a new fp32 final state instead, which is dropped: the same bytes as an in-place
    update, no copy back).
    """

    name: str
    impl: str
    family: str
    states: list = field(default_factory=list)
    slots: torch.Tensor | None = None
    kernel_backend: str = "auto"
    boundary: bool = True  # False: the step alone (``:step``), windows never close
    launch: object = None  # the LaunchConfig of a windowed method (``:triton-close``, ``:cuda-close``)

    def __call__(self, layer: int, q, k, v, g, beta) -> torch.Tensor:
        st = self.states[layer]
        if self.impl == "fla":
            kw = dict(initial_state=st, output_final_state=True, use_qk_l2norm_in_kernel=True)
            q, k, v, g, beta = q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None]
            if self.family == "gdn":
                from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fn
            else:
                from fla.ops.kda import fused_recurrent_kda as fn
            return fn(q, k, v, g=g, beta=beta, **kw)[0][:, 0]  # g and beta by keyword (FLA's order differs)
        if self.impl == "reference-fp32":
            return _fp32_reference(st, q, k, v, g, beta)
        if self.impl.startswith("per-step"):
            from ..ops.per_step_decode import per_step_decode

            return per_step_decode(
                st, self.slots, q, k, v, g, beta, validate=False, backend=self.kernel_backend
            )
        from ..ops.leapquant_decode import leapquant_decode

        return leapquant_decode(
            st, self.slots, q, k, v, g, beta, validate=False, backend=self.kernel_backend,
            boundary=self.boundary, launch=self.launch,
        )  # fmt: skip

    def load(self, states: list[torch.Tensor]) -> None:
        """Set every layer's state from full-precision ``[B, HV, K, V]`` tensors (window position 0)."""
        for st, s in zip(self.states, states):
            if self.impl in ("fla", "reference-fp32"):
                st.copy_(s)
            elif self.impl.startswith("per-step"):
                st.load(self.slots, s)
            else:
                from ..ops.leapquant_decode import load_states

                load_states(st, self.slots, s, backend=self.kernel_backend)

    def nbytes(self) -> int:
        """Bytes held by the states of all layers."""
        tensors = []
        for st in self.states:
            if isinstance(st, torch.Tensor):
                tensors.append(st)
            else:  # a LeapQuant pool (tensors) or a per-step pool (state, scale)
                tensors += list(getattr(st, "tensors", {}).values()) or [st.state, st.scale]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _fp32_reference(state, q, k, v, g, beta) -> torch.Tensor:
    """FLA semantics on an fp32 ``[B, HV, K, V]`` state, in place: decay, delta read, write, read out."""
    from ..recurrences import l2norm

    hv, d_k = v.shape[1], q.shape[-1]
    q = l2norm(q.float()).repeat_interleave(hv // q.shape[1], dim=1) * d_k**-0.5
    k = l2norm(k.float()).repeat_interleave(hv // k.shape[1], dim=1)
    decay = g.float().exp()
    state.mul_(decay[..., None] if g.ndim == 3 else decay[..., None, None])
    u = beta.float()[..., None] * (v.float() - torch.einsum("bhkv,bhk->bhv", state, k))
    state.add_(k[..., :, None] * u[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", state, q).to(v.dtype)


def _fla_available() -> bool:
    try:
        import fla.ops.gated_delta_rule
        import fla.ops.kda  # noqa: F401
    except ImportError:
        return False
    return True


def make_backend(
    variant: Variant, spec: ModelSpec, batch: int, device, *, seed: int = 0, kernel_backend: str = "auto"
) -> StateBackend:
    """Allocate the states of ``spec``'s linear layers for ``batch`` sequences, filled with plausible content.

    LeapQuant pools get random payloads and window positions spread uniformly over ``0..P-1`` (as
    ``bench kernel`` does), so ``1/P`` of the heads close a window at every step, as under continuous
    batching; the other states get random values.  ``fp32:fla`` runs the torch reference of FLA's kernel on
    the CPU (or with ``kernel_backend="reference"``).
    """
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed + 7)
    n_lin = spec.layer_types.count("linear")
    hv, kd = spec.lin_value_heads, spec.lin_head_dim
    slots = torch.arange(batch, dtype=torch.int32, device=device)
    if variant.kernel == "fla":
        if device.type != "cuda" or kernel_backend == "reference":
            impl = "reference-fp32"
        elif _fla_available():
            impl = "fla"
        else:
            raise LeapQuantError(
                "bench decode: fp32:fla needs flash-linear-attention on a GPU (fp32 runs our per-step kernel)"
            )
        states = [torch.randn(batch, hv, kd, kd, generator=gen, device=device) for _ in range(n_lin)]
        return StateBackend(variant.label, impl, spec.family, states, slots, kernel_backend)
    if variant.per_step:
        from ..ops.per_step_decode import PerStepPool

        fmt = variant.method.codec
        states = []
        for _ in range(n_lin):
            pool = PerStepPool.allocate(fmt, batch, hv, kd, kd, device)
            pool.state.copy_(torch.randn(pool.state.shape, generator=gen, device=device).to(pool.state.dtype))
            states.append(pool)
        return StateBackend(variant.label, f"per-step-{fmt}", spec.family, states, slots, kernel_backend)
    from ..ops.leapquant_decode import LaunchConfig
    from .kernel import _randomize, allocate_pool

    cfg = variant.pool_config(hv, kd, kd, "vector" if spec.family == "kda" else "scalar")
    states = []
    for _ in range(n_lin):
        pool = allocate_pool(variant, cfg, batch, spec.lin_key_heads, device)
        _randomize(pool, gen)
        states.append(pool)
    launch = None  # the tuned launch, as leapquant_decode picks it
    if variant.close != "auto":  # the same launch with the close the variant names
        from dataclasses import replace

        launch = replace(
            LaunchConfig.tuned(cfg.decay, cfg.compensators, cfg.residual), close_impl=variant.close
        )
    impl = "leapquant" + (":step" if variant.step_only else "") + (":paged" if variant.paged else "")
    return StateBackend(
        variant.label, impl, spec.family, states, slots, kernel_backend, not variant.step_only, launch
    )
