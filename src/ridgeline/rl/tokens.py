"""Token-in, token-out records of episodes, and the padded batches the trainer sees.

An episode is one token sequence: the prompt, then for each turn the tokens the policy
sampled (with the sampler's logprob and the weights version of each) and the tokens of
the observation that followed, appended as ids exactly as the next turn's prompt was
sent to the engine. Nothing is ever re-rendered from text, so the trainer computes
logprobs on exactly the ids the engine sampled (re-tokenising multi-turn text is the
most common silent bug in agentic RL: verl #3960, #3720). The loss mask is 1 on policy
tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ridgeline.errors import ConfigError


@dataclass
class TokenEpisode:
    """The tokens of one episode as the engine sampled them: what the trainer trains on
    (its grade is the `filters.EpisodeOutcome` that carries it)."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)         # 1: sampled by the policy
    behaviour_logprobs: list[float] = field(default_factory=list)  # 0.0 where mask is 0
    versions: list[int] = field(default_factory=list)          # -1 where mask is 0

    @classmethod
    def start(cls, prompt_ids: list[int]) -> TokenEpisode:
        ep = cls()
        ep.add_context(prompt_ids)
        return ep

    def add_context(self, ids: list[int]) -> None:
        """Tokens the policy did not choose (the prompt, an observation)."""
        self.token_ids += [int(t) for t in ids]
        self.loss_mask += [0] * len(ids)
        self.behaviour_logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_completion(self, ids: list[int], logprobs: list[float],
                       versions: list[int]) -> None:
        """Tokens the policy sampled, with what the sampler recorded for each."""
        if not (len(ids) == len(logprobs) == len(versions)):
            raise ConfigError(f"a completion of {len(ids)} tokens came with {len(logprobs)} "
                              f"logprobs and {len(versions)} versions",
                              hint="pass the engine's token_ids, logprobs and token_versions")
        self.token_ids += [int(t) for t in ids]
        self.loss_mask += [1] * len(ids)
        self.behaviour_logprobs += [float(x) for x in logprobs]
        self.versions += [int(v) for v in versions]

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class TokenBatch:
    """Right-padded tensors of a list of episodes. Row t of `loss_mask` etc. refers to
    token t, predicted from tokens < t (so column 0, a prompt token, is never trained)."""

    token_ids: torch.Tensor           # [B, T] long
    attention_mask: torch.Tensor      # [B, T] long
    loss_mask: torch.Tensor           # [B, T] float
    behaviour_logprobs: torch.Tensor  # [B, T] float
    advantages: torch.Tensor          # [B] float

    @classmethod
    def of(cls, episodes: list[TokenEpisode], advantages: list[float],
           pad_id: int = 0) -> TokenBatch:
        if len(episodes) != len(advantages) or not episodes:
            raise ConfigError(f"{len(episodes)} episodes and {len(advantages)} advantages",
                              hint="pass one advantage per episode, at least one episode")
        width = max(len(e.token_ids) for e in episodes)

        def pad(rows: list[list[int]] | list[list[float]], value: float,
                dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=dtype)

        return cls(
            token_ids=pad([e.token_ids for e in episodes], pad_id, torch.long),
            attention_mask=pad([[1] * len(e.token_ids) for e in episodes], 0, torch.long),
            loss_mask=pad([e.loss_mask for e in episodes], 0, torch.float32),
            behaviour_logprobs=pad([e.behaviour_logprobs for e in episodes], 0.0,
                                   torch.float32),
            advantages=torch.tensor(advantages, dtype=torch.float32))

    def __len__(self) -> int:
        return self.token_ids.shape[0]

    def rows(self, index: slice | list[int]) -> TokenBatch:
        """The episodes at `index`, cut to the longest of them: padding up to the whole
        batch's longest episode would cost a micro-batch activations for tokens that are
        not there (in float32 about 2 MB per padded token for SmolLM2-135M)."""
        width = max(int(self.attention_mask[index].sum(dim=1).max()), 1) \
            if len(self.token_ids[index]) else 0
        return TokenBatch(self.token_ids[index, :width], self.attention_mask[index, :width],
                          self.loss_mask[index, :width],
                          self.behaviour_logprobs[index, :width], self.advantages[index])
