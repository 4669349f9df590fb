"""`RemoteWeights`: the weights of a model served by `ridgeline serve
--enable-weight-updates`, replaced over HTTP (`POST /v1/weights`, see `serve.weights`).

It has the method an RL trainer syncs into, `update_weights(named_tensors, version)`, the
same as the in-process `EngineWorker`, so `PolicyTrainer.sync(RemoteWeights(url, model))`
moves a training step's weights to the server the rollouts run on. The tensors travel as
one safetensors file in their own dtype (the server converts to its engine's); the
server checks every tensor before it copies any.

    weights = RemoteWeights("http://127.0.0.1:8000/v1", "policy", api_key=key)
    weights.check_compatible(policy.engine_weights())   # the server serves this model
    trainer.sync(weights)                               # after each step
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import httpx
import torch

from ridgeline.errors import ConfigError, ModelEndpointError
from ridgeline.llm.openai_client import error_text, normalise_base_url


class RemoteWeights:
    def __init__(self, base_url: str, model: str, api_key: str | None = None, *,
                 timeout: float = 600.0, max_retries: int = 2) -> None:
        self.base_url = normalise_base_url(base_url)
        self.model = model
        self.max_retries = max_retries
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                                  headers=headers)
        self.last_update: dict[str, Any] = {}

    @property
    def url(self) -> str:
        return f"{self.base_url}/weights"

    def describe(self) -> dict[str, Any]:
        """The server's answer to GET /v1/weights: `version`, `updates_enabled`, and
        `tensors` (HF name -> shape)."""
        return self._send("GET", content=None, params={"model": self.model})

    def check_compatible(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A `ConfigError` unless the server takes updates and its model has exactly these
        tensors (HF names, shapes): the complete weights of the model it should serve."""
        info = self.describe()
        if not info.get("updates_enabled"):
            raise ConfigError(f"{self.base_url} does not accept weight updates",
                              hint="start it with `ridgeline serve --enable-weight-updates`")
        there = {n: tuple(s) for n, s in (info.get("tensors") or {}).items()}
        here = {n: tuple(t.shape) for n, t in named_tensors}
        if there != here:
            diff = sorted(n for n in set(there) | set(here) if there.get(n) != here.get(n))
            raise ConfigError(
                f"the model {self.model!r} on {self.base_url} is not this policy: "
                + ", ".join(f"{n} is {there.get(n)} there, {here.get(n)} here"
                            for n in diff[:3]),
                hint="serve the policy's model directory (`ridgeline serve --model DIR`)")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int | None = None) -> int:
        """Send the tensors; the server's engine (and its `:fast` sibling) samples with
        them from its next step on, stamping new tokens with `version`. Returns how many
        tensors the server loaded."""
        from safetensors.torch import save

        t0 = time.perf_counter()
        body = save(_unshared(named_tensors))
        params: dict[str, Any] = {"model": self.model}
        if version is not None:
            params["version"] = int(version)
        t1 = time.perf_counter()
        answer = self._send("POST", content=body, params=params)
        self.last_update = {**answer, "serialise_seconds": t1 - t0,
                            "request_seconds": time.perf_counter() - t1}
        return int(answer.get("tensors", 0))

    def _send(self, method: str, content: bytes | None, params: dict[str, Any]) -> dict[str, Any]:
        problem = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(0.5 * 2 ** (attempt - 1))
            try:
                # an update names its version, so sending it twice does no harm
                r = self._http.request(method, self.url, params=params,
                                       content=None if content is None else _chunks(content),
                                       headers={"content-type": "application/octet-stream"}
                                       if content is not None else None)
            except httpx.TransportError as e:
                problem = f"{type(e).__name__}: {e}"
                continue
            if r.status_code >= 500:
                problem = f"HTTP {r.status_code}: {error_text(r)[:300]}"
                continue
            if r.status_code >= 400:
                hint = {401: "check the API key",
                        403: "start the server with --enable-weight-updates",
                        404: "check the URL and the served model name"}.get(
                            r.status_code, "the server refused these weights; nothing changed")
                raise ModelEndpointError(f"{method} {self.url} answered HTTP {r.status_code}: "
                                         f"{error_text(r)[:300]}", hint=hint)
            return r.json()
        raise ModelEndpointError(f"{method} {self.url} failed after {self.max_retries + 1} "
                                 f"attempts; last: {problem}",
                                 hint="check that the server is running and reachable")

    def close(self) -> None:
        self._http.close()


def _chunks(body: bytes, size: int = 4 << 20) -> Iterator[bytes]:
    """The body in 4 MiB pieces (chunked transfer): httpx sends one huge `bytes` body
    at ~100 MB/s, pieces at ~1 GB/s."""
    view = memoryview(body)
    for start in range(0, len(view), size):
        yield bytes(view[start:start + size])


def _unshared(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, none sharing memory with another (safetensors refuses
    shared storage, e.g. tied embeddings)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in named_tensors:
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out
