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

cgroup v2 (every modern distribution; `detect` prefers v1 where v1 holds the controllers,
as on a hybrid host): one group per sandbox under a `ridgeline` parent with memory and pids
(and cpu, if offered) enabled, limited by `memory.max`, `memory.swap.max` 0 and `pids.max`;
the parent weighs `cpu.weight` 200 (two host processes). v2 has no per-thread membership
for these controllers, so a process is placed by a wrapper instead: `sh` writes its own
pid into the group's `cgroup.procs` and execs the real command (`enter_argv`); if that
write fails nothing runs. The parent is made where this process may: at the root of the
hierarchy (a container with its own cgroup namespace), in `RIDGELINE_CGROUP_PARENT` (a
writable v2 directory, e.g. a systemd unit with `Delegate=yes`), or in our own group
when it is delegated to us, after moving this process into a leaf (`<own>/harness`),
since v2 only enables controllers for children of a group without processes.

Without root or without controllers (`CgroupHost.detect()` is None; `detect_with_reason`
says why) the bwrap backend refuses sandboxes with memory or process limits unless
`Limits.weak_limits` accepts per-process rlimits. `RIDGELINE_CGROUP_ROOT` points the
detection at another cgroup mount (tests).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import itertools
import os
import queue
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "pids", "cpu")
#: cgroup v2 controllers a sandbox needs; cpu is used when offered.
V2_REQUIRED = ("memory", "pids")
#: Weight of the parent group of all sandboxes, against 1024 for one host process.
ALL_SANDBOXES_CPU_SHARES = 2048
#: The same in cgroup v2 units (100 is one host process).
ALL_SANDBOXES_CPU_WEIGHT = 200
V2 = "v2"
#: Places the shell in the group whose cgroup.procs is $0, then runs the command.
ENTER_SCRIPT = 'echo $$ > "$0" && exec "$@"'
_SH = shutil.which("sh") or "/bin/sh"


def cgroup_root() -> Path:
    return Path(os.environ.get("RIDGELINE_CGROUP_ROOT") or CGROUP_ROOT)


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and its v2 path under the key
    `V2`, from /proc/self/cgroup."""
    paths: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        num, ctrls, path = line.split(":", 2)
        if num == "0" and not ctrls:
            paths[V2] = path
        for c in ctrls.split(","):
            if c:
                paths[c] = path
    return paths


def v2_mount(root: Path) -> Path | None:
    """The cgroup v2 hierarchy: `root` itself (a v2-only host) or `root`/unified (a
    hybrid one), if mounted."""
    for p in (root, root / "unified"):
        if (p / "cgroup.controllers").is_file():
            return p
    return None


def _controllers(path: Path, name: str = "cgroup.controllers") -> list[str]:
    try:
        return (path / name).read_text().split()
    except OSError:
        return []


def _make_parent(controller: str, parent: Path) -> None:
    parent.mkdir(exist_ok=True)
    if controller == "cpu":
        _write(parent / "cpu.shares", ALL_SANDBOXES_CPU_SHARES)
    elif controller == V2:  # made again after another process removed it at its exit
        offered = _controllers(parent)
        _write(parent / "cgroup.subtree_control",
               " ".join(f"+{c}" for c in CONTROLLERS if c in offered))


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
    """The machine's usable controllers and the parent `ridgeline` group: one per v1
    controller (`version` 1), or one v2 group holding them all (`version` 2, key V2)."""

    _found: "dict[Path, tuple[CgroupHost | None, str]]" = {}
    _lock = threading.Lock()

    def __init__(self, parents: dict[str, Path], own: dict[str, Path],
                 version: int = 1) -> None:
        self.parents = parents  # controller (or V2) -> .../ridgeline
        self.own = own          # controller -> this process's group (where threads go back)
        self.version = version
        self._ids = itertools.count()

    @classmethod
    def detect(cls) -> "CgroupHost | None":
        """The host's cgroups, or None when they cannot be used (see
        `detect_with_reason`)."""
        return cls.detect_with_reason()[0]

    @classmethod
    def detect_with_reason(cls) -> "tuple[CgroupHost | None, str]":
        """The host's cgroups (v1 memory, pids and cpu, else v2 memory and pids), or None
        and why not. Probed once per process and cgroup root; stale groups of dead
        processes are removed on the way."""
        root = cgroup_root()
        with cls._lock:
            if root not in cls._found:
                cls._found[root] = cls._probe(root)
            return cls._found[root]

    @classmethod
    def _probe(cls, root: Path) -> "tuple[CgroupHost | None, str]":
        if os.geteuid() != 0:
            return None, "not running as root (creating cgroups needs it)"
        if os.environ.get("RIDGELINE_SANDBOX_NO_CGROUPS"):
            return None, "cgroups are disabled by RIDGELINE_SANDBOX_NO_CGROUPS"
        try:
            own_paths = _own_cgroups()
        except OSError as e:
            return None, f"cannot read /proc/self/cgroup: {e}"
        host, why_v1 = cls._probe_v1(root, own_paths)
        if host is None:
            host, why_v2 = cls._probe_v2(root, own_paths)
            if host is None:
                return None, f"cgroup v1: {why_v1}; cgroup v2: {why_v2}"
        host.sweep_stale()
        atexit.register(host.remove_parents)
        return host, ""

    @classmethod
    def _probe_v1(cls, root: Path, own_paths: dict[str, str]) -> "tuple[CgroupHost | None, str]":
        parents, own = {}, {}
        for c in CONTROLLERS:
            if c not in own_paths:
                return None, f"no v1 {c} controller in /proc/self/cgroup"
            base = root / c / own_paths[c].lstrip("/")
            if not (base / "cgroup.procs").exists():
                return None, f"no v1 {c} hierarchy at {root / c}"
            parent = base / "ridgeline"
            try:
                _make_parent(c, parent)
            except OSError as e:
                return None, f"cannot create {parent}: {e.strerror}"
            parents[c], own[c] = parent, base
        return cls(parents, own), ""

    @classmethod
    def _probe_v2(cls, root: Path, own_paths: dict[str, str]) -> "tuple[CgroupHost | None, str]":
        explicit = os.environ.get("RIDGELINE_CGROUP_PARENT")
        if explicit:
            base = Path(explicit)
            if not (base / "cgroup.controllers").is_file():
                return None, f"RIDGELINE_CGROUP_PARENT={explicit} is not a cgroup v2 directory"
            # Our sandboxes' parent directly: it must hold no processes of its own.
            return cls._v2_parent(base, base, leaf=None)
        mount = v2_mount(root)
        if mount is None:
            return None, f"no cgroup2 filesystem at {root} or {root / 'unified'}"
        if V2 not in own_paths:
            return None, "this process has no cgroup v2 path in /proc/self/cgroup"
        base = mount / own_paths[V2].lstrip("/")
        offered = _controllers(base)
        missing = [c for c in V2_REQUIRED if c not in offered]
        if missing:
            return None, (f"{base} offers {', '.join(offered) or 'no controllers'}, not "
                          f"{', '.join(missing)} (on a hybrid host they belong to cgroup v1; "
                          "or they are not delegated to this process's group)")
        # v2 enables controllers only for children of a group without processes: the
        # hierarchy's root is exempt; elsewhere this process moves into a leaf first.
        leaf = None if base == mount else base / "harness"
        return cls._v2_parent(base, base / "ridgeline", leaf)

    @classmethod
    def _v2_parent(cls, base: Path, parent: Path,
                   leaf: Path | None) -> "tuple[CgroupHost | None, str]":
        offered = _controllers(base)
        missing = [c for c in V2_REQUIRED if c not in offered]
        if missing:
            return None, f"{base} does not offer {', '.join(missing)}"
        wanted = [c for c in CONTROLLERS if c in offered]
        try:
            if leaf is not None:
                leaf.mkdir(exist_ok=True)
                _write(leaf / "cgroup.procs", os.getpid())
            if parent != base:
                _write(base / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
                parent.mkdir(exist_ok=True)
            _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
            if "cpu" in wanted and parent != base:
                _write(parent / "cpu.weight", ALL_SANDBOXES_CPU_WEIGHT)
        except OSError as e:
            hint = (" (other processes share this cgroup: run the harness in a unit of "
                    "its own with Delegate=yes, e.g. `systemd-run --scope -p Delegate=yes "
                    "...`, or set RIDGELINE_CGROUP_PARENT to a writable, empty v2 group)"
                    if e.errno == errno.EBUSY else "")
            return None, f"cannot set up {parent}: {e.strerror or e}{hint}"
        enabled = _controllers(parent, "cgroup.subtree_control")
        if any(c not in enabled for c in V2_REQUIRED):
            return None, f"{parent} did not enable {', '.join(V2_REQUIRED)} for its children"
        return cls({V2: parent}, {V2: base}, version=2), ""

    def remove_parents(self) -> None:
        """At exit: drop the `ridgeline` groups if no other process uses them, so the
        groups we were started in can be removed by whoever made them."""
        if os.environ.get("RIDGELINE_CGROUP_PARENT") and self.version == 2:
            return  # not ours to remove
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
        self.version = host.version
        self.dirs = {c: p / name for c, p in host.parents.items()}
        self._seq = itertools.count()
        try:
            for c, d in self.dirs.items():
                try:
                    d.mkdir()
                except FileNotFoundError:  # another process removed the empty parent
                    _make_parent(c, d.parent)
                    d.mkdir()
            if self.version == 2:
                d = self.dirs[V2]
                self.dirs = {"memory": d, "pids": d}  # one group holds every controller
                if memory_bytes is not None:
                    _write(d / "memory.max", memory_bytes)
                    # No swapping around the limit (absent without swap accounting).
                    with contextlib.suppress(FileNotFoundError):
                        _write(d / "memory.swap.max", 0)
                if max_processes is not None:
                    _write(d / "pids.max", max_processes)
            else:
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
        now on belong to the sandbox (cgroup v1 allows per-thread membership; in v2
        each process places itself, see `enter_argv`)."""
        if self.version == 2:
            return
        for d in self.dirs.values():
            _write(d / "tasks", "0")

    def move_current_thread(self, group: ExecGroup | None) -> None:
        """Move the calling thread to another pids group (None: the sandbox's own)."""
        if self.version == 2:
            return
        _write((group.path if group else self.dirs["pids"]) / "tasks", "0")

    def enter_argv(self, group: ExecGroup | None) -> list[str]:
        """The prefix that starts a command in `group` (None: the sandbox's own group):
        nothing in v1 (the launcher thread's groups are inherited), in v2 a shell that
        moves itself into the group before it execs the command."""
        if self.version != 2:
            return []
        procs = (group.path if group else self.dirs["pids"]) / "cgroup.procs"
        return [_SH, "-c", ENTER_SCRIPT, str(procs)]

    def pids(self) -> set[int]:
        out: set[int] = set()
        for p in _tree(self.dirs["pids"]):
            out |= _read_pids(p)
        return out

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer has killed in this sandbox."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            text = (self.dirs["memory"] / name).read_text()
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
        for d in set(self.dirs.values()):
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
