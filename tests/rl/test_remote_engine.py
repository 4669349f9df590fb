"""RL with rollouts on `ridgeline serve`: the agent talks to the server token-in/token-out,
each step's weights are pushed to it (`RemoteWeights`, `POST /v1/weights`), and after a
sync the server's logprobs on the recorded ids are the trainer's (the step-0 invariant
holds again at every version)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_agent_rollout import chatml_tokenizer, hello_task
from transformers import LlamaConfig, LlamaForCausalLM

from ridgeline.agent import AgentConfig
from ridgeline.engine import EngineConfig, LLMEngine
from ridgeline.errors import ConfigError
from ridgeline.llm.base import Sampling
from ridgeline.llm.openai_client import OpenAIClient
from ridgeline.llm.remote_weights import RemoteWeights
from ridgeline.rl.agent_rollout import AgentRollout
from ridgeline.rl.run import TrainConfig, train
from ridgeline.rl.run_log import read_metrics
from ridgeline.rl.tokens import TokenBatch
from ridgeline.rl.trainer import PolicyTrainer, TrainerConfig
from ridgeline.serve.app import ServerThread, create_app


def chatml_llama(vocab: int, eos: int, seed: int = 0, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        eos_token_id=eos, tie_word_embeddings=False))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny ChatML policy saved as a model directory with its tokenizer."""
    tok = chatml_tokenizer()
    path = tmp_path_factory.mktemp("models") / "policy"
    chatml_llama(len(tok), tok.eos_token_id).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def serve(model_dir: Path, **kw) -> ServerThread:
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=1024, max_model_len=4096))
    return ServerThread(create_app({"policy": engine}, weight_updates=True, **kw))


def test_after_each_sync_the_servers_logprobs_are_the_trainers(model_dir):
    tok = chatml_tokenizer()
    model = LlamaForCausalLM.from_pretrained(model_dir)
    trainer = PolicyTrainer(model, TrainerConfig(lr=1e-2))
    with serve(model_dir) as srv:
        client = OpenAIClient(srv.base_url, model="policy")
        weights = RemoteWeights(srv.base_url, "policy")
        rollout = AgentRollout(client, tok, AgentConfig(step_limit=2),
                               Sampling(temperature=1.0, max_tokens=16))
        for version in (0, 1, 2):
            record, _ = rollout.episode(hello_task(), seed=version, sample=0)
            ep = record.sample
            assert ep is not None and ep.num_policy_tokens > 0
            sampled = {v for v, m in zip(ep.versions, ep.loss_mask) if m}
            assert sampled == {version}
            batch = TokenBatch.of([ep], [1.0])
            with torch.no_grad():
                mine, _ = trainer.logprobs(batch)
            recorded = batch.behaviour_logprobs
            mask = batch.loss_mask.bool()
            assert (mine[mask] - recorded[mask]).abs().max() < 1e-3
            trainer.step(batch)                     # the weights move (lr 1e-2)...
            trainer.sync(weights)                   # ...and the server follows
            assert weights.describe()["version"] == version + 1
        with torch.no_grad():
            moved, _ = trainer.logprobs(batch)
        assert (moved[mask] - recorded[mask]).abs().max() > 1e-3


def remote_config(model_dir: Path, out: Path, url: str | list[str] | None, **engine
                  ) -> TrainConfig:
    return TrainConfig.model_validate({
        "policy": {"model": str(model_dir)},
        "tasks": {"source": "builtin", "ids": ["hello-file"], "check": False},
        "steps": 2, "out": str(out), "plots": False,
        "trainer": {"lr": 1e-3},
        "loop": {"group_size": 2, "batch_groups": 1, "eta": 1, "rollout_threads": 1,
                 "filters": {"limit_policy": "score", "skip_zero_variance": False}},
        "rollout": {"max_tokens": 12, "step_limit": 2},
        "engine": {"url": url, **engine}})


def test_a_train_run_with_rollouts_on_a_server(model_dir, tmp_path):
    with serve(model_dir) as srv:
        # the server starts with other weights (say, a previous run's): the run resets them
        other = chatml_llama(len(chatml_tokenizer()), chatml_tokenizer().eos_token_id, seed=9)
        RemoteWeights(srv.base_url, "policy").update_weights(
            [(n, p.detach()) for n, p in other.named_parameters()], version=41)
        result = train(remote_config(model_dir, tmp_path / "run", srv.base_url))
        info = RemoteWeights(srv.base_url, "policy").describe()
    assert result.steps_done == 2
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [0, 1]
    assert [m["version"] for m in metrics] == [1.0, 2.0] and info["version"] == 2
    assert metrics[0]["staleness_max"] == 0.0       # step 0 trained on version-0 tokens


def test_a_server_without_updates_or_with_another_model_fails_at_the_start(model_dir, tmp_path):
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=256))
    with ServerThread(create_app({"policy": engine})) as srv:
        with pytest.raises(ConfigError, match="does not accept weight updates"):
            train(remote_config(model_dir, tmp_path / "a", srv.base_url))
    tok = chatml_tokenizer()
    other = tmp_path / "other"
    chatml_llama(len(tok), tok.eos_token_id, layers=3).save_pretrained(other)
    tok.save_pretrained(other)
    with serve(other) as srv:
        with pytest.raises(ConfigError, match="is not this policy"):
            train(remote_config(model_dir, tmp_path / "b", srv.base_url))
    assert not (tmp_path / "a" / "metrics.jsonl").exists()


def test_the_token_family_needs_the_in_process_engine(tmp_path):
    cfg = TrainConfig.model_validate({"tasks": {"source": "shift"}, "out": str(tmp_path / "r"),
                                      "engine": {"url": "http://127.0.0.1:9/v1"}})
    with pytest.raises(ConfigError, match="in-process engine only"):
        train(cfg)


def test_rollouts_routed_over_two_servers_and_weights_sent_to_both(model_dir, tmp_path):
    with serve(model_dir) as a, serve(model_dir) as b:
        result = train(remote_config(model_dir, tmp_path / "run", [a.base_url, b.base_url]))
        versions = [RemoteWeights(s.base_url, "policy").describe()["version"] for s in (a, b)]
    assert result.steps_done == 2 and versions == [2, 2]
    last = read_metrics(tmp_path / "run")[-1]
    assert last["replica/0/requests"] + last["replica/1/requests"] > 0


def test_a_run_over_two_domains_reports_their_shares_and_resumes_the_schedule(model_dir,
                                                                               tmp_path):
    """The domain scheduler drives an in-process run on two task domains: metrics carry
    each domain's starts and caps, report.json their shares, and --resume continues the
    scheduler's state (its kind is checked)."""
    cfg = remote_config(model_dir, tmp_path / "run", None)
    cfg = cfg.model_copy(update={
        "tasks": cfg.tasks.model_copy(update={"ids": ["hello-file", "sh-copy-file"]}),
        "loop": cfg.loop.model_copy(update={"batch_groups": 2, "rollout_threads": 2}),
        "engine": cfg.engine.model_copy(update={"url": None, "replicas": 2})})
    first = train(cfg)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert set(report["domains"]) == {"shell-and-files", "shell-basics"}
    assert sum(d["share_of_starts"] for d in report["domains"].values()) == pytest.approx(1.0)
    metrics = read_metrics(tmp_path / "run")
    assert {"sched/shell-basics/started", "sched/shell-and-files/cap"} <= set(metrics[-1])
    state = json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())
    assert state["sampler"]["kind"] == "domain" and first.steps_done == 2
    resumed = train(cfg.model_copy(update={"steps": 3}), resume=True)
    assert resumed.steps_done == 3
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [0, 1, 2]
