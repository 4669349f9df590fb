"""Prometheus metrics of the server, in a registry of its own (one per app, so several
apps in one process, as in tests, do not collide).

Request-side metrics are observed by the handlers (what a client experiences: time to
first token counts from the moment the request was read). Engine-side ones are read at
scrape time from each worker's latest stats snapshot, which the engine thread takes
after every step, so a scrape never touches the engine while it runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ridgeline.engine.core.worker import EngineWorker

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class ServerMetrics:
    def __init__(self, workers: Mapping[str, EngineWorker]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("ridgeline_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("ridgeline_request_finished",
                                "Generation requests by model and finish reason "
                                "(abort: the client went away)", ["model", "reason"], registry=r)
        self.prompt_tokens = Counter("ridgeline_prompt_tokens", "Prompt tokens received",
                                     ["model"], registry=r)
        self.generation_tokens = Counter("ridgeline_generation_tokens", "Tokens generated",
                                         ["model"], registry=r)
        self.ttft = Histogram("ridgeline_time_to_first_token_seconds",
                              "From the request being read to its first token",
                              ["model"], buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("ridgeline_inter_token_latency_seconds",
                             "Between consecutive token batches of one request",
                             ["model"], buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("ridgeline_request_latency_seconds",
                             "From the request being read to its last token",
                             ["model"], buckets=_E2E_BUCKETS, registry=r)
        r.register(EngineCollector(workers))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """Engine gauges and counters from each worker's stats snapshot."""

    def __init__(self, workers: Mapping[str, EngineWorker]) -> None:
        self.workers = workers

    def collect(self) -> Iterator[Metric]:
        kv = GaugeMetricFamily("ridgeline_kv_cache_usage_ratio",
                               "Fraction of KV cache blocks held by live sequences",
                               labels=["model"])
        running = GaugeMetricFamily("ridgeline_num_requests_running",
                                    "Sequences in the running batch", labels=["model"])
        waiting = GaugeMetricFamily("ridgeline_num_requests_waiting",
                                    "Sequences waiting to be scheduled", labels=["model"])
        preempt = CounterMetricFamily("ridgeline_num_preemptions",
                                      "Sequences preempted (KV freed, recomputed later)",
                                      labels=["model"])
        aborted = CounterMetricFamily("ridgeline_num_aborted_requests",
                                      "Requests aborted in the engine because their client "
                                      "disconnected", labels=["model"])
        prefix = GaugeMetricFamily("ridgeline_prefix_cache_hit_rate",
                                   "Prompt tokens found in the prefix cache / looked up",
                                   labels=["model"])
        accept = GaugeMetricFamily("ridgeline_spec_decode_acceptance_rate",
                                   "Accepted / proposed speculative tokens (NaN without "
                                   "speculative decoding)", labels=["model"])
        healthy = GaugeMetricFamily("ridgeline_engine_up", "1 while the engine thread runs",
                                    labels=["model"])
        for name, worker in self.workers.items():
            s = worker.stats
            kv.add_metric([name], s.kv_usage)
            running.add_metric([name], s.num_running)
            waiting.add_metric([name], s.num_waiting)
            preempt.add_metric([name], s.num_preemptions)
            aborted.add_metric([name], worker.num_aborted)
            prefix.add_metric([name], s.prefix_cache_hit_rate)
            rate = getattr(s, "spec_acceptance_rate", None)  # set by engines that speculate
            accept.add_metric([name], math.nan if rate is None else float(rate))
            healthy.add_metric([name], 1.0 if worker.is_running else 0.0)
        yield from (kv, running, waiting, preempt, aborted, prefix, accept, healthy)

    def describe(self) -> Iterator[Metric]:
        return iter(())
