"""The small trained checkpoints shipped inside the package, looked up by name.

Every folder here that holds a ``config.json`` is a checkpoint named after its folder, so adding one is
adding a folder (``scripts/train_checkpoints.py --out leapquant/checkpoints``); nothing else lists them.
Each folder is a transformers model (safetensors, config, tokenizer) with a model card (``README.md``).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import LeapQuantError, did_you_mean

__all__ = ["DEFAULT_CHECKPOINT", "checkpoint_names", "checkpoint_path", "resolve_model"]

_ROOT = Path(__file__).resolve().parent
DEFAULT_CHECKPOINT = "qwen35-gdn-hybrid-byte"
"""The checkpoint ``leapquant eval`` and ``leapquant trace`` use without ``--model``."""


def checkpoint_names() -> list[str]:
    """Names of the shipped checkpoints, sorted."""
    return sorted(p.name for p in _ROOT.iterdir() if (p / "config.json").is_file())


def checkpoint_path(name: str) -> Path:
    """The folder of the shipped checkpoint ``name``, a transformers model for ``from_pretrained``."""
    names = checkpoint_names()
    if not isinstance(name, str) or name not in names:
        raise LeapQuantError(
            f"no shipped checkpoint {name!r}{did_you_mean(str(name), names)} (shipped: {', '.join(names)})"
        )
    return _ROOT / name


def resolve_model(model: str | Path) -> Path:
    """A model folder from a path to a transformers folder or a shipped checkpoint's name.

    A path that exists wins over a name, so a user's own folder is never shadowed by a checkpoint.
    """
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if str(model) in checkpoint_names():
        return checkpoint_path(str(model))
    if path.is_dir():
        raise LeapQuantError(f"model {model}: the folder has no config.json (not a transformers model)")
    if path.exists():
        raise LeapQuantError(f"model {model}: expected a folder holding config.json, got a file")
    names = checkpoint_names()
    raise LeapQuantError(
        f"model {model!r}: no such folder and no shipped checkpoint of that name"
        f"{did_you_mean(str(model), names)} (shipped: {', '.join(names)})"
    )
