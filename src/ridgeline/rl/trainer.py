"""The policy trainer: a transformers causal LM holding the same weights as the engine,
updated from token batches and synced back to the engine after each step.

`step(batch)` computes the current policy's logprobs on exactly the recorded token ids,
the decoupled PPO loss against the behaviour logprobs the sampler recorded
(`losses.policy_loss`), and takes one AdamW step (gradient accumulation over
micro-batches, gradient-norm clipping, optional bfloat16 autocast: this CPU has
AVX512_BF16). `sync(worker)` copies the weights into the engine between two of its
steps (`EngineWorker.update_weights`, which drops the prefix cache and stamps new tokens
with the new version) and times it.
"""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from ridgeline.rl.losses import policy_loss, token_logprobs
from ridgeline.rl.tokens import TokenBatch


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float | None = Field(1.0, gt=0, description="max gradient norm (None: off)")
    micro_batch_size: int = Field(8, ge=1, description="episodes per forward/backward")
    dtype: Literal["float32", "bfloat16"] = "float32"
    eps_low: float = Field(0.2, ge=0, description="PPO clip below 1")
    eps_high: float = Field(0.28, ge=0, description="PPO clip above 1 (clip-higher)")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the reference policy")
    kl_estimator: Literal["k1", "k3"] = "k3"
    aggregation: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"


class PolicyTrainer:
    def __init__(self, model: torch.nn.Module, config: TrainerConfig | None = None,
                 reference: torch.nn.Module | None = None) -> None:
        self.model = model
        self.config = cfg = config or TrainerConfig()
        self.reference = reference  # frozen, for the optional KL term
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr,
                                           weight_decay=cfg.weight_decay, betas=cfg.betas)
        self.version = 0            # the weights version; the engine's after each sync
        self.num_steps = 0

    def _autocast(self) -> Any:
        if self.config.dtype == "bfloat16":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def logprobs(self, batch: TokenBatch, model: torch.nn.Module | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token logprobs [B, T] (and entropies) of `batch.token_ids` under `model`
        (default: the policy); position 0 has none (it is never a policy token)."""
        model = model or self.model
        with self._autocast():
            logits = model(input_ids=batch.token_ids,
                           attention_mask=batch.attention_mask).logits
        return token_logprobs(logits, batch.token_ids, with_entropy=True)

    def step(self, batch: TokenBatch) -> dict[str, float]:
        """One optimizer step over the whole batch (micro-batched); metrics."""
        cfg = self.config
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = float(batch.loss_mask.sum())
        total_seqs = float((batch.loss_mask.sum(dim=1) > 0).sum())
        sums: dict[str, float] = {}
        t0 = time.perf_counter()
        for start in range(0, len(batch), cfg.micro_batch_size):
            mb = batch.rows(slice(start, start + cfg.micro_batch_size))
            tokens = float(mb.loss_mask.sum())
            if tokens == 0:
                continue
            new, entropy = self.logprobs(mb)
            ref = None
            if self.reference is not None and cfg.kl_coef > 0:
                with torch.no_grad():
                    ref, _ = self.logprobs(mb, self.reference)
            loss, metrics = policy_loss(
                new, mb.behaviour_logprobs, mb.advantages, mb.loss_mask,
                eps_low=cfg.eps_low, eps_high=cfg.eps_high, ref_logprobs=ref,
                kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator,
                aggregation=cfg.aggregation, entropy=entropy)
            # the batch's mean, accumulated: each micro-batch weighs by its share of the
            # batch's tokens (token-mean) or of its sequences (seq-mean-token-mean)
            if cfg.aggregation == "token-mean":
                share = tokens / max(total_tokens, 1.0)
            else:
                share = float((mb.loss_mask.sum(dim=1) > 0).sum()) / max(total_seqs, 1.0)
            (loss * share).backward()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * tokens
        grad_norm = None
        if cfg.grad_clip is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                             cfg.grad_clip))
        self.optimizer.step()
        self.num_steps += 1
        out = {k: v / max(total_tokens, 1.0) for k, v in sums.items()}
        out.update(train_seconds=time.perf_counter() - t0, policy_tokens=total_tokens)
        if grad_norm is not None:
            out["grad_norm"] = grad_norm
        return out

    def sync(self, worker: Any) -> dict[str, float]:
        """Copy the weights into the engine (between two of its steps) as a new version."""
        t0 = time.perf_counter()
        self.version += 1
        with torch.no_grad():
            tensors = [(name, p.detach()) for name, p in self.model.named_parameters()]
            worker.update_weights(tensors, version=self.version)
        return {"sync_seconds": time.perf_counter() - t0, "version": float(self.version)}

    def state_dict(self) -> dict[str, Any]:
        """A copy (not views of the live tensors: AdamW keeps updating those)."""
        return copy.deepcopy({"model": self.model.state_dict(),
                              "optimizer": self.optimizer.state_dict(),
                              "version": self.version, "num_steps": self.num_steps})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = copy.deepcopy(state)  # loading on CPU would alias the given tensors
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.num_steps = int(state["num_steps"])
