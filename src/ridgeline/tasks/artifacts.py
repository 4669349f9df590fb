"""Harbor's separate verifier environment (`verifier.environment_mode = "separate"`):
the tests run in an image of their own (the task's tests/Dockerfile), given only the
files the task declares as `artifacts` from the agent's environment.

The artifacts are archived *inside* the agent's sandbox (after its processes are
stopped) into its /logs/agent, read by the host without following links and capped by
the task's storage, and unpacked by the sandbox user inside the verifier's sandbox once
the verifier has reset it, so nothing the agent wrote is interpreted by the host and no
path it names can make the host write outside the verifier's sandbox.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import replace

from ridgeline.errors import SandboxError
from ridgeline.tasks.dockerfile import plan_build
from ridgeline.tasks.environment import LOGS_PATH, TESTS_PATH, TaskSandbox
from ridgeline.tasks.model import Task

ARCHIVE = ".ridgeline-artifacts.tar"
MiB = 1024 * 1024


class ArtifactsTooLarge(SandboxError):
    """The agent left artifacts larger than the task's storage: its failure."""


def verifier_task(task: Task) -> Task:
    """The task as its separate verifier environment: built from tests/Dockerfile (its
    context the tests folder), nothing of the agent's environment (setup, sidecars)."""
    assert task.verifier_dockerfile is not None
    build = plan_build(task.verifier_dockerfile, task.verifier_dockerfile.parent)
    return replace(task, build=build, sidecars=(), setup_script=None, files_dir=None,
                   verifier_dockerfile=None, artifacts=())


def collect(task: Task, sandbox: TaskSandbox) -> bytes:
    """A tar of the task's artifacts as the agent's sandbox has them (missing ones are
    left out, as Harbor leaves them)."""
    if not task.artifacts:
        return b""
    rel = [a.lstrip("/") for a in task.artifacts]
    # a name the agent cannot have planted anything at (its processes are stopped)
    name = f".ridgeline-artifacts-{secrets.token_hex(8)}.tar"
    res = sandbox.run(["tar", "-c", "--ignore-failed-read", "-f",
                       f"{LOGS_PATH}/agent/{name}", "-C", "/", *rel], timeout=120)
    host = sandbox.logs_host_dir / "agent" / name
    if res.killed_by == "file_size" or "No space left" in res.stderr:
        # the archive of what the agent left does not fit the task's limits
        with contextlib.suppress(OSError):
            os.unlink(host)
        raise ArtifactsTooLarge(f"the artifacts do not fit the task's storage "
                                f"({task.resources.storage_mb} MB)")
    try:
        fd = os.open(host, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SandboxError(f"the artifacts could not be archived: {res.stderr[-300:]}"
                           ) from None
    try:
        cap = task.resources.storage_mb * MiB
        with os.fdopen(fd, "rb") as f:
            data = f.read(cap + 1)
        if len(data) > cap:
            raise ArtifactsTooLarge(f"the artifacts are larger than the task's storage "
                                    f"({task.resources.storage_mb} MB)")
        return data
    finally:
        with contextlib.suppress(OSError):
            os.unlink(host)


def place(sandbox: TaskSandbox, data: bytes) -> None:
    """Unpack the artifacts at their paths in the verifier's sandbox, as its user."""
    if not data:
        return
    staged = sandbox.tests_host_dir / ARCHIVE
    staged.write_bytes(data)
    staged.chmod(0o644)
    try:
        res = sandbox.run(["tar", "-x", "-p", "--no-same-owner", "-C", "/", "-f",
                           f"{TESTS_PATH}/{ARCHIVE}"], timeout=120)
    finally:
        staged.unlink(missing_ok=True)
    if not res.ok:
        raise SandboxError(f"the artifacts could not be placed in the verifier's "
                           f"environment: {res.stderr.strip()[-300:]}")
