"""One engine on its own thread, fed by asyncio handlers.

The engine is synchronous and single-threaded, so each served model gets an
`EngineWorker`: a thread that applies queued add/abort commands between steps, steps
while there is work, and hands every step's outputs to the event loops that asked for
them. A handler calls `await worker.add_request(...)` (which raises the engine's own
`EngineError` for a bad request) and then reads `(tag, RequestOutput)` items, or an
exception when the engine fails, from the asyncio queue it passed in.

Deliveries are batched: one `call_soon_threadsafe` per event loop per step, not one per
request, so 64 streaming clients cost one wake-up of the loop per step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ridgeline.engine.llm_engine import EngineStats, LLMEngine
from ridgeline.engine.outputs import RequestOutput
from ridgeline.engine.sampling_params import SamplingParams
from ridgeline.errors import RidgelineError

log = logging.getLogger(__name__)


class EngineUnavailableError(RidgelineError):
    """The engine thread stopped (shut down or failed); the server cannot take requests."""

    http_status = 503


@dataclass
class _Sink:
    """Where one request's outputs go: an asyncio queue on some event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[tuple[Any, RequestOutput | BaseException]]
    tag: Any
    added: asyncio.Future[None]


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: _Sink


@dataclass
class _Abort:
    request_id: str


_FAILED = "failed after an internal error (see the server log)"

# Per event loop: callables to run there, in order, after a step.
_Deliveries = dict[asyncio.AbstractEventLoop, list[Callable[[], None]]]


class EngineWorker:
    def __init__(self, engine: LLMEngine, name: str = "engine") -> None:
        self.engine = engine
        self.name = name
        self._cond = threading.Condition()
        self._commands: deque[_Add | _Abort] = deque()
        self._sinks: dict[str, _Sink] = {}  # touched by the engine thread only
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._need_drain = False  # aborted requests whose final outputs are still pending
        #: why the loop died (None while healthy); for the log and the operator, never a
        #: client: error messages say only that it failed
        self.error: str | None = None
        #: a snapshot taken by the engine thread after every step (safe to read anywhere)
        self.stats: EngineStats = engine.stats()
        #: requests aborted because their client went away or gave up
        self.num_aborted = 0

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.name}",
                                        daemon=True)
        self._thread.start()

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

    # ---- called from event loops -------------------------------------------------------

    async def add_request(self, request_id: str, prompt_token_ids: list[int],
                          params: SamplingParams,
                          queue: asyncio.Queue[tuple[Any, RequestOutput | BaseException]],
                          tag: Any = None) -> None:
        """Queue a request; returns once the engine accepted it (raises what the engine
        raised otherwise). Its outputs arrive in `queue` as `(tag, RequestOutput)`."""
        if not self.is_running:
            raise EngineUnavailableError(
                f"model {self.name!r} " + (_FAILED if self.error else "is not running"),
                hint="restart the server")
        loop = asyncio.get_running_loop()
        sink = _Sink(loop, queue, tag, loop.create_future())
        self._post(_Add(request_id, list(prompt_token_ids), params, sink))
        try:
            await sink.added
        except asyncio.CancelledError:
            self.abort(request_id)  # the client left while the request was being added
            raise

    def abort(self, request_id: str) -> None:
        """Stop a request (no-op when it already finished). Thread-safe."""
        self._post(_Abort(request_id))

    def _post(self, command: _Add | _Abort) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    # ---- the engine thread -------------------------------------------------------------

    def _has_work(self) -> bool:
        return self._need_drain or self.engine.has_unfinished_requests()

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
                    self._need_drain = False
                    for out in self._step():
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

    def _step(self) -> list[RequestOutput]:
        outputs = self.engine.step()
        if not self.engine.has_unfinished_requests():
            # A request the engine failed during this step reports its final output from
            # the next step(); with nothing left to run, that step would never come and
            # its client would wait forever.
            outputs += self.engine.step()
        return outputs

    def _apply(self, command: _Add | _Abort, deliveries: _Deliveries) -> None:
        if isinstance(command, _Abort):
            if command.request_id in self._sinks:
                del self._sinks[command.request_id]
                self.engine.abort(command.request_id)
                self._need_drain = True
                self.num_aborted += 1
            return
        sink = command.sink
        try:
            self.engine.add_request(command.request_id, prompt_token_ids=command.prompt_token_ids,
                                    params=command.params)
        except Exception as e:  # the engine's verdict on a bad request, for the handler
            _defer(deliveries, sink.loop, _settle, sink.added, e)
            return
        self._sinks[command.request_id] = sink
        _defer(deliveries, sink.loop, _settle, sink.added, None)

    def _dispatch(self, out: RequestOutput, deliveries: _Deliveries) -> None:
        sink = self._sinks.get(out.request_id)
        if sink is None:
            return  # aborted: nobody is listening
        if out.finished:
            del self._sinks[out.request_id]
        _defer(deliveries, sink.loop, sink.queue.put_nowait, (sink.tag, out))

    def _shutdown(self, commands: list[_Add | _Abort], deliveries: _Deliveries,
                  error: BaseException) -> None:
        for command in commands:
            if isinstance(command, _Add):
                _defer(deliveries, command.sink.loop, _settle, command.sink.added, error)
        for request_id, sink in self._sinks.items():
            _defer(deliveries, sink.loop, sink.queue.put_nowait, (sink.tag, error))
            try:
                self.engine.abort(request_id)
            except Exception:  # the engine is already broken; the handlers know
                pass
        self._sinks.clear()
        try:
            self.engine.step()  # drain the abort outputs so the engine is clean for reuse
            self.stats = self.engine.stats()
        except Exception:
            pass

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
