"""What the engine returns: one `RequestOutput` per request and step (streaming), holding
a `CompletionOutput` per sample with everything produced so far and the new part; and
`EngineStats`, a snapshot of its scheduler, KV pool, prefix cache and speculation."""

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
    # the weights version each token was sampled under (`LLMEngine.policy_version`)
    token_versions: list[int] = field(default_factory=list)

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


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_blocks: int
    num_free_blocks: int
    kv_usage: float  # fraction of usable blocks held by live sequences
    kv_bytes_per_token: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found cached
    num_evictions: int
    num_steps: int
    num_prompt_tokens_computed: int
    num_generated_tokens: int
    kv_cache_dtype: str = "auto"
    kv_capacity_tokens: int = 0  # tokens the KV pool holds
    # speculative decoding (None / 0 when the engine does not speculate)
    spec_acceptance_rate: float | None = None  # accepted / proposed tokens
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_steps: int = 0  # steps that verified proposals

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries
