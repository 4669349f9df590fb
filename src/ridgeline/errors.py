"""The error hierarchy for mistakes a user can make.

Every `RidgelineError` carries a message that says what went wrong *and what to do*.
The CLI prints it as one line and exits with code 2; servers map it to a 4xx with an
OpenAI-style error body. Anything that is not a `RidgelineError` is a bug in Ridgeline.
"""

from __future__ import annotations


class RidgelineError(Exception):
    """Base class for errors a user can cause and fix."""

    #: HTTP status a server should answer with for this error.
    http_status: int = 400

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message} ({hint})")


class ConfigError(RidgelineError):
    """A configuration value is invalid, missing or contradictory."""


class NotFoundError(RidgelineError):
    """A file, model, task or object the user named does not exist."""

    http_status = 404


class UnsupportedError(RidgelineError):
    """The request is well formed but asks for something Ridgeline cannot do here."""


class SandboxError(RidgelineError):
    """A sandbox could not be created or used (closed, bad spec, missing backend)."""


class PathEscapeError(SandboxError):
    """A path given to the sandbox files API leads outside the workspace."""

    http_status = 403


class EngineError(RidgelineError):
    """A request to the inference engine is invalid (bad sampling params, too long).
    `param`: the request field it concerns, when there is one (servers report it)."""

    def __init__(self, message: str, *, hint: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.param = param


class ModelLoadError(RidgelineError):
    """Model weights or config could not be loaded (missing, corrupt, unsupported)."""


class TaskError(RidgelineError):
    """A task directory is malformed (missing file, bad YAML/TOML)."""


class ModelEndpointError(RidgelineError):
    """A model endpoint failed after retries (down, timing out, answering errors)."""

    http_status = 502


class AuthenticationError(RidgelineError):
    """A request without a valid API key."""

    http_status = 401


class PermissionDeniedError(RidgelineError):
    """An authenticated caller asked for something its key does not allow (a model, a tool,
    another tenant's object)."""

    http_status = 403


class ConflictError(RidgelineError):
    """The request conflicts with an object's state (an idempotency key reused with another
    body, cancelling a finished task)."""

    http_status = 409


class PayloadTooLargeError(RidgelineError):
    """A body or upload over its configured limit."""

    http_status = 413


class RateLimitError(RidgelineError):
    """A key's rpm, tpm or concurrency limit is reached; retry after `retry_after_s`."""

    http_status = 429

    def __init__(self, message: str, *, retry_after_s: float | None = None,
                 hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.retry_after_s = retry_after_s
