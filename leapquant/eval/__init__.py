"""Measuring methods: trace replay against the exact trajectory, and figures."""

from .plot import plot_state_error
from .simulate import checkpoint_steps, replay, simulate

__all__ = ["checkpoint_steps", "plot_state_error", "replay", "simulate"]
