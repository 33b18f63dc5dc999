"""Trace files (general-form records of recorded or synthetic streams) and synthetic traces."""

from .io import Trace, load_trace, save_trace
from .synth import SynthConfig, synthesize

__all__ = ["SynthConfig", "Trace", "load_trace", "save_trace", "synthesize"]
