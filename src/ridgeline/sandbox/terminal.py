"""Attaching the user's terminal to a shell in a sandbox (`ridgeline sandbox shell`).

The sandbox gets a pseudo-terminal of its own, never the host's: a process inside could
otherwise push keystrokes into the host shell's input (TIOCSTI). We relay bytes between
the real terminal (in raw mode) and the pty, and pass on window-size changes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import shutil
import signal
import struct
import sys
import termios
import tty

from ridgeline.errors import SandboxError


def _copy_winsize(src_fd: int, dst_fd: int) -> None:
    with contextlib.suppress(OSError):
        size = fcntl.ioctl(src_fd, termios.TIOCGWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
        fcntl.ioctl(dst_fd, termios.TIOCSWINSZ, size)


def attach(sandbox, argv: list[str] | None = None) -> int:
    """Run `argv` (default: an interactive bash) in `sandbox` on a new pty connected to
    this process's terminal; returns its exit status."""
    if not sys.stdin.isatty():
        raise SandboxError("an interactive shell needs a terminal",
                           hint="pipe commands into `ridgeline sandbox run -- bash` instead")
    setsid = shutil.which("setsid")
    if setsid is None:
        raise SandboxError("setsid not found", hint="install util-linux")
    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()
    master, slave = os.openpty()
    _copy_winsize(stdin, master)
    try:
        proc = sandbox.popen(argv or ["bash", "-i"], launcher=(setsid, "--ctty"),
                             env={"TERM": os.environ.get("TERM", "xterm")},
                             stdin=slave, stdout=slave, stderr=slave)
    finally:
        os.close(slave)
    old_attrs = termios.tcgetattr(stdin)
    old_winch = signal.signal(signal.SIGWINCH, lambda *_: _copy_winsize(stdin, master))
    try:
        tty.setraw(stdin)
        while True:
            try:
                ready, _, _ = select.select([stdin, master], [], [])
            except InterruptedError:
                continue
            if master in ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the other side closed
                    data = b""
                if not data:
                    break
                os.write(stdout, data)
            if stdin in ready:
                data = os.read(stdin, 65536)
                if not data:
                    break
                os.write(master, data)
    finally:
        termios.tcsetattr(stdin, termios.TCSADRAIN, old_attrs)
        signal.signal(signal.SIGWINCH, old_winch)
        os.close(master)
    try:
        return proc.wait(timeout=5)
    except Exception:  # noqa: BLE001 - the shell did not exit with the terminal
        proc.kill()
        return proc.wait()
