"""What the engine returns: one `RequestOutput` per request and step (streaming), holding
a `CompletionOutput` per sample with everything produced so far and the new part."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ridgeline.engine.sequence import RequestMetrics

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]  # logprob of each sampled token
    top_logprobs: list[dict[int, float]] | None  # when SamplingParams.logprobs was set
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that matched
    delta_text: str = ""  # what this step added
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # set when the request failed alone (finish_reason "abort")

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens
