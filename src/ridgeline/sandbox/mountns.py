"""Bind sources the sandbox's unprivileged host uid could not reach, made reachable.

bwrap runs as the sandbox's own host uid (identity.py), and it resolves every bind
source with that uid's permissions: a workspace under a root-only directory, the
host's Python under /root, or the passwd file Ridgeline writes for the sandbox would
all be "permission denied". So the thread that starts a sandbox's processes moves into
a private mount namespace of its own (unshare(CLONE_NEWNS) affects only the calling
thread), mounts a small tmpfs on a fixed, empty mount point and bind-mounts each such
source there; bwrap, started from that thread, binds the staged copy instead. Nothing
of this is visible to the host or to other sandboxes, and it all disappears with the
thread's namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import stat
import tempfile
from pathlib import Path

from ridgeline.errors import SandboxError
from ridgeline.sandbox.rootfs import SYSTEM_DIRS

CLONE_NEWNS = 0x00020000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
BIND_OPTIONS = ("--bind", "--ro-bind", "--bind-try", "--ro-bind-try", "--dev-bind")
#: Sources the sandbox uid can always read: the host's system trees (rootfs binds them
#: world-readable, root-only entries masked) and /dev/null.
PUBLIC_SOURCES = (*(f"/{d}" for d in SYSTEM_DIRS), "/dev/null")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    enc = (lambda s: s.encode() if s is not None else None)
    if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def stage_point() -> Path:
    """The empty host directory every sandbox thread mounts its staging tmpfs on. It
    holds nothing in the host's namespace, but must not be someone else's link."""
    path = Path(tempfile.gettempdir()) / f"ridgeline-stage-{os.geteuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o755)
    st = path.lstat()
    if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid()
            or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
        raise SandboxError(f"{path} is not a directory owned by this user",
                           hint="remove it and try again")
    path.chmod(0o755)
    return path


class StagedSources:
    """Lives in (and must only be used from) the thread that starts the sandbox."""

    def __init__(self, point: Path) -> None:
        if _libc.unshare(CLONE_NEWNS) != 0:
            err = ctypes.get_errno()
            raise SandboxError(f"unshare(CLONE_NEWNS): {os.strerror(err)}")
        # Mounts made below must not propagate back to the host's namespace.
        _mount(None, "/", None, MS_REC | MS_PRIVATE)
        self.point = point
        self._staged: dict[str, str] = {}
        self._mount_point()

    def _mount_point(self) -> None:
        _mount("ridgeline-stage", str(self.point), "tmpfs", 0, "mode=0755,size=1m")

    def _bind(self, source: str, dest: Path) -> None:
        if os.path.isdir(source):
            dest.mkdir(mode=0o755)
        else:
            dest.touch(mode=0o644)
        _mount(source, str(dest), None, MS_BIND | MS_REC)

    def stage(self, source: str) -> str:
        """A path under the staging point that shows `source` (file or directory)."""
        if source in self._staged:
            return self._staged[source]
        dest = self.point / str(len(self._staged))
        self._bind(source, dest)
        self._staged[source] = str(dest)
        return str(dest)

    def ensure(self) -> None:
        """Re-stage everything if the staging tmpfs is gone: removing the (empty) host
        directory it is mounted on detaches it in every namespace (Linux >= 3.18). A
        source replaced since it was staged (a file renamed over, e.g. the identity
        files another process rewrote) is bound again: a bind of the unlinked old file
        can no longer be mounted by bwrap."""
        if os.path.ismount(self.point):
            for source, dest in self._staged.items():
                try:
                    now, staged = os.stat(source), os.stat(dest)
                except FileNotFoundError:
                    continue  # gone for good: bwrap will say so
                if (now.st_dev, now.st_ino) != (staged.st_dev, staged.st_ino):
                    if _libc.umount2(dest.encode(), MNT_DETACH) != 0:
                        err = ctypes.get_errno()
                        raise OSError(err, f"umount {dest}: {os.strerror(err)}")
                    _mount(source, dest, None, MS_BIND | MS_REC)
            return
        with contextlib.suppress(FileExistsError):
            self.point.mkdir(mode=0o755)
        self._mount_point()
        for source, dest in self._staged.items():
            self._bind(source, Path(dest))

    def rewrite(self, args: list[str]) -> list[str]:
        """bwrap arguments with every non-public bind source replaced by its stage."""
        out, i = [], 0
        while i < len(args):
            a = args[i]
            out.append(a)
            if a in BIND_OPTIONS and i + 1 < len(args):
                src = args[i + 1]
                public = any(src == p or src.startswith(p + "/") for p in PUBLIC_SOURCES)
                out.append(src if public or not os.path.exists(src) else self.stage(src))
                i += 2
                continue
            i += 1
        return out
