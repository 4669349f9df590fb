"""Reading a generation request (chat, completions, Responses, Messages). `parse_call`
checks only what routing and quotas need (a JSON object; `model` and the `models`
fallback list, `route`; `messages`, `prompt` or `input`; `stream`, `stream_options`, `n`,
the reply's token limit; a Responses `previous_response_id`) and estimates its tokens for
tpm; the
upstream validates the rest, and its 4xx reaches the client as it is. The `_Call` it
returns builds the body for each upstream model, re-serialised only when a field must
change (the model name, the gateway-only `models` and `route`, a stream's request for its
usage); otherwise the client's bytes are forwarded as they are.

Split out of `ridgeline.platform.gateway`, which describes the whole design.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from ridgeline.platform.gateway_config import BodyTooLargeError, GatewayConfig, _clip
from ridgeline.wire import RequestError

MAX_FALLBACK_MODELS = 8


#: The generation routes: OpenAI's chat and text completions and Responses API, and
#: Anthropic's Messages API.
CallKind = Literal["chat", "completions", "responses", "messages"]
#: Where the request's own limit on the reply's tokens is, per kind (the first present).
_MAX_TOKENS_FIELDS = {"chat": ("max_completion_tokens", "max_tokens"),
                      "completions": ("max_tokens",), "responses": ("max_output_tokens",),
                      "messages": ("max_tokens",)}


@dataclass
class _Call:
    """One request as the gateway reads it: what routing and quotas need, and the body."""

    kind: CallKind
    raw: bytes
    body: dict[str, Any]
    names: list[str]                 # the models to try, in order
    stream: bool
    client_wants_usage: bool
    estimated_tokens: int
    prompt_estimate: int = 0         # the body's size in tokens, charged when no usage comes
    previous_response_id: str | None = None  # a Responses follow-up: only its server has it
    encoded: dict[str, bytes] = field(default_factory=dict)  # upstream body per model name

    def upstream_body(self, model: str) -> bytes:
        """The body to forward: the model the upstream knows, no gateway-only fields, and
        for a stream a request for its usage (for accounting, whether the client wants it
        or not; the Responses and Messages streams always report it)."""
        data = self.encoded.get(model)
        asks_usage = self.stream and self.kind in ("chat", "completions")
        if data is None and not asks_usage and model == self.body.get("model") \
                and "models" not in self.body and "route" not in self.body:
            data = self.raw  # nothing to change: the client's bytes as they are
        if data is None:
            body = {k: v for k, v in self.body.items() if k not in ("models", "route")}
            body["model"] = model
            if asks_usage:
                body["stream_options"] = {**(self.body.get("stream_options") or {}),
                                          "include_usage": True}
            data = self.encoded[model] = json.dumps(body, ensure_ascii=False,
                                                    separators=(",", ":")).encode()
        return data


def parse_call(raw: bytes, kind: CallKind, config: GatewayConfig) -> _Call:
    """Only what routing and quotas need is checked here; the upstream validates the
    rest (and its 4xx reaches the client as it is)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise RequestError("the request body is not valid JSON", hint="send a JSON object",
                           code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_json")
    names = _requested_models(body)
    if kind in ("chat", "messages"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _missing_or_invalid(body, "messages", "a non-empty list of messages")
    elif kind == "completions" and "prompt" not in body:
        raise _missing_or_invalid(body, "prompt", "a string, strings or token ids")
    elif kind == "responses" and "input" not in body and "previous_response_id" not in body:
        raise _missing_or_invalid(body, "input", "a string or a list of input items")
    previous = body.get("previous_response_id") if kind == "responses" else None
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise _missing_or_invalid(body, "previous_response_id", "a response id")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _missing_or_invalid(body, "stream", "true or false")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _missing_or_invalid(body, "stream_options", "an object")
    n = _positive_int(body, "n") or 1
    max_tokens = next((v for v in (_positive_int(body, f) for f in _MAX_TOKENS_FIELDS[kind])
                       if v is not None), config.default_max_tokens)
    prompt = body.get("prompt")
    prompts = len(prompt) if (kind == "completions" and isinstance(prompt, list) and prompt
                              and not isinstance(prompt[0], int)) else 1
    # The body's size stands in for the prompt's (tools and all); usage corrects it.
    estimate = math.ceil(len(raw) / config.chars_per_token) + max_tokens * n * prompts
    # Only chat and completions streams carry usage on request (and drop it otherwise).
    wants_usage = bool(options and options.get("include_usage")) or kind in ("responses",
                                                                             "messages")
    return _Call(kind, raw, body, names, stream, wants_usage, estimate,
                 prompt_estimate=math.ceil(len(raw) / config.chars_per_token),
                 previous_response_id=previous)


def _missing_or_invalid(body: dict[str, Any], key: str, what: str) -> RequestError:
    if key not in body:
        return RequestError(f"missing required field {key!r}", param=key,
                            code="missing_required_parameter")
    return RequestError(f"invalid value for {key!r}: expected {what}", param=key,
                        code="invalid_value")


def _positive_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _missing_or_invalid(body, key, "a positive integer")
    return value


def _requested_models(body: dict[str, Any]) -> list[str]:
    """The names to try, in order: `model`, then the `models` fallback list."""
    route = body.get("route")
    if route is not None and route != "fallback":
        raise RequestError(f"route {_clip(str(route))!r} is not supported (only 'fallback')",
                           param="route", code="invalid_value")
    names: list[str] = []
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str) or not model:
            raise _missing_or_invalid(body, "model", "a model name")
        names.append(model)
    models = body.get("models")
    if models is not None:
        if (not isinstance(models, list) or not models
                or not all(isinstance(m, str) and m for m in models)):
            raise _missing_or_invalid(body, "models", "a non-empty list of model names")
        names += [m for m in models if m not in names]
    if not names:
        raise RequestError("missing required field 'model'", param="model",
                           code="missing_required_parameter")
    if len(names) > MAX_FALLBACK_MODELS:
        raise RequestError(f"{len(names)} models to fall back over, more than this gateway's "
                           f"limit of {MAX_FALLBACK_MODELS}", param="models",
                           code="limit_exceeded")
    return names


def _too_large(limit: int) -> BodyTooLargeError:
    return BodyTooLargeError(f"the request body is over this gateway's limit of {limit} "
                             "bytes", hint="send a smaller request")
