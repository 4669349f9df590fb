"""The proposers of speculative decoding: prompt lookup over n-grams (`NgramProposer`,
with a suffix index per sequence and one over earlier outputs), a draft model run k times
over its own paged cache (`DraftProposer`), and draft heads beside the n-grams
(`HeadsProposer`). Each returns one `Proposal` per sequence and learns from what the
target accepted (`on_verified`)."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import numpy as np
import torch

from ridgeline.engine.config import SpeculativeConfig
from ridgeline.engine.model_executor.model_runner import ForwardItem, ModelRunner
from ridgeline.engine.model_executor.sampler import Sampler
from ridgeline.engine.sequence import Sequence
from ridgeline.engine.spec_decode.acceptance import AcceptanceModel, HeadCalibration
from ridgeline.engine.spec_decode.cost_model import StepCost, expected_kept
from ridgeline.engine.spec_decode.proposal import Proposal, SpecState
from ridgeline.engine.spec_decode.suffix_index import GlobalIndex, Match, SuffixIndex, walk
from ridgeline.engine.structured import Grammar, mask_logits

if TYPE_CHECKING:
    from ridgeline.engine.spec_decode.draft_heads import DraftHeads

#: Occurrences of the matched suffix examined per lookup (the most recent ones).
MAX_CANDIDATES = 16


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


class NgramProposer:
    """Prompt lookup: no model, so its q is one-hot (deterministic proposals).

    Mode "suffix": each sequence's tokens are indexed as they grow (`SuffixIndex`, in its
    `SpecState`), a bounded `GlobalIndex` holds finished sequences' outputs, and every
    proposed token comes with its chance of acceptance (`AcceptanceModel`). Mode "lookup":
    `ngram_lookup`, k planned from the sequence's recent acceptance."""


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
    own paged cache under the target's block ids (block tables, preemption and prefix
    sharing need no second bookkeeping). It computes lazily, only when its sequence
    speculates, catching up from where it stopped; blocks whose draft KV is complete are
    remembered by prefix-cache key, so a sequence that hit the prefix cache skips them."""

    sizes_proposals = False  # k comes from the sequence's recent acceptance

    def __init__(self, runner: ModelRunner, block_key: Callable[[int], Hashable | None],
                 target_vocab: int) -> None:
        self.cost: StepCost | None = None  # set by the Speculator: draft passes cost too
        self.runner = runner
        self.block_size = runner.kv_cache.block_size
        # a block's prefix-cache key (None: not cached), read from the block manager
        self.block_key = block_key
        self.target_vocab = target_vocab
        # block id -> the prefix-cache key it had when its draft KV was completed
        self.complete: dict[int, Hashable] = {}

    def propose(self, items: list[tuple[Sequence, int]], states: dict[Sequence, SpecState],
                sampler: Sampler) -> list[Proposal]:
        bs = self.block_size
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
                key = self.block_key(b)
                if key is None or self.complete.get(b) != key:
                    break
                c += bs
            c = min(c, last)
            first.append((seq.block_table, c, seq.token_ids[c:], 1))
            st.draft_computed = seq.num_tokens
        seqs = [seq for seq, _ in items]
        # a constrained sequence drafts under its grammar too (a copy that steps along
        # the draft): its proposals are ones the target could emit, and q is masked alike
        ahead = [None if seq.grammar is None else seq.grammar.copy() for seq in seqs]
        tokens, probs = self._pick(self.runner.forward(first), seqs, sampler, ahead)
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
            tokens, probs = self._pick(logits, [seqs[i] for i in live], sampler,
                                       [ahead[i] for i in live])
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
        for i in range(st.draft_marked, st.draft_computed // self.block_size):
            b = seq.block_table[i]
            key = self.block_key(b)
            if key is None:  # not in the prefix cache (yet): nobody else can hit it
                break
            self.complete[b] = key
            st.draft_marked = i + 1

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence], sampler: Sampler,
              grammars: list[Grammar | None]) -> tuple[list[int], list[torch.Tensor | None]]:
        """The draft's token for each row, and q (the distribution it was drawn from) for
        rows that sample; rows with a grammar are masked by it first, and it takes the
        token picked."""
        v = self.target_vocab
        if logits.shape[1] > v:  # tokens the target cannot emit are never proposed
            logits = logits[:, :v]
        elif logits.shape[1] < v:
            pad = logits.new_full((logits.shape[0], v - logits.shape[1]), float("-inf"))
            logits = torch.cat([logits, pad], dim=1)
        if any(g is not None for g in grammars):
            logits = mask_logits(logits.float(), grammars)
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
        picked = tokens.tolist()
        for g, t in zip(grammars, picked):
            if g is not None:
                g.accept(t)
        return picked, probs


class HeadsProposer:
    """Draft heads (draft_heads.py) beside the n-gram proposer: both propose for every
    sequence, each token with its chance of acceptance, and the sequence verifies the
    proposal expected to keep more tokens. Copying from the context (code edits, logs) is
    the n-grams' strength, free text the heads'."""

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
