"""Forks: several sandboxes that start from one prepared workspace, copy-on-write.

`Sandbox.fork(n)` (bwrap) freezes the workspace as it is now into a base tree once,
then gives each of the n new sandboxes an overlay mount on its workspace directory:
the base read-only below, an empty upper directory of its own above (on the sandbox's
own volume where it has one, so its disk quota counts what it writes). Nothing is
copied per fork until a fork writes a file (the kernel copies that file up).

Why a frozen copy rather than the parent's workspace itself: the parent keeps running
and writing in place, and an overlay's lower tree must not change under it. The copy is
made by the snapshot code (snapshot.py: every path relative to a descriptor opened with
O_NOFOLLOW, because the parent's processes may swap directories for links meanwhile),
then materialised once into the base; both are the host's, unreachable by any sandbox.

Each fork is a sandbox of its own uid (identity.py), while the base's files belong to
the parent's: the fork's workspace is chowned as any new workspace is, and with
`metacopy=on` that copies up metadata only, not data.

What a fork keeps: the workspace's files (contents, modes, links) and, for a task
sandbox, the built image it runs on. What it does not: processes, /tmp, shell state
(memory snapshots of running processes, as E2B and Modal offer, are a later step).
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

from ridgeline.sandbox import hostfs
from ridgeline.sandbox import snapshot as snapshots

MNT_DETACH = 2
UPPER, WORK = ".fork-upper", ".fork-work"

_libc = ctypes.CDLL(None, use_errno=True)


class ForkBase:
    """A frozen workspace tree shared read-only by forks; removed with its last user."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.tree = directory / "tree"
        self._users = 1            # the caller of `freeze` holds one reference
        self._lock = threading.Lock()

    @classmethod
    def freeze(cls, workspace: Path, directory: Path, max_bytes: int | None) -> "ForkBase":
        """Copy `workspace` (possibly in use) into `directory`/tree, safely."""
        directory.mkdir(mode=0o700)
        try:
            snap = snapshots.take(workspace, directory / "store", "fork", None, max_bytes)
            (directory / "tree").mkdir(mode=0o700)
            snapshots.restore(directory / "tree", snap)
            hostfs.discard_tree(directory / "store", "fork snapshot store")
        except BaseException:
            hostfs.discard_tree(directory, "fork base")
            raise
        return cls(directory)

    def acquire(self) -> None:
        with self._lock:
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            last = self._users == 0
        if last:
            hostfs.discard_tree(self.directory, "fork base")


def can_mount() -> bool:
    """Overlay mounts need root on the host (elsewhere a fork copies the base)."""
    return os.geteuid() == 0


def mount_overlay(workspace: Path, base: ForkBase) -> None:
    """Mount the base (read-only) under a fresh upper layer on `workspace`, whose own
    filesystem holds the upper and work directories (hidden by the mount)."""
    upper, work = workspace / UPPER, workspace / WORK
    upper.mkdir(mode=0o755)
    work.mkdir(mode=0o700)
    opts = (f"lowerdir={base.tree},upperdir={upper},workdir={work},"
            "metacopy=on,redirect_dir=on")
    if _libc.mount(b"overlay", os.fsencode(workspace), b"overlay", 0, opts.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount overlay on {workspace}: {os.strerror(err)}")


def unmount_overlay(workspace: Path) -> None:
    """Detach the overlay (idempotent: nothing mounted is fine)."""
    if _libc.umount2(os.fsencode(workspace), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):   # EINVAL: not a mount point; ENOENT: gone
            raise OSError(err, f"umount {workspace}: {os.strerror(err)}")
