"""The per-key limiter: rpm and tpm token buckets (on a clock the tests move), the
estimate-then-settle token accounting, concurrency slots, all-or-nothing admission, and
no over-admission from many threads or tasks at once."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ridgeline.errors import RateLimitError
from ridgeline.platform.limits import KeyLimits, KeyRateLimitError, RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def refused(limiter: RateLimiter, limits: KeyLimits, tokens: int = 0,
            key: str = "k") -> KeyRateLimitError:
    with pytest.raises(KeyRateLimitError) as info:
        limiter.admit(key, limits, tokens)
    assert isinstance(info.value, RateLimitError) and info.value.http_status == 429
    return info.value


def test_rpm_bucket_refuses_then_refills() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    limits = KeyLimits(rpm=3)
    for _ in range(3):  # a minute's allowance at once
        limiter.admit("k", limits).release()
    err = refused(limiter, limits)
    assert err.limit == "rpm" and err.retry_after_s == pytest.approx(20.0)  # 60 s / 3
    assert "3 requests per minute" in err.message
    clock.now += 19.0
    assert refused(limiter, limits).retry_after_s == pytest.approx(1.0)
    clock.now += 1.0
    limiter.admit("k", limits).release()
    refused(limiter, limits)
    limiter.admit("other key", limits).release()  # keys do not share buckets


def test_tpm_charges_the_estimate_and_settles_to_the_real_usage() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    limits = KeyLimits(tpm=1000)
    first = limiter.admit("k", limits, tokens=600)
    assert first.charged_tokens == 600
    err = refused(limiter, limits, tokens=600)         # 400 left
    assert err.limit == "tpm" and err.retry_after_s == pytest.approx(200 / (1000 / 60))
    first.settle(100)                                   # used 100: 500 come back
    first.settle(999)                                   # settles once
    second = limiter.admit("k", limits, tokens=600)     # 900 >= 600
    second.settle(None)                                 # unknown usage: the estimate stays
    refused(limiter, limits, tokens=600)                # 300 left
    limiter.admit("k", limits, tokens=300)


def test_usage_over_the_estimate_leaves_a_debt_that_refill_repays() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    limits = KeyLimits(tpm=600)                         # 10 tokens per second
    limiter.admit("k", limits, tokens=100).settle(1200)  # 600 over the bucket
    err = refused(limiter, limits, tokens=1)
    assert err.retry_after_s == pytest.approx(60.1)     # 601 tokens at 10/s
    clock.now += 61
    limiter.admit("k", limits, tokens=1)


def test_a_charge_is_capped_at_the_bucket() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    limits = KeyLimits(tpm=1000)
    big = limiter.admit("k", limits, tokens=50_000)     # admitted with a full bucket
    assert big.charged_tokens == 1000
    refused(limiter, limits, tokens=1)
    big.settle(10)                                      # it used 10
    limiter.admit("k", limits, tokens=990)


def test_concurrency_slots() -> None:
    limiter = RateLimiter(Clock())
    limits = KeyLimits(max_concurrency=2)
    a = limiter.admit("k", limits)
    with limiter.admit("k", limits):
        assert limiter.in_flight("k") == 2
        err = refused(limiter, limits)
        assert err.limit == "concurrency" and err.retry_after_s is not None
    assert limiter.in_flight("k") == 1
    a.release()
    a.release()  # idempotent: never frees a slot it does not hold
    assert limiter.in_flight("k") == 0
    b, c = limiter.admit("k", limits), limiter.admit("k", limits)
    refused(limiter, limits)
    b.release()
    c.release()


def test_a_refusal_takes_nothing() -> None:
    limiter = RateLimiter(Clock())
    limits = KeyLimits(rpm=2, tpm=100, max_concurrency=5)
    limiter.admit("k", limits, tokens=100).release()
    refused(limiter, limits, tokens=50)   # tpm refuses: the rpm and slot it checked stay
    assert limiter.in_flight("k") == 0
    limiter.admit("k", limits, tokens=0).release()  # the second request of the minute
    assert refused(limiter, limits).limit == "rpm"


def test_new_limits_apply_to_the_next_request() -> None:
    limiter = RateLimiter(Clock())
    for _ in range(2):
        limiter.admit("k", KeyLimits(rpm=2)).release()
    refused(limiter, KeyLimits(rpm=2))
    limiter.admit("k", KeyLimits(rpm=5)).release()     # raised: a fresh bucket
    limiter.admit("k", KeyLimits()).release()          # unlimited


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rpm"):
        KeyLimits(rpm=0)
    with pytest.raises(ValueError, match="max_concurrency"):
        KeyLimits(max_concurrency=-1)


def test_threads_never_over_admit() -> None:
    limiter = RateLimiter(Clock())  # a frozen clock: no refill during the test
    limits = KeyLimits(rpm=500, max_concurrency=3)
    admitted = []
    peak = [0]
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(200):
            try:
                admission = limiter.admit("k", limits)
            except KeyRateLimitError:
                continue
            with lock:
                admitted.append(1)
                peak[0] = max(peak[0], limiter.in_flight("k"))
            admission.release()

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 500          # exactly the minute's allowance of 1600 attempts
    assert peak[0] <= 3
    assert limiter.in_flight("k") == 0


def test_asyncio_tasks_share_the_concurrency_limit() -> None:
    limiter = RateLimiter(Clock())
    limits = KeyLimits(max_concurrency=3)
    running = 0
    peak = 0
    outcomes: list[str] = []

    async def request() -> None:
        nonlocal running, peak
        try:
            admission = limiter.admit("k", limits)
        except KeyRateLimitError as e:
            outcomes.append(e.limit)
            return
        with admission:
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.01)
            running -= 1
        outcomes.append("ok")

    async def main() -> None:
        await asyncio.gather(*(request() for _ in range(10)))
        await asyncio.gather(*(request() for _ in range(2)))  # after: slots are free

    asyncio.run(main())
    assert peak == 3
    assert outcomes.count("ok") == 5 and outcomes.count("concurrency") == 7
    assert limiter.in_flight("k") == 0
