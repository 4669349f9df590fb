"""Per-sandbox cgroups (v1 memory, pids and cpu controllers), where the machine allows.

Why cgroups: a sandbox's processes all map to one host uid, so rlimits cannot bound the
sandbox as a whole. The pids controller is the fork-bomb limit (RLIMIT_NPROC is not
enforced for a uid that maps to host root, and would otherwise be shared by every
sandbox), the memory controller kills a memory bomb and says so (`oom_kill` counter),
and the cpu controller puts all sandboxes together in one group that weighs like two
host processes, so the host stays responsive whatever runs inside.

Each sandbox gets `<controller>/<our cgroup>/ridgeline/<pid>-<id>`; every command run
in it gets its own pids sub-group, so a timeout kills exactly that command's processes
(also the ones that called setsid or were re-parented). A process is placed by the
thread that starts it: each sandbox has a launcher thread that lives in the sandbox's
groups (cgroup v1 allows per-thread membership, and a child starts in the groups of the
thread that forked it), so there is no wrapper process and `subprocess` keeps its fast
vfork path. The OOM killer only picks thread-group leaders, never that thread's host
process.

Without root or without v1 controllers (`CgroupHost.detect()` is None) the backends fall
back to rlimits and process-group kills.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import itertools
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "pids", "cpu")
#: Weight of the parent group of all sandboxes, against 1024 for one host process.
ALL_SANDBOXES_CPU_SHARES = 2048


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller, from /proc/self/cgroup."""
    paths: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        for c in ctrls.split(","):
            if c:
                paths[c] = path
    return paths


def _make_parent(controller: str, parent: Path) -> None:
    parent.mkdir(exist_ok=True)
    if controller == "cpu":
        _write(parent / "cpu.shares", ALL_SANDBOXES_CPU_SHARES)


def _write(path: Path, value: str | int) -> None:
    # Moving a thread by writing "0" (the writer itself) to `tasks` skips the kernel's
    # global threadgroup lock, whose write side waits for an RCU grace period and
    # stalls every fork on the machine meanwhile (milliseconds under load).
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, str(value).encode())
    finally:
        os.close(fd)


def _read_pids(path: Path) -> set[int]:
    try:
        return {int(x) for x in (path / "cgroup.procs").read_text().split()}
    except OSError:  # removed meanwhile (ENOENT, or ENODEV while being removed)
        return set()


def _tree(path: Path) -> list[Path]:
    """`path` and all cgroups below it, deepest first (the order rmdir needs)."""
    out: list[Path] = []
    for dirpath, dirnames, _ in os.walk(path, topdown=False):
        out.append(Path(dirpath))
    return out


def kill_tree(path: Path, keep: frozenset[int] = frozenset(), timeout: float = 5.0) -> bool:
    """SIGKILL every process in the cgroup `path` and below, except `keep` and this
    process, until none is left (a fork racing the kill is caught by the next pass).
    Returns once they are gone from /proc too: a task leaves its cgroup early in its
    exit, before it has released its resources and been reaped."""
    keep = keep | {os.getpid()}
    end = time.monotonic() + timeout
    killed: set[int] = set()
    while True:
        pids: set[int] = set()
        for p in _tree(path):
            pids |= _read_pids(p)
        pids -= keep
        if not pids:
            break
        if time.monotonic() > end:
            return False
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        killed |= pids
        time.sleep(0.001)
    while killed and time.monotonic() < end:
        killed = {p for p in killed if not _gone(p)}
        if killed:
            time.sleep(0.001)
    return not killed


def _gone(pid: int) -> bool:
    """Exited and reaped, or a zombie of ours (our caller reaps it: `Popen.wait`)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0] in ("Z", "X") and int(fields[1]) == os.getpid()


def remove_tree(path: Path, timeout: float = 5.0) -> bool:
    """rmdir `path` and its sub-groups (they must be empty; exiting tasks take a moment)."""
    end = time.monotonic() + timeout
    for p in _tree(path):
        while True:
            try:
                p.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > end:
                    return False
                time.sleep(0.002)
    return True


class _Janitor:
    """Removes emptied cgroups in the background: rmdir of a cgroup waits for the kernel
    to retire it (an RCU grace period, about a millisecond), which no command should pay.
    A group still busy after a while (a background process lives on) is left alone; the
    sandbox's `destroy` removes it with everything else."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Path, float]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def remove(self, path: Path, patience: float = 0.5) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="ridgeline-cgroup-janitor")
                self._thread.start()
        self._queue.put((path, time.monotonic() + patience))

    def _loop(self) -> None:
        while True:
            path, until = self._queue.get()
            while True:
                try:
                    for p in _tree(path):
                        p.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or time.monotonic() > until:
                        break
                    time.sleep(0.005)


_janitor = _Janitor()


class CgroupHost:
    """The machine's usable v1 controllers and the parent `ridgeline` group in each."""

    _instance: "CgroupHost | None | bool" = False
    _lock = threading.Lock()

    def __init__(self, parents: dict[str, Path], own: dict[str, Path]) -> None:
        self.parents = parents  # controller -> .../ridgeline
        self.own = own          # controller -> this process's group (where threads go back)
        self._ids = itertools.count()

    @classmethod
    def detect(cls) -> "CgroupHost | None":
        """The host's cgroups, or None when they cannot be used (not root, cgroup v2 only,
        controllers missing). Probed once per process; stale groups of dead processes
        are removed on the way."""
        with cls._lock:
            if cls._instance is False:
                cls._instance = cls._probe()
            return cls._instance  # type: ignore[return-value]

    @classmethod
    def _probe(cls) -> "CgroupHost | None":
        if os.geteuid() != 0 or os.environ.get("RIDGELINE_SANDBOX_NO_CGROUPS"):
            return None
        try:
            own_paths = _own_cgroups()
        except OSError:
            return None
        parents, own = {}, {}
        for c in CONTROLLERS:
            if c not in own_paths:
                return None
            base = CGROUP_ROOT / c / own_paths[c].lstrip("/")
            if not (base / "cgroup.procs").exists():
                return None
            parent = base / "ridgeline"
            try:
                _make_parent(c, parent)
            except OSError:
                return None
            parents[c], own[c] = parent, base
        host = cls(parents, own)
        host.sweep_stale()
        atexit.register(host.remove_parents)
        return host

    def remove_parents(self) -> None:
        """At exit: drop the `ridgeline` groups if no other process uses them, so the
        groups we were started in can be removed by whoever made them."""
        for parent in self.parents.values():
            with contextlib.suppress(OSError):
                for child in parent.iterdir():
                    if child.is_dir():
                        child.rmdir()
                parent.rmdir()

    def sweep_stale(self) -> None:
        """Remove groups left by processes that died without closing their sandboxes."""
        for c, parent in self.parents.items():
            for child in parent.iterdir():
                if not child.is_dir():
                    continue
                owner = child.name.split("-", 1)[0]
                if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                    kill_tree(child, timeout=1.0)
                    remove_tree(child, timeout=1.0)

    def create(self, sandbox_id: str, memory_bytes: int | None,
               max_processes: int | None) -> "SandboxCgroup":
        return SandboxCgroup(self, f"{os.getpid()}-{sandbox_id}", memory_bytes, max_processes)


@dataclass
class ExecGroup:
    """The pids sub-group of one command: every process it starts lands here."""

    path: Path

    def pids(self) -> set[int]:
        out: set[int] = set()
        for p in _tree(self.path):
            out |= _read_pids(p)
        return out

    def kill(self, keep: frozenset[int] = frozenset()) -> bool:
        return kill_tree(self.path, keep)

    def remove(self) -> None:
        """Drop the group once nothing runs in it (in the background; a group kept busy
        by a background job stays until the sandbox is destroyed)."""
        _janitor.remove(self.path)


class SandboxCgroup:
    """The groups of one sandbox, with its memory and process limits."""

    def __init__(self, host: CgroupHost, name: str, memory_bytes: int | None,
                 max_processes: int | None) -> None:
        self.host = host
        self.dirs = {c: p / name for c, p in host.parents.items()}
        self._seq = itertools.count()
        try:
            for c, d in self.dirs.items():
                try:
                    d.mkdir()
                except FileNotFoundError:  # another process removed the empty parent
                    _make_parent(c, d.parent)
                    d.mkdir()
            if memory_bytes is not None:
                _write(self.dirs["memory"] / "memory.limit_in_bytes", memory_bytes)
                # No swapping around the limit: a memory bomb must be killed, not paged.
                with contextlib.suppress(OSError):
                    _write(self.dirs["memory"] / "memory.swappiness", 0)
            if max_processes is not None:
                _write(self.dirs["pids"] / "pids.max", max_processes)
        except OSError:
            self.destroy()
            raise

    def exec_group(self) -> ExecGroup:
        path = self.dirs["pids"] / f"x{next(self._seq)}"
        path.mkdir()
        return ExecGroup(path)

    def adopt_current_thread(self) -> None:
        """Put the calling thread into the sandbox's groups: children it starts from
        now on belong to the sandbox (cgroup v1 allows per-thread membership)."""
        for d in self.dirs.values():
            _write(d / "tasks", "0")

    def move_current_thread(self, group: ExecGroup | None) -> None:
        """Move the calling thread to another pids group (None: the sandbox's own)."""
        _write((group.path if group else self.dirs["pids"]) / "tasks", "0")

    def pids(self) -> set[int]:
        out: set[int] = set()
        for p in _tree(self.dirs["pids"]):
            out |= _read_pids(p)
        return out

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer has killed in this sandbox."""
        try:
            text = (self.dirs["memory"] / "memory.oom_control").read_text()
        except OSError:
            return 0
        for line in text.splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def destroy(self) -> bool:
        """Kill whatever is still in the groups (synchronously: nothing may outlive
        this call) and remove them (in the background)."""
        ok = True
        for d in self.dirs.values():
            if d.exists():
                ok &= kill_tree(d)
                _janitor.remove(d, patience=5.0)
        return ok


class CgroupTracker:
    """Shell tracker with cgroups: the session has one pids group; a command's processes
    are the ones in it that were not there when the command began (earlier background
    jobs survive an interrupt). Nothing is moved between groups per command: moving
    another process takes the kernel's global threadgroup lock."""

    def __init__(self, group: ExecGroup, bash_pid: int, launcher_pid: int) -> None:
        self.group = group
        self.bash_pid = bash_pid
        self.launcher_pid = launcher_pid  # nsenter, outside: it reaps bash and exits
        self._before: set[int] = set()

    def begin(self) -> None:
        self._before = self.group.pids()

    def interrupt(self) -> None:
        keep = self._before | {self.bash_pid, self.launcher_pid, os.getpid()}
        for _ in range(1000):  # a fork racing the kill is caught by the next pass
            victims = self.group.pids() - keep
            if not victims:
                return
            for pid in victims:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.001)

    def kill_all(self) -> None:
        self.group.kill(keep=frozenset({self.launcher_pid}))
        self.group.remove()
