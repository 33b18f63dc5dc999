"""When and how a recurrent state is quantized: per-step, per-window, compensator tokens, smoothing.

``parse_method("leapquant-int8")`` gives a :class:`MethodConfig`; :class:`WindowedState` runs it on a batch
of heads (the float64/float32 reference every kernel is tested against).  :class:`LayerPlan` gives each
layer its own method; :func:`calibrate` (the ``leapquant-auto`` policy) chooses one per layer on a trace.
"""

from .auto import AUTO_CANDIDATES, POLICIES, AutoPolicy, calibrate
from .compensators import fit_compensators, orthonormalize, start_vectors
from .config import (
    ALIASES,
    BASELINE_METHODS,
    MethodConfig,
    as_method,
    method_names,
    parse_method,
    resolve_codec,
)
from .layer_plan import LayerPlan, as_layer_methods, load_plan
from .smoothing import SMOOTHING_FLOOR, smoothing_scales
from .window import WindowedState

__all__ = [
    "ALIASES",
    "AUTO_CANDIDATES",
    "BASELINE_METHODS",
    "POLICIES",
    "SMOOTHING_FLOOR",
    "AutoPolicy",
    "LayerPlan",
    "MethodConfig",
    "WindowedState",
    "as_layer_methods",
    "as_method",
    "calibrate",
    "fit_compensators",
    "load_plan",
    "method_names",
    "orthonormalize",
    "parse_method",
    "resolve_codec",
    "smoothing_scales",
    "start_vectors",
]
