"""The trainer against the engine: at step 0 the trainer's logprobs on the exact recorded
ids of a multi-turn episode equal the sampler's, the importance ratio is 1 and the KL 0;
after a step, the synced engine generates what the updated model generates."""

from __future__ import annotations

import math

import pytest
import torch
from tests.helpers.engine_fixtures import hf_greedy, random_prompts, tiny_model

from ridgeline.engine import LLM, SamplingParams
from ridgeline.rl.losses import policy_loss
from ridgeline.rl.tokens import TokenBatch, TokenEpisode
from ridgeline.rl.trainer import PolicyTrainer, TrainerConfig

PROMPTS = random_prompts(4, 512, seed=9, min_len=5, max_len=12)
OBSERVATION = [17, 23, 5, 99]  # what an environment answered, appended as ids


def multi_turn_episodes(llm: LLM, turns: int = 2, seed: int = 0, temperature: float = 1.0,
                        logprobs_mode: str = "raw") -> list[TokenEpisode]:
    """Sampled (temperature 1) episodes: prompt, then per turn a completion from the
    engine and an observation appended as tokens; turn k's prompt is exactly the ids so
    far (token-in, token-out)."""
    episodes = []
    for i, prompt in enumerate(PROMPTS):
        ep = TokenEpisode.start(prompt)
        for turn in range(turns):
            params = SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True,
                                    seed=seed + 31 * i + turn, logprobs_mode=logprobs_mode)
            out = llm.worker.submit(llm.new_request_id("rl"), ep.token_ids, params).result()
            c = out.outputs[0]
            ep.add_completion(c.token_ids, c.logprobs, c.token_versions)
            if turn < turns - 1:
                ep.add_context(OBSERVATION)
        episodes.append(ep)
    return episodes


@pytest.fixture
def setup():
    model = tiny_model("llama", seed=4)
    llm = LLM.from_hf_model(model, num_kv_blocks=256, block_size=4)
    return model, llm


def test_step_zero_invariants_on_multi_turn_episodes(setup):
    model, llm = setup
    episodes = multi_turn_episodes(llm)
    assert all(ep.num_policy_tokens == 12 for ep in episodes)
    assert all(v == 0 for ep in episodes for v, m in zip(ep.versions, ep.loss_mask) if m)
    batch = TokenBatch.of(episodes, [1.0, -1.0, 0.5, -0.5])
    trainer = PolicyTrainer(model)
    with torch.no_grad():
        new, _ = trainer.logprobs(batch)
    mask = batch.loss_mask.bool()
    diff = (new - batch.behaviour_logprobs)[mask].abs().max().item()
    assert diff < 1e-3, f"trainer and sampler disagree by {diff}"
    _, metrics = policy_loss(new, batch.behaviour_logprobs, batch.advantages, batch.loss_mask)
    assert abs(metrics["importance_ratio"] - 1.0) < 1e-3
    assert abs(metrics["kl"]) < 1e-4
    assert metrics["clip_fraction"] == 0.0


def test_a_step_then_sync_makes_the_engine_generate_what_the_model_does(setup):
    model, llm = setup
    trainer = PolicyTrainer(model, TrainerConfig(lr=1e-2, micro_batch_size=2))
    episodes = multi_turn_episodes(llm)
    metrics = trainer.step(TokenBatch.of(episodes, [1.0, -1.0, 1.0, -1.0]))
    assert metrics["policy_tokens"] == 48 and metrics["grad_norm"] > 0
    sync = trainer.sync(llm.worker)
    assert sync["version"] == 1.0
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    out = llm.generate([PROMPTS[0]], greedy)[0].outputs[0]
    model.eval()
    assert out.token_ids == hf_greedy(model, PROMPTS[0], 10)[0]
    assert out.token_versions == [1] * 10


def test_positive_advantage_makes_its_tokens_more_likely(setup):
    model, llm = setup
    trainer = PolicyTrainer(model, TrainerConfig(lr=5e-3, grad_clip=None))
    episodes = multi_turn_episodes(llm, turns=1)
    batch = TokenBatch.of(episodes[:1], [1.0])
    with torch.no_grad():
        before = (trainer.logprobs(batch)[0] * batch.loss_mask).sum().item()
    trainer.step(batch)
    with torch.no_grad():
        after = (trainer.logprobs(batch)[0] * batch.loss_mask).sum().item()
    assert after > before


def test_bfloat16_autocast_trains_and_stays_close(setup):
    model, llm = setup
    trainer = PolicyTrainer(model, TrainerConfig(dtype="bfloat16"))
    batch = TokenBatch.of(multi_turn_episodes(llm, turns=1), [1.0, -1.0, 0.5, -0.5])
    with torch.no_grad():
        new, _ = trainer.logprobs(batch)
    mask = batch.loss_mask.bool()
    assert new.dtype == torch.float32  # logprobs in float32 even under autocast
    assert (new - batch.behaviour_logprobs)[mask].abs().max().item() < 0.1
    assert trainer.step(batch)["policy_tokens"] == 24


def test_trainer_state_round_trip(setup):
    model, llm = setup
    trainer = PolicyTrainer(model, TrainerConfig(lr=1e-2))
    batch = TokenBatch.of(multi_turn_episodes(llm, turns=1), [1.0, -1.0, 0.5, -0.5])
    trainer.step(batch)
    state = trainer.state_dict()
    other = PolicyTrainer(tiny_model("llama", seed=4), TrainerConfig(lr=1e-2))
    other.load_state_dict(state)
    assert other.version == trainer.version and other.num_steps == 1
    for (n, a), (_, b) in zip(model.named_parameters(), other.model.named_parameters()):
        assert torch.equal(a, b), n
    # the same next step from the same state
    trainer.step(batch)
    other.step(batch)
    for (n, a), (_, b) in zip(model.named_parameters(), other.model.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), n


def test_logprobs_at_policy_positions_equal_the_full_logits_path(setup):
    """The trainer runs the LM head only where a policy token is predicted; the values
    (and their gradients) are those of the full [B, T, V] logits."""
    from ridgeline.rl.losses import token_logprobs

    model, llm = setup
    trainer = PolicyTrainer(model)
    episodes = multi_turn_episodes(llm)
    batch = TokenBatch.of(episodes, [1.0] * len(episodes))
    fast, fast_entropy = trainer.logprobs(batch)
    logits = trainer.model(input_ids=batch.token_ids, attention_mask=batch.attention_mask).logits
    full, full_entropy = token_logprobs(logits, batch.token_ids, with_entropy=True)
    mask = batch.loss_mask.bool()
    assert torch.allclose(fast[mask], full[mask], atol=1e-5)
    assert torch.allclose(fast_entropy[mask], full_entropy[mask], atol=1e-4)
    assert (fast[~mask] == 0).all()
    g_fast = torch.autograd.grad(fast[mask].sum(), trainer.model.lm_head.weight)[0]
    g_full = torch.autograd.grad(full[mask].sum(), trainer.model.lm_head.weight)[0]
    assert torch.allclose(g_fast, g_full, atol=1e-4)


def test_step_zero_invariants_at_a_sampling_temperature_below_one(setup):
    """Sampling at temperature 0.7 with tempered logprobs: the trainer at the same
    temperature reproduces them (and the raw ones would not be the behaviour policy)."""
    model, llm = setup
    tempered = multi_turn_episodes(llm, temperature=0.7, logprobs_mode="tempered", seed=5)
    raw = multi_turn_episodes(llm, temperature=0.7, logprobs_mode="raw", seed=5)
    assert [e.token_ids for e in tempered] == [e.token_ids for e in raw]  # same draws
    batch = TokenBatch.of(tempered, [1.0] * len(tempered))
    mask = batch.loss_mask.bool()
    with torch.no_grad():
        new, _ = PolicyTrainer(model, TrainerConfig(temperature=0.7)).logprobs(batch)
        at_one, _ = PolicyTrainer(model).logprobs(batch)
    assert (new - batch.behaviour_logprobs)[mask].abs().max() < 1e-3
    raw_batch = TokenBatch.of(raw, [1.0] * len(raw))
    assert (at_one - raw_batch.behaviour_logprobs)[mask].abs().max() < 1e-3
    assert (new - at_one)[mask].abs().max() > 1e-2   # the two really differ


def _stale(batch: TokenBatch, shift: float) -> TokenBatch:
    """The batch as if sampled by an older policy that gave its tokens e^shift times
    less probability than the current one (stale rollouts of an async run)."""
    batch.behaviour_logprobs = (batch.behaviour_logprobs - shift) * batch.loss_mask
    return batch


def test_decoupled_loss_keeps_the_gradient_that_the_coupled_clip_zeroes(setup):
    """Stale data with positive advantages: pi_new / pi_behav = e > 1 + eps_high for every
    token, so PPO-clip against the behaviour logprobs has no gradient at all, while the
    decoupled loss anchors the clip at the current weights and weighs each token by the
    (capped) behaviour weight."""
    model, llm = setup
    batch = _stale(TokenBatch.of(multi_turn_episodes(llm, turns=1), [1.0, 0.5, 1.0, 0.5]),
                   1.0)
    coupled = PolicyTrainer(model, TrainerConfig(decoupled=False)).gradient(batch)
    assert coupled.abs().max().item() == 0.0
    trainer = PolicyTrainer(model, TrainerConfig(max_behaviour_weight=2.0))
    assert trainer.config.decoupled  # the default
    decoupled = trainer.gradient(batch)
    assert decoupled.norm().item() > 0
    metrics = trainer.step(batch)
    assert metrics["clip_fraction"] == 0.0 and abs(metrics["importance_ratio"] - 1) < 1e-6
    # every token's weight e^1 = 2.72 is truncated at the cap
    assert metrics["behaviour_weight"] == pytest.approx(2.0)
    assert metrics["behaviour_weight_capped"] == pytest.approx(1.0)


def test_decoupled_gradient_is_the_behaviour_weighted_policy_gradient(setup):
    """Uncapped, the decoupled gradient of stale data is e^shift times the on-policy one:
    the weight pi_prox / pi_behav, with the clip inactive at the proximal policy."""
    model, llm = setup
    episodes = multi_turn_episodes(llm, turns=1)
    fresh = TokenBatch.of(episodes, [1.0, -1.0, 0.5, -0.5])
    stale = _stale(TokenBatch.of(episodes, [1.0, -1.0, 0.5, -0.5]), 0.5)
    cfg = TrainerConfig(max_behaviour_weight=None)
    g_fresh = PolicyTrainer(model, cfg).gradient(fresh)
    g_stale = PolicyTrainer(model, cfg).gradient(stale)
    torch.testing.assert_close(g_stale, g_fresh * torch.exp(torch.tensor(0.5)),
                               rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_of_similar_length_cut_to_their_width_give_the_same_gradient(
        setup, aggregation):
    """Episodes of very different lengths: micro-batches group similar lengths and drop
    the padding beyond their longest; the gradient is the whole batch's all the same."""
    model, llm = setup
    episodes = multi_turn_episodes(llm, turns=1)
    long = multi_turn_episodes(llm, turns=4, seed=3)[0]
    batch = TokenBatch.of([episodes[0], long, episodes[1], episodes[2]],
                          [1.0, -0.5, 0.5, -1.0])
    cfg = {"aggregation": aggregation, "max_behaviour_weight": None}
    whole = PolicyTrainer(model, TrainerConfig(micro_batch_size=4, **cfg)).gradient(batch)
    trainer = PolicyTrainer(model, TrainerConfig(micro_batch_size=2, **cfg))
    widths = [mb.token_ids.shape[1] for mb in trainer._micro_batches(batch)]
    assert widths[0] < batch.token_ids.shape[1] == widths[-1]
    torch.testing.assert_close(trainer.gradient(batch), whole, rtol=1e-4, atol=1e-6)


def test_gradient_checkpointing_gives_the_same_gradient(setup):
    model, llm = setup
    batch = TokenBatch.of(multi_turn_episodes(llm, turns=2), [1.0, -0.5, 0.5, -1.0])
    plain = PolicyTrainer(model, TrainerConfig(gradient_checkpointing=False)).gradient(batch)
    assert not model.is_activation_checkpointing
    recomputed = PolicyTrainer(model, TrainerConfig())     # the default: on where it can
    assert model.is_activation_checkpointing
    torch.testing.assert_close(recomputed.gradient(batch), plain, rtol=1e-4, atol=1e-6)


def test_gradient_checkpointing_required_of_a_model_without_it_is_a_clear_error():
    from ridgeline.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot checkpoint"):
        PolicyTrainer(torch.nn.Linear(2, 2), TrainerConfig(gradient_checkpointing=True))
    PolicyTrainer(torch.nn.Linear(2, 2), TrainerConfig())     # unset: where it can


def test_micro_batches_hold_at_most_the_token_budget_and_keep_the_gradient(setup):
    model, llm = setup
    episodes = multi_turn_episodes(llm, turns=1) + multi_turn_episodes(llm, turns=3, seed=5)
    batch = TokenBatch.of(episodes, [1.0, -1.0, 0.5, -0.5, 0.25, -0.25, 1.0, -1.0])
    longest = int(batch.attention_mask.sum(dim=1).max())
    budget = 2 * longest
    whole = PolicyTrainer(model, TrainerConfig(micro_batch_size=8, micro_batch_tokens=None))
    trainer = PolicyTrainer(model, TrainerConfig(micro_batch_size=8, micro_batch_tokens=budget))
    parts = list(trainer._micro_batches(batch))
    assert sum(len(p) for p in parts) == len(batch) and len(parts) > 1
    assert all(p.token_ids.numel() <= budget for p in parts)
    alone = PolicyTrainer(model, TrainerConfig(micro_batch_tokens=1))
    assert [len(p) for p in alone._micro_batches(batch)] == [1] * len(batch)
    torch.testing.assert_close(trainer.gradient(batch), whole.gradient(batch),
                               rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_chunked_logprobs_equal_the_whole_head_and_keep_no_vocab_sized_tensor(
        setup, checkpointing):
    """logprob_chunk_tokens: values, entropies and gradients (every parameter) equal the
    one-chunk path's, and nothing of [policy tokens, V] is saved for backward: the head's
    logits are recomputed one chunk at a time."""
    model, llm = setup
    batch = TokenBatch.of(multi_turn_episodes(llm, turns=2), [1.0, -0.5, 0.5, -1.0])
    n = int(batch.loss_mask.sum())
    vocab = model.config.vocab_size
    results = {}
    for chunk in (None, 5):
        trainer = PolicyTrainer(model, TrainerConfig(logprob_chunk_tokens=chunk,
                                                     gradient_checkpointing=checkpointing))
        saved: list[tuple[int, ...]] = []

        def keep(t: torch.Tensor) -> torch.Tensor:
            saved.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            logp, ent = trainer.logprobs(batch)
        grads = torch.autograd.grad((logp * batch.loss_mask).sum(), trainer.params)
        # what backward keeps over the vocabulary (logits, log_softmax), by size
        wide = [math.prod(shape) for shape in saved if shape and shape[-1] == vocab]
        results[chunk] = (logp.detach(), ent, grads, max(wide, default=0))
    (lp, ent, grads, whole), (clp, cent, cgrads, chunked) = results[None], results[5]
    assert n > 5
    torch.testing.assert_close(clp, lp, rtol=0, atol=1e-6)
    torch.testing.assert_close(cent, ent, rtol=0, atol=1e-5)
    for a, b in zip(cgrads, grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # summation order
    assert whole >= n * vocab        # the whole path keeps [N, V]
    assert chunked == 0              # chunks keep only their [C, H] input


def test_chunked_logprobs_bound_peak_memory():
    """A long sequence through a wide vocabulary: the peak of live allocations during
    forward and backward (the profiler's allocation events, in order) stays below one
    [N, V] float32 logits tensor, which the whole head holds several of."""
    from torch.profiler import ProfilerActivity, profile

    model = tiny_model("llama", vocab=8192, max_pos=2048, seed=0)
    ids = torch.randint(3, 8192, (1, 512))
    batch = TokenBatch(ids, torch.ones_like(ids), torch.ones(1, 512), torch.zeros(1, 512),
                       torch.ones(1))
    batch.loss_mask[0, 0] = 0
    peaks = {}
    for chunk in (None, 64):
        trainer = PolicyTrainer(model, TrainerConfig(logprob_chunk_tokens=chunk))
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            logp, _ = trainer.logprobs(batch)
            logp.sum().backward()
        trainer.optimizer.zero_grad(set_to_none=True)
        peak, live = 0, 0
        for event in sorted(prof.events(), key=lambda e: e.time_range.start):
            live += event.self_cpu_memory_usage
            peak = max(peak, live)
        peaks[chunk] = peak
    logits_bytes = 511 * 8192 * 4
    assert peaks[None] > 2 * logits_bytes
    assert peaks[64] < logits_bytes
