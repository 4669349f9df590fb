"""Per-key request quotas: requests per minute, tokens per minute and requests in flight.

    limiter = RateLimiter()
    admission = limiter.admit(key_id, KeyLimits(rpm=60, tpm=10_000, max_concurrency=4),
                              tokens=estimate)          # RateLimitError (429) if over
    try:
        ...                                             # the request
        admission.settle(used_tokens)                   # the real usage replaces the estimate
    finally:
        admission.release()                             # frees the concurrency slot

rpm and tpm are token buckets that hold a minute's allowance and refill continuously, so
a key may burst up to its whole minute and then runs at the steady rate. Tokens are not
known until the upstream answers, so admission charges an estimate (the prompt's
estimate plus `max_tokens`) and `settle` corrects the bucket by the difference: a reply
longer than charged leaves the bucket in debt, which later requests wait out; a shorter
one gives the rest back. One charge is capped at the bucket's capacity, so a request
larger than a minute's tokens is admitted once the bucket is full rather than never.

In-process only (each gateway replica enforces its own share). Every operation is O(1)
under one `threading.Lock` and never awaits inside it, so the limiter is safe from the
event loop and from threads alike.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ridgeline.errors import RateLimitError


@dataclass(frozen=True)
class KeyLimits:
    """A key's quotas; None means unlimited."""

    rpm: int | None = None               # requests per minute
    tpm: int | None = None               # prompt + completion tokens per minute
    max_concurrency: int | None = None   # requests in flight at once

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm", "max_concurrency"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 or None (unlimited), not {value}")


class KeyRateLimitError(RateLimitError):
    """A key's own quota is used up; `limit` says which one (rpm, tpm, concurrency)."""

    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, limit: str, retry_after_s: float | None,
                 hint: str | None = None) -> None:
        super().__init__(message, retry_after_s=retry_after_s, hint=hint)
        self.limit = limit


class _Bucket:
    """`capacity` units refilling at `capacity` per minute. `level` may go below zero
    (a request that used more than it was charged): that debt is repaid by refill."""

    __slots__ = ("capacity", "rate", "level", "updated")

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        self.rate = capacity / 60.0
        self.level = float(capacity)
        self.updated = now

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` is available (0 if it is now)."""
        return max(0.0, (amount - self.level) / self.rate)


class _KeyState:
    __slots__ = ("requests", "tokens", "in_flight")

    def __init__(self) -> None:
        self.requests: _Bucket | None = None
        self.tokens: _Bucket | None = None
        self.in_flight = 0


class Admission:
    """One admitted request's hold on its key's quotas: `settle` once with the tokens it
    really used, `release` once when it is over (both idempotent)."""

    __slots__ = ("key_id", "charged_tokens", "_limiter", "_settled", "_released")

    def __init__(self, limiter: RateLimiter, key_id: str, charged_tokens: int) -> None:
        self.key_id = key_id
        self.charged_tokens = charged_tokens
        self._limiter = limiter
        self._settled = False
        self._released = False

    def settle(self, used_tokens: int | None) -> None:
        """Replace the estimate charged at admission by `used_tokens` (None: keep it)."""
        if self._settled:
            return
        self._settled = True
        if used_tokens is not None:
            self._limiter._adjust_tokens(self.key_id, used_tokens - self.charged_tokens)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._limiter._release(self.key_id)

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class RateLimiter:
    """rpm, tpm and concurrency per key id, with the limits passed on each `admit` (so a
    key's new limits apply from its next request)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: dict[str, _KeyState] = {}

    def admit(self, key_id: str, limits: KeyLimits, tokens: int = 0) -> Admission:
        """Take one request, `tokens` estimated tokens and a concurrency slot from the
        key's quotas, or none of them and raise `KeyRateLimitError` with `retry_after_s`."""
        with self._lock:
            now = self._clock()
            state = self._keys.get(key_id)
            if state is None:
                state = self._keys[key_id] = _KeyState()
            if limits.max_concurrency is not None and state.in_flight >= limits.max_concurrency:
                raise KeyRateLimitError(
                    f"API key {key_id} already has {state.in_flight} requests in flight, its "
                    f"limit of {limits.max_concurrency}", limit="concurrency", retry_after_s=1.0,
                    hint="wait for a request to finish, or ask for a higher max_concurrency")
            requests = _bucket(state, "requests", limits.rpm, now)
            if requests is not None and requests.level < 1:
                raise KeyRateLimitError(
                    f"API key {key_id} reached its limit of {limits.rpm} requests per minute",
                    limit="rpm", retry_after_s=requests.wait_s(1),
                    hint="retry after the time in the Retry-After header")
            charge = tokens
            budget = _bucket(state, "tokens", limits.tpm, now)
            if budget is not None:
                charge = min(tokens, budget.capacity)
                if budget.level < charge:
                    raise KeyRateLimitError(
                        f"API key {key_id} reached its limit of {limits.tpm} tokens per minute "
                        f"(this request is estimated at {tokens} tokens: prompt plus max_tokens)",
                        limit="tpm", retry_after_s=budget.wait_s(charge),
                        hint="retry after the time in the Retry-After header, or ask for fewer "
                             "max_tokens")
            # Every check passed: take from all of them together.
            if requests is not None:
                requests.level -= 1
            if budget is not None:
                budget.level -= charge
            state.in_flight += 1
            return Admission(self, key_id, charge)

    def in_flight(self, key_id: str) -> int:
        with self._lock:
            state = self._keys.get(key_id)
            return state.in_flight if state else 0

    def _adjust_tokens(self, key_id: str, delta: int) -> None:
        with self._lock:
            state = self._keys.get(key_id)
            if state is not None and state.tokens is not None:
                state.tokens.refill(self._clock())
                state.tokens.level = min(state.tokens.capacity, state.tokens.level - delta)

    def _release(self, key_id: str) -> None:
        with self._lock:
            state = self._keys.get(key_id)
            if state is not None and state.in_flight > 0:
                state.in_flight -= 1


def _bucket(state: _KeyState, which: str, capacity: int | None, now: float) -> _Bucket | None:
    """The key's bucket for `which`, refilled to `now`; rebuilt when its limit changed."""
    if capacity is None:
        setattr(state, which, None)
        return None
    bucket: _Bucket | None = getattr(state, which)
    if bucket is None or bucket.capacity != capacity:
        bucket = _Bucket(capacity, now)
        setattr(state, which, bucket)
    else:
        bucket.refill(now)
    return bucket


def retry_after_header(seconds: float) -> str:
    """Retry-After in whole seconds, rounded up (a client that waits that long gets in)."""
    return str(max(1, math.ceil(seconds)))


__all__ = ["Admission", "KeyLimits", "KeyRateLimitError", "RateLimiter", "retry_after_header"]
