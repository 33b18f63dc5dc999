"""Checkpoints of a teacher-forced evaluation, so that a long run can stop and go on where it stopped.

A long run (a real model, many methods, hundreds of thousands of tokens) can take longer than one job on a
time-limited or preemptible GPU allows (``leapquant eval --checkpoint FILE --time-limit SECONDS``). A
checkpoint holds the run's identity (:func:`run_identity`: model and a fingerprint of its weights, methods,
settings, the token ids, the device and the software versions), its running sums and curves, the random
number generators' states (stochastic rounding draws from them), and the whole decode state: the
transformers cache (attention keys and values, convolution states, the row handles of patched layers) and
every patched layer's method states (:meth:`leapquant.LeapQuantPatch.snapshot`). Going on from it gives
the numbers of an uninterrupted run, bit for bit on the same machine and software. A finished run leaves
only its report.

The file is written to a temporary name, flushed to disk and renamed, so a run killed while saving keeps
the previous checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import LeapQuantError

__all__ = [
    "CHECKPOINT_VERSION", "load_checkpoint", "restore_cache", "restore_rng", "run_identity",
    "save_checkpoint", "snapshot_cache", "snapshot_rng",
]  # fmt: skip

CHECKPOINT_VERSION = 2

# plain attribute values a transformers cache layer keeps beside its tensors (flags, sizes)
_PLAIN = (bool, int, float, str, type(None))


def _copied(x, device: torch.device | str):
    """``x`` with every tensor copied to ``device`` (nested dicts, lists and tuples kept as they are): saved
    tensors never alias live ones, and restored ones never alias the loaded file."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(device, copy=True)
    if isinstance(x, dict):
        return {k: _copied(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_copied(v, device) for v in x)
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
    """Put a :func:`snapshot_cache` back into ``cache`` (built by a prefill of the same model and batch).
    Every attribute this cache's layers keep must be in the snapshot and the other way round: a
    transformers version that added one would otherwise keep its prefill value without a word."""
    mine = snapshot_cache(cache)
    if len(snap) != len(mine):
        raise LeapQuantError(f"checkpoint: a cache of {len(snap)} layers, this model's has {len(mine)}")
    for i, (layer, saved, now) in enumerate(zip(cache.layers, snap, mine, strict=True)):
        if saved.keys() != now.keys() or saved["type"] != now["type"]:
            raise LeapQuantError(
                f"checkpoint: cache layer {i} was a {saved['type']} with {sorted(saved)}, here a "
                f"{now['type']} with {sorted(now)} (another transformers version?)"
            )
        for name, value in saved.items():
            if name != "type":
                setattr(layer, name, _copied(value, device))


def snapshot_rng(device: torch.device) -> dict:
    """The CPU's and ``device``'s random number generator states (stochastic rounding draws from them)."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def run_identity(model, config, ids: torch.Tensor) -> dict:
    """What a checkpoint must share with the run that goes on from it: the model (its folder name,
    class and a fingerprint of its weights: every parameter's shape and sums), each row's method in full
    (a saved plan by its contents), the evaluation settings, the token ids, the device and the software."""
    from .. import __version__
    from .provenance import _version

    weights = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            x = p.detach().double()
            weights.append(f"{name}{tuple(p.shape)}:{float(x.sum())!r}:{float(x.abs().sum())!r}")
    return {
        "model": Path(getattr(model.config, "_name_or_path", "") or type(model).__name__).name,
        "architecture": type(model).__name__,
        "weights": weights,
        "rows": ["fp32", *config.methods],
        "methods": [repr(config.config_of(r)) for r in ("fp32", *config.methods)],
        "tokens": config.tokens,
        "prefill": config.prefill,
        "curve_points": config.curve_points,
        "backend": config.backend,
        "chunk": config.chunk,
        "generate": list(config.generate),
        "generate_tokens": config.generate_tokens,
        "device": str(model.device.type),
        "dtype": str(next(model.parameters()).dtype),
        "software": {
            "leapquant": __version__,
            "torch": str(torch.__version__),
            **{name: _version(name) for name in ("transformers", "triton", "fla-core")},
        },
        "ids": ids.cpu(),
    }


def save_checkpoint(path: str | Path, payload: dict) -> None:
    """Write ``payload`` (tensors anywhere: they are saved from the CPU) to ``path`` atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save({"version": CHECKPOINT_VERSION, **_copied(payload, "cpu")}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


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
    if not isinstance(saved, dict) or saved.get("version") != CHECKPOINT_VERSION or "identity" not in saved:
        raise LeapQuantError(
            f"checkpoint {path}: not a version-{CHECKPOINT_VERSION} leapquant eval checkpoint"
        )
    mine = saved["identity"]
    for key, value in identity.items():
        theirs = mine.get(key)
        if isinstance(value, torch.Tensor):
            same = isinstance(theirs, torch.Tensor) and theirs.shape == value.shape
            same = same and torch.equal(theirs, value)
        else:
            same = theirs == value
        if not same:
            shown = f"{theirs!r}, this run {value!r}"
            if isinstance(value, torch.Tensor):
                shown = "the token ids differ"
            elif len(shown) > 200:  # the weights' fingerprint: naming it is enough
                shown = "they differ"
            raise LeapQuantError(
                f"checkpoint {path} is of another run: {key}: {shown} (delete it to start afresh, or run the "
                "command that wrote it)"
            )
    return saved
