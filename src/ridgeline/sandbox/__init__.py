"""Isolated sandboxes where agents act, tasks are verified and rollouts run.

    from ridgeline.sandbox import create_sandbox, SandboxSpec
    with create_sandbox(SandboxSpec(workspace_path="/app")) as sb:
        sb.run("echo hi").stdout

Backends: `bwrap` (default; namespaces, cgroups, read-only host root), `local` (no
isolation, for development) and `docker` (a Docker engine through its Python SDK).
"""

from __future__ import annotations

import threading
from typing import Any

from ridgeline.errors import SandboxError
from ridgeline.sandbox.base import (
    ExecResult, HealthReport, InvalidSpecError, Limits, Mount, NetworkPolicy, Sandbox,
    SandboxProvider, SandboxSpec, ShellSession,
)

BACKENDS = ("bwrap", "local", "docker")
DEFAULT_BACKEND = "bwrap"

_providers: dict[str, SandboxProvider] = {}
_lock = threading.Lock()


def _make_provider(name: str, **options: Any) -> SandboxProvider:
    if name == "bwrap":
        from ridgeline.sandbox.bwrap import BwrapProvider
        return BwrapProvider(**options)
    if name == "local":
        from ridgeline.sandbox.local import LocalProvider
        return LocalProvider(**options)
    if name == "docker":
        from ridgeline.sandbox.docker import DockerProvider
        return DockerProvider(**options)
    raise SandboxError(f"unknown sandbox backend {name!r}",
                       hint=f"valid backends: {', '.join(BACKENDS)}")


def get_provider(name: str = DEFAULT_BACKEND, **options: Any) -> SandboxProvider:
    """The provider of a backend. Without options it is shared (made once per process);
    options (e.g. `bwrap_path=`, `root_dir=`) make a new one."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise SandboxError(f"unknown sandbox backend {name!r}",
                           hint=f"valid backends: {', '.join(BACKENDS)}")
    if options:
        return _make_provider(name, **options)
    with _lock:
        if name not in _providers:
            _providers[name] = _make_provider(name)
        return _providers[name]


def create_sandbox(spec: SandboxSpec | None = None, backend: str = DEFAULT_BACKEND) -> Sandbox:
    """Create a sandbox (a context manager: `with create_sandbox(spec) as sb:`)."""
    if spec is not None and not isinstance(spec, SandboxSpec):
        raise SandboxError(f"spec must be a SandboxSpec, got {type(spec).__name__}")
    return get_provider(backend).create(spec or SandboxSpec())


def __getattr__(name: str) -> Any:
    # The pool imports the backends lazily; exposing it here keeps `import ridgeline.sandbox`
    # cheap for subsystems that only need the types.
    if name == "SandboxPool":
        from ridgeline.sandbox.pool import SandboxPool
        return SandboxPool
    raise AttributeError(name)


__all__ = [
    "BACKENDS", "ExecResult", "HealthReport", "InvalidSpecError", "Limits", "Mount",
    "NetworkPolicy", "Sandbox", "SandboxPool", "SandboxProvider", "SandboxSpec",
    "ShellSession", "create_sandbox", "get_provider",
]
