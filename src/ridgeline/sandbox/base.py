"""The sandbox interface every backend implements, and the types it speaks.

Subsystems to the right (tasks, agent, rl, eval, platform) only ever see these names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, Field, model_validator

from ridgeline.errors import ConfigError


class NetworkPolicy(str, Enum):
    NONE = "none"          # no network at all (own empty net namespace)
    LOOPBACK = "loopback"  # own namespace with only `lo` up: servers inside talk to each other


class Mount(BaseModel):
    """An extra bind mount: `source` on the host appears at `target` inside."""

    source: Path
    target: str
    writable: bool = False

    @model_validator(mode="after")
    def _check(self) -> "Mount":
        if not self.target.startswith("/"):
            raise ValueError(f"mount target must be an absolute path, got {self.target!r}")
        return self


class Limits(BaseModel):
    """Resource limits; `None` means unlimited (not recommended for agents)."""

    wall_timeout_s: float = Field(120.0, gt=0, description="default timeout of one run()")
    cpu_seconds: int | None = Field(None, gt=0)
    memory_bytes: int | None = Field(2 * 1024**3, gt=0)
    max_processes: int | None = Field(512, gt=0)
    max_file_size_bytes: int | None = Field(1024**3, gt=0)
    max_output_bytes: int = Field(1024 * 1024, gt=0, description="captured per stream")


class SandboxSpec(BaseModel):
    """Everything that defines a sandbox. Pure data: a provider turns it into a Sandbox."""

    workspace_from: Path | None = Field(
        None, description="seed the workspace with a copy of this host directory")
    workspace_path: str = Field("/workspace", description="where the workspace is mounted inside")
    mounts: list[Mount] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = Field(None, description="cwd of commands; default: workspace_path")
    limits: Limits = Field(default_factory=Limits)
    network: NetworkPolicy = NetworkPolicy.NONE
    tools_root: Path = Field(Path("/"), description="host tree visible read-only inside")

    @model_validator(mode="after")
    def _check(self) -> "SandboxSpec":
        if not self.workspace_path.startswith("/") or self.workspace_path == "/":
            raise ValueError("workspace_path must be an absolute path other than '/'")
        return self

    @property
    def cwd(self) -> str:
        return self.workdir or self.workspace_path


@dataclass
class ExecResult:
    """The outcome of one command. `stdout`/`stderr` are decoded with replacement;
    the exact bytes are in `stdout_bytes`/`stderr_bytes`."""

    exit_code: int
    stdout_bytes: bytes
    stderr_bytes: bytes
    duration_s: float
    timed_out: bool = False
    killed_by: str | None = None  # "timeout", "memory", "cpu", "signal:<N>", "output" ...
    truncated: bool = False

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", errors="replace")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass
class HealthReport:
    healthy: bool
    checks: dict[str, bool] = field(default_factory=dict)
    detail: str = ""


@runtime_checkable
class ShellSession(Protocol):
    def send(self, cmd: str, timeout: float | None = None) -> ExecResult: ...
    def close(self) -> None: ...


@runtime_checkable
class Sandbox(Protocol):
    spec: SandboxSpec

    def run(self, cmd: str | list[str], timeout: float | None = None,
            env: dict[str, str] | None = None, cwd: str | None = None,
            stdin: bytes | None = None) -> ExecResult: ...
    def shell(self) -> ShellSession: ...
    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None: ...
    def read_file(self, path: str, max_bytes: int | None = None) -> bytes: ...
    def list_files(self, path: str = ".") -> list[str]: ...
    def snapshot(self) -> str: ...
    def restore(self, snapshot_id: str) -> None: ...
    def health(self) -> HealthReport: ...
    def close(self) -> None: ...


class SandboxProvider(Protocol):
    name: str

    def create(self, spec: SandboxSpec) -> Sandbox: ...


__all__ = [
    "ConfigError", "ExecResult", "HealthReport", "Limits", "Mount", "NetworkPolicy",
    "Sandbox", "SandboxProvider", "SandboxSpec", "ShellSession",
]
