"""Which proposed tokens to keep: speculative sampling that leaves the model's output
distribution exactly as plain decoding would.

For one sequence the target model scored its k proposed tokens d_1..d_k in one pass,
giving k + 1 distributions p_1..p_{k+1} (p_j is the next-token distribution after
d_1..d_{j-1}). The proposer drew d_j from q_j.

- greedy: d_j is kept while it is p_j's argmax; the first mismatch is replaced by that
  argmax, and after k matches p_{k+1}'s argmax is appended. The output is token for
  token the greedy decode.
- sampling: d_j is kept with probability min(1, p_j(d_j) / q_j(d_j)); at the first
  rejection a token is drawn from the residual norm(max(0, p_j - q_j)) and the rest are
  dropped; after k acceptances one more token is drawn from p_{k+1}. Each emitted token
  is then distributed as p (Leviathan et al. 2023; Chen et al. 2023). A deterministic
  proposer (n-gram lookup) is the one-hot q: keep d_j with probability p_j(d_j), else
  draw from p_j with d_j removed.

p_j is the distribution the engine's sampler would draw from (temperature, top-k, top-p,
min-p applied); logprobs are those of the raw model distribution, as in `Sampler`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ridgeline.engine.model_executor.sampler import Sampler, recorded_logprobs
from ridgeline.engine.sequence import Sequence


@dataclass
class SpecSample:
    """What one sequence emits from a verification step."""

    token_ids: list[int]  # accepted proposals, then one token of the target's own
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]
    num_accepted: int  # how many proposals were kept


def rejection_sample(logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
                     draft_probs: list[torch.Tensor | None], sampler: Sampler
                     ) -> list[SpecSample]:
    """`logits` holds len(drafts[i]) + 1 consecutive rows per sequence i (the target's
    scores after each prefix of the proposal). `draft_probs[i]` is q as
    [len(drafts[i]), vocab], or None for a one-hot proposer (and for greedy sequences,
    where q does not matter)."""
    logits = logits.float()
    spans: list[tuple[int, int]] = []
    row = 0
    for d in drafts:
        spans.append((row, row + len(d) + 1))
        row += len(d) + 1
    assert row == logits.shape[0], "one row per proposal plus one per sequence"

    # p for every row of every sampling sequence, in one batched call
    row_seqs = [s for s, (a, b) in zip(seqs, spans) for _ in range(b - a)]
    greedy_rows = [s.params.greedy for s in row_seqs]
    probs: torch.Tensor | None = None
    argmax: list[int] = []
    if all(greedy_rows):
        argmax = logits.argmax(dim=-1).tolist()
    else:
        sample_idx = [i for i, g in enumerate(greedy_rows) if not g]
        probs = torch.zeros_like(logits)
        idx = torch.tensor(sample_idx, device=logits.device)
        probs[idx] = sampler.filtered_probs(logits[idx], [row_seqs[i] for i in sample_idx])
        if any(greedy_rows):
            argmax = logits.argmax(dim=-1).tolist()

    results: list[tuple[list[int], int]] = []
    for i, (seq, (a, b)) in enumerate(zip(seqs, spans)):
        if seq.params.greedy:
            results.append(_greedy(drafts[i], argmax[a:b]))
        else:
            assert probs is not None
            gen = seq.generator or sampler.generator
            results.append(_speculative(drafts[i], probs[a:b], draft_probs[i], gen))

    # logprobs of the emitted tokens under the raw (or tempered) distribution of their rows
    # (only those rows: the ones after a rejection emit nothing)
    rows = [a + j for (a, _), (toks, _) in zip(spans, results) for j in range(len(toks))]
    toks = [t for toks, _ in results for t in toks]
    emitting = logits[torch.tensor(rows, device=logits.device)]
    lse = torch.logsumexp(emitting, dim=-1)
    row_params = [seq.params for seq, (toks_i, _) in zip(seqs, results) for _ in toks_i]
    lps = recorded_logprobs(emitting, torch.tensor(toks, device=logits.device),
                            row_params, lse).tolist()
    k_max = max((s.params.logprobs or 0) for s in seqs)
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k_max > 0:
        vals, ids = torch.topk(emitting, k_max, dim=-1)
        top_vals = (vals - lse[:, None]).tolist()
        top_ids = ids.tolist()

    out: list[SpecSample] = []
    pos = 0
    for seq, (tokens, accepted) in zip(seqs, results):
        n_top = seq.params.logprobs
        seq_lps = lps[pos:pos + len(tokens)]
        tops: list[dict[int, float] | None] = []
        for j, t in enumerate(tokens):
            if n_top is None:
                tops.append(None)
                continue
            d = {top_ids[pos + j][m]: top_vals[pos + j][m] for m in range(n_top)}
            d[t] = seq_lps[j]
            tops.append(d)
        out.append(SpecSample(tokens, seq_lps, tops, accepted))
        pos += len(tokens)
    return out


def _greedy(draft: list[int], argmax: list[int]) -> tuple[list[int], int]:
    n = 0
    while n < len(draft) and draft[n] == argmax[n]:
        n += 1
    return argmax[:n + 1], n


def _speculative(draft: list[int], p: torch.Tensor, q: torch.Tensor | None,
                 gen: torch.Generator) -> tuple[list[int], int]:
    """p: [k + 1, vocab] target probabilities; q: [k, vocab] proposal probabilities or
    None for one-hot proposals."""
    k = len(draft)
    if k:
        d = torch.tensor(draft, device=p.device)
        p_d = p[:k].gather(1, d[:, None]).squeeze(1)
        if q is None:
            ratio = p_d
        else:
            q_d = q.gather(1, d[:, None]).squeeze(1)
            ratio = torch.where(q_d > 0, p_d / q_d, torch.ones_like(p_d))
        u = torch.rand(k, generator=gen, device=p.device)
        rejected = (u >= ratio).nonzero()
        n = int(rejected[0, 0]) if len(rejected) else k
    else:
        n = 0
    if n < k:  # resample position n from the residual
        if q is None:
            residual = p[n].clone()
            residual[draft[n]] = 0.0
        else:
            residual = (p[n] - q[n]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: p itself is exact
            residual = p[n]
        last = residual
    else:
        last = p[k]
    return draft[:n] + [_draw(last, gen)], n


def _draw(weights: torch.Tensor, gen: torch.Generator) -> int:
    """A draw proportional to `weights` (the exponential race, as `Sampler` draws)."""
    noise = torch.empty_like(weights).exponential_(generator=gen)
    return int((weights / noise).argmax())
