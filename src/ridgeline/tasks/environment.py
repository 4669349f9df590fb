"""A task's environment without Docker: a sandbox whose writable workspace is the task's
working directory (/app in Terminal-Bench), built the way its Dockerfile says.

`prepare_environment(task)` returns a `TaskSandbox`: the backend sandbox plus the
harness's staging directories, mounted at

    /tests       the task's tests, copied in only when the verifier runs (read-only)
    /solution    the oracle solution, copied in only when it is applied (read-only)
    /logs        Harbor's log directory (/logs/verifier/reward.txt ...), writable
    /root        a writable home (HOME; uv's installer idiom writes ~/.local/bin)
    /ridgeline   the offline tools (uv, curl, apt-get ...), first on PATH

Failures are typed: `TaskUnsupported` (this machine cannot provide what the task needs:
the Dockerfile cannot be reproduced, a package or the internet is missing) and
`EnvironmentSetupError` (setup.sh or the sandbox failed: infrastructure).
"""

from __future__ import annotations

import os
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path, PurePosixPath

from ridgeline.errors import SandboxError, UnsupportedError
from ridgeline.sandbox import Limits, Mount, NetworkPolicy, SandboxSpec
from ridgeline.sandbox.base import ExecResult, HealthReport, Sandbox, ShellSession
from ridgeline.tasks.dockerfile import CopyStep, MkdirStep, RunStep
from ridgeline.tasks.harness import HARNESS_MOUNT, OFFLINE_MARK, HarnessTools, harness_tools
from ridgeline.tasks.model import Task

MiB = 1024 * 1024
BUILD_STEP_TIMEOUT_S = 300.0
SETUP_TIMEOUT_S = 120.0
TESTS_PATH = "/tests"
SOLUTION_PATH = "/solution"
LOGS_PATH = "/logs"


class TaskUnsupported(UnsupportedError):
    """This machine cannot provide what the task needs (reported, never scored)."""

    def __init__(self, task_id: str, reason: str) -> None:
        self.task_id = task_id
        self.reason = reason
        super().__init__(f"task {task_id!r} is unsupported here: {reason}")


class EnvironmentSetupError(SandboxError):
    """Setting up the task's environment failed (an infrastructure error, not a score)."""

    def __init__(self, task_id: str, reason: str) -> None:
        self.task_id = task_id
        self.reason = reason
        super().__init__(f"task {task_id!r}: environment set-up failed: {reason}")


HOME_PATH = "/root"   # Docker tasks run as root with this home; ours is writable


def interpreter_mounts(tools: HarnessTools) -> list[Mount]:
    """The host interpreter (its venv and the Python it is built on) runs the tests and
    the offline tools inside, so its trees are mounted read-only at their own paths:
    sandboxes show only the host's system directories, and the home mount at /root
    would hide a pyenv Python. Trees under /usr are already there."""
    roots = {sys.prefix, sys.base_prefix, str(Path(tools.python).resolve().parent.parent)}
    roots |= {os.path.realpath(r) for r in roots}   # symlinked prefixes: both paths
    kept: list[str] = []
    for r in sorted(roots):
        if r in ("/", "/usr") or r.startswith("/usr/"):
            continue
        if not any(r == k or r.startswith(k + "/") for k in kept):
            kept.append(r)
    return [Mount(source=Path(r), target=r, writable=False) for r in kept]


def _create_sandbox(spec: SandboxSpec, backend: str) -> Sandbox:
    from ridgeline.sandbox import create_sandbox  # the factory lives beside the backends
    return create_sandbox(spec, backend=backend)


class TaskSandbox:
    """A sandbox prepared for one task. It is a `Sandbox` (every call goes to the backend
    sandbox) that also knows its task and the host side of its staging mounts."""

    def __init__(self, task: Task, inner: Sandbox, staging: Path, tools: HarnessTools,
                 extra_dirs: dict[str, Path]) -> None:
        self.task = task
        self.inner = inner
        self.staging = staging
        self.tools = tools
        self.extra_dirs = extra_dirs
        self.setup_s = 0.0
        self._closed = False

    # host side of the mounts
    @property
    def tests_host_dir(self) -> Path:
        return self.staging / "tests"

    @property
    def solution_host_dir(self) -> Path:
        return self.staging / "solution"

    @property
    def logs_host_dir(self) -> Path:
        return self.staging / "logs"

    @property
    def spec(self) -> SandboxSpec:
        return self.inner.spec

    @property
    def workspace_dir(self) -> Path:
        return Path(self.inner.workspace_dir)  # type: ignore[attr-defined]

    def host_path(self, path: str) -> Path | None:
        """Where an absolute sandbox path under the workspace or an extra writable tree
        lives on the host (None for anything else)."""
        ws = self.spec.workspace_path
        for root, host in [(ws, self.workspace_dir), *self.extra_dirs.items()]:
            if path == root or path.startswith(root.rstrip("/") + "/"):
                rel = PurePosixPath(path).relative_to(root)
                return host / rel
        return None

    def run(self, cmd: str | list[str], timeout: float | None = None,
            env: dict[str, str] | None = None, cwd: str | None = None,
            stdin: bytes | None = None) -> ExecResult:
        return self.inner.run(cmd, timeout=timeout, env=env, cwd=cwd, stdin=stdin)

    def shell(self) -> ShellSession:
        return self.inner.shell()

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        self.inner.write_file(path, data, mode)

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        return self.inner.read_file(path, max_bytes)

    def list_files(self, path: str = ".") -> list[str]:
        return self.inner.list_files(path)

    def snapshot(self) -> str:
        return self.inner.snapshot()

    def restore(self, snapshot_id: str) -> None:
        self.inner.restore(snapshot_id)

    def health(self) -> HealthReport:
        return self.inner.health()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.inner.close()
        finally:
            shutil.rmtree(self.staging, ignore_errors=True)

    def __enter__(self) -> "TaskSandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def sandbox_limits(task: Task) -> Limits:
    """Task resources and timeouts as sandbox limits. CPU count has no equivalent (the
    sandbox limits CPU time, not cores); storage caps the size of any one file."""
    return Limits(wall_timeout_s=task.agent_timeout_s,
                  memory_bytes=task.resources.memory_mb * MiB,
                  max_file_size_bytes=task.resources.storage_mb * MiB)


def runtime_env(task: Task, tools: HarnessTools) -> dict[str, str]:
    home = HOME_PATH
    return {"PATH": tools.runtime_path(), "HOME": home, "TEST_DIR": TESTS_PATH,
            "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TERM": "xterm",
            "DEBIAN_FRONTEND": "noninteractive", "PYTHONUNBUFFERED": "1",
            "RIDGELINE_STATE": f"{home}/.cache/ridgeline-offline"}


def prepare_environment(task: Task, backend: str = "bwrap", *,
                        env: dict[str, str] | None = None) -> TaskSandbox:
    """Create the task's sandbox and build its environment in it (see module doc).
    Raises `TaskUnsupported` or `EnvironmentSetupError`; nothing is left behind then."""
    if (reason := task.unsupported_reason) is not None:
        raise TaskUnsupported(task.id, reason)
    t0 = time.perf_counter()
    tools = harness_tools()
    staging = Path(tempfile.mkdtemp(prefix=f"ridgeline-task-{task.id[:40]}-"))
    for sub in ("tests", "solution", "logs/verifier", "logs/agent", "home", "extra"):
        (staging / sub).mkdir(parents=True)
    extra: dict[str, Path] = {}
    for i, d in enumerate(task.build.extra_dirs):
        extra[d] = staging / "extra" / str(i)
        extra[d].mkdir()
    base = runtime_env(task, tools)
    steps, image_env = task.build.steps(base)
    home = base["HOME"]
    mounts = [Mount(source=tools.host_dir, target=HARNESS_MOUNT, writable=False),
              Mount(source=staging / "tests", target=TESTS_PATH, writable=False),
              Mount(source=staging / "solution", target=SOLUTION_PATH, writable=False),
              Mount(source=staging / "logs", target=LOGS_PATH, writable=True),
              Mount(source=staging / "home", target=home, writable=True),
              *interpreter_mounts(tools),
              *(Mount(source=h, target=d, writable=True) for d, h in extra.items())]
    spec = SandboxSpec(workspace_path=task.build.workspace, workdir=task.workdir,
                       mounts=mounts, env={**image_env, **(env or {})},
                       limits=sandbox_limits(task), network=NetworkPolicy.NONE)
    try:
        inner = _create_sandbox(spec, backend)
    except Exception:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    sb = TaskSandbox(task, inner, staging, tools, extra)
    try:
        _build(task, sb, steps)
        if task.setup_script is not None:
            _run_setup(task, sb)
    except BaseException:
        sb.close()
        raise
    sb.setup_s = time.perf_counter() - t0
    return sb


def _build(task: Task, sb: TaskSandbox, steps: list) -> None:
    ws = sb.workspace_dir
    if task.files_dir is not None:
        shutil.copytree(task.files_dir, ws, dirs_exist_ok=True, symlinks=True)
    for step in steps:
        if isinstance(step, MkdirStep):
            host = sb.host_path(step.path)
            if host is not None:
                host.mkdir(parents=True, exist_ok=True)
        elif isinstance(step, CopyStep):
            _copy(task, sb, step)
        elif isinstance(step, RunStep):
            _run_build_step(task, sb, step)


def _copy(task: Task, sb: TaskSandbox, step: CopyStep) -> None:
    dest = sb.host_path(step.dest)
    if dest is None:    # the plan already reports these; this guards a stale plan
        raise TaskUnsupported(task.id, f"Dockerfile line {step.line}: cannot copy into "
                              f"{step.dest} without Docker")
    written: list[Path] = []
    if step.content is not None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(step.content)
        written.append(dest)
    for src in step.sources:
        if step.unpack:
            dest.mkdir(parents=True, exist_ok=True)
            with tarfile.open(src) as tar:
                tar.extractall(dest, filter="data")
            written.append(dest)
        elif src.is_dir():
            shutil.copytree(src, dest, dirs_exist_ok=True, symlinks=True)
            written.append(dest)
        else:
            target = dest / src.name if (step.dest_is_dir or dest.is_dir()) else dest
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
            written.append(target)
    if step.chmod:
        mode = int(step.chmod, 8)
        for p in written:
            for q in [p, *(p.rglob("*") if p.is_dir() else [])]:
                q.chmod(mode)


def _failure_reason(res: ExecResult) -> str:
    text = res.stderr + "\n" + res.stdout
    marks = [ln.split(OFFLINE_MARK, 1)[1].strip() for ln in text.splitlines()
             if OFFLINE_MARK in ln]
    if marks:
        return marks[0]
    tail = " | ".join(ln for ln in text.strip().splitlines()[-3:] if ln.strip())
    how = "timed out" if res.timed_out else f"exit code {res.exit_code}"
    return f"{how}: {tail[-400:]}" if tail else how


def _run_build_step(task: Task, sb: TaskSandbox, step: RunStep) -> None:
    env = dict(step.env)
    env["PATH"] = f"{sb.tools.build_bin}:{env.get('PATH', sb.tools.runtime_path())}"
    try:
        res = sb.run(list(step.argv), timeout=BUILD_STEP_TIMEOUT_S, env=env,
                     cwd=step.workdir)
    except SandboxError as e:
        raise EnvironmentSetupError(task.id, f"Dockerfile line {step.line}: {e}") from e
    if not res.ok:
        cmd = step.argv[-1] if len(step.argv) > 1 else step.argv[0]
        cmd = cmd if len(cmd) < 80 else cmd[:77] + "..."
        # A build step that cannot run here means the image cannot be reproduced.
        raise TaskUnsupported(task.id, f"Dockerfile line {step.line}: RUN {cmd!r} "
                              f"failed here ({_failure_reason(res)})")


def _run_setup(task: Task, sb: TaskSandbox) -> None:
    assert task.setup_script is not None
    script = task.setup_script.read_bytes()
    try:
        res = sb.run(["bash", "-s"], stdin=script, timeout=SETUP_TIMEOUT_S)
    except SandboxError as e:
        raise EnvironmentSetupError(task.id, f"setup.sh: {e}") from e
    if not res.ok:
        if OFFLINE_MARK in res.stderr + res.stdout:
            raise TaskUnsupported(task.id, f"setup.sh: {_failure_reason(res)}")
        raise EnvironmentSetupError(task.id, f"setup.sh {_failure_reason(res)}")


def clear_dir(path: Path) -> None:
    """Empty a staging directory in place (it is bind-mounted, so it must stay)."""
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


def stage_copy(src: Path, dest_dir: Path, name: str | None = None) -> None:
    target = dest_dir / (name or src.name)
    if src.is_dir():
        shutil.copytree(src, target, dirs_exist_ok=True, symlinks=True)
    else:
        shutil.copy2(src, target)
    os.chmod(target, os.stat(target).st_mode | 0o444)
