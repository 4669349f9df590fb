"""A throwaway `redis-server` on loopback for tests: a free port, no persistence
(`--save "" --appendonly no`), its files in a temp dir; started, PINGed until it answers,
and stopped. Tests that need Redis import it:

    from tests.helpers.redis_server import RedisServer, redis_server_fixture

    redis_server = redis_server_fixture()          # a session-wide server, fixture name
                                                   # "redis_server"; skips without one
    def test_x(redis_server: RedisServer) -> None:
        client = redis.Redis.from_url(redis_server.url)

Tests sharing the server keep their keys apart (a unique key prefix or db number each)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.helpers.local_servers import free_port, stop_process

SKIP_REASON = ("redis-server is not installed (Debian: apt-get install redis-server; "
               "`make system-deps` does it)")


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


def require_redis_server() -> str:
    """The binary's path, or skip the calling test with a reason that says how to get it."""
    path = redis_server_path()
    if path is None:
        pytest.skip(SKIP_REASON)
    return path


def ping(port: int, timeout: float = 0.5) -> bool:
    """True when a Redis server on 127.0.0.1:port answers PING (raw RESP: no client needed)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One `redis-server` process. Use as a context manager, or `start()` / `stop()`."""

    def __init__(self, *, extra_args: tuple[str, ...] = (), start_timeout_s: float = 10.0
                 ) -> None:
        self.extra_args = extra_args
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = redis_server_path()
        if binary is None:
            raise RuntimeError(SKIP_REASON)
        self._dir = tempfile.TemporaryDirectory(prefix="ridgeline-redis-")
        # A free port can be taken between our probe and redis' bind: retry on a new one.
        last_log = ""
        for _ in range(3):
            self.port = free_port()
            log = Path(self._dir.name) / f"redis-{self.port}.log"
            self.proc = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1",
                 "--save", "", "--appendonly", "no", "--dir", self._dir.name,
                 "--logfile", str(log), "--daemonize", "no", *self.extra_args],
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + self.start_timeout_s
            while time.monotonic() < deadline and self.proc.poll() is None:
                if ping(self.port):
                    return self
                time.sleep(0.02)
            last_log = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            self._kill()
        self.stop()
        raise RuntimeError(f"redis-server did not answer PING; its log:\n{last_log}")

    def _kill(self) -> None:
        if self.proc is None:
            return
        stop_process(self.proc)
        self.proc = None

    def stop(self) -> None:
        self._kill()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def redis_server_fixture(scope: Any = "session", name: str = "redis_server"
                         ) -> Callable[..., Iterator[RedisServer]]:
    """A pytest fixture (assign it to a module-level name) yielding a running RedisServer;
    tests using it are skipped with a clear reason where redis-server is not installed."""

    @pytest.fixture(scope=scope, name=name)
    def _redis_server() -> Iterator[RedisServer]:
        require_redis_server()
        with RedisServer() as server:
            yield server

    return _redis_server
