"""The agent task API: submit (202 and an id), status, list, cancel, result, and the event
stream as Server-Sent Events that resume from `Last-Event-ID`.

    POST /v1/agent/tasks                 {"instruction": ..., "files": {...}, "webhook": {...}}
    GET  /v1/agent/tasks                 this tenant's tasks, newest first
    GET  /v1/agent/tasks/{id}            status (and result once finished)
    POST /v1/agent/tasks/{id}/cancel
    GET  /v1/agent/tasks/{id}/events     SSE; `Last-Event-ID: n` (or ?after=n) resumes after n
    GET  /v1/agent/tasks/{id}/workspace  the final (or latest) workspace as tar.gz

Submission is all-or-nothing: the body is validated (size, paths, webhook URL) before
anything is stored, and the task row is written before its job is queued; a job that could
not be queued leaves the task failed with the reason, never queued and forgotten. The
`Idempotency-Key` header makes a retried POST return the task it created the first time.
"""

from __future__ import annotations

import asyncio
import json
import posixpath
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ridgeline.errors import PayloadTooLargeError, RidgelineError
from ridgeline.platform.dag import GraphRunner, TaskGraph
from ridgeline.platform.principal import Principal
from ridgeline.platform.queue import JobQueue
from ridgeline.platform.store import TaskRecord, TaskStatus, TaskStore
from ridgeline.platform.worker import AGENT_TASK
from ridgeline.serve.protocol import RequestError

MAX_FILES_BYTES = 8 << 20
MAX_INSTRUCTION_CHARS = 100_000


class WebhookSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str
    secret: str | None = Field(None, description="whsec_... (Standard Webhooks); one is "
                               "generated and returned once when absent")


class AgentTaskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    instruction: str = Field(min_length=1, max_length=MAX_INSTRUCTION_CHARS)
    model: str = Field("default", min_length=1, max_length=200)
    files: dict[str, str] = Field(default_factory=dict,
                                  description="workspace files to start with: path -> text")
    tools: list[str] = Field(default_factory=list, description="registry tools the agent may "
                             "use besides the sandbox's bash and file tools")
    max_steps: int = Field(30, ge=1, le=500)
    time_limit_s: float = Field(900.0, gt=0, le=24 * 3600)
    webhook: WebhookSpec | None = None
    metadata: dict[str, str] = Field(default_factory=dict, max_length=32)
    replay: list[str] | None = Field(None, description="replies for model 'replay' "
                                     "(load tests; workers accept it only when configured)")
    graph: TaskGraph | None = Field(None, description="run as a graph of agent tasks "
                                    "(plan, parallel subtasks, merge); `instruction` is the goal")

    @field_validator("files")
    @classmethod
    def _files(cls, files: dict[str, str]) -> dict[str, str]:
        total = 0
        for path, content in files.items():
            norm = posixpath.normpath(path)
            if not path or path.startswith("/") or norm.startswith("..") or "\0" in path:
                raise ValueError(f"file path {path!r} must be relative and stay inside the "
                                 "workspace")
            total += len(path) + len(content.encode())
        if total > MAX_FILES_BYTES:
            raise ValueError(f"files total {total} bytes, over the limit of {MAX_FILES_BYTES}")
        return files


#: Called with a task that reached a terminal state outside a worker (a cancel while it
#: was queued), so webhooks fire for every ending.
FinishHook = Callable[[TaskRecord], None]
#: Validates and completes a request before it is stored (webhook URL check, secret).
Prepare = Callable[[AgentTaskRequest, Principal], dict[str, Any]]


def tasks_router(store: TaskStore, queue: JobQueue, principal: Callable[..., Any], *,
                 graphs: GraphRunner | None = None,
                 prepare: Prepare | None = None, on_finish: FinishHook | None = None,
                 max_body_bytes: int = MAX_FILES_BYTES + (1 << 20),
                 poll_s: float = 0.2) -> APIRouter:
    router = APIRouter()

    def visible(task_id: str, who: Principal) -> TaskRecord:
        return store.get(task_id, None if who.admin else who.tenant)

    @router.post("/v1/agent/tasks", status_code=202)
    async def submit(request: Request, who: Principal = Depends(principal),
                     idempotency_key: str | None = Header(None, alias="Idempotency-Key")
                     ) -> JSONResponse:
        raw = await request.body()
        if len(raw) > max_body_bytes:
            raise PayloadTooLargeError(f"the request body is {len(raw)} bytes, over the limit "
                                       f"of {max_body_bytes}",
                                       hint="send fewer or smaller files")
        try:
            body = AgentTaskRequest.model_validate_json(raw)
        except ValidationError as e:  # the app's handler names the first bad field
            raise RequestValidationError(e.errors()) from None
        if idempotency_key is not None and not 1 <= len(idempotency_key) <= 255:
            raise RequestError("Idempotency-Key must be 1 to 255 characters")
        # on a worker thread: the webhook URL check resolves its host (DNS must not stall
        # the event loop) and the key's limits may be read from the database
        stored = (await asyncio.to_thread(prepare, body, who) if prepare
                  else body.model_dump(mode="json"))
        secret = (stored.get("webhook") or {}).get("secret")
        kind = "dag" if body.graph is not None else "agent"
        if kind == "dag" and graphs is None:
            raise RequestError("this server does not run task graphs")
        task, created = await asyncio.to_thread(
            store.create_task, who, stored, kind=kind, idempotency_key=idempotency_key)
        if created and kind == "dag":
            await asyncio.to_thread(graphs.advance, task.id)  # type: ignore[union-attr]
        elif created:
            await asyncio.to_thread(enqueue, store, queue, task)
        # the task as created (a worker may already hold it); a replay shows it as it is now
        out = (task if created else store.get(task.id)).public()
        if created and secret and not (body.webhook and body.webhook.secret):
            out["webhook_secret"] = secret  # shown once: the receiver verifies with it
        return JSONResponse(out, status_code=202 if created else 200)

    @router.get("/v1/agent/tasks")
    async def list_tasks(who: Principal = Depends(principal), status: str | None = None,
                         limit: int = Query(50, ge=1, le=1000)) -> dict[str, Any]:
        if status is not None and status not in {s.value for s in TaskStatus}:
            raise RequestError(f"unknown status {status!r}",
                               hint=f"one of {', '.join(s.value for s in TaskStatus)}")
        tasks = await asyncio.to_thread(store.list, None if who.admin else who.tenant,
                                        status=status, limit=limit)
        return {"object": "list", "data": [t.public() for t in tasks]}

    @router.get("/v1/agent/tasks/{task_id}")
    async def get_task(task_id: str, who: Principal = Depends(principal)) -> dict[str, Any]:
        return visible(task_id, who).public()

    @router.post("/v1/agent/tasks/{task_id}/cancel")
    async def cancel(task_id: str, who: Principal = Depends(principal)) -> dict[str, Any]:
        visible(task_id, who)
        task = await asyncio.to_thread(store.request_cancel, task_id,
                                       None if who.admin else who.tenant)
        await asyncio.to_thread(queue.cancel, task_id)
        if task.kind == "dag" and graphs is not None:
            await asyncio.to_thread(graphs.advance, task_id)  # cancels the running nodes
            task = store.get(task_id)
        elif task.status.terminal and on_finish is not None:
            on_finish(task)
        return task.public()

    @router.get("/v1/agent/tasks/{task_id}/workspace")
    async def workspace(task_id: str, who: Principal = Depends(principal)) -> Response:
        visible(task_id, who)
        checkpoint = await asyncio.to_thread(store.load_checkpoint, task_id)
        if checkpoint is None or checkpoint.workspace is None:
            raise RidgelineError(f"task {task_id} has no workspace yet",
                                 hint="it is saved after the first step that used the sandbox")
        return Response(checkpoint.workspace, media_type="application/gzip",
                        headers={"x-ridgeline-step": str(checkpoint.step)})

    @router.get("/v1/agent/tasks/{task_id}/events")
    async def events(task_id: str, request: Request, who: Principal = Depends(principal),
                     after: int | None = Query(None, ge=0),
                     last_event_id: str | None = Header(None, alias="Last-Event-ID")
                     ) -> StreamingResponse:
        visible(task_id, who)
        start = after if after is not None else _event_id(last_event_id)
        return StreamingResponse(_stream(store, task_id, start, request, poll_s),
                                 media_type="text/event-stream",
                                 headers={"cache-control": "no-cache",
                                          "x-accel-buffering": "no"})

    return router


def enqueue(store: TaskStore, queue: JobQueue, task: TaskRecord) -> None:
    """Queue the task's job; if the queue refuses, the task fails with the reason (the
    client sees it in the status instead of a task that never starts)."""
    try:
        queue.enqueue(AGENT_TASK, {"task_id": task.id}, job_id=task.id)
    except Exception as e:
        store.finish(task.id, TaskStatus.FAILED, error=f"could not be queued: {e}")
        raise


async def _stream(store: TaskStore, task_id: str, after: int, request: Request,
                  poll_s: float) -> AsyncIterator[bytes]:
    last = after
    idle = 0.0
    while True:
        batch = await asyncio.to_thread(store.events, task_id, last)
        for event in batch:
            last = event.seq
            yield (f"id: {event.seq}\nevent: {event.type}\n"
                   f"data: {json.dumps(event.public())}\n\n").encode()
        if batch:
            idle = 0.0
            continue
        task = await asyncio.to_thread(store.get, task_id)
        if task.status.terminal:
            # every event up to the terminal one has been sent (it is written with the status)
            if not await asyncio.to_thread(store.events, task_id, last):
                return
            continue
        if await request.is_disconnected():
            return
        idle += poll_s
        if idle >= 15.0:  # a comment line keeps proxies from closing an idle stream
            idle = 0.0
            yield b": keep-alive\n\n"
        await asyncio.sleep(poll_s)


def _event_id(value: str | None) -> int:
    if value is None or value == "":
        return 0
    try:
        seq = int(value)
    except ValueError:
        raise RequestError(f"Last-Event-ID {value!r} is not an event id",
                           hint="send the id of the last event you received") from None
    if seq < 0:
        raise RequestError("Last-Event-ID must be >= 0")
    return seq
