"""The sandbox's root filesystem, as a list of bubblewrap arguments.

The root is a tmpfs (remounted read-only once built) with the host's system directories
bound read-only onto it, so new mount points (`/app`, `/tests`, `/logs/verifier`) can be
created anywhere, also where the host has no such directory. A target under a bound host
directory that the host lacks (say `/opt/app`) is made possible by "exploding" that
directory: a tmpfs in its place with each of its entries bound back, down the path.

What stays hidden: /root, /home, /run, /mnt, the host's /tmp and /var, and anything else
not in `SYSTEM_DIRS`; and, inside what is bound, every root-owned file or directory the
host does not let everyone read (/etc/shadow, /etc/ssl/private ...). That second list
matters because the sandbox's uid maps to the host uid that runs bwrap (root here), so
owner permissions would otherwise apply (see bwrap.py for why it maps that way).
"""

from __future__ import annotations

import contextlib
import functools
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ridgeline.errors import NotFoundError, SandboxError
from ridgeline.sandbox.base import SandboxSpec

#: Top-level host directories bound read-only when the tools root is the host's `/`.
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "opt")
#: Top-level entries of a custom tools root (an image's root filesystem) that the
#: sandbox provides itself. Its /var (dpkg's state) and /home (users made by the
#: build) are the image's, read-only, with a private /var/tmp.
PROVIDED = ("proc", "dev", "sys", "tmp", "run")
#: Directories under the bound ones scanned for unreadable (secret) entries.
SCANNED_FOR_SECRETS = ("etc", "opt")
SCAN_LIMIT = 50_000


@dataclass
class _Node:
    """One directory of the sandbox root: either bound from the host (`host`), or a
    tmpfs (host None) whose children are listed."""

    host: str | None = None
    children: dict[str, "_Node"] = field(default_factory=dict)
    exploded: bool = False


@dataclass(frozen=True)
class RootPlan:
    """How a tools root is laid out: bound directories, symlinks and secret masks."""

    root: str
    binds: tuple[tuple[str, str], ...]     # (sandbox path, host path)
    symlinks: tuple[tuple[str, str], ...]  # (sandbox path, link target)
    masked_files: tuple[str, ...]
    masked_dirs: tuple[str, ...]

    def host_path(self, path: str) -> str:
        return path if self.root == "/" else self.root.rstrip("/") + path


@functools.lru_cache(maxsize=8)
def plan_root(tools_root: str) -> RootPlan:
    """Lay out a tools root (cached: the host's system directories rarely change)."""
    root = os.path.realpath(tools_root)
    if not os.path.isdir(root):
        raise NotFoundError(f"tools_root {tools_root} is not a directory",
                            hint="point tools_root at a root filesystem tree, or leave it '/'")
    names = SYSTEM_DIRS if root == "/" else tuple(sorted(
        n for n in os.listdir(root) if n not in PROVIDED))
    binds, links = [], []
    for name in names:
        host = os.path.join(root, name)
        if os.path.islink(host):
            links.append(("/" + name, os.readlink(host)))
        elif os.path.isdir(host) or os.path.isfile(host):
            binds.append(("/" + name, host))
    files: list[str] = []
    dirs: list[str] = []
    if root == "/":
        for name in SCANNED_FOR_SECRETS:
            _scan_secrets("/" + name, files, dirs)
    return RootPlan(root, tuple(binds), tuple(links), tuple(files), tuple(dirs))


def _unreadable_root_entry(st: os.stat_result) -> bool:
    """Owned by root (user or group) and not readable by everyone: a host secret."""
    if st.st_uid != 0 and st.st_gid != 0:
        return False  # other owners: the sandbox's uid has only "other" rights there
    need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(st.st_mode) else 0)
    return (st.st_mode & need) != need


def _scan_secrets(top: str, files: list[str], dirs: list[str]) -> None:
    stack, seen = [top], 0
    while stack and seen < SCAN_LIMIT:
        d = stack.pop()
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            seen += 1
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode):
                continue
            if stat.S_ISDIR(st.st_mode):
                if _unreadable_root_entry(st):
                    dirs.append(e.path)
                else:
                    stack.append(e.path)
            elif stat.S_ISREG(st.st_mode) and _unreadable_root_entry(st):
                files.append(e.path)


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p]


def write_identity(directory: Path, uid: int, name: str, home: str) -> bool:
    """passwd and group files for the sandbox: the host's, with `uid` named `name` (the
    host may have a real user with that uid). False if the host has no /etc/passwd."""
    entries = {"passwd": f"{name}:x:{uid}:{uid}:sandbox user:{home}:/bin/bash",
               "group": f"{name}:x:{uid}:"}
    try:
        for fname, entry in entries.items():
            kept = [ln for ln in Path("/etc", fname).read_text().splitlines()
                    if ln.count(":") >= 2 and ln.split(":")[2] != str(uid)
                    and ln.split(":")[0] != name]
            text = "\n".join([*kept, entry]) + "\n"
            final = directory / fname
            # Leave an identical file alone: running sandboxes (of this or another
            # process) bind this very inode, and a bind of a replaced, unlinked file can
            # no longer be mounted when they restart (bwrap: "No such file or directory").
            with contextlib.suppress(FileNotFoundError):
                if final.read_text() == text:
                    continue
            tmp = directory / f".{fname}.{os.getpid()}.tmp"
            tmp.write_text(text)
            tmp.chmod(0o644)
            tmp.replace(final)
    except OSError:
        return False
    return True


def build_root_args(spec: SandboxSpec, workspace_dir: Path, empty_dir: Path,
                    tmp_size: int | None, identity_dir: Path | None = None) -> list[str]:
    """bwrap arguments that build the whole root: system dirs, masks, the sandbox's own
    /proc, /dev, /tmp, /run, /home, /var, the workspace and the spec's mounts."""
    plan = plan_root(str(spec.tools_root))
    top = _Node()
    for path, host in plan.binds:
        top.children[path.strip("/")] = _Node(host=host)
    symlinks = {p.strip("/"): t for p, t in plan.symlinks}

    targets = [(spec.workspace_path, str(workspace_dir), True)]
    for m in spec.mounts:
        if not m.source.exists():
            raise NotFoundError(f"mount source {m.source} does not exist",
                                hint=f"create it, or drop the mount at {m.target}")
        targets.append((m.target, str(m.source.resolve()), m.writable))
    # Parents before children, so a mount inside another one lands on top of it.
    targets.sort(key=lambda t: len(_parts(t[0])))
    for target, _, _ in targets:
        first = _parts(target)[0]
        if first in symlinks:
            raise SandboxError(f"cannot mount at {target}: /{first} is a symlink in the "
                               f"sandbox root (to {symlinks[first]}); use the real path")
        _make_room(top, _parts(target))

    args: list[str] = []
    for name, target in sorted(symlinks.items()):
        args += ["--symlink", target, "/" + name]
    exploded: list[str] = []
    _emit(top, "", args, exploded)
    if plan.root == "/" and identity_dir is not None and _visible(top, "/etc/passwd"):
        for fname in ("passwd", "group"):
            args += ["--ro-bind", str(identity_dir / fname), f"/etc/{fname}"]
    if plan.root == "/":
        for f in plan.masked_files:
            if _visible(top, f):
                args += ["--ro-bind", "/dev/null", f]
        for d in plan.masked_dirs:
            if _visible(top, d):
                args += ["--ro-bind", str(empty_dir), d]
    size = ["--size", str(tmp_size)] if tmp_size else []
    # Each tmpfs is capped at the memory limit (its pages count as memory anyway).
    args += ["--proc", "/proc", *proc_hardening_args(), "--dev", "/dev",
             "--perms", "1777", *size, "--tmpfs", "/dev/shm",
             "--perms", "1777", *size, "--tmpfs", "/tmp",
             "--perms", "0755", *size, "--tmpfs", "/run"]
    if plan.root == "/" or "home" not in top.children:
        args += ["--perms", "0755", *size, "--tmpfs", "/home", "--dir", "/home/sandbox"]
    if plan.root == "/" or "var" not in top.children:
        args += ["--dir", "/var", "--symlink", "../tmp", "/var/tmp",
                 "--symlink", "../run", "/var/run", "--symlink", "../run/lock", "/var/lock"]
    elif os.path.isdir(plan.host_path("/var/tmp")) and not os.path.islink(
            plan.host_path("/var/tmp")):
        args += ["--perms", "1777", *size, "--tmpfs", "/var/tmp"]
    for target, source, writable in targets:
        args += ["--bind" if writable else "--ro-bind", source, target]
    # Read-only only now: mount points above had to be created first. An exploded
    # directory that is itself a mount target is covered by that mount, which decides
    # (a remount there would make a writable home read-only).
    mounted = {"/" + "/".join(_parts(t)) for t, _, _ in targets}
    for path in sorted(exploded, key=lambda p: -len(_parts(p))):
        if "/" + "/".join(_parts(path)) not in mounted:
            args += ["--remount-ro", path]
    args += ["--remount-ro", "/"]
    return args


#: /proc entries that change or reveal the host kernel: made read-only (directories and
#: write-only triggers), or hidden behind /dev/null (readable secrets), as Docker does.
PROC_READ_ONLY = ("/proc/sys", "/proc/sysrq-trigger", "/proc/bus", "/proc/fs", "/proc/irq")
PROC_MASKED = ("/proc/kcore", "/proc/keys", "/proc/key-users", "/proc/timer_list",
               "/proc/sched_debug", "/proc/latency_stats", "/proc/kallsyms", "/proc/kmsg",
               "/proc/acpi", "/proc/scsi", "/proc/asound")


@functools.cache
def proc_hardening_args() -> tuple[str, ...]:
    """bwrap arguments for the sandbox's /proc: the sysctl tree and trigger files bound
    read-only over themselves, secrets masked. Ownership already keeps the sandbox's uid
    from writing them (bwrap.py); this holds even where the sandbox runs as host root's
    uid (bwrap run by an unprivileged user whose uid is the only one mapped)."""
    args: list[str] = []
    for path in PROC_READ_ONLY:
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    for path in PROC_MASKED:
        if os.path.isdir(path):
            args += ["--tmpfs", path, "--remount-ro", path]
        elif os.path.exists(path):
            args += ["--ro-bind", "/dev/null", path]
    return tuple(args)  # the host's /proc entries do not change: probed once


def _make_room(top: _Node, parts: list[str]) -> None:
    """Make sure the mount point `parts` can be created: walking down its ancestors,
    a bound host directory that lacks the rest of the path is exploded (bwrap can only
    create directories on a tmpfs, never inside a read-only host directory)."""
    node = top
    for i, name in enumerate(parts[:-1]):
        child = node.children.get(name)
        if child is None:
            return  # a tmpfs from here down: bwrap creates the directories itself
        if child.host is not None:
            if os.path.exists(os.path.join(child.host, *parts[i + 1:])):
                return  # the mount point already exists in the host directory
            _explode(child)
        node = child


def _explode(node: _Node) -> None:
    """Turn a bound directory into a tmpfs with each of its entries bound back."""
    assert node.host is not None
    host = node.host
    try:
        entries = sorted(os.listdir(host))
    except OSError as e:
        raise SandboxError(f"cannot prepare a mount point inside {host}: {e}") from None
    node.host, node.exploded = None, True
    for name in entries:
        node.children[name] = _Node(host=os.path.join(host, name))


def _emit(node: _Node, path: str, args: list[str], exploded: list[str]) -> None:
    for name, child in sorted(node.children.items()):
        p = f"{path}/{name}"
        if child.host is not None:
            if os.path.islink(child.host):
                args += ["--symlink", os.readlink(child.host), p]
            else:
                args += ["--ro-bind", child.host, p]
        else:
            args += ["--perms", "0755", "--tmpfs", p]
            exploded.append(p)
            _emit(child, p, args, exploded)


def _visible(top: _Node, path: str) -> bool:
    """Whether a host path is bound (directly or through a bound ancestor) in the root."""
    node = top
    for name in _parts(path):
        child = node.children.get(name)
        if child is None:
            return False
        if child.host is not None:
            return True
        node = child
    return False

