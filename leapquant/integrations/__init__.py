"""Integrations with model libraries and serving engines.

* :mod:`leapquant.integrations.transformers`: :func:`patch` a loaded transformers hybrid model so that its
  linear-attention layers decode through a LeapQuant (or baseline) state.
* :mod:`leapquant.integrations.calibrate`: :func:`calibrate_model`, the ``leapquant-auto`` policy's method per
  layer for a loaded model (a :class:`~leapquant.methods.LayerPlan` that :func:`patch` takes).
* :mod:`leapquant.integrations.backends`: the per-layer state objects behind it (model-native fp32, the float
  reference, the Triton kernel pools).

transformers is imported only when a model is patched.
"""

from __future__ import annotations

from .calibrate import calibrate_model
from .transformers import LeapQuantPatch, linear_attention_layers, patch, unpatch

__all__ = ["LeapQuantPatch", "calibrate_model", "linear_attention_layers", "patch", "unpatch"]
