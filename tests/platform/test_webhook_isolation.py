"""One slow webhook receiver cannot hold up the others (issue 25, finding 9): attacks with
real receivers on loopback. A receiver that trickles its answer a byte at a time, one that
answers with an endless body and a host whose DNS lookup stalls; each next to a healthy
receiver that must get its webhook while the slow attempt is still in flight. Progress is
checked by order (what happened before what), never by wall-clock time; the waits below
are safety limits only."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from ridgeline.platform.webhooks import (
    WebhookConfig, WebhookDispatcher, WebhookOutbox, new_secret,
)

SECRET = new_secret()
T0 = 1_000_000.0


def wait_for(predicate: Any, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())


class Trickler:
    """A receiver on loopback that reads each request, then answers slowly: `mode` "status"
    trickles the status line, "headers" sends the status line and trickles the headers,
    "body" sends 200 and its headers and trickles the body, "flood" sends `status` with an
    endless body as fast as the socket takes it. It stops when the client hangs up."""

    def __init__(self, mode: str, *, interval: float = 0.05, status: int = 200) -> None:
        self.mode, self.interval, self.status = mode, interval, status
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(32)
        self.port = self.sock.getsockname()[1]
        self.lock = threading.Lock()
        self.connections = 0
        self.open = 0                    # connections still being answered
        self.bytes_sent = 0
        self.hung_up = threading.Event()  # the client closed while we were still sending
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}/hook"

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            with self.lock:
                self.connections += 1
                self.open += 1
            try:
                self._answer(conn)
            finally:
                with self.lock:
                    self.open -= 1

    def _answer(self, conn: socket.socket) -> None:
        head = f"HTTP/1.1 {self.status} X\r\ncontent-type: text/plain\r\n"
        if self.mode == "flood":
            conn.sendall(f"{head}content-length: {1 << 40}\r\n\r\n".encode())
            block = b"x" * 65536
            while not self.stop.is_set():
                try:
                    conn.sendall(block)
                except OSError:
                    self.hung_up.set()
                    return
                with self.lock:
                    self.bytes_sent += len(block)
            return
        full = f"{head}content-length: 100000\r\n\r\n".encode() + b"y" * 100000
        split = {"status": 0, "headers": len(f"HTTP/1.1 {self.status} X\r\n"),
                 "body": len(full) - 100000}[self.mode]
        conn.sendall(full[:split])
        for i in range(split, len(full)):
            if self.stop.is_set():
                return
            try:
                conn.sendall(full[i:i + 1])
            except OSError:
                self.hung_up.set()
                return
            with self.lock:
                self.bytes_sent += 1
            time.sleep(self.interval)

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


class Healthy:
    """A receiver that answers 204 at once and records the webhook ids it got."""

    def __init__(self) -> None:
        received: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                self.rfile.read(int(self.headers.get("content-length", 0)))
                received.append(self.headers.get("webhook-id", ""))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.received = received
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def healthy() -> Iterator[Healthy]:
    h = Healthy()
    yield h
    h.close()


def config(**kw: Any) -> WebhookConfig:
    base: dict[str, Any] = dict(allow_private_targets=True, poll_interval_s=3600,
                                base_delay_s=3600, max_delay_s=3600)
    return WebhookConfig(**{**base, **kw})


# ---- no batch barrier: a slow target occupies only its own slots ----------------------------


@pytest.mark.parametrize("mode", ["status", "body"])
@pytest.mark.parametrize("cap", ["owner", "target"])
def test_a_healthy_webhook_is_delivered_while_slow_ones_trickle(
        tmp_path: Path, healthy: Healthy, mode: str, cap: str) -> None:
    """One tenant's receivers trickle their answers for far longer than the test; another
    tenant's webhook must still arrive, while the slow attempts are in flight. `cap` says
    which cap bounds the attacker: its tenant (three slow targets) or its one target."""
    slow = [Trickler(mode) for _ in range(3 if cap == "owner" else 1)]
    cfg = config(timeout_s=600, concurrency=4, max_per_owner=2, max_per_target=2)
    box = WebhookOutbox(tmp_path / "w.db", cfg)
    owner = "mallory" if cap == "owner" else None
    try:
        with WebhookDispatcher(box) as d:
            d.start()
            slow_ids = [box.submit(slow[i % len(slow)].url(), "x", {"i": i}, SECRET,
                                   owner=owner) for i in range(6)]
            # positive control: the slow receivers hold two attempts and are trickling
            assert wait_for(lambda: sum(t.open for t in slow) == 2 and
                            sum(t.bytes_sent for t in slow) > 0)
            good = box.submit(healthy.url, "x", {"tenant": "alice"}, SECRET,
                              owner="alice" if owner else None)
            assert wait_for(lambda: box.get(good).state == "delivered")
            assert healthy.received == [good]
            # ... while the slow attempts were still in flight, and the caps held
            assert sum(t.open for t in slow) == 2 and sum(t.connections for t in slow) == 2
            assert not any(t.hung_up.is_set() for t in slow)
            states = [box.get(i) for i in slow_ids]
            assert all(s.state == "pending" and s.last_error is None for s in states)
            assert sorted(s.attempts for s in states) == [0, 0, 0, 0, 1, 1]
            for t in slow:   # let the in-flight attempts end so the dispatcher can stop
                t.close()
    finally:
        for t in slow:
            t.close()
        box.close()


# ---- each attempt has one total deadline and reads a bounded response -----------------------


@pytest.mark.parametrize("mode", ["status", "headers"])
def test_a_trickling_answer_is_cut_off_at_the_deadline(tmp_path: Path, mode: str) -> None:
    """Every read returns within `interval`, so a per-read timeout would never fire; the
    attempt must still end at its total deadline and be retried."""
    slow = Trickler(mode, interval=0.05)
    box = WebhookOutbox(tmp_path / "w.db", config(timeout_s=1.0), clock=lambda: T0)
    try:
        did = box.submit(slow.url(), "x", {}, SECRET)
        with WebhookDispatcher(box) as d:
            assert d.run_once(T0) == 1
        got = box.get(did)
        assert (got.state, got.attempts, got.last_status) == ("pending", 1, None)
        assert "timed out after 1 s" in (got.last_error or "")
        # positive control: the receiver was answering, a byte at a time, reads in
        assert slow.connections == 1 and slow.bytes_sent >= 2
        assert wait_for(slow.hung_up.is_set)       # we hung up on it; it had more to send
    finally:
        slow.close()
        box.close()


def test_a_2xx_whose_body_trickles_is_delivered_at_the_deadline(tmp_path: Path) -> None:
    slow = Trickler("body", interval=0.05)
    box = WebhookOutbox(tmp_path / "w.db", config(timeout_s=1.0), clock=lambda: T0)
    try:
        did = box.submit(slow.url(), "x", {}, SECRET)
        with WebhookDispatcher(box) as d:
            assert d.run_once(T0) == 1
        got = box.get(did)
        assert (got.state, got.last_status) == ("delivered", 200)   # the status decides
        assert slow.bytes_sent >= 2 and wait_for(slow.hung_up.is_set)
    finally:
        slow.close()
        box.close()


@pytest.mark.parametrize("status, state", [(200, "delivered"), (500, "pending")])
def test_an_endless_response_body_is_read_only_up_to_the_cap(
        tmp_path: Path, status: int, state: str) -> None:
    flood = Trickler("flood", status=status)
    box = WebhookOutbox(tmp_path / "w.db", config(timeout_s=60, max_response_bytes=64 * 1024),
                        clock=lambda: T0)
    try:
        did = box.submit(flood.url(), "x", {}, SECRET)
        with WebhookDispatcher(box) as d:
            assert d.run_once(T0) == 1
        got = box.get(did)
        assert (got.state, got.last_status) == (state, status)
        if status == 500:
            assert got.last_error is not None and got.last_error.startswith("HTTP 500: xxx")
            assert len(got.last_error) < 400
        # positive control: the receiver kept sending until we hung up, long before the
        # deadline (60 s) and long before its body (1 TiB) ended
        assert wait_for(flood.hung_up.is_set)
        assert flood.bytes_sent >= 64 * 1024
    finally:
        flood.close()
        box.close()


# ---- a stalled DNS lookup ------------------------------------------------------------------


@pytest.fixture
def stalling_dns(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A resolver that answers 127.0.0.1 for `*.stall.example`, but blocks while `stall`
    is set (as a slow or hostile DNS server does). `entered` counts blocked lookups."""
    real = socket.getaddrinfo
    state: dict[str, Any] = {"stall": threading.Event(), "release": threading.Event(),
                             "entered": 0, "lock": threading.Lock()}

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else str(host)
        if not name.endswith("stall.example"):
            return real(host, port, *args, **kwargs)
        if state["stall"].is_set():
            with state["lock"]:
                state["entered"] += 1
            state["release"].wait(60)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", int(port or 0)))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield state
    state["release"].set()


def test_a_stalled_lookup_is_cut_off_and_keeps_only_its_owners_slot(
        tmp_path: Path, healthy: Healthy, stalling_dns: dict[str, Any]) -> None:
    """The lookup cannot be interrupted: the attempt ends at its deadline, but the slot
    stays taken (by its owner) until the lookup thread returns, so abandoned lookups cannot
    pile up beyond the owner's share; other tenants are delivered meanwhile."""
    # quick retries: a healthy attempt that overruns its deadline on a loaded machine is
    # sent again, while mallory's cannot be (its only slot stays taken)
    cfg = config(timeout_s=1.0, concurrency=2, max_per_owner=1, base_delay_s=0.05,
                 max_delay_s=0.1)
    box = WebhookOutbox(tmp_path / "w.db", cfg)
    port = int(healthy.url.split(":")[2].split("/")[0])
    hooks = [box.submit(f"http://h{i}.stall.example:{port}/hook", "x", {"i": i}, SECRET,
                        owner="mallory") for i in range(2)]
    stalling_dns["stall"].set()
    try:
        with WebhookDispatcher(box) as d:
            d.start()
            assert wait_for(lambda: stalling_dns["entered"] == 1)   # positive control
            assert wait_for(lambda: "timed out" in (box.get(hooks[0]).last_error or "") or
                            "timed out" in (box.get(hooks[1]).last_error or ""))
            good = box.submit(healthy.url, "x", {}, SECRET, owner="alice")
            assert wait_for(lambda: box.get(good).state == "delivered")
            # the lookup is still blocked, and mallory's second webhook still waits for
            # the slot its first one's lookup holds
            assert stalling_dns["entered"] == 1 and not stalling_dns["release"].is_set()
            assert sorted(box.get(h).attempts for h in hooks) == [0, 1]
            stalling_dns["stall"].clear()
            stalling_dns["release"].set()
            second = next(h for h in hooks if box.get(h).attempts == 0)
            assert wait_for(lambda: box.get(second).state == "delivered")
    finally:
        stalling_dns["release"].set()
        box.close()
