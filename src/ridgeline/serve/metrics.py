"""Prometheus metrics of the server, in a registry of its own (one per app, so several
apps in one process, as in tests, do not collide).

Request-side metrics are observed by the handlers (what a client experiences: time to
first token counts from the moment the request was read). Engine-side ones are read at
scrape time from each worker's latest stats snapshot, which the engine thread takes
after every step, so a scrape never touches the engine while it runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ridgeline.engine.core.worker import EngineWorker
    from ridgeline.engine.outputs import EngineStats

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


def _acceptance_rate(stats: EngineStats) -> float:
    rate = getattr(stats, "spec_acceptance_rate", None)  # set by engines that speculate
    return math.nan if rate is None else float(rate)


#: The engine's metrics, each labelled by model: (family, name, help, its value from a
#: worker and that worker's stats snapshot).
_ENGINE_METRICS: tuple[tuple[type[GaugeMetricFamily | CounterMetricFamily], str, str,
                             Callable[[EngineWorker, EngineStats], float]], ...] = (
    (GaugeMetricFamily, "ridgeline_kv_cache_usage_ratio",
     "Fraction of KV cache blocks held by live sequences", lambda w, s: s.kv_usage),
    (GaugeMetricFamily, "ridgeline_num_requests_running", "Sequences in the running batch",
     lambda w, s: s.num_running),
    (GaugeMetricFamily, "ridgeline_num_requests_waiting", "Sequences waiting to be scheduled",
     lambda w, s: s.num_waiting),
    (CounterMetricFamily, "ridgeline_num_preemptions",
     "Sequences preempted (KV freed, recomputed later)", lambda w, s: s.num_preemptions),
    (CounterMetricFamily, "ridgeline_num_aborted_requests",
     "Requests aborted in the engine because their client disconnected",
     lambda w, s: w.num_aborted),
    (GaugeMetricFamily, "ridgeline_prefix_cache_hit_rate",
     "Prompt tokens found in the prefix cache / looked up", lambda w, s: s.prefix_cache_hit_rate),
    (GaugeMetricFamily, "ridgeline_spec_decode_acceptance_rate",
     "Accepted / proposed speculative tokens (NaN without speculative decoding)",
     lambda w, s: _acceptance_rate(s)),
    (GaugeMetricFamily, "ridgeline_engine_up", "1 while the engine thread runs",
     lambda w, s: 1.0 if w.is_running else 0.0),
)


class EngineCollector(Collector):
    """Engine gauges and counters from each worker's stats snapshot."""

    def __init__(self, workers: Mapping[str, EngineWorker]) -> None:
        self.workers = workers

    def collect(self) -> Iterator[Metric]:
        # one stats snapshot per worker, so a scrape's numbers are of one moment
        snapshots = [(name, worker, worker.stats) for name, worker in self.workers.items()]
        for family, metric, doc, value in _ENGINE_METRICS:
            samples = family(metric, doc, labels=["model"])
            for name, worker, stats in snapshots:
                samples.add_metric([name], value(worker, stats))
            yield samples

    def describe(self) -> Iterator[Metric]:
        return iter(())
