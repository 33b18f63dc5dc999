"""How a ``[..., d_k, d_v]`` recurrent state is stored: formats, their names and the shared interface.

``get_format("int8")`` builds a format from its name (see :mod:`leapquant.formats.registry` for the
grammar); ``format_names()`` lists representative canonical names.  Every format implements
:class:`StateFormat`: ``quantize`` -> :class:`QuantizedState`, ``dequantize``, ``fake_quantize`` and the
exact ``bits_per_element``.
"""

from .base import QuantizedState, StateFormat
from .elements import IntElement, MinifloatElement
from .mx import MXFormat
from .nvfp import NVFPFormat
from .registry import format_names, get_format
from .scaled import CastFormat, FullPrecision, ScaledFormat

__all__ = [
    "CastFormat",
    "FullPrecision",
    "IntElement",
    "MXFormat",
    "MinifloatElement",
    "NVFPFormat",
    "QuantizedState",
    "ScaledFormat",
    "StateFormat",
    "format_names",
    "get_format",
]
