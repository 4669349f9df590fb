"""Speculative decoding inside continuous batching, around the scheduler (which owns every
KV slot) as in vLLM v1:

1. `plan`, after a step: each decoding sequence (one new token, no penalties) gets the k
   that maximizes the batch's expected tokens per second (`seq.num_lookahead`), from its
   proposals' chance of acceptance and the measured step cost (`StepCost`); on a large,
   compute-bound batch k falls to 0 and speculation switches itself off;
2. the next `Scheduler.schedule()` reserves those look-ahead slots from the budget its
   admissions leave, and `propose` fills them (proposers.py: n-grams, a draft model over
   its own paged cache under the same block ids, draft heads), cutting what does not pay;
3. the `ModelRunner` verifies the proposals in the step's one forward pass;
4. `accept` samples the step (rejection_sampler.py keeps the target distribution exactly;
   greedy output is plain decoding's); `Scheduler.update_from_output` keeps the accepted
   tokens and frees the slots of the rest.
Unverified tokens never enter `Sequence.token_ids`, so the prefix cache never registers a
block holding them. docs/architecture.md ("Speculative decoding") has the whole story."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from functools import partial
from typing import TYPE_CHECKING

import torch

from ridgeline.engine.config import SpeculativeConfig
from ridgeline.engine.model_executor.model_runner import ModelOutput, ModelRunner
from ridgeline.engine.model_executor.sampler import Sampler
from ridgeline.engine.sequence import Emitted, Sequence
from ridgeline.engine.spec_decode.cost_model import StepCost, cut_proposal
from ridgeline.engine.spec_decode.proposal import Proposal, SpecState
from ridgeline.engine.spec_decode.proposers import DraftProposer, HeadsProposer, NgramProposer
from ridgeline.engine.spec_decode.rejection_sampler import rejection_sample
from ridgeline.engine.structured import mask_draft_logits
from ridgeline.errors import ConfigError

if TYPE_CHECKING:
    from ridgeline.engine.model_executor.loader import ModelSource
    from ridgeline.engine.spec_decode.draft_heads import DraftHeads

class Speculator:
    """Plans and proposes look-ahead tokens, and accepts or rejects them once the target
    has scored them; the scheduler owns the slots, the runner runs the pass."""

    def __init__(self, cfg: SpeculativeConfig, *, max_model_len: int,
                 proposer: NgramProposer | DraftProposer | HeadsProposer) -> None:
        self.cfg = cfg
        self.max_model_len = max_model_len
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

    # ---- 1: plan, after a step, for the next ----------------------------------------

    def plan(self, running: list[Sequence], prefill_tokens: int = 0) -> None:
        """After a step (its tokens appended): how many tokens each decoding sequence may
        propose in the next one, as `seq.num_lookahead`; the scheduler reserves their
        slots from the budget its admissions leave. `prefill_tokens`: the step's prefill
        tokens beyond one per sequence, the estimate of the next step's."""
        cfg = self.cfg
        batch = len(running)
        if batch > cfg.max_batch_size:
            return
        planned = prefill_tokens
        for seq in running:
            if seq.num_computed_tokens != seq.num_tokens - 1:
                continue  # a prefill chunk: nothing to guess yet
            if seq.params.uses_penalties:
                continue  # penalties change with every accepted token
            k = self.state(seq).plan_k(cfg, self.proposer.sizes_proposals,
                                       partial(self.cost.best_k, batch=batch, planned=planned))
            if seq.params.max_tokens is not None:  # the step emits up to k + 1 tokens
                k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
            k = min(k, self.max_model_len - seq.num_tokens)
            if k > 0:
                seq.num_lookahead = k
                planned += k

    # ---- 2: propose, into the slots the scheduler reserved -------------------------

    def propose(self, scheduled: list[tuple[Sequence, int]], lookahead: dict[Sequence, int],
                sampler: Sampler) -> dict[Sequence, Proposal]:
        """Proposals for the sequences that speculate this step (empty: plain step), at
        most `lookahead[seq]` tokens each; proposals the cost model does not pay for are
        cut, and their slots go back in `Scheduler.update_from_output`."""
        if not lookahead:
            return {}
        items = list(lookahead.items())
        states = {seq: self.state(seq) for seq, _ in items}
        proposals = self.proposer.propose(items, states, sampler)
        batch = len(scheduled)
        planned = sum(n for _, n in scheduled) - batch
        out: dict[Sequence, Proposal] = {}
        for (seq, _), prop in zip(items, proposals):
            if seq.grammar is not None:  # tokens the grammar refuses could never be kept
                valid = seq.grammar.valid_prefix(prop.token_ids)
                prop.token_ids = prop.token_ids[:valid]
                if prop.probs is not None:
                    prop.probs = prop.probs[:valid]
            keep = cut_proposal(prop, self.cfg, self.cost, batch, planned)
            if keep < len(prop.token_ids):
                prop.token_ids = prop.token_ids[:keep]
                if prop.probs is not None:
                    prop.probs = prop.probs[:keep]
            planned += keep
            if prop.token_ids:
                out[seq] = prop
        return out

    def observe(self, scheduled: list[tuple[Sequence, int]], output: ModelOutput) -> None:
        """The time of a step's forward pass; decode-only steps inform the cost model
        (prefill chunks cost differently per token)."""
        if all(n == 1 for _, n in scheduled):
            self.cost.observe(output.num_tokens, output.seconds)

    # ---- 4: accept ------------------------------------------------------------------

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
        spec_logits = logits[torch.tensor(spec_rows, device=logits.device)]
        if any(s.grammar is not None for s in spec):  # each row under its draft prefix
            spec_logits = mask_draft_logits(spec_logits.float(), [s.grammar for s in spec],
                                            [proposals[s].token_ids for s in spec])
        results = rejection_sample(spec_logits,
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


def build_speculator(cfg: SpeculativeConfig, *, max_model_len: int, vocab_size: int,
                     block_key: Callable[[int], Hashable | None],
                     draft: ModelRunner | None = None,
                     heads: DraftHeads | None = None) -> Speculator | None:
    """The engine's speculator (None when speculation is off): n-gram lookup (with draft
    heads beside it, if given), or the draft model's runner (over the same block ids as
    the target)."""
    if not cfg.enabled:
        return None
    proposer: NgramProposer | DraftProposer | HeadsProposer
    if draft is not None:
        proposer = DraftProposer(draft, block_key, vocab_size)
    elif heads is not None:
        proposer = HeadsProposer(cfg, heads)
    else:
        proposer = NgramProposer(cfg)
    return Speculator(cfg, max_model_len=max_model_len, proposer=proposer)


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
        from ridgeline.engine.model_executor.loader import open_source
        from ridgeline.engine.model_executor.registry import resolve_model

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
