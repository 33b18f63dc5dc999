"""When and how a recurrent state is quantized: per-step, per-window, compensator tokens, smoothing.

``parse_method("leapquant-int8")`` gives a :class:`MethodConfig`; :class:`WindowedState` runs it on a batch
of heads (the float64/float32 reference every kernel is tested against).
"""

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
from .smoothing import SMOOTHING_FLOOR, smoothing_scales
from .window import WindowedState

__all__ = [
    "ALIASES",
    "BASELINE_METHODS",
    "SMOOTHING_FLOOR",
    "MethodConfig",
    "WindowedState",
    "as_method",
    "fit_compensators",
    "method_names",
    "orthonormalize",
    "parse_method",
    "resolve_codec",
    "smoothing_scales",
    "start_vectors",
]
