"""Token chunks through a transformers model and its cache, with the positions passed explicitly.

transformers 5.17 derives positions from the cache's length when a forward pass gets none, and only attention
layers track a length: a model without attention layers (the all-linear-attention recall checkpoints) fails
with "get_seq_length can only be called on Attention layers". Such a model also gets its absent masks as a
dict, for the same reason. Every evaluation that feeds a model step by step goes through
:class:`CachedStream`.
"""

from __future__ import annotations

__all__ = ["CachedStream"]

# the per-layer-type masks transformers would otherwise build from the cache's length
_NO_MASKS = {"full_attention": None, "linear_attention": None}


class CachedStream:
    """Feeds ``[B, T]`` token chunks in order through ``model`` with one ``DynamicCache``.

    Calling it runs one forward pass over the next chunk (positions continue from the previous chunk) and
    returns the model's output; keyword arguments (e.g. ``logits_to_keep``) go to the model.
    """

    def __init__(self, model):
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.position = 0
        has_attention = "full_attention" in (getattr(model.config, "layer_types", None) or ())
        self._extra = {} if has_attention else {"attention_mask": _NO_MASKS}

    def __call__(self, ids, **kwargs):
        import torch

        at = torch.arange(self.position, self.position + ids.shape[1], device=ids.device)
        self.position += ids.shape[1]
        return self.model(
            ids,
            past_key_values=self.cache,
            use_cache=True,
            position_ids=at[None].expand(ids.shape[0], -1),
            **self._extra,
            **kwargs,
        )
