"""Webhooks end to end: Standard Webhooks signatures checked both ways against the
`standardwebhooks` library, and deliveries to a real uvicorn receiver on loopback that
verifies each one with that library and fails, refuses or hangs on request. Scheduling is
checked on the recorded next-attempt times (an injected `now` and a seeded RNG), never on
wall-clock time."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request, Response
from tests.helpers.postgres_server import postgres_server_fixture
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from ridgeline.errors import (
    ConfigError, ConflictError, NotFoundError, PayloadTooLargeError, RidgelineError,
)
from ridgeline.platform.urls import UnsafeURLError
from ridgeline.platform.webhooks import (
    WebhookConfig, WebhookDispatcher, WebhookOutbox, WebhookSignatureError, new_secret,
    retry_after_seconds, sign, signature_header, verify,
)
from ridgeline.wire import error_for

SECRET = new_secret()
# "Now" for the outbox and the dispatcher in scheduling tests (signatures use real time).
T0 = 1_000_000.0

# ---- signatures ----------------------------------------------------------------------------


def test_new_secrets_are_whsec_base64_of_32_random_bytes() -> None:
    a, b = new_secret(), new_secret()
    assert a.startswith("whsec_") and a != b
    assert len(base64.b64decode(a.removeprefix("whsec_"))) == 32


def test_the_standard_webhooks_test_vector() -> None:
    # The example in the Standard Webhooks specification.
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    got = sign(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, b'{"test": 2432232314}')
    assert got == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_our_signatures_verify_with_the_standardwebhooks_library() -> None:
    body = json.dumps({"type": "task.completed", "data": {"id": "t1", "ok": True}}).encode()
    now = int(time.time())
    headers = {"webhook-id": "msg_1", "webhook-timestamp": str(now),
               "webhook-signature": sign(SECRET, "msg_1", now, body)}
    assert Webhook(SECRET).verify(body, headers)["data"]["id"] == "t1"
    with pytest.raises(WebhookVerificationError):
        Webhook(SECRET).verify(body.replace(b"t1", b"t2"), headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(new_secret()).verify(body, headers)
    old = now - 600
    with pytest.raises(WebhookVerificationError, match="too old"):
        Webhook(SECRET).verify(body, {**headers, "webhook-timestamp": str(old),
                                      "webhook-signature": sign(SECRET, "msg_1", old, body)})


def test_the_librarys_signatures_verify_with_ours() -> None:
    body = b'{"type":"ping","data":{"n":1}}'
    now = datetime.now(tz=timezone.utc)
    stamp = int(now.timestamp())
    headers = {"Webhook-Id": "msg_2", "Webhook-Timestamp": str(stamp),
               "Webhook-Signature": Webhook(SECRET).sign("msg_2", now, body.decode())}
    verify(SECRET, headers, body)                       # case-insensitive header names
    with pytest.raises(WebhookSignatureError, match="no webhook signature matches"):
        verify(SECRET, headers, body + b" ")
    with pytest.raises(WebhookSignatureError, match="no webhook signature matches"):
        verify(SECRET, {**headers, "Webhook-Id": "msg_3"}, body)
    with pytest.raises(WebhookSignatureError, match="300 s"):
        verify(SECRET, headers, body, now=stamp + 301)
    with pytest.raises(WebhookSignatureError, match="300 s"):
        verify(SECRET, headers, body, now=stamp - 301)  # from the future
    with pytest.raises(WebhookSignatureError, match="missing"):
        verify(SECRET, {"webhook-id": "msg_2"}, body)
    assert WebhookSignatureError("x").http_status == 401


def test_key_rotation_signs_with_each_secret() -> None:
    old, new = new_secret(), new_secret()
    body, stamp = b"{}", int(time.time())
    header = signature_header([old, new], "msg_r", stamp, body)
    assert len(header.split(" ")) == 2
    headers = {"webhook-id": "msg_r", "webhook-timestamp": str(stamp),
               "webhook-signature": header}
    for s in (old, new):
        verify(s, headers, body)
        Webhook(s).verify(body, headers)
    verify([new_secret(), new], headers, body)          # a receiver holding both
    with pytest.raises(WebhookSignatureError):
        verify(new_secret(), headers, body)
    # unknown versions and junk entries are skipped, not fatal
    verify(old, {**headers, "webhook-signature": "v1a,abc v1,@@@ " + header}, body)


def test_bad_secrets_are_refused() -> None:
    for bad in ("whsec_", "whsec_not base64!", ""):
        with pytest.raises(ConfigError, match="whsec_"):
            sign(bad, "m", 1, b"")


# ---- a real receiver ------------------------------------------------------------------------


class Receiver:
    """Verifies every webhook with the `standardwebhooks` library and answers as planned:
    one entry per request, a status code or "hang"; 204 when the plan runs out."""

    def __init__(self) -> None:
        self.secret = SECRET
        self.plan: list[int | str] = []
        self.headers_for: dict[int, dict[str, str]] = {}
        self.hang_s = 2.0
        self.received: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def reset(self) -> None:
        with self.lock:
            self.plan, self.headers_for, self.received = [], {}, []

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/hook")
        async def hook(request: Request) -> Response:
            body = await request.body()
            headers = dict(request.headers)
            try:
                payload = Webhook(self.secret).verify(body, headers)
                verified = True
            except WebhookVerificationError:
                payload, verified = None, False
            with self.lock:
                self.received.append({"id": headers.get("webhook-id"), "body": body,
                                      "verified": verified, "payload": payload})
                action = self.plan.pop(0) if self.plan else 204
            if action == "hang":
                await asyncio.sleep(self.hang_s)
                action = 204
            if not verified:
                return Response("bad signature", status_code=401)
            status = int(action)
            return Response(None if status == 204 else f"status {status}", status_code=status,
                            headers=self.headers_for.get(status, {}))

        return app


def received_ids(receiver: Receiver) -> list[str]:
    return [r["id"] for r in receiver.received]


@pytest.fixture(scope="module")
def receiver_server() -> Iterator[tuple[Receiver, int]]:
    rec = Receiver()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(rec.app(), log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    yield rec, sock.getsockname()[1]
    server.should_exit = True
    thread.join(5)


@pytest.fixture
def receiver(receiver_server: tuple[Receiver, int]) -> Receiver:
    receiver_server[0].reset()
    return receiver_server[0]


@pytest.fixture
def url(receiver_server: tuple[Receiver, int]) -> str:
    return f"http://127.0.0.1:{receiver_server[1]}/hook"


def config(**kw: Any) -> WebhookConfig:
    base = dict(allow_private_targets=True, base_delay_s=1.0, max_delay_s=60.0,
                timeout_s=2.0, max_attempts=5)
    return WebhookConfig(**{**base, **kw})


def fixed_clock_outbox(path: Path, cfg: WebhookConfig | None = None) -> WebhookOutbox:
    """An outbox whose clock stands at T0: deliveries are submitted due at T0."""
    return WebhookOutbox(path, cfg or config(), clock=lambda: T0)


@pytest.fixture
def outbox(tmp_path: Path) -> Iterator[WebhookOutbox]:
    box = fixed_clock_outbox(tmp_path / "webhooks.db")
    yield box
    box.close()


def dispatcher(box: WebhookOutbox, cfg: WebhookConfig | None = None,
               seed: int = 0) -> WebhookDispatcher:
    return WebhookDispatcher(box, cfg or box.config, rng=random.Random(seed))


# ---- delivery, retry, dead letters ----------------------------------------------------------


def test_delivered_after_two_failures_with_the_same_webhook_id(
        outbox: WebhookOutbox, receiver: Receiver, url: str) -> None:
    receiver.plan = [500, 503]
    did = outbox.submit(url, "task.completed", {"task": "t1", "reward": 1.0}, SECRET)
    assert did.startswith("msg_")
    with dispatcher(outbox) as d:
        now = T0
        for expected_attempts in (1, 2):
            assert d.run_once(now) == 1
            got = outbox.get(did)
            assert (got.state, got.attempts) == ("pending", expected_attempts)
            assert got.last_status in (500, 503) and "HTTP 5" in (got.last_error or "")
            assert now <= got.next_attempt_at <= now + 2 ** (expected_attempts - 1)
            assert d.run_once(now) == 0               # not due again before its time
            now = got.next_attempt_at
        assert d.run_once(now) == 1
    got = outbox.get(did)
    assert (got.state, got.attempts, got.last_status) == ("delivered", 3, 204)
    assert got.delivered_at == now
    assert [r["id"] for r in receiver.received] == [did] * 3
    assert all(r["verified"] for r in receiver.received)
    assert len({r["body"] for r in receiver.received}) == 1   # the same bytes every time
    sent = receiver.received[0]["payload"]
    assert sent["type"] == "task.completed" and sent["data"] == {"task": "t1", "reward": 1.0}
    assert datetime.fromisoformat(sent["timestamp"].replace("Z", "+00:00")).tzinfo
    assert outbox.due(now + 10_000) == []


def test_backoff_doubles_up_to_the_cap_then_dead_letters(
        outbox: WebhookOutbox, receiver: Receiver, url: str) -> None:
    cfg = config(jitter=False, base_delay_s=1.0, max_delay_s=5.0, max_attempts=6)
    receiver.plan = [500] * 10
    did = outbox.submit(url, "task.failed", {"n": 1}, SECRET)
    delays = []
    with dispatcher(outbox, cfg) as d:
        now = T0
        while outbox.get(did).state == "pending":
            assert d.run_once(now) == 1
            got = outbox.get(did)
            if got.state == "pending":
                delays.append(got.next_attempt_at - now)
                now = got.next_attempt_at
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0]
    dead = outbox.get(did)
    assert (dead.state, dead.attempts, dead.last_status) == ("dead", 6, 500)
    assert "HTTP 500" in (dead.last_error or "") and "gave up after 6 attempts" in dead.last_error
    assert len(receiver.received) == 6
    assert [x.id for x in outbox.deliveries("dead")] == [did]
    assert outbox.deliveries("delivered") == []
    assert outbox.counts() == {"pending": 0, "delivered": 0, "dead": 1}
    with pytest.raises(RidgelineError, match="unknown delivery state"):
        outbox.deliveries("lost")  # type: ignore[arg-type]


def test_full_jitter_draws_each_delay_from_zero_to_the_cap(
        outbox: WebhookOutbox, receiver: Receiver, url: str) -> None:
    cfg = config(base_delay_s=10.0, max_delay_s=45.0, max_attempts=6)
    receiver.plan = [502] * 10
    did = outbox.submit(url, "x", {}, SECRET)
    delays = []
    with dispatcher(outbox, cfg, seed=42) as d:
        now = T0
        for _ in range(5):
            d.run_once(now)
            got = outbox.get(did)
            delays.append(got.next_attempt_at - now)
            now = got.next_attempt_at
    caps = [10.0, 20.0, 40.0, 45.0, 45.0]
    same_seed = random.Random(42)
    assert delays == pytest.approx([same_seed.uniform(0, c) for c in caps])
    assert all(0 <= x <= c for x, c in zip(delays, caps))
    assert any(x < c * 0.9 for x, c in zip(delays, caps))   # really jittered


@pytest.mark.parametrize("status", [400, 401, 404, 410, 422])
def test_permanent_4xx_is_dead_at_once(outbox: WebhookOutbox, receiver: Receiver, url: str,
                                       status: int) -> None:
    receiver.plan = [status]
    did = outbox.submit(url, "x", {"a": 1}, SECRET)
    with dispatcher(outbox) as d:
        assert d.run_once(T0) == 1
        assert d.run_once(T0 + 10_000) == 0
    got = outbox.get(did)
    assert (got.state, got.attempts, got.last_status) == ("dead", 1, status)
    assert f"HTTP {status}: status {status}" == got.last_error   # with the body's start
    assert len(receiver.received) == 1


@pytest.mark.parametrize("status", [408, 409, 425, 429])
def test_retryable_4xx_and_retry_after(outbox: WebhookOutbox, receiver: Receiver, url: str,
                                       status: int) -> None:
    receiver.plan = [status]
    receiver.headers_for = {status: {"retry-after": "30"}}
    did = outbox.submit(url, "x", {}, SECRET)
    with dispatcher(outbox, config(base_delay_s=0.5)) as d:
        d.run_once(T0)
        got = outbox.get(did)
        assert (got.state, got.last_status) == ("pending", status)
        assert got.next_attempt_at == pytest.approx(T0 + 30)   # longer than the backoff
        d.run_once(got.next_attempt_at)
    assert outbox.get(did).state == "delivered"


def test_retry_after_is_capped_by_max_delay(outbox: WebhookOutbox, receiver: Receiver,
                                            url: str) -> None:
    receiver.plan = [503]
    receiver.headers_for = {503: {"retry-after": "86400"}}
    did = outbox.submit(url, "x", {}, SECRET)
    with dispatcher(outbox, config(max_delay_s=60.0)) as d:
        d.run_once(T0)
    assert outbox.get(did).next_attempt_at == pytest.approx(T0 + 60)


def test_retry_after_header_forms() -> None:
    assert retry_after_seconds("120") == 120.0
    assert retry_after_seconds("-5") == 0.0
    assert retry_after_seconds(None) is None and retry_after_seconds("soon") is None
    when = datetime.fromtimestamp(T0 + 90, tz=timezone.utc)
    assert retry_after_seconds(format_datetime(when, usegmt=True), now=T0) == 90.0


def test_a_hanging_receiver_times_out_and_is_retried(
        outbox: WebhookOutbox, receiver: Receiver, url: str) -> None:
    receiver.plan = ["hang"]
    receiver.hang_s = 1.5
    did = outbox.submit(url, "x", {}, SECRET)
    with dispatcher(outbox, config(timeout_s=0.3)) as d:
        d.run_once(T0)
        got = outbox.get(did)
        assert (got.state, got.last_status) == ("pending", None)
        assert "timed out after 0.3 s" in (got.last_error or "")
        d.run_once(got.next_attempt_at)
    assert outbox.get(did).state == "delivered"
    assert [r["id"] for r in receiver.received] == [did, did]


def test_connection_refused_is_retried_then_dead(outbox: WebhookOutbox) -> None:
    with socket.socket() as s:         # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    did = outbox.submit(f"http://127.0.0.1:{closed}/hook", "x", {}, SECRET)
    with dispatcher(outbox, config(max_attempts=2)) as d:
        d.run_once(T0)
        got = outbox.get(did)
        assert got.state == "pending" and "ConnectError" in (got.last_error or "")
        d.run_once(got.next_attempt_at)
    dead = outbox.get(did)
    assert dead.state == "dead" and "gave up after 2 attempts" in (dead.last_error or "")


def test_requeue_sends_a_dead_delivery_again_with_the_same_id(
        outbox: WebhookOutbox, receiver: Receiver, url: str) -> None:
    receiver.plan = [410]
    did = outbox.submit(url, "x", {"k": "v"}, SECRET)
    with dispatcher(outbox) as d:
        d.run_once(T0)
        assert outbox.get(did).state == "dead"
        again = outbox.requeue(did, now=T0 + 5)
        assert (again.state, again.attempts, again.next_attempt_at) == ("pending", 0, T0 + 5)
        assert d.run_once(T0 + 5) == 1
    got = outbox.get(did)
    assert (got.state, got.attempts) == ("delivered", 1)
    assert [r["id"] for r in receiver.received] == [did, did]
    with pytest.raises(NotFoundError):
        outbox.requeue("msg_nope")


# ---- persistence and idempotency ------------------------------------------------------------


def test_pending_deliveries_survive_a_restart(tmp_path: Path, receiver: Receiver,
                                              url: str) -> None:
    path = tmp_path / "hooks.db"
    first = fixed_clock_outbox(path)
    in_flight = first.submit(url, "b", {"n": 2}, SECRET)
    # The process dies while sending `in_flight`: claimed (attempt counted) but not finished.
    (claimed, secrets), = first.claim_due(T0, 10, lease_s=60)
    assert (claimed.id, claimed.attempts, secrets) == (in_flight, 1, [SECRET])
    waiting = first.submit(url, "a", {"n": 1}, SECRET)
    first.close()

    second = fixed_clock_outbox(path)
    assert {x.id for x in second.deliveries("pending")} == {waiting, in_flight}
    with dispatcher(second) as d:
        assert d.run_once(T0) == 1                # the claimed one waits out its lease
        assert d.run_once(T0 + 61) == 1           # then it is sent again
    assert {x.id: (x.state, x.attempts) for x in second.deliveries()} == {
        waiting: ("delivered", 1), in_flight: ("delivered", 2)}
    assert sorted(r["id"] for r in receiver.received) == sorted([waiting, in_flight])
    mode = sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    second.close()


def test_idempotency_key(outbox: WebhookOutbox, url: str) -> None:
    a = outbox.submit(url, "task.completed", {"task": "t1"}, SECRET, idempotency_key="t1:done")
    b = outbox.submit(url, "task.completed", {"task": "t1"}, SECRET, idempotency_key="t1:done")
    assert a == b and len(outbox.deliveries()) == 1
    with pytest.raises(ConflictError) as info:
        outbox.submit(url, "task.completed", {"task": "t2"}, SECRET, idempotency_key="t1:done")
    assert error_for(info.value)[0] == 409
    c = outbox.submit(url, "task.completed", {"task": "t1"}, SECRET)
    assert c != a and len(outbox.deliveries()) == 2


# ---- bad input: refused, nothing stored ------------------------------------------------------


SSRF_URLS = [
    "file:///etc/passwd",
    "http://169.254.169.254/latest/meta-data",
    "http://[::1]/",
    "http://0x7f000001/",
    "http://2130706433/",
    "http://user:pw@example.com/",
    "gopher://x",
    "http://localhost:8080/hook",
    "http://10.0.0.5/hook",
    "http://[fe80::1]/hook",
]


@pytest.mark.parametrize("bad", SSRF_URLS)
def test_ssrf_urls_are_refused_with_a_400_and_nothing_is_stored(tmp_path: Path,
                                                                 bad: str) -> None:
    box = WebhookOutbox(tmp_path / "w.db")          # the default config: public targets only
    with pytest.raises(UnsafeURLError) as info:
        box.submit(bad, "x", {"a": 1}, SECRET, idempotency_key="k")
    status, body = error_for(info.value)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"] and body["error"]["param"] == "url"
    assert box.deliveries() == [] and box.next_due_at() is None
    box.close()


def test_the_default_config_refuses_the_loopback_receiver(tmp_path: Path, url: str) -> None:
    box = WebhookOutbox(tmp_path / "w.db")
    assert WebhookConfig().allow_private_targets is False
    with pytest.raises(UnsafeURLError, match="loopback"):
        box.submit(url, "x", {}, SECRET)
    assert box.deliveries() == []
    box.close()


def test_allowing_private_targets_never_allows_metadata(outbox: WebhookOutbox) -> None:
    assert outbox.config.allow_private_targets
    for bad in ("http://169.254.169.254/latest/meta-data", "http://[fe80::1]/",
                "http://[::ffff:169.254.169.254]/"):
        with pytest.raises(UnsafeURLError):
            outbox.submit(bad, "x", {}, SECRET)
    assert outbox.deliveries() == []


def test_a_target_refused_at_send_time_is_dead_without_a_request(
        outbox: WebhookOutbox, receiver: Receiver, url: str) -> None:
    did = outbox.submit(url, "x", {}, SECRET)     # stored while private targets were allowed
    strict = config(allow_private_targets=False)
    with dispatcher(outbox, strict) as d:
        d.run_once(T0)
    got = outbox.get(did)
    assert got.state == "dead" and "refused" in (got.last_error or "")
    assert receiver.received == []


def test_other_bad_input_is_refused_before_storing(outbox: WebhookOutbox, url: str) -> None:
    small = fixed_clock_outbox(outbox.path, config(max_body_bytes=100))
    with pytest.raises(PayloadTooLargeError) as info:
        small.submit(url, "x", {"blob": "y" * 200}, SECRET)
    assert error_for(info.value)[0] == 413
    with pytest.raises(ConfigError):
        outbox.submit(url, "x", {}, "not-a-secret!")
    with pytest.raises(ConfigError):
        outbox.submit(url, "x", {}, [])
    with pytest.raises(RidgelineError, match="event_type"):
        outbox.submit(url, "", {}, SECRET)
    with pytest.raises(RidgelineError, match="JSON"):
        outbox.submit(url, "x", {"f": object()}, SECRET)
    with pytest.raises(RidgelineError, match="JSON"):
        outbox.submit(url, "x", {"nan": float("nan")}, SECRET)
    assert outbox.deliveries() == [] and small.deliveries() == []
    small.close()


# ---- the background thread, threads and two dispatchers -------------------------------------


def wait_for(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_the_background_thread_wakes_on_submit_and_retries_on_time(
        tmp_path: Path, receiver: Receiver, url: str) -> None:
    # A poll interval far longer than the test: only the wake-up on submit, and the timer
    # set for the next due retry, can deliver in time.
    box = WebhookOutbox(tmp_path / "bg.db", config(poll_interval_s=3600, base_delay_s=0.05))
    receiver.plan = [500]
    with WebhookDispatcher(box) as d:
        d.start()
        assert d.running
        did = box.submit(url, "x", {"n": 1}, SECRET)
        assert wait_for(lambda: box.get(did).state == "delivered")
        d.stop()
        assert not d.running
    assert received_ids(receiver) == [did, did]
    box.close()


def test_concurrent_submits_are_each_delivered_once(tmp_path: Path, receiver: Receiver,
                                                   url: str) -> None:
    box = WebhookOutbox(tmp_path / "mt.db", config(poll_interval_s=3600, concurrency=4))
    ids: list[str] = []
    lock = threading.Lock()

    def producer(k: int) -> None:
        for i in range(8):
            did = box.submit(url, "x", {"producer": k, "i": i}, SECRET)
            with lock:
                ids.append(did)

    with WebhookDispatcher(box) as d:
        d.start()
        threads = [threading.Thread(target=producer, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert wait_for(lambda: len(box.deliveries("delivered", limit=100)) == 32)
    assert sorted(received_ids(receiver)) == sorted(ids) and len(set(ids)) == 32
    assert box.counts() == {"pending": 0, "delivered": 32, "dead": 0}
    assert all(r["verified"] for r in receiver.received)
    box.close()


def test_two_dispatchers_on_one_file_never_send_a_delivery_twice(
        tmp_path: Path, receiver: Receiver, url: str) -> None:
    path = tmp_path / "two.db"
    small_batches = config(batch_size=3)    # many claims each, interleaved
    a, b = fixed_clock_outbox(path, small_batches), fixed_clock_outbox(path, small_batches)
    ids = [a.submit(url, "x", {"i": i}, SECRET) for i in range(24)]
    sent: dict[str, int] = {}

    def drain(name: str, d: WebhookDispatcher) -> None:
        total = 0
        while (n := d.run_once(T0)) > 0:
            total += n
        sent[name] = total

    with dispatcher(a) as da, dispatcher(b) as db:
        threads = [threading.Thread(target=drain, args=(n, d)) for n, d in (("a", da), ("b", db))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sum(sent.values()) == 24
    assert sorted(received_ids(receiver)) == sorted(ids)      # each exactly once
    assert {x.state for x in a.deliveries(limit=100)} == {"delivered"}
    a.close()
    b.close()


# ---- the same persistence on SQLite and on PostgreSQL ---------------------------------------

postgres_server = postgres_server_fixture()


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where the test's outbox lives: a new SQLite file, or a new database on the session's
    PostgreSQL server (started on loopback by the tests)."""
    if request.param == "postgresql":
        return request.getfixturevalue("postgres_server").new_database()
    return str(tmp_path / "hooks.db")


def test_pending_deliveries_survive_a_restart_on_each_backend(
        database: str, receiver: Receiver, url: str) -> None:
    first = fixed_clock_outbox(database)  # type: ignore[arg-type]
    in_flight = first.submit(url, "b", {"n": 2}, SECRET)
    (claimed, secrets), = first.claim_due(T0, 10, lease_s=60)   # dies while sending it
    assert (claimed.id, claimed.attempts, secrets) == (in_flight, 1, [SECRET])
    waiting = first.submit(url, "a", {"n": 1}, SECRET)
    first.close()

    second = fixed_clock_outbox(database)  # type: ignore[arg-type]
    assert {x.id for x in second.deliveries("pending")} == {waiting, in_flight}
    with dispatcher(second) as d:
        assert d.run_once(T0) == 1                # the claimed one waits out its lease
        assert d.run_once(T0 + 61) == 1           # then it is sent again
    assert {x.id: (x.state, x.attempts) for x in second.deliveries()} == {
        waiting: ("delivered", 1), in_flight: ("delivered", 2)}
    assert sorted(r["id"] for r in receiver.received) == sorted([waiting, in_flight])
    assert second.counts() == {"pending": 0, "delivered": 2, "dead": 0}
    second.close()


def test_ties_in_time_go_by_insertion_order_on_each_backend(database: str, url: str) -> None:
    box = fixed_clock_outbox(database)  # type: ignore[arg-type]   # every one at T0
    ids = [box.submit(url, "x", {"i": i}, SECRET) for i in range(6)]
    assert [d.id for d in box.due(T0)] == ids                   # oldest first
    assert [d.id for d in box.deliveries()] == ids[::-1]        # newest first
    assert [d.id for d, _ in box.claim_due(T0, 4, lease_s=60)] == ids[:4]
    assert box.next_due_at() == T0 and [d.id for d in box.due(T0)] == ids[4:]
    box.close()


def test_idempotency_key_on_each_backend(database: str, url: str) -> None:
    boxes = [fixed_clock_outbox(database) for _ in range(2)]  # type: ignore[arg-type]
    got: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def submit(i: int) -> None:
        barrier.wait()
        did = boxes[i % 2].submit(url, "task.completed", {"task": "t1"}, SECRET,
                                  idempotency_key="t1:done")
        with lock:
            got.append(did)

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 1       # eight racing submits, one delivery
    assert len(boxes[0].deliveries()) == 1
    with pytest.raises(ConflictError):
        boxes[1].submit(url, "task.completed", {"task": "t2"}, SECRET,
                        idempotency_key="t1:done")
    assert boxes[1].requeue(got[0], now=T0 + 1).next_attempt_at == T0 + 1
    with pytest.raises(NotFoundError):
        boxes[1].requeue("msg_nope")
    for box in boxes:
        box.close()


def test_two_dispatchers_never_send_a_delivery_twice_on_each_backend(
        database: str, receiver: Receiver, url: str) -> None:
    small_batches = config(batch_size=3)    # many claims each, interleaved
    a = fixed_clock_outbox(database, small_batches)  # type: ignore[arg-type]
    b = fixed_clock_outbox(database, small_batches)  # type: ignore[arg-type]
    ids = [a.submit(url, "x", {"i": i}, SECRET) for i in range(24)]
    sent: dict[str, int] = {}

    def drain(name: str, d: WebhookDispatcher) -> None:
        total = 0
        while (n := d.run_once(T0)) > 0:
            total += n
        sent[name] = total

    with dispatcher(a) as da, dispatcher(b) as db:
        threads = [threading.Thread(target=drain, args=(n, d)) for n, d in (("a", da), ("b", db))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sum(sent.values()) == 24
    assert sorted(received_ids(receiver)) == sorted(ids)      # each exactly once
    assert {x.state for x in b.deliveries(limit=100)} == {"delivered"}
    a.close()
    b.close()


def test_a_receivers_nul_byte_is_kept_in_the_last_error(database: str, url: str) -> None:
    box = fixed_clock_outbox(database)  # type: ignore[arg-type]
    did = box.submit(url, "x", {}, SECRET)
    box.mark_retry(did, 500, "HTTP 500: bad\x00body", T0, T0 + 5)
    got = box.get(did)
    assert (got.state, got.last_status, got.next_attempt_at) == ("pending", 500, T0 + 5)
    assert got.last_error is not None and got.last_error.startswith("HTTP 500: bad")
    box.close()
