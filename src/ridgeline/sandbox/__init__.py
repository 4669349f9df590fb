"""Isolated sandboxes where agents act, tasks are verified and rollouts run."""

from ridgeline.sandbox.base import (
    ExecResult, HealthReport, Limits, Mount, NetworkPolicy, Sandbox, SandboxProvider,
    SandboxSpec, ShellSession,
)

__all__ = [
    "ExecResult", "HealthReport", "Limits", "Mount", "NetworkPolicy", "Sandbox",
    "SandboxProvider", "SandboxSpec", "ShellSession",
]
