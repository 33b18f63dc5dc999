"""The one exception type leapquant raises for bad input.

Every user-facing check raises :class:`LeapQuantError` with a one-line message that names the problem
(the argument, the expected and the actual value); the CLI prints it and exits non-zero.
"""

__all__ = ["LeapQuantError"]


class LeapQuantError(ValueError):
    """Bad input: unknown method or format, malformed trace, shape or dtype mismatch, NaN/Inf."""
