"""A sequence is one sample being generated: its tokens, how many of them already have KV
in the cache (`num_computed_tokens`), its block table, and what it has produced so far.
A request with `n > 1` owns n sequences that share the prompt's KV blocks."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ridgeline.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()


#: What a step samples for one sequence: (token, logprob, top logprobs) per new token.
Emitted = list[tuple[int, float, "dict[int, float] | None"]]

#: Prompt tokens kept as left context for decoding the first output tokens.
DETOKENIZE_CONTEXT_TOKENS = 5


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # which of the request's n samples
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    # Blocks may only be shared between sequences with the same salt (see BlockManager).
    cache_salt: object = None
    generator: torch.Generator | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Hash of each full block of token_ids, computed lazily and kept across preemption.
    block_hashes: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading blocks of block_table already hashed
    # leading blocks of block_table released (now the null block): before the sliding
    # window of every token still to compute (BlockManager.sliding_window)
    num_released_blocks: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    # proposed tokens the speculator plans for the next step; the scheduler reserves
    # their KV slots when it schedules the sequence (and resets this)
    num_lookahead: int = 0
    # where the output stands in its request's grammar (engine/structured.py), if any
    grammar: Any = None
    # outputs
    logprobs: list[float] = field(default_factory=list)
    # the policy (weights) version each output token was sampled under (RL staleness)
    token_versions: list[int] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # incremental detokenisation (core/detokenizer.py): the decoded window starts a few
    # prompt tokens back (tokenizer-specific spacing), and nothing before the output is shown
    prefix_offset: int = -1
    read_offset: int = -1
    # what the last RequestOutput reported, to compute deltas
    reported_tokens: int = 0
    reported_text: int = 0

    def __post_init__(self) -> None:
        if self.params.logprobs is not None and self.top_logprobs is None:
            self.top_logprobs = []
        if self.read_offset < 0:
            self.read_offset = self.num_prompt_tokens
            self.prefix_offset = max(self.num_prompt_tokens - DETOKENIZE_CONTEXT_TOKENS, 0)

    def append_token(self, token: int, logprob: float, top: dict[int, float] | None,
                     version: int) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.token_versions.append(version)
        if self.top_logprobs is not None and top is not None:
            self.top_logprobs.append(top)

    def truncate(self, num_tokens: int) -> None:
        """Drop the tokens after the first `num_tokens` (a stop string ended the output
        inside a run of accepted tokens)."""
        out = num_tokens - self.num_prompt_tokens
        del self.token_ids[num_tokens:], self.logprobs[out:], self.token_versions[out:]
        if self.top_logprobs is not None:
            del self.top_logprobs[out:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}#{self.index}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table}, "
                f"{self.status.value})")


@dataclass(eq=False)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (first sample)
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(eq=False)
class Request:
    """What the user submitted: a prompt, its parameters and the n sequences sampling it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    error: str | None = None

    @classmethod
    def new(cls, request_id: str, prompt: str | None, ids: list[int], params: SamplingParams,
            cache_salt: int | None, device: torch.device) -> Request:
        """A request with its `params.n` sequences; a seeded request gives each sample a
        generator of its own, so its draws do not depend on its batch mates."""
        import torch


        seqs = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=device).manual_seed(
                    (params.seed + i * 0x9E3779B97F4A7C15) % 2**63)
            seq = Sequence(request_id=request_id, index=i, token_ids=list(ids),
                           num_prompt_tokens=len(ids), params=params, cache_salt=cache_salt,
                           generator=gen)
            seqs.append(seq)
        return cls(request_id, prompt, list(ids), params, seqs)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
