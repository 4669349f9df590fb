"""What every backend shares: a workspace that is a directory on the host.

`HostSandbox` owns that directory (`workspace_dir`), the confined files API, snapshots,
health probes, the closed-state check and the context-manager protocol. A backend adds
how commands run (`run`, `shell`) and how all of its processes are stopped
(`_stop_processes`, `_start_processes`, `_close_processes`).
"""

from __future__ import annotations

import abc
import atexit
import logging
import os
import queue
import secrets
import shutil
import stat
import tempfile
import threading
import time
import weakref
from pathlib import Path

from ridgeline.errors import NotFoundError, SandboxError
from ridgeline.sandbox import disk, hostfs
from ridgeline.sandbox import fork as forks
from ridgeline.sandbox import snapshot as snapshots
from ridgeline.sandbox.base import ExecResult, HealthReport, SandboxSpec, ShellSession
from ridgeline.sandbox.quota import DiskQuota
from ridgeline.sandbox.workspace import Workspace

MIN_FREE_DISK_BYTES = 64 * 1024 * 1024
CLOCK_TOLERANCE_S = 5.0
EARLIEST_SANE_TIME = 1_704_067_200  # 2024-01-01: a clock before this is broken

log = logging.getLogger(__name__)
_live: "weakref.WeakSet[HostSandbox]" = weakref.WeakSet()
_live_lock = threading.Lock()


class _Trash:
    """Deletes directories in the background: a closed sandbox's directory is renamed
    away at once (one metadata operation) and its tree removed off the caller's path.
    The tree is the sandbox's (any depth, any width): removal is iterative and a failure
    is logged, never raised, so the thread lives on and the next sandboxes are served."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Path] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def discard(self, path: Path) -> None:
        trash = path.with_name(f".trash-{path.name}")
        try:
            os.rename(path, trash)
        except OSError:
            hostfs.discard_tree(path, "sandbox directory")
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="ridgeline-sandbox-trash")
                self._thread.start()
        self._queue.put(trash)

    def _loop(self) -> None:
        while True:
            path = self._queue.get()
            try:
                hostfs.discard_tree(path, "closed sandbox's directory")
            except BaseException as e:  # noqa: BLE001 - this thread must outlive any tree
                log.error("the sandbox trash failed on %s: %r", path, e)


_trash = _Trash()


def discard_later(path: Path) -> None:
    """Delete the directory `path` (any tree, however deep) in the background; a
    failure is logged. The caller must not use the path again."""
    _trash.discard(path)


def default_root() -> Path:
    """Where sandboxes keep their host directories: $RIDGELINE_SANDBOX_DIR, else a
    directory in the system temp dir."""
    env = os.environ.get("RIDGELINE_SANDBOX_DIR")
    return Path(env) if env else Path(tempfile.gettempdir()) / f"ridgeline-sandboxes-{os.getuid()}"


def prepare_root(root: Path) -> Path:
    """Create the root and remove directories of sandboxes whose process is gone."""
    # Only root may enter: files made inside belong to the host uid that runs the
    # sandbox, and a setuid file there must never be reachable by other host users.
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = root.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise SandboxError(f"{root} is not a directory owned by this user",
                           hint="remove it, or set RIDGELINE_SANDBOX_DIR to another directory")
    root.chmod(0o700)
    for child in root.iterdir():
        owner = child.name.removeprefix(".trash-").split("-", 1)[0]
        if child.is_dir() and owner.isdigit() and not Path(f"/proc/{owner}").exists():
            # A leftover that cannot be deleted is logged and left: it must never stop
            # this process from creating sandboxes.
            hostfs.discard_tree(child, "leftover sandbox directory")
    (root / ".empty").mkdir(exist_ok=True, mode=0o555)
    return root


class HostSandbox(abc.ABC):
    """Base of the backends: a sandbox whose workspace is the host directory
    `workspace_dir` (mounted at `spec.workspace_path` inside)."""

    backend = "host"

    def __init__(self, spec: SandboxSpec, root: Path,
                 owner: tuple[int, int] | None = None,
                 fork_base: "forks.ForkBase | None" = None) -> None:
        self.spec = spec
        #: The frozen workspace this sandbox's overlay reads (a fork), if any.
        self._fork_base: forks.ForkBase | None = None
        #: The host (uid, gid) the sandbox user is, when it is not the host's own.
        self.owner = owner
        self.id = secrets.token_hex(6)
        self.dir = root / f"{os.getpid()}-{self.id}"
        self._closed = False
        self._lock = threading.RLock()
        self._snapshots: dict[str, snapshots.Snapshot] = {}
        self._snap_seq = 0
        self.dir.mkdir(mode=0o700)
        self._owner_pid = os.getpid()
        try:
            ws = self.dir / "workspace"
            if spec.workspace_from is not None:
                src = Path(spec.workspace_from)
                if not src.is_dir():
                    raise NotFoundError(f"workspace_from {src} is not a directory",
                                        hint="seed the workspace from an existing directory")
            ws.mkdir()
            # A backend may give the workspace a filesystem of its own (volume.py).
            self._attach_storage(ws)
            if fork_base is not None:   # a fork: the base below, its own writes above
                forks.mount_overlay(ws, fork_base)
                fork_base.acquire()
                self._fork_base = fork_base
            if spec.workspace_from is not None:
                shutil.copytree(src, ws, symlinks=True, copy_function=disk.copy2_sparse,
                                dirs_exist_ok=True)
            ws.chmod(0o755)
            if owner is not None:  # nothing runs in the sandbox yet: a plain walk is safe
                chown_tree(ws, *owner)
            self.files = Workspace(ws, spec.workspace_path, spec.limits.max_file_size_bytes,
                                   owner)
        except BaseException:
            self._release_fork()
            self._release_storage()
            hostfs.discard_tree(self.dir, "sandbox directory")
            raise
        self._quota: DiskQuota | None = None
        with _live_lock:
            _live.add(self)

    def _attach_storage(self, ws: Path) -> None:
        """Give the (empty) workspace directory its own filesystem; none by default."""

    def _release_storage(self) -> None:
        """Undo `_attach_storage`, once nothing runs in the sandbox. Idempotent."""

    def _release_fork(self) -> None:
        """Detach a fork's overlay (before the storage under it) and let go of its base."""
        base, self._fork_base = self._fork_base, None
        if base is not None:
            try:
                forks.unmount_overlay(self.dir / "workspace")
            finally:
                base.release()

    def _start_quota(self) -> None:
        """Watch the disk quota (backends call this once their processes can run)."""
        limit = self.spec.limits.disk_bytes
        if limit is None or self._quota is not None:
            return
        trees = [self.workspace_dir, *(m.source for m in self.spec.mounts if m.writable)]
        self._quota = DiskQuota(trees, limit, self._over_quota, self.id)

    def _over_quota(self, used: int) -> None:
        with self._lock:
            if not self._closed:
                self._stop_processes()

    @property
    def disk_kills(self) -> int:
        """How many times the sandbox's processes were killed for its disk quota."""
        return self._quota.exceeded if self._quota is not None else 0

    # -- state -----------------------------------------------------------------------------
    @property
    def workspace_dir(self) -> Path:
        """The host directory that backs the workspace (copy files in and out here)."""
        return self.files.host_dir

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def alive(self) -> bool:
        """Open and able to run commands (cheap: no command is run)."""
        return not self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.id} is closed", hint="create a new sandbox")

    def _command(self, cmd: str | list[str], timeout: float | None) -> tuple[list[str], float]:
        """`run`'s command as argv (a string is a bash script, a list the argv itself) and
        its timeout: the spec's default, or a positive number of seconds."""
        argv = ["bash", "-c", cmd] if isinstance(cmd, str) else [str(a) for a in cmd]
        if timeout is None:
            return argv, self.spec.limits.wall_timeout_s
        if not isinstance(timeout, (int, float)) or not timeout > 0 or timeout == float("inf"):
            raise SandboxError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return argv, float(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} {self.id} {state} workspace={self.spec.workspace_path}>"

    # -- processes (backends) ----------------------------------------------------------------
    @abc.abstractmethod
    def run(self, cmd: str | list[str], timeout: float | None = None,
            env: dict[str, str] | None = None, cwd: str | None = None,
            stdin: bytes | None = None) -> ExecResult:
        """Run one command in the sandbox."""

    @abc.abstractmethod
    def shell(self) -> ShellSession:
        """A persistent bash session inside the sandbox."""

    @abc.abstractmethod
    def _stop_processes(self) -> None:
        """Kill every process of the sandbox (the sandbox stays usable afterwards)."""

    @abc.abstractmethod
    def _close_processes(self) -> None:
        """Kill every process and release what the backend holds (final)."""

    # -- files -----------------------------------------------------------------------------
    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        self._check_open()
        self.files.write_file(path, data, mode)

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        self._check_open()
        return self.files.read_file(path, max_bytes)

    def list_files(self, path: str = ".", recursive: bool = False) -> list[str]:
        self._check_open()
        return self.files.list_files(path, recursive)

    # -- snapshots -------------------------------------------------------------------------
    def snapshot(self) -> str:
        """Record the workspace; returns an id for `restore`."""
        with self._lock:
            self._check_open()
            self._snap_seq += 1
            snap_id = f"{self.id}-{self._snap_seq}"
            previous = next(reversed(self._snapshots.values()), None)
            self._snapshots[snap_id] = snapshots.take(
                self.workspace_dir, self.dir / "snapshots" / snap_id, snap_id, previous,
                max_bytes=self.spec.limits.disk_bytes)
            return snap_id

    def adopt_snapshot(self, store: Path, snap_id: str | None = None) -> str:
        """Register the current workspace, known to equal `store` (it was just seeded
        from it), as a snapshot without copying anything. Used by the warm pool."""
        with self._lock:
            self._check_open()
            snap_id = snap_id or f"{self.id}-base"
            self._snapshots[snap_id] = snapshots.adopt(self.workspace_dir, store, snap_id)
            return snap_id

    def restore(self, snapshot_id: str) -> None:
        """Return the workspace byte for byte to the snapshot (added files removed,
        changed ones rewritten, deleted ones recreated)."""
        with self._lock:
            self._check_open()
            snap = self._snapshots.get(snapshot_id)
            if snap is None:
                raise NotFoundError(f"no snapshot {snapshot_id!r} in sandbox {self.id}",
                                    hint="use an id returned by snapshot() of this sandbox")
            snapshots.restore(self.workspace_dir, snap)

    def stop_processes(self) -> None:
        """Kill every process in the sandbox (background ones included); the sandbox
        stays usable with the same workspace. The verifier calls this before grading so
        nothing the agent left running can touch the tests or their results."""
        with self._lock:
            self._check_open()
            self._stop_processes()

    def reset(self, snapshot_id: str) -> None:
        """Kill every process and restore the workspace: the state a pool hands out."""
        with self._lock:
            self._check_open()
            self._stop_processes()
            self.restore(snapshot_id)

    # -- health ----------------------------------------------------------------------------
    def health(self, timeout: float = 10.0) -> HealthReport:
        """Can it execute, is the workspace writable from inside, is disk free, is the
        clock sane. Tells a broken environment apart from an agent's failure."""
        checks: dict[str, bool] = {}
        problems: list[str] = []
        nonce = secrets.token_hex(4)
        probe = f"{self._probe_dir()}/.ridgeline-health-{nonce}"
        script = f'date +%s; : > "{probe}" && rm -f "{probe}" && echo writable'
        try:
            res = self.run(["sh", "-c", script], timeout=timeout)
            lines = res.stdout.split()
            checks["exec"] = bool(lines) and lines[0].isdigit()
            if not checks["exec"]:
                problems.append(f"probe exited {res.exit_code}: {res.stderr.strip()[:200]}")
        except Exception as e:  # noqa: BLE001 - any failure here is the finding
            res, lines = None, []
            checks["exec"] = False
            problems.append(f"cannot execute: {e}")
        checks["workspace_writable"] = "writable" in lines
        if checks["exec"] and not checks["workspace_writable"]:
            problems.append("the workspace is not writable from inside")
        now = time.time()
        try:
            inside = int(lines[0]) if lines else None
        except ValueError:
            inside = None
        checks["clock"] = (now > EARLIEST_SANE_TIME and inside is not None
                           and abs(inside - now) <= CLOCK_TOLERANCE_S)
        if not checks["clock"]:
            problems.append(f"clock not sane (host {now:.0f}, inside {inside})")
        try:
            # The host's disk under the sandbox, not the workspace: a workspace on a
            # volume of its own that the agent filled is the agent's doing.
            st = os.statvfs(self.dir)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = 0
        checks["disk"] = free >= MIN_FREE_DISK_BYTES
        if not checks["disk"]:
            problems.append(f"only {free // (1024 * 1024)} MiB free for the workspace")
        extra = self._health_checks()
        checks.update({k: ok for k, (ok, _) in extra.items()})
        problems += [why for ok, why in extra.values() if not ok]
        return HealthReport(all(checks.values()), checks, "; ".join(problems))

    def _health_checks(self) -> dict[str, tuple[bool, str]]:
        return {}

    def _probe_dir(self) -> str:
        """The workspace as commands see it."""
        return self.spec.workspace_path

    # -- end -------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process of the sandbox and delete its directories. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self._quota is not None:
                self._quota.stop()
            self._close_processes()
        finally:
            try:
                try:
                    self._release_fork()
                finally:
                    self._release_storage()
            finally:
                _trash.discard(self.dir)
            with _live_lock:
                _live.discard(self)


def chown_tree(root: Path, uid: int, gid: int) -> None:
    """Give a tree the host harness just created to the sandbox's uid (links are
    changed themselves, never followed). Only for trees no sandbox process can reach
    yet: once one runs, host writes go through `Workspace`."""
    # Relative to the walk's own descriptors: iterative, and no path grows past PATH_MAX.
    dir_fds: dict[str, int] = {}
    fd = hostfs.open_dir(root)
    try:
        os.fchown(fd, uid, gid)
        for rel, _ in disk.walk(fd, lambda rel, dfd: dir_fds.__setitem__(rel, dfd)):
            parent, _, name = rel.rpartition("/")
            os.chown(name, uid, gid, dir_fd=dir_fds[parent], follow_symlinks=False)
    finally:
        os.close(fd)


@atexit.register
def _close_all() -> None:
    """Sandboxes still open when the interpreter exits are closed, not leaked."""
    with _live_lock:
        live = [sb for sb in _live if sb._owner_pid == os.getpid()]  # not a fork's parent's
    for sb in live:
        try:
            sb.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
