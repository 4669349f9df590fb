"""The policy trainer: a transformers causal LM holding the same weights as the engine,
updated from token batches and synced back to the engine after each step.

`step(batch)` computes the current policy's logprobs on exactly the recorded token ids,
the decoupled PPO loss (AReaL's: the clip is anchored to the proximal policy, the weights
before this update, and the behaviour logprobs the sampler recorded only weigh each token
by pi_prox / pi_behav, truncated at `max_behaviour_weight` or masked outside the
thresholds, per token or per sequence: `rollout_correction`, `losses.policy_loss`; the
sampler/trainer mismatch is measured every step, `mismatch/*`), and takes one AdamW step
(gradient accumulation over micro-batches, gradient-norm clipping, bfloat16 autocast
where the CPU computes bf16 natively: `dtype="auto"`, resolved once into
`autocast_dtype`). `sync(worker)` copies the weights into the engine between two of its
steps (`EngineWorker.update_weights`, which drops the prefix cache and stamps new tokens
with the new version; any `protocols.WeightsSink`) and times it.

Long trajectories: the LM head runs on policy positions only and in chunks
(`logprob_chunk_tokens`, recomputed in backward), the layers under activation
checkpointing, and with `pack` the episodes of a micro-batch run as one unpadded row of
at most `micro_batch_tokens` tokens, attention confined to each episode.

The model is a `policy.Policy` (`load_policy`: the engine's own weights, optionally with
LoRA adapters; sync sends `Policy.engine_weights()`, the merged adapted tensors only with
LoRA) or a plain transformers module (sync sends all of `named_parameters()`). The
optimizer sees the trainable parameters only.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Iterator
from typing import Literal, TypedDict

import torch
from pydantic import BaseModel, ConfigDict, Field

from ridgeline.cpu import has_native_bf16
from ridgeline.errors import ConfigError
from ridgeline.rl.losses import (
    SEQUENCE_METRICS,
    check_correction,
    head_logprobs,
    policy_loss,
    token_logprobs,
)
from ridgeline.rl.memory import memory_metrics, release_freed_memory
from ridgeline.rl.policy import Policy, named_tensor_bytes
from ridgeline.rl.protocols import WeightsSink
from ridgeline.rl.tokens import TokenBatch

log = logging.getLogger(__name__)

AutocastDtype = Literal["float32", "bfloat16"]


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float | None = Field(1.0, gt=0, description="max gradient norm (None: off)")
    micro_batch_size: int = Field(8, ge=1, description="episodes per forward/backward")
    micro_batch_tokens: int | None = Field(4096, ge=1, description="at most this many "
                                           "padded tokens per forward/backward (an episode "
                                           "longer than this is one alone); a step's "
                                           "activation memory grows with it. None: "
                                           "micro_batch_size alone")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="the forward pass's autocast dtype. auto: bfloat16 where the "
        "device computes it natively (CPU: AVX512_BF16, AMX or Arm BF16; CUDA: "
        "is_bf16_supported), else float32 (on an AVX2-only CPU bf16 is emulated and a "
        "step is several times slower than in float32)")
    eps_low: float = Field(0.2, ge=0, description="PPO clip below 1")
    eps_high: float = Field(0.28, ge=0, description="PPO clip above 1 (clip-higher)")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the reference policy")
    kl_estimator: Literal["k1", "k3"] = "k3"
    aggregation: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    decoupled: bool = Field(True, description="decoupled PPO (AReaL): clip against the "
                            "proximal policy (the weights before this step) and weigh by "
                            "pi_prox / pi_behav; False: PPO-clip against the behaviour "
                            "logprobs, which zeroes the gradient of stale tokens")
    max_behaviour_weight: float | None = Field(5.0, gt=0, description="cap of the behaviour "
                                               "weight pi_prox / pi_behav (tis: truncated "
                                               "above it, mis: masked above it; None: no "
                                               "cap); only with decoupled")
    rollout_correction: Literal["none", "tis", "mis"] = Field(
        "tis", description="how the behaviour weight w = pi_prox / pi_behav between the "
        "trainer and the sampler's recorded logprobs (another numeric path: bf16/int8 "
        "engine; older weights) enters the loss: tis: truncated at max_behaviour_weight; "
        "mis: tokens outside [min_behaviour_weight, max_behaviour_weight] get weight 0; "
        "none: w = 1 (mismatch ignored; still measured, mismatch/*). Only with decoupled")
    rollout_correction_level: Literal["token", "sequence", "geometric"] = Field(
        "token", description="w per token, per sequence (the product over its tokens) or "
        "the per-sequence geometric mean; the thresholds apply to that weight")
    min_behaviour_weight: float | None = Field(None, gt=0, description="mis only: tokens "
                                               "(sequences) with a weight below this are "
                                               "masked too (None: no lower bound)")
    temperature: float = Field(1.0, gt=0, description="the rollouts' sampling temperature: "
                               "logprobs are of log_softmax(logits / temperature), matching "
                               "behaviour logprobs recorded with logprobs_mode='tempered'")
    release_memory: bool = Field(True, description="after each step, hand the heap's freed "
                                 "pages back to the OS (glibc malloc_trim): activations of "
                                 "varying shapes otherwise ratchet the RSS up step by step")
    logprob_chunk_tokens: int | None = Field(
        512, ge=1, description="the LM head and log_softmax run on this many policy "
        "positions at a time, each recomputed in backward: memory for logprobs is a few "
        "[chunk, vocab] tensors (512 x 49K float32: 100 MB each) instead of [policy tokens, "
        "vocab]. None: all at once")
    pack: bool = Field(False, description="pack episodes into one row of at most "
                       "micro_batch_tokens tokens per forward/backward (no padding; "
                       "position ids restart per episode and attention stays inside each "
                       "episode); micro_batch_size is then not used")
    gradient_checkpointing: bool | None = Field(
        None, description="recompute each layer's activations in the backward pass instead "
        "of keeping them (SmolLM2-135M, 4 episodes of ~1,100 tokens: peak 4.0 GB instead of "
        "10.1, and no slower on this CPU: docs/benchmarks.md). None: on where the model "
        "supports it (transformers models); True: required")


def resolve_dtype(dtype: str, device_type: str = "cpu") -> AutocastDtype:
    """The autocast dtype `TrainerConfig.dtype` means on `device_type`: "auto" is
    bfloat16 where it is native (`cpu.has_native_bf16`; CUDA: `is_bf16_supported`),
    float32 elsewhere. An explicit "bfloat16" stays, with a warning where it is emulated
    (it works, slowly)."""
    if device_type == "cuda":
        native = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    else:
        native = has_native_bf16()
    if dtype == "auto":
        return "bfloat16" if native else "float32"
    if dtype == "bfloat16" and not native:
        log.warning("trainer dtype bfloat16 on a %s without native bf16 arithmetic: it is "
                    "emulated, a step can be several times slower than in float32 (dtype: "
                    "auto picks float32 here)", device_type.upper())
    return "bfloat16" if dtype == "bfloat16" else "float32"


class TrainerState(TypedDict):
    """A trainer's checkpoint state: the model's (LoRA: the adapters'), AdamW's, the
    weights version and the steps taken."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, object]
    version: int
    num_steps: int


class PolicyTrainer:
    """The in-process `protocols.ResumableTrainer`."""

    def __init__(self, model: torch.nn.Module | Policy, config: TrainerConfig | None = None,
                 reference: torch.nn.Module | None = None) -> None:
        if isinstance(model, Policy):
            self.policy: Policy | None = model
            self.model = model.model
            params = model.trainable_parameters()
        else:
            self.policy = None
            self.model = model
            params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("the policy has no trainable parameters",
                              hint="unfreeze some, or load it with load_policy()")
        self.config = cfg = config or TrainerConfig()
        self.reference = reference  # frozen, for the optional KL term
        self.params = params  # what the optimizer updates (LoRA: the adapters)
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr,
                                           weight_decay=cfg.weight_decay, betas=cfg.betas)
        self.version = 0            # the weights version; the engine's after each sync
        self.num_steps = 0
        _set_gradient_checkpointing(self.model, cfg.gradient_checkpointing)
        self.device_type = params[0].device.type
        _check_options(cfg, self.model)
        # what cfg.dtype ("auto") means on this machine, once
        self.autocast_dtype: AutocastDtype = resolve_dtype(cfg.dtype, self.device_type)
        log.info("trainer autocast dtype: %s (configured %s)", self.autocast_dtype, cfg.dtype)

    def _autocast(self) -> contextlib.AbstractContextManager[object]:
        if self.autocast_dtype == "bfloat16":
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _step_done(self, out: dict[str, float]) -> dict[str, float]:
        """What every optimizer step adds to its metrics, after releasing the memory it
        freed (`release_memory`): the autocast dtype (1: bfloat16) and the process's
        resident memory (`memory/rss_gb`, `memory/peak_rss_gb`)."""
        if self.config.release_memory:
            release_freed_memory()
        out["autocast_bf16"] = float(self.autocast_dtype == "bfloat16")
        out.update(memory_metrics())
        return out

    def logprobs(self, batch: TokenBatch, model: torch.nn.Module | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token logprobs [B, T] (and entropies) of `batch.token_ids` under `model`
        (default: the policy) at the policy tokens (`loss_mask`); 0 elsewhere, and
        position 0 has none (it is never a policy token).

        The LM head and the softmax over the vocabulary run only on the positions that
        predict a policy token: in agent episodes most tokens are prompt and
        observations, and [B, T, V] logits (V = 49K for SmolLM2) would cost more time and
        memory than the rest of the forward pass; it runs `logprob_chunk_tokens` positions
        at a time (`losses.head_logprobs`). With `pack` the episodes run as one row
        (`_packed`) and come back in the batch's [B, T] layout, so masks and per-sequence
        aggregation see the same tensors as unpacked."""
        model = model or self.model
        parts = _decoder_and_head(model)
        if parts is None:  # a model without the split: the full logits
            with self._autocast():
                logits = model(input_ids=batch.token_ids,
                               attention_mask=batch.attention_mask).logits
            return token_logprobs(logits, batch.token_ids, with_entropy=True,
                                  temperature=self.config.temperature)
        decoder, head = parts
        want = batch.loss_mask[:, 1:] > 0               # token t+1 is predicted at t
        rows, cols = want.nonzero(as_tuple=True)
        targets = batch.token_ids[rows, cols + 1]
        with self._autocast():
            # no KV cache to build: a training forward (and checkpointing refuses one)
            if self.config.pack:
                ids, positions, offsets = _packed(batch)
                # no attention mask: transformers confines attention to each episode from
                # the restarting position ids (checked at start: _check_packing_isolates)
                hidden = decoder(input_ids=ids, position_ids=positions,
                                 use_cache=False).last_hidden_state[0]
                at = hidden[offsets[rows] + cols]
            else:
                hidden = decoder(input_ids=batch.token_ids,
                                 attention_mask=batch.attention_mask,
                                 use_cache=False).last_hidden_state
                at = hidden[rows, cols]                  # [N, H]
            picked, entropy = head_logprobs(at, head, targets,
                                            temperature=self.config.temperature,
                                            chunk_tokens=self.config.logprob_chunk_tokens)
        shape = batch.token_ids.shape
        out = torch.zeros(shape, dtype=torch.float32).index_put((rows, cols + 1), picked)
        ent = torch.zeros(shape, dtype=torch.float32).index_put((rows, cols + 1), entropy)
        return out, ent

    def step(self, batch: TokenBatch) -> dict[str, float]:
        """One optimizer step over the whole batch (micro-batched); metrics."""
        cfg = self.config
        t0 = time.perf_counter()
        sums, total_tokens = self._backward(batch)
        grad_norm = None
        if cfg.grad_clip is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip))
        self.optimizer.step()
        self.num_steps += 1
        out = {k: v / max(total_tokens, 1.0) for k, v in sums.items()}
        out.update(train_seconds=time.perf_counter() - t0, policy_tokens=total_tokens)
        if grad_norm is not None:
            out["grad_norm"] = grad_norm
        return self._step_done(out)

    def _micro_batches(self, batch: TokenBatch) -> Iterator[TokenBatch]:
        """Episodes of similar length together, at most `micro_batch_size` of them and
        `micro_batch_tokens` padded tokens (a longer episode goes alone), each
        micro-batch cut to its longest (`TokenBatch.rows`): activations grow with the
        padded tokens, so long agent episodes must not share a forward pass with many
        others. The loss is a sum over micro-batches, so their makeup does not change
        the gradient.

        With `pack`, episodes are binned first-fit by decreasing length into micro-batches
        of at most `micro_batch_tokens` real tokens (a longer episode goes alone), which
        `logprobs` runs as one row each: no padding at all."""
        cfg = self.config
        lengths = [int(n) for n in batch.attention_mask.sum(dim=1)]
        if cfg.pack:
            yield from (batch.rows(sorted(b)) for b in
                        _first_fit(lengths, cfg.micro_batch_tokens or max(lengths, default=1)))
            return
        order = sorted(range(len(batch)), key=lambda i: lengths[i])
        group: list[int] = []
        for i in order:   # ascending: the newest member is the longest
            full = len(group) >= cfg.micro_batch_size or (
                cfg.micro_batch_tokens is not None
                and (len(group) + 1) * lengths[i] > cfg.micro_batch_tokens)
            if group and full:
                yield batch.rows(group)
                group = []
            group.append(i)
        if group:
            yield batch.rows(group)

    def supervised_step(self, batch: TokenBatch) -> dict[str, float]:
        """One optimizer step of supervised fine-tuning: the mean negative log-likelihood
        of the policy tokens (`loss_mask`) over the whole batch, micro-batched like
        `step`; the advantages and behaviour logprobs of the batch are not used. The
        logprobs are at the trainer's temperature (1 for SFT: the plain distribution)."""
        cfg = self.config
        t0 = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = float(batch.loss_mask.sum())
        if total_tokens == 0:
            raise ConfigError("an SFT batch without a single policy token",
                              hint="every SFT episode needs at least one reply token")
        nll_sum = 0.0
        correct = 0.0
        for mb in self._micro_batches(batch):
            if float(mb.loss_mask.sum()) == 0:
                continue
            logp, _ = self.logprobs(mb)
            nll = -(logp * mb.loss_mask).sum()
            (nll / total_tokens).backward()
            nll_sum += float(nll.detach())
            # a token the policy already ranks above 1/2 is one greedy decoding would pick
            correct += float(((logp.detach() > -0.6931) * mb.loss_mask).sum())
        grad_norm = None
        if cfg.grad_clip is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.num_steps += 1
        out = {"sft/nll": nll_sum / total_tokens,
               "sft/token_prob_above_half": correct / total_tokens,
               "train_seconds": time.perf_counter() - t0, "policy_tokens": total_tokens}
        if grad_norm is not None:
            out["grad_norm"] = grad_norm
        return self._step_done(out)

    def gradient(self, batch: TokenBatch) -> torch.Tensor:
        """The loss gradient of `batch` over the trainable parameters, flattened (float32),
        without a step: for comparing the directions different data pull in."""
        self._backward(batch)
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().float()
                 .flatten() for p in self.params]
        self.optimizer.zero_grad(set_to_none=True)
        return torch.cat(grads)

    def global_counts(self, tokens: float, sequences: float) -> tuple[float, float]:
        """The batch's policy tokens and sequences the loss is normalised by: this
        batch's in one process; over all ranks in `sharded.ShardedTrainer`."""
        return tokens, sequences

    def _backward(self, batch: TokenBatch) -> tuple[dict[str, float], float]:
        """Zero the gradients, then accumulate the batch's loss gradient (micro-batched);
        token-weighted metric sums and the number of policy tokens."""
        cfg = self.config
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        # the whole batch's counts (sharded: over every rank's share, `sharded.py`)
        total_tokens, total_seqs = self.global_counts(
            float(batch.loss_mask.sum()), float((batch.loss_mask.sum(dim=1) > 0).sum()))
        sums: dict[str, float] = {}
        for mb in self._micro_batches(batch):
            tokens = float(mb.loss_mask.sum())
            if tokens == 0:
                continue
            new, entropy = self.logprobs(mb)
            # The proximal policy is the weights before this update. The trainer takes one
            # optimizer step per batch, so they are the weights of this very forward pass:
            # its logprobs, detached, are exactly what a separate no-grad forward would give.
            prox = new.detach() if cfg.decoupled else None
            ref = None
            if self.reference is not None and cfg.kl_coef > 0:
                with torch.no_grad():
                    ref, _ = self.logprobs(mb, self.reference)
            loss, metrics = policy_loss(
                new, mb.behaviour_logprobs, mb.advantages, mb.loss_mask,
                proximal_logprobs=prox,
                max_behaviour_weight=cfg.max_behaviour_weight if cfg.decoupled else None,
                min_behaviour_weight=cfg.min_behaviour_weight if cfg.decoupled else None,
                rollout_correction=cfg.rollout_correction if cfg.decoupled else "none",
                correction_level=cfg.rollout_correction_level,
                eps_low=cfg.eps_low, eps_high=cfg.eps_high, ref_logprobs=ref,
                kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator,
                aggregation=cfg.aggregation, entropy=entropy)
            # the batch's mean, accumulated: each micro-batch weighs by its share of the
            # batch's tokens (token-mean) or of its sequences (seq-mean-token-mean)
            seqs = float((mb.loss_mask.sum(dim=1) > 0).sum())
            if cfg.aggregation == "token-mean":
                share = tokens / max(total_tokens, 1.0)
            else:
                share = seqs / max(total_seqs, 1.0)
            (loss * share).backward()
            # the batch's loss, kept as a token-weighted sum like the metrics below
            sums["loss"] = sums.get("loss", 0.0) + float(loss.detach()) * share * total_tokens
            for k, v in metrics.items():
                # a sequence mean weighs by sequences, scaled to the tokens' normaliser
                weight = seqs * total_tokens / max(total_seqs, 1.0) \
                    if k in SEQUENCE_METRICS else tokens
                sums[k] = sums.get(k, 0.0) + float(v) * weight
        return sums, total_tokens

    def sync(self, sink: WeightsSink) -> dict[str, float]:
        """Copy the weights into the engine (between two of its steps) as a new version:
        `Policy.engine_weights()` (LoRA: the merged adapted tensors only), or a plain
        module's `named_parameters()`. `sync_seconds` includes the LoRA merge
        (`sync_merge_seconds`)."""
        t0 = time.perf_counter()
        self.version += 1
        with torch.no_grad():
            if self.policy is not None:
                tensors = self.policy.engine_weights()
            else:
                tensors = [(name, p.detach()) for name, p in self.model.named_parameters()]
            t1 = time.perf_counter()
            sink.update_weights(tensors, version=self.version)
        t2 = time.perf_counter()
        return {"sync_seconds": t2 - t0, "sync_merge_seconds": t1 - t0,
                "sync_tensors": float(len(tensors)),
                "sync_bytes": float(named_tensor_bytes(tensors)),
                "version": float(self.version)}

    def _model_state(self) -> dict[str, torch.Tensor]:
        """The model's state; with LoRA the trainable adapters only (the frozen base is
        the model directory's, named by the policy's identity)."""
        state = self.model.state_dict()
        if self.policy is None or self.policy.lora is None:
            return state
        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        return {k: v for k, v in state.items() if k in trainable}

    def state_dict(self) -> TrainerState:
        """A copy (not views of the live tensors: AdamW keeps updating those)."""
        return copy.deepcopy({"model": self._model_state(),
                              "optimizer": self.optimizer.state_dict(),
                              "version": self.version, "num_steps": self.num_steps})

    def load_state_dict(self, state: TrainerState) -> None:
        state = copy.deepcopy(state)  # loading on CPU would alias the given tensors
        if self.policy is None:
            self.model.load_state_dict(state["model"])
        else:
            self._load_policy_state(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.num_steps = int(state["num_steps"])

    def _load_policy_state(self, model_state: dict[str, torch.Tensor]) -> None:
        """A policy's state (LoRA: the adapters only). One that does not fit (saved with
        or without LoRA, another rank) is a ConfigError, raised before anything loads."""
        expected = {k: tuple(v.shape) for k, v in self._model_state().items()}
        given = {k: tuple(v.shape) for k, v in model_state.items()}
        if given != expected:
            missing = sorted(set(expected) - set(given))
            unexpected = sorted(set(given) - set(expected))
            shapes = sorted(k for k in set(given) & set(expected) if given[k] != expected[k])
            raise ConfigError(
                f"the checkpoint's model state does not fit this policy (missing "
                f"{missing[:2]}, unexpected {unexpected[:2]}, other shape {shapes[:2]})",
                hint="resume with the policy config (lora) the checkpoint was trained with")
        self.model.load_state_dict(model_state, strict=self.policy is None
                                   or self.policy.lora is None)


def _set_gradient_checkpointing(model: torch.nn.Module, want: bool | None) -> None:
    """On (True: required, None: where the model has it) or off, non-reentrant (works
    with frozen inputs, as LoRA's). transformers >= 5 calls it activation checkpointing
    (the old name is deprecated); a peft model passes either through to its base."""
    new = callable(getattr(model, "activation_checkpointing_enable", None))
    old = callable(getattr(model, "gradient_checkpointing_enable", None))
    if want is False:
        if new:
            model.activation_checkpointing_disable()
        elif old:
            model.gradient_checkpointing_disable()
        return
    kwargs = {"use_reentrant": False}
    if new:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif old:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    elif want:
        raise ConfigError(f"{type(model).__name__} cannot checkpoint its activations",
                          hint="set trainer.gradient_checkpointing: false (or leave it unset)")


def _check_options(cfg: TrainerConfig, model: torch.nn.Module) -> None:
    """The rollout correction and packing options this model can use, or a ConfigError
    at start (not at the first step)."""
    check_correction(cfg.rollout_correction, cfg.rollout_correction_level,
                     cfg.max_behaviour_weight, cfg.min_behaviour_weight)
    explicit = {"rollout_correction", "rollout_correction_level", "min_behaviour_weight"}
    if not cfg.decoupled and explicit & cfg.model_fields_set:
        raise ConfigError("rollout_correction applies to the decoupled loss (the weight "
                          "pi_prox / pi_behav); with decoupled: false the PPO ratio is "
                          "taken against the behaviour logprobs directly",
                          hint="set decoupled: true, or drop the rollout_correction options")
    if not cfg.pack:
        return
    if cfg.micro_batch_tokens is None:
        raise ConfigError("pack needs a token budget per micro-batch",
                          hint="set trainer.micro_batch_tokens (e.g. 4096)")
    parts = _decoder_and_head(model)
    if parts is None:
        raise ConfigError(f"{type(model).__name__} cannot be packed: it does not expose a "
                          "decoder (get_decoder) taking position_ids and an LM head",
                          hint="set trainer.pack: false")
    _check_packing_isolates(parts[0])


def _first_fit(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of `lengths` in bins of total length <= budget (first fit, longest first:
    few bins, so little per-forward overhead); one longer than budget is a bin alone."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def _packed(batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The episodes of a right-padded batch as one row: token ids [1, L] and position ids
    [1, L] (0.. again at each episode's start, which is how transformers' attention
    finds the episodes: no attention across them), and each row's offset in it [B]."""
    lengths = batch.attention_mask.sum(dim=1)
    present = batch.attention_mask.bool()
    device = present.device
    width = batch.attention_mask.shape[1]
    if not torch.equal(present, torch.arange(width, device=device)[None, :] < lengths[:, None]):
        raise ConfigError("pack needs right-padded episodes (attention_mask 1 then 0)",
                          hint="build the batch with TokenBatch.of")
    ids = batch.token_ids[present]                     # row-major: episode after episode
    offsets = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(ids.shape[0], device=device) - offsets.repeat_interleave(lengths)
    return ids[None], positions[None], offsets


def _check_packing_isolates(decoder: torch.nn.Module) -> None:
    """Refuse to pack with a model whose attention does not confine each packed episode
    to itself (one that ignores position_ids or gets no mask from them would let
    episodes attend to each other, silently): an episode packed after another must give
    the hidden states it gives alone."""
    first, second = torch.arange(1, 6), torch.arange(2, 5)
    device = next(decoder.parameters()).device
    was_training = decoder.training
    decoder.eval()
    try:
        with torch.no_grad():
            alone = decoder(input_ids=second[None].to(device),
                            use_cache=False).last_hidden_state[0].float()
            ids = torch.cat([first, second])[None].to(device)
            positions = torch.cat([torch.arange(5), torch.arange(3)])[None].to(device)
            packed = decoder(input_ids=ids, position_ids=positions,
                             use_cache=False).last_hidden_state[0, 5:].float()
    finally:
        decoder.train(was_training)
    scale = float(alone.abs().max()) or 1.0
    if not torch.allclose(packed, alone, rtol=1e-2, atol=1e-2 * scale):
        raise ConfigError(f"{type(decoder).__name__} does not keep packed episodes apart "
                          "(an episode packed after another attends to it)",
                          hint="set trainer.pack: false, or use an attention implementation "
                               "that builds the mask from position_ids (sdpa, eager, flash)")


def _decoder_and_head(model: torch.nn.Module
                      ) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """The transformer body and the LM head of a causal LM (through a peft wrapper: its
    LoRA layers sit inside the body), or None when the model does not expose them."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    get_decoder = getattr(base, "get_decoder", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if get_decoder is None or head is None:
        return None
    decoder = get_decoder()
    return (decoder, head) if decoder is not None and decoder is not base else None
