"""The upstreams and how a request is routed over them. `Upstream`: one server's config
and what the gateway has learnt about it (its models, its latency, its circuit breaker:
closed; open for `cooldown_s` after `failure_threshold` failures in a row; half-open for
one probe). `Target`: one upstream asked for one model. `UpstreamPool`: the shared
keep-alive client, the model lists of "*" upstreams (refreshed in the background, and
re-asked for a name nobody serves), and the order to try them: `targets` (the `:fast` and
`:nitro` variants, smooth weighted round robin over replicas, cooling upstreams last) and
`plan` (a fallback list, every healthy target before any cooling one).

Nothing here sends a completion: `gateway_forwarding` walks the plan and reports each
attempt's outcome to the upstream's circuit. Split out of `ridgeline.platform.gateway`,
which describes the whole design and re-exports these names.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from ridgeline.errors import ConfigError
from ridgeline.platform.gateway_config import GatewayConfig, UpstreamConfig, _clip
from ridgeline.wire import FAST_SUFFIX, RequestError, split_variant

# the logger's name from before the split, so logging configured for it keeps applying
log = logging.getLogger("ridgeline.platform.gateway")

VARIANT_HEADER = "x-ridgeline-variant"
UPSTREAM_HEADER = "x-ridgeline-upstream"
_UNKNOWN_MODEL_RECHECK_S = 1.0      # an unknown name re-asks "*" upstreams at most this often


# ---- upstream state ------------------------------------------------------------------------


class Upstream:
    """An upstream's config and what the gateway has learnt about it: its models, its
    latency, and its circuit (closed; open for `cooldown_s` after `failure_threshold`
    failures in a row; then half-open, when one request probes it)."""

    def __init__(self, config: UpstreamConfig, failure_threshold: int = 3) -> None:
        self.config = config
        self.name = config.name
        self.weight = config.weight
        self.failure_threshold = failure_threshold
        self.chat_url = config.base_url + "/chat/completions"
        self.completions_url = config.base_url + "/completions"
        self.responses_url = config.base_url + "/responses"
        #: Where each kind of generation request goes.
        self.urls = {"chat": self.chat_url, "completions": self.completions_url,
                     "responses": self.responses_url, "messages": config.base_url + "/messages"}
        self.models_url = config.base_url + "/models"
        self.headers = {"content-type": "application/json"}
        if config.api_key_env:
            key = os.environ.get(config.api_key_env)
            if not key:
                raise ConfigError(f"upstream {config.name!r}: the environment variable "
                                  f"{config.api_key_env} holding its API key is not set")
            self.headers["authorization"] = f"Bearer {key}"
        self.timeout = httpx.Timeout(config.timeout_s, connect=min(config.timeout_s, 5.0))
        self.dynamic = config.models == "*"
        self.models: frozenset[str] = frozenset() if self.dynamic else frozenset(config.models)
        self.listed_at: float | None = None  # when /v1/models last answered
        self.latency_s: float | None = None  # EWMA of time to the response (or first chunk)
        self.failures = 0                    # in a row
        self.cooldown_until = 0.0
        self.probing = False

    def circuit(self, now: float) -> Literal["closed", "open", "half-open"]:
        if self.failures < self.failure_threshold:
            return "closed"
        return "open" if now < self.cooldown_until else "half-open"

    def cooling(self, now: float) -> bool:
        """Tried only after every other candidate: open, or half-open with its probe out."""
        state = self.circuit(now)
        return state == "open" or (state == "half-open" and self.probing)

    def begin(self, now: float) -> None:
        if self.circuit(now) == "half-open":
            self.probing = True  # this request is the probe

    def succeeded(self, latency_s: float, alpha: float) -> None:
        self.failures = 0
        self.probing = False
        self.latency_s = latency_s if self.latency_s is None else \
            alpha * latency_s + (1 - alpha) * self.latency_s

    def failed(self, now: float, cooldown_s: float) -> None:
        was = self.circuit(now)
        self.failures += 1
        self.probing = False
        if self.failures >= self.failure_threshold:
            self.cooldown_until = now + cooldown_s
            if was != "open":
                log.warning("upstream %s: %d failures in a row, cooling down for %g s",
                            self.name, self.failures, cooldown_s)

    def describe(self, now: float) -> dict[str, Any]:
        return {"circuit": self.circuit(now), "failures": self.failures,
                "models": sorted(self.models),
                "latency_ms": None if self.latency_s is None else round(self.latency_s * 1e3, 3)}


@dataclass(frozen=True)
class Target:
    """One way to answer a requested name: this upstream, asked for `model`."""

    requested: str
    upstream: Upstream
    model: str
    variant: str | None  # "fast", "fastest-upstream" or None

    def headers(self) -> dict[str, str]:
        headers = {UPSTREAM_HEADER: self.upstream.name}
        if self.variant is not None:
            headers[VARIANT_HEADER] = self.variant
        return headers


class UpstreamPool:
    """The upstreams and what routing knows of them: the shared HTTP client, each
    upstream's models, and the order to try them for a name. `Gateway` is one."""

    def __init__(self, config: GatewayConfig, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.upstreams = [Upstream(u, config.failure_threshold) for u in config.upstreams]
        self._client: httpx.AsyncClient | None = None
        self._swrr: dict[str, dict[str, float]] = {}   # model -> upstream -> current weight
        self._refreshing: asyncio.Future[Any] | None = None
        self._last_forced_refresh = -math.inf

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:  # made in the serving loop, on first use
            n = self.config.max_connections
            self._client = httpx.AsyncClient(
                limits=httpx.Limits(max_connections=n, max_keepalive_connections=n,
                                    keepalive_expiry=30.0))
        return self._client

    async def aclose(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # -- models -------------------------------------------------------------------------------
    async def refresh_models(self) -> None:
        """Ask every "*" upstream for its models (one that does not answer keeps its
        last list)."""
        await asyncio.gather(*(self._list_models(u) for u in self.upstreams if u.dynamic))

    async def _list_models(self, upstream: Upstream) -> None:
        try:
            r = await self.client.get(upstream.models_url, headers=upstream.headers,
                                      timeout=upstream.timeout)
            r.raise_for_status()
            data = r.json().get("data", [])
            upstream.models = frozenset(m["id"] for m in data if isinstance(m.get("id"), str))
            upstream.listed_at = self.clock()
        except (httpx.HTTPError, ValueError, AttributeError, TypeError) as e:
            log.warning("upstream %s: listing its models failed: %s", upstream.name, e)

    def _refresh_in_background(self) -> None:
        """Re-list stale "*" upstreams without holding up the request that noticed."""
        if self._refreshing is not None and not self._refreshing.done():
            return
        now = self.clock()
        if any(u.dynamic and (u.listed_at is None
                              or now - u.listed_at > self.config.models_refresh_s)
               for u in self.upstreams):
            self._refreshing = asyncio.ensure_future(self.refresh_models())

    def known_models(self) -> set[str]:
        return {m for u in self.upstreams for m in u.models}

    def _serves(self, name: str) -> bool:
        fast_base = _fast_base(name)
        wanted = (name,) if fast_base is None else (fast_base + FAST_SUFFIX, fast_base)
        return any(w in u.models for u in self.upstreams for w in wanted)

    async def _ensure_known(self, names: list[str]) -> None:
        """404 for a name no upstream serves. It may be a model a "*" upstream started
        serving since its last listing: ask again first, at most once a second."""
        if all(self._serves(n) for n in names):
            self._refresh_in_background()
            return
        now = self.clock()
        if any(u.dynamic for u in self.upstreams) and \
                now - self._last_forced_refresh >= _UNKNOWN_MODEL_RECHECK_S:
            self._last_forced_refresh = now
            await self.refresh_models()
        for n in names:
            if not self._serves(n):
                known = sorted(self.known_models())
                shown = ", ".join(known[:20]) + (" ..." if len(known) > 20 else "")
                raise RequestError(f"the model {_clip(n)!r} does not exist",
                                   hint=f"models: {shown or 'none (no upstream answers)'}",
                                   param="model", code="model_not_found", status=404)

    # -- routing ------------------------------------------------------------------------------
    def targets(self, name: str) -> list[Target]:
        """The upstreams for one requested name, in the order to try them (cooling ones
        last)."""
        now = self.clock()
        fast_base = _fast_base(name)
        if fast_base is not None:
            fast = fast_base + FAST_SUFFIX
            ups = [u for u in self.upstreams if fast in u.models]
            if ups:
                return [Target(name, u, fast, "fast") for u in self._order(fast, ups, now)]
            # No fast variant anywhere: the quickest upstream of the standard model (one
            # not measured yet counts as quickest, so that it gets measured).
            ups = [u for u in self.upstreams if fast_base in u.models]
            ups.sort(key=lambda u: (u.cooling(now), u.latency_s or 0.0))
            return [Target(name, u, fast_base, "fastest-upstream") for u in ups]
        ups = [u for u in self.upstreams if name in u.models]
        return [Target(name, u, name, None) for u in self._order(name, ups, now)]

    def _order(self, model: str, ups: list[Upstream], now: float) -> list[Upstream]:
        """Healthy upstreams first, the first of them by smooth weighted round robin
        (each gets its weight's share, interleaved), the rest by weight; cooling last."""
        healthy = [u for u in ups if not u.cooling(now)]
        cooling = [u for u in ups if u.cooling(now)]
        if len(healthy) > 1:
            current = self._swrr.setdefault(model, {})
            total = 0.0
            for u in healthy:
                current[u.name] = current.get(u.name, 0.0) + u.weight
                total += u.weight
            first = max(healthy, key=lambda u: current[u.name])
            current[first.name] -= total
            healthy = [first, *sorted((u for u in healthy if u is not first),
                                      key=lambda u: -u.weight)]
        return healthy + cooling

    def plan(self, names: list[str]) -> list[Target]:
        """Every (model, upstream) to try for a fallback list, in order: the healthy ones
        of every model before any cooling one (skipped while others are available)."""
        now = self.clock()
        every = [t for n in names for t in self.targets(n)]
        return ([t for t in every if not t.upstream.cooling(now)]
                + [t for t in every if t.upstream.cooling(now)])

    def describe(self) -> dict[str, Any]:
        now = self.clock()
        return {u.name: u.describe(now) for u in self.upstreams}


def _fast_base(name: str) -> str | None:
    """`x` for `x:fast` or `x:nitro` (the fast variant), else None."""
    base, variant = split_variant(name)
    return base if variant in ("fast", "nitro") else None


def _base_name(name: str) -> str:
    """The name allow-lists hold: without :fast, :fast-q or :nitro."""
    return split_variant(name)[0]
