"""A warm pool of sandboxes of one spec.

`acquire()` hands out a sandbox that is already running (a deque pop); `release()`
gives it back, and a background thread resets it (every process killed, a fresh /tmp,
the workspace restored to its clean state) before anyone gets it again. At most
`max_concurrency` sandboxes are leased at once; `acquire` waits for one beyond that.

The seed directory is copied once into the pool's base; each member is seeded from the
base and registers it as its clean snapshot without copying it again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import shutil
import threading
import time
from collections import deque
from pathlib import Path
from typing import Iterator

from ridgeline.errors import ConfigError, SandboxError
from ridgeline.sandbox import disk
from ridgeline.sandbox.base import SandboxSpec
from ridgeline.sandbox.host_sandbox import HostSandbox

RESET_WORKERS = 2
log = logging.getLogger(__name__)


class SandboxPool:
    def __init__(self, spec: SandboxSpec | None = None, size: int = 4, backend: str = "bwrap",
                 max_concurrency: int | None = None, *, provider=None) -> None:
        if not isinstance(size, int) or size < 0:
            raise ConfigError(f"pool size must be a whole number >= 0, got {size!r}")
        if max_concurrency is not None and (not isinstance(max_concurrency, int)
                                            or max_concurrency < 1):
            raise ConfigError(f"max_concurrency must be >= 1, got {max_concurrency!r}")
        from ridgeline.sandbox import get_provider
        self.spec = spec or SandboxSpec()
        self.size = size
        self.max_concurrency = max_concurrency or max(size, 1)
        self._provider = provider or get_provider(backend)
        self._cond = threading.Condition()
        self._idle: deque[HostSandbox] = deque()
        self._leased: set[HostSandbox] = set()
        self._clean: dict[str, str] = {}   # sandbox id -> its clean snapshot id
        self._busy = 0                     # being created or reset
        self._closed = False
        self._dirty: queue.SimpleQueue = queue.SimpleQueue()
        self.resets = self.replaced = 0
        self.dir = Path(self._provider.root) / f"{os.getpid()}-pool-{secrets.token_hex(4)}"
        self.dir.mkdir()
        try:
            base = self.dir / "base"
            if self.spec.workspace_from is not None:
                if not Path(self.spec.workspace_from).is_dir():
                    raise SandboxError(f"workspace_from {self.spec.workspace_from} is not a "
                                       "directory")
                # Sparse: a seed's holes must not become zeros on the host's disk.
                shutil.copytree(self.spec.workspace_from, base, symlinks=True,
                                copy_function=disk.copy2_sparse)
            else:
                base.mkdir()
            self._base = base
            self._member_spec = self.spec.model_copy(update={"workspace_from": base})
            self._workers = [threading.Thread(target=self._reset_loop, daemon=True,
                                              name=f"ridgeline-pool-reset-{i}")
                             for i in range(RESET_WORKERS)]
            for w in self._workers:
                w.start()
            for _ in range(size):
                self._idle.append(self._create())
        except BaseException:
            self.close()
            raise

    # -- members ---------------------------------------------------------------------------
    def _create(self) -> HostSandbox:
        sb = self._provider.create(self._member_spec)
        try:
            self._clean[sb.id] = sb.adopt_snapshot(self._base)
        except BaseException:
            sb.close()
            raise
        return sb

    def _discard(self, sb: HostSandbox) -> None:
        self._clean.pop(sb.id, None)
        with contextlib.suppress(Exception):
            sb.close()

    @property
    def total(self) -> int:
        return len(self._idle) + len(self._leased) + self._busy

    # -- leasing ---------------------------------------------------------------------------
    def acquire(self, timeout: float | None = None) -> HostSandbox:
        """A ready sandbox in its clean state. Waits while `max_concurrency` are leased
        (SandboxError after `timeout` seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    raise SandboxError("the sandbox pool is closed")
                if len(self._leased) < self.max_concurrency:
                    while self._idle:
                        sb = self._idle.popleft()
                        if sb.alive:
                            self._leased.add(sb)
                            return sb
                        self._discard(sb)  # died while idle: never hand it out
                    if self.total < max(self.size, self.max_concurrency):
                        self._busy += 1
                        break  # create one outside the lock
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise SandboxError(f"no sandbox became free within {timeout} s "
                                       f"({len(self._leased)} leased, max_concurrency="
                                       f"{self.max_concurrency})")
                self._cond.wait(left)
        try:
            sb = self._create()
        except BaseException:
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()
            raise
        with self._cond:
            self._busy -= 1
            if self._closed:
                self._discard(sb)
                raise SandboxError("the sandbox pool is closed")
            self._leased.add(sb)
            return sb

    def release(self, sb: HostSandbox) -> None:
        """Give a sandbox back; it is reset in the background before its next lease."""
        with self._cond:
            if self._closed:
                self._discard(sb)  # the pool is gone; so is its sandbox
                return
            if sb not in self._leased:
                raise SandboxError(f"sandbox {getattr(sb, 'id', sb)} is not leased from this pool",
                                   hint="release each acquired sandbox exactly once")
            self._leased.remove(sb)
            self._busy += 1
            self._cond.notify_all()
        self._dirty.put(sb)

    @contextlib.contextmanager
    def lease(self, timeout: float | None = None) -> Iterator[HostSandbox]:
        """`with pool.lease() as sb:` acquires and releases."""
        sb = self.acquire(timeout)
        try:
            yield sb
        finally:
            self.release(sb)

    def _reset_loop(self) -> None:
        while True:
            sb = self._dirty.get()
            if sb is None:
                return
            ok = False
            if not self._closed and not sb.closed and sb.id in self._clean:
                try:
                    sb.reset(self._clean[sb.id])
                    ok = sb.alive
                except Exception as e:  # noqa: BLE001 - a sandbox that cannot reset is replaced
                    log.warning("sandbox pool: resetting %s failed (%s); replacing it", sb.id, e)
                    ok = False
            with self._cond:
                self.resets += 1
                if ok and not self._closed:
                    self._idle.append(sb)
                    self._busy -= 1
                    self._cond.notify_all()
                    continue
            self._discard(sb)
            replacement = None
            if not self._closed and self.total - 1 < self.size:
                try:
                    replacement = self._create()
                except Exception:  # noqa: BLE001 - the next acquire creates one instead
                    replacement = None
            with self._cond:
                self._busy -= 1
                self.replaced += 1
                if replacement is not None:
                    if self._closed:
                        self._discard(replacement)
                    else:
                        self._idle.append(replacement)
                self._cond.notify_all()

    # -- end -------------------------------------------------------------------------------
    def close(self) -> None:
        """Close every sandbox of the pool, leased ones included."""
        with self._cond:
            if self._closed and not hasattr(self, "_workers"):
                return
            self._closed = True
            members = list(self._idle) + list(self._leased)
            self._idle.clear()
            self._leased.clear()
            self._cond.notify_all()
        for w in getattr(self, "_workers", []):
            self._dirty.put(None)
        for w in getattr(self, "_workers", []):
            w.join(timeout=30)
        while True:  # members released but not reset when the workers stopped
            try:
                sb = self._dirty.get_nowait()
            except queue.Empty:
                break
            if sb is not None:
                members.append(sb)
        for sb in members:
            self._discard(sb)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.__dict__.pop("_workers", None)

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return self.total
