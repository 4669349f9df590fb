"""`ridgeline sft`: oracle solutions played by the agent loop become episodes in exactly
the token format RL samples, episode files are checked before they are trained on, and
a run has `ridgeline train`'s run directory, checkpoints and `--resume`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ridgeline.errors import ConfigError
from ridgeline.llm.base import Message
from ridgeline.llm.chat_template import encode_chat
from ridgeline.rl import checkpoint
from ridgeline.rl.config import RolloutSettings
from ridgeline.rl.parts import family_tasks, rollout_agent_config
from ridgeline.rl.policy import PolicyConfig, load_policy
from ridgeline.rl.run_log import read_metrics
from ridgeline.rl.sft import SFTConfig, sft
from ridgeline.rl.sft_data import (
    ScriptedReplies, inspect_commands, oracle_episode, oracle_replies, read_episodes, token_runs,
    write_episodes,
)
from ridgeline.rl.tokens import TokenBatch, TokenEpisode
from ridgeline.rl.trainer import PolicyTrainer, TrainerConfig
from ridgeline.rl.config import FamilySelection
from tests.helpers.tiny_tokenizer import tiny_tokenizer

FAMILIES = ["sort-numbers", "replace-word"]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok) -> Path:
    """A tiny random Llama with a byte-level tokenizer, saved as a model directory."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=False))
    path = tmp_path_factory.mktemp("models") / "tiny"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    kept, excluded = family_tasks(FamilySelection(names=FAMILIES, instances=1), root, "bwrap")
    assert not excluded and len(kept) == 2
    return kept


def test_an_oracle_episode_is_the_agent_loop_token_format_with_loss_on_replies_only(tok, tasks):
    agent = rollout_agent_config(RolloutSettings())
    ep = oracle_episode(tasks[0], tok, agent, context_window=4096, style="direct")
    assert not isinstance(ep, str), ep
    parts = token_runs(ep.tokens)
    # prompt, reply (plan + the solution as a shell block), observation, finish
    assert [m for m, _ in parts] == [0, 1, 0, 1]
    # the prompt is exactly what the agent sends an engine: its system and task messages
    # through the chat template
    system = agent.system_template.split("{format_help}")[0]
    prompt = tok.decode(parts[0][1])
    assert prompt.startswith("<|im_start|>system\n" + system)
    assert tasks[0].instruction in prompt and prompt.endswith("<|im_start|>assistant\n")
    head = encode_chat(tok, [Message(role="system", content=prompt.split(
        "<|im_start|>system\n")[1].split("<|im_end|>")[0]), Message(
        role="user", content=prompt.split("<|im_start|>user\n")[1].split("<|im_end|>")[0])])
    assert parts[0][1] == head
    reply = tok.decode(parts[1][1])
    assert "```bash\n" in reply and reply.endswith("```<|im_end|>")
    assert "Observation" in tok.decode(parts[2][1])
    assert tok.decode(parts[3][1]).startswith("<finish>")


def test_an_inspect_oracle_episode_looks_at_the_input_solves_checks_the_output_then_finishes(
        tok, tasks):
    task = tasks[0]                           # sort-numbers: /app/<in>.txt -> /app/<out>.txt
    ep = oracle_episode(task, tok, rollout_agent_config(RolloutSettings()),
                        context_window=4096)
    assert not isinstance(ep, str), ep
    parts = token_runs(ep.tokens)
    assert [m for m, _ in parts] == [0, 1] * 4
    replies = [tok.decode(ids) for m, ids in parts if m == 1]
    observations = [tok.decode(ids) for m, ids in parts[2::2]]
    files = sorted(p.name for p in task.files_dir.iterdir())  # type: ignore[union-attr]
    assert f"head -n 8 {files[0]}" in replies[0]
    numbers = (task.files_dir / files[0]).read_text().split()  # type: ignore[operator]
    assert numbers[0] in observations[0]      # the policy sees the real input
    solution = task.solution_script.read_text().splitlines()[-1]  # type: ignore[union-attr]
    assert solution in replies[1]
    out = solution.split("> ")[-1].strip()
    assert f"head -n 8 {out}" in replies[2]
    assert sorted(numbers, key=int)[0] in observations[2] or sorted(
        numbers, key=int)[-1] in observations[2]       # and what its command wrote
    assert replies[3].startswith("<finish>")


def test_every_training_family_gives_inspect_oracle_episodes_whose_actions_all_succeed(
        tok, tmp_path):
    """The look and check commands are built from each family's instruction and files;
    an oracle episode with a failed action would be left out (and teach finishing after
    an error if it were not)."""
    from ridgeline.rl.sft_data import oracle_episodes
    from ridgeline.tasks.families import families

    tasks, excluded = family_tasks(FamilySelection(split="train", instances=1), tmp_path,
                                   "bwrap")
    assert not excluded
    episodes, left_out = oracle_episodes(tasks, tok, rollout_agent_config(RolloutSettings()),
                                         context_window=16384)
    assert not left_out, left_out
    assert len(episodes) == len(tasks) == len(families("train"))


def test_an_inspect_episode_whose_check_fails_is_played_direct_instead(tok, tasks, tmp_path):
    import shutil

    import yaml

    from ridgeline.tasks.loader import load_task

    odd = tmp_path / "odd"
    shutil.copytree(tasks[0].path, odd)
    # the instruction names a path that no step creates: the check's look at it fails
    meta = yaml.safe_load((odd / "task.yaml").read_text())
    meta["instruction"] += " Notes, if any, are in /app/NOTES.md."
    (odd / "task.yaml").write_text(yaml.safe_dump(meta))
    task = load_task(odd)
    assert "head -n 8 NOTES.md" in inspect_commands(task)[1]
    ep = oracle_episode(task, tok, rollout_agent_config(RolloutSettings()), context_window=4096)
    assert not isinstance(ep, str), ep
    replies = [tok.decode(ids) for m, ids in token_runs(ep.tokens) if m == 1]
    assert len(replies) == 2 and "NOTES" not in "".join(replies)   # solution, finish


def test_sft_refuses_a_step_limit_too_short_for_its_oracle_episodes():
    with pytest.raises(ValueError, match="step_limit to 4"):
        SFTConfig(rollout=RolloutSettings(step_limit=3))
    SFTConfig(rollout=RolloutSettings(step_limit=2), oracle_style="direct")


def test_a_solution_the_agent_cannot_type_is_left_out_with_its_reason(tok, tasks, tmp_path):
    import shutil

    from ridgeline.tasks.loader import load_task

    broken = tmp_path / "broken"
    shutil.copytree(tasks[0].path, broken)
    (broken / "solution.sh").write_text("#!/bin/bash\nset -e\necho wrong > /app/ordered.txt\n")
    ep = oracle_episode(load_task(broken), tok, rollout_agent_config(RolloutSettings()),
                        context_window=4096)
    assert isinstance(ep, str) and "did not pass" in ep
    (broken / "solution.sh").write_text("#!/bin/bash\n# nothing\n")
    with pytest.raises(ConfigError, match="one shell block"):
        oracle_replies(load_task(broken))


def test_scripted_replies_end_where_a_stop_string_ends_sampling(tok):
    gen = ScriptedReplies(["think\n<bash>ls</bash>", "done"], tok, name="s",
                          context_window=100, eos_id=tok.eos_token_id)
    from ridgeline.llm.base import Sampling

    first = gen.complete_ids([1], Sampling(stop=["</bash>"]))
    assert first.text == "think\n<bash>ls" and first.stop_reason == "</bash>"
    assert tok.decode(first.token_ids) == "think\n<bash>ls</bash>"
    second = gen.complete_ids([1], Sampling(stop=["</bash>"]))
    assert second.token_ids[-1] == tok.eos_token_id and second.stop_reason is None
    with pytest.raises(ConfigError, match="reply 3 of 2"):
        gen.complete_ids([1])


def test_episode_files_round_trip_and_refuse_ids_that_do_not_retokenise(tok, tasks, tmp_path):
    ep = oracle_episode(tasks[1], tok, rollout_agent_config(RolloutSettings()),
                        context_window=4096)
    assert not isinstance(ep, str)
    identity = {"architecture": "LlamaForCausalLM", "vocab_size": len(tok)}
    path = write_episodes(tmp_path / "e.jsonl", [ep], tok, identity)  # type: ignore[arg-type]
    back = read_episodes(path, tok, identity)  # type: ignore[arg-type]
    assert back[0].tokens.token_ids == ep.tokens.token_ids
    assert back[0].tokens.loss_mask == ep.tokens.loss_mask
    rec = json.loads(path.read_text())
    # a prompt token swapped for another that decodes the same way is not what the
    # template renders: refused, never trained on
    bad = dict(rec, token_ids=list(rec["token_ids"]))
    bad["token_ids"][3] = 999_999
    (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
    with pytest.raises(ConfigError, match="cannot be trained on"):
        read_episodes(tmp_path / "bad.jsonl", tok, identity)  # type: ignore[arg-type]
    text_changed = dict(rec, texts=["something else", *rec["texts"][1:]])
    (tmp_path / "bad2.jsonl").write_text(json.dumps(text_changed) + "\n")
    with pytest.raises(ConfigError, match="line 1"):
        read_episodes(tmp_path / "bad2.jsonl", tok, identity)  # type: ignore[arg-type]
    other = {"architecture": "LlamaForCausalLM", "vocab_size": 49152}
    with pytest.raises(ConfigError, match="another model"):
        read_episodes(path, tok, other)  # type: ignore[arg-type]


def test_the_supervised_loss_is_the_mean_nll_of_the_policy_tokens_only(model_dir):
    policy = load_policy(PolicyConfig(model=str(model_dir)))
    trainer = PolicyTrainer(policy, TrainerConfig(lr=1e-9, micro_batch_size=1))
    a = TokenEpisode.start([5, 6, 7])
    a.add_completion([8, 9], [0.0, 0.0], [0, 0])
    b = TokenEpisode.start([5, 6])
    b.add_completion([10], [0.0], [0])
    batch = TokenBatch.of([a, b], [0.0, 0.0], pad_id=0)
    with torch.no_grad():
        logits = policy.model(input_ids=batch.token_ids,
                              attention_mask=batch.attention_mask).logits.float()
    logp = torch.log_softmax(logits, -1)
    want = -(logp[0, 2, 8] + logp[0, 3, 9] + logp[1, 1, 10]) / 3
    metrics = trainer.supervised_step(batch)
    assert metrics["sft/nll"] == pytest.approx(float(want), rel=1e-4)
    empty = TokenBatch.of([TokenEpisode.start([1, 2])], [0.0])
    with pytest.raises(ConfigError, match="without a single policy token"):
        trainer.supervised_step(empty)


def sft_config(model_dir: Path, out: Path, **over) -> SFTConfig:
    cfg = {"policy": {"model": str(model_dir)},
           "tasks": {"families": {"names": FAMILIES, "instances": 1}},
           "epochs": 40, "batch_size": 2, "checkpoint_every": 5, "out": str(out),
           "trainer": {"lr": 1e-2, "micro_batch_size": 2}, "plots": False}
    cfg.update(over)
    return SFTConfig.model_validate(cfg)


def test_sft_learns_the_oracle_episodes_and_resumes_where_it_stopped(model_dir, tok, tmp_path):
    out = tmp_path / "run"
    first = sft(sft_config(model_dir, out, epochs=20))
    assert first.steps_done == 20 and first.episodes == {"oracle": 2}
    assert (out / "episodes" / "oracle.jsonl").is_file()
    assert checkpoint.find(out) is not None
    # the run directory holds a model the engine and `ridgeline train` load
    assert (out / "checkpoint" / "config.json").is_file()
    with pytest.raises(ConfigError, match="already holds a run"):
        sft(sft_config(model_dir, out))
    # resume: the same run with more epochs goes on from step 20, nothing repeated
    second = sft(sft_config(model_dir, out), resume=True)
    assert second.steps_done == 40
    steps = [m["step"] for m in read_metrics(out)]
    assert steps == list(range(40))
    nll = [m["sft/nll"] for m in read_metrics(out)]
    assert nll[-1] < 0.5 * nll[0], nll
    from ridgeline.rl.run_plots import plot_run

    assert "sft_loss" in plot_run(out)
    # `ridgeline train` (and eval, serve) take the run directory as the model
    from ridgeline.rl.policy import hf_model_dir

    assert hf_model_dir(str(out)) == out / "checkpoint"
    policy = load_policy(PolicyConfig(model=str(out)))
    assert policy.identity["vocab_size"] == len(tok)


@pytest.mark.parametrize("over, message", [
    ({"oracle": False}, "no data"),
    ({"tasks": {"source": "shift"}}, "token family"),
    ({"tasks": {"eval_ids": ["x"]}}, "does not evaluate"),
    ({"trainer": {"temperature": 0.7}}, "temperature must be 1"),
])
def test_sft_config_mistakes_are_refused_before_anything_runs(tmp_path, over, message):
    with pytest.raises(ValueError, match=message):
        sft_config(tmp_path, tmp_path / "o", **over)


def test_families_of_the_wrong_split_are_an_error(tmp_path):
    with pytest.raises(ConfigError, match="not of the train split"):
        family_tasks(FamilySelection(names=["longest-line"], split="train"), tmp_path, "bwrap")


class ScriptedRollout:
    """Plays episodes from a table: (task id, sample) -> (passed, ids)."""

    def __init__(self, table):
        self.table = table

    def episode(self, task, seed, sample):
        from ridgeline.rl.filters import EpisodeOutcome

        ok, ids = self.table[(task.id, sample)]
        tokens = TokenEpisode.start([1, 2])
        tokens.add_completion(ids, [0.0] * len(ids), [0] * len(ids))
        return EpisodeOutcome(verdict="passed" if ok else "failed",
                              reward=1.0 if ok else 0.0, sample=tokens), None


def test_rejection_sampling_keeps_each_distinct_passing_episode_once(tasks):
    from ridgeline.rl.sft_data import rejection_sampled

    a, b = tasks[0].id, tasks[1].id
    rollout = ScriptedRollout({(a, 0): (True, [5]), (a, 1): (True, [5]), (a, 2): (False, [6]),
                               (b, 0): (False, [7]), (b, 1): (True, [8]), (b, 2): (True, [9])})
    kept, played = rejection_sampled(rollout, tasks, samples=3, seed=0)  # type: ignore[arg-type]
    assert played == 6
    assert sorted((e.task_id, e.tokens.token_ids[-1]) for e in kept) == sorted(
        [(a, 5), (b, 8), (b, 9)])
    assert all(e.source == "rollout" for e in kept)


def test_a_rejection_sampling_round_samples_from_the_trained_weights_and_keeps_its_file(
        model_dir, tmp_path):
    out = tmp_path / "rft"
    res = sft(sft_config(model_dir, out, epochs=2, rejection_sampling={
        "rounds": 1, "samples": 2, "epochs": 1},
        rollout={"max_tokens": 32, "step_limit": 2}, engine={"max_num_seqs": 8},
        oracle_style="direct"))
    # 2 oracle epochs of 1 batch, then one epoch over oracle + kept rollouts
    assert (out / "episodes" / "rejection-1.jsonl").is_file()
    kept = res.episodes.get("rollout", 0)
    assert res.steps_done == 2 + -(-(2 + kept) // 2)
    assert [m["sft/phase"] for m in read_metrics(out)][:2] == [0, 0]
    assert read_metrics(out)[-1]["sft/phase"] == 1


def test_resuming_with_another_model_is_refused(model_dir, tok, tmp_path):
    out = tmp_path / "run"
    sft(sft_config(model_dir, out, epochs=1))
    torch.manual_seed(1)
    other = tmp_path / "other"
    LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
        eos_token_id=tok.eos_token_id)).save_pretrained(other)
    tok.save_pretrained(other)
    with pytest.raises(ConfigError, match="another model"):
        sft(sft_config(other, out, epochs=2), resume=True)
