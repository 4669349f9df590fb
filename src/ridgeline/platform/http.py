"""HTTP glue every platform router shares: OpenAI-style error bodies and the caller's
identity from its API key.

    app = FastAPI()
    install_error_handlers(app)
    principal = principal_dependency(keystore)

    @app.get("/v1/things")
    async def things(who: Principal = Depends(principal)) -> ...

Routes that take a body declare none to FastAPI (which would read and parse it before
the key is checked): they authenticate first and then `read_body`, which refuses a body
over its limit from `Content-Length` or, for a chunked one, as soon as the bytes read pass
it. A 401 or 413 closes the connection, so an unread body is not drained either.
`install_docs` serves `/openapi.json`, `/docs` and `/redoc` to holders of a key only.

`install_error_handlers` answers a `RidgelineError` with its status and the body
``{"error": {"message", "type", "param", "code"}}`` (`wire.error_for`; a 429
also carries Retry-After, a 401 ``WWW-Authenticate: Bearer``), FastAPI's validation
errors with a 400 naming the first bad field, unknown routes and methods with 404/405 in
the same shape, and a bug with a 500 that says only "internal error" and the request
id, the exception and traceback going to the log. Every response carries its request id
in ``x-request-id``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ridgeline.errors import (
    AuthenticationError, PayloadTooLargeError, RateLimitError, RidgelineError,
)
from ridgeline.platform.keys import InvalidApiKeyError, KeyStore
from ridgeline.platform.limits import retry_after_header
from ridgeline.platform.principal import Principal
from ridgeline.wire import error_body, error_for, error_type, internal_error_body

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


def error_response(exc: RidgelineError) -> JSONResponse:
    """The JSON response for a user mistake, with the headers its status calls for."""
    status, body = error_for(exc)
    headers: dict[str, str] = {}
    if isinstance(exc, RateLimitError) and exc.retry_after_s is not None:
        headers["retry-after"] = retry_after_header(exc.retry_after_s)
    if isinstance(exc, AuthenticationError):
        headers["www-authenticate"] = "Bearer"
    if isinstance(exc, (AuthenticationError, PayloadTooLargeError)):
        # the request's body may still be on its way: close rather than drain it
        headers["connection"] = "close"
    return JSONResponse(body, status_code=status, headers=headers)


async def read_body(request: Request, limit: int, *,
                    too_large: Callable[[int], PayloadTooLargeError] | None = None) -> bytes:
    """The request's body, refused (413, `too_large(limit)`) from its Content-Length or as
    soon as the bytes read pass `limit`, so a chunked body is never buffered past it
    either. Call it only after the caller is authenticated."""
    refuse = too_large or _too_large
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        await _drain(request)
        raise refuse(limit)
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            await _drain(request)
            raise refuse(limit)
        parts.append(part)
    return b"".join(parts)


#: What is read and dropped of an authenticated client's refused body before the 413 and
#: the close: a socket closed with unread data is reset, and the reset can destroy the 413
#: on its way to a client that is still sending. Bounded in bytes and time (nothing is
#: kept); past either, the connection closes anyway.
DRAIN_BYTES = 64 << 20
DRAIN_SECONDS = 2.0


async def _drain(request: Request) -> None:
    drained = 0
    try:
        async with asyncio.timeout(DRAIN_SECONDS):
            async for part in request.stream():
                drained += len(part)
                if drained > DRAIN_BYTES:
                    return
    except (TimeoutError, ClientDisconnect, RuntimeError):  # slow, gone, or all read
        return


def parse_body(raw: bytes, model: type[M]) -> M:
    """`model` from a JSON body read by `read_body`, or the validation error FastAPI
    raises for a declared body (its locations start with "body"), so the 400 names the
    field the same way."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])}
                                      for err in e.errors()]) from None


def _too_large(limit: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"the request body is over this route's limit of {limit} "
                                "bytes", hint="send a smaller request")


def request_id_of(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id", "unknown")


def validation_error_body(exc: RequestValidationError) -> dict[str, Any]:
    """The OpenAI-style body for a request FastAPI could not validate: its first problem,
    naming the field (`param`) without the body/query/path/header prefix."""
    errors = exc.errors()
    err = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(p) for p in err.get("loc", ())]
    if loc and loc[0] in ("body", "query", "path", "header"):
        loc = loc[1:]
    param = ".".join(loc) or None
    if err.get("type") == "missing":
        return error_body(f"missing required field {param!r}", param=param,
                          code="missing_required_parameter")
    if err.get("type") == "json_invalid":
        return error_body("invalid JSON in the request body", code="invalid_json")
    where = f" for {param!r}" if param else ""
    return error_body(f"invalid value{where}: {err.get('msg')}", param=param,
                      code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-style answers to every error the app's routes can raise (see the module)."""

    @app.exception_handler(RidgelineError)
    async def _user_error(_: Request, exc: RidgelineError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error_body(exc), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), type=error_type(exc.status_code),
                                       code=exc.status_code),
                            status_code=exc.status_code, headers=exc.headers)

    app.add_middleware(_RequestIds)


class _RequestIds:
    """Pure ASGI (streams pass through untouched): a request id for every request, in
    the `x-request-id` response header and `request.state.request_id`, and the 500 for
    a bug, logged with that id."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = request_id
        header = (b"x-request-id", request_id.encode())
        started = False

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("internal error (request id %s, %s %s)", request_id,
                          scope.get("method"), scope.get("path"))
            if started:  # half sent: it can only be cut short
                raise
            body = json.dumps(internal_error_body(request_id)).encode()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"), header]})
            await send({"type": "http.response.body", "body": body})


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def api_key_of(request: Request) -> str | None:
    """The key of ``Authorization: Bearer <key>`` or, as Anthropic's clients send it,
    ``x-api-key: <key>``."""
    token = bearer_token(request)
    if token is None:
        token = request.headers.get("x-api-key", "").strip() or None
    return token


def principal_dependency(keystore: KeyStore) -> Callable[[Request], Awaitable[Principal]]:
    """A FastAPI dependency: the `Principal` of the request's key (``Authorization:
    Bearer`` or ``x-api-key``), or a 401 (`InvalidApiKeyError`)."""

    async def principal(request: Request) -> Principal:
        token = api_key_of(request)
        if token is None:
            raise InvalidApiKeyError("no API key given",
                                     hint="send the header 'Authorization: Bearer <key>'")
        return keystore.authenticate(token).principal

    return principal


def install_docs(app: FastAPI, principal: Callable[..., Any]) -> None:
    """`/openapi.json`, `/docs` and `/redoc` behind the API key (the app must be made
    with ``openapi_url=None, docs_url=None, redoc_url=None``): the schema names every
    route and parameter, which is no business of a caller without a key."""
    title = app.title

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(_: Principal = Depends(principal)) -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(_: Principal = Depends(principal)) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{title} - docs")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(_: Principal = Depends(principal)) -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{title} - ReDoc")


__all__ = ["api_key_of", "bearer_token", "error_response", "install_docs", "install_error_handlers",
           "internal_error_body", "parse_body", "principal_dependency", "read_body",
           "request_id_of", "validation_error_body"]
