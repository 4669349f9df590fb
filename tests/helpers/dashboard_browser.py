"""What the dashboard's browser tests share: one headless Chromium (Debian's, driven by
Playwright) and one platform server for all three modules, and a local listener standing
in for an attacker's server.

    from tests.helpers.dashboard_browser import chromium_browser, dashboard_platform, listener  # fixtures
    from tests.helpers.dashboard_browser import release_after_last_user  # autouse: closes them in time

Starting Playwright's driver, Chromium and a platform costs seconds each on a small machine,
so each starts on first use and is closed right after the last selected test that uses it
(`release_after_last_user`), not at the end of the session: a live sync Playwright keeps
its asyncio loop marked as running in the main thread, so every later `asyncio.run()` in
the suite would refuse to start, and the platform's workers would keep polling."""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import pytest

from ridgeline.platform.config import PlatformConfig
from ridgeline.platform.principal import Principal
from ridgeline.platform.service import Platform
from ridgeline.serve.app import ServerThread

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run"]


def require_chromium() -> Any:
    """Playwright's sync API; the test is skipped, saying what to install, without it."""
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is a dev dependency (make install)")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (make system-deps does it)")
    return sync_api


def wait_until(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout  # a safety limit, not a measurement
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# -- shared resources: fixture name -> (the object, how to close it) ---------------------
_started: dict[str, tuple[Any, Callable[[], None]]] = {}


def _acquire(name: str, start: Callable[[], tuple[Any, Callable[[], None]]]) -> Any:
    if name not in _started:
        _started[name] = start()
    return _started[name][0]


def _release(name: str) -> None:
    if name in _started:
        _started.pop(name)[1]()


def _start_browser() -> tuple[Any, Callable[[], None]]:
    sync_api = require_chromium()
    playwright = sync_api.sync_playwright().start()
    try:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
    except BaseException:
        playwright.stop()
        raise

    def stop() -> None:
        try:
            chromium.close()
        finally:
            playwright.stop()
    return chromium, stop


@dataclass
class Served:
    """A running platform: `url` its root; `key()` a new API key and its principal."""
    url: str
    platform: Platform

    def key(self, tenant: str, user: str = "ann") -> tuple[str, Principal]:
        key, record = self.platform.keys.create(tenant, user=user)
        return key, Principal(key_id=record.key_id, tenant=tenant, user=user)


def _start_platform(data_dir: Path) -> tuple[Served, Callable[[], None]]:
    # two workers run the tasks the tests submit (replayed model replies, local sandbox)
    config = PlatformConfig.model_validate({
        "data_dir": str(data_dir), "server": {"run_workers": 2},
        "worker": {"sandbox": "local", "allow_replay_model": True, "poll_s": 0.05},
        "rag": {"embedder": "hashing", "qdrant_path": ":memory:"}})
    platform = Platform(config)
    try:
        server = ServerThread(platform.app()).start()
    except BaseException:
        platform.close()
        raise

    def stop() -> None:
        try:
            server.stop()
        finally:
            platform.close()
    return Served(server.url, platform), stop


@pytest.fixture(scope="session")
def chromium_browser() -> Iterator[Any]:
    """The shared Chromium; each test opens a context of its own and closes it."""
    yield _acquire("chromium_browser", _start_browser)
    _release("chromium_browser")  # at the session's end, where no test's teardown did it


@pytest.fixture(scope="session")
def dashboard_platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The shared platform; tests keep apart by using tenants of their own."""
    yield _acquire("dashboard_platform",
                   lambda: _start_platform(tmp_path_factory.mktemp("dashboard")))
    _release("dashboard_platform")


@pytest.fixture(autouse=True)
def release_after_last_user(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test: close what no later selected test uses (see the module's doc)."""
    yield
    items = request.session.items
    later = items[items.index(request.node) + 1:] if request.node in items else []
    for name in list(_started):
        if not any(name in getattr(item, "fixturenames", ()) for item in later):
            _release(name)


class Listener:
    """An attacker's server on loopback: records each request's path, answers "ok" to any
    origin (so a request the browser lets out also completes)."""

    def __init__(self) -> None:
        hits: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                hits.append(self.path)
                self.send_response(200)
                self.send_header("access-control-allow-origin", "*")
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.hits = hits
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def starting(self, prefix: str) -> list[str]:
        return [h for h in self.hits if h.startswith(prefix)]

    def wait_for(self, paths: Iterable[str], timeout: float = 10.0) -> None:
        expected = set(paths)
        try:
            wait_until(lambda: expected <= set(self.hits), timeout)
        except AssertionError:
            raise AssertionError(f"no request to {sorted(expected - set(self.hits))} "
                                 f"(requests: {self.hits})") from None

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture(scope="module")
def listener() -> Iterator[Listener]:
    server = Listener()
    yield server
    server.close()
