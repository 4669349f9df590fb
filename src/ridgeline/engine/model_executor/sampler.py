"""From the logits of the sequences that sample this step to one token each, with the
sampled token's logprob (and top-k logprobs when asked).

Order: penalties, then temperature, top-k, top-p, min-p, then a draw. Greedy rows take
the argmax after penalties. Logprobs are those of the raw model distribution (or, for
`logprobs_mode="tempered"`, of log_softmax(logits / temperature)). A request
with a seed draws from its own generator, so its samples do not depend on its batch mates
(beyond float rounding of the batched forward)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ridgeline.engine.kernels import decode_ops
from ridgeline.engine.structured import mask_logits
from ridgeline.engine.sequence import Sequence


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]


def recorded_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: list,
                      lse: torch.Tensor | None = None) -> torch.Tensor:
    """The logprob recorded for each row's chosen token: under the raw distribution, or
    under log_softmax(logits / temperature) for rows asking `logprobs_mode="tempered"`
    (greedy rows have no temperature: raw)."""
    lse = torch.logsumexp(logits, dim=-1) if lse is None else lse
    raw = logits.gather(1, tokens[:, None]).squeeze(1) - lse
    tempered = [i for i, p in enumerate(params)
                if p.logprobs_mode == "tempered" and not p.greedy and p.temperature != 1.0]
    if tempered:
        idx = torch.tensor(tempered, device=logits.device)
        temps = torch.tensor([params[i].temperature for i in tempered], device=logits.device)
        scaled = logits[idx] / temps[:, None]
        raw[idx] = scaled.gather(1, tokens[idx][:, None]).squeeze(1) - \
            torch.logsumexp(scaled, dim=-1)
    return raw


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # for requests without a seed

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        logits = logits.float()
        if any(s.grammar is not None for s in seqs):   # first: logprobs are the masked ones
            logits = mask_logits(logits, [s.grammar for s in seqs])
        params = [s.params for s in seqs]
        greedy = [p.greedy for p in params]
        penalties = any(p.uses_penalties for p in params)
        # all greedy on raw logits (a decode batch of evaluation or benchmark requests):
        # argmax and logsumexp in one C pass per row, the token's logprob = max - lse
        fused = decode_ops.argmax_logsumexp(logits) if all(greedy) and not penalties \
            else None
        if fused is not None:
            tokens, top, lse = fused
            return self._output(logits, tokens, lse, params, top - lse)
        lse = torch.logsumexp(logits, dim=-1)
        processed = apply_penalties(logits.clone(), seqs) if penalties else logits
        if all(greedy):
            tokens = processed.argmax(dim=-1)
        else:
            tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
            g_rows = [i for i, gr in enumerate(greedy) if gr]
            r_rows = [i for i, gr in enumerate(greedy) if not gr]
            if g_rows:
                idx = torch.tensor(g_rows, device=logits.device)
                tokens[idx] = processed[idx].argmax(dim=-1)
            idx = torch.tensor(r_rows, device=logits.device)
            probs = self.filtered_probs(processed[idx], [seqs[i] for i in r_rows])
            tokens[idx] = self.draw(probs, [seqs[i] for i in r_rows])

        return self._output(logits, tokens, lse, params,
                            recorded_logprobs(logits, tokens, params, lse))

    @staticmethod
    def _output(logits: torch.Tensor, tokens: torch.Tensor, lse: torch.Tensor,
                params: list, sampled_lp: torch.Tensor) -> SamplerOutput:
        top: list[dict[int, float] | None] = [None] * len(params)
        k_max = max((p.logprobs or 0) for p in params)
        if k_max > 0:
            vals, ids = torch.topk(logits, k_max, dim=-1)
            vals = (vals - lse[:, None]).tolist()
            ids = ids.tolist()
        token_list = tokens.tolist()
        lp_list = sampled_lp.tolist()
        for i, p in enumerate(params):
            if p.logprobs is not None:   # (tokens a grammar refuses have no logprob)
                d = {ids[i][j]: vals[i][j] for j in range(p.logprobs)
                     if vals[i][j] != float("-inf")} if p.logprobs else {}
                d[token_list[i]] = lp_list[i]
                top[i] = d
        return SamplerOutput(token_list, lp_list, top)

    def filtered_probs(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Each row's sampling distribution: temperature, top-k, top-p and min-p applied
        (what a draw samples from; speculation's proposers and verifier need it too)."""
        temps = torch.tensor([s.params.temperature for s in seqs], device=logits.device)
        logits = logits / temps[:, None]
        top_k = [s.params.top_k for s in seqs]
        if any(k > 0 for k in top_k):
            vocab = logits.shape[-1]
            ks = [min(k, vocab) if k > 0 else 1 for k in top_k]
            kth = logits.topk(max(ks), dim=-1).values.gather(
                1, torch.tensor(ks, device=logits.device)[:, None] - 1)
            off = torch.tensor([k <= 0 for k in top_k], device=logits.device)[:, None]
            kth = kth.masked_fill(off, float("-inf"))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_p = [s.params.top_p for s in seqs]
        if any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            ps = torch.tensor(top_p, device=logits.device)[:, None]
            drop_sorted = mass_before > ps  # keeps the smallest prefix reaching top_p
            drop_sorted[:, 0] = False
            drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        probs = logits.softmax(dim=-1)
        min_p = [s.params.min_p for s in seqs]
        if any(m > 0 for m in min_p):
            ms = torch.tensor(min_p, device=logits.device)[:, None]
            probs = probs.masked_fill(probs < ms * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs

    def draw(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """argmax(p / E) with E ~ Exp(1) is a draw from p (the exponential race)."""
        noise = torch.empty_like(probs)
        shared = [i for i, s in enumerate(seqs) if s.generator is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1], device=probs.device) \
                .exponential_(generator=self.generator)
        for i, s in enumerate(seqs):
            if s.generator is not None:
                noise[i].exponential_(generator=s.generator)
        return (probs / noise).argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition penalty (transformers' form) over prompt and output tokens; presence and
    frequency penalties (OpenAI's form) over output tokens only."""
    device = logits.device
    vocab = logits.shape[1]
    rows_all, cols_all, rows_out, cols_out = [], [], [], []
    for i, s in enumerate(seqs):
        if s.params.repetition_penalty != 1.0:
            ids = [t for t in set(s.token_ids) if t < vocab]
            rows_all.extend([i] * len(ids))
            cols_all.extend(ids)
        if s.params.presence_penalty or s.params.frequency_penalty:
            out = [t for t in s.output_token_ids if t < vocab]
            rows_out.extend([i] * len(out))
            cols_out.extend(out)
    if rows_all:
        rep = torch.tensor([s.params.repetition_penalty for s in seqs], device=device)
        r = torch.tensor(rows_all, device=device)
        c = torch.tensor(cols_all, device=device)
        vals = logits[r, c]
        pen = rep[r]
        logits[r, c] = torch.where(vals > 0, vals / pen, vals * pen)
    if rows_out:
        counts = torch.zeros_like(logits)
        counts.index_put_((torch.tensor(rows_out, device=device),
                           torch.tensor(cols_out, device=device)),
                          torch.ones(len(rows_out), device=device), accumulate=True)
        freq = torch.tensor([s.params.frequency_penalty for s in seqs], device=device)
        pres = torch.tensor([s.params.presence_penalty for s in seqs], device=device)
        logits -= freq[:, None] * counts + pres[:, None] * (counts > 0).float()
    return logits
