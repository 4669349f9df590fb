"""Replaying speculation offline: what the engine's n-gram speculation would do on a
request whose greedy output is known, counted exactly in microseconds per step instead of
a forward pass (benchmarks/spec_bench.py --replay tunes the proposers with it)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ridgeline.engine.config import SpeculativeConfig
from ridgeline.engine.sampling_params import SamplingParams
from ridgeline.engine.sequence import Sequence, SequenceStatus
from ridgeline.engine.spec_decode.cost_model import StepCost, cut_proposal
from ridgeline.engine.spec_decode.proposal import SpecState
from ridgeline.engine.spec_decode.proposers import NgramProposer


@dataclass
class ReplayStats:
    """Counts of a replay (`replay_greedy`), summed over requests."""

    passes: int = 0  # target forward passes, the prefill pass included
    emitted: int = 0  # output tokens
    proposed: int = 0
    accepted: int = 0
    proposer_calls: int = 0
    proposer_seconds: float = 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.emitted / self.passes if self.passes else 0.0

    @property
    def rejected_per_token(self) -> float:
        return (self.proposed - self.accepted) / self.emitted if self.emitted else 0.0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None


def replay_greedy(proposer: NgramProposer, cfg: SpeculativeConfig, cost: StepCost,
                  prompt: list[int], output: list[int], max_tokens: int,
                  stats: ReplayStats | None = None) -> ReplayStats:
    """What the engine's speculation would do on one request decoded alone (a batch of one,
    every step a decode step after the prefill) whose greedy output is known: with greedy
    sampling the tokens a step keeps follow from the output alone, so this counts the
    engine's forward passes, proposed and accepted tokens exactly, in microseconds per step
    instead of a forward pass. `cost` stands in for the measured step cost (fixed
    coefficients make it deterministic). The proposer keeps its state across calls (the
    global index, the acceptance model), as an engine serving requests one by one does.
    Proposals running past the end of `output` (after its EOS) count as rejected there."""
    stats = stats if stats is not None else ReplayStats()
    seq = Sequence("replay", 0, list(prompt) + list(output[:1]), len(prompt),
                   SamplingParams(temperature=0, max_tokens=max_tokens))
    st = SpecState()
    stats.passes += 1  # the prefill pass emits the first token
    i, end = 1, len(output)
    while i < end:
        k = min(st.plan_k(cfg, proposer.sizes_proposals, cost.best_k),
                max_tokens - seq.num_output_tokens - 1)
        a = n = 0
        if k > 0:
            start = time.perf_counter()
            (prop,) = proposer.propose([(seq, k)], {seq: st}, None)
            stats.proposer_seconds += time.perf_counter() - start
            stats.proposer_calls += 1
            n = cut_proposal(prop, cfg, cost)
            while a < n and i + a < end and prop.token_ids[a] == output[i + a]:
                a += 1
            if n:
                st.record(n, a)
                proposer.on_verified(seq, st, seq.num_tokens, n, a)
        step = min(a + 1, end - i)
        seq.token_ids.extend(output[i:i + step])
        i += step
        stats.passes += 1
        stats.proposed += n
        stats.accepted += a
    stats.emitted += len(output)
    seq.status = SequenceStatus.FINISHED
    return stats
