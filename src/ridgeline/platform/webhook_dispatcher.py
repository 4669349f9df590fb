"""The sending half of webhooks: `WebhookDispatcher` claims due deliveries from a
`WebhookOutbox` and POSTs them, signed (`ridgeline.platform.webhook_signing`), on an event
loop thread of its own. Each attempt has one total deadline (DNS included) and a bounded
read of the response, and runs within the caps (`concurrency`, `max_per_target` per
origin, `max_per_owner` per tenant), so one slow receiver or tenant cannot hold up the
others. Every attempt re-checks the URL and connects only to addresses it checked
(`ridgeline.platform.urls`: SSRF, DNS rebinding).

Each answer becomes an `Attempt` (delivered, retry or permanent); retries wait for
exponential backoff with full jitter or for Retry-After (`retry_after_seconds`), and a
delivery is dead after `max_attempts`. The isolation and at-least-once argument is set out
in `ridgeline.platform.webhooks`, which re-exports these names.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import email.utils
import functools
import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timezone
from typing import Any, Literal

import httpx

from ridgeline.platform.urls import UnsafeURLError, check_outbound_url, safe_async_client
from ridgeline.platform.webhook_outbox import (
    Delivery, InFlight, WebhookConfig, WebhookOutbox, delivery_target,
)
from ridgeline.platform.webhook_signing import signed_headers

# the logger's name from before the split, so logging configured for it keeps applying
log = logging.getLogger("ridgeline.platform.webhooks")

#: Statuses that say "not now" rather than "never": timeout, conflict, too early, rate limit.
RETRYABLE_4XX = frozenset({408, 409, 425, 429})


# ---- the dispatcher ------------------------------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    """What one POST came to."""

    outcome: Literal["delivered", "retry", "permanent"]
    status: int | None
    error: str | None
    retry_after_s: float | None = None


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """Seconds a Retry-After header asks for (delta-seconds or an HTTP date), or None."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


#: The lookups (resolver threads) of the attempt running in this task, so its slot is held
#: until they return even when the attempt gave up on them.
_LOOKUPS: contextvars.ContextVar[list[concurrent.futures.Future[Any]] | None] = \
    contextvars.ContextVar("webhook_lookups", default=None)


def _getaddrinfo(host: str, port: int) -> list[tuple[Any, ...]]:
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)


class WebhookDispatcher:
    """Sends due deliveries; `run_once` in a caller's loop or `start` for a background loop.

    Attempts run on the dispatcher's own event loop (a thread it starts on first use), so
    none of them blocks a caller's loop; database calls and DNS lookups run on its own
    small thread pools."""

    def __init__(self, outbox: WebhookOutbox, config: WebhookConfig | None = None,
                 client: httpx.AsyncClient | None = None, *,
                 clock: Callable[[], float] = time.time,
                 rng: random.Random | None = None) -> None:
        self.outbox = outbox
        self.config = config or outbox.config
        c = self.config
        # one lookup at most per slot (a slot is held until its lookup returns): never queued
        self._dns = ThreadPoolExecutor(c.concurrency, thread_name_prefix="webhook-dns")
        self._io = ThreadPoolExecutor(4, thread_name_prefix="webhook-db")
        # The default client connects only to addresses it checked (DNS rebinding); a
        # client passed in is trusted to do the same.
        self._client = client or safe_async_client(
            allow_private=c.allow_private_targets, timeout=c.timeout_s, resolver=self._resolve,
            limits=httpx.Limits(max_connections=max(100, 2 * c.concurrency),
                                max_keepalive_connections=c.concurrency))
        self._owns_client = client is None
        self._clock = clock
        self._rng = rng or random.Random()
        self._rng_lock = threading.Lock()
        self._lock = threading.Lock()          # the in-flight counts
        self._claim_lock = threading.Lock()    # one claim at a time: counts and claims agree
        self._in_flight = InFlight(c.concurrency, c.max_per_target, c.max_per_owner)
        self._start_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._wake: asyncio.Event | None = None
        self._serving: concurrent.futures.Future[None] | None = None
        self._stop = threading.Event()

    # -- the event loop --

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._start_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="webhook-dispatcher",
                                          daemon=True)
                thread.start()
                self._loop, self._loop_thread = loop, thread
            return self._loop

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._ensure_loop()).result()

    async def _in_io(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(
            self._io, functools.partial(fn, *args))

    async def _resolve(self, host: str, port: int) -> list[tuple[Any, ...]]:
        """The client's host lookup: on the dispatcher's DNS threads, recorded against the
        running attempt (see `_LOOKUPS`)."""
        future = self._dns.submit(_getaddrinfo, host, port)
        lookups = _LOOKUPS.get()
        if lookups is not None:
            lookups.append(future)
        return await asyncio.wrap_future(future)

    def _notify(self) -> None:
        """Wake the background loop (from any thread)."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):   # the loop is closing
                loop.call_soon_threadsafe(wake.set)

    # -- one pass --

    def delay_for(self, attempt: int) -> float:
        """The wait after failed attempt number `attempt` (1-based), before Retry-After."""
        cap = min(self.config.max_delay_s,
                  self.config.base_delay_s * 2.0 ** min(attempt - 1, 60))
        if not self.config.jitter:
            return cap
        with self._rng_lock:
            return self._rng.uniform(0.0, cap)

    def run_once(self, now: float | None = None) -> int:
        """Send the deliveries due at `now` once (up to `batch_size`, within the caps) and
        wait for them; the number sent. For a caller's own loop and for tests: the
        background loop (`start`) never waits for a batch."""
        return int(self._call(self._pass(now)))

    async def _pass(self, now: float | None) -> int:
        tasks = await self._launch(now, self.config.batch_size)
        if tasks:
            await asyncio.gather(*tasks)
        return len(tasks)

    def _free_slots(self) -> int:
        with self._lock:
            return self.config.concurrency - self._in_flight.total

    async def _launch(self, now: float | None, limit: int) -> list[asyncio.Task[None]]:
        """Claim what the free slots and the caps admit, and start an attempt for each."""
        claimed = await self._in_io(self._claim, now, limit)
        loop = asyncio.get_running_loop()
        return [loop.create_task(self._run(d, secrets, now)) for d, secrets in claimed]

    def _claim(self, now: float | None, limit: int) -> list[tuple[Delivery, list[str]]]:
        with self._claim_lock:
            with self._lock:
                snapshot = self._in_flight.copy()
            limit = min(limit, snapshot.max_total - snapshot.total)
            if limit <= 0:
                return []
            at = self._clock() if now is None else now
            lease = 2 * self.config.timeout_s + 30.0
            claimed = self.outbox.claim_due(at, limit, lease, in_flight=snapshot)
            with self._lock:
                for d, _ in claimed:
                    self._in_flight.add(delivery_target(d.url), d.owner)
            return claimed

    async def _run(self, d: Delivery, secrets: list[str], now: float | None) -> None:
        lookups: list[concurrent.futures.Future[Any]] = []
        token = _LOOKUPS.set(lookups)
        try:
            result = await self._attempt(d, secrets)
            try:
                await self._in_io(self._record, d, result,
                                  self._clock() if now is None else now)
            except Exception:   # the lease runs out and the delivery is sent again
                log.exception("webhook %s: could not record the attempt", d.id)
        finally:
            _LOOKUPS.reset(token)
            pending = [f for f in lookups if not f.done()]
            if pending:   # a lookup still runs on its thread: the slot stays taken
                asyncio.get_running_loop().create_task(self._release_after(d, pending))
            else:
                self._release(d)

    async def _release_after(self, d: Delivery,
                             pending: list[concurrent.futures.Future[Any]]) -> None:
        try:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in pending),
                                 return_exceptions=True)
        finally:
            self._release(d)

    def _release(self, d: Delivery) -> None:
        with self._lock:
            self._in_flight.remove(delivery_target(d.url), d.owner)
        self._notify()

    def attempt(self, delivery: Delivery, secrets: Sequence[str]) -> Attempt:
        """POST one delivery once and classify what came back (from a thread that is not
        the dispatcher's loop)."""
        return self._call(self._attempt(delivery, list(secrets)))   # type: ignore[no-any-return]

    async def _attempt(self, delivery: Delivery, secrets: Sequence[str]) -> Attempt:
        body = delivery.body.encode()
        headers = {"content-type": "application/json",
                   "user-agent": "ridgeline-webhooks/1",
                   "accept-encoding": "identity",   # the size cap counts the bytes received
                   **signed_headers(secrets, delivery.id, int(time.time()), body)}
        timeout = self.config.timeout_s
        status: int | None = None
        retry_after: str | None = None
        excerpt = ""
        try:
            check_outbound_url(delivery.url, allow_private=self.config.allow_private_targets,
                               resolve=False)
            # the one deadline over everything, DNS included: a receiver that trickles a
            # byte at a time would keep a per-read timeout from ever firing
            async with asyncio.timeout(timeout):
                async with self._client.stream("POST", delivery.url, content=body,
                                               headers=headers, timeout=timeout) as r:
                    status, retry_after = r.status_code, r.headers.get("retry-after")
                    excerpt = await _excerpt(r, self.config.max_response_bytes)
        except UnsafeURLError as e:
            return Attempt("permanent", None, f"refused: {e}")
        except (TimeoutError, httpx.TimeoutException) as e:
            if status is None:
                return Attempt("retry", None, f"timed out after {timeout:g} s "
                               f"({type(e).__name__}; the deadline covers DNS, connect, "
                               "request and response)")
            # the status came in time and decides; the body trickled past the deadline
        except httpx.HTTPError as e:
            if status is None:
                return Attempt("retry", None, f"{type(e).__name__}: {e}")
        except Exception as e:   # a bug must not stop the other deliveries; keep it visible
            log.exception("webhook %s: unexpected error", delivery.id)
            return Attempt("retry", None, f"{type(e).__name__}: {e}")
        assert status is not None
        if 200 <= status < 300:
            return Attempt("delivered", status, None)
        error = f"HTTP {status}" + (f": {excerpt}" if excerpt else "")
        if 400 <= status < 500 and status not in RETRYABLE_4XX:
            return Attempt("permanent", status, error)
        return Attempt("retry", status, error, retry_after_seconds(retry_after))

    def _record(self, d: Delivery, result: Attempt, now: float) -> None:
        if result.outcome == "delivered":
            self.outbox.mark_delivered(d.id, result.status or 0, now)
            return
        error = result.error or "failed"
        if result.outcome == "permanent":
            self.outbox.mark_dead(d.id, result.status, error, now)
            log.warning("webhook %s to %s is dead: %s", d.id, d.url, error)
            return
        if d.attempts >= self.config.max_attempts:
            self.outbox.mark_dead(d.id, result.status,
                                  f"{error} (gave up after {d.attempts} attempts)", now)
            log.warning("webhook %s to %s is dead after %d attempts: %s", d.id, d.url,
                        d.attempts, error)
            return
        delay = self.delay_for(d.attempts)
        if result.retry_after_s is not None:
            delay = max(delay, min(result.retry_after_s, self.config.max_delay_s))
        self.outbox.mark_retry(d.id, result.status, error, now, now + delay)

    # -- the background loop --

    @property
    def running(self) -> bool:
        return self._serving is not None and not self._serving.done()

    def start(self) -> None:
        if self._serving is not None:
            return
        self._stop.clear()
        loop = self._ensure_loop()
        self.outbox.add_listener(self._notify)
        ready = threading.Event()
        self._serving = asyncio.run_coroutine_threadsafe(self._serve(ready), loop)
        ready.wait(5)   # its wake-up event exists before a submit can call for it

    def stop(self, timeout: float | None = None) -> None:
        """Stop the background loop; attempts in flight finish or reach their deadline."""
        if self._serving is None:
            return
        self.outbox.remove_listener(self._notify)
        self._stop.set()
        self._notify()
        try:
            self._serving.result(timeout)
        except concurrent.futures.TimeoutError:
            log.warning("webhook dispatcher did not stop within %s s", timeout)
        except Exception:
            log.exception("webhook dispatcher loop failed")
        self._serving = None

    async def _serve(self, ready: threading.Event) -> None:
        self._wake = wake = asyncio.Event()
        ready.set()
        running: set[asyncio.Task[None]] = set()
        idle_rounds = 0
        while not self._stop.is_set():
            wake.clear()
            launched: list[asyncio.Task[None]] = []
            try:
                launched = await self._launch(None, self.config.batch_size)
            except Exception:   # e.g. the database busy for long: try again next round
                log.exception("webhook dispatcher pass failed")
            for task in launched:
                running.add(task)
                task.add_done_callback(running.discard)
            free = self._free_slots()
            if launched:
                idle_rounds = 0
                if free > 0:
                    continue   # more may be due right now
            # Sleep until the next delivery we could claim is due. What the caps hold back
            # (and everything, when the slots are full) waits for a finished attempt,
            # which wakes us; so does a submit.
            wait = self.config.poll_interval_s
            if free > 0:
                try:
                    with self._lock:
                        snapshot = self._in_flight.copy()
                    next_due = await self._in_io(
                        functools.partial(self.outbox.next_due_at, in_flight=snapshot))
                except Exception:
                    next_due = None
                if next_due is not None:
                    # due already (it became due after the claim): claim again now, but
                    # not in a tight loop should the claim keep refusing it
                    idle_rounds += 1
                    wait = min(wait, max(next_due - self._clock(),
                                         0.0 if idle_rounds <= 2 else 0.05))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), wait)
        if running:
            await asyncio.gather(*running, return_exceptions=True)

    def close(self) -> None:
        self.stop()
        loop, thread = self._loop, self._loop_thread
        if loop is not None and thread is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            if not thread.is_alive():
                loop.close()
            self._loop = self._loop_thread = None
        elif self._owns_client:
            asyncio.run(self._client.aclose())
        self._io.shutdown(wait=True)
        # a lookup stuck in the resolver cannot be interrupted; its thread ends with it
        self._dns.shutdown(wait=False, cancel_futures=True)

    async def _shutdown(self) -> None:
        me = asyncio.current_task()
        # twice: a cancelled attempt may start a task that waits for its lookup
        for _ in range(2):
            others = [t for t in asyncio.all_tasks() if t is not me]
            for t in others:
                t.cancel()
            await asyncio.gather(*others, return_exceptions=True)
        if self._owns_client:
            await self._client.aclose()

    def __enter__(self) -> WebhookDispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _excerpt(response: httpx.Response, max_bytes: int, limit: int = 300) -> str:
    """Read at most `max_bytes` of a response body (the rest is never read) and return
    its start, for the delivery's last error."""
    head = b""
    size = 0
    if max_bytes > 0:
        async for chunk in response.aiter_raw():
            if len(head) < limit:
                head += chunk[:limit - len(head)]
            size += len(chunk)
            if size >= max_bytes:
                break
    text = head.decode("utf-8", "replace").strip()
    return " ".join(text.split())
