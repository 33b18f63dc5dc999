"""Format names to format objects.

Grammar (case-insensitive; ``GRAN`` is ``tensor``, ``row``, ``col`` or ``gG``, default ``col``)::

    fp32 | bf16 | fp16
    intN[-GRAN]                      N = 2..8, e.g. int8, int4-g32
    fp8-e4m3[-GRAN|-none]            also fp8-e5m2; -none is a plain cast without scale
    fp6-e2m3[-GRAN] | fp6-e3m2[-GRAN] | fp4-e2m1[-GRAN]
    mxfp8[-e4m3|-e5m2][-rceil]       mxfp6[-e2m3|-e3m2][-rceil]   mxfp4[-e2m1][-rceil]
    nvfp4 | nvfp6

``get_format(f.name) == f`` for every format this module builds (``stochastic`` aside: it is a
quantize-time option, not part of the storage name; the ``+sr`` name suffix is parsed by the method layer).
"""

from __future__ import annotations

import re

from ..errors import LeapQuantError
from .base import StateFormat, parse_granularity
from .constants import BF16, E2M1, E2M3, E3M2, E4M3, E5M2, FP16, MinifloatSpec
from .elements import IntElement, MinifloatElement
from .mx import MXFormat
from .nvfp import NVFPFormat
from .scaled import CastFormat, FullPrecision, ScaledFormat

__all__ = ["format_names", "get_format"]

_FAMILIES = (
    "use fp32, bf16, fp16, intN[-GRAN] (N=2..8), fp8-e4m3|fp8-e5m2[-GRAN|-none], fp6-e2m3|fp6-e3m2|fp4-e2m1"
    "[-GRAN], mxfp8[-e5m2]|mxfp6-e2m3|mxfp6-e3m2|mxfp4[-rceil], nvfp4, nvfp6 (GRAN: tensor, row, col, gG)"
)

_SCALED_MINIFLOATS: dict[str, MinifloatSpec] = {
    "fp8-e4m3": E4M3,
    "fp8-e5m2": E5M2,
    "fp6-e2m3": E2M3,
    "fp6-e3m2": E3M2,
    "fp4-e2m1": E2M1,
}
# MX family names; the bare family name picks the default element.
_MX: dict[str, MinifloatSpec] = {
    "mxfp8": E4M3,
    "mxfp8-e4m3": E4M3,
    "mxfp8-e5m2": E5M2,
    "mxfp6": E2M3,
    "mxfp6-e2m3": E2M3,
    "mxfp6-e3m2": E3M2,
    "mxfp4": E2M1,
    "mxfp4-e2m1": E2M1,
}
_NVFP = {"nvfp4": E2M1, "nvfp6": E2M3}
_INT = re.compile(r"int(\d+)(?:-(.+))?")


class UnknownFormat(LeapQuantError):
    """A name that belongs to no format family (a method name wraps it with its own hint)."""


def _unknown(name: str) -> LeapQuantError:
    return UnknownFormat(f"unknown format {name!r}: {_FAMILIES}")


def _granularity(name: str, text: str | None):
    if text is None:
        return "col"
    try:
        return parse_granularity(text)
    except LeapQuantError:
        raise LeapQuantError(
            f"format {name!r}: unknown granularity {text!r} (use tensor, row, col or gG, e.g. g32)"
        ) from None


def get_format(name: str, *, stochastic: bool = False) -> StateFormat:
    """The format called ``name``; ``stochastic=True`` rounds its elements stochastically.

    Raises :class:`LeapQuantError` for unknown names, and for ``stochastic`` on the lossless ``fp32``.
    """
    if not isinstance(name, str):
        raise LeapQuantError(f"a format name must be a string, got {name!r}")
    key = name.strip().lower()
    if key == "fp32":
        if stochastic:
            raise LeapQuantError("format 'fp32' is lossless: stochastic rounding does not apply")
        return FullPrecision()
    if key in ("bf16", "fp16"):
        return CastFormat(MinifloatElement(BF16 if key == "bf16" else FP16), stochastic)
    m = _INT.fullmatch(key)
    if m:
        bits = int(m.group(1))
        if not 2 <= bits <= 8:
            raise LeapQuantError(f"unknown format {name!r}: integer formats have 2..8 bits ({_FAMILIES})")
        return ScaledFormat(IntElement(bits), _granularity(name, m.group(2)), stochastic)
    for prefix, spec in _SCALED_MINIFLOATS.items():
        if key == prefix or key.startswith(prefix + "-"):
            rest = key[len(prefix) + 1 :] or None
            if rest == "none" and spec in (E4M3, E5M2):
                return CastFormat(MinifloatElement(spec), stochastic)
            return ScaledFormat(MinifloatElement(spec), _granularity(name, rest), stochastic)
    if key.startswith("mx"):
        base, rule = (key[: -len("-rceil")], "rceil") if key.endswith("-rceil") else (key, "floor")
        if base in _MX:
            return MXFormat(MinifloatElement(_MX[base]), rule, stochastic)
    if key in _NVFP:
        return NVFPFormat(MinifloatElement(_NVFP[key]), stochastic)
    raise _unknown(name)


def format_names() -> list[str]:
    """A representative list of canonical format names (every one parses with :func:`get_format`)."""
    return [
        "fp32",
        "bf16",
        "fp16",
        "fp8-e4m3",
        "fp8-e5m2",
        "fp8-e4m3-tensor",
        "fp8-e4m3-row",
        "fp8-e4m3-g32",
        "fp8-e4m3-none",
        "fp8-e5m2-none",
        "int8",
        "int6",
        "int4",
        "int8-tensor",
        "int8-row",
        "int8-g32",
        "int4-g32",
        "int4-g16",
        "fp6-e2m3",
        "fp4-e2m1-g32",
        "mxfp8",
        "mxfp8-rceil",
        "mxfp8-e5m2",
        "mxfp6-e2m3",
        "mxfp6-e3m2",
        "mxfp6-e2m3-rceil",
        "mxfp4",
        "mxfp4-rceil",
        "nvfp4",
        "nvfp6",
    ]
