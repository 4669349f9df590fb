"""What speculation proposes and what it remembers per sequence: a `Proposal` (tokens, the
draft's distribution, per-token confidence) and `SpecState` (the sequence's acceptance
estimate, its draft model progress, its n-gram index and the draft heads' last hidden
state), with the rule that plans k from the estimate."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ridgeline.engine.config import SpeculativeConfig
from ridgeline.engine.spec_decode.cost_model import StepCost

if TYPE_CHECKING:
    from ridgeline.engine.spec_decode.suffix_index import SuffixIndex

#: Weight of older rounds in a request's acceptance estimate, per round.
DECAY = 0.8
#: The estimate starts as if 4 of 5 proposed tokens had been accepted; after a pause it
#: restarts from a weaker guess (a probe with a small k).
PRIOR_ACCEPTED, PRIOR_REJECTED = 4.0, 1.0
PROBE_ACCEPTED, PROBE_REJECTED = 1.0, 0.5


@dataclass
class Proposal:
    token_ids: list[int]
    probs: torch.Tensor | None = None  # q as [len(token_ids), vocab]; None for one-hot
    # per token, the chance it is accepted if the ones before it are (None: not estimated)
    confidence: list[float] | None = None


@dataclass
class SpecState:
    """Per sequence: its acceptance estimate (decayed counts of accepted and rejected
    proposals, a geometric model: each proposal is accepted with the same chance) and
    the draft model's progress through it."""

    accepted: float = PRIOR_ACCEPTED
    rejected: float = PRIOR_REJECTED
    cooldown: int = 0  # candidate steps left without speculating
    num_proposed: int = 0
    num_accepted: int = 0
    draft_computed: int = 0  # leading tokens whose draft KV is in the draft cache
    draft_marked: int = 0  # leading blocks recorded as complete in the draft cache
    preemptions_seen: int = 0
    index: SuffixIndex | None = None  # n-gram mode "suffix": the sequence's own tokens
    evidence: list[int] = field(default_factory=list)  # buckets of the last proposal
    # draft heads: the hidden state of the row that emitted the sequence's newest token,
    # valid while the sequence has `hidden_at` tokens; the last head proposal's buckets
    hidden: torch.Tensor | None = None
    hidden_at: int = -1
    head_buckets: list[int] = field(default_factory=list)

    def plan_k(self, cfg: SpeculativeConfig, sizes_proposals: bool,
               best_k: Callable[[float, int], int] | None = None) -> int:
        """The most tokens to ask for: all a proposer that weighs its own tokens may give
        (its proposal is cut by `cut_proposal`), else `next_k`."""
        return cfg.num_speculative_tokens if sizes_proposals else self.next_k(cfg, best_k)

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def next_k(self, cfg: SpeculativeConfig,
               best_k: Callable[[float, int], int] | None = None) -> int:
        """How many tokens to propose now; `best_k(acceptance, k_max)` weighs them
        against the step's cost (default: a batch of one at the prior cost)."""
        if not cfg.adaptive:
            return cfg.num_speculative_tokens
        if self.cooldown > 0:
            self.cooldown -= 1
            return 0
        alpha = self.acceptance
        choose = best_k or StepCost().best_k
        k = 0 if alpha < cfg.min_acceptance else choose(alpha, cfg.num_speculative_tokens)
        if k == 0:  # not worth it: pause, then probe again with a fresh estimate
            self.cooldown = cfg.cooldown_steps
            self.accepted, self.rejected = PROBE_ACCEPTED, PROBE_REJECTED
        return k

    def record(self, proposed: int, accepted: int) -> None:
        self.num_proposed += proposed
        self.num_accepted += accepted
        self.accepted = DECAY * self.accepted + accepted
        self.rejected = DECAY * self.rejected + (1 if accepted < proposed else 0)
