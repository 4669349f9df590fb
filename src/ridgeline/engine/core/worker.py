"""The one thing that steps an engine: a thread that owns an `LLMEngine` and serves
everyone who shares it.

The engine is synchronous and single-threaded. Its `EngineWorker` applies queued
commands between steps (add, abort, a call such as `update_weights`), steps while there
is work and is not paused, and hands every step's outputs to whoever asked for them:

- asyncio handlers (the server) `await worker.add_request(..., queue)` and read
  `(tag, RequestOutput)` items, or an exception if the engine fails, from their asyncio
  queue; deliveries are batched: one `call_soon_threadsafe` per event loop per step,
  so 64 streaming clients cost one wake-up of the loop per step;
- threads (`LLM.generate`, `EngineClient`, RL rollout workers) call `submit(...)` and
  iterate the returned `RequestHandle`, or wait for its `result()`.

For RL, `pause()` stops stepping after the current step (requests stay in flight),
`update_weights(...)` swaps weights between steps (the prefix cache is dropped: its KV
came from the old weights) and `resume()` continues; tokens sampled afterwards come
from the new weights.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ridgeline.engine.core.llm_engine import LLMEngine
from ridgeline.engine.outputs import EngineStats, RequestOutput
from ridgeline.engine.sampling_params import SamplingParams
from ridgeline.errors import EngineError, RidgelineError

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineUnavailableError(RidgelineError):
    """The engine thread stopped (shut down or failed); it cannot take requests."""

    http_status = 503


_FAILED = "failed after an internal error (see the server log)"

# Per event loop: callables to run there, in order, after a step.
_Deliveries = dict[asyncio.AbstractEventLoop, list[Callable[[], None]]]


@dataclass
class _AsyncSink:
    """Where one request's outputs go: an asyncio queue on some event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[tuple[Any, RequestOutput | BaseException]]
    tag: Any
    added: asyncio.Future[None]

    def settle(self, deliveries: _Deliveries, error: BaseException | None) -> None:
        _defer(deliveries, self.loop, _settle, self.added, error)

    def deliver(self, deliveries: _Deliveries, item: RequestOutput | BaseException) -> None:
        _defer(deliveries, self.loop, self.queue.put_nowait, (self.tag, item))


@dataclass
class _ThreadSink:
    """Where a thread's request's outputs go: a thread-safe queue. With `final_only`
    only the last output (outputs are cumulative, so it holds everything) and errors:
    a caller that waits for results does not wake, and take the GIL from the engine
    thread, for every request at every step (64 requests: ~15% of the engine's time)."""

    added: Future = field(default_factory=Future)
    queue: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    final_only: bool = False

    def settle(self, deliveries: _Deliveries, error: BaseException | None) -> None:
        if error is None:
            self.added.set_result(None)
        else:
            self.added.set_exception(error)

    def deliver(self, deliveries: _Deliveries, item: RequestOutput | BaseException) -> None:
        if self.final_only and isinstance(item, RequestOutput) and not item.finished:
            return
        self.queue.put(item)


_Sink = _AsyncSink | _ThreadSink


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]  # text (the engine tokenises it) or token ids
    params: SamplingParams
    sink: _Sink


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    done: Future


class RequestHandle:
    """A request submitted from a thread: iterate its outputs, or wait for the last."""

    def __init__(self, worker: EngineWorker, request_id: str, sink: _ThreadSink) -> None:
        self.request_id = request_id
        self._worker = worker
        self._sink = sink
        self.final: RequestOutput | None = None

    def __iter__(self) -> Iterator[RequestOutput]:
        while self.final is None:
            item = self._sink.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self.final = item
            yield item

    def result(self) -> RequestOutput:
        """The final output (waits for it; raises if the engine failed)."""
        for _ in self:
            pass
        assert self.final is not None
        return self.final

    def abort(self) -> None:
        self._worker.abort(self.request_id)


class EngineWorker:
    def __init__(self, engine: LLMEngine, name: str = "engine") -> None:
        self.engine = engine
        self.name = name
        self._cond = threading.Condition()
        self._commands: deque[_Add | _Abort | _Call] = deque()
        self._sinks: dict[str, _Sink] = {}  # touched by the engine thread only
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._paused = False
        #: why the loop died (None while healthy); for the log and the operator, never a
        #: client: error messages say only that it failed
        self.error: str | None = None
        #: a snapshot taken by the engine thread after every step (safe to read anywhere)
        self.stats: EngineStats = engine.stats()
        #: requests aborted because their client went away or gave up
        self.num_aborted = 0

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> EngineWorker:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name=f"engine-{self.name}",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever is in flight, end the loop and wait for the thread."""
        thread = self._thread
        if thread is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify()
        thread.join(timeout)
        self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def _check_running(self) -> None:
        if not self.is_running:
            raise EngineUnavailableError(
                f"model {self.name!r} " + (_FAILED if self.error else "is not running"),
                hint="restart the server" if self.error else "call start() first")

    # ---- asyncio callers -----------------------------------------------------------------

    async def add_request(self, request_id: str, prompt_token_ids: list[int],
                          params: SamplingParams,
                          queue: asyncio.Queue[tuple[Any, RequestOutput | BaseException]],
                          tag: Any = None) -> None:
        """Queue a request; returns once the engine accepted it (raises what the engine
        raised otherwise). Its outputs arrive in `queue` as `(tag, RequestOutput)`."""
        self._check_running()
        loop = asyncio.get_running_loop()
        sink = _AsyncSink(loop, queue, tag, loop.create_future())
        self._post(_Add(request_id, list(prompt_token_ids), params, sink))
        try:
            await sink.added
        except asyncio.CancelledError:
            self.abort(request_id)  # the client left while the request was being added
            raise

    # ---- thread callers ------------------------------------------------------------------

    def submit(self, request_id: str, prompt: str | list[int],
               params: SamplingParams) -> RequestHandle:
        """Queue a request from a thread (text or token ids); returns once the engine
        accepted it (raises the engine's `EngineError` for a bad request)."""
        return self.submit_many([(request_id, prompt, params)])[0]

    def submit_many(self, requests: list[tuple[str, str | list[int], SamplingParams]],
                    *, final_only: bool = False) -> list[RequestHandle]:
        """Queue several requests at once, so they start in the same step. If the engine
        refuses one, the others are aborted and its error is raised. With `final_only`
        the handles yield only each request's last output (for callers that only wait
        for results)."""
        self._check_running()
        if threading.current_thread() is self._thread:
            raise EngineError("submit() was called on the engine thread",
                              hint="step the engine directly there")
        handles = []
        with self._cond:
            for rid, prompt, params in requests:
                sink = _ThreadSink(final_only=final_only)
                prompt = prompt if isinstance(prompt, str) else list(prompt)
                self._commands.append(_Add(rid, prompt, params, sink))
                handles.append(RequestHandle(self, rid, sink))
            self._cond.notify()
        errors = [h._sink.added.exception() for h in handles]
        if any(e is not None for e in errors):
            for h, e in zip(handles, errors):
                if e is None:
                    h.abort()
            raise next(e for e in errors if e is not None)
        return handles

    def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps; its result."""
        if threading.current_thread() is self._thread:
            return fn(self.engine)
        self._check_running()
        done: Future = Future()
        self._post(_Call(fn, done))
        return done.result()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int | None = None) -> int:
        """Swap weights between two steps; requests in flight continue on the new ones,
        and the tokens they sample from then on carry the new `version`."""
        tensors = list(named_tensors)
        return self.call(lambda engine: engine.update_weights(tensors, version))

    def pause(self) -> None:
        """Stop stepping once the current step is done (requests stay in flight, new
        ones are accepted and wait). Returns when the engine is idle."""
        with self._cond:
            self._paused = True
        self.call(lambda engine: None)  # a barrier: the step in progress has finished

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify()

    @property
    def is_paused(self) -> bool:
        return self._paused

    def abort(self, request_id: str) -> None:
        """Stop a request (no-op when it already finished). Thread-safe."""
        self._post(_Abort(request_id))

    def _post(self, command: _Add | _Abort | _Call) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    # ---- the engine thread -------------------------------------------------------------

    def _has_work(self) -> bool:
        return not self._paused and self.engine.has_unfinished_requests()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stopping or self._has_work()):
                        self._cond.wait()
                    commands = list(self._commands)
                    self._commands.clear()
                    stopping = self._stopping
                deliveries: _Deliveries = {}
                if stopping:
                    self._shutdown(commands, deliveries, EngineUnavailableError(
                        f"model {self.name!r} is shutting down", hint="retry later"))
                    self._flush(deliveries)
                    return
                for command in commands:
                    self._apply(command, deliveries)
                if self._has_work():
                    for out in self.engine.step():
                        self._dispatch(out, deliveries)
                    self.stats = self.engine.stats()
                self._flush(deliveries)
        except BaseException as e:  # a bug in the engine: fail every request, stop serving
            log.exception("engine %s failed", self.name)
            self.error = f"{type(e).__name__}: {e}"
            deliveries = {}
            with self._cond:
                commands = list(self._commands)
                self._commands.clear()
            self._shutdown(commands, deliveries, EngineUnavailableError(
                f"model {self.name!r} {_FAILED}", hint="restart the server"))
            self._flush(deliveries)

    def _apply(self, command: _Add | _Abort | _Call, deliveries: _Deliveries) -> None:
        if isinstance(command, _Call):
            try:
                command.done.set_result(command.fn(self.engine))
            except Exception as e:  # the caller's to handle
                command.done.set_exception(e)
            return
        if isinstance(command, _Abort):
            if command.request_id in self._sinks:
                del self._sinks[command.request_id]
                self.engine.abort(command.request_id)
                self.num_aborted += 1
            return
        sink = command.sink
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params)
        except Exception as e:  # the engine's verdict on a bad request, for the caller
            sink.settle(deliveries, e)
            return
        self._sinks[command.request_id] = sink
        sink.settle(deliveries, None)

    def _dispatch(self, out: RequestOutput, deliveries: _Deliveries) -> None:
        sink = self._sinks.get(out.request_id)
        if sink is None:
            return  # aborted: nobody is listening
        if out.finished:
            del self._sinks[out.request_id]
        sink.deliver(deliveries, out)

    def _shutdown(self, commands: list[_Add | _Abort | _Call], deliveries: _Deliveries,
                  error: BaseException) -> None:
        for command in commands:
            if isinstance(command, _Add):
                command.sink.settle(deliveries, error)
            elif isinstance(command, _Call):
                command.done.set_exception(error)
        for request_id, sink in self._sinks.items():
            sink.deliver(deliveries, error)
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - the engine is already broken; callers know
                log.debug("abort of %s during shutdown failed", request_id, exc_info=True)
        self._sinks.clear()
        try:
            while self.engine.has_unfinished_requests() and not self.engine.requests:
                self.engine.step()  # drain the abort outputs so the engine is clean for reuse
            self.stats = self.engine.stats()
        except Exception:  # noqa: BLE001 - as above
            log.debug("draining engine %s during shutdown failed", self.name, exc_info=True)

    @staticmethod
    def _flush(deliveries: _Deliveries) -> None:
        for loop, calls in deliveries.items():
            try:
                loop.call_soon_threadsafe(_run_all, calls)
            except RuntimeError:  # that loop is closed: its handlers are gone
                pass


def _defer(deliveries: _Deliveries, loop: asyncio.AbstractEventLoop,
           fn: Callable[..., Any], *args: Any) -> None:
    deliveries.setdefault(loop, []).append(lambda: fn(*args))


def _run_all(calls: list[Callable[[], None]]) -> None:
    for call in calls:
        call()


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # the waiting handler was cancelled
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
