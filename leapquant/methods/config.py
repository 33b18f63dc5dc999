"""Method configurations and the method-name grammar.

A method name is ``CODEC[/wP][+OPTION]...``:

* ``CODEC`` is a state format (``int8``, ``bf16``, ``fp8-e4m3``, ``mxfp4``, ``nvfp4``, ...) or an adapted
  baseline (``kvquant-int8``, ``quarot-int8``, ``turboquant-8``, ...);
* ``/wP`` quantizes once per window of P records (without it: after every record, the per-step baseline);
* ``+ctR`` keeps R compensator tokens in fp16 (``+svd`` fits them by exact SVD instead of power iteration,
  ``+itN`` sets N power iterations per window boundary);
* ``+smooth`` applies residual smoothing;
* ``+ls`` refits each value channel's scale to its codes by least squares, so that a boundary stores a
  projection of what it quantizes (:mod:`leapquant.methods.scale_fit`; integer formats with one scale per
  value channel: ``int8``, ``int6``, ``int4``);
* ``+rec16`` / ``+recbf16`` / ``+rec32`` choose the record-buffer precision (default: fp16, or full precision
  when the state itself is full precision);
* ``+sr`` rounds the state stochastically.

Aliases name the configurations the paper evaluates, with one change: the 6- and 4-bit ones add ``+ls``.
Their boundary error is large enough that a head whose decay stays near 1 compounds it window after window
when scales are set by the channel maximum (the paper's ``int4/w16+ct8+smooth`` diverges on our GDN recall
model); ``+ls`` stores the same codes and bytes and keeps such states bounded.  The paper's exact
configurations stay reachable by their spelled-out names.  :func:`method_names` lists every alias.

``leapquant-auto`` is a policy, not a method: it picks a method per layer on a calibration trace
(:mod:`leapquant.methods.auto`, ``leapquant calibrate``) and yields a
:class:`~leapquant.methods.layer_plan.LayerPlan`; ``parse_method`` refuses it with that hint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from ..checks import check_count
from ..errors import LeapQuantError, did_you_mean
from ..formats.base import StateFormat
from ..formats.registry import UnknownFormat, format_names

__all__ = [
    "ALIASES",
    "BASELINE_METHODS",
    "POLICY_NAMES",
    "MethodConfig",
    "as_method",
    "method_names",
    "parse_method",
    "resolve_codec",
]

ALIASES = {
    "leapquant-int8": "int8/w16+ct4+smooth",
    "leapquant-int6": "int6/w16+ct4+smooth+ls",
    "leapquant-int4": "int4/w16+ct8+smooth+ls",
}

# The per-step rows of the paper's Tables 1 and 5 (direct formats and adapted baselines) at 16/8/6/4 bits.
BASELINE_METHODS = (
    "fp32",
    "bf16",
    "fp16",
    "fp8-e4m3",
    "fp8-e5m2",
    "int8",
    "mxfp8",
    "kvquant-int8",
    "quarot-int8",
    "turboquant-8",
    "int6",
    "mxfp6-e2m3",
    "mxfp6-e3m2",
    "nvfp6",
    "kvquant-int6",
    "quarot-int6",
    "turboquant-6",
    "int4",
    "mxfp4",
    "nvfp4",
    "kvquant-int4",
    "quarot-int4",
    "turboquant-4",
)

# Names of per-layer policies (methods/auto.py): they need a model to calibrate on, so no MethodConfig.
POLICY_NAMES = ("leapquant-auto",)

RECORD_PRECISIONS = {"fp32": 4, "fp16": 2, "bf16": 2}
_OPTION = re.compile(r"^(ct(\d+)|it(\d+)|svd|smooth|ls|sr|rec(16|bf16|32))$")


def resolve_codec(name: str, *, stochastic: bool = False) -> StateFormat:
    """A state format or adapted baseline by name (raises LeapQuantError if it is neither)."""
    from ..formats import get_format
    from .baselines import get_baseline

    baseline = get_baseline(name, stochastic=stochastic)
    if baseline is not None:
        return baseline
    return get_format(name, stochastic=stochastic)


@dataclass(frozen=True)
class MethodConfig:
    """How a state is stored and when it is quantized.

    Attributes:
        codec: state format or adapted baseline name for the (residual) state.
        window: records per window ``p``; 1 quantizes after every record (per-step).  One record is one
            token for GDN, KDA and most families; RWKV-7 writes 2 a token and DeltaProduct ``n``, so their
            windows span ``p / 2`` and ``p / n`` tokens (and may close between a token's records).
        compensators: number ``r`` of compensator tokens (0: none).
        fit: ``"power"`` (power iteration warm-started from the previous window) or ``"svd"``.
        power_iters: power iterations at each window boundary.
        cold_iters: power iterations when a state is loaded (prefill hand-off).  At a window boundary a
            column whose warm start is zero (a sequence decoded from a zero state) restarts from the fixed
            start vectors with ``power_iters``, as the kernels do; the next windows go on iterating.
        smoothing: residual smoothing of key rows (eq. 7).
        least_squares_scales: refit each value channel's scale to its codes at every boundary (``+ls``).
        record_precision: ``"fp16"``, ``"bf16"`` or ``"fp32"`` for buffered keys and corrections
            (decays are always kept in fp32); ``None`` picks fp16, or fp32 when the codec is lossless
            or the window is 1 (per-step: nothing is buffered).
        compensator_precision: ``"fp16"`` (the paper) or ``"fp32"``.
        stochastic: stochastic rounding of the state.
    """

    codec: str
    window: int = 1
    compensators: int = 0
    fit: str = "power"
    power_iters: int = 1
    cold_iters: int = 8
    smoothing: bool = False
    least_squares_scales: bool = False
    record_precision: str | None = None
    compensator_precision: str = "fp16"
    stochastic: bool = False

    def __post_init__(self) -> None:
        if self.window < 1:
            raise LeapQuantError(f"method {self.codec}: window must be >= 1, got {self.window}")
        if self.compensators < 0:
            raise LeapQuantError(f"method {self.codec}: compensators must be >= 0, got {self.compensators}")
        if self.fit not in ("power", "svd"):
            raise LeapQuantError(f"method {self.codec}: fit must be 'power' or 'svd', got {self.fit!r}")
        if self.power_iters < 1 or self.cold_iters < 1:
            raise LeapQuantError(f"method {self.codec}: power iterations must be >= 1")
        if self.record_precision is not None and self.record_precision not in RECORD_PRECISIONS:
            raise LeapQuantError(
                f"method {self.codec}: record precision must be fp32, fp16 or bf16, "
                f"got {self.record_precision!r}"
            )
        if self.compensator_precision not in ("fp16", "fp32"):
            raise LeapQuantError(
                f"method {self.codec}: compensator precision must be fp16 or fp32, "
                f"got {self.compensator_precision!r}"
            )
        # resolve the codec now, so that an unknown name fails at construction, and keep its canonical
        # spelling: "INT8" or "int8-col" is int8, and a pool or a table keyed by name must see one name
        if self.format.name != self.codec:
            object.__setattr__(self, "codec", self.format.name)
        if self.least_squares_scales:
            from .scale_fit import check_scale_fit

            check_scale_fit(self.format, self.name)

    @cached_property
    def format(self) -> StateFormat:
        """The codec object of the (residual) state."""
        return resolve_codec(self.codec, stochastic=self.stochastic)

    @property
    def records(self) -> str:
        """Record-buffer precision after the default is resolved."""
        if self.record_precision is not None:
            return self.record_precision
        # a per-step method has no buffer: its one record lives in registers at full precision
        return "fp32" if self.format.lossless or self.window == 1 else "fp16"

    @property
    def name(self) -> str:
        """Canonical method name (defaults omitted); ``parse_method(cfg.name) == cfg``."""
        parts = [self.codec + (f"/w{self.window}" if self.window > 1 else "")]
        if self.compensators:
            parts.append(f"ct{self.compensators}")
            if self.fit == "svd":
                parts.append("svd")
            if self.power_iters != 1:
                parts.append(f"it{self.power_iters}")
        if self.smoothing:
            parts.append("smooth")
        if self.least_squares_scales:
            parts.append("ls")
        if self.record_precision is not None:
            parts.append({"fp32": "rec32", "fp16": "rec16", "bf16": "recbf16"}[self.record_precision])
        if self.stochastic:
            parts.append("sr")
        return "+".join(parts)

    def bytes_per_element(self, d_k: int, d_v: int) -> float:
        """Stored bytes per state element at a window boundary: residual, scales, smoothing, compensators."""
        check_count("d_k", d_k), check_count("d_v", d_v)
        elements = d_k * d_v
        total = self.format.bytes_per_element(d_k, d_v)
        if self.smoothing:
            total += 4 * d_k / elements
        comp_bytes = 2 if self.compensator_precision == "fp16" else 4
        total += self.compensators * (d_k + d_v) * comp_bytes / elements
        return total

    def boundary_bytes(self, d_k: int, d_v: int) -> int:
        """Stored bytes of one head's boundary (``bytes_per_element * d_k * d_v``, whole bytes): counted in
        bits, which are whole for every format, so that a float ulp never adds a byte."""
        bits = round(self.bytes_per_element(d_k, d_v) * 8 * d_k * d_v)
        return -(-bits // 8)

    def record_buffer_bytes(self, d_k: int, d_v: int, decay_values: int | None = None) -> int:
        """Bytes of one head's record buffer: p records of key and correction at the record precision and
        log decay (an fp32 running sum for a scalar decay, at the record precision per key channel), plus
        the position.

        ``decay_values`` is the number of decay values per record (1 for a scalar decay such as GDN's,
        ``d_k`` for KDA; default ``d_k``).  A per-step method buffers nothing.
        """
        check_count("d_k", d_k), check_count("d_v", d_v)
        if self.window == 1:
            return 0
        rec = RECORD_PRECISIONS[self.records]
        decay = d_k if decay_values is None else decay_values
        decay_bytes = 4 if decay == 1 else rec * decay
        return self.window * (decay_bytes + rec * (d_k + d_v)) + 4


def parse_method(name: str) -> MethodConfig:
    """Parse a method name (see the module docstring) into a :class:`MethodConfig`."""
    if name.strip() in POLICY_NAMES:
        raise LeapQuantError(
            f"{name.strip()} chooses a method per layer on a calibration trace: run `leapquant calibrate "
            "--model DIR --out plan.json` (or leapquant.calibrate_model) and pass the plan file"
        )
    if name.strip().endswith(".json"):
        raise LeapQuantError(
            f"{name.strip()} names a layer plan, not one method: leapquant.patch, `leapquant eval -m` and "
            "`leapquant memory --method` take plans; this entry point takes one method for every layer"
        )
    text = ALIASES.get(name.strip(), name.strip())
    head, *options = text.split("+")
    codec, window = head, 1
    if "/" in head:
        codec, _, w = head.partition("/")
        if not re.fullmatch(r"w\d+", w):
            raise LeapQuantError(
                f"method {name!r}: window must be written /wP with P a whole number, got /{w}"
            )
        window = int(w[1:])
    fields: dict = {"codec": codec, "window": window}
    seen: set[str] = set()
    for opt in options:
        m = _OPTION.match(opt)
        if not m:
            raise LeapQuantError(
                f"method {name!r}: unknown option +{opt} (use +ctR, +svd, +itN, +smooth, +ls, +rec16, "
                "+recbf16, +rec32, +sr)"
                + did_you_mean(opt, ("smooth", "ls", "svd", "sr", "rec16", "recbf16", "rec32"))
            )
        kind = "ct" if m.group(2) else "it" if m.group(3) else "rec" if m.group(4) else opt
        if kind in seen:  # "+ct4+ct2" kept the last one silently
            label = {"ct": "+ctR", "it": "+itN", "rec": "+rec16/bf16/32"}.get(kind, f"+{kind}")
            raise LeapQuantError(f"method {name!r}: {label} is given twice")
        seen.add(kind)
        if m.group(2):
            fields["compensators"] = int(m.group(2))
        elif m.group(3):
            fields["power_iters"] = int(m.group(3))
        elif opt == "svd":
            fields["fit"] = "svd"
        elif opt == "smooth":
            fields["smoothing"] = True
        elif opt == "ls":
            fields["least_squares_scales"] = True
        elif opt == "sr":
            fields["stochastic"] = True
        else:
            fields["record_precision"] = {"16": "fp16", "bf16": "bf16", "32": "fp32"}[m.group(4)]
    if ("fit" in fields or "power_iters" in fields) and not fields.get("compensators"):
        raise LeapQuantError(f"method {name!r}: +svd and +itN need compensator tokens (+ctR)")
    try:
        return MethodConfig(**fields)
    except UnknownFormat:
        known = [n for n, _ in method_names()] + format_names()
        raise LeapQuantError(
            f"unknown method {name!r}: CODEC must be an alias "
            f"({', '.join(ALIASES)}), a baseline (kvquant-intN, quarot-intN, turboquant-N) or a format "
            "(fp32, bf16, fp16, intN[-GRAN], fp8-e4m3, mxfp8/6/4, nvfp4/6, ...): see `leapquant methods`"
            + did_you_mean(codec, known)
        ) from None


def as_method(method: str | MethodConfig, what: str = "method") -> MethodConfig:
    """A :class:`MethodConfig` from what a public entry point was given: a name (parsed here, the one place
    names become configs) or a config (returned as is).  Anything else raises a :class:`LeapQuantError`
    naming ``what``."""
    if isinstance(method, MethodConfig):
        return method
    if isinstance(method, str):
        return parse_method(method)
    raise LeapQuantError(
        f"{what} must be a method name such as 'leapquant-int8' (`leapquant methods`) or a MethodConfig, "
        f"got {type(method).__name__}"
    )


def method_names() -> list[tuple[str, str]]:
    """Every named method as ``(name, what it is)``: aliases, LeapQuant ablations and baselines."""
    rows = [(alias, f"= {target}") for alias, target in ALIASES.items()]
    rows += [
        ("int8/w16", "per-window INT8 (ablation)"),
        ("int8/w16+ct4", "per-window INT8 + 4 compensator tokens (ablation)"),
        ("bf16/w16", "per-window BF16"),
    ]
    rows += [(m, "exact trajectory" if m == "fp32" else "per-step") for m in BASELINE_METHODS]
    return rows
