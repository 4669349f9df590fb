"""Ridgeline: sandboxes, an inference engine, coding agents, evaluation, async RL and an
agent platform, whole on one CPU machine with a small real model."""

from ridgeline.errors import RidgelineError

__version__ = "0.1.0"
__all__ = ["RidgelineError", "__version__"]
