"""A task's environment without Docker: a sandbox whose writable workspace is the task's
working directory (/app in Terminal-Bench), built the way its Dockerfile says.

`prepare_environment(task)` returns a `TaskSandbox`: the backend sandbox plus the
harness's staging directories, mounted at

    /tests       the task's tests, copied in only when the verifier runs (read-only)
    /solution    the oracle solution, copied in only when it is applied (read-only)
    /logs        Harbor's log directory (/logs/verifier/reward.txt ...), writable
    /root        a writable home (HOME; uv's installer idiom writes ~/.local/bin),
                 emptied by the verifier before the tests (the agent's files never
                 configure the verifier's tools)
    /ridgeline   the offline tools (uv, curl, apt-get ...), first on PATH

Untrusted task directories: whatever the build writes into the sandbox (the task's
files, `COPY`/`ADD`, `WORKDIR`) is streamed in as a tar archive and unpacked *by the
sandbox user inside the sandbox*, so a link planted by an earlier `RUN` is resolved in
the sandbox's own view and can never make the host write, chmod or delete outside it.
Each `RUN` step's processes are killed when it ends (as a Docker layer would end them),
so nothing races the next step.

Failures are typed: `TaskUnsupported` (this machine cannot provide what the task needs:
the Dockerfile cannot be reproduced, a package or the internet is missing) and
`EnvironmentSetupError` (setup.sh or the sandbox failed: infrastructure).
"""

from __future__ import annotations

import contextlib
import logging
import lzma
import os
import posixpath
import secrets
import shutil
import stat
import sys
import tarfile
import tempfile
import time
import zlib
from pathlib import Path, PurePosixPath

from ridgeline.errors import ConfigError, SandboxError, UnsupportedError
from ridgeline.sandbox import Limits, Mount, NetworkPolicy, SandboxSpec, hostfs
from ridgeline.sandbox import fork as forks
from ridgeline.sandbox.base import ExecResult, HealthReport, Sandbox, ShellSession
from ridgeline.sandbox.host_sandbox import chown_tree, discard_later
from ridgeline.sandbox.bwrap import HOSTNAME
from ridgeline.sandbox.network import PrivateNetwork, hosts_file, resolv_conf
from ridgeline.tasks.build_archive import Budget, write_members, write_repacked
from ridgeline.tasks.dockerfile import CopyStep, MkdirStep, RunStep
from ridgeline.tasks.harness import HARNESS_MOUNT, OFFLINE_MARK, HarnessTools, harness_tools
from ridgeline.tasks import wheelhouse
from ridgeline.tasks.images import BuiltImage, builder, environment_mode, uses_images
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


log = logging.getLogger(__name__)

#: Files of the staging directory mounted over the image's (network_mounts).
NETWORK_FILES = ("hosts", "resolv.conf")

#: The operator's word on tasks that declare `allow_internet`: `deny` (the default: no
#: network while the agent acts or the tests run) or `allow`.
INTERNET_ENV = "RIDGELINE_TASK_INTERNET"

#: The backends that run a task on its built image (image_environment.py).
IMAGE_BACKENDS = ("bwrap", "docker")
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
        self.image: BuiltImage | None = None   # the built image, when there is one
        #: compose sidecars (running sandboxes) and the private network they share
        self.sidecars: dict[str, Sandbox] = {}
        self.network: PrivateNetwork | None = None
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
    def owner(self) -> tuple[int, int] | None:
        """The host (uid, gid) of the sandbox user, when it is not the host's own."""
        return getattr(self.inner, "owner", None)

    def stop_processes(self) -> None:
        """Kill every process in the sandbox (it stays usable)."""
        self.inner.stop_processes()  # type: ignore[attr-defined]

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

    def use_image(self, image: BuiltImage | None) -> None:
        """This sandbox runs on `image` (kept mounted until it closes)."""
        self.image = image
        if image is not None:
            builder().acquire(image)

    def fork(self, n: int) -> list["TaskSandbox"]:
        """`n` task sandboxes that start from this one's state: the same image (or host
        root) and a copy-on-write fork of the workspace as it is now (the task's setup
        and any agent steps so far; sandbox/fork.py). Each has staging of its own: an
        empty /logs, /tests and /solution, and a fresh home (what a step left in /root,
        /tmp or running processes is not kept). An RL group of one task uses this."""
        if self.sidecars:
            raise SandboxError(f"task {self.task.id!r}: cannot fork an environment with "
                               "compose sidecars (the forks would share them)")
        fork = getattr(self.inner, "fork", None)
        if fork is None:
            raise SandboxError(f"the {self.inner.backend} backend cannot fork sandboxes",
                               hint="use the bwrap backend")
        stagings, specs, extras = [], [], []
        old = {str(self.staging / sub): sub
               for sub in ("tests", "solution", "logs", "home", *NETWORK_FILES)}
        try:
            for _ in range(n):
                staging = Path(tempfile.mkdtemp(prefix=f"ridgeline-task-{self.task.id[:40]}-"))
                stagings.append(staging)
                for sub in ("tests", "solution", "logs/verifier", "logs/agent", "home"):
                    (staging / sub).mkdir(parents=True)
                for name in NETWORK_FILES:   # /etc/hosts ...: outlive this sandbox
                    if (self.staging / name).exists():
                        shutil.copy2(self.staging / name, staging / name)
                # writable trees beside the workspace (/data ...): a copy each, made as
                # snapshots are (the parent may be writing them)
                trees = {}
                for i, (target, host) in enumerate(self.extra_dirs.items()):
                    base = forks.ForkBase.freeze(host, staging / f"extra-{i}",
                                                 self.spec.limits.disk_bytes)
                    trees[str(host.resolve())] = base.tree
                mounts = [m.model_copy(update={"source": staging / old[str(m.source)]})
                          if str(m.source) in old else
                          m.model_copy(update={"source": trees[str(m.source.resolve())]})
                          if m.writable and str(m.source.resolve()) in trees else m
                          for m in self.spec.mounts]
                extras.append({t: trees[str(h.resolve())] for t, h in self.extra_dirs.items()})
                specs.append(self.spec.model_copy(update={"mounts": mounts,
                                                          "workspace_from": None}))
            inners = fork(n, specs)
        except BaseException:
            for staging in stagings:
                hostfs.discard_tree(staging, "task staging directory")
            raise
        out = []
        for inner, staging, extra in zip(inners, stagings, extras):
            sb = TaskSandbox(self.task, inner, staging, self.tools, extra)
            if sb.owner is not None:
                for tree in ["logs", "home", *(str(h.relative_to(staging))
                                               for h in extra.values())]:
                    chown_tree(staging / tree, *sb.owner)
            sb.use_image(self.image)
            out.append(sb)
        return out

    def run(self, cmd: str | list[str], timeout: float | None = None,
            env: dict[str, str] | None = None, cwd: str | None = None,
            stdin: bytes | None = None, pass_fds: tuple[int, ...] = ()) -> ExecResult:
        if pass_fds:  # only backends that start processes on this host can pass them
            return self.inner.run(cmd, timeout=timeout, env=env, cwd=cwd,  # type: ignore[call-arg]
                                  stdin=stdin, pass_fds=pass_fds)
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
            try:
                _close_group(self.sidecars, self.network)
                if self.image is not None:
                    builder().release(self.image)
            finally:
                # /logs and /root are the agent's (any depth): deleted off the caller's
                # path, a failure logged, never raised.
                discard_later(self.staging)

    def __enter__(self) -> "TaskSandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def _close_group(sidecars: dict[str, Sandbox], net: PrivateNetwork | None) -> None:
    from ridgeline.tasks.sidecars import close_group
    close_group(sidecars, net)


def wheel_mounts_for(task: Task, image: bool = False) -> tuple[list[Mount], dict[str, str]]:
    """The wheelhouse of what the task's test scripts install (wheelhouse.py), mounted
    read-only for the offline uv/pip stand-ins and a real pip (on the task's `image`,
    all of it: the image has only what its build installed), or nothing."""
    wheels = wheelhouse.prefetch(task, everything=image)
    if wheels is None:
        return [], {}
    return ([Mount(source=wheels, target=wheelhouse.MOUNT, writable=False)],
            {wheelhouse.ENV: wheelhouse.MOUNT, "PIP_FIND_LINKS": wheelhouse.MOUNT,
             "PIP_NO_INDEX": "1"})


def sandbox_limits(task: Task) -> Limits:
    """Task resources and timeouts as sandbox limits. CPU count has no equivalent (the
    sandbox limits CPU time, not cores); storage bounds both any one file and the disk
    the whole environment may hold (workspace, /logs, /root and other writable trees)."""
    storage = task.resources.storage_mb * MiB
    return Limits(wall_timeout_s=task.agent_timeout_s,
                  memory_bytes=task.resources.memory_mb * MiB,
                  max_file_size_bytes=storage, disk_bytes=storage)


def runtime_env(task: Task, tools: HarnessTools) -> dict[str, str]:
    home = HOME_PATH
    return {"PATH": tools.runtime_path(), "HOME": home, "TEST_DIR": TESTS_PATH,
            "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TERM": "xterm",
            "DEBIAN_FRONTEND": "noninteractive", "PYTHONUNBUFFERED": "1",
            "RIDGELINE_STATE": f"{home}/.cache/ridgeline-offline"}


def operator_allows_internet() -> bool:
    value = os.environ.get(INTERNET_ENV, "deny").strip().lower() or "deny"
    if value not in ("allow", "deny"):
        raise ConfigError(f"{INTERNET_ENV}={value!r} is not allow or deny",
                          hint="allow gives tasks that declare allow_internet the internet")
    return value == "allow"


def internet_for(task: Task, backend: str) -> bool:
    """Whether the task's sandbox reaches the internet: the task allows it and so does
    the operator ($RIDGELINE_TASK_INTERNET=allow); bwrap only (a slirp4netns NAT that
    keeps the host out of reach, sandbox/network.py)."""
    if not (task.resources.allow_internet and operator_allows_internet()):
        return False
    if backend != "bwrap":
        log.warning("task %s: internet is given on the bwrap backend only; on %s it runs "
                    "offline", task.id, backend)
        return False
    return True


def network_mounts(task: Task, staging: Path, net: PrivateNetwork | None) -> list[Mount]:
    """/etc/hosts (localhost and the task's service name, the compose services with
    sidecars: a Docker container gets one written at run time, and an image built by
    podman has an empty one), /etc/resolv.conf for the internet."""
    if not (staging / "hosts").exists():   # start_sidecars wrote it with every service
        hosts_file(staging, [task.service_name, HOSTNAME])
    mounts = [Mount(source=staging / "hosts", target="/etc/hosts", writable=False)]
    if net is not None and net.slirp is not None:
        mounts.append(Mount(source=resolv_conf(staging), target="/etc/resolv.conf",
                            writable=False))
    return mounts


def prepare_environment(task: Task, backend: str = "bwrap", *,
                        env: dict[str, str] | None = None,
                        mode: str | None = None) -> TaskSandbox:
    """Create the task's sandbox and build its environment in it (see module doc).
    `mode` (default: $RIDGELINE_TASK_ENV, else auto) says whether a Dockerfile is built
    for real (`image`, images.py) or interpreted onto the host's root (`host`).
    Raises `TaskUnsupported` or `EnvironmentSetupError`; nothing is left behind then."""
    image = None
    if task.build.source is not None and backend in IMAGE_BACKENDS and uses_images(mode):
        from ridgeline.tasks import image_environment as on_image
        if (reason := task.unsupported_reason_in(images=True)) is not None:
            raise TaskUnsupported(task.id, reason)
        if backend == "docker" and task.sidecars:
            raise TaskUnsupported(task.id, "compose sidecars run on the bwrap backend "
                                           "only (private networks of sibling sandboxes)")
        image = on_image.build_image(task, fallback=(mode or environment_mode()) == "auto")
    if image is None and (reason := task.unsupported_reason_in(images=False)) is not None:
        raise TaskUnsupported(task.id, reason)
    t0 = time.perf_counter()
    tools = harness_tools()
    staging = Path(tempfile.mkdtemp(prefix=f"ridgeline-task-{task.id[:40]}-"))
    sidecars: dict[str, Sandbox] = {}
    net: PrivateNetwork | None = None
    internet = internet_for(task, backend)
    try:
        if image is not None and task.sidecars:
            from ridgeline.tasks.sidecars import start_sidecars
            net, sidecars = start_sidecars(task, staging, internet=internet)
        elif internet:
            net = PrivateNetwork(internet=True)
        if image is not None:
            inner, extra = on_image.create_on_image(task, image, tools, staging, env, net,
                                                    backend)
            steps = []
        else:
            inner, extra, steps = _stage_and_create(task, tools, staging, backend, env, net)
    except BaseException:  # an invalid spec, a failed sandbox: nothing is left behind
        _close_group(sidecars, net)
        hostfs.discard_tree(staging, "task staging directory")
        raise
    sb = TaskSandbox(task, inner, staging, tools, extra)
    sb.sidecars, sb.network = sidecars, net
    sb.use_image(image)
    try:
        if sb.owner is not None:  # the writable staging trees are the sandbox user's
            for sub in ("logs", "home", "extra"):
                chown_tree(staging / sub, *sb.owner)
        _build(task, sb, steps)
        if task.setup_script is not None:
            _run_setup(task, sb)
    except BaseException:
        sb.close()
        raise
    sb.setup_s = time.perf_counter() - t0
    return sb


def _stage_and_create(task: Task, tools: HarnessTools, staging: Path, backend: str,
                      env: dict[str, str] | None, net: PrivateNetwork | None = None
                      ) -> tuple[Sandbox, dict[str, Path], list]:
    """The staging trees, the sandbox's spec and the sandbox (prepare_environment
    removes `staging` if this raises)."""
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
    wheel_mounts, wheel_env = wheel_mounts_for(task)
    spec = SandboxSpec(workspace_path=task.build.workspace, workdir=task.workdir,
                       mounts=mounts + wheel_mounts + network_mounts(task, staging, net),
                       env={**image_env, **wheel_env, **(env or {})},
                       limits=sandbox_limits(task), network=NetworkPolicy.LOOPBACK,
                       network_namespace=net.path if net is not None else None)
    return _create_sandbox(spec, backend), extra, steps


def _build(task: Task, sb: TaskSandbox, steps: list) -> None:
    if task.files_dir is not None:
        _copy_in(task, sb, sb.spec.workspace_path, _children(task.files_dir), None,
                 "the task's files")
    for step in steps:
        if isinstance(step, MkdirStep):
            if sb.host_path(step.path) is not None:
                _copy_in(task, sb, step.path, [], None, f"Dockerfile line {step.line}")
        elif isinstance(step, CopyStep):
            _copy(task, sb, step)
        elif isinstance(step, RunStep):
            _run_build_step(task, sb, step)
            sb.stop_processes()  # a layer's background processes end with it


#: Run by the sandbox user inside the sandbox: unpack the archive "$2" into "$1".
#: Modes as archived (-p); ownership is the sandbox user's (--no-same-owner).
_UNPACK = 'set -e; mkdir -p -- "$1"; exec tar -x -p --no-same-owner -C "$1" -f "$2"'


def _copy(task: Task, sb: TaskSandbox, step: CopyStep) -> None:
    where = f"Dockerfile line {step.line}"
    if sb.host_path(step.dest) is None:  # the plan already reports these; a stale plan
        raise TaskUnsupported(task.id, f"{where}: cannot copy into {step.dest} without "
                              "Docker")
    mode = int(step.chmod, 8) if step.chmod else None
    if step.content is not None:
        _copy_in(task, sb, posixpath.dirname(step.dest),
                 [(step.content, posixpath.basename(step.dest), False)], mode, where)
        return
    for src in step.sources:
        if step.unpack:
            _copy_in(task, sb, step.dest, [], mode, where, archive=src)
        elif src.is_dir():
            _copy_in(task, sb, step.dest, _children(src), mode, where)
        elif step.dest_is_dir or sb.run(["test", "-d", step.dest]).ok:
            _copy_in(task, sb, step.dest, [(src, src.name, True)], mode, where)
        else:
            _copy_in(task, sb, posixpath.dirname(step.dest),
                     [(src, posixpath.basename(step.dest), True)], mode, where)


def _children(directory: Path) -> list[tuple[Path | str, str, bool]]:
    """A directory's entries as members; links among them stay links (not followed)."""
    return [(c, c.name, False) for c in sorted(directory.iterdir())]


def _copy_in(task: Task, sb: TaskSandbox, dest: str,
             members: list[tuple[Path | str, str, bool]], mode: int | None, where: str,
             archive: Path | None = None) -> None:
    """Unpack `members` ((host path or text, name, follow a top-level link)) or a
    task's archive into the sandbox directory `dest`, as the sandbox user. The archive
    is streamed to a file in the (read-only to the sandbox) tests staging directory,
    capped by the task's storage (build_archive), and unpacked from there."""
    name = f".ridgeline-build-{secrets.token_hex(8)}.tar"
    budget = Budget(where, task.resources.storage_mb * MiB)
    fd = os.open(sb.tests_host_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                 | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.fchmod(fd, 0o644)  # the sandbox user reads it
        try:
            with os.fdopen(fd, "wb") as out:
                if archive is None:
                    write_members(out, members, mode, budget)
                else:
                    write_repacked(out, archive, mode, budget)
        except (OSError, tarfile.TarError, EOFError, zlib.error, lzma.LZMAError) as e:
            raise TaskUnsupported(task.id, f"{where}: cannot read the files to copy: "
                                  f"{e}") from e
        try:
            res = sb.run(["sh", "-c", _UNPACK, "sh", dest, f"{TESTS_PATH}/{name}"],
                         timeout=BUILD_STEP_TIMEOUT_S)
        except SandboxError as e:
            raise EnvironmentSetupError(task.id, f"{where}: {e}") from e
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sb.tests_host_dir / name)
    if not res.ok:
        raise TaskUnsupported(task.id, f"{where}: copying into {dest} failed here "
                              f"({_failure_reason(res)})")


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


def stage_copy(src: Path, dest_dir: Path, name: str | None = None) -> None:
    """Copy a file or tree of the task into a read-only staging directory (one the
    sandbox cannot write, so plain paths are safe here), readable by the sandbox."""
    target = dest_dir / (name or src.name)
    if src.is_dir():
        shutil.copytree(src, target, dirs_exist_ok=True, symlinks=True)
        for dirpath, dirnames, filenames in os.walk(target):
            for n in dirnames + filenames:
                _readable(Path(dirpath) / n)
    else:
        shutil.copy2(src, target)
    _readable(target)


def _readable(p: Path) -> None:
    """Let the sandbox user (not the owner: root) read it, and enter it if a directory."""
    st = p.lstat()
    if stat.S_ISLNK(st.st_mode):
        return
    extra = 0o555 if stat.S_ISDIR(st.st_mode) else 0o444
    os.chmod(p, stat.S_IMODE(st.st_mode) | extra)
