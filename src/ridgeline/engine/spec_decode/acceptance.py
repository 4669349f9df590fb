"""How likely a proposed token is to be accepted, learned from the tokens verified so far:
per bucket of n-gram evidence (`AcceptanceModel`) and per draft head and probability bin
(`HeadCalibration`), each a prior updated with every verified token."""

from __future__ import annotations

import bisect

from ridgeline.engine.spec_decode.suffix_index import Evidence

#: Match lengths that separate the buckets of `AcceptanceModel`: 1, 2, 3, 4-5, 6-8, 9-16, 17+.
MATCH_BUCKETS = (1, 2, 3, 5, 8, 16)
#: Prior chance that a proposed token is accepted, per match-length bucket, for matches in
#: the request's own tokens and in earlier requests' outputs; where the occurrences in
#: play disagree, SPLIT times that. Measured on SmolLM2-135M-Instruct (greedy, the
#: prompts of benchmarks/spec_bench.py): matches of 1-3 tokens are right about half the
#: time in the own context, long ones nearly always; earlier requests are weaker evidence.
PRIOR_LOCAL = (0.3, 0.45, 0.5, 0.75, 0.8, 0.9, 0.95)
PRIOR_GLOBAL = (0.1, 0.15, 0.25, 0.35, 0.5, 0.6, 0.7)
SPLIT = 0.75
#: The prior counts as this many verified tokens; a bucket's counts are halved when they
#: pass MODEL_CAP, so the estimate keeps following the model and the workload.
PRIOR_WEIGHT, MODEL_CAP = 32.0, 1024.0


class BucketCounts:
    """Per bucket of evidence, tokens kept of tokens verified, starting from a prior worth
    PRIOR_WEIGHT tokens; halved past MODEL_CAP, so the estimate follows the workload."""

    kept: list[float]
    seen: list[float]

    def chance(self, bucket: int) -> float:
        return self.kept[bucket] / self.seen[bucket]

    def update(self, bucket: int, accepted: bool) -> None:
        self.kept[bucket] += accepted
        self.seen[bucket] += 1
        if self.seen[bucket] > MODEL_CAP:
            self.kept[bucket] *= 0.5
            self.seen[bucket] *= 0.5


class AcceptanceModel(BucketCounts):
    """The chance that an n-gram proposal's token is accepted given the evidence behind it
    (`Evidence`: match length, agreement of the occurrences, own context or not), per
    bucket of evidence: a prior, updated with every verified token."""

    def __init__(self) -> None:
        self.kept = []
        self.seen = []
        for local in (False, True):
            for prior in (PRIOR_LOCAL if local else PRIOR_GLOBAL):
                for split in (False, True):
                    self.kept.append(PRIOR_WEIGHT * prior * (SPLIT if split else 1.0))
                    self.seen.append(PRIOR_WEIGHT)

    @staticmethod
    def bucket(e: Evidence) -> int:
        m = bisect.bisect_left(MATCH_BUCKETS, e.match)
        return (int(e.local) * (len(MATCH_BUCKETS) + 1) + m) * 2 + int(e.support < e.alive)


#: Buckets of a head's softmax probability for its token (`HeadCalibration`).
PROB_BINS = 10


class HeadCalibration(BucketCounts):
    """The chance that a draft head's token is accepted, per head and bin of the head's
    own probability for it: a prior (the bin's probability) updated with every verified
    token, as `AcceptanceModel` does for n-gram evidence."""

    def __init__(self, num_heads: int) -> None:
        self.num_heads = num_heads
        self.kept = [PRIOR_WEIGHT * (b + 0.5) / PROB_BINS
                     for _ in range(num_heads) for b in range(PROB_BINS)]
        self.seen = [PRIOR_WEIGHT] * (num_heads * PROB_BINS)

    @staticmethod
    def bucket(head: int, prob: float) -> int:
        return head * PROB_BINS + min(PROB_BINS - 1, int(prob * PROB_BINS))

    def best_gain(self, head: int) -> float:
        """The most tokens the heads after `head` can add to a chain that reached it
        (each at its most reliable bucket): the bound that lets a proposer skip them."""
        total, reach = 0.0, 1.0
        for h in range(head + 1, self.num_heads):
            reach *= max(self.chance(h * PROB_BINS + b) for b in range(PROB_BINS))
            total += reach
        return total
