"""leapquant: low-bit recurrent state for linear-attention LLM layers (the LeapQuant method).

Importing the package is cheap: it imports torch but touches no GPU and loads no Triton kernel.
"""

__version__ = "0.1.0"

__all__ = ["LeapQuantError", "__version__"]

from .errors import LeapQuantError
