"""The generation path of `ridgeline serve`: the engine requests behind one HTTP
request and what comes back from them.

`_Generation` adds one engine request per prompt (all at once, so they share the next
step), gathers their outputs in one queue, observes the request-side metrics (time to
first token, inter-token latency, tokens, finish reasons) and aborts whatever has not
finished when the client leaves or something fails. `_final_outputs` runs a non-streamed
generation to the end, watching for a disconnect; `_check_generated` turns an engine
failure of one request into `_GenerationFailed` (a 500 without detail). Streaming is
`serve.streaming`; the endpoints that build the engine requests are `serve.completions`.
Split out of `ridgeline.serve.app`, which describes the whole server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from ridgeline.engine.outputs import RequestOutput
from ridgeline.engine.sampling_params import SamplingParams
from ridgeline.serve.metrics import ServerMetrics
from ridgeline.serve.served import ServedModel

# ---- one generation: engine requests, metrics, abort -----------------------------------------


class _Generation:
    """The engine requests behind one HTTP request (one per prompt), their outputs in one
    queue, and what the metrics need. `abort()` stops whatever has not finished."""

    def __init__(self, model: ServedModel, metrics: ServerMetrics, request_id: str,
                 t0: float) -> None:
        self.model = model
        self.metrics = metrics
        self.request_id = request_id
        self.t0 = t0
        self.queue: asyncio.Queue[tuple[Any, RequestOutput | BaseException]] = asyncio.Queue()
        self.unfinished: dict[str, int] = {}  # request id -> its number of samples
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self._last_token_time: float | None = None

    async def start(self, prompts: list[tuple[list[int], SamplingParams]]) -> None:
        """Add every prompt at once (so they share the next step); if the engine refuses
        one, the others are aborted and its error raised."""
        rids = [self.request_id if len(prompts) == 1 else f"{self.request_id}-{i}"
                for i in range(len(prompts))]
        for rid, (_, params) in zip(rids, prompts):
            self.unfinished[rid] = params.n
        try:
            results = await asyncio.gather(
                *(self.model.worker.add_request(rid, ids, params, self.queue, tag=i)
                  for i, (rid, (ids, params)) in enumerate(zip(rids, prompts))),
                return_exceptions=True)
        except BaseException:  # cancelled: the client left
            self.abort(count=False)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.abort(count=False)
            raise errors[0]
        self.prompt_tokens = sum(len(ids) for ids, _ in prompts)
        self.metrics.prompt_tokens.labels(self.model.name).inc(self.prompt_tokens)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """`(prompt index, output)` for every step of every request until all finish."""
        while self.unfinished:
            tag, item = await self.queue.get()
            if isinstance(item, BaseException):
                self.unfinished.clear()
                raise item
            self._observe(item)
            if item.finished:
                self.unfinished.pop(item.request_id, None)
            yield tag, item

    def _observe(self, out: RequestOutput) -> None:
        name = self.model.name
        new = sum(len(c.delta_token_ids) for c in out.outputs)
        if new:
            now = time.perf_counter()
            if self._last_token_time is None:
                self.metrics.ttft.labels(name).observe(now - self.t0)
                self.cached_tokens += out.num_cached_tokens
            else:
                self.metrics.itl.labels(name).observe(now - self._last_token_time)
            self._last_token_time = now
            self.completion_tokens += new
            self.metrics.generation_tokens.labels(name).inc(new)
        if out.finished:
            for c in out.outputs:
                self.metrics.finished.labels(name, c.finish_reason or "abort").inc()
            if len(self.unfinished) <= 1:
                self.metrics.e2e.labels(name).observe(time.perf_counter() - self.t0)

    def abort(self, count: bool = True) -> None:
        for rid, n in self.unfinished.items():
            self.model.worker.abort(rid)
            if count:
                self.metrics.finished.labels(self.model.name, "abort").inc(n)
        self.unfinished.clear()

    def client_gone(self) -> None:
        """The client disconnected during a non-streamed request."""
        self.abort()
        self.queue.put_nowait((None, _ClientGone()))

    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


class _ClientGone(Exception):
    pass


async def _final_outputs(gen: _Generation, request: Request) -> dict[int, RequestOutput]:
    """Run a non-streamed generation to the end; abort it if the client disconnects."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                gen.client_gone()
                return

    watcher = asyncio.ensure_future(watch())
    final: dict[int, RequestOutput] = {}
    try:
        async for tag, out in gen.outputs():
            if out.finished:
                final[tag] = out
    finally:
        watcher.cancel()
        gen.abort()  # no-op unless something went wrong mid-way
    for out in final.values():
        _check_generated(out)
    return final


class _GenerationFailed(Exception):
    """The engine failed one request (a bug, logged by the engine): a 500, no detail."""


def _check_generated(out: RequestOutput) -> None:
    if out.finished and out.error is not None:
        raise _GenerationFailed(f"request {out.request_id} failed in the engine: {out.error}")
