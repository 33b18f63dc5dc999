"""Baselines the paper adapts from KV-cache/activation quantization to the recurrent state (Section 4.1).

Each is a :class:`~leapquant.formats.base.StateFormat` applied to the whole state after every step:

* ``kvquant-int{b}`` / ``kvquant-nuq{b}``: per-key-row integers (or NormalFloat levels) with the top 1% of
  entries kept as fp16 outliers (:class:`KVQuant`);
* ``quarot-int{b}``: two-sided randomized Hadamard rotation, then per-column integers (:class:`QuaRot`);
* ``-asym`` (``kvquant-int{b}-asym``, ``quarot-int{b}-asym``): the published papers' asymmetric grid,
  ``2^b`` levels from each row's (column's) min to its max, where the default grid is symmetric;
* ``turboquant-{b}``: per-column norm, random rotation and Lloyd-Max scalar codes (:class:`TurboQuant`).

Name grammar (``b`` is the bit width; suffixes only for non-default settings, in this order)::

    kvquant-(int|nuq){2..8}[-o{fraction}][-asym]   e.g. kvquant-int4, kvquant-nuq6-o0.02, kvquant-int4-asym
    quarot-int{2..8}[-seed{n}][-asym]              e.g. quarot-int8, quarot-int4-seed3, quarot-int4-asym
    turboquant-{1..8}[-seed{n}]               e.g. turboquant-4

Stochastic rounding is a quantize-time option (``get_baseline(name, stochastic=True)``; ``+sr`` in a method
name), not part of the storage name, as for every format.  ``get_baseline(f.name)`` gives back ``f`` for
deterministic formats.
"""

from __future__ import annotations

import re

from ...errors import LeapQuantError
from ...formats.base import StateFormat
from .kvquant import KVQuant, normal_float_codebook
from .quarot import QuaRot, random_orthogonal, randomized_hadamard
from .turboquant import LloydMaxCodebook, TurboQuant, lloyd_max_codebook

__all__ = [
    "KVQuant",
    "LloydMaxCodebook",
    "QuaRot",
    "TurboQuant",
    "baseline_names",
    "get_baseline",
    "lloyd_max_codebook",
    "normal_float_codebook",
    "random_orthogonal",
    "randomized_hadamard",
]

_NUM = r"(?:\d+(?:\.\d*)?|\.\d+)(?:e-?\d+)?"
_PATTERNS = {
    "kvquant": re.compile(rf"kvquant-(int|nuq)(\d+)(?:-o({_NUM}))?(-asym)?"),
    "quarot": re.compile(r"quarot-int(\d+)(?:-seed(\d+))?(-asym)?"),
    "turboquant": re.compile(r"turboquant-(\d+)(?:-seed(\d+))?"),
}
_GRAMMAR = {
    "kvquant": "kvquant-(int|nuq){2..8}[-o{fraction}][-asym]",
    "quarot": "quarot-int{2..8}[-seed{n}][-asym]",
    "turboquant": "turboquant-{1..8}[-seed{n}]",
}


def baseline_names() -> list[str]:
    """The canonical baseline names (the paper's 8/6/4-bit settings, plus TurboQuant at 3 and 2 bits)."""
    names = [f"kvquant-{kind}{b}" for kind in ("int", "nuq") for b in (8, 6, 4)]
    names += [f"quarot-int{b}" for b in (8, 6, 4)]
    names += [f"turboquant-{b}" for b in (8, 6, 4, 3, 2)]
    return names


def get_baseline(name: str, *, stochastic: bool = False) -> StateFormat | None:
    """The baseline format ``name`` denotes, ``None`` if it names no baseline family.

    ``stochastic=True`` rounds the integer grids of KVQuant and QuaRot stochastically; TurboQuant is
    deterministic and refuses it.

    Raises :class:`LeapQuantError` when the family is a baseline's but the rest does not parse or is out of
    range (``kvquant-int9``, ``quarot-fp8``, ``turboquant-x``), so a registry can try its own names first.
    """
    if not isinstance(name, str):
        raise LeapQuantError(f"a baseline name must be a string, got {type(name).__name__}")
    family = name.split("-", 1)[0]
    if family not in _PATTERNS:
        return None
    m = _PATTERNS[family].fullmatch(name)
    if m is None:
        raise LeapQuantError(f"bad {family} name {name!r}: expected {_GRAMMAR[family]}")
    if family == "kvquant":
        kind, bits, frac, asym = m.groups()
        fraction = 0.01 if frac is None else float(frac)
        fmt = KVQuant(
            bits=int(bits), nuq=kind == "nuq", outlier_fraction=fraction, stochastic=stochastic,
            asymmetric=asym is not None,
        )  # fmt: skip
    elif family == "quarot":
        bits, seed, asym = m.groups()
        fmt = QuaRot(bits=int(bits), seed=int(seed or 0), stochastic=stochastic, asymmetric=asym is not None)
    else:
        if stochastic:
            raise LeapQuantError(f"{name}: TurboQuant's codebook rounding is deterministic; drop +sr")
        bits, seed = m.groups()
        fmt = TurboQuant(bits=int(bits), seed=int(seed or 0))
    if fmt.name != name:  # one spelling a baseline: tables keyed by name must not list it twice
        raise LeapQuantError(f"baseline {name!r} is {fmt.name!r}: write it that way")
    return fmt
