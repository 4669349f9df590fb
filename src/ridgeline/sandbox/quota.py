"""The disk quota of a sandbox: how much its workspace and writable mounts may hold.

This machine's filesystems have no project quotas, so the bound is enforced by
measurement: a watcher thread walks the sandbox's writable host trees (allocated
blocks, so a sparse file costs what it really holds; disk.py) and, the moment they are
over `Limits.disk_bytes`, kills every process of the sandbox, as a memory cgroup kills
on OOM. Files are kept (nothing is lost; the caller sees `killed_by="disk"` and decides).
The interval adapts to the walk's own cost, so a big workspace is not walked
continuously: at most ~5% of one core goes to watching.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from ridgeline.sandbox import disk

MIN_INTERVAL_S = 0.25
MAX_INTERVAL_S = 5.0
#: Walk time is at most this share of the time between walks.
DUTY = 0.05
log = logging.getLogger(__name__)


class DiskQuota:
    def __init__(self, trees: list[Path], limit: int, on_exceeded: Callable[[int], None],
                 name: str = "sandbox") -> None:
        self.trees, self.limit = trees, limit
        self._on_exceeded = on_exceeded
        self._stop = threading.Event()
        self.exceeded = 0          # how many times the quota was hit
        self.last_bytes = 0
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"ridgeline-disk-quota-{name}")
        self._thread.start()

    def used(self) -> int:
        total = 0
        for tree in self.trees:
            try:
                total += disk.allocated_bytes(tree)
            except OSError:
                continue  # a tree that vanished holds nothing
        return total

    def check(self) -> bool:
        """Measure now; True (and processes killed) if over the quota."""
        used = self.last_bytes = self.used()
        if used <= self.limit:
            return False
        self.exceeded += 1
        log.warning("sandbox over its disk quota (%s > %s): killing its processes",
                    disk.human(used), disk.human(self.limit))
        self._on_exceeded(used)
        return True

    def _loop(self) -> None:
        interval = MIN_INTERVAL_S
        while not self._stop.wait(interval):
            t0 = time.monotonic()
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watcher must outlive odd trees
                log.exception("disk quota check failed")
            cost = time.monotonic() - t0
            interval = min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, cost / DUTY))

    def stop(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
