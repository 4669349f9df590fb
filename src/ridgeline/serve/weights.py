"""Weight updates over HTTP: a trainer on another process or machine pushes new weights
into `ridgeline serve` between two engine steps, as `EngineWorker.update_weights` does
in-process (RL with rollouts on a server; SGLang's update_weights_from_tensor).

    GET  /v1/weights?model=NAME            version, and the tensors the model takes
    POST /v1/weights?model=NAME&version=N  body: a safetensors file of HF-named tensors

The body may hold any subset of the model's tensors, in any float dtype (converted to the
engine's). Every tensor is checked first (a name the model has, its shape, finite
values), so a bad file is a 400 that changes nothing. The update goes to the model and
its `:fast` sibling (the same weights under another cache); requests in flight pause for
the copy and go on with the new weights, their later tokens stamped with the new version
(`token_versions` with `return_token_ids`). The prefix cache is dropped.

POST is refused (403) unless the server was started with `--enable-weight-updates`:
whoever may call it decides what the model says, so give the server an `--api-key` too
when it listens beyond loopback. Bodies may be up to `ServerLimits.max_weights_bytes`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request

from ridgeline.errors import RidgelineError
from ridgeline.wire import FAST_SUFFIX, RequestError, base_model_name

WEIGHTS_PATH = "/v1/weights"


class WeightUpdatesDisabled(RidgelineError):
    http_status = 403


def family(served: Mapping[str, Any], name: str) -> list[str]:
    """The served names that share `name`'s weights: the model and its `:fast` sibling
    (`:fast-q` holds int8 weights and takes no float updates)."""
    base = base_model_name(name) or name
    names = [n for n in (base, base + FAST_SUFFIX) if n in served]
    if not names:
        raise RequestError(f"the model {name[:100]!r} does not exist",
                           hint=f"served models: {', '.join(served)}", param="model",
                           code="model_not_found", status=404)
    return names


def _query_model(request: Request) -> str:
    model = request.query_params.get("model")
    if not model:
        raise RequestError("missing query parameter 'model'", param="model",
                           hint=f"{WEIGHTS_PATH}?model=NAME", code="missing_required_parameter")
    return model


def _query_version(request: Request) -> int | None:
    raw = request.query_params.get("version")
    if raw is None or raw == "":
        return None
    try:
        version = int(raw)
    except ValueError:
        version = -1
    if version < 0:
        raise RequestError(f"version must be an integer >= 0, not {raw[:40]!r}",
                           param="version")
    return version


def decode_weights(raw: bytes) -> dict[str, Any]:
    """The tensors of a safetensors file; a body that is not one, or holds a tensor that
    is not floating point or not finite, is a `RequestError`."""
    import torch
    from safetensors.torch import load

    if not raw:
        raise RequestError("the request body is empty; send a safetensors file of the "
                           "weights", code="invalid_weights")
    try:
        tensors = load(raw)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise RequestError(f"the body is not a safetensors file: {str(e)[:200]}",
                           hint="serialise with safetensors.torch.save",
                           code="invalid_weights") from None
    if not tensors:
        raise RequestError("the safetensors file holds no tensors", code="invalid_weights")
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise RequestError(f"tensor {name[:100]} has dtype {t.dtype}; weights are "
                               "floating point", code="invalid_weights")
        if not bool(torch.isfinite(t).all()):
            raise RequestError(f"tensor {name[:100]} holds NaN or infinite values",
                               hint="the trainer diverged; these weights were not loaded",
                               code="invalid_weights")
    return tensors


def add_weight_routes(app: FastAPI, served: Mapping[str, Any], enabled: bool) -> None:
    """GET and POST `/v1/weights` on `app` for the `ServedModel`s in `served`."""

    @app.get(WEIGHTS_PATH)
    async def describe(request: Request) -> dict[str, Any]:
        name = _query_model(request)
        engine = served[name if name in served else family(served, name)[0]].worker.engine
        quantized = engine.runner.model.quantized   # int8 weights take no float updates
        shapes = {} if quantized else await asyncio.to_thread(engine.weight_shapes)
        return {"object": "weights", "model": name, "version": engine.policy_version,
                "updates_enabled": enabled and not quantized, "quantized": quantized,
                "tensors": {n: list(s) for n, s in shapes.items()}}

    @app.post(WEIGHTS_PATH)
    async def update(request: Request) -> dict[str, Any]:
        if not enabled:
            raise WeightUpdatesDisabled(
                "weight updates are disabled on this server",
                hint="start it with `ridgeline serve --enable-weight-updates` (and an --api-key)")
        names = family(served, _query_model(request))
        version = _query_version(request)
        t0 = time.perf_counter()
        raw = bytearray()
        async for chunk in request.stream():  # bounded by the gate's weights limit
            raw += chunk
        t_received = time.perf_counter()
        tensors = await asyncio.to_thread(decode_weights, bytes(raw))
        del raw
        t1 = time.perf_counter()
        workers = [served[n].worker for n in names]
        items = list(tensors.items())
        # the first update checks every tensor before copying any; the siblings have the
        # same model, so after it passes theirs cannot fail on a shape
        count = 0
        for w in workers:
            count = await asyncio.to_thread(w.update_weights, items, version)
        now = workers[0].engine.policy_version
        return {"object": "weights", "model": names[0], "updated": names, "version": now,
                "tensors": count, "bytes": sum(t.numel() * t.element_size() for _, t in items),
                "receive_seconds": round(t_received - t0, 4),
                "decode_seconds": round(t1 - t_received, 4),
                "seconds": round(time.perf_counter() - t0, 4)}
