"""A persistent bash: the terminal an agent types into.

One bash process reads commands from its stdin, NUL-terminated, and `eval`s each in the
same shell, so cwd, variables, functions and background jobs persist. After a command it
prints a marker line with a random token, the exit status and `$PWD` on stdout (and the
token on stderr), which is how `send` knows where the output of that command ends.

The token is new for every command and reaches bash only after the command has run:
`send` writes the command, then the token, and bash reads the token from its stdin once
`eval` returns. While the command runs the token is in no variable, argument or
environment of the shell (commands get /dev/null as stdin), so its output cannot print
a marker that ends it early with a status or cwd of its choosing; a token from an
earlier command is never accepted again. Residual: the command runs inside this bash
and may rewrite it (define a function named `builtin`, read bash's stdin through
/proc/$$/fd), so the reported status is the agent's own claim, like `(exit 0)` would
be: it is shown to the agent and never graded (verdicts come from the verifier).

At a timeout the command's processes are killed (the backend's `Tracker` knows which:
a cgroup per command, or the process tree) and bash prints its marker, still alive. If
bash itself is what hangs (a loop of builtins), it is killed and restarted in the last
known directory on the next `send`; the result says that variables were reset.
"""

from __future__ import annotations

import logging
import os
import secrets
import selectors
import subprocess
import time
from typing import Callable, Protocol

from ridgeline.errors import SandboxError
from ridgeline.sandbox.base import ExecResult
from ridgeline.sandbox.process import TIMEOUT_EXIT_CODE, Capture, close_pipe, kill_threshold

log = logging.getLogger(__name__)

INTERRUPT_GRACE_S = 2.0
START_TIMEOUT_S = 30.0

# {marker} is the start-up token only (it is in bash's argv): each command's token is
# read after the command, into the variable that held the command.
_SCRIPT = r"""
builtin printf '\n%s\n' {marker} >&2
builtin printf '\n%s 0 %s\n' {marker} "$PWD"
while IFS= builtin read -r -d '' __rl_c; do
  builtin eval "$__rl_c" </dev/null
  __rl_s=$?
  IFS= builtin read -r -d '' __rl_c
  builtin printf '\n%s\n' "$__rl_c" >&2
  builtin printf '\n%s %d %s\n' "$__rl_c" "$__rl_s" "$PWD"
done
"""


def _new_marker() -> bytes:
    return f"__RIDGELINE_{secrets.token_hex(16)}__".encode()


class Tracker(Protocol):
    """Which processes belong to the current command of a shell session."""

    def begin(self) -> None: ...          # a command is about to start
    def interrupt(self) -> None: ...      # kill the command's processes, not bash
    def kill_all(self) -> None: ...       # kill bash and everything it started


#: start(argv, cwd) -> (bash process with stdin/stdout/stderr pipes, its tracker)
Starter = Callable[[list[str], "str | None"], "tuple[subprocess.Popen, Tracker]"]


class _Stream:
    """Output of one pipe, split at the session's marker."""

    def __init__(self, fd: int, marker: bytes, limit: int) -> None:
        self.fd = fd
        self.marker = b"\n" + marker
        self.limit = limit
        self.buf = bytearray()    # not yet assigned to a command
        self.capture = Capture(limit)
        self.done = False
        self.line = b""           # the rest of the marker line (stdout: status and cwd)
        self.eof = False

    def reset(self, marker: bytes) -> None:
        self.marker = b"\n" + marker
        self.capture = Capture(self.limit)
        self.done = False
        self.line = b""
        self._consume()

    def feed(self, data: bytes) -> None:
        self.buf += data
        self._consume()

    def _consume(self) -> None:
        if self.done:
            return
        i = self.buf.find(self.marker)
        if i < 0:
            keep = len(self.marker)  # a marker may be split across reads
            if len(self.buf) > keep:
                self.capture.feed(bytes(self.buf[:-keep]))
                del self.buf[:-keep]
            return
        end = self.buf.find(b"\n", i + len(self.marker))
        if end < 0:
            self.capture.feed(bytes(self.buf[:i]))
            del self.buf[:i]
            return
        self.capture.feed(bytes(self.buf[:i]))
        self.line = bytes(self.buf[i + len(self.marker):end]).strip()
        del self.buf[:end + 1]
        self.done = True


class BashSession:
    """`send(cmd, timeout) -> ExecResult` against one long-lived bash."""

    def __init__(self, start: Starter, *, max_output: int, default_timeout: float,
                 cwd: str | None = None, check_open: Callable[[], None] | None = None) -> None:
        self._start = start
        self.max_output = max_output
        self.default_timeout = default_timeout
        self._check_open = check_open or (lambda: None)
        self.cwd = cwd
        self._proc: subprocess.Popen | None = None
        self._closed = False
        self._note = ""  # said once, in the result of the next command
        self._spawn()

    # -- lifecycle -----------------------------------------------------------------------
    def _spawn(self) -> None:
        marker = _new_marker()
        argv = ["bash", "--noprofile", "--norc", "-c", _SCRIPT.format(marker=marker.decode())]
        self._proc, self._tracker = self._start(argv, self.cwd)
        assert self._proc.stdout and self._proc.stderr and self._proc.stdin
        for pipe in (self._proc.stdout, self._proc.stderr):
            os.set_blocking(pipe.fileno(), False)
        self._out = _Stream(self._proc.stdout.fileno(), marker, self.max_output)
        self._err = _Stream(self._proc.stderr.fileno(), marker, self.max_output)
        if not self._wait_markers(time.monotonic() + START_TIMEOUT_S):
            err = self._err.capture.value().decode(errors="replace").strip()
            self._kill()
            raise SandboxError(f"the shell did not start: {err[-500:] or 'no output'}")

    def _kill(self) -> None:
        try:
            self._tracker.kill_all()
        finally:
            proc, self._proc = self._proc, None
            if proc is not None:
                for pipe in (proc.stdin, proc.stdout, proc.stderr):
                    close_pipe(pipe)
                try:
                    proc.kill()  # a no-op once bash has exited
                except OSError as e:
                    log.warning("could not kill the shell's bash (pid %d): %s", proc.pid, e)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._proc is not None:
            self._kill()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> "BashSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- commands --------------------------------------------------------------------------
    def send(self, cmd: str, timeout: float | None = None) -> ExecResult:
        """Run `cmd` in the session; returns its output and exit status. A command that
        is still running at `timeout` is killed (timed_out=True, exit code 124)."""
        self._check_open()
        if self._closed:
            raise SandboxError("this shell session is closed", hint="open one with shell()")
        if "\0" in cmd:
            raise SandboxError("a shell command cannot contain NUL bytes")
        if self._proc is None:
            self._spawn()  # the previous bash had to be killed: start afresh in its cwd
        elif self._proc.poll() is not None:
            code = self._proc.returncode
            self._kill()
            raise SandboxError(f"the shell session has ended (exit status {code})",
                               hint="open a new one with shell()")
        assert self._proc is not None and self._proc.stdin is not None
        if timeout is None:
            timeout = self.default_timeout
        elif not isinstance(timeout, (int, float)) or not timeout > 0:
            raise SandboxError(f"timeout must be a positive number of seconds, got {timeout!r}")
        t0 = time.monotonic()
        marker = _new_marker()  # this command's alone; bash reads it after the command
        self._out.reset(marker)
        self._err.reset(marker)
        self._tracker.begin()
        try:
            self._proc.stdin.write(cmd.encode() + b"\0" + marker + b"\0")
            self._proc.stdin.flush()
        except BrokenPipeError:
            pass  # bash is gone; reported below from its exit status
        except OSError as e:
            log.warning("could not send a command to the shell's bash: %s", e)
        done = self._wait_markers(t0 + timeout)
        timed_out = killed = False
        if not done and self._proc.poll() is None and not self._out.eof:
            timed_out = True
            self._tracker.interrupt()
            done = self._wait_markers(time.monotonic() + INTERRUPT_GRACE_S)
            if not done:  # bash itself is stuck
                killed = True
                self._kill()
        note = self._note
        self._note = ""
        if killed:
            note += (f"\n[ridgeline: the shell did not return after the command was "
                     f"stopped; it was restarted in {self.cwd or 'its start directory'}; "
                     "shell variables, functions and background jobs are gone]\n")
        code = TIMEOUT_EXIT_CODE if timed_out else 0
        if done and self._out.line:
            status, _, pwd = self._out.line.decode(errors="replace").partition(" ")
            if not timed_out:
                code = int(status) if status.lstrip("-").isdigit() else 0
            self.cwd = pwd or self.cwd
        elif not timed_out and self._proc is not None:
            # No marker: bash exited (`exit`, `set -e`) with the command's status.
            try:
                code = self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = 1
            code = 128 - code if code < 0 else code
        stopped = self._out.capture.total > kill_threshold(self.max_output)
        return ExecResult(
            exit_code=code,
            stdout_bytes=self._out.capture.value(stopped=stopped),
            stderr_bytes=self._err.capture.value(stopped=stopped) + note.encode(),
            duration_s=time.monotonic() - t0,
            timed_out=timed_out,
            killed_by="timeout" if timed_out else ("output" if stopped else None),
            truncated=self._out.capture.truncated or self._err.capture.truncated,
        )

    def _wait_markers(self, deadline: float) -> bool:
        """Read both pipes until both markers arrived (True), EOF or the deadline."""
        proc = self._proc
        assert proc is not None
        streams = {s.fd: s for s in (self._out, self._err)}
        stopped = False
        sel = selectors.DefaultSelector()
        try:
            for s in streams.values():
                if not s.eof:
                    sel.register(s.fd, selectors.EVENT_READ)
            while not (self._out.done and self._err.done):
                left = deadline - time.monotonic()
                if left <= 0 or not sel.get_map():
                    return False
                for key, _ in sel.select(left):
                    s = streams[key.fd]
                    try:
                        data = os.read(key.fd, 1 << 16)
                    except BlockingIOError:
                        continue
                    if not data:
                        s.eof = True
                        sel.unregister(key.fd)
                        continue
                    s.feed(data)
                    if (not stopped and not s.done
                            and s.capture.total > kill_threshold(self.max_output)):
                        stopped = True
                        self._tracker.interrupt()  # endless output: stop the command
            return True
        finally:
            sel.close()
