"""Integrations with model libraries and serving engines.

* :mod:`leapquant.integrations.transformers`: :func:`patch` a loaded transformers hybrid model so that its
  linear-attention layers decode through a LeapQuant (or baseline) state.
* :mod:`leapquant.integrations.backends`: the per-layer state objects behind it (model-native fp32, the float
  reference, the Triton kernel pools).

transformers is imported only when a model is patched.
"""

from __future__ import annotations

from .transformers import LeapQuantPatch, linear_attention_layers, patch, unpatch

__all__ = ["LeapQuantPatch", "linear_attention_layers", "patch", "unpatch"]
