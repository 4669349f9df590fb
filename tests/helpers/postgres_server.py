"""A throwaway PostgreSQL server on loopback for tests: `initdb` into a temp dir (trust
authentication, reachable only on 127.0.0.1 and a Unix socket in that dir), `postgres` on
a free port with durability off (fsync, synchronous_commit, full_page_writes: the data
dies with the test run anyway), polled until it accepts connections, and stopped.

    from tests.helpers.postgres_server import PostgresServer, postgres_server_fixture

    postgres_server = postgres_server_fixture()    # a session-wide server, fixture name
                                                   # "postgres_server"; skips without one
    def test_x(postgres_server: PostgresServer) -> None:
        url = postgres_server.new_database()       # a fresh, empty database per test

The binaries are found via $RIDGELINE_PG_BIN, then PATH, then Debian's
/usr/lib/postgresql/<version>/bin. PostgreSQL refuses to run as root, so under root the
server runs as the `postgres` system user (its temp dir is handed to that user)."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.helpers.local_servers import free_port, stop_process

SKIP_REASON = ("PostgreSQL server binaries (initdb, postgres) are not installed (Debian: "
               "apt-get install postgresql; `make system-deps` does it) or psycopg 3 is "
               "missing (pip install 'psycopg[binary]')")


def postgres_bin_dir() -> Path | None:
    """The directory holding `initdb` and `postgres`, or None."""
    candidates: list[str] = []
    if os.environ.get("RIDGELINE_PG_BIN"):
        candidates.append(os.environ["RIDGELINE_PG_BIN"])
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(str(Path(on_path).parent))
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                         key=lambda p: int(Path(p).parent.name)
                         if Path(p).parent.name.isdigit() else 0, reverse=True)
    for c in candidates:
        if (Path(c) / "initdb").is_file() and (Path(c) / "postgres").is_file():
            return Path(c)
    return None


def have_psycopg() -> bool:
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return False
    return True


def require_postgres() -> Path:
    """The binaries' directory, or skip the calling test with a reason saying how to get
    them."""
    found = postgres_bin_dir()
    if found is None or not have_psycopg():
        pytest.skip(SKIP_REASON)
    return found


class PostgresServer:
    """One `postgres` process and its cluster. A context manager, or `start()` / `stop()`."""

    user = "postgres"

    def __init__(self, *, start_timeout_s: float = 30.0,
                 settings: dict[str, str] | None = None) -> None:
        self.start_timeout_s = start_timeout_s
        self.settings = settings or {}
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None
        self._as: dict[str, Any] = {}

    @property
    def url(self) -> str:
        """The URL of the `postgres` database (an admin's; tests use `new_database`)."""
        return self.url_for("postgres")

    def url_for(self, database: str) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """Create an empty database and return its URL (tests never share tables)."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:16]
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url_for(name)

    def start(self) -> PostgresServer:
        bindir = postgres_bin_dir()
        if bindir is None:
            raise RuntimeError(SKIP_REASON)
        self._dir = tempfile.mkdtemp(prefix="ridgeline-pg-")
        if os.geteuid() == 0:   # initdb and postgres refuse root: run them as `postgres`
            try:
                pw = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError("running as root, and there is no `postgres` user to run "
                                   "the server as (Debian's postgresql package makes one)"
                                   ) from None
            os.chown(self._dir, pw.pw_uid, pw.pw_gid)
            self._as = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        data = Path(self._dir) / "data"
        init = subprocess.run(
            [str(bindir / "initdb"), "-D", str(data), "-U", self.user, "-A", "trust",
             "-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions"],
            capture_output=True, text=True, cwd=self._dir, **self._as)
        if init.returncode != 0:
            self.stop()
            raise RuntimeError(f"initdb failed:\n{init.stdout}\n{init.stderr}")
        last_log = ""
        for _ in range(3):   # a free port can be taken before postgres binds it: retry
            self.port = free_port()
            log = Path(self._dir) / f"postgres-{self.port}.log"
            options = {"listen_addresses": "127.0.0.1", "port": str(self.port),
                       "unix_socket_directories": self._dir, "fsync": "off",
                       "synchronous_commit": "off", "full_page_writes": "off",
                       "max_connections": "200", "shared_buffers": "32MB",
                       **self.settings}
            args = [str(bindir / "postgres"), "-D", str(data)]
            for k, v in options.items():
                args += ["-c", f"{k}={v}"]
            with open(log, "wb") as out:
                self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                             cwd=self._dir, **self._as)
            deadline = time.monotonic() + self.start_timeout_s
            while time.monotonic() < deadline and self.proc.poll() is None:
                if self._ready():
                    return self
                time.sleep(0.05)
            last_log = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            self._kill()
        self.stop()
        raise RuntimeError(f"postgres did not accept connections; its log:\n{last_log}")

    def _ready(self) -> bool:
        import psycopg

        try:
            with psycopg.connect(self.url, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.OperationalError:
            return False

    def _kill(self) -> None:
        if self.proc is None:
            return
        stop_process(self.proc, signal.SIGINT, timeout=10)  # PostgreSQL's "fast" shutdown
        self.proc = None

    def stop(self) -> None:
        self._kill()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def postgres_server_fixture(scope: Any = "session", name: str = "postgres_server",
                            settings: dict[str, str] | None = None
                            ) -> Callable[..., Iterator[PostgresServer]]:
    """A pytest fixture (assign it to a module-level name) yielding a running
    PostgresServer (with extra `settings`, as `postgres -c`); tests using it are skipped
    with a clear reason where the server binaries or psycopg are not installed."""

    @pytest.fixture(scope=scope, name=name)
    def _postgres_server() -> Iterator[PostgresServer]:
        require_postgres()
        with PostgresServer(settings=settings) as server:
            yield server

    return _postgres_server
