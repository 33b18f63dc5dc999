"""What one benchmark row runs: a method plus named options, parsed once at the command line.

A variant is written ``METHOD[:OPTION]...``, where ``METHOD`` is any method name with a kernel
(:func:`leapquant.methods.parse_method`) and the options say how it runs:

* ``:fla``: FLA's ``fused_recurrent_*`` kernels on an fp32 state (method ``fp32`` only: the baseline);
* ``:step``: the step kernel alone, positions frozen (a breakdown of a windowed method's time);
* ``:triton-close`` / ``:cuda-close``: which window close runs (default: CUDA where it applies);
* ``:paged``: the pool laid out in vLLM's state pages instead of contiguous slots.

Per-step methods (window 1: ``fp32``, ``bf16``, ``int8``) run our per-step kernels; windowed methods run
a LeapQuant pool.  Below the command line every benchmark takes a :class:`Variant`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LeapQuantError
from ..formats.residual import RESIDUAL_FORMATS
from ..methods.config import MethodConfig, parse_method

__all__ = ["CLOSES", "OPTIONS", "Variant", "parse_variant"]

CLOSES = ("auto", "triton", "cuda")
# option -> (Variant field, value)
OPTIONS = {
    "fla": ("kernel", "fla"),
    "step": ("step_only", True),
    "triton-close": ("close", "triton"),
    "cuda-close": ("close", "cuda"),
    "paged": ("paged", True),
}


@dataclass(frozen=True)
class Variant:
    """One benchmark row's state method and how it runs.

    Attributes:
        method: the state method.
        kernel: ``"leapquant"`` (our kernels: per-step for window 1, a pool otherwise) or ``"fla"`` (FLA's
            fp32 kernels; method ``fp32`` only).
        close: ``"auto"``, ``"triton"`` or ``"cuda"``: the window close of a windowed method.
        step_only: time the step kernel alone (windowed methods).
        paged: lay the pool out in vLLM's state pages (windowed methods).
        label: the name rows and tables show (default: the canonical spelling).
    """

    method: MethodConfig
    kernel: str = "leapquant"
    close: str = "auto"
    step_only: bool = False
    paged: bool = False
    label: str = ""

    def __post_init__(self) -> None:
        if self.kernel not in ("leapquant", "fla"):
            raise LeapQuantError(f"variant: kernel must be 'leapquant' or 'fla', got {self.kernel!r}")
        if self.close not in CLOSES:
            raise LeapQuantError(f"variant: close must be one of {', '.join(CLOSES)}, got {self.close!r}")
        m = self.method
        if self.kernel == "fla" and m.name != "fp32":
            raise LeapQuantError(f"variant {self.name}: FLA's kernels keep an fp32 state (use fp32:fla)")
        windowed_only = self.step_only or self.paged or self.close != "auto"
        if m.window == 1:
            from ..ops.per_step_decode import per_step_unsupported

            reason = None if self.kernel == "fla" else per_step_unsupported(m)
            if windowed_only:
                reason = ":step, :paged and the close options apply to windowed methods (METHOD/wP)"
        else:
            from ..ops.pool import pool_unsupported

            reason = pool_unsupported(m)
        if reason is not None:
            raise LeapQuantError(f"variant {self.name}: no kernel: {reason}")
        if not self.label:
            object.__setattr__(self, "label", self.name)

    @property
    def name(self) -> str:
        """Canonical spelling: ``parse_variant(v.name)`` rebuilds ``v`` (up to the label)."""
        opts = [opt for opt, (field, value) in OPTIONS.items() if getattr(self, field) == value]
        return ":".join([self.method.name, *opts])

    @property
    def per_step(self) -> bool:
        """Whether the state is stored per step (FLA's fp32 or our per-step kernels), not in a pool."""
        return self.method.window == 1

    def state_bytes_per_head(self, d_k: int, d_v: int) -> int:
        """Stored bytes of one head's per-step state (per-step variants)."""
        fmt = RESIDUAL_FORMATS[self.method.codec]
        return d_k * d_v * fmt.payload_dtype.itemsize + (4 * d_v if fmt.scaled else 0)

    def pool_config(self, heads: int, d_k: int = 128, d_v: int = 128, decay: str = "scalar"):
        """The :class:`~leapquant.ops.PoolConfig` of a windowed variant."""
        from ..ops.pool import PoolConfig

        return PoolConfig(self.method, heads=heads, d_k=d_k, d_v=d_v, decay=decay)


def parse_variant(text: str) -> Variant:
    """``"leapquant-int8:step"`` -> :class:`Variant` (see the module docstring for the grammar)."""
    name, *options = text.strip().split(":")
    fields: dict = {}
    for opt in options:
        if opt not in OPTIONS:
            raise LeapQuantError(
                f"variant {text!r}: unknown option :{opt} (options: {', '.join(':' + o for o in OPTIONS)})"
            )
        field, value = OPTIONS[opt]
        if field in fields:
            raise LeapQuantError(f"variant {text!r}: two options set the {field}")
        fields[field] = value
    return Variant(parse_method(name), label=text.strip(), **fields)
