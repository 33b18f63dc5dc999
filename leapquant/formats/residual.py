"""The residual formats the decode kernels store, in one table: pool, kernel and planner facts derive here.

A *residual format* is a state format with a GPU layout: the payload dtype of ``LeapQuantPool`` (and of
``PerStepPool`` where a per-step kernel exists), whether a per-value-channel fp32 scale rides beside it, the
element maximum the scale maps to, the ``RESIDUAL`` code the Triton kernels and ``close.cu`` branch on, and
which window closes and per-step kernels take it.  The numerics are those of the state formats of the same
name (:func:`leapquant.formats.get_format`); ``tests/test_residual_formats.py`` checks that every consumer
agrees with this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..errors import LeapQuantError

__all__ = [
    "CUDA_CLOSE_RESIDUALS",
    "PER_STEP_RESIDUALS",
    "RESIDUAL_FORMATS",
    "ResidualFormat",
    "residual_format",
]


@dataclass(frozen=True)
class ResidualFormat:
    """One residual format's layout and kernel facts (its numerics: ``get_format(name)``).

    Attributes:
        name: the state-format name (``int8``, ``fp8-e4m3``, ...), as in method names.
        payload_dtype: dtype of the pool's ``payload`` tensor.
        keys_per_element: keys packed in one payload element (int4: two per byte, even key in the low nibble).
        scaled: a per-value-channel fp32 ``scale`` tensor rides beside the payload.
        code: the ``RESIDUAL`` constant of the kernels (``fused_recurrent.py``, ``close.py``, ``close.cu``);
            formats that share a code share a code path (int6 runs int8's on 6-bit codes).
        stored_bits: bits the payload spends per element (int6 keeps its codes one per byte: 8).
        cuda_close: ``close.cu`` takes it (the Triton close takes every format).
        per_step_code: the ``STATE`` code of the per-step kernel (``None``: no per-step kernel).
    """

    name: str
    payload_dtype: torch.dtype
    keys_per_element: int
    scaled: bool
    code: int
    stored_bits: int
    cuda_close: bool
    per_step_code: int | None

    @cached_property
    def state_format(self):
        """The :class:`~leapquant.formats.StateFormat` whose numerics the kernels reproduce."""
        from . import get_format

        return get_format(self.name)

    @cached_property
    def qmax(self) -> float | None:
        """Element maximum the per-value-channel scale maps to (``None``: unscaled)."""
        return self.state_format.element.max_value if self.scaled else None

    @cached_property
    def integer(self) -> bool:
        """Integer codes (the tensor-core step takes them as exact operands)."""
        from .elements import IntElement

        return isinstance(getattr(self.state_format, "element", None), IntElement)

    @cached_property
    def packed(self) -> bool:
        """Whether the payload stores the format at its own width (int6: no, its codes sit in bytes)."""
        bits = self.state_format.part_bits()
        return self.stored_bits == bits.get("codes", bits.get("values"))


# fmt: off
_TABLE = (
    #              name        payload dtype        keys/elem scaled code bits cuda_close per_step_code
    ResidualFormat("int8",     torch.int8,          1,        True,  2,   8,   True,      2),
    ResidualFormat("int6",     torch.int8,          1,        True,  2,   8,   True,      None),
    ResidualFormat("int4",     torch.uint8,         2,        True,  4,   4,   True,      None),
    ResidualFormat("fp8-e4m3", torch.float8_e4m3fn, 1,        True,  3,   8,   True,      None),
    ResidualFormat("bf16",     torch.bfloat16,      1,        False, 1,   16,  False,     1),
    ResidualFormat("fp32",     torch.float32,       1,        False, 0,   32,  False,     0),
)
# fmt: on
RESIDUAL_FORMATS: dict[str, ResidualFormat] = {f.name: f for f in _TABLE}
CUDA_CLOSE_RESIDUALS = tuple(f.name for f in _TABLE if f.cuda_close)
PER_STEP_RESIDUALS = tuple(f.name for f in _TABLE if f.per_step_code is not None)


def residual_format(name: str) -> ResidualFormat:
    """The table row of ``name`` (raises :class:`LeapQuantError` naming the formats that have kernels)."""
    fmt = RESIDUAL_FORMATS.get(name)
    if fmt is None:
        raise LeapQuantError(
            f"no kernel stores {name!r}: kernel residual formats are {', '.join(RESIDUAL_FORMATS)}"
        )
    return fmt
