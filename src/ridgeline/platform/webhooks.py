"""Webhooks: results pushed to a URL the user registered, signed per Standard Webhooks
(https://www.standardwebhooks.com; any receiver using the `standardwebhooks` library
verifies them), retried with exponential backoff and full jitter, dead-lettered after
`max_attempts`.

`WebhookOutbox` is the durable part: a table `webhook_deliveries` (`ridgeline.platform.db`:
a SQLite file in WAL mode on one machine, or PostgreSQL shared by many) holding each
delivery's URL, signed body, secret and state (pending -> delivered | dead). `submit`
checks the URL against SSRF (`ridgeline.platform.urls`) and the body's size before
anything is stored.
`WebhookDispatcher` sends what is due: `run_once` for a caller's own loop, `start`/`stop`
for a background loop woken by each submit, by each finished attempt and by a timer.

One slow receiver must not hold up the others (they belong to other tenants). Every
attempt has one total deadline, `timeout_s`, over the DNS lookup, the connection, sending
the body and the response (a receiver trickling a byte at a time is cut off at the
deadline, not kept alive by each byte), and reads at most `max_response_bytes` of the
response. Attempts run as independent tasks on the dispatcher's own event loop: the
background loop claims a due delivery whenever a slot is free and records each outcome as
it comes, with no batch to wait for. At most `concurrency` attempts are in flight, at most
`max_per_target` to one origin and at most `max_per_owner` for one owner (the tenant a
platform task belongs to), so a tenant with many slow targets fills only its own share of
the slots; deliveries of full targets and owners are skipped by the claim, not queued
behind them. A DNS lookup cannot be interrupted: an attempt that times out during one
keeps its slot until the lookup thread returns, so abandoned lookups stay within the same
caps. The caps are per dispatcher (per process).

Delivery is at least once: the webhook id (`webhook-id`, also the delivery id) is the same
on every attempt, so receivers dedupe on it. A dispatcher *claims* what it sends by moving
its next attempt a lease into the future, with an update conditional on the delivery still
being due, so two dispatchers on one database do not send the same delivery at once, and
one that dies mid-send leaves it to be sent again.

Outcomes: 2xx delivered; 4xx other than 408/409/425/429 permanent (dead at once); other
statuses, timeouts and connection errors retried after a delay drawn uniformly from
[0, min(max_delay_s, base_delay_s * 2**(attempt-1))], or after Retry-After when that is
longer (up to max_delay_s). A URL refused when it is sent (its name now resolves to an
internal address) is dead at once. Redirects are not followed (a redirect is an error).

The body is `{"type", "timestamp", "data"}`, fixed at submit, so every attempt sends the
same bytes (for agent tasks `data` is `task_webhook_data`: a bounded summary with links to
the full task, never the request itself); the signature's `webhook-timestamp` is the
wall-clock time of each attempt (receivers reject old ones), while scheduling uses the
dispatcher's clock, which tests replace. Secrets are stored in the table (signing needs
them): protect the database as such.

Layout: `webhook_signing` (secrets, signatures, `verify`), `webhook_outbox` (the table
and its records: `WebhookConfig`, `Delivery`, `InFlight`, `WebhookOutbox`) and
`webhook_dispatcher` (`WebhookDispatcher`, `Attempt`, `retry_after_seconds`), each
importing only those before it. This module holds what a platform task's webhook says
(`task_webhook_data`) and re-exports the names of all three, so imports from
`ridgeline.platform.webhooks` keep working.
"""

from __future__ import annotations

import json
from typing import Any

from ridgeline.platform.store import TaskRecord
from ridgeline.platform.webhook_dispatcher import (
    RETRYABLE_4XX, Attempt, WebhookDispatcher, retry_after_seconds,
)
from ridgeline.platform.webhook_outbox import (
    STATES, Delivery, DeliveryState, InFlight, PreparedDelivery, WebhookConfig, WebhookOutbox,
    delivery_target,
)
from ridgeline.platform.webhook_signing import (
    SECRET_PREFIX, WebhookSignatureError, new_secret, secret_key, sign, signature_header,
    signed_headers, verify,
)

__all__ = [
    "ERROR_CHARS", "METADATA_BYTES", "RETRYABLE_4XX", "SECRET_PREFIX", "STATES",
    "SUMMARY_CHARS", "Attempt", "Delivery", "DeliveryState", "InFlight", "PreparedDelivery",
    "WebhookConfig", "WebhookDispatcher", "WebhookOutbox", "WebhookSignatureError",
    "delivery_target", "new_secret", "retry_after_seconds", "secret_key", "sign",
    "signature_header", "signed_headers", "task_webhook_data", "verify",
]


# ---- what a task's webhook says --------------------------------------------------------------

#: Bounds of the free text a task webhook carries (characters), and of its metadata
#: (bytes of JSON); what is cut is fetched through the links.
SUMMARY_CHARS = 4000
ERROR_CHARS = 2000
METADATA_BYTES = 4096
_RESULT_SCALARS = ("exit_status", "steps", "wall_s", "workspace_bytes")


def _clip(text: str, limit: int) -> tuple[str, bool]:
    return (text, False) if len(text) <= limit else (text[:limit], True)


def task_webhook_data(task: TaskRecord, public_url: str | None = None) -> dict[str, Any]:
    """The `data` of a task's webhook: its id, status and a summary of its result,
    bounded whatever the task's size, and links to fetch the rest with an API key. Never
    the request (its files and instruction can be megabytes, over `max_body_bytes`)."""
    truncated = False
    result = task.result if isinstance(task.result, dict) else {}
    summary: dict[str, Any] = {}
    for key in _RESULT_SCALARS:
        value = result.get(key)
        if isinstance(value, (bool, int, float)):
            summary[key] = value
        elif isinstance(value, str):
            summary[key], cut = _clip(value, 200)
            truncated |= cut
    usage = result.get("usage")
    if isinstance(usage, dict):
        summary["usage"] = {k: v for k, v in usage.items() if k in ("prompt_tokens",
                            "completion_tokens") and isinstance(v, (int, float))}
    if isinstance(result.get("summary"), str):
        summary["summary"], cut = _clip(result["summary"], SUMMARY_CHARS)
        truncated |= cut
    nodes = result.get("nodes")
    if isinstance(nodes, dict):   # a graph: how many nodes ended how (ids are in the task)
        statuses: dict[str, int] = {}
        for node in nodes.values():
            status = str(node.get("status")) if isinstance(node, dict) else "unknown"
            statuses[status[:40]] = statuses.get(status[:40], 0) + 1
        summary["nodes"] = dict(list(sorted(statuses.items()))[:16])
    error = None
    if task.error is not None:
        error, cut = _clip(str(task.error), ERROR_CHARS)
        truncated |= cut
    metadata = task.request.get("metadata") if isinstance(task.request, dict) else None
    if metadata and len(json.dumps(metadata).encode()) > METADATA_BYTES:
        metadata, truncated = None, True
    path = f"{(public_url or '').rstrip('/')}/v1/agent/tasks/{task.id}"
    return {"id": task.id, "object": "agent.task", "kind": task.kind,
            "status": task.status.value, "created_at": task.created_at,
            "updated_at": task.updated_at, "attempts": task.attempts,
            "parent_id": task.parent_id, "error": error, "result": summary or None,
            "metadata": metadata or {}, "truncated": truncated,
            "links": {"task": path, "events": path + "/events",
                      "workspace": path + "/workspace"}}
