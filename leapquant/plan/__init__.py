"""Capacity planning: bytes of recurrent state, conv state, KV cache and weights, and requests that fit.

``leapquant memory`` drives it from the command line.  Importing this package does not import torch; the
planner imports the method grammar (and with it torch) on first use.
"""

from .memory import BufferSpec, MemoryPlan, buffer_plan, plan_memory
from .models import MODEL_TYPES, HybridShape, load_shape, shape_from_config

__all__ = [
    "MODEL_TYPES",
    "BufferSpec",
    "HybridShape",
    "MemoryPlan",
    "buffer_plan",
    "load_shape",
    "plan_memory",
    "shape_from_config",
]
