"""`ServerThread`: uvicorn serving an app on a free loopback port in a background thread,
for tests, benchmarks and notebooks (`with ServerThread(create_app(...)) as server:`).

It binds the socket itself (port 0 picks a free one, known before the server starts),
waits until uvicorn reports started, and stops it on exit. It knows nothing of the app it
serves (the platform's tests run their own FastAPI apps on it) and imports neither
FastAPI nor uvicorn at module level. Split out of `ridgeline.serve.app`, which still
exports it.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from ridgeline.engine.core.worker import EngineUnavailableError
from ridgeline.errors import ConfigError


class ServerThread:
    """uvicorn serving `app` on a free loopback port, in a background thread (tests,
    benchmarks, notebooks). `url` is the root, `base_url` the OpenAI base (`.../v1`)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        import uvicorn

        self.host = host
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise ConfigError(f"cannot listen on {host}:{port}: {e}",
                              hint="pick another --port") from None
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise EngineUnavailableError(f"the server on {self.url} did not start",
                                             hint="see the log above")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        return self.start() if not self._thread.is_alive() else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
