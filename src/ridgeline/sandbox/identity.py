"""Who a sandbox is on the host: one unprivileged host uid per sandbox.

The sandbox user (uid 1000 inside) must never be host root: with the host's uid
mapped in, owner permissions of root-owned files apply, so a writable `/proc/sys`
file, a root-owned mount source or a file the host harness wrote would be the
sandbox's to change. When Ridgeline runs as root, each sandbox therefore gets a host
uid (and gid) of its own from a dedicated range far above any real account; two
sandboxes never share one, so they cannot signal, trace or write each other's files.

A uid is held by an exclusive `flock` on a lock file named after it, in a root-only
directory shared by every Ridgeline process on the machine; the kernel releases the
lock when the holder exits, so a crash never leaks a uid.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import random
import stat
import tempfile
import threading
from pathlib import Path

from ridgeline.errors import SandboxError

#: First host uid (and gid) handed to sandboxes, and how many there are. Far above
#: login accounts and the usual subordinate-uid ranges (100000 + 65536 * n).
UID_BASE = 1_600_000_000
UID_COUNT = 65_536


def lock_dir() -> Path:
    """Where the uid locks live: $RIDGELINE_UID_DIR, else /run/ridgeline-uids (shared by
    every process on the machine), else a directory in the temp dir."""
    env = os.environ.get("RIDGELINE_UID_DIR")
    if env:
        return Path(env)
    run = Path("/run")
    base = run if os.access(run, os.W_OK) else Path(tempfile.gettempdir())
    return base / "ridgeline-uids"


def _private_dir(path: Path) -> Path:
    """Create `path` (mode 0700) or check that it is a directory of ours, not a link."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=True)
    st = path.lstat()
    if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid()
            or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
        raise SandboxError(f"{path} is not a private directory owned by this user",
                           hint="remove it, or set RIDGELINE_UID_DIR to another directory")
    return path


class HostIdentity:
    """A host uid/gid leased to one sandbox until `release()`."""

    def __init__(self, uid: int, lock_fd: int) -> None:
        self.uid = self.gid = uid
        self._fd: int | None = lock_fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None

    def __repr__(self) -> str:
        return f"<HostIdentity uid={self.uid}>"


class IdentityAllocator:
    """Hands out host uids from [base, base + count), one per live sandbox."""

    def __init__(self, directory: Path | None = None, base: int = UID_BASE,
                 count: int = UID_COUNT) -> None:
        self.dir = _private_dir(directory or lock_dir())
        self.base, self.count = base, count
        self._lock = threading.Lock()
        self._rng = random.Random()

    def acquire(self) -> HostIdentity:
        # Start at a random slot: concurrent processes rarely probe the same files.
        start = self._rng.randrange(self.count)
        with self._lock:
            for i in range(self.count):
                slot = (start + i) % self.count
                fd = os.open(self.dir / str(slot), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
                             | os.O_NOFOLLOW, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as e:
                    os.close(fd)
                    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                        continue
                    raise
                return HostIdentity(self.base + slot, fd)
        raise SandboxError(f"all {self.count} sandbox uids are in use",
                           hint="close sandboxes that are no longer needed")
