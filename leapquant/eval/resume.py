"""Checkpoints of a teacher-forced evaluation, so that a long run can stop and go on where it stopped.

A 64K-token run of a hybrid takes longer than one job on a time-limited or preemptible GPU allows
(``leapquant eval --checkpoint FILE --time-limit SECONDS``). A checkpoint holds the run's identity (model,
methods, settings and the token ids themselves), its running sums and curves, and the whole decode state:
the transformers cache (attention keys and values, convolution states, the row handles of patched
layers) and every patched layer's method states (:meth:`leapquant.LeapQuantPatch.snapshot`). Going on
from it gives the numbers of an uninterrupted run, bit for bit on the same machine and software.

The file is written to a temporary name and renamed, so a run killed while saving keeps the previous
checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import LeapQuantError

__all__ = ["CHECKPOINT_VERSION", "load_checkpoint", "restore_cache", "save_checkpoint", "snapshot_cache"]

CHECKPOINT_VERSION = 1

# plain attribute values a transformers cache layer keeps beside its tensors (flags, sizes)
_PLAIN = (bool, int, float, str, type(None))


def _to_cpu(x):
    """``x`` with every tensor copied to the CPU (nested dicts, lists and tuples kept as they are)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def _to_device(x, device: torch.device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _to_device(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_device(v, device) for v in x)
    return x


def _layer_value(value) -> bool:
    """Whether a cache layer's attribute is state to save: a tensor, a flag or size, or a dict of them
    (per-state tensors of a linear-attention layer); devices and dtypes are not."""
    if isinstance(value, (torch.Tensor, *_PLAIN)):
        return True
    return isinstance(value, dict) and all(isinstance(v, (torch.Tensor, *_PLAIN)) for v in value.values())


def snapshot_cache(cache) -> list[dict]:
    """The state of every layer of a transformers ``DynamicCache`` (tensors not copied)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise LeapQuantError(
            f"{type(cache).__name__} has no .layers: this transformers cache is not supported"
        )
    return [
        {"type": type(layer).__name__, **{k: v for k, v in vars(layer).items() if _layer_value(v)}}
        for layer in layers
    ]


def restore_cache(cache, snap: list[dict], device: torch.device) -> None:
    """Put a :func:`snapshot_cache` back into ``cache`` (built by a prefill of the same model and batch)."""
    if len(snap) != len(cache.layers):
        raise LeapQuantError(
            f"checkpoint: a cache of {len(snap)} layers, this model's has {len(cache.layers)}"
        )
    for i, (layer, saved) in enumerate(zip(cache.layers, snap, strict=True)):
        if saved["type"] != type(layer).__name__:
            raise LeapQuantError(
                f"checkpoint: cache layer {i} was a {saved['type']}, here a {type(layer).__name__}"
            )
        for name, value in saved.items():
            if name != "type":
                setattr(layer, name, _to_device(value, device))


def save_checkpoint(path: str | Path, payload: dict) -> None:
    """Write ``payload`` (tensors anywhere: they are saved from the CPU) to ``path`` atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"version": CHECKPOINT_VERSION, **_to_cpu(payload)}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | Path, identity: dict) -> dict:
    """The checkpoint at ``path``, after checking that it belongs to the run ``identity`` describes."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise LeapQuantError(f"checkpoint {path}: no such file") from None
    except Exception as exc:  # a truncated or foreign file: say which, not a pickle traceback
        raise LeapQuantError(
            f"checkpoint {path}: not a leapquant eval checkpoint (torch.load: {type(exc).__name__})"
        ) from None
    if not isinstance(saved, dict) or saved.get("version") != CHECKPOINT_VERSION:
        raise LeapQuantError(
            f"checkpoint {path}: not a version-{CHECKPOINT_VERSION} leapquant eval checkpoint"
        )
    mine = saved["identity"]
    for key, value in identity.items():
        theirs = mine.get(key)
        same = torch.equal(theirs, value) if isinstance(value, torch.Tensor) else theirs == value
        if not same:
            tokens = isinstance(value, torch.Tensor)
            shown = "the token ids differ" if tokens else f"{theirs!r}, this run {value!r}"
            raise LeapQuantError(
                f"checkpoint {path} is of another run: {key}: {shown} (delete it to start afresh, or run the "
                "command that wrote it)"
            )
    return saved
