"""What the gateway is configured with, and the errors it answers with: `UpstreamConfig`
(one OpenAI-compatible server: URL, API key variable, models, weight, timeout),
`GatewayConfig` (the upstreams, body limit, retries, circuit breaker, model refresh, tpm
estimates, connection pool) and the OpenAI-shaped errors (`model_not_allowed`,
`upstream_unavailable`, `request_too_large`, `upstream_rate_limited`).

No behaviour and none of the gateway's HTTP stack, so `ridgeline.platform.config` reads a
gateway's settings without importing the gateway itself. Split out of
`ridgeline.platform.gateway`, which describes the whole design and re-exports these names.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ridgeline.errors import (
    ModelEndpointError, PayloadTooLargeError, PermissionDeniedError, RateLimitError,
)
from ridgeline.llm.openai_client import normalise_base_url


# ---- config -----------------------------------------------------------------------------------


class UpstreamConfig(BaseModel):
    """One OpenAI-compatible server the gateway forwards to."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    base_url: str = Field(description="its OpenAI base URL (http://host:port or .../v1)")
    api_key_env: str | None = Field(None, description="environment variable holding the "
                                    "upstream's API key (sent as Bearer)")
    models: list[str] | Literal["*"] = Field("*", description="model names it serves; '*': "
                                             "ask its /v1/models")
    weight: float = Field(1.0, gt=0, description="share of its models' traffic")
    timeout_s: float = Field(120.0, gt=0, description="per read; connecting gets at most 5 s")

    @field_validator("base_url")
    @classmethod
    def _url(cls, value: str) -> str:
        return normalise_base_url(value)


class GatewayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    upstreams: list[UpstreamConfig] = Field(
        default_factory=lambda: [UpstreamConfig(name="local", base_url="http://127.0.0.1:8000")],
        description="default: `ridgeline serve` on this machine")
    max_body_bytes: int = Field(4 * 2**20, ge=1)
    retries: int = Field(2, ge=0, description="retries on one upstream after a connection "
                         "error, 502 or 503")
    retry_backoff_s: float = Field(0.05, ge=0, description="first backoff; doubles each retry")
    failure_threshold: int = Field(3, ge=1, description="failures in a row before a cooldown")
    cooldown_s: float = Field(30.0, gt=0)
    models_refresh_s: float = Field(60.0, gt=0, description="how often '*' upstreams are "
                                    "asked for their models")
    default_max_tokens: int = Field(1024, ge=1, description="the completion estimate for "
                                    "tpm when a request sets no max_tokens")
    chars_per_token: float = Field(4.0, gt=0, description="prompt estimate for tpm")
    latency_ewma_alpha: float = Field(0.2, gt=0, le=1)
    max_connections: int = Field(1024, ge=1, description="to all upstreams together")

    @model_validator(mode="after")
    def _unique(self) -> GatewayConfig:
        names = [u.name for u in self.upstreams]
        if len(set(names)) != len(names):
            raise ValueError(f"upstream names must be unique: {names}")
        return self


# ---- errors -------------------------------------------------------------------------------------


class ModelNotAllowedError(PermissionDeniedError):
    code = "model_not_allowed"
    param = "model"


class UpstreamError(ModelEndpointError):
    """Every upstream that could answer failed (502)."""

    code = "upstream_unavailable"


class BodyTooLargeError(PayloadTooLargeError):
    code = "request_too_large"


class UpstreamRateLimitError(RateLimitError):
    """Every upstream answered 429."""

    code = "upstream_rate_limited"


def _clip(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
