"""Quotas and usage per API key. `UsageMeter.admit` takes one request, the estimated
tokens and a concurrency slot from the key's rpm, tpm and concurrency
(`ridgeline.platform.limits`; `KeyRateLimitError`, a 429, over one); `account` settles
that estimate with the tokens the call used and counts them in the key's usage rows
(`KeyStore.record_usage`, written in batches). `admit_task` admits an agent task (a
graph's node) against the same rpm and concurrency.

The gateway's own requests and the model calls of agent tasks
(`ridgeline.platform.worker.MeteredModel`) go through the same meter, so a task spends its
key's quotas. `_usage_of` and `_int` read an upstream's `usage` (`normalise_usage`: the
Responses and Messages APIs name it differently). Split out of
`ridgeline.platform.gateway`, which describes the whole design.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from ridgeline.platform.keys import KeyStore
from ridgeline.platform.limits import Admission, KeyLimits, KeyRateLimitError, RateLimiter
from ridgeline.platform.principal import Principal


class UsageMeter:
    """A key's quotas before a call and its usage after; without a keystore, the default
    limits and no usage rows. `Gateway` is one."""

    def __init__(self, keystore: KeyStore | None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.keystore = keystore
        self.limiter = RateLimiter(clock)

    # -- accounting -----------------------------------------------------------------------------
    def admit(self, principal: Principal, tokens: int) -> Admission:
        """Take one request, `tokens` estimated tokens and a concurrency slot from the key's
        quotas (`KeyRateLimitError` if over one); the caller `account`s and releases it."""
        limits = self.keystore.limits(principal.key_id) if self.keystore else KeyLimits()
        return self.limiter.admit(principal.key_id, limits, tokens)

    def admit_task(self, principal: Principal, live_tasks: int = 0) -> None:
        """May the key start one more agent task (a graph's node) now: one request of its
        rpm, and fewer than its `max_concurrency` live tasks (`live_tasks`: of the graph)."""
        limits = self.keystore.limits(principal.key_id) if self.keystore else KeyLimits()
        if limits.max_concurrency is not None and live_tasks >= limits.max_concurrency:
            raise KeyRateLimitError(
                f"API key {principal.key_id} has {live_tasks} tasks of this graph running, "
                f"its limit of {limits.max_concurrency}", limit="concurrency",
                retry_after_s=1.0, hint="the next node starts when one finishes")
        self.limiter.admit(principal.key_id, limits).release()

    def account(self, principal: Principal, model: str, admission: Admission, *,
                prompt_tokens: int, completion_tokens: int, error: bool = False) -> None:
        """Settle an admitted call with the tokens it used and count it in the key's usage."""
        self._account(principal, model, {"prompt_tokens": prompt_tokens,
                                         "completion_tokens": completion_tokens},
                      error=error, admission=admission)

    def _account(self, principal: Principal, model: str, usage: dict[str, Any] | None, *,
                 error: bool, admission: Admission, keep_estimate: bool = False) -> None:
        prompt = _int(usage, "prompt_tokens")
        completion = _int(usage, "completion_tokens")
        if usage is not None:
            admission.settle(prompt + completion)
        elif not keep_estimate:
            admission.settle(0)  # nothing was generated
        if self.keystore is not None:
            self.keystore.record_usage(principal, model, prompt_tokens=prompt,
                                       completion_tokens=completion, error=error)


def _usage_of(content: bytes) -> dict[str, Any] | None:
    try:
        usage = json.loads(content).get("usage")
    except (ValueError, AttributeError):
        return None
    return normalise_usage(usage) if isinstance(usage, dict) else None


def normalise_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """`usage` in chat's terms (`prompt_tokens`, `completion_tokens`). The Responses API
    says `input_tokens` / `output_tokens`; Anthropic's too, with the prompt tokens read
    from or written to its cache counted apart, which are prompt tokens all the same."""
    if "prompt_tokens" in usage or "input_tokens" not in usage and "output_tokens" not in usage:
        return usage
    prompt = sum(_int(usage, k) for k in ("input_tokens", "cache_read_input_tokens",
                                          "cache_creation_input_tokens"))
    return {"prompt_tokens": prompt, "completion_tokens": _int(usage, "output_tokens")}


def _int(usage: dict[str, Any] | None, key: str) -> int:
    value = usage.get(key) if usage else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
