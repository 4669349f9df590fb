"""Stored responses of `POST /v1/responses` (``store: true``, OpenAI's default): what
`GET /v1/responses/{id}` answers, what `previous_response_id` continues, and the handle
of a background response that `POST /v1/responses/{id}/cancel` stops.

The store lives in the memory of one server process: it is lost on restart and not
shared between replicas (behind the platform gateway, which remembers each response's
server, a follow-up reaches the one that holds it). It is bounded, least recently used
first out, by a count (`max_responses`) and by the approximate size of what it holds
(`max_bytes`, the JSON of each response and its conversation); when it is full, a
finished response is evicted before a running one, and an evicted running background
response is cancelled (nobody could poll it any more).
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ridgeline.wire import RequestError

#: Statuses after which a response no longer changes.
FINAL_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled"})


@dataclass
class StoredResponse:
    #: The response object as `GET /v1/responses/{id}` returns it (updated in place
    #: while a background response runs).
    body: dict[str, Any]
    #: The conversation so far as chat messages (without instructions, which a
    #: follow-up does not inherit), the reply included once it is done.
    conversation: list[dict[str, Any]] = field(default_factory=list)
    #: The task that generates a background response; cancelling it aborts the engine
    #: request.
    task: asyncio.Task[None] | None = None
    size: int = 0

    @property
    def finished(self) -> bool:
        return self.body.get("status") in FINAL_STATUSES

    def measure(self) -> None:
        self.size = len(json.dumps(self.body)) + len(json.dumps(self.conversation))


class ResponseStore:
    def __init__(self, max_responses: int = 1024, max_bytes: int = 256 * 2**20) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, stored: StoredResponse) -> None:
        response_id = stored.body["id"]
        self._drop(response_id)
        stored.measure()
        self._items[response_id] = stored
        self._bytes += stored.size
        self._evict()

    def update(self, stored: StoredResponse) -> None:
        """Re-measure a stored response that changed (a background one finishing)."""
        if self._items.get(stored.body["id"]) is stored:
            self._bytes -= stored.size
            stored.measure()
            self._bytes += stored.size
            self._evict()

    def get(self, response_id: str, param: str | None = None,
            status: int = 404) -> StoredResponse:
        """The stored response, or an error naming the id (404 for the id in a path;
        400, as OpenAI, for a `previous_response_id` in a body)."""
        stored = self._items.get(response_id)
        if stored is None:
            raise RequestError(f"no response with id {response_id[:100]!r} is stored on this "
                               "server", hint="responses are kept in memory, a bounded number "
                               "of them, and only with store: true", param=param,
                               code="response_not_found" if status == 404
                               else "previous_response_not_found", status=status)
        self._items.move_to_end(response_id)
        return stored

    def _drop(self, response_id: str) -> StoredResponse | None:
        stored = self._items.pop(response_id, None)
        if stored is not None:
            self._bytes -= stored.size
        return stored

    def _evict(self) -> None:
        while len(self._items) > 1 and (len(self._items) > self.max_responses
                                        or self._bytes > self.max_bytes):
            older = list(self._items)[:-1]  # never the one just stored
            victim = next((k for k in older if self._items[k].finished), older[0])
            stored = self._drop(victim)
            if stored is not None and stored.task is not None and not stored.task.done():
                stored.task.cancel()
