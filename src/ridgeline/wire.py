"""The HTTP side both servers share (`ridgeline serve` and the platform's API): OpenAI's
error bodies (and Anthropic's, for `/v1/messages`), the request error that carries them,
and the names of a model's variants.

Below `serve` and `platform` (it imports only `errors`), so the platform needs nothing of
the model server to speak the same wire format.
"""

from __future__ import annotations

from typing import Any

from ridgeline.errors import RidgelineError


class RequestError(RidgelineError):
    """A bad HTTP request, with the OpenAI `param` and `code` it concerns."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int = 400, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.param = param
        self.code = code
        self.http_status = status


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_for(exc: RidgelineError) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body for a user mistake."""
    status = exc.http_status
    param = getattr(exc, "param", None)
    code = getattr(exc, "code", None)
    return status, error_body(str(exc), type=error_type(status), param=param, code=code)


def internal_error_body(request_id: str) -> dict[str, Any]:
    """What a client learns of a bug: that it happened, and the id to find it in the log."""
    return error_body(f"internal error (request id {request_id})", type="internal_error",
                      code="internal_error")


# ---- Anthropic's error shape (/v1/messages) ------------------------------------------------

#: Anthropic's error `type` per HTTP status; any other 4xx is an invalid request, any
#: other 5xx an API error.
_ANTHROPIC_ERROR_TYPES = {401: "authentication_error", 403: "permission_error",
                          404: "not_found_error", 413: "request_too_large",
                          429: "rate_limit_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``, as Anthropic's API answers."""
    kind = _ANTHROPIC_ERROR_TYPES.get(status) or ("api_error" if status >= 500
                                                  else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def as_anthropic_error(body: dict[str, Any], status: int) -> dict[str, Any]:
    """An OpenAI-shaped error body in Anthropic's shape (the same message)."""
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return anthropic_error_body(status, str(message or f"HTTP {status}"))


# ---- model variants ---------------------------------------------------------------------------

#: `<model>:fast` names the lossless high-speed variant of `<model>` (the same weights),
#: `<model>:fast-q` the quantized one (int8 KV cache and weights); `<model>:nitro`
#: (OpenRouter's name for "the fastest provider") asks a gateway for the fast variant.
FAST_SUFFIX = ":fast"
FAST_Q_SUFFIX = ":fast-q"
NITRO_SUFFIX = ":nitro"
_VARIANTS = {FAST_Q_SUFFIX: "fast-q", FAST_SUFFIX: "fast", NITRO_SUFFIX: "nitro"}


def split_variant(name: str) -> tuple[str, str | None]:
    """`(<model>, variant)` for `<model>:fast`, `:fast-q` or `:nitro` (variant "fast",
    "fast-q" or "nitro"); `(name, None)` for any other name, a bare suffix included."""
    for suffix, variant in _VARIANTS.items():
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[:-len(suffix)], variant
    return name, None


def base_model_name(name: str) -> str | None:
    """`<model>` for a server's variant name `<model>:fast` or `<model>:fast-q`, else
    None (`:nitro` is a gateway's request, never a served name)."""
    base, variant = split_variant(name)
    return base if variant in ("fast", "fast-q") else None
