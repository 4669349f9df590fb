"""The platform assembled: one object that owns the stores, the queue, the webhook outbox,
the tools registry and the RAG index, and the FastAPI app that serves them.

    platform = Platform(PlatformConfig.load("platform.yaml"))
    app = platform.app()            # gateway + agent tasks + RAG + dashboard + metrics
    platform.worker().run_forever() # in another process (`ridgeline platform worker`)

Everything a task needs between processes lives in the stores (task rows, events,
checkpoints, jobs, deliveries), so API servers and workers can be restarted, scaled and
killed independently. `maintenance()` repairs what a crash between two writes can leave:
a queued task whose job was never enqueued, a graph that did not advance after a child
finished, a job the queue dead-lettered while its task still says in progress.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from importlib import resources
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from ridgeline.agent.environment import ToolEnvironment
from ridgeline.errors import ConflictError, NotFoundError, PermissionDeniedError, RidgelineError
from ridgeline.platform.config import PlatformConfig
from ridgeline.platform.dag import GraphRunner
from ridgeline.platform.gateway import gateway_router
from ridgeline.platform.gateway_forwarding import Gateway
from ridgeline.platform.http import install_docs, install_error_handlers, principal_dependency
from ridgeline.platform.keys import KeyStore
from ridgeline.platform.principal import Principal
from ridgeline.platform.queue import open_queue
from ridgeline.platform.rag import (
    MEMORY_READ, MEMORY_WRITE, RAG_READ, AgentMemory, DocumentIndex, open_index, open_memory,
)
from ridgeline.platform.rag_api import rag_router
from ridgeline.platform.replay import REPLAY_MODEL
from ridgeline.platform.db import Transaction, open_database
from ridgeline.platform.legacy import LEGACY_FILES, adopt_legacy_files
from ridgeline.platform.store import TaskRecord, TaskStatus, TaskStore
from ridgeline.platform.task_service import AGENT_TASK, enqueue
from ridgeline.platform.tasks_api import AgentTaskRequest, tasks_router
from ridgeline.platform.openapi_tools import load_openapi_tools
from ridgeline.platform.tool_env import PlatformToolEnvironment
from ridgeline.platform.tools import SQLIdempotencyStore, ToolCallContext, ToolRegistry
from ridgeline.platform.urls import check_outbound_url
from ridgeline.platform.webhook_dispatcher import WebhookDispatcher
from ridgeline.platform.webhook_outbox import WebhookOutbox
from ridgeline.platform.webhook_signing import new_secret
from ridgeline.platform.webhooks import task_webhook_data
from ridgeline.wire import RequestError
from ridgeline.platform.worker import AgentWorker, EnvFactory, ModelFactory, sandbox_workbench

log = logging.getLogger(__name__)

#: Tasks queued longer than this without their job in the queue are enqueued again.
ORPHAN_AFTER_S = 30.0
#: How often `maintenance` looks for terminal tasks without their webhook delivery.
WEBHOOK_REPAIR_EVERY_S = 3600.0
#: The outbox's own SQLite file in data_dir before it moved into the store's database.
LEGACY_OUTBOX = LEGACY_FILES["webhooks"]
#: Dead jobs reconciled per query in `maintenance` (all of them are, a page at a time).
DEAD_LETTER_PAGE = 1000
#: The dashboard shows text tenants and models wrote: it may run only its own same-origin
#: script and style files (no inline script, handler or style), talk only to this origin,
#: never be framed, and Trusted Types make an HTML-string sink throw instead of parsing.
DASHBOARD_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                 "connect-src 'self'; base-uri 'none'; form-action 'none'; "
                 "frame-ancestors 'none'; require-trusted-types-for 'script'; "
                 "trusted-types 'none'")
DASHBOARD_HEADERS = {"content-security-policy": DASHBOARD_CSP,
                     "x-content-type-options": "nosniff", "referrer-policy": "no-referrer",
                     "x-frame-options": "DENY", "cache-control": "no-cache"}
DASHBOARD_ASSETS = {"dashboard.js": "text/javascript; charset=utf-8",
                    "dashboard.css": "text/css; charset=utf-8"}


def _webhook_key(task: TaskRecord) -> str:
    """One delivery per task and final status, however often it is written or repaired."""
    return f"{task.id}:{task.status.value}"


class Platform:
    def __init__(self, config: PlatformConfig, *, model_factory: ModelFactory | None = None,
                 env_factory: EnvFactory | None = None) -> None:
        self.config = config
        config.prepare()
        # one database for the store, the outbox and (unless a deprecated setting gives
        # them one of their own) the queue, the keys and the tool results
        self.db = open_database(config.database(), pool_size=config.store.pool_size)
        self.store = TaskStore(self.db)
        # the outbox is a table of the store's database: a task's webhook is written in
        # the transaction that writes its final status, so neither exists without the other
        self.outbox = WebhookOutbox(self.db, config.webhooks)
        self.store.on_terminal(self._queue_webhook, self.outbox.notify)
        separate = {c: config.separate_database(c) for c in ("queue", "keys", "tools")}
        adopt = ["webhooks"] + [c for c, own in separate.items() if own is None
                                and not (c == "queue" and config.queue.backend == "redis")]
        try:   # before the keys open: the config's admin key then replaces an adopted one
            adopt_legacy_files(self.db, config.data_dir, adopt)
            self.queue = open_queue(config.queue.model_copy(
                update={"path": separate["queue"]}), db=self.db)
        except BaseException:
            self.db.close()
            raise
        self.keys = KeyStore.from_config(config.keys.model_copy(
            update={"path": separate["keys"]}), db=self.db)
        # a graph's nodes are admitted under its key like requests (rpm, live nodes)
        self.graphs = GraphRunner(self.store, self.queue, enqueue, on_finish=self.task_finished,
                                  admit=lambda who, live: self.gateway.admit_task(who, live))
        # one gateway per platform: its rate limiter also meters task submissions
        self.gateway = Gateway(config.gateway, self.keys)
        self.model_factory = model_factory
        self.metrics = CollectorRegistry()
        self.tools = ToolRegistry(self.metrics, idempotency_store=SQLIdempotencyStore(
            separate["tools"] or self.db))
        self._register_tools()
        self.env_factory = env_factory or self.task_environment
        self._queue_depth = Gauge("ridgeline_queue_depth", "jobs by state",
                                  ["state"], registry=self.metrics)
        self._tasks = Gauge("ridgeline_agent_tasks", "agent tasks by status", ["status"],
                            registry=self.metrics)
        self._stop = threading.Event()
        self._next_webhook_repair = 0.0
        self._threads: list[threading.Thread] = []
        self._rag: tuple[DocumentIndex, AgentMemory] | None = None
        self.dead_letter_page = DEAD_LETTER_PAGE

    def rag(self) -> tuple[DocumentIndex, AgentMemory]:
        """The document index and agent memory, opened on first use (the embedded Qdrant
        store belongs to one process: the API server's; workers never open it)."""
        if self._rag is None:
            rag = self.config.rag
            if not rag.qdrant_url and rag.qdrant_path != ":memory:":
                rag = rag.model_copy(update={"qdrant_path": self.config.path(rag.qdrant_path)})
            index = open_index(rag)
            self._rag = (index, open_memory(index, rag))
        return self._rag

    # -- tools -------------------------------------------------------------------------
    def _register_tools(self) -> None:
        """The platform's own tools (documents and memory, under the caller's tenant and
        ACL) and the REST tools of the configured OpenAPI specs."""
        platform = self

        @self.tools.tool(name="search_documents", scopes=(RAG_READ,))
        def search_documents(query: str, k: int = 5, *, ctx: ToolCallContext) -> str:
            """Search the documents this task's owner may read; returns the best passages."""
            index, _ = platform.rag()
            hits = index.search(query, ctx.principal, k=k)
            if not hits:
                return "no matching documents"
            return "\n\n".join(f"[{h.doc_id} #{h.chunk}] {h.text}" for h in hits)

        @self.tools.tool(name="remember", scopes=(MEMORY_WRITE,), side_effects=True)
        def remember(text: str, *, ctx: ToolCallContext) -> str:
            """Keep a note in this owner's long-term memory for later tasks."""
            _, memory = platform.rag()
            return memory.remember(ctx.principal, "agent", text)

        @self.tools.tool(name="recall", scopes=(MEMORY_READ,))
        def recall(query: str, k: int = 5, *, ctx: ToolCallContext) -> str:
            """Notes from this owner's long-term memory that match the query."""
            _, memory = platform.rag()
            hits = memory.recall(ctx.principal, "agent", query, k=k)
            return "\n".join(f"- {h.text}" for h in hits) or "nothing remembered yet"

        for source in self.config.tools.openapi:
            for tool in load_openapi_tools(
                    self.config.path(source.spec) if "://" not in source.spec else source.spec,
                    source.base_url, allow_private=source.allow_private,
                    **({"scopes_for": lambda *_a, s=tuple(source.scopes): s}
                       if source.scopes is not None else {})):
                self.tools.add(tool)

    def task_environment(self, task: TaskRecord, sandbox: Any, run: Any) -> ToolEnvironment:
        """The sandbox's tools plus the registry tools the task asked for, run as the
        principal that submitted it (its scopes, tenant, user and groups as stored then)."""
        p = task.request.get("principal") or {}
        principal = Principal(key_id=task.key_id, tenant=task.tenant, user=p.get("user"),
                              groups=frozenset(p.get("groups", [])),
                              scopes=frozenset(p.get("scopes", [])))
        return PlatformToolEnvironment(
            sandbox_workbench(sandbox), self.tools, principal,
            idempotency_prefix=task.id, only=task.request.get("tools") or [])

    # -- the life of a task ------------------------------------------------------------
    def prepare_request(self, body: AgentTaskRequest, who: Principal) -> dict[str, Any]:
        """Everything checked before a task is stored: the model the key may use, replay
        only where allowed, the webhook URL (SSRF); a secret generated when none is given."""
        base = body.model.split(":", 1)[0]
        if body.model == REPLAY_MODEL:
            if not self.config.worker.allow_replay_model:
                raise RequestError("model 'replay' is not enabled on this platform",
                                   hint="it is for load tests: set worker.allow_replay_model")
        elif not who.may_use_model(base):
            raise PermissionDeniedError(f"this API key may not use model {base!r}")
        # a submission counts against the key's requests per minute like a completion
        self.gateway.limiter.admit(who.key_id, self.keys.limits(who.key_id)).release()
        for name in body.tools:  # 404 for an unknown tool, 403 outside the key's scopes
            self.tools.authorize(name, who)
        stored = body.model_dump(mode="json", exclude_none=True)
        # who the agent acts as, fixed at submission (workers have no request to ask)
        stored["principal"] = {"user": who.user, "groups": sorted(who.groups),
                               "scopes": sorted(who.scopes | ({"*"} if who.admin else set()))}
        if body.webhook is not None:
            check_outbound_url(body.webhook.url,
                               allow_private=self.config.webhooks.allow_private_targets)
            stored["webhook"] = {"url": body.webhook.url,
                                 "secret": body.webhook.secret or new_secret()}
        return stored

    def _queue_webhook(self, tx: Transaction, task: TaskRecord) -> None:
        """In the transaction that made `task` terminal: its webhook's delivery row (the
        dispatcher sends it). No DNS here (every attempt checks the addresses); a
        delivery the outbox refuses is an event of the task, never a rolled-back finish."""
        hook = task.request.get("webhook")
        if not hook:
            return
        try:
            # pure checks and formatting: whatever fails here is a refusal, so a stored
            # request the outbox cannot use never keeps its task from ending
            if not isinstance(hook, dict):
                raise RidgelineError("the stored webhook is not an object")
            delivery = self.outbox.prepare(
                hook.get("url"), f"agent_task.{task.status.value}",
                task_webhook_data(task, self.config.webhooks.public_url),
                hook.get("secret") or [], owner=task.tenant,
                idempotency_key=_webhook_key(task), resolve=False)
        except Exception as e:  # noqa: BLE001 - see above
            self.store.append_event_in(tx, task.id, "webhook.refused",
                                       {"error": f"{type(e).__name__}: {e}"[:500]})
            return
        try:
            self.outbox.insert(tx, delivery)  # a database error rolls the status back too
        except ConflictError as e:            # another request under the task's key
            self.store.append_event_in(tx, task.id, "webhook.refused", {"error": str(e)[:500]})

    def task_finished(self, task: TaskRecord) -> None:
        """A task reached a terminal state (its webhook was written with it): if it is a
        node of a graph, the graph moves on."""
        if task.parent_id:
            self.graphs.advance(task.parent_id)

    def repair_webhooks(self, *, within_s: float = 7 * 86400, limit: int = 1000) -> int:
        """Terminal tasks of the last `within_s` with a webhook and no delivery row (ended
        before the outbox shared the store's transaction, or by an older version) get
        theirs; a refused one is not tried again. How many were written."""
        since = time.time() - within_s
        rows = self.store.db.fetchall(
            "SELECT t.id FROM tasks t WHERE t.status IN ('completed', 'failed', 'cancelled')"
            " AND t.updated_at >= ? AND t.request LIKE '%\"webhook\"%'"
            " AND NOT EXISTS (SELECT 1 FROM webhook_deliveries w"
            "   WHERE w.idempotency_key = t.id || ':' || t.status)"
            " AND NOT EXISTS (SELECT 1 FROM task_events e WHERE e.task_id = t.id"
            "   AND e.type = 'webhook.refused') LIMIT ?", (since, limit))
        written = 0
        for (task_id,) in rows:
            task = self.store.get(task_id)
            if task.request.get("webhook"):
                self.store.db.run(lambda tx, task=task: self._queue_webhook(tx, task))
                written += 1
        if written:
            self.outbox.notify()
        return written

    def worker(self, name: str | None = None) -> AgentWorker:
        config = self.config.worker
        if config.base_url is None and self.config.gateway.upstreams:
            # no model URL of its own: the agents call the gateway's first upstream
            first = self.config.gateway.upstreams[0]
            config = config.model_copy(update={
                "base_url": first.base_url,
                "api_key_env": first.api_key_env or config.api_key_env})
        # gateway: every model call a task makes is admitted and charged under its key
        return AgentWorker(config, self.store, self.queue,
                           model_factory=self.model_factory, env_factory=self.env_factory,
                           on_finish=self.task_finished, name=name, gateway=self.gateway)

    def maintenance(self, now: float | None = None) -> dict[str, int]:
        """Repair what a crash between two writes can leave (safe to run anywhere, any
        number of times: every step is idempotent)."""
        now = time.time() if now is None else now
        requeued = dead = 0
        for task in self.store.list(None, status=TaskStatus.QUEUED.value, kind="agent",
                                    limit=10_000):
            if now - task.created_at > ORPHAN_AFTER_S and self.queue.info(task.id) is None:
                enqueue(self.store, self.queue, task)
                requeued += 1
        # Every dead job once: a page of the unreconciled ones at a time, each marked when
        # its task is ended (a fixed page of the oldest would never reach the newer ones).
        while letters := self.queue.dead_letters(limit=self.dead_letter_page,
                                                 unreconciled=True):
            done = []
            for letter in letters:
                if letter["kind"] == AGENT_TASK:
                    try:
                        task = self.store.get(letter["id"])
                        if not task.status.terminal and self.store.finish(
                                task.id, TaskStatus.FAILED,
                                error=f"gave up after {letter['attempts']} attempts: "
                                      f"{letter.get('last_error')}"):
                            self.task_finished(self.store.get(task.id))
                            dead += 1
                    except NotFoundError:
                        pass  # a job without a task: nothing to end
                    except Exception as e:  # left unmarked: the next round tries again
                        log.error("dead job %s: ending its task failed: %s", letter["id"], e)
                        continue
                done.append(letter["id"])
            if not done or self.queue.mark_reconciled(done) == 0:
                break  # no progress this round (the store is failing): try again later
        cancelled = 0
        for task in self.store.list(None, status=TaskStatus.IN_PROGRESS.value, kind="agent",
                                    cancel_requested=True, limit=10_000):
            # cancelled while running, and no worker holds it any more (it died): end it
            info = self.queue.info(task.id)
            if info is None or info["state"] != "leased":
                if self.store.finish(task.id, TaskStatus.CANCELLED, error="cancelled"):
                    self.task_finished(self.store.get(task.id))
                    cancelled += 1
        graphs = self.graphs.advance_all()
        # Deliveries are written with the final status now, so only tasks ended before
        # that (or by an older version) lack one: a scan at start and then hourly, not
        # a table scan every round.
        webhooks = 0
        if time.monotonic() >= self._next_webhook_repair:
            self._next_webhook_repair = time.monotonic() + WEBHOOK_REPAIR_EVERY_S
            webhooks = self.repair_webhooks()
        return {"requeued": requeued, "dead": dead, "cancelled": cancelled, "graphs": graphs,
                "webhooks": webhooks}

    def stats(self) -> dict[str, Any]:
        return {"tasks": self.store.counts(), "queue": self.queue.depth(),
                "webhooks": self.outbox.counts()}

    # -- background work of the API process ----------------------------------------------
    def start_background(self) -> None:
        dispatcher = WebhookDispatcher(self.outbox, self.config.webhooks)
        dispatcher.start()
        self._dispatcher = dispatcher
        t = threading.Thread(target=self._maintain, name="platform-maintenance", daemon=True)
        t.start()
        self._threads.append(t)
        self._workers = [self.worker(f"api-worker-{i}").start()
                         for i in range(self.config.server.run_workers)]

    def _maintain(self) -> None:
        while not self._stop.wait(self.config.server.maintenance_s):
            try:
                self.maintenance()
            except Exception as e:  # logged; the next round tries again
                log.error("platform maintenance failed: %s", e)

    def stop_background(self) -> None:
        self._stop.set()
        for w in getattr(self, "_workers", []):
            w.stop()
        if getattr(self, "_dispatcher", None) is not None:
            self._dispatcher.close()
            self._dispatcher = None
        for t in self._threads:
            t.join(timeout=5)

    def close(self) -> None:
        self.stop_background()
        self.keys.close()
        if self._rag is not None:
            self._rag[0].close()
            self._rag = None
        self.outbox.close()
        self.queue.close()
        close_tools = getattr(self.tools.idempotency_store, "close", None)
        if close_tools is not None:
            close_tools()
        self.store.close()
        self.db.close()

    # -- HTTP --------------------------------------------------------------------------
    def app(self, *, background: bool = True) -> FastAPI:
        gateway = self.gateway
        principal = principal_dependency(self.keys)

        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            if background:
                self.start_background()
            yield
            await gateway.aclose()
            if background:
                self.stop_background()

        # the schema and its pages only behind a key (install_docs)
        app = FastAPI(title="Ridgeline platform", lifespan=lifespan, openapi_url=None,
                      docs_url=None, redoc_url=None)
        install_error_handlers(app)
        install_docs(app, principal)
        app.include_router(gateway_router(gateway, principal))
        index, memory = self.rag()
        app.include_router(rag_router(index, memory, principal))
        app.include_router(tasks_router(self.store, self.queue, principal, graphs=self.graphs,
                                        prepare=self.prepare_request,
                                        on_finish=self.task_finished))

        @app.get("/health")
        async def health() -> dict[str, Any]:
            return {"status": "ok"}

        @app.get("/v1/platform/stats")
        async def stats(who: Principal = Depends(principal)) -> dict[str, Any]:
            if who.admin:
                return self.stats()
            return {"tasks": self.store.counts(who.tenant), "queue": self.queue.depth()}

        @app.get("/metrics")
        async def metrics() -> Response:
            for state, n in self.queue.depth().items():
                self._queue_depth.labels(state).set(n)
            for status, n in self.store.counts().items():
                self._tasks.labels(status).set(n)
            return Response(generate_latest(self.metrics), media_type=CONTENT_TYPE_LATEST)

        @app.get("/dashboard", response_class=HTMLResponse)
        async def dashboard() -> HTMLResponse:
            page = resources.files("ridgeline.platform").joinpath("static/dashboard.html")
            return HTMLResponse(page.read_text(), headers=DASHBOARD_HEADERS)

        @app.get("/dashboard/{name}", include_in_schema=False)
        async def dashboard_asset(name: str) -> Response:
            if name not in DASHBOARD_ASSETS:  # a fixed list: no path from the URL is opened
                raise NotFoundError(f"no dashboard file {name!r}", hint="open /dashboard")
            asset = resources.files("ridgeline.platform").joinpath(f"static/{name}")
            return Response(asset.read_bytes(), media_type=DASHBOARD_ASSETS[name],
                            headers=DASHBOARD_HEADERS)

        app.state.platform = self
        app.state.gateway = gateway
        return app
