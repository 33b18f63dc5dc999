"""The one exception type leapquant raises for bad input, and the "did you mean" hint its messages share.

Every user-facing check raises :class:`LeapQuantError` with a one-line message that names the problem
(the argument, the expected and the actual value); the CLI prints it and exits with status 2.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["LeapQuantError", "did_you_mean"]


class LeapQuantError(ValueError):
    """Bad input: unknown method or format, malformed trace, shape or dtype mismatch, NaN/Inf."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``choices`` to ``name`` (``"; did you mean one of 'x',
    'y'?"`` for a name cut short that starts several), or ``""`` if none is close."""
    key, choices = str(name).strip().lower(), list(choices)
    started = [c for c in choices if key and c.startswith(key)]  # a name cut short
    close = started if len(started) == 1 else difflib.get_close_matches(key, choices, n=1, cutoff=0.6)
    if not close and len(started) > 1:
        return f"; did you mean one of {', '.join(map(repr, started))}?"
    return f"; did you mean {close[0]!r}?" if close else ""
