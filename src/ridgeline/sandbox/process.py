"""Driving one started process to its end: stdin fed, stdout and stderr captured up to a
cap (cut with a marker), a deadline, and a kill hook that ends the whole process tree.

Every backend starts its process its own way (bwrap: `nsenter` into the sandbox; local:
plainly) and hands the `Popen` to `communicate`, so limits behave the same everywhere.
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import IO, Callable

from ridgeline.sandbox.base import ExecResult

log = logging.getLogger(__name__)

#: After the command exits, output still buffered (or written by a background process
#: that inherited the pipes) is collected for at most this long.
DRAIN_GRACE_S = 0.2
#: After a kill, how long to wait for the process tree to go away.
KILL_GRACE_S = 5.0
#: A stream this many times over the cap is endless output: the command is stopped
#: instead of burning CPU until its timeout (the first `cap` bytes are still returned).
OUTPUT_KILL_FACTOR = 16
OUTPUT_KILL_MIN_BYTES = 16 * 1024 * 1024
READ_CHUNK = 1 << 16

SIGNAL_CAUSES = {signal.SIGXCPU: "cpu", signal.SIGXFSZ: "file_size"}
TIMEOUT_EXIT_CODE = 124  # what coreutils `timeout` reports; agents know it


@dataclass
class Capture:
    """One output stream: the first `limit` bytes are kept, the rest only counted."""

    limit: int
    kept: bytearray = field(default_factory=bytearray)
    total: int = 0

    def feed(self, data: bytes) -> None:
        room = self.limit - len(self.kept)
        if room > 0:
            self.kept += data[:room]
        self.total += len(data)

    @property
    def truncated(self) -> bool:
        return self.total > self.limit

    def value(self, stopped: bool = False) -> bytes:
        if not self.truncated:
            return bytes(self.kept)
        omitted = self.total - len(self.kept)
        how = (f"the command was stopped after writing {self.total} bytes" if stopped
               else f"{omitted} more bytes were not kept")
        marker = f"\n[ridgeline: output truncated at {self.limit} bytes; {how}]\n"
        return bytes(self.kept) + marker.encode()


@dataclass
class Outcome:
    """What happened to a process, before a backend adds its own diagnosis."""

    returncode: int
    stdout: Capture
    stderr: Capture
    duration_s: float
    timed_out: bool = False
    output_killed: bool = False


def kill_threshold(limit: int) -> int:
    return max(limit * OUTPUT_KILL_FACTOR, OUTPUT_KILL_MIN_BYTES)


def communicate(proc: subprocess.Popen, *, stdin: bytes | None, timeout: float | None,
                max_output: int, kill: Callable[[], None],
                started: float | None = None) -> Outcome:
    """Feed `stdin`, collect both outputs, enforce `timeout` (seconds, None = none)
    and the output cap; `kill()` must end the whole tree of `proc`."""
    t0 = started if started is not None else time.monotonic()
    deadline = None if timeout is None else t0 + timeout
    out, err = Capture(max_output), Capture(max_output)
    captures = {}
    sel = selectors.DefaultSelector()
    for pipe, cap in ((proc.stdout, out), (proc.stderr, err)):
        if pipe is not None:
            os.set_blocking(pipe.fileno(), False)
            sel.register(pipe.fileno(), selectors.EVENT_READ)
            captures[pipe.fileno()] = cap
    pending = memoryview(stdin or b"")
    if proc.stdin is not None:
        if pending:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
    # A pidfd tells us the moment the process exits, even while a background child
    # keeps the pipes open; without one we poll.
    pidfd = _pidfd(proc.pid)
    if pidfd is not None:
        sel.register(pidfd, selectors.EVENT_READ)
    stop_at: float | None = None  # when to stop reading: exit + grace, or kill + grace
    timed_out = output_killed = False
    threshold = kill_threshold(max_output)
    try:
        while True:
            now = time.monotonic()
            if proc.returncode is not None or proc.poll() is not None:
                if not captures and not pending:
                    break
                stop_at = min(stop_at or float("inf"), now + DRAIN_GRACE_S)
            if (deadline is not None and now >= deadline and not timed_out
                    and not output_killed):
                timed_out = True
                kill()
                stop_at = min(stop_at or float("inf"), time.monotonic() + KILL_GRACE_S)
            if stop_at is not None and now >= stop_at:
                break
            waits = [t - now for t in (None if timed_out else deadline, stop_at)
                     if t is not None]
            wait = max(0.0, min([*waits, 0.05 if pidfd is None else 3600.0]))
            for key, _ in sel.select(wait):
                fd = key.fd
                if fd == pidfd:
                    sel.unregister(pidfd)
                    os.close(pidfd)
                    pidfd = None
                elif proc.stdin is not None and not proc.stdin.closed \
                        and fd == proc.stdin.fileno():
                    pending = _feed(proc, sel, pending)
                else:
                    try:
                        data = os.read(fd, READ_CHUNK)
                    except BlockingIOError:
                        continue
                    if not data:
                        sel.unregister(fd)
                        del captures[fd]
                        continue
                    captures[fd].feed(data)
                    if not output_killed and not timed_out and captures[fd].total > threshold:
                        output_killed = True
                        kill()
                        stop_at = min(stop_at or float("inf"), time.monotonic() + KILL_GRACE_S)
    finally:
        sel.close()
        if pidfd is not None:
            os.close(pidfd)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            close_pipe(pipe)
    try:
        rc = proc.wait(timeout=KILL_GRACE_S if (timed_out or output_killed) else None)
    except subprocess.TimeoutExpired:
        kill()
        proc.kill()
        rc = proc.wait()
    return Outcome(rc, out, err, time.monotonic() - t0, timed_out, output_killed)


def _feed(proc: subprocess.Popen, sel: selectors.BaseSelector, pending: memoryview) -> memoryview:
    assert proc.stdin is not None
    try:
        n = os.write(proc.stdin.fileno(), pending[:READ_CHUNK])
        pending = pending[n:]
    except BlockingIOError:
        return pending
    except OSError as e:  # the command does not read its input: not our error
        if e.errno not in (errno.EPIPE, errno.EINVAL):
            raise
        pending = pending[:0]
    if not pending:
        sel.unregister(proc.stdin.fileno())
        proc.stdin.close()
    return pending


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def to_exec_result(o: Outcome, *, memory_killed: bool = False) -> ExecResult:
    """Map an outcome to the public result: shell-style exit codes (128+N for signal N,
    124 for a timeout) and the reason a process was killed."""
    rc = o.returncode
    killed_by: str | None = None
    code = 128 - rc if rc < 0 else rc
    if o.timed_out:
        killed_by, code = "timeout", TIMEOUT_EXIT_CODE
    elif o.output_killed:
        killed_by = "output"
    elif memory_killed:
        killed_by = "memory"
    elif rc < 0:
        killed_by = SIGNAL_CAUSES.get(-rc, f"signal:{-rc}")
    elif rc > 128 and rc - 128 in SIGNAL_CAUSES:  # a shell reporting its child's signal
        killed_by = SIGNAL_CAUSES[rc - 128]
    return ExecResult(
        exit_code=code,
        stdout_bytes=o.stdout.value(stopped=o.output_killed),
        stderr_bytes=o.stderr.value(stopped=o.output_killed),
        duration_s=o.duration_s,
        timed_out=o.timed_out,
        killed_by=killed_by,
        truncated=o.stdout.truncated or o.stderr.truncated,
    )


def kill_process_tree(pid: int, keep: frozenset[int] = frozenset()) -> None:
    """SIGKILL every descendant of `pid` still linked to it, then `pid` and its process
    group (a re-parented daemon escapes this; cgroups are the complete answer). The
    descendants go first so that `pid` (e.g. nsenter) can still reap its child."""
    import psutil

    try:
        descendants = {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        descendants = set()
    for v in descendants - keep - {os.getpid()}:
        sigkill(v)
    end = time.monotonic() + 0.5
    while descendants and time.monotonic() < end:  # let `pid` reap them
        try:
            if not psutil.Process(pid).children():
                break
        except psutil.Error:
            break
        time.sleep(0.002)
    sigkill(pid, group=True)
    sigkill(pid)


def sigkill(pid: int, group: bool = False) -> None:
    """SIGKILL the process `pid` (or the process group it leads), which may have exited
    already: that is expected and fine. Any other failure (EPERM: the pid is not ours)
    is logged, never hidden."""
    try:
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # gone already, or (group) not a group leader: nothing left to kill
    except OSError as e:
        log.warning("could not kill %s %d: %s", "process group" if group else "process", pid, e)


def close_pipe(pipe: IO[bytes] | None) -> None:
    """Close one of a child's pipes. Closing its stdin flushes what is still buffered,
    which fails with BrokenPipeError once the child has exited: expected, there is no
    one left to read it. Any other failure is logged."""
    if pipe is None or pipe.closed:
        return
    try:
        pipe.close()
    except BrokenPipeError:
        pass
    except OSError as e:
        log.warning("closing a pipe of a sandbox command failed: %s", e)


class TreeTracker:
    """Shell tracker without cgroups: the command's processes are the descendants of
    bash that did not exist before it started (earlier background jobs survive)."""

    def __init__(self, bash_pid: int, session_pid: int | None = None) -> None:
        self.bash_pid = bash_pid
        self.session_pid = session_pid if session_pid is not None else bash_pid
        self._before: set[int] = set()

    def _descendants(self) -> set[int]:
        import psutil

        try:
            return {p.pid for p in psutil.Process(self.bash_pid).children(recursive=True)}
        except psutil.Error:
            return set()

    def begin(self) -> None:
        self._before = self._descendants()

    def interrupt(self) -> None:
        for _ in range(50):
            victims = self._descendants() - self._before
            if not victims:
                return
            for v in victims:
                sigkill(v)
            time.sleep(0.005)

    def kill_all(self) -> None:
        kill_process_tree(self.session_pid)
        kill_process_tree(self.bash_pid)
