"""The agent task API: submit (202 and an id), status, list, cancel, result, and the event
stream as Server-Sent Events that resume from `Last-Event-ID`.

    POST /v1/agent/tasks                 {"instruction": ..., "files": {...}, "webhook": {...},
                                          "share_with": {"users": [...], "groups": [...]}}
    GET  /v1/agent/tasks                 summaries of the caller's tasks, newest first
    GET  /v1/agent/tasks/{id}            status, the whole request (and result once finished)
    POST /v1/agent/tasks/{id}/cancel
    GET  /v1/agent/tasks/{id}/events     SSE; `Last-Event-ID: n` (or ?after=n) resumes after n
    GET  /v1/agent/tasks/{id}/workspace  the final (or latest) workspace as tar.gz

Visibility follows the principal, not the tenant: a task is seen, followed, downloaded and
cancelled by the key that submitted it, that key's user, and the users and groups of the
same tenant it was shared with at submission (`share_with`; a graph's nodes inherit the
graph's). An admin key sees every task. Anyone else, a colleague in the same tenant
included, gets the same 404 as for a task that does not exist. A task's events carry what
its tools read as the submitter (documents under the submitter's ACLs): sharing a task
shares that too.

The caller's key is checked before the body is read; the body is read under a cap, from
Content-Length or while it streams in. Lists are bounded summaries (`store.task_summary`);
the whole request is on the single-task route only.

Submission is all-or-nothing: the body is validated (size, paths, webhook URL) before
anything is stored, and the task row is written before its job is queued; a job that could
not be queued leaves the task failed with the reason, never queued and forgotten. The
`Idempotency-Key` header makes a retried POST return the task it created the first time.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Annotated, Any, AsyncIterator, Callable

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from ridgeline.errors import ConflictError, RidgelineError
from ridgeline.platform.dag import GraphRunner, TaskGraph
from ridgeline.platform.http import parse_body, read_body
from ridgeline.platform.principal import Principal, group_reader, user_reader
from ridgeline.platform.queue import JobQueue
from ridgeline.platform.store import TaskRecord, TaskStatus, TaskStore
from ridgeline.platform.task_service import enqueue
from ridgeline.wire import RequestError

MAX_FILES_BYTES = 8 << 20
MAX_INSTRUCTION_CHARS = 100_000
#: input files: how many, and how long a path and each of its names may be (in bytes);
#: well under Linux's PATH_MAX and NAME_MAX once the workspace directory is in front
MAX_FILES = 10_000
MAX_PATH_BYTES = 1024
MAX_NAME_BYTES = 255
#: event ids are 64-bit integers in the database; a larger Last-Event-ID is refused
MAX_EVENT_ID = 2**63 - 1
_EVENT_ID = re.compile(r"-?[0-9]+")

Name = Annotated[str, StringConstraints(min_length=1, max_length=200)]


class WebhookSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str
    secret: str | None = Field(None, description="whsec_... (Standard Webhooks); one is "
                               "generated and returned once when absent")


class ShareSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    users: list[Name] = Field(default_factory=list, max_length=100)
    groups: list[Name] = Field(default_factory=list, max_length=100)


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
    share_with: ShareSpec | None = Field(None, description="users and groups of your tenant "
                                         "who may also see, follow and cancel this task "
                                         "(its events show what its tools read as you)")

    @field_validator("files")
    @classmethod
    def _files(cls, files: dict[str, str]) -> dict[str, str]:
        # Everything a worker's write could trip over is refused here: once accepted, a
        # file that cannot be written would fail every attempt as an infrastructure error.
        if len(files) > MAX_FILES:
            raise ValueError(f"{len(files)} files, over the limit of {MAX_FILES}: pack them "
                             "into fewer files")
        total = 0
        for path, content in files.items():
            problem = _path_problem(path)
            if problem:
                raise ValueError(f"file path {path[:300]!r} {problem}: give a relative path "
                                 "that stays inside the workspace, such as 'src/main.py'")
            try:
                total += len(path.encode()) + len(content.encode())
            except UnicodeEncodeError:
                raise ValueError(f"file {path!r} is not valid Unicode text (an unpaired "
                                 "surrogate)") from None
        if total > MAX_FILES_BYTES:
            raise ValueError(f"files total {total} bytes, over the limit of {MAX_FILES_BYTES}")
        # one name cannot be a file and the directory of another file
        dirs = {p.rsplit("/", i)[0] for p in files for i in range(1, p.count("/") + 1)}
        clash = sorted(dirs & files.keys())
        if clash:
            raise ValueError(f"file path {clash[0]!r} is also a directory of another file: "
                             "a name can be one or the other")
        return files


def _path_problem(path: str) -> str | None:
    """Why `path` cannot be written as given in a workspace, or None. Only normal forms
    are accepted ('a/b', not './a//b/'), so two keys never name one file."""
    if not path:
        return "is empty"
    if "\0" in path:
        return "contains a NUL byte"
    try:
        size = len(path.encode())
    except UnicodeEncodeError:
        return "is not valid Unicode (an unpaired surrogate)"
    if path.startswith("/"):
        return "is absolute"
    if size > MAX_PATH_BYTES:
        return f"is {size} bytes long, over the limit of {MAX_PATH_BYTES}"
    for name in path.split("/"):
        if name in ("", ".", ".."):
            return "has an empty, '.' or '..' component"
        if len(name.encode()) > MAX_NAME_BYTES:
            return f"has a name over {MAX_NAME_BYTES} bytes"
    return None


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
        return store.get(task_id, visible_to=who)

    @router.post("/v1/agent/tasks", status_code=202)
    async def submit(request: Request, who: Principal = Depends(principal),
                     idempotency_key: str | None = Header(None, alias="Idempotency-Key")
                     ) -> JSONResponse:
        body = parse_body(await read_body(request, max_body_bytes), AgentTaskRequest)
        if idempotency_key is not None and not 1 <= len(idempotency_key) <= 255:
            raise RequestError("Idempotency-Key must be 1 to 255 characters")
        # on a worker thread: the webhook URL check resolves its host (DNS must not stall
        # the event loop) and the key's limits may be read from the database
        stored = (await asyncio.to_thread(prepare, body, who) if prepare
                  else body.model_dump(mode="json"))
        # a secret we generated is left out of the idempotency fingerprint (a retry would
        # get another one) and shown again on a replay to the key that submitted
        generated = body.webhook is not None and body.webhook.secret is None and \
            bool((stored.get("webhook") or {}).get("secret"))
        fingerprint = ({**stored, "webhook": {k: v for k, v in stored["webhook"].items()
                                              if k != "secret"}} if generated else None)
        kind = "dag" if body.graph is not None else "agent"
        if kind == "dag" and graphs is None:
            raise RequestError("this server does not run task graphs")
        share = body.share_with or ShareSpec()
        readers = ([user_reader(u) for u in share.users]
                   + [group_reader(g) for g in share.groups])
        try:
            task, created = await asyncio.to_thread(
                store.create_task, who, stored, kind=kind, idempotency_key=idempotency_key,
                fingerprint=fingerprint, readers=readers)
        except ConflictError:  # its message names the key's task, maybe a colleague's
            raise ConflictError(f"idempotency key {idempotency_key!r} was used for another "
                                "request", hint="use a new key for a different request"
                                ) from None
        if not created and not who.admin:
            try:  # idempotency keys are per tenant: a colleague's replay must not see it
                await asyncio.to_thread(visible, task.id, who)
            except RidgelineError:
                raise ConflictError(f"idempotency key {idempotency_key!r} was used by "
                                    "another key of your tenant",
                                    hint="use a new key") from None
        if created and kind == "dag":
            await asyncio.to_thread(graphs.advance, task.id)  # type: ignore[union-attr]
        elif created:
            await asyncio.to_thread(enqueue, store, queue, task)
        # the task as created (a worker may already hold it); a replay shows it as it is now
        out = (task if created else store.get(task.id)).public()
        if generated and (created or task.key_id == who.key_id):
            # the receiver verifies with it; a lost first response must not lose it
            out["webhook_secret"] = task.request["webhook"]["secret"]
        return JSONResponse(out, status_code=202 if created else 200)

    @router.get("/v1/agent/tasks")
    async def list_tasks(who: Principal = Depends(principal), status: str | None = None,
                         limit: int = Query(50, ge=1, le=1000)) -> dict[str, Any]:
        if status is not None and status not in {s.value for s in TaskStatus}:
            raise RequestError(f"unknown status {status!r}",
                               hint=f"one of {', '.join(s.value for s in TaskStatus)}")
        tasks = await asyncio.to_thread(store.summaries, who, status=status, limit=limit)
        return {"object": "list", "data": tasks}

    @router.get("/v1/agent/tasks/{task_id}")
    async def get_task(task_id: str, who: Principal = Depends(principal)) -> dict[str, Any]:
        return (await asyncio.to_thread(visible, task_id, who)).public()

    @router.post("/v1/agent/tasks/{task_id}/cancel")
    async def cancel(task_id: str, who: Principal = Depends(principal)) -> dict[str, Any]:
        await asyncio.to_thread(visible, task_id, who)
        task = await asyncio.to_thread(store.request_cancel, task_id,
                                       None if who.admin else who.tenant)
        await asyncio.to_thread(queue.cancel, task_id)
        if task.kind == "dag" and graphs is not None:
            await asyncio.to_thread(graphs.advance, task_id)  # cancels the running nodes
            task = store.get(task_id)
        elif task.status.terminal and on_finish is not None:
            # on a thread: queuing the webhook checks its URL, which resolves the host
            await asyncio.to_thread(on_finish, task)
        return task.public()

    @router.get("/v1/agent/tasks/{task_id}/workspace")
    async def workspace(task_id: str, who: Principal = Depends(principal)) -> Response:
        await asyncio.to_thread(visible, task_id, who)
        checkpoint = await asyncio.to_thread(store.load_checkpoint, task_id)
        if checkpoint is None or checkpoint.workspace is None:
            raise RidgelineError(f"task {task_id} has no workspace yet",
                                 hint="it is saved after the first step that used the sandbox")
        return Response(checkpoint.workspace, media_type="application/gzip",
                        headers={"x-ridgeline-step": str(checkpoint.step)})

    @router.get("/v1/agent/tasks/{task_id}/events")
    async def events(task_id: str, request: Request, who: Principal = Depends(principal),
                     after: int | None = Query(None, ge=0, le=MAX_EVENT_ID),
                     last_event_id: str | None = Header(None, alias="Last-Event-ID")
                     ) -> StreamingResponse:
        await asyncio.to_thread(visible, task_id, who)
        start = after if after is not None else _event_id(last_event_id)
        return StreamingResponse(_stream(store, task_id, start, request, poll_s),
                                 media_type="text/event-stream",
                                 headers={"cache-control": "no-cache",
                                          "x-accel-buffering": "no"})

    return router


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
    if not _EVENT_ID.fullmatch(value):
        raise RequestError(f"Last-Event-ID {value[:40]!r} is not an event id",
                           hint="send the id of the last event you received")
    if value.startswith("-"):
        raise RequestError("Last-Event-ID must be >= 0")
    if len(value) > 19 or int(value) > MAX_EVENT_ID:  # no int() of a huge digit string
        raise RequestError(f"Last-Event-ID {value[:40]} is out of range (at most "
                           f"{MAX_EVENT_ID})", hint="send the id of the last event you received")
    return int(value)
