"""Capacity planning and the one source of model shapes: bytes of recurrent state, conv state, KV cache and
weights, requests that fit, and the model presets every command takes by name.

``leapquant memory`` drives it from the command line.  Importing this package does not import torch; the
planner imports the method grammar (and with it torch) on first use.
"""

from .memory import BufferSpec, MemoryPlan, buffer_plan, plan_memory
from .models import MODEL_TYPES, HybridShape, shape_from_config
from .presets import PRESETS, load_shape, resolve_preset

__all__ = [
    "MODEL_TYPES",
    "PRESETS",
    "BufferSpec",
    "HybridShape",
    "MemoryPlan",
    "buffer_plan",
    "load_shape",
    "plan_memory",
    "resolve_preset",
    "shape_from_config",
]
