"""Ridgeline: sandboxes, an inference engine, coding agents, evaluation, async RL and an
agent platform, whole on one CPU machine with a small real model."""

import os

# Idle OpenMP workers sleep instead of spinning. torch's worker threads otherwise spin for
# a while after every parallel op, and on a small CPU they take the cores from the
# engine's attention-kernel threads (measured: decode attention 2x slower) and stall
# short matmuls for a scheduler slice. Read once, when torch loads its OpenMP runtime, so
# it only applies if ridgeline is imported before torch; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from ridgeline.errors import RidgelineError  # noqa: E402

__version__ = "0.1.0"
__all__ = ["RidgelineError", "__version__"]
