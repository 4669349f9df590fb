"""Speculative decoding inside continuous batching.

Each step, after the scheduler has picked the batch, the `Speculator`:

1. plans: every decoding sequence (one new token, no penalties) gets the k that
   maximizes the batch's expected tokens per second, from the chance that its proposals
   are accepted and the measured cost of a forward pass (`StepCost`: seconds = a + b *
   tokens, fit over recent steps). On a small batch a verified token costs a fraction of
   a step; on a large, compute-bound one as much as a decoded token, so there k falls to
   0 and speculation switches itself off. Never more than `max_batch_size` sequences.
   The chance is the sequence's recent acceptance (draft model, n-gram mode "lookup"),
   or, n-gram mode "suffix", each proposed token's own from the evidence behind it: the
   proposal is then cut after it is made (`cut_proposal`);
2. proposes: the n-gram proposer looks the sequence's last tokens up in its prompt and
   output (mode "suffix": in an index kept per sequence, and in earlier requests'
   outputs; see suffix_index.py), the draft proposer runs a small model k times;
3. has the scheduler reserve look-ahead KV slots for the proposals
   (`Scheduler.reserve_lookahead`; when the pool is short the sequence just decodes);
4. the engine's `ModelRunner` verifies them in the step's one forward pass, where a
   speculating sequence contributes its last token plus its proposals (a multi-token
   decode over the paged KV) and every other sequence what the scheduler gave it;
5. `accept` samples the step: rejection sampling (`rejection_sampler`) for speculating
   sequences, the plain sampler for the rest; the scheduler then advances
   `num_computed_tokens` by the kept tokens only and frees blocks that hold nothing but
   rejected positions (`Scheduler.update_from_output`).

Unverified tokens never enter `Sequence.token_ids` before acceptance, so the prefix cache
(which hashes only full blocks of `token_ids`) never registers a block holding them.

The draft model has its own paged cache with the same block ids as the target's: block
tables, preemption and prefix sharing need no second bookkeeping. The draft computes
lazily (only when its sequence speculates, catching up from where it stopped), and a
map of blocks whose draft KV is complete lets a sequence that hit the prefix cache skip
those blocks in the draft too.
"""

from __future__ import annotations

import bisect
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from ridgeline.engine.config import SpeculativeConfig
from ridgeline.engine.model_runner import ForwardItem, ModelOutput, ModelRunner
from ridgeline.engine.rejection_sampler import rejection_sample
from ridgeline.engine.sampler import Sampler
from ridgeline.engine.sampling_params import SamplingParams
from ridgeline.engine.sequence import Sequence, SequenceStatus
from ridgeline.engine.suffix_index import (
    Evidence,
    GlobalIndex,
    Match,
    SuffixIndex,
    walk,
)
from ridgeline.errors import ConfigError

if TYPE_CHECKING:
    from ridgeline.engine.block_manager import BlockKey, BlockManager
    from ridgeline.engine.draft_heads import DraftHeads
    from ridgeline.engine.loader import ModelSource
    from ridgeline.engine.scheduler import Scheduler

#: Before any measurement: one more token in a forward pass costs this fraction of the
#: pass's fixed cost (about what a 2-core CPU shows for SmolLM2 at 1-8 tokens).
PRIOR_TOKEN_COST = 0.4
#: Weight of older rounds in a request's acceptance estimate, per round.
DECAY = 0.8
#: The estimate starts as if 4 of 5 proposed tokens had been accepted; after a pause it
#: restarts from a weaker guess (a probe with a small k).
PRIOR_ACCEPTED, PRIOR_REJECTED = 4.0, 1.0
PROBE_ACCEPTED, PROBE_REJECTED = 1.0, 0.5

#: What a step samples for one sequence: (token, logprob, top logprobs) per new token.
Emitted = list[tuple[int, float, "dict[int, float] | None"]]


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


# ---- proposers --------------------------------------------------------------------------


def ngram_lookup(tokens: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the sequence's
    last n tokens, for the longest n in [ngram_min, ngram_max] that occurs; [] if none."""
    length = len(tokens)
    if length < 2 or k <= 0:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        # windows starting at 0..length-1-n: they end before the last token, so every
        # match has at least one token after it
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []


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
#: Occurrences of the matched suffix examined per lookup (the most recent ones).
MAX_CANDIDATES = 16


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


class NgramProposer:
    """Prompt lookup: no model, so its q is one-hot (deterministic proposals).

    Mode "suffix": each sequence's tokens are indexed as they grow (`SuffixIndex`, in its
    `SpecState`), a bounded `GlobalIndex` holds finished sequences' outputs, and every
    proposed token comes with its chance of acceptance (`AcceptanceModel`). Mode "lookup":
    `ngram_lookup`, k planned from the sequence's recent acceptance."""

    allocates_first = False

    def __init__(self, cfg: SpeculativeConfig) -> None:
        assert cfg.ngram_min is not None and cfg.ngram_max is not None
        self.ngram_min = cfg.ngram_min
        self.ngram_max = cfg.ngram_max
        self.sizes_proposals = cfg.ngram_mode == "suffix"
        # anchor orders up to 3: longer matches are found by extending a trigram's
        self.anchors = tuple(range(self.ngram_min, max(self.ngram_min,
                                                       min(self.ngram_max, 3)) + 1))
        self.global_index = (GlobalIndex(self.anchors, cfg.global_index_tokens)
                             if self.sizes_proposals and cfg.global_index_tokens > 0 else None)
        self.model = AcceptanceModel()
        # sequences with an index, until they finish: (sequence, its index, prompt length,
        # whether its output may feed the global index)
        self._live: list[tuple[weakref.ref[Sequence], SuffixIndex, int, bool]] = []

    def propose(self, items: list[tuple[Sequence, int]], states: dict[Sequence, SpecState],
                sampler: Sampler | None) -> list[Proposal]:
        if not self.sizes_proposals:
            return [Proposal(ngram_lookup(seq.token_ids, k, self.ngram_min, self.ngram_max))
                    for seq, k in items]
        self._retire_finished()
        out = []
        for seq, k in items:
            st = states[seq]
            index = st.index
            if index is None or index.tokens is not seq.token_ids:
                index = st.index = SuffixIndex(self.anchors, seq.token_ids)
                self._live.append((weakref.ref(seq), index, seq.num_prompt_tokens,
                                   _shares(seq)))
            else:
                index.sync()
            found = self._matches(seq.token_ids, index, _shares(seq))
            tokens, evidence = walk(found, k, seq.token_ids)
            st.evidence = [self.model.bucket(e) for e in evidence]
            out.append(Proposal(tokens, confidence=[self.model.chance(b) for b in st.evidence]))
        return out

    def _matches(self, context: list[int], index: SuffixIndex, shared: bool) -> list[Match]:
        found = index.matches(context, self.ngram_max, MAX_CANDIDATES, local=True)
        if self.global_index is not None and shared:
            other = self.global_index.matches(context, self.ngram_max, MAX_CANDIDATES)
            if other:  # longest first; the own context first among equals
                found = sorted(found + other, key=lambda c: -c.length)
        return found

    def _retire_finished(self) -> None:
        """Move the outputs of sequences that finished (or are gone) to the global index."""
        live = []
        for ref, index, num_prompt, shared in self._live:
            seq = ref()
            if seq is not None and not seq.is_finished:
                live.append((ref, index, num_prompt, shared))
            elif self.global_index is not None and shared:
                self.global_index.add(index.tokens[num_prompt:])
        self._live = live

    def on_verified(self, seq: Sequence, state: SpecState, num_tokens: int, k: int,
                    accepted: int) -> None:
        # tokens after the first rejected one were not judged: they teach nothing
        for j, b in enumerate(state.evidence[:min(k, accepted + 1)]):
            self.model.update(b, j < accepted)


def _shares(seq: Sequence) -> bool:
    """Whether a sequence reads and feeds the global index: only where it shares the
    prefix cache (no salt of its own). Another request's output makes proposals faster,
    a timing signal, so it crosses exactly the boundary that cached prefixes cross."""
    return seq.cache_salt is None


class DraftProposer:
    """A smaller model with the target's tokenizer, run autoregressively k times over its
    own paged cache (same block ids as the target's)."""

    allocates_first = True  # the draft writes KV at the proposals' slots
    sizes_proposals = False  # k comes from the sequence's recent acceptance

    def __init__(self, runner: ModelRunner, block_manager: BlockManager,
                 target_vocab: int) -> None:
        self.cost: StepCost | None = None  # set by the Speculator: draft passes cost too
        self.runner = runner
        self.block_size = runner.kv_cache.block_size
        self.block_manager = block_manager
        self.target_vocab = target_vocab
        # block id -> the prefix-cache key it had when its draft KV was completed
        self.complete: dict[int, BlockKey] = {}

    def propose(self, items: list[tuple[Sequence, int]], states: dict[Sequence, SpecState],
                sampler: Sampler) -> list[Proposal]:
        bs = self.block_size
        blocks = self.block_manager.blocks
        first: list[ForwardItem] = []
        for seq, _ in items:
            st = states[seq]
            if st.preemptions_seen != seq.num_preemptions:  # its blocks were all freed
                st.preemptions_seen = seq.num_preemptions
                st.draft_computed = st.draft_marked = 0
            self._mark_complete(seq, st)
            last = seq.num_tokens - 1
            c = st.draft_computed
            # skip blocks whose draft KV another sequence (or this one) completed
            while c % bs == 0 and c + bs <= last:
                b = seq.block_table[c // bs]
                key = blocks[b].key
                if key is None or self.complete.get(b) != key:
                    break
                c += bs
            c = min(c, last)
            first.append((seq.block_table, c, seq.token_ids[c:], 1))
            st.draft_computed = seq.num_tokens
        seqs = [seq for seq, _ in items]
        tokens, probs = self._pick(self.runner.forward(first), seqs, sampler)
        drafts = [[t] for t in tokens]
        qs: list[list[torch.Tensor]] = [[] if p is None else [p] for p in probs]
        for j in range(1, max(k for _, k in items)):
            live = [i for i, (_, k) in enumerate(items) if k > j]
            batch = []
            for i in live:
                seq = items[i][0]
                pos = seq.num_tokens - 1 + j  # the previous proposal's position
                self.complete.pop(seq.block_table[pos // bs], None)  # unverified KV
                batch.append((seq.block_table, pos, [drafts[i][-1]], 1))
            start = time.perf_counter()
            logits = self.runner.forward(batch)
            if self.cost is not None:
                self.cost.observe_draft(time.perf_counter() - start)
            tokens, probs = self._pick(logits, [seqs[i] for i in live], sampler)
            for i, t, p in zip(live, tokens, probs):
                drafts[i].append(t)
                if p is not None:
                    qs[i].append(p)
        return [Proposal(d, torch.stack(q) if q else None) for d, q in zip(drafts, qs)]

    def on_verified(self, seq: Sequence, state: SpecState, num_tokens: int, k: int,
                    accepted: int) -> None:
        # the draft saw the proposals up to d_{k-1}; those accepted are now real tokens
        state.draft_computed = num_tokens + min(accepted, k - 1)

    def _mark_complete(self, seq: Sequence, st: SpecState) -> None:
        blocks = self.block_manager.blocks
        for i in range(st.draft_marked, st.draft_computed // self.block_size):
            b = seq.block_table[i]
            key = blocks[b].key
            if key is None:  # not in the prefix cache (yet): nobody else can hit it
                break
            self.complete[b] = key
            st.draft_marked = i + 1

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence], sampler: Sampler
              ) -> tuple[list[int], list[torch.Tensor | None]]:
        """The draft's token for each row, and q (the distribution it was drawn from) for
        rows that sample."""
        v = self.target_vocab
        if logits.shape[1] > v:  # tokens the target cannot emit are never proposed
            logits = logits[:, :v]
        elif logits.shape[1] < v:
            pad = logits.new_full((logits.shape[0], v - logits.shape[1]), float("-inf"))
            logits = torch.cat([logits, pad], dim=1)
        tokens = logits.argmax(dim=-1)
        probs: list[torch.Tensor | None] = [None] * len(seqs)
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if rows:
            idx = torch.tensor(rows, device=logits.device)
            row_seqs = [seqs[i] for i in rows]
            q = sampler.filtered_probs(logits[idx], row_seqs)
            tokens[idx] = sampler.draw(q, row_seqs)
            for j, i in enumerate(rows):
                probs[i] = q[j]
        return tokens.tolist(), probs


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


def expected_kept(chances: list[float] | None) -> float:
    """Tokens of a proposal expected to be accepted (each needs all before it)."""
    total, reach = 0.0, 1.0
    for c in chances or []:
        reach *= c
        total += reach
    return total


class HeadsProposer:
    """Draft heads (draft_heads.py) beside the n-gram proposer: both propose for every
    sequence, each token with its chance of acceptance, and the sequence verifies the
    proposal expected to keep more tokens. Copying from the context (code edits, logs) is
    the n-grams' strength, free text the heads'."""

    allocates_first = False
    sizes_proposals = True

    def __init__(self, cfg: SpeculativeConfig, heads: DraftHeads) -> None:
        self.ngram = NgramProposer(cfg)
        # below this chance (all tokens before included) a proposal is cut anyway
        self.floor = cfg.min_proposal_chance if cfg.adaptive else 0.0
        self.heads = heads
        self.calibration = HeadCalibration(heads.num_heads)
        self.num_head_proposals = 0  # proposals taken from the heads (the rest: n-grams)

    def propose(self, items: list[tuple[Sequence, int]], states: dict[Sequence, SpecState],
                sampler: Sampler | None) -> list[Proposal]:
        out = self.ngram.propose(items, states, sampler)
        ready = [i for i, (seq, _) in enumerate(items)
                 if states[seq].hidden is not None and states[seq].hidden_at == seq.num_tokens]
        for seq, _ in items:
            states[seq].head_buckets = []
        if not ready:
            return out
        hidden = torch.stack([states[items[i][0]].hidden for i in ready])  # type: ignore[misc]
        last = torch.tensor([items[i][0].token_ids[-1] for i in ready], device=hidden.device)
        cal = self.calibration
        # the heads run while some sequence's chain may still beat its n-gram proposal
        # (every later head at its best bucket) and is likely enough to be verified
        target = [expected_kept(out[i].confidence) for i in ready]
        gain = [0.0] * len(ready)
        reach = [1.0] * len(ready)
        if all(t >= cal.best_gain(-1) for t in target):
            return out

        def stop(head: int, p: torch.Tensor) -> bool:
            rest = cal.best_gain(head)
            go = False
            for r, x in enumerate(p.tolist()):
                reach[r] *= cal.chance(cal.bucket(head, x))
                gain[r] += reach[r]
                go = go or (reach[r] >= self.floor and gain[r] + reach[r] * rest > target[r])
            return not go

        tokens, probs = self.heads.propose(hidden, last, max(items[i][1] for i in ready), stop)
        for row, i in enumerate(ready):
            seq, k = items[i]
            st = states[seq]
            n = min(k, tokens.shape[1])
            buckets = [cal.bucket(j, p) for j, p in enumerate(probs[row, :n].tolist())]
            chances = [cal.chance(b) for b in buckets]
            if expected_kept(chances) > expected_kept(out[i].confidence):
                out[i] = Proposal(tokens[row, :n].tolist(), confidence=chances)
                self.num_head_proposals += 1
                st.evidence = []  # the n-gram model learns nothing from this step
                st.head_buckets = buckets
        return out

    def on_verified(self, seq: Sequence, state: SpecState, num_tokens: int, k: int,
                    accepted: int) -> None:
        self.ngram.on_verified(seq, state, num_tokens, k, accepted)
        for j, b in enumerate(state.head_buckets[:min(k, accepted + 1)]):
            self.calibration.update(b, j < accepted)


# ---- the orchestrator -------------------------------------------------------------------


class Speculator:
    """Plans and proposes look-ahead tokens, and accepts or rejects them once the target
    has scored them; the scheduler owns the slots, the runner runs the pass."""

    def __init__(self, cfg: SpeculativeConfig, *, scheduler: Scheduler, max_model_len: int,
                 proposer: NgramProposer | DraftProposer | HeadsProposer) -> None:
        self.cfg = cfg
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = scheduler.max_num_batched_tokens
        self.proposer = proposer
        self.states: weakref.WeakKeyDictionary[Sequence, SpecState] = weakref.WeakKeyDictionary()
        self.num_proposed = 0
        self.num_accepted = 0
        self.num_spec_steps = 0  # steps that verified proposals
        self.num_emitted = 0  # tokens those sequences emitted in those steps
        self.cost = StepCost()
        if isinstance(proposer, DraftProposer):
            proposer.cost = self.cost
        # the engine passes each step's hidden states (`keep_hidden`) to draft heads
        self.reads_hidden = isinstance(proposer, HeadsProposer)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted / self.num_proposed if self.num_proposed else None

    def state(self, seq: Sequence) -> SpecState:
        st = self.states.get(seq)
        if st is None:
            st = self.states[seq] = SpecState(preemptions_seen=seq.num_preemptions)
        return st

    def keep_hidden(self, samplers: list[Sequence], hidden: torch.Tensor,
                    emitted: list[Emitted]) -> None:
        """Each sampler's emitting row (`hidden[i]`), for its next proposal: valid once
        the step's tokens are appended (a sequence cut short by a stop has finished)."""
        for i, (seq, tokens) in enumerate(zip(samplers, emitted)):
            st = self.state(seq)
            st.hidden = hidden[i]
            st.hidden_at = seq.num_tokens + len(tokens)

    # ---- 1-3: plan, propose, reserve slots ------------------------------------------

    def propose(self, scheduled: list[tuple[Sequence, int]],
                sampler: Sampler) -> dict[Sequence, Proposal]:
        """Proposals for the sequences that speculate this step (empty: plain step), each
        with its look-ahead slots reserved."""
        items = self._plan(scheduled)
        if not items:
            return {}
        sched = self.scheduler
        if self.proposer.allocates_first:
            items = [(seq, k) for seq, k in items if sched.reserve_lookahead(seq, k)]
            if not items:
                return {}
        states = {seq: self.state(seq) for seq, _ in items}
        proposals = self.proposer.propose(items, states, sampler)
        batch = len(scheduled)
        planned = sum(n for _, n in scheduled) - batch
        out: dict[Sequence, Proposal] = {}
        for (seq, _), prop in zip(items, proposals):
            keep = cut_proposal(prop, self.cfg, self.cost, batch, planned)
            if keep < len(prop.token_ids):
                prop.token_ids = prop.token_ids[:keep]
                if prop.probs is not None:
                    prop.probs = prop.probs[:keep]
            planned += keep
            if not prop.token_ids:
                continue
            if self.proposer.allocates_first or sched.reserve_lookahead(seq,
                                                                       len(prop.token_ids)):
                out[seq] = prop
        for seq, _ in items:  # reserved but nothing to verify: give the slots back
            if seq not in out:
                sched.release_lookahead(seq)
        return out

    def _plan(self, scheduled: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        cfg = self.cfg
        batch = len(scheduled)
        if batch > cfg.max_batch_size:
            return []
        num_tokens = sum(n for _, n in scheduled)
        budget = self.max_num_batched_tokens - num_tokens
        items: list[tuple[Sequence, int]] = []
        planned = num_tokens - batch  # prefill tokens beyond one per sequence
        for seq, n in scheduled:
            if n != 1 or seq.num_computed_tokens != seq.num_tokens - 1:
                continue  # a prefill chunk: nothing to guess yet
            if seq.params.uses_penalties:
                continue  # penalties change with every accepted token
            k = self.state(seq).plan_k(cfg, self.proposer.sizes_proposals,
                                       partial(self.cost.best_k, batch=batch, planned=planned))
            if seq.params.max_tokens is not None:  # the step emits up to k + 1 tokens
                k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
            k = min(k, self.max_model_len - seq.num_tokens, budget)
            if k > 0:
                items.append((seq, k))
                budget -= k
                planned += k
        return items

    def observe(self, scheduled: list[tuple[Sequence, int]], output: ModelOutput) -> None:
        """The time of a step's forward pass; decode-only steps inform the cost model
        (prefill chunks cost differently per token)."""
        if all(n == 1 for _, n in scheduled):
            self.cost.observe(output.num_tokens, output.seconds)

    # ---- 5: accept ------------------------------------------------------------------

    def accept(self, output: ModelOutput, proposals: dict[Sequence, Proposal],
               sampler: Sampler) -> tuple[list[Emitted], dict[Sequence, int]]:
        """What each sampling sequence emits this step, and how many proposals each
        speculating sequence keeps (for `Scheduler.update_from_output`)."""
        assert output.logits is not None
        spec_rows: list[int] = []
        plain_rows: list[int] = []
        for seq, rows in zip(output.samplers, output.row_slices()):
            (spec_rows if seq in proposals else plain_rows).extend(range(rows.start, rows.stop))
        logits = output.logits
        emitted: dict[Sequence, Emitted] = {}
        plain = [s for s in output.samplers if s not in proposals]
        if plain:
            res = sampler(logits[torch.tensor(plain_rows, device=logits.device)], plain)
            for i, seq in enumerate(plain):
                emitted[seq] = [(res.token_ids[i], res.logprobs[i], res.top_logprobs[i])]
        spec = [s for s in output.samplers if s in proposals]
        results = rejection_sample(logits[torch.tensor(spec_rows, device=logits.device)],
                                   spec, [proposals[s].token_ids for s in spec],
                                   [proposals[s].probs for s in spec], sampler)
        self.num_spec_steps += 1
        accepted: dict[Sequence, int] = {}
        for seq, res in zip(spec, results):
            k, a = len(proposals[seq].token_ids), res.num_accepted
            st = self.state(seq)
            st.record(k, a)
            self.proposer.on_verified(seq, st, seq.num_tokens, k, a)
            self.num_proposed += k
            self.num_accepted += a
            self.num_emitted += len(res.token_ids)
            accepted[seq] = a
            emitted[seq] = list(zip(res.token_ids, res.logprobs, res.top_logprobs))
        return [emitted[s] for s in output.samplers], accepted


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


def build_speculator(cfg: SpeculativeConfig, *, scheduler: Scheduler, max_model_len: int,
                     vocab_size: int, draft: ModelRunner | None = None,
                     heads: DraftHeads | None = None) -> Speculator | None:
    """The engine's speculator (None when speculation is off): n-gram lookup (with draft
    heads beside it, if given), or the draft model's runner (over the same block ids as
    the target)."""
    if not cfg.enabled:
        return None
    proposer: NgramProposer | DraftProposer | HeadsProposer
    if draft is not None:
        proposer = DraftProposer(draft, scheduler.block_manager, vocab_size)
    elif heads is not None:
        proposer = HeadsProposer(cfg, heads)
    else:
        proposer = NgramProposer(cfg)
    return Speculator(cfg, scheduler=scheduler, max_model_len=max_model_len,
                      proposer=proposer)


# ---- construction -----------------------------------------------------------------------


def open_draft_source(cfg: SpeculativeConfig, target: ModelSource,
                      draft: ModelSource | None, *, cache_dir: str | None) -> ModelSource | None:
    """The draft model's source (method "draft"), checked against the target's tokenizer."""
    if cfg.method != "draft":
        return None
    if draft is None:
        if cfg.draft_model is None:
            raise ConfigError("speculative.method is 'draft' but no draft model is given",
                              hint="set speculative.draft_model to a model name or path")
        from ridgeline.engine.loader import open_source
        from ridgeline.engine.registry import resolve_model

        draft = open_source(resolve_model(cfg.draft_model), cache_dir=cache_dir)
    check_same_tokenizer(target, draft)
    return draft


def check_same_tokenizer(target: ModelSource, draft: ModelSource) -> None:
    """Proposals are token ids: the draft must spell every token as the target does."""
    hint = "use a draft model from the target's family (same tokenizer)"
    t_tok, d_tok = target.tokenizer(), draft.tokenizer()
    if t_tok is not None and d_tok is not None:
        t_vocab, d_vocab = t_tok.get_vocab(), d_tok.get_vocab()
        if t_vocab != d_vocab:
            differ = sorted(set(t_vocab.items()) ^ set(d_vocab.items()), key=str)[:3]
            raise ConfigError(
                f"draft model {draft.name!r} has another tokenizer than {target.name!r} "
                f"({len(d_vocab)} vs {len(t_vocab)} tokens; e.g. {differ} differ)", hint=hint)
    elif draft.config.vocab_size != target.config.vocab_size:
        raise ConfigError(
            f"draft model {draft.name!r} has a vocabulary of {draft.config.vocab_size} tokens, "
            f"the target {target.name!r} {target.config.vocab_size}", hint=hint)
