"""leapquant: low-bit recurrent state for linear-attention LLM layers (the LeapQuant method).

Importing the package is cheap: submodules load on first use, no GPU is touched and no Triton kernel is
compiled.  The names below are the main entry points; everything else lives in the subpackages
(``formats``, ``recurrences``, ``methods``, ``traces``, ``eval``); the shipped checkpoints are found by
name with ``checkpoint_path``.
"""

from __future__ import annotations

import importlib

from .errors import LeapQuantError

__version__ = "0.1.0"

_LAZY = {
    "get_format": "leapquant.formats",
    "parse_method": "leapquant.methods",
    "MethodConfig": "leapquant.methods",
    "WindowedState": "leapquant.methods",
    "LayerPlan": "leapquant.methods",
    "load_plan": "leapquant.methods",
    "Records": "leapquant.recurrences",
    "exact_recurrence": "leapquant.recurrences",
    "Trace": "leapquant.traces",
    "load_trace": "leapquant.traces",
    "save_trace": "leapquant.traces",
    "simulate": "leapquant.eval",
    "patch": "leapquant.integrations",
    "checkpoint_path": "leapquant.checkpoints",
    "checkpoint_names": "leapquant.checkpoints",
    "unpatch": "leapquant.integrations",
    "calibrate_model": "leapquant.integrations",
}

__all__ = ["LeapQuantError", "__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'leapquant' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
