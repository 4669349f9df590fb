"""What the loopback servers tests start (Redis, PostgreSQL) share: a free port and a
shutdown that escalates to SIGKILL."""

from __future__ import annotations

import signal
import socket
import subprocess


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 5.0
                 ) -> None:
    """Ask `proc` to stop with `sig`, then kill it if it has not within `timeout`."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
