"""Continuous batching with chunked prefill: each step spends a token budget on the
running sequences first (decodes and unfinished prefills, oldest first), then admits
waiting ones. When the pool runs out, the newest running sequence is preempted: its
blocks are freed and it is recomputed later (its full blocks usually survive in the
prefix cache, so recomputation is cheap).

The scheduler owns each sequence's KV slots and `num_computed_tokens`. After a step the
speculator plans how many tokens a decoding sequence will propose (`seq.num_lookahead`);
`schedule()` reserves their slots with the step's own from the budget left after
admissions (when the pool is short the sequence just decodes). `update_from_output` is
where a step's results land: it advances every sequence by what was computed and kept,
gives back the slots of rejected or unused proposals, appends the sampled tokens and
finishes the sequences they stop (`OutputProcessor` then detokenizes, checks stop strings
and builds the outputs)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ridgeline.engine.core.block_manager import BlockManager
from ridgeline.engine.sequence import Emitted, Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    # (sequence, number of its tokens to compute this step), in batch order
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # decoding sequences with KV slots reserved for this many proposed tokens
    lookahead: dict[Sequence, int] = field(default_factory=dict)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_chunked_prefill: bool = True,
                 eos_token_ids: set[int] | frozenset[int] = frozenset(),
                 max_model_len: int = 1 << 62) -> None:
        self.block_manager = block_manager
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # 1. Running sequences, oldest first; the newest yields its blocks when short.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new <= 0:  # nothing to compute (cannot happen with one token per step)
                i += 1
                continue
            while not bm.allocate_slots(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                budget -= num_new
                i += 1

        # 2. Admit waiting sequences while blocks, budget and seats last (not in a step
        #    that had to preempt: that would only thrash).
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            computed = bm.get_computed_blocks(seq)
            num_hit = len(computed) * bm.block_size
            num_new = seq.num_tokens - num_hit
            if num_new > budget:
                if not self.chunked_prefill:
                    break
                num_new = budget
            if not bm.allocate_slots(seq, num_new, computed):
                break
            self.waiting.popleft()
            bm.record_prefix_lookup(seq.num_tokens, num_hit)
            seq.num_computed_tokens = num_hit
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_hit
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new

        # 3. Look-ahead slots for planned proposals, from what budget is left (admissions
        #    first: speculation must not slow prefills down).
        for seq, n in out.scheduled:
            k, seq.num_lookahead = min(seq.num_lookahead, budget), 0
            if (k > 0 and n == 1 and seq.num_computed_tokens == seq.num_tokens - 1
                    and bm.allocate_slots(seq, 1 + k)):
                out.lookahead[seq] = k
                budget -= k
        return out

    def update_from_output(self, out: SchedulerOutput, accepted: dict[Sequence, int],
                           samplers: list[Sequence] = (), emitted: list[Emitted] = (), *,
                           version: int = 0) -> None:
        """After the forward pass: each sequence computed its scheduled tokens, plus the
        proposals it kept (`accepted`); blocks holding only rejected or unused look-ahead
        positions go back. Then each sampling sequence takes the tokens it emitted (with
        their logprobs and the weights `version`) up to the first that stops it: EOS, a
        stop token, max_tokens or the context length (stop strings need the text: the
        output processor checks those). A sequence that stops is finished here."""
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n + accepted.get(seq, 0)
            if seq in out.lookahead:
                self.block_manager.free_tail(seq, seq.num_computed_tokens)
        for seq, tokens in zip(samplers, emitted):
            for token, logprob, top in tokens:
                seq.append_token(token, logprob, top, version)
                if self._grammar_ends(seq, token) or self._stops(seq, token):
                    self.finish(seq)
                    break  # the rest of an accepted run is dropped

    def _stops(self, seq: Sequence, token: int) -> bool:
        params = seq.params
        if not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif token in params.stop_token_ids:  # type: ignore[operator]
            seq.finish_reason, seq.stop_reason = "stop", token
        elif ((params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens)
              or seq.num_tokens >= self.max_model_len):
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _grammar_ends(self, seq: Sequence, token: int) -> bool:
        """Advance a constrained sequence's grammar by its new token. A complete grammar
        allows only EOS next, so the output ends as any other (that EOS hidden); where
        EOS is ignored it ends at that EOS all the same. "abort" if the grammar failed (a
        resource limit: a masked draw cannot pick a refused token)."""
        if seq.grammar is None:
            return False
        if not seq.grammar.accept(token):
            if seq.finish_reason is None:
                seq.finish_reason, seq.stop_reason = "abort", f"grammar: {seq.grammar.error}"
        elif seq.grammar.done and token in self.eos_token_ids and seq.finish_reason is None:
            seq.finish_reason = "stop"
        return seq.finish_reason is not None

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free_seq(seq)
        seq.num_computed_tokens = 0
        seq.num_lookahead = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and release its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.FINISHED
