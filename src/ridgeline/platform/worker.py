"""Agent workers: lease a task from the queue, run the agent in a sandbox step by step,
checkpoint after every step, and finish the task exactly once.

A task's job is delivered at least once (a worker that dies loses its lease and the job
goes to another worker), so the worker is written for redelivery:

- `TaskStore.start_attempt` numbers the attempt; every checkpoint and the final status are
  written only while that attempt is still the task's latest (a fencing token), so a
  worker that lost its lease while paused cannot overwrite its successor's progress.
- A resumed attempt loads the last checkpoint: the agent's history and counters
  (`Episode.state`) and the workspace files (a tar made *inside* the sandbox, so the host
  never walks a directory the untrusted code controls). The step that was cut short runs
  again from the state before it; tools with side effects outside the sandbox carry an
  idempotency key derived from (task, step, call) so their replay returns the recorded
  result instead of acting twice.
- The sandbox is created on the first action that needs it: a task that only talks or
  only uses registry tools costs no sandbox.

Every model call a task makes is admitted and charged under the key that submitted it
(`MeteredModel`, given the platform's gateway): the key's rpm, tpm and concurrency apply to
its agents as to its own requests, and each call is a usage row. A call over a limit waits
(up to `quota_wait_s`) and then fails the task with the quota's error, never as an
infrastructure error. Model errors reach task events without the model endpoint's URL.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from pydantic import BaseModel, Field

from ridgeline.agent.config import AgentConfig
from ridgeline.agent.environment import ToolEnvironment
from ridgeline.agent.loop import Agent, Episode, InstructionTask
from ridgeline.agent.tools import Workbench
from ridgeline.agent.trajectory import ExitStatus, StepRecord
from ridgeline.errors import ConfigError, ModelEndpointError, RidgelineError, SandboxError
from ridgeline.llm.base import ChatModel, Completion, Message, Sampling, ToolSpec
from ridgeline.platform.limits import KeyRateLimitError
from ridgeline.platform.principal import Principal
from ridgeline.platform.queue import Job, JobQueue
from ridgeline.platform.replay import REPLAY_MODEL, ReplayModel
from ridgeline.platform.store import TaskRecord, TaskStatus, TaskStore
from ridgeline.platform.task_service import AGENT_TASK
from ridgeline.platform.tool_env import PlatformToolEnvironment
from ridgeline.sandbox import Sandbox, SandboxSpec, get_provider

log = logging.getLogger(__name__)

# Failures of what the task runs on, not of the task: retried from the last checkpoint.
INFRASTRUCTURE_ERRORS = (ModelEndpointError, SandboxError)
CHECKPOINT_FILE = ".ridgeline-checkpoint.tgz"


class WorkerConfig(BaseModel):
    concurrency: int = Field(2, ge=1, le=256, description="tasks run at once per worker process")
    sandbox: str = Field("bwrap", description="sandbox backend: bwrap, local (no isolation), docker")
    base_url: str | None = Field(None, description="OpenAI-compatible URL the agents' model "
                                 "calls go to (a `ridgeline serve`, vLLM, the gateway); "
                                 "default: the gateway's first upstream")
    api_key_env: str = Field("RIDGELINE_WORKER_API_KEY",
                             description="environment variable holding the key for base_url")
    lease_s: float = Field(30.0, gt=0, description="a task whose worker is silent this long "
                           "goes to another worker")
    heartbeat_s: float = Field(5.0, gt=0)
    poll_s: float = Field(1.0, gt=0, description="how long one lease call waits for work")
    max_workspace_bytes: int = Field(64 << 20, gt=0,
                                     description="largest workspace a checkpoint may hold")
    command_timeout_s: float = Field(120.0, gt=0)
    allow_replay_model: bool = Field(False, description="accept tasks whose model is 'replay' "
                                     "(scripted replies: load tests and demos only)")
    quota_wait_s: float = Field(300.0, ge=0, description="how long a task's model call waits "
                                "for its key's rpm/tpm/concurrency before the task fails")


class TaskCancelled(Exception):
    """Raised from the step hook when the task was cancelled: the episode stops there."""


class LeaseLost(Exception):
    """Raised when this worker no longer owns the task (its lease expired and another
    worker has it): stop without writing anything more."""


class WorkerDraining(Exception):
    """Raised from the step hook when the worker is shutting down (SIGTERM): the task
    goes back to the queue at once and another worker resumes it from this checkpoint."""


class LazySandbox:
    """A sandbox created on first use (and given the task's files or its checkpointed
    workspace then). Attribute access is forwarded to the real sandbox."""

    def __init__(self, create: Callable[[], Sandbox]) -> None:
        self._create = create
        self._sandbox: Sandbox | None = None
        self._lock = threading.Lock()

    @property
    def started(self) -> bool:
        return self._sandbox is not None

    def get(self) -> Sandbox:
        with self._lock:
            if self._sandbox is None:
                self._sandbox = self._create()
            return self._sandbox

    def __getattr__(self, name: str) -> Any:
        return getattr(self.get(), name)

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()


@dataclass
class _Heartbeat:
    """Renews the job's lease in the background; `lost` is set once renewal fails."""

    queue: JobQueue
    job: Job
    interval_s: float
    lease_s: float
    lost: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"heartbeat-{self.job.id}")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                ok = self.queue.heartbeat(self.job, lease_s=self.lease_s)
            except Exception as e:  # the queue is down: keep trying until the lease runs out
                log.warning("heartbeat for %s failed: %s", self.job.id, e)
                continue
            if not ok:
                self.lost.set()
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class TaskQuotaError(KeyRateLimitError):
    """A task's model call stayed over its key's quota longer than `quota_wait_s`: the
    task fails with this (the key's limit, not the infrastructure)."""


_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"<>]+", re.IGNORECASE)


def redact_endpoint(text: str) -> str:
    """A model error as a tenant may read it: no URL (the model server's address is the
    deployment's, not the tenant's)."""
    return _URL.sub("<model endpoint>", text)


class Gateway(Protocol):
    """What a worker needs of `ridgeline.platform.gateway.Gateway`."""

    def admit(self, principal: Principal, tokens: int) -> Any: ...

    def account(self, principal: Principal, model: str, admission: Any, *,
                prompt_tokens: int, completion_tokens: int, error: bool = False) -> None: ...


class MeteredModel:
    """A task's model with every call admitted and charged under the submitting key by the
    gateway's limiter and usage accounting (the same buckets and rows as the key's own
    requests): over a limit, the call waits for it (checking `interrupt`) up to `wait_s`,
    then raises `TaskQuotaError`. A call whose answer reports no usage is charged an
    estimate (characters / 4 of prompt and reply), never nothing."""

    def __init__(self, inner: ChatModel, gateway: Gateway, principal: Principal, model: str,
                 *, wait_s: float, interrupt: Callable[[], None] = lambda: None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.inner = inner
        self.gateway = gateway
        self.principal = principal
        self.name = model  # not the inner client's name: that one holds the endpoint URL
        self.model = model
        self.wait_s = wait_s
        self.interrupt = interrupt
        self.sleep = sleep
        self.supports_tools = getattr(inner, "supports_tools", False)

    @property
    def context_window(self) -> int:
        return self.inner.context_window

    def count_tokens(self, messages: list[Message]) -> int:
        return self.inner.count_tokens(messages)

    def _admit(self, tokens: int) -> Any:
        waited = 0.0
        while True:
            try:
                return self.gateway.admit(self.principal, tokens)
            except KeyRateLimitError as e:
                pause = max(0.05, min(1.0, e.retry_after_s or 1.0))
                if waited + pause > self.wait_s:
                    raise TaskQuotaError(
                        f"the task's model calls are over its API key's {e.limit} limit: "
                        f"{e.message} (waited {waited:.0f} s)", limit=e.limit,
                        retry_after_s=e.retry_after_s,
                        hint="raise the key's limits, or run fewer tasks at once") from None
            self.interrupt()  # cancelled or draining: stop waiting
            self.sleep(pause)
            waited += pause

    def chat(self, messages: list[Message], tools: list[ToolSpec] | None = None,
             sampling: Sampling | None = None) -> Completion:
        max_tokens = (sampling or Sampling()).max_tokens
        prompt_estimate = max(1, _chars_tokens(messages, tools))
        admission = self._admit(prompt_estimate + max_tokens)
        try:
            try:
                completion = self.inner.chat(messages, tools=tools, sampling=sampling)
            except RidgelineError as e:
                self.gateway.account(self.principal, self.model, admission,
                                     prompt_tokens=0, completion_tokens=0, error=True)
                _redact_error(e)
                raise
            except BaseException:
                self.gateway.account(self.principal, self.model, admission,
                                     prompt_tokens=0, completion_tokens=0, error=True)
                raise
            prompt, done = completion.usage.prompt_tokens, completion.usage.completion_tokens
            if prompt + done <= 0:  # no usage reported: an estimate, never free
                prompt = prompt_estimate
                done = max(1, math.ceil((len(completion.text) + sum(
                    len(str(c.arguments)) + len(c.name) for c in completion.tool_calls)) / 4))
            self.gateway.account(self.principal, self.model, admission,
                                 prompt_tokens=prompt, completion_tokens=done)
            return completion
        finally:
            admission.release()


def _chars_tokens(messages: list[Message], tools: list[ToolSpec] | None) -> int:
    chars = sum(len(m.content) + sum(len(str(c.arguments)) for c in m.tool_calls)
                for m in messages)
    chars += sum(len(t.description) + len(str(t.parameters)) for t in tools or ())
    return math.ceil(chars / 4) + 4 * len(messages)


def _redact_error(e: RidgelineError) -> None:
    """Strip URLs from a model error in place (its type and hint stay)."""
    e.message = redact_endpoint(e.message)
    if e.hint is not None:
        e.hint = redact_endpoint(e.hint)
    e.args = (e.message if e.hint is None else f"{e.message} ({e.hint})",)


ModelFactory = Callable[[TaskRecord], ChatModel]
EnvFactory = Callable[[TaskRecord, Sandbox, "TaskRun"], ToolEnvironment]
FinishHook = Callable[[TaskRecord], None]


class TaskRun:
    """One attempt at one task on this worker."""

    def __init__(self, worker: "AgentWorker", task: TaskRecord, job: Job) -> None:
        self.worker = worker
        self.task = task
        self.job = job
        self.attempt = task.attempts
        self.store = worker.store
        self.sandbox = LazySandbox(self._create_sandbox)
        self.checkpoint = self.store.load_checkpoint(task.id)
        self._workspace: bytes | None = self.checkpoint.workspace if self.checkpoint else None

    # -- the sandbox and its files -----------------------------------------------------
    def _create_sandbox(self) -> Sandbox:
        cfg = self.worker.config
        provider = get_provider(cfg.sandbox)
        sandbox = provider.create(SandboxSpec())
        try:
            if self._workspace is not None:
                restore_workspace(sandbox, self._workspace)
            else:
                # a DAG node starts from its dependencies' final workspaces, in order
                for source in self.task.request.get("workspace_from") or []:
                    done = self.store.load_checkpoint(source)
                    if done is not None and done.workspace is not None:
                        restore_workspace(sandbox, done.workspace)
                for path, content in (self.task.request.get("files") or {}).items():
                    sandbox.write_file(path, content)
        except BaseException:
            sandbox.close()
            raise
        return sandbox

    def snapshot(self) -> bytes | None:
        """The workspace as a tar.gz (None while no sandbox was needed and nothing was
        given to start from)."""
        if not self.sandbox.started:
            if self._workspace is None and (self.task.request.get("files")
                                            or self.task.request.get("workspace_from")):
                self.sandbox.get()  # materialise the inputs so the result carries them
            else:
                return self._workspace
        self._workspace = snapshot_workspace(self.sandbox.get(),
                                             self.worker.config.max_workspace_bytes)
        return self._workspace

    # -- the episode -------------------------------------------------------------------
    def on_step(self, episode: Episode, record: StepRecord) -> None:
        # A cancel also cancels the job, so the lease reads as lost: the cancel wins (the
        # attempt fence below still stops a worker whose task another one has taken).
        cancelled = self.store.cancel_requested(self.task.id)
        if self.heartbeat.lost.is_set() and not cancelled:
            raise LeaseLost(self.task.id)
        state = episode.state()
        if not self.store.save_checkpoint(self.task.id, record.index, state, self.snapshot(),
                                          attempt=self.attempt):
            raise LeaseLost(self.task.id)
        self.store.append_event(self.task.id, "task.step", step_event(record))
        if cancelled:
            raise TaskCancelled(self.task.id)
        if self.worker.draining.is_set():
            raise WorkerDraining(self.task.id)

    def principal(self) -> Principal:
        """The submitter as stored with the task: whose quotas and usage its calls use."""
        p = self.task.request.get("principal") or {}
        return Principal(key_id=self.task.key_id, tenant=self.task.tenant, user=p.get("user"))

    def interrupt(self) -> None:
        """Raised into a model call waiting for quota: the task was cancelled, the worker
        is shutting down, or the lease is gone."""
        if self.store.cancel_requested(self.task.id):
            raise TaskCancelled(self.task.id)
        if self.worker.draining.is_set():
            raise WorkerDraining(self.task.id)
        if self.heartbeat.lost.is_set():
            raise LeaseLost(self.task.id)

    def run(self) -> None:
        request = self.task.request
        cfg = self.worker.config
        agent_config = AgentConfig(step_limit=int(request.get("max_steps", 30)),
                                   time_limit_s=float(request.get("time_limit_s", 900.0)),
                                   command_timeout_s=cfg.command_timeout_s)
        model = self.worker.model_factory(self.task)
        # 'replay' answers from the task's own script, no model server: nothing to meter
        if self.worker.gateway is not None and not isinstance(model, ReplayModel):
            model = MeteredModel(model, self.worker.gateway, self.principal(),
                                 request.get("model") or "default", wait_s=cfg.quota_wait_s,
                                 interrupt=self.interrupt)
        env = self.worker.env_factory(self.task, self.sandbox, self)  # type: ignore[arg-type]
        agent = Agent(model, agent_config)
        episode = Episode(agent, InstructionTask(request["instruction"], id=self.task.id), env,
                          None, on_step=self.on_step)
        if isinstance(env, PlatformToolEnvironment):
            # side effects keyed by step number: the replay of a cut-short step after a
            # resume has the same number (a model's call ids would be new)
            env.step = lambda: episode.n_steps
        if self.checkpoint is not None:
            episode.load_state(self.checkpoint.state)
            self.store.append_event(self.task.id, "task.resumed",
                                    {"from_step": self.checkpoint.step, "attempt": self.attempt})
        self.heartbeat = _Heartbeat(self.worker.queue, self.job, cfg.heartbeat_s, cfg.lease_s)
        try:
            result = episode.run()
        except TaskCancelled:
            self.store.finish(self.task.id, TaskStatus.CANCELLED, error="cancelled",
                              attempt=self.attempt)
            return
        finally:
            self.heartbeat.stop()
            self.sandbox.close()
        if self.heartbeat.lost.is_set():
            raise LeaseLost(self.task.id)
        r = result.result
        ok = r.status is ExitStatus.FINISHED
        body = {"exit_status": r.status.value, "summary": r.summary, "steps": r.steps,
                "usage": {"prompt_tokens": r.prompt_tokens,
                          "completion_tokens": r.completion_tokens},
                "wall_s": r.wall_s,
                "error": redact_endpoint(r.error) if r.error else r.error,
                "workspace_bytes": len(self._workspace) if self._workspace else 0}
        if result.exception is not None and not ok and r.status is ExitStatus.ERROR:
            # the model endpoint or the sandbox broke: infrastructure, retried by the queue
            raise result.exception
        self.store.finish(self.task.id, TaskStatus.COMPLETED if ok else TaskStatus.FAILED,
                          result=body, error=None if ok else (body["error"] or r.status.value),
                          attempt=self.attempt)


def step_event(record: StepRecord) -> dict[str, Any]:
    """A step as the event stream shows it: the action and a bounded observation."""
    out: dict[str, Any] = {"step": record.index}
    if record.action is not None:
        out["action"] = {"tool": record.action.tool, "args": record.action.args}
    if record.observation is not None:
        text = record.observation.text
        out["observation"] = {"ok": record.observation.ok,
                              "exit_code": record.observation.exit_code,
                              "text": text[:2000] + ("..." if len(text) > 2000 else "")}
    if record.format_error:
        out["format_error"] = record.format_error[:500]
    if record.response is not None and record.response.content:
        out["reply"] = record.response.content[:2000]
    return out


def snapshot_workspace(sandbox: Sandbox, max_bytes: int) -> bytes:
    """tar.gz of the workspace, made by `tar` inside the sandbox (the host never follows
    a path the sandboxed code could have turned into a symlink)."""
    # The archive is written inside the directory it archives, so "." always changes while
    # tar reads it: GNU tar's exit status 1 (some file changed) is expected, 2 is an error.
    script = (f'tar --warning=no-file-changed -czf "{CHECKPOINT_FILE}" '
              f'--exclude="./{CHECKPOINT_FILE}" .; [ $? -le 1 ] && wc -c < "{CHECKPOINT_FILE}"')
    res = sandbox.run(["sh", "-c", script], timeout=120)
    if not res.ok:
        raise SandboxError(f"could not snapshot the workspace: {res.stderr.strip()[:300]}")
    size = int(res.stdout.strip() or 0)
    if size > max_bytes:
        sandbox.run(["rm", "-f", CHECKPOINT_FILE], timeout=30)
        raise RidgelineError(f"the workspace is {size} bytes compressed, over the checkpoint "
                             f"limit of {max_bytes}",
                             hint="raise worker.max_workspace_bytes or keep less in the workspace")
    data = sandbox.read_file(CHECKPOINT_FILE, max_bytes=max_bytes + 1)
    sandbox.run(["rm", "-f", CHECKPOINT_FILE], timeout=30)
    return data


def restore_workspace(sandbox: Sandbox, data: bytes) -> None:
    sandbox.write_file(CHECKPOINT_FILE, data)
    res = sandbox.run(["sh", "-c", f'tar -xzf "{CHECKPOINT_FILE}" && rm -f "{CHECKPOINT_FILE}"'],
                      timeout=120)
    if not res.ok:
        raise SandboxError(f"could not restore the workspace: {res.stderr.strip()[:300]}")


def default_model_factory(config: WorkerConfig) -> ModelFactory:
    # one client per model name for the worker's life: its connections and the model's
    # context window (a GET /models) are reused by every task, not fetched per task
    clients: dict[str, ChatModel] = {}
    lock = threading.Lock()

    def make(task: TaskRecord) -> ChatModel:
        name = task.request.get("model") or "default"
        if name == REPLAY_MODEL:
            if not config.allow_replay_model:
                raise ConfigError("this worker does not run 'replay' tasks",
                                  hint="set worker.allow_replay_model for load tests")
            return ReplayModel(list(task.request.get("replay") or []))
        if not config.base_url:
            raise ConfigError("worker.base_url is not set: agents have no model to call",
                              hint="point it at the gateway or a `ridgeline serve` /v1 URL")
        from ridgeline.llm.openai_client import OpenAIClient
        with lock:
            if name not in clients:
                clients[name] = OpenAIClient(config.base_url, model=name,
                                             api_key=os.environ.get(config.api_key_env))
            return clients[name]
    return make


def sandbox_workbench(sandbox: Sandbox) -> Workbench:
    """The agent's sandbox tools for a platform task (the agent's default observation
    budget): the one place the platform builds them."""
    return Workbench(sandbox, AgentConfig().observation_max_bytes)


def workbench_env(config: WorkerConfig) -> EnvFactory:
    def make(task: TaskRecord, sandbox: Sandbox, run: TaskRun) -> ToolEnvironment:
        return sandbox_workbench(sandbox)
    return make


class AgentWorker:
    """Runs agent tasks from `queue` with `config.concurrency` threads until `stop()`."""

    def __init__(self, config: WorkerConfig, store: TaskStore, queue: JobQueue, *,
                 model_factory: ModelFactory | None = None, env_factory: EnvFactory | None = None,
                 on_finish: FinishHook | None = None, name: str | None = None,
                 gateway: Gateway | None = None) -> None:
        self.config = config
        # admits and charges every model call under the task's key (None: unmetered, for
        # a worker with no platform around it)
        self.gateway = gateway
        self.store = store
        self.queue = queue
        self.model_factory = model_factory or default_model_factory(config)
        self.env_factory = env_factory or workbench_env(config)
        self.on_finish = on_finish
        self.name = name or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._stop = threading.Event()
        self.draining = threading.Event()
        self._threads: list[threading.Thread] = []
        self.completed = 0

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> "AgentWorker":
        for i in range(self.config.concurrency):
            t = threading.Thread(target=self._loop, name=f"{self.name}-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout)

    def drain(self) -> None:
        """Stop taking tasks; running ones hand back after their current step (SIGTERM:
        a scale-down costs one step, not a lease timeout)."""
        self.draining.set()
        self._stop.set()

    def run_forever(self) -> None:
        previous = signal.getsignal(signal.SIGTERM)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: self.drain())
        self.start()
        try:
            with contextlib.suppress(KeyboardInterrupt):
                while not self._stop.wait(1.0):
                    pass
            self.drain()
            self.stop(timeout=max(30.0, self.config.command_timeout_s))
        finally:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, previous)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                job = self.queue.lease(self.name, kinds=[AGENT_TASK], lease_s=self.config.lease_s,
                                       wait_s=self.config.poll_s)
            except Exception as e:  # the queue is unreachable: wait and try again
                log.warning("lease failed: %s", e)
                self._stop.wait(self.config.poll_s)
                continue
            if job is not None:
                self.process(job)

    # -- one job -----------------------------------------------------------------------
    def process(self, job: Job) -> None:
        task = self.store.start_attempt(job.id)
        if task is None:  # cancelled while queued, or finished by an earlier holder
            self.queue.ack(job)
            self._finished(job.id)
            return
        try:
            TaskRun(self, task, job).run()
        except LeaseLost:
            if self.store.cancel_requested(job.id):  # the job was cancelled with the task
                if self.store.finish(job.id, TaskStatus.CANCELLED, error="cancelled",
                                     attempt=task.attempts):
                    self._finished(job.id)
                return
            log.warning("task %s: lease lost, another worker continues it", job.id)
            return
        except WorkerDraining:
            # back to the queue now (this counts as an attempt) rather than after the lease
            if self.queue.fail(job, "the worker shut down", retry_in_s=0.0) == "queued":
                self.store.append_event(job.id, "task.handed_back",
                                        {"attempt": task.attempts, "worker": self.name})
            return
        except RidgelineError as e:
            if not isinstance(e, INFRASTRUCTURE_ERRORS):  # the request itself is wrong:
                self.store.finish(job.id, TaskStatus.FAILED,  # retrying cannot help
                                  error=redact_endpoint(f"{type(e).__name__}: {e}"),
                                  attempt=task.attempts)
                self.queue.ack(job)
                self._finished(job.id)
                return
            self._retry_or_fail(job, task, e)
            return
        except Exception as e:  # a bug or a broken dependency: retried, then dead-lettered
            self._retry_or_fail(job, task, e)
            return
        self.queue.ack(job)
        self._finished(job.id)

    def _retry_or_fail(self, job: Job, task: TaskRecord, e: BaseException) -> None:
        """Infrastructure failed: the queue retries the job (from the last checkpoint)
        until its attempts run out, then the task fails with the last error."""
        log.warning("task %s attempt %d failed: %s: %s", job.id, task.attempts,
                    type(e).__name__, e)  # the log keeps the URL; the task's events do not
        error = redact_endpoint(f"{type(e).__name__}: {e}")
        state = self.queue.fail(job, error, retry_in_s=min(30.0, 2.0 ** task.attempts))
        if state == "dead":
            self.store.finish(job.id, TaskStatus.FAILED, error=error, attempt=task.attempts)
            self._finished(job.id)
        elif state == "queued":  # "lost": cancelled or taken over meanwhile, nothing to say
            self.store.append_event(job.id, "task.retrying",
                                    {"attempt": task.attempts, "error": error[:500]})

    def _finished(self, task_id: str) -> None:
        self.completed += 1
        if self.on_finish is not None:
            task = self.store.get(task_id)
            if task.status.terminal:
                try:
                    self.on_finish(task)
                except Exception as e:  # a webhook that cannot be queued must not lose the task
                    log.error("on_finish for %s failed: %s", task_id, e)
