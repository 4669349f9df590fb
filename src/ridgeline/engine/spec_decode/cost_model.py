"""What a verified token costs: `StepCost` fits the forward pass's seconds as `a + b *
tokens` over recent steps, and `best_len` / `cut_proposal` choose how many proposed tokens
are worth verifying in a batch of a given size."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ridgeline.engine.config import SpeculativeConfig

if TYPE_CHECKING:
    from ridgeline.engine.spec_decode.proposal import Proposal

#: Before any measurement: one more token in a forward pass costs this fraction of the
#: pass's fixed cost (about what a 2-core CPU shows for SmolLM2 at 1-8 tokens).
PRIOR_TOKEN_COST = 0.4


class StepCost:
    """Seconds of a decoding forward pass as `a + b * tokens`, fit by least squares over
    recent steps (older ones weigh less), so the choice of k follows the machine: its
    load, its thread count, the batch size. Until steps of different sizes have been
    seen, `b / a` is PRIOR_TOKEN_COST."""

    def __init__(self, decay: float = 0.97, fixed: tuple[float, float] | None = None) -> None:
        self.decay = decay
        self.fixed = fixed  # (a, b) to use instead of measurements (replays, tests)
        self._sums = (0.0, 0.0, 0.0, 0.0, 0.0)  # weight, x, y, x^2, x*y
        self.draft_seconds = 0.0  # one draft forward pass (EMA), 0 without a draft model

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        w, x, y, xx, xy = self._sums
        self._sums = (d * w + 1, d * x + tokens, d * y + seconds, d * xx + tokens * tokens,
                      d * xy + tokens * seconds)

    def observe_draft(self, seconds: float) -> None:
        self.draft_seconds = seconds if not self.draft_seconds else (
            0.9 * self.draft_seconds + 0.1 * seconds)

    def coefficients(self) -> tuple[float, float]:
        """(a, b): in seconds once anything was measured, else in units of a."""
        if self.fixed is not None:
            return self.fixed
        w, x, y, xx, xy = self._sums
        if w > 0:
            spread = w * xx - x * x
            if w >= 4 and spread >= 0.25 * w * w:  # token counts really differ
                b = (w * xy - x * y) / spread
                a = (y - b * x) / w
                if a > 0 and b > 0:
                    return a, b
                if b <= 0:  # extra tokens are free (latency-bound)
                    return y / w, 1e-6 * y / w
                return 1e-6 * y / w, y / x  # all cost is per token (compute-bound)
            a = (y / w) / (1 + PRIOR_TOKEN_COST * x / w)  # the prior, at the measured scale
            return a, PRIOR_TOKEN_COST * a
        return 1.0, PRIOR_TOKEN_COST

    def best_k(self, alpha: float, k_max: int, batch: int = 1, planned: int = 0) -> int:
        """The k that maximizes the batch's expected tokens per second when one of its
        `batch` sequences, accepting each proposal with chance `alpha`, proposes k more
        tokens on top of `planned` already proposed by others (0: do not speculate)."""
        return self.best_len([alpha] * k_max, batch, planned)

    def best_len(self, chances: list[float], batch: int = 1, planned: int = 0) -> int:
        """`best_k` for a proposal whose j-th token is accepted with chance `chances[j]`
        when the ones before it are: how many of its tokens to verify."""
        a, b = self.coefficients()
        d = self.draft_seconds if self._sums[0] > 0 else 0.0
        base = a + b * (batch + planned)
        best, best_rate = 0, batch / base
        emitted = reach = 1.0  # expected tokens this sequence emits; P(all so far kept)
        for k, chance in enumerate(chances, 1):
            reach *= chance
            emitted += reach
            rate = (emitted + batch - 1) / (base + (b + d) * k)
            if rate > best_rate:
                best, best_rate = k, rate
        return best


def cut_proposal(prop: Proposal, cfg: SpeculativeConfig, cost: StepCost, batch: int = 1,
                 planned: int = 0) -> int:
    """How many of the proposal's tokens to verify: where the proposer weighed them and k
    is adaptive, the count that pays (`StepCost.best_len`), but none that is less likely
    than `min_proposal_chance` to be accepted; else all."""
    if prop.confidence is None or not cfg.adaptive:
        return len(prop.token_ids)
    chances = prop.confidence[:len(prop.token_ids)]
    reach = 1.0
    for n, chance in enumerate(chances):
        reach *= chance
        if reach < cfg.min_proposal_chance:
            chances = chances[:n]
            break
    return cost.best_len(chances, batch, planned)


def expected_kept(chances: list[float] | None) -> float:
    """Tokens of a proposal expected to be accepted (each needs all before it)."""
    total, reach = 0.0, 1.0
    for c in chances or []:
        reach *= c
        total += reach
    return total
