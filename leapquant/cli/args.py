"""Argument types and the parser class every ``leapquant`` command uses.

Types wrap :mod:`leapquant.checks`, so a bad value is refused while the command line is parsed, before any
work, with the same one-line message the Python API gives. The parser reports every error as one line.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from .. import checks
from ..errors import LeapQuantError

__all__ = [
    "Parser",
    "UsageError",
    "count",
    "device",
    "input_file",
    "output_dir",
    "output_file",
    "positive_float",
    "typed",
]


class UsageError(LeapQuantError):
    """A command line argparse refused (unknown option, missing argument, bad value)."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (no usage block), raised for ``main`` to print."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


def typed(check: Callable, name: str) -> Callable[[str], object]:
    """An argparse type from a check that raises :class:`LeapQuantError`."""

    def convert(text: str):
        try:
            return check(text)
        except LeapQuantError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name  # argparse names the type in its fallback message
    return convert


def count(minimum: int = 1) -> Callable[[str], int]:
    """A whole number of at least ``minimum``."""

    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise LeapQuantError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise LeapQuantError(f"must be >= {minimum}, got {value}")
        return value

    return typed(check, "count")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise LeapQuantError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise LeapQuantError(f"must be a finite number > 0, got {text}")
    return value


positive_float = typed(_positive_float, "positive_float")


def input_file(what: str, suffixes: Sequence[str] = ()) -> Callable[[str], object]:
    return typed(lambda text: checks.check_input_file(text, what, suffixes), "input_file")


def output_file(what: str, suffixes: Sequence[str] = ()) -> Callable[[str], object]:
    return typed(lambda text: checks.check_output_file(text, what, suffixes), "output_file")


def output_dir(what: str) -> Callable[[str], object]:
    return typed(lambda text: checks.check_output_dir(text, what), "output_dir")


device = typed(checks.resolve_device, "device")
"""``auto``, ``cpu``, ``cuda`` or ``cuda:N``, resolved against this machine."""

JSON = (".json",)
MD = (".md",)
PLOT = (".png", ".pdf", ".svg")
TRACE = (".npz",)
