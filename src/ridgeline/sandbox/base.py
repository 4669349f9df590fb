"""The sandbox interface every backend implements, and the types it speaks.

Subsystems to the right (tasks, agent, rl, eval, platform) only ever see these names.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ridgeline.errors import ConfigError

MiB = 1024 * 1024
#: Below this a sandbox cannot even start bash; such a limit is a mistake, not a policy.
MIN_MEMORY_BYTES = 16 * MiB
#: bwrap, the sandbox's init and the command itself already count against the limit.
MIN_PROCESSES = 8
#: Paths the sandbox provides itself; nothing may be mounted on or under them.
RESERVED_PATHS = ("/proc", "/dev", "/sys")


class InvalidSpecError(ConfigError, ValueError):
    """A sandbox spec, limit or mount is invalid. It is a `ConfigError` for callers and a
    `ValueError` for pydantic, so a bad nested model still names its parent field."""


class _SpecModel(BaseModel):
    """Strict pydantic model: unknown fields are typos, and invalid values raise an
    `InvalidSpecError` that names the field (never a bare pydantic traceback)."""

    model_config = ConfigDict(extra="forbid")

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            from ridgeline.config import format_validation_error
            msg = format_validation_error(e, type(self).__name__)
            raise InvalidSpecError(msg.replace("Value error, ", "")) from None


def normalize_sandbox_path(path: str, what: str) -> str:
    """An absolute, normalised path inside the sandbox (no `..`, no trailing slash)."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError(f"{what} must be an absolute path, got {path!r}")
    if "\0" in path or any(part == ".." for part in path.split("/")):
        raise ValueError(f"{what} must not contain '..' or NUL bytes, got {path!r}")
    return posixpath.normpath(path).replace("//", "/")


def _mount_point(path: str, what: str, root_refusal: str) -> str:
    """`path` normalised as a place the spec mounts something on: not '/' (`root_refusal`
    says why) and not on or under the paths the sandbox provides itself."""
    v = normalize_sandbox_path(path, what)
    if v == "/":
        raise ValueError(root_refusal)
    if any(v == r or v.startswith(r + "/") for r in RESERVED_PATHS):
        raise ValueError(f"{what} {v!r} is inside {', '.join(RESERVED_PATHS)}, "
                         "which the sandbox provides itself")
    return v


class NetworkPolicy(str, Enum):
    NONE = "none"          # no network at all (own empty net namespace)
    LOOPBACK = "loopback"  # own namespace with only `lo` up: servers inside talk to each other


class Mount(_SpecModel):
    """An extra bind mount: `source` on the host appears at `target` inside."""

    source: Path
    target: str
    writable: bool = False

    @field_validator("target")
    @classmethod
    def _target(cls, v: str) -> str:
        return _mount_point(v, "mount target",
                            "mount target must not be '/' (use tools_root for the root)")


class Limits(_SpecModel):
    """Resource limits; `None` means unlimited (not recommended for agents)."""

    wall_timeout_s: float = Field(120.0, gt=0, allow_inf_nan=False,
                                  description="default timeout of one run()")
    cpu_seconds: int | None = Field(None, gt=0, description="CPU time of one process")
    memory_bytes: int | None = Field(2 * 1024**3, ge=MIN_MEMORY_BYTES,
                                     description="memory of the whole sandbox")
    max_processes: int | None = Field(512, ge=MIN_PROCESSES,
                                      description="processes and threads of the whole sandbox")
    max_file_size_bytes: int | None = Field(1024**3, gt=0, description="size of any one file")
    disk_bytes: int | None = Field(
        10 * 1024**3, gt=0, description="disk the workspace and writable mounts may hold "
        "(allocated bytes, so sparse files count what they hold). The workspace is a "
        "filesystem of this size (writes past it fail with ENOSPC); over it in total, every "
        "process of the sandbox is killed, and snapshots are refused")
    disk_inodes: int = Field(1_000_000, ge=16, description="files, directories and links "
                             "the workspace may hold (its filesystem's inode count)")
    weak_limits: bool = Field(
        False, description="accept weaker enforcement where this machine lacks the strong "
        "one: without loop devices the disk quota is a watcher that kills after the fact, "
        "and without cgroup controllers memory and processes are per-process rlimits. "
        "Off (the default), such a sandbox is refused with the reason")
    max_output_bytes: int = Field(1024 * 1024, gt=0, description="captured per stream")


class SandboxSpec(_SpecModel):
    """Everything that defines a sandbox. Pure data: a provider turns it into a Sandbox."""

    workspace_from: Path | None = Field(
        None, description="seed the workspace with a copy of this host directory")
    workspace_path: str = Field("/workspace", description="where the workspace is mounted inside")
    mounts: list[Mount] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = Field(None, description="cwd of commands; default: workspace_path")
    limits: Limits = Field(default_factory=Limits)
    network: NetworkPolicy = NetworkPolicy.NONE
    network_namespace: Path | None = Field(
        None, description="join this private network (sandbox.network.PrivateNetwork: "
                          "loopback shared by a group of sandboxes) instead of `network`")
    tools_root: Path = Field(Path("/"), description="host tree visible read-only inside")
    image: str | None = Field(None, description="container image (docker backend only)")

    @field_validator("workspace_path")
    @classmethod
    def _workspace_path(cls, v: str) -> str:
        return _mount_point(v, "workspace_path",
                            "workspace_path must be an absolute path other than '/'")

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str | None) -> str | None:
        return None if v is None else normalize_sandbox_path(v, "workdir")

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if not k or "=" in k or "\0" in k or "\0" in val:
                raise ValueError(f"invalid environment variable {k!r}: names must be "
                                 "non-empty without '=' and values must not contain NUL")
        return v

    @model_validator(mode="after")
    def _check(self) -> "SandboxSpec":
        targets = [m.target for m in self.mounts]
        dup = {t for t in targets if targets.count(t) > 1}
        if dup:
            raise ValueError(f"two mounts share the target {sorted(dup)[0]!r}")
        if self.workspace_path in targets:
            raise ValueError(f"a mount targets the workspace path {self.workspace_path!r}")
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
    killed_by: str | None = None  # "timeout", "memory", "cpu", "file_size", "output", "signal:<N>"
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
    """A persistent bash: cwd, variables and background jobs survive between commands.
    `send` returns that command's output and exit status; at `timeout` the command is
    killed (timed_out=True, exit code 124) and the session stays usable. After the shell
    itself exits (`exit`), `send` raises SandboxError."""

    def send(self, cmd: str, timeout: float | None = None) -> ExecResult: ...
    def close(self) -> None: ...


@runtime_checkable
class Sandbox(Protocol):
    """An isolated machine for one agent or task. A context manager; every method but
    `close` raises SandboxError once it is closed.

    - `run`: a str runs with `bash -c`, a list is executed directly; a missing command is
      exit code 127 in the result; `timeout` defaults to `spec.limits.wall_timeout_s`, and
      at the timeout every process the command started is killed (exit code 124).
    - files: paths are relative to the workspace or absolute inside it (`/app/x` when
      `workspace_path` is `/app`); `..` or symlinks leading outside raise
      PathEscapeError, a missing file NotFoundError. `list_files` gives the entries of a
      directory, sorted, directories with a trailing '/'.
    - `snapshot`/`restore`: the workspace returns byte for byte (files added, changed,
      deleted since); processes and /tmp are not part of a snapshot.
    - `workspace_dir`: the host directory that backs the workspace.
    """

    spec: SandboxSpec

    @property
    def workspace_dir(self) -> Path: ...
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
    "ConfigError", "ExecResult", "InvalidSpecError", "HealthReport", "Limits", "Mount", "NetworkPolicy",
    "Sandbox", "SandboxProvider", "SandboxSpec", "ShellSession",
]
