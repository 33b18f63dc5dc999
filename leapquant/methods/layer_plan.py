"""A method per layer: what ``leapquant-auto`` chooses, explicit, inspectable and saved as JSON.

A :class:`LayerPlan` maps linear-attention layer indices to :class:`MethodConfig` s, optionally with a
default for layers it does not list.  ``leapquant.patch``, ``leapquant eval -m PLAN.json`` and the capacity
planner take one wherever they take a method; a plain method is the plan that gives every layer the same
config.  The JSON form::

    {"plan": "leapquant-layer-plan/1",
     "default": null,                                    # or a method name for unlisted layers
     "layers": {"0": "int4/w16+ct8+smooth", "6": "int8/w16+ct4+smooth", ...},
     "evidence": {...}}                                   # how it was chosen (calibrate()); free-form

Method names in the file are canonical (``MethodConfig.name``), so a saved plan reads back equal.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LeapQuantError
from .config import MethodConfig, as_method, parse_method

__all__ = ["PLAN_FORMAT", "LayerPlan", "as_layer_methods", "load_plan"]

PLAN_FORMAT = "leapquant-layer-plan/1"


@dataclass(frozen=True)
class LayerPlan:
    """Methods per layer.

    Attributes:
        layers: ``((layer_idx, MethodConfig), ...)`` sorted by layer, each layer once.
        default: the method of layers not listed (``None``: an unlisted layer is an error).
        evidence: how the plan was made (calibration measurements); not part of equality.
    """

    layers: tuple[tuple[int, MethodConfig], ...] = ()
    default: MethodConfig | None = None
    evidence: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        idx = [i for i, _ in self.layers]
        if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in idx):
            raise LeapQuantError(f"layer plan: layer indices must be whole numbers >= 0, got {idx}")
        if len(set(idx)) != len(idx) or idx != sorted(idx):
            raise LeapQuantError(f"layer plan: layers must be listed once each, in order, got {idx}")
        if not all(isinstance(c, MethodConfig) for _, c in self.layers):
            raise LeapQuantError("layer plan: every layer needs a MethodConfig")
        if not self.layers and self.default is None:
            raise LeapQuantError("layer plan: list some layers or give a default method")

    @classmethod
    def uniform(cls, method: str | MethodConfig) -> LayerPlan:
        """Every layer under one method."""
        return cls(default=as_method(method))

    def for_layer(self, layer: int) -> MethodConfig:
        """The method of linear-attention layer ``layer``."""
        for i, cfg in self.layers:
            if i == layer:
                return cfg
        if self.default is None:
            raise LeapQuantError(
                f"layer plan lists layers {[i for i, _ in self.layers]} and has no default: no method "
                f"for layer {layer}"
            )
        return self.default

    def check_layers(self, layers: list[int]) -> None:
        """Raise unless the plan names exactly a method for each of ``layers`` (a model's linear layers)."""
        extra = sorted({i for i, _ in self.layers} - set(layers))
        if extra:
            raise LeapQuantError(
                f"layer plan lists layers {extra}, which are not linear-attention layers {layers}"
            )
        for layer in layers:
            self.for_layer(layer)

    @property
    def is_uniform(self) -> bool:
        """One method for every layer."""
        return len({c for _, c in self.layers} | ({self.default} if self.default else set())) == 1

    @property
    def name(self) -> str:
        """Short description: the method of a uniform plan, else ``layers(0,1=M;6=M2)``."""
        if self.is_uniform:
            return (self.default or self.layers[0][1]).name
        groups: dict[str, list[int]] = {}
        for i, cfg in self.layers:
            groups.setdefault(cfg.name, []).append(i)
        parts = [f"{','.join(map(str, ids))}={m}" for m, ids in groups.items()]
        if self.default is not None:
            parts.append(f"*={self.default.name}")
        return "layers(" + ";".join(parts) + ")"

    @property
    def window(self) -> int:
        """The longest window of any layer (what a report on the whole model can quote)."""
        return max(c.window for c in self.methods())

    def methods(self) -> list[MethodConfig]:
        """The distinct methods of the plan, in layer order (the default last)."""
        out: list[MethodConfig] = []
        for cfg in [c for _, c in self.layers] + ([self.default] if self.default else []):
            if cfg not in out:
                out.append(cfg)
        return out

    def bytes_per_element(self, d_k: int, d_v: int, layers: Sequence[int] | None = None) -> float:
        """Boundary bytes per element averaged over a model's linear-attention ``layers`` (each under its
        own method, the default's included), or without them over the listed layers (the default's if
        none is listed)."""
        if layers is not None:
            cfgs = [self.for_layer(i) for i in layers]
        else:
            cfgs = [c for _, c in self.layers] or [self.default]
        return sum(c.bytes_per_element(d_k, d_v) for c in cfgs) / len(cfgs)

    def to_json(self) -> dict:
        return {
            "plan": PLAN_FORMAT,
            "default": None if self.default is None else self.default.name,
            "layers": {str(i): c.name for i, c in self.layers},
            "evidence": self.evidence,
        }

    @classmethod
    def from_json(cls, data: dict, source: str = "plan") -> LayerPlan:
        if not isinstance(data, dict) or data.get("plan") != PLAN_FORMAT:
            raise LeapQuantError(f'{source}: not a layer plan (expected "plan": "{PLAN_FORMAT}")')
        layers = data.get("layers") or {}
        if not isinstance(layers, dict) or not all(str(k).isdigit() for k in layers):
            raise LeapQuantError(f'{source}: "layers" must map layer indices to method names')
        default = data.get("default")
        return cls(
            tuple(sorted((int(i), parse_method(m)) for i, m in layers.items())),
            None if default is None else parse_method(default),
            evidence=data.get("evidence") or {},
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path


def load_plan(path: str | Path) -> LayerPlan:
    """Read a plan saved by :meth:`LayerPlan.save` (``leapquant calibrate --out``)."""
    p = Path(path)
    if not p.is_file():
        raise LeapQuantError(f"layer plan {path} does not exist")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise LeapQuantError(f"layer plan {path} is not JSON: {e}") from None
    return LayerPlan.from_json(data, source=str(path))


def as_layer_methods(method, what: str = "method") -> LayerPlan:
    """A :class:`LayerPlan` from what an entry point was given: a plan, a ``.json`` plan file, or a method
    name / :class:`MethodConfig` (every layer the same).  ``leapquant-auto`` needs a model to calibrate on:
    it raises, naming how to make its plan."""
    if isinstance(method, LayerPlan):
        return method
    if isinstance(method, str) and method.strip().endswith(".json"):
        return load_plan(method.strip())
    return LayerPlan.uniform(as_method(method, what))  # parse_method refuses policy names with a hint
