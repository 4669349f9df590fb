"""The bubblewrap backend: each sandbox is a set of Linux namespaces kept alive by an
init process, and every command enters them with `nsenter`.

Start: `bwrap` creates user, pid, ipc, uts, cgroup and mount namespaces (plus a network
namespace, see below), builds the root (rootfs.py), drops every capability, forbids
nested user namespaces, and runs bash as pid 1 of the new pid namespace. That init only
reads a pipe we hold: it reaps orphans, ignores signals sent from inside (pid 1 is
immune to SIGKILL from its own namespace), and dies with us (`--die-with-parent`, and
EOF on the pipe). Killing it tears the pid namespace down: the kernel kills every
process in it, so `close()` leaves nothing behind.

Commands: `nsenter` joins the init's namespaces, root and cwd and becomes uid 1000 (no
capabilities survive its exec: the uid is not root in the namespace, every mount is
nosuid). `prlimit` in front sets the per-process rlimits. Cgroups (cgroups.py) bound the
sandbox's memory and process count and let a timeout kill exactly one command's tree.
The workspace and each writable mount are filesystems of their own (volume.py), so the
kernel bounds their disk and inodes. Where the machine has no cgroup controllers or no
loop devices, a sandbox with such limits is refused with the reason, unless
`Limits.weak_limits` accepts rlimits and the disk watcher instead.

Uids: uid 1000 inside is never host root. Run by root, every sandbox gets a host uid
of its own (identity.py) and bwrap runs as that uid, so the sandbox's user namespace
maps 1000 to it: root-owned host files, `/proc/sys` included, are "other" to the
sandbox, and files it creates belong to its uid. Bind sources that uid cannot reach
(a workspace under a root-only directory, the host's Python under /root) are staged
in a private mount namespace of the launcher thread first (mountns.py). Whatever the
host writes into the sandbox's writable trees is chowned to the sandbox's uid.

Network: under `none` the init starts in a fresh network namespace made by the host (so
its loopback is down and no process inside may bring it up); under `loopback` bwrap
makes one with `lo` up.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import select
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, TypeVar

from ridgeline.errors import ConfigError, SandboxError
from ridgeline.sandbox import fork as forks
from ridgeline.sandbox import network, volume
from ridgeline.sandbox.base import ExecResult, Limits, NetworkPolicy, SandboxSpec, ShellSession
from ridgeline.sandbox.cgroups import (CgroupHost, CgroupTracker, ExecGroup, SandboxCgroup,
                                       kill_tree)
from ridgeline.sandbox.host_sandbox import HostSandbox, default_root, prepare_root
from ridgeline.sandbox.identity import HostIdentity, IdentityAllocator
from ridgeline.sandbox.mountns import StagedSources, stage_point
from ridgeline.sandbox.process import (TreeTracker, communicate, kill_process_tree,
                                       to_exec_result)
from ridgeline.sandbox.rootfs import build_root_args, write_identity
from ridgeline.sandbox.shell import BashSession

SANDBOX_UID = 1000
HOSTNAME = "sandbox"
START_TIMEOUT_S = 30.0
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/home/sandbox", "USER": "sandbox", "LOGNAME": "sandbox",
    "SHELL": "/bin/bash", "LANG": "C.UTF-8", "TERM": "dumb",
}
# pid 1 is bash reading a pipe we hold: `read` fails only at EOF, i.e. when we are gone.
# A pid namespace's init only receives signals it has handlers for from inside it, and
# bash installs none here; SIGCHLD ignored makes the kernel reap orphans adopted by it
# (dash cannot ignore SIGCHLD, hence bash).
INIT_SCRIPT = "trap '' CHLD; echo ready; exec >/dev/null 2>&1; while read -r _; do :; done"
# Out-of-memory wording of common runtimes, for when no memory cgroup is available.
OOM_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc",
               b"out of memory", b"Out of memory")
INSTALL_HINT = "install it with `apt-get install -y bubblewrap`"

#: Variables that steer the dynamic loader or libc of a process. The host-side helpers
#: (prlimit, nsenter) run as root with the command's environment, so a command whose
#: environment has any of these gets it from `env -i` *inside* the sandbox instead.
LOADER_VARS = frozenset({"GCONV_PATH", "GETCONF_DIR", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH",
                         "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TZDIR"})

T = TypeVar("T")


class _Launcher:
    """The sandbox's own thread, which starts every process of the sandbox.

    Why a thread: `--die-with-parent` is PR_SET_PDEATHSIG, which fires when the *thread*
    that forked bwrap exits, so the init must come from a thread that lives exactly as
    long as the sandbox. And with cgroups, a child starts in its thread's groups: this
    thread stays in the sandbox's memory and cpu groups, and waits in a fresh pids group
    for the next command (prepared right after the previous one started, so a command
    never waits for the move: moving a thread between v1 cgroups costs up to a
    millisecond, the kernel waiting for an RCU grace period)."""

    def __init__(self, cgroup: SandboxCgroup | None, stage_at: Path | None = None,
                 volumes: tuple[Path, Path] | None = None) -> None:
        self._cg = cgroup
        self._stage_at = stage_at
        self._volumes = volumes  # (sandbox root, this sandbox's directory)
        self.staged: StagedSources | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._next: ExecGroup | None = None
        self._where = "sandbox"  # which pids group this thread is in: "sandbox" or "exec"
        ready: Future = Future()
        self._thread = threading.Thread(target=self._loop, args=(ready,), daemon=True,
                                        name="ridgeline-sandbox-launcher")
        self._thread.start()
        ready.result()

    def _loop(self, ready: Future) -> None:
        try:
            if self._cg is not None:
                self._cg.adopt_current_thread()
            if self._stage_at is not None:
                self.staged = StagedSources(self._stage_at)
                if self._volumes is not None:
                    # The copy of the host's mounts this thread just got holds the other
                    # sandboxes' volumes: dropped, so none outlives its sandbox here.
                    volume.detach_all(*self._volumes)
            ready.set_result(None)
        except BaseException as e:  # noqa: BLE001 - reported to the constructor
            ready.set_exception(e)
            return
        while True:
            job = self._jobs.get()
            if job is None:
                return
            kind, fn, fut = job
            try:
                if kind == "call":
                    fut.set_result(fn())
                elif kind == "init":
                    self._enter_sandbox_group()
                    fut.set_result(fn())
                else:
                    group = self._enter_exec_group()
                    fut.set_result((fn(group), group))
                    self._next = None
                    self._enter_exec_group()  # the next one, while nobody waits
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                if not fut.done():
                    fut.set_exception(e)

    def _enter_sandbox_group(self) -> None:
        if self._cg is not None and self._where != "sandbox":
            self._cg.move_current_thread(None)
            self._where = "sandbox"

    def _enter_exec_group(self) -> ExecGroup | None:
        if self._cg is None:
            return None
        if self._next is None:
            self._next = self._cg.exec_group()
            self._cg.move_current_thread(self._next)
            self._where = "exec"
        return self._next

    def _call(self, kind: str, fn: Callable[[], T]):
        if not self._thread.is_alive():
            raise SandboxError("the sandbox's launcher thread has stopped")
        fut: Future = Future()
        self._jobs.put((kind, fn, fut))
        return fut.result()

    def start_init(self, fn: Callable[[], T]) -> T:
        return self._call("init", fn)

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the launcher thread (in its mount namespace)."""
        return self._call("call", fn)

    def spawn(self, fn: Callable[[ExecGroup | None], T]) -> tuple[T, ExecGroup | None]:
        """Run `fn(group)` (which starts a process) in a fresh exec group; returns its
        result and that group."""
        return self._call("exec", fn)

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)
        if self._next is not None:
            self._next.remove()


_libc = ctypes.CDLL(None, use_errno=True)


def _find(tool: str, package: str, explicit: str | None = None) -> str:
    path = explicit or shutil.which(tool) or f"/usr/bin/{tool}"
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise SandboxError(f"{tool} not found at {path}",
                           hint=f"install it with `apt-get install -y {package}`")
    return path


class BwrapProvider:
    """Makes bubblewrap sandboxes. `bwrap_path` overrides where bwrap is looked for."""

    name = "bwrap"

    def __init__(self, bwrap_path: str | None = None, root_dir: Path | None = None) -> None:
        path = bwrap_path or shutil.which("bwrap") or "/usr/bin/bwrap"
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise SandboxError(f"bubblewrap (bwrap) not found at {path}", hint=INSTALL_HINT)
        self.bwrap = path
        self.nsenter = _find("nsenter", "util-linux")
        self.prlimit = _find("prlimit", "util-linux")
        self.setpriv = _find("setpriv", "util-linux")
        self.privileged = os.geteuid() == 0
        self.cgroups, self.cgroup_reason = CgroupHost.detect_with_reason()
        root = root_dir or default_root()
        volume.sweep_stale(root)  # before prepare_root deletes their directories
        self.root = prepare_root(root)
        # A filesystem per sandbox bounds its disk (volume.py), where the machine allows.
        self.volume_reason = volume.unavailable_reason(self.root)
        self.volumes = volume.Templates(self.root) if self.volume_reason is None else None
        # As root: a host uid per sandbox, and the mount point for staged bind sources.
        self.identities = IdentityAllocator() if self.privileged else None
        self.stage_at = stage_point() if self.privileged else None
        identity = self.root / ".identity"
        identity.mkdir(exist_ok=True)
        self.identity = identity if write_identity(identity, SANDBOX_UID, "sandbox",
                                                   BASE_ENV["HOME"]) else None

    def create(self, spec: SandboxSpec) -> "BwrapSandbox":
        return BwrapSandbox(self, spec)


class BwrapSandbox(HostSandbox):
    backend = "bwrap"

    def __init__(self, provider: BwrapProvider, spec: SandboxSpec,
                 fork_base: forks.ForkBase | None = None) -> None:
        _refuse_weak_limits(provider, spec.limits)
        self._p = provider
        self._volume: volume.Volume | None = None
        self._mount_volumes: list[volume.MountVolume] = []
        self.host_id: HostIdentity | None = (provider.identities.acquire()
                                             if provider.identities is not None else None)
        try:
            owner = (self.host_id.uid, self.host_id.gid) if self.host_id else None
            super().__init__(spec, provider.root, owner=owner, fork_base=fork_base)
        except BaseException as e:
            if self.host_id is not None:
                self.host_id.release()
            if self._volume is not None and "No space left" in str(e):
                raise SandboxError(
                    f"workspace_from {spec.workspace_from} does not fit in the sandbox's "
                    f"disk (limits.disk_bytes={spec.limits.disk_bytes}, disk_inodes="
                    f"{spec.limits.disk_inodes})", hint="raise the limits or seed less") from e
            raise
        self._lent: list[tuple[Path, int, int]] = []
        self._proc: subprocess.Popen | None = None
        self._pidfd: int | None = None
        self.init_pid = 0
        self.namespaces: dict[str, int] = {}
        self._shells: list[BashSession] = []
        self._cg: SandboxCgroup | None = None
        self._launcher: _Launcher | None = None
        try:
            lim = spec.limits
            if provider.cgroups is not None:
                self._cg = provider.cgroups.create(self.id, lim.memory_bytes, lim.max_processes)
            self._lend_writable_mounts()
            self._launcher = _Launcher(self._cg, provider.stage_at, (provider.root, self.dir))
            self._env = {**BASE_ENV, **spec.env}
            self._init_cwd = self._prepare_cwd()
            tmp_size = lim.memory_bytes  # tmpfs pages count against memory anyway
            root_args = build_root_args(spec, self.workspace_dir, provider.root / ".empty",
                                        tmp_size, provider.identity)
            staged = self._launcher.staged
            self._root_args = (self._launcher.call(lambda: staged.rewrite(root_args))
                               if staged is not None else root_args)
            self._rlimits = self._rlimit_args()
            self._start_init()
            self._start_quota()
        except BaseException:
            self.close()
            raise

    def fork(self, n: int, specs: list[SandboxSpec] | None = None) -> list["BwrapSandbox"]:
        """`n` new sandboxes whose workspaces start as this one's is now, copy-on-write
        (fork.py). `specs` gives each its own spec (default: this one's); writable mounts
        would be shared by every fork, so the default refuses them (a `TaskSandbox` forks
        with mounts of each fork's own). This sandbox goes on unchanged."""
        if n < 1:
            raise ConfigError(f"fork(n={n}): n must be at least 1")
        if specs is not None and len(specs) != n:
            raise ConfigError(f"fork(n={n}) got {len(specs)} specs", hint="one spec per fork")
        if specs is None:
            if any(m.writable for m in self.spec.mounts):
                raise SandboxError("cannot fork a sandbox with writable mounts: every fork "
                                   "would write into the same host directory",
                                   hint="pass specs with a writable mount of each fork's own")
            specs = [self.spec.model_copy(update={"workspace_from": None})] * n
        self._check_open()
        base = forks.ForkBase.freeze(self.workspace_dir, self._p.root / f"{os.getpid()}-fork-"
                                     f"{self.id}-{time.monotonic_ns()}",
                                     self.spec.limits.disk_bytes)
        made: list[BwrapSandbox] = []
        try:
            for spec in specs:
                if forks.can_mount():
                    made.append(BwrapSandbox(self._p, spec, fork_base=base))
                else:   # no overlay mounts here: each fork gets a copy of the base
                    made.append(BwrapSandbox(self._p, spec.model_copy(
                        update={"workspace_from": base.tree})))
        except BaseException:
            for sb in made:
                sb.close()
            raise
        finally:
            base.release()   # the forks hold their own references
        return made

    def _attach_storage(self, ws: Path) -> None:
        """The workspace and each writable mount's directory on a volume of their own
        (volume.py): the kernel bounds each to disk_bytes and disk_inodes, the quota
        watcher their total."""
        lim, templates = self.spec.limits, self._p.volumes
        if lim.disk_bytes is None or templates is None:
            return
        self._volume = volume.Volume(templates, self.dir / "disk.img", ws,
                                     lim.disk_bytes, lim.disk_inodes)
        for i, m in enumerate(self.spec.mounts):
            src = m.source.resolve()
            if m.writable and src.is_dir():
                self._mount_volumes.append(volume.MountVolume(
                    templates, self.dir / f"mount-{i}.img", self.dir / f"mount-{i}", src,
                    lim.disk_bytes, lim.disk_inodes))

    def _release_storage(self) -> None:
        try:
            for mv in getattr(self, "_mount_volumes", []):
                mv.release()  # copies the files back into the host directory
        finally:
            vol = getattr(self, "_volume", None)
            if vol is not None:
                vol.release()

    def _lend_writable_mounts(self) -> None:
        """A writable mount's directory is the sandbox uid's while the sandbox lives
        (only the directory itself: what is inside keeps its owners), so what the spec
        calls writable is writable to a sandbox that is not host root."""
        if self.owner is None:
            return
        for m in self.spec.mounts:
            src = m.source.resolve()
            if m.writable and src.is_dir():
                st = src.stat()
                os.chown(src, *self.owner)
                self._lent.append((src, st.st_uid, st.st_gid))

    def _return_mounts(self) -> None:
        for src, uid, gid in self._lent:
            with contextlib.suppress(FileNotFoundError):
                os.chown(src, uid, gid)
        self._lent.clear()

    # -- the init process ---------------------------------------------------------------
    def _prepare_cwd(self) -> str:
        """Where pid 1 (and so every command) starts: the spec's cwd if it is in the
        workspace (created if missing), else the workspace (commands then `cd`)."""
        cwd, ws = self.spec.cwd, self.spec.workspace_path
        if cwd == ws or cwd.startswith(ws + "/"):
            rel = cwd[len(ws):].lstrip("/")
            if rel:
                self.files.make_dirs(rel)
            return cwd
        return ws

    def _rlimit_args(self) -> list[str]:
        lim, args = self.spec.limits, []
        if lim.cpu_seconds is not None:
            args.append(f"--cpu={lim.cpu_seconds}:{lim.cpu_seconds + 1}")
        if lim.max_file_size_bytes is not None:
            args.append(f"--fsize={lim.max_file_size_bytes}")
        if self._cg is None:  # no cgroups: per-process rlimits are all we have
            if lim.memory_bytes is not None:
                args.append(f"--as={lim.memory_bytes}")
            if lim.max_processes is not None:
                args.append(f"--nproc={lim.max_processes}")
        return [self._p.prlimit, *args, "--"] if args else []

    def _bwrap_argv(self, info_fd: int, own_netns: bool) -> list[str]:
        argv = [self._p.bwrap, "--unshare-user", "--unshare-ipc", "--unshare-pid",
                "--unshare-uts", "--unshare-cgroup-try", "--disable-userns",
                "--die-with-parent", "--as-pid-1", "--cap-drop", "ALL",
                "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", HOSTNAME]
        if not own_netns:
            argv.append("--unshare-net")
        argv += self._root_args
        argv += ["--chdir", self._init_cwd, "--info-fd", str(info_fd), "--clearenv"]
        for k, v in self._env.items():
            argv += ["--setenv", k, v]
        return argv + ["--", "bash", "--noprofile", "--norc", "-c", INIT_SCRIPT]

    def _as_sandbox_user(self, argv: list[str]) -> list[str]:
        """`argv` run as the sandbox's own host uid (when root). Dropped by `setpriv`
        rather than by Popen's `user=`: that forces a fork() of this whole process,
        which costs ~13 ms once torch is loaded, where Popen otherwise uses vfork."""
        if self.host_id is None:
            return argv
        return [self._p.setpriv, f"--reuid={self.host_id.uid}",
                f"--regid={self.host_id.gid}", "--clear-groups", "--", *argv]

    def _start_init(self) -> None:
        shared = self.spec.network_namespace
        if shared is not None and not self._p.privileged:
            raise SandboxError("joining a private network needs root")
        own_netns = shared is not None or (self.spec.network == NetworkPolicy.NONE
                                           and self._p.privileged)
        info_r, info_w = os.pipe()
        log_path = self.dir / "bwrap.log"
        try:
            argv = self._as_sandbox_user(self._bwrap_argv(info_w, own_netns))
            if self._cg is not None:
                argv = self._cg.enter_argv(None) + argv
            with open(log_path, "wb") as log:
                def spawn() -> subprocess.Popen:
                    if self._launcher.staged is not None:
                        self._launcher.staged.ensure()
                    netns = (network.joined(shared) if shared is not None else
                             network.fresh() if own_netns else contextlib.nullcontext())
                    with netns:
                        return subprocess.Popen(argv, stdin=subprocess.PIPE,
                                                stdout=subprocess.PIPE, stderr=log,
                                                pass_fds=(info_w,), env={"PATH": BASE_ENV["PATH"]})
                try:
                    self._proc = self._launcher.start_init(spawn)
                except OSError as e:
                    raise SandboxError(f"could not start bwrap: {e}") from None
            os.close(info_w)
            info_w = -1
            deadline = time.monotonic() + START_TIMEOUT_S
            info = _read_all(info_r, deadline)
            ready = _read_line(self._proc.stdout.fileno(), deadline) if info else b""  # type: ignore[union-attr]
            if not info or ready.strip() != b"ready":
                self._proc.kill()
                self._proc.wait()
                why = log_path.read_text(errors="replace").strip() or "no message"
                raise SandboxError(f"bwrap could not start the sandbox: {why[-800:]}")
        finally:
            os.close(info_r)
            if info_w >= 0:
                os.close(info_w)
        assert self._proc.stdout is not None
        self._proc.stdout.close()
        data = json.loads(info)
        self.init_pid = int(data["child-pid"])
        self.namespaces = {k.removesuffix("-namespace"): v for k, v in data.items()
                           if k.endswith("-namespace")}
        self._pidfd = os.pidfd_open(self.init_pid)
        ns = ["-U", "-m", "-i", "-u", "-p", "-n"] + (["-C"] if "cgroup" in self.namespaces else [])
        self._nsenter = [self._p.nsenter, "-t", str(self.init_pid), *ns, "-r", "-w",
                         "-S", str(SANDBOX_UID), "-G", str(SANDBOX_UID), "--"]

    def _init_alive(self) -> bool:
        """pid 1 still runs (its pidfd is not readable). Checked before every nsenter,
        whose `-t pid` must never meet a recycled pid."""
        fd = self._pidfd
        if fd is None or self._proc is None:
            return False
        try:
            return not select.select([fd], [], [], 0)[0]
        except (OSError, ValueError):
            # the quota watcher's thread restarted the init meanwhile (the descriptor is
            # closed): the init this call asked about is gone
            return False

    @property
    def alive(self) -> bool:
        return not self._closed and self._init_alive()

    def _kill_init(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            # pid 1 finishes exiting only once every process of its namespace is gone.
            select.select([self._pidfd], [], [], 10.0)
            os.close(self._pidfd)
            self._pidfd = None
        if self._proc is not None:
            if self._proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self._proc.stdin.close()
            try:  # bwrap reaps pid 1 and exits; killing it first would leave a zombie
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def _close_shells(self) -> None:
        for sh in self._shells:
            with contextlib.suppress(Exception):
                sh.close()
        self._shells.clear()

    def _stop_processes(self) -> None:
        self._close_shells()
        self._kill_init()
        if self._cg is not None:
            for d in self._cg.dirs.values():
                kill_tree(d)
        self._start_init()

    def _close_processes(self) -> None:
        self._close_shells()
        try:
            self._kill_init()
        finally:
            try:
                if self._launcher is not None:
                    self._launcher.stop()  # out of the groups before they are removed
                if self._cg is not None:
                    self._cg.destroy()
            finally:
                self._return_mounts()
                if self.host_id is not None:  # only once nothing runs as it any more
                    self.host_id.release()

    def _check_running(self) -> None:
        with self._lock:  # waits while the processes are being restarted
            self._check_open()
            alive = self._init_alive()
        if not alive:
            raise SandboxError(f"sandbox {self.id} has stopped: its init process exited",
                               hint="close it and create a new sandbox")

    def _health_checks(self) -> dict[str, tuple[bool, str]]:
        return {"init": (self._init_alive(), "the sandbox's init process has exited")}

    # -- commands ---------------------------------------------------------------------------
    def _argv(self, cmd: list[str], cwd: str | None) -> list[str]:
        argv = [str(a) for a in cmd]
        if not argv:
            raise SandboxError("empty command")
        target = cwd if cwd is not None else self.spec.cwd
        if target != self._init_cwd:
            argv = ["sh", "-c", 'cd -- "$1" && shift && exec "$@"', "sh", target, *argv]
        return argv

    def _spawn(self, argv: list[str], *, env: dict[str, str] | None = None,
               cwd: str | None = None, launcher: tuple[str, ...] = (),
               **kwargs) -> tuple[subprocess.Popen, ExecGroup | None]:
        """Start `argv` inside the sandbox; returns the process and, with cgroups, the
        pids group that holds everything it starts. `launcher` runs on the host first
        (e.g. `setsid --ctty` for a terminal)."""
        self._check_running()
        full_env = {**self._env, **(env or {})}
        inner = self._argv(argv, cwd)
        if not _host_safe(full_env):
            inner = ["env", "-i", *(f"{k}={v}" for k, v in full_env.items()), *inner]
            full_env = {"PATH": BASE_ENV["PATH"]}
        full = [*launcher, *self._rlimits, *self._nsenter, *inner]

        def start(group: ExecGroup | None = None) -> subprocess.Popen:
            argv = self._cg.enter_argv(group) + full if self._cg is not None else full
            try:
                return subprocess.Popen(argv, env=full_env, **kwargs)
            except OSError as e:
                busy = " (the sandbox is at its process limit)" if e.errno == 11 else ""
                raise SandboxError(f"could not start a command in sandbox {self.id}: "
                                   f"{e.strerror}{busy}") from None

        if self._cg is None or self._launcher is None:
            return start(), None
        return self._launcher.spawn(start)

    def popen(self, argv: list[str], *, env: dict[str, str] | None = None,
              cwd: str | None = None, launcher: tuple[str, ...] = (),
              **kwargs) -> subprocess.Popen:
        """Start `argv` inside the sandbox, like `subprocess.Popen` (for a terminal)."""
        return self._spawn(argv, env=env, cwd=cwd, launcher=launcher, **kwargs)[0]

    def run(self, cmd: str | list[str], timeout: float | None = None,
            env: dict[str, str] | None = None, cwd: str | None = None,
            stdin: bytes | None = None, pass_fds: tuple[int, ...] = ()) -> ExecResult:
        """Run one command to completion. Background processes it leaves keep running
        (like `docker exec`); at the timeout every process it started is killed.
        `pass_fds`: host descriptors the command inherits at the same numbers (the
        verifier's report socket)."""
        argv, limit = self._command(cmd, timeout)
        self._check_running()
        oom_before = self._cg.oom_kills() if self._cg else 0
        disk_before = self.disk_kills
        t0 = time.monotonic()
        proc, group = self._spawn(argv, env=env, cwd=cwd, stdin=subprocess.PIPE if stdin
                                  is not None else subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, start_new_session=True,
                                  pass_fds=pass_fds)

        def kill() -> None:
            if group is not None:
                # nsenter (outside) is spared: it reaps its child and exits by itself; if
                # it died first, the orphan would wait for the host's init to reap it.
                group.kill(keep=frozenset({proc.pid}))
            else:
                kill_process_tree(proc.pid)

        try:
            outcome = communicate(proc, stdin=stdin, max_output=self.spec.limits.max_output_bytes,
                                  timeout=limit, kill=kill, started=t0)
        finally:
            if group is not None:
                group.remove()
        rc = outcome.returncode
        if self._cg is not None:
            memory = self._cg.oom_kills() > oom_before and rc in (-9, 137)
        else:
            memory = rc != 0 and any(m in outcome.stderr.kept for m in OOM_MARKERS)
        if (rc != 0 and not self._init_alive() and not outcome.timed_out
                and self.disk_kills == disk_before):
            raise SandboxError(f"sandbox {self.id} stopped while running the command",
                               hint="close it and create a new sandbox")
        over_disk = rc != 0 and self.disk_kills > disk_before
        result = to_exec_result(outcome, memory_killed=memory)
        if over_disk:
            result.killed_by = "disk"
            result.stderr_bytes += (
                f"ridgeline: killed: sandbox {self.id} is over its disk quota "
                f"(limits.disk_bytes={self.spec.limits.disk_bytes})\n".encode())
        if rc == 1 and outcome.stderr.kept.startswith(b"nsenter: fork failed"):
            result.exit_code = 126  # "cannot execute", as a shell says it
            result.stderr_bytes = (
                f"ridgeline: cannot start the command: sandbox {self.id} is at its process "
                f"limit (max_processes={self.spec.limits.max_processes})\n".encode())
        return result

    def shell(self) -> ShellSession:
        """A persistent bash in the sandbox (see shell.py)."""
        self._check_running()

        def start(argv: list[str], cwd: str | None):
            proc, group = self._spawn(argv, cwd=cwd, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      start_new_session=True)
            bash = _child_of(proc.pid)
            if self._cg is not None and group is not None:
                return proc, CgroupTracker(group, bash or proc.pid, proc.pid)
            return proc, TreeTracker(bash or proc.pid, session_pid=proc.pid)

        session = BashSession(start, max_output=self.spec.limits.max_output_bytes,
                              default_timeout=self.spec.limits.wall_timeout_s,
                              check_open=self._check_running)
        self._shells = [sh for sh in self._shells if not sh.closed] + [session]
        return session

    @property
    def env(self) -> dict[str, str]:
        return dict(self._env)


def _refuse_weak_limits(provider: BwrapProvider, lim: Limits) -> None:
    """Refuse a sandbox whose limits this machine could only enforce weakly, unless
    `lim.weak_limits` accepts that; the error says what is missing and why."""
    why = []
    if lim.disk_bytes is not None and provider.volumes is None:
        why.append("its disk quota would only be a watcher that kills after the fact "
                   "(unlinked open files, fallocate and inode floods get past it), as no "
                   f"filesystem of its own can be made: {provider.volume_reason}")
    if (lim.memory_bytes is not None or lim.max_processes is not None) and provider.cgroups is None:
        why.append("its memory and process limits would only be per-process rlimits "
                   "(several processes together exceed them), as no cgroup controllers "
                   f"are usable: {provider.cgroup_reason}")
    if why and not lim.weak_limits:
        raise SandboxError(
            "sandbox refused: " + "; and ".join(why),
            hint="run as root with /dev/loop-control, mkfs.ext4 (e2fsprogs) and cgroup v1 "
                 "memory/pids/cpu or a delegated cgroup v2 group (`systemd-run --scope -p "
                 "Delegate=yes ...`, or RIDGELINE_CGROUP_PARENT); or accept the weaker "
                 "limits with Limits(weak_limits=True)")


def _host_safe(env: dict[str, str]) -> bool:
    """Whether this environment can be given to the host-side helpers as it is."""
    for k, v in env.items():
        if (k.startswith(("LD_", "GLIBC_", "MALLOC_")) or k in LOADER_VARS
                or (k == "TZ" and v.startswith((":", "/")))):
            return False
    return True


def _child_of(pid: int, timeout: float = 5.0) -> int | None:
    """The (single) child of `pid`: nsenter forks the process that enters the pid
    namespace; that child is the one to track."""
    end = time.monotonic() + timeout
    path = f"/proc/{pid}/task/{pid}/children"
    while time.monotonic() < end:
        try:
            kids = open(path).read().split()
        except OSError:
            return None
        if kids:
            return int(kids[0])
        time.sleep(0.0005)
    return None


def _read_all(fd: int, deadline: float) -> bytes:
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return b""
        b = os.read(fd, 4096)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


def _read_line(fd: int, deadline: float) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return buf
        b = os.read(fd, 64)
        if not b:
            return buf
        buf += b
    return buf
