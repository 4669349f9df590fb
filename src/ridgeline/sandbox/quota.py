"""The disk quota watcher: the backstop behind the per-sandbox filesystem.

The bound itself is the filesystem: a workspace on a volume of its own (volume.py)
cannot grow past `Limits.disk_bytes`, the kernel says ENOSPC. This watcher adds the
total over the workspace and the writable mounts (host directories, not on the volume)
and, the moment it is over `Limits.disk_bytes`, kills every process of the sandbox, as
a memory cgroup kills on OOM. Files are kept (the caller sees `killed_by="disk"`). A
volume is measured by statvfs (what the filesystem holds, open unlinked files
included); other trees by a walk (allocated blocks, disk.py), which cannot see an
unlinked open file or stop a fallocate before the next walk: that is why the filesystem
is the bound, and this watcher alone (`Limits.weak_limits`, no loop devices) is weaker.
A walk that fails (a tree deeper than the open-file limit, an unreadable entry) counts
as over the quota, never as empty. One thread watches every sandbox of the process;
each sandbox's interval adapts to its walk's own cost (~5% of one core).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from ridgeline.sandbox import disk, volume

MIN_INTERVAL_S = 0.25
MAX_INTERVAL_S = 5.0
#: Walk time is at most this share of the time between walks.
DUTY = 0.05
#: What a tree that cannot be measured counts as: more than any quota.
UNMEASURABLE = sys.maxsize
log = logging.getLogger(__name__)


class DiskQuota:
    """One sandbox's quota; measured by the process-wide watcher thread from
    construction until `stop()`."""

    def __init__(self, trees: list[Path], limit: int, on_exceeded: Callable[[int], None],
                 name: str = "sandbox") -> None:
        self.trees, self.limit, self.name = trees, limit, name
        self._on_exceeded = on_exceeded
        self.exceeded = 0          # how many times the quota was hit
        self.next_due = time.monotonic() + MIN_INTERVAL_S
        _watcher.add(self)

    def used(self) -> int:
        """Bytes the trees hold; UNMEASURABLE if a tree cannot be measured."""
        total = 0
        for tree in self.trees:
            vol = volume.mounted_at(tree)
            try:
                total += vol.used() if vol is not None else disk.allocated_bytes(tree)
            except OSError as e:
                if not os.path.lexists(tree):
                    continue  # a tree that vanished holds nothing
                log.warning("sandbox %s: cannot measure %s (%s): counted as over its "
                            "disk quota", self.name, tree, e)
                return UNMEASURABLE
        return total

    def check(self) -> bool:
        """Measure now; True (and processes killed) if over the quota."""
        used = self.used()
        if used <= self.limit:
            return False
        self.exceeded += 1
        log.warning("sandbox %s over its disk quota (%s > %s): killing its processes",
                    self.name, "unmeasurable" if used == UNMEASURABLE else disk.human(used),
                    disk.human(self.limit))
        self._on_exceeded(used)
        return True

    def stop(self) -> None:
        _watcher.discard(self)


class _Watcher:
    """A single thread for every sandbox of the process: each quota is measured when
    due, and its next turn comes after its walk's cost / DUTY (at least MIN_INTERVAL_S,
    at most MAX_INTERVAL_S)."""

    def __init__(self) -> None:
        self._quotas: set[DiskQuota] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, q: DiskQuota) -> None:
        with self._lock:
            self._quotas.add(q)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="ridgeline-disk-quota")
                self._thread.start()

    def discard(self, q: DiskQuota) -> None:
        with self._lock:
            self._quotas.discard(q)

    def _loop(self) -> None:
        while True:
            with self._lock:
                if not self._quotas:  # nothing to watch: the next add() starts a thread
                    self._thread = None
                    return
                due = sorted(self._quotas, key=lambda q: q.next_due)
            now = time.monotonic()
            for q in due:
                if q.next_due > now:
                    break
                t0 = time.monotonic()
                try:
                    with self._lock:
                        live = q in self._quotas
                    if live:
                        q.check()
                except Exception:  # noqa: BLE001 - the watcher must outlive odd trees
                    log.exception("disk quota check of sandbox %s failed", q.name)
                cost = time.monotonic() - t0
                q.next_due = time.monotonic() + min(MAX_INTERVAL_S,
                                                    max(MIN_INTERVAL_S, cost / DUTY))
            time.sleep(MIN_INTERVAL_S / 2)


_watcher = _Watcher()
