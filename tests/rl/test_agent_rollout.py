"""Agentic rollouts token by token: the agent plays real terminal tasks in task sandboxes,
every turn's prompt is the previous turn's ids plus what was sampled plus the
observation's ids (never re-rendered), and the trainer computes the engine's logprobs on
exactly those ids (the step-0 invariants: KL 0, ratio 1, logprobs within 1e-3)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ridgeline.agent import AgentConfig
from ridgeline.engine import LLM
from ridgeline.errors import ConfigError, ModelEndpointError
from ridgeline.llm.base import Completion, Message, Sampling
from ridgeline.llm.chat_template import continuation_ids, encode_chat
from ridgeline.llm.engine_client import EngineClient
from ridgeline.rl.agent_rollout import AgentRollout
from ridgeline.rl.filters import EpisodeOutcome, FilterConfig, filter_episode
from ridgeline.rl.losses import policy_loss
from ridgeline.rl.sampler import TaskSampler
from ridgeline.rl.token_chat import HISTORY_REWRITTEN, TokenChat
from ridgeline.rl.tokens import TokenBatch
from ridgeline.rl.trainer import PolicyTrainer
from ridgeline.tasks import load_tasks
from ridgeline.tasks.loader import builtin_suite_dir

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chatml_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character plus ChatML's two special tokens; <|im_end|> ends a turn."""
    vocab = {"<unk>": 0}
    for c in [chr(i) for i in range(32, 127)] + ["\n"]:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(".|\n"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.eos_token = "<|im_end|>"
    fast.chat_template = CHATML
    return fast


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return chatml_tokenizer()


@pytest.fixture(scope="module")
def tiny(tok) -> tuple[LlamaForCausalLM, LLM]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=False))
    llm = LLM.from_hf_model(model, tok, num_kv_blocks=2048, max_model_len=4096, max_num_seqs=16)
    return model, llm


class Recording:
    """A token generator that remembers every prompt it was given."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.context_window = inner.context_window
        self.prompts: list[list[int]] = []
        self.completions: list[Completion] = []

    def complete_ids(self, prompt_ids, sampling=None, tools=None) -> Completion:
        self.prompts.append(list(prompt_ids))
        c = self.inner.complete_ids(prompt_ids, sampling, tools)
        self.completions.append(c)
        return c


def hello_task():
    return {t.id: t for t in load_tasks(str(builtin_suite_dir()))}["hello-file"]


@pytest.fixture(scope="module")
def episodes(tiny, tok):
    """Two 3-turn episodes of a real task by a random model (format errors and failed
    commands make every episode multi-turn), each with its generator's prompts."""
    _, llm = tiny
    gens = []
    out = []
    for seed in (1, 2):
        gen = Recording(EngineClient(llm))
        rollout = AgentRollout(gen, tok, AgentConfig(step_limit=3),
                               Sampling(temperature=1.0, max_tokens=24))
        record, ep = rollout.episode(hello_task(), seed=seed, sample=0)
        gens.append(gen)
        out.append((record, ep))
    return out, gens


def test_each_turn_extends_the_previous_ids_exactly(episodes, tok):
    results, gens = episodes
    for (record, _), gen in zip(results, gens):
        assert len(gen.prompts) == 3                      # three turns, one sequence
        for k in range(1, len(gen.prompts)):
            before = gen.prompts[k - 1] + gen.completions[k - 1].token_ids
            assert gen.prompts[k][:len(before)] == before  # nothing re-tokenised
            assert len(gen.prompts[k]) > len(before)       # the observation came after it
        ep = record.sample
        assert ep.token_ids == gen.prompts[-1] + gen.completions[-1].token_ids
        # the loss mask covers exactly the sampled tokens
        sampled = [i for c in gen.completions for i in c.token_ids]
        assert [t for t, m in zip(ep.token_ids, ep.loss_mask) if m] == sampled
        assert sum(len(c.token_ids) for c in gen.completions) == ep.num_policy_tokens
        # the first prompt is what every client sends for these messages
        assert gen.prompts[0][:3] == encode_chat(tok, [Message(role="system", content="x")])[:3]


def test_graded_by_the_task_tests_and_kept_for_training(episodes):
    results, _ = episodes
    for record, ep in results:
        assert ep.verdict.status.value in ("passed", "failed"), ep.verdict.detail  # graded
        assert record.reward == ep.verdict.reward
        assert record.exit_status == "step_limit"
        assert filter_episode(record).reason == "step_limit"  # a limit: masked by default,
        assert filter_episode(record, FilterConfig(limit_policy="score")).mask  # or scored


def test_step_zero_invariants_on_multi_turn_episodes(episodes, tiny):
    model, _ = tiny
    results, _ = episodes
    batch = TokenBatch.of([r.sample for r, _ in results], [1.0, -1.0])
    trainer = PolicyTrainer(model)
    with torch.no_grad():
        new, entropy = trainer.logprobs(batch)
        loss, metrics = policy_loss(new, batch.behaviour_logprobs, batch.advantages,
                                    batch.loss_mask, ref_logprobs=new, kl_coef=0.1,
                                    entropy=entropy)
    mask = batch.loss_mask.bool()
    assert (new - batch.behaviour_logprobs)[mask].abs().max() < 1e-3
    assert abs(float(metrics["importance_ratio"]) - 1.0) < 1e-3
    assert abs(float(metrics["kl"])) < 1e-6
    assert float(metrics["clip_fraction"]) == 0.0


def test_every_token_carries_the_weights_version_it_was_sampled_under(tiny, tok):
    model, llm = tiny
    trainer = PolicyTrainer(model)
    gen = EngineClient(llm)
    chat = TokenChat(gen, tok, sampling=Sampling(temperature=1.0, max_tokens=8, seed=3))
    msgs = [Message(role="user", content="hi")]
    first = chat.chat(msgs)
    trainer.sync(llm.worker)                                  # version 1
    msgs += [Message(role="assistant", content=first.text),
             Message(role="user", content="Observation:\nok")]
    chat.chat(msgs)
    ep, why = chat.sample()
    assert why is None
    policy_versions = [v for v, m in zip(ep.versions, ep.loss_mask) if m]
    assert policy_versions == [0] * len(first.token_ids) + \
        [1] * (len(policy_versions) - len(first.token_ids))


def test_a_rewritten_history_is_answered_but_not_trained_on(tiny, tok):
    _, llm = tiny
    chat = TokenChat(EngineClient(llm), tok, sampling=Sampling(temperature=1.0, max_tokens=4))
    msgs = [Message(role="system", content="s"), Message(role="user", content="a")]
    reply = chat.chat(msgs)
    # the agent condensed its history: the first user turn is gone
    condensed = [msgs[0], Message(role="user", content="summary"),
                 Message(role="assistant", content=reply.text),
                 Message(role="user", content="b")]
    again = chat.chat(condensed)
    assert again.token_ids                                   # still answered
    ep, why = chat.sample()
    assert why == HISTORY_REWRITTEN
    rec = filter_episode(EpisodeOutcome(verdict="passed", reward=1.0, sample=ep, unusable=why))
    assert not rec.mask and rec.reason == HISTORY_REWRITTEN and rec.reward is None


def test_a_server_without_token_ids_is_a_clear_error(tok):
    class NoIds:
        name, context_window = "plain-server", 4096

        def complete_ids(self, prompt_ids, sampling=None, tools=None):
            return Completion(text="hi")

    chat = TokenChat(NoIds(), tok)
    with pytest.raises(ModelEndpointError, match="token ids"):
        chat.chat([Message(role="user", content="x")])


def test_rollouts_over_http_record_the_servers_ids_and_versions(tiny, tok):
    """The same recording against `ridgeline serve` (an OpenAI-compatible server that
    returns token ids): prompt ids in, sampled ids, logprobs and versions out."""
    from ridgeline.engine import LLMEngine
    from ridgeline.llm.openai_client import OpenAIClient
    from ridgeline.serve.app import ServerThread, create_app

    model, llm = tiny
    engine = LLMEngine.from_hf_model(model, tok, num_kv_blocks=512, max_model_len=4096)
    with ServerThread(create_app({"tiny": engine})) as srv:
        client = OpenAIClient(srv.base_url, model="tiny", context_window=4096)
        chat = TokenChat(client, tok, sampling=Sampling(temperature=0.0, max_tokens=6))
        msgs = [Message(role="user", content="hello")]
        remote = chat.chat(msgs)
        msgs += [Message(role="assistant", content=remote.text),
                 Message(role="user", content="more")]
        chat.chat(msgs)
        ep, why = chat.sample()
    assert why is None and remote.token_versions == [0] * len(remote.token_ids)
    # greedy: the in-process engine on the same weights samples the same ids
    local = EngineClient(llm).complete_ids(encode_chat(tok, msgs[:1]),
                                           Sampling(temperature=0.0, max_tokens=6))
    assert remote.token_ids == local.token_ids
    assert max(abs(a - b) for a, b in zip(remote.logprobs, local.logprobs)) < 1e-4
    assert ep.num_policy_tokens > len(remote.token_ids)


def test_continuation_ids_close_the_reply_and_open_the_next_turn(tok):
    obs = [Message(role="user", content="Observation:\nok")]
    after_eos = tok.decode(continuation_ids(tok, obs, "<|im_end|>"))
    assert after_eos == "\n<|im_start|>user\nObservation:\nok<|im_end|>\n<|im_start|>assistant\n"
    cut_off = tok.decode(continuation_ids(tok, obs, "x"))   # stopped by a stop string
    assert cut_off == "<|im_end|>" + after_eos
    with pytest.raises(ConfigError, match="assistant"):
        continuation_ids(tok, [Message(role="assistant", content="no")])


def test_a_template_that_rewrites_earlier_turns_is_refused(tok):
    import copy

    odd = copy.deepcopy(tok)
    # renders only the last message: adding a turn changes what came before
    odd.chat_template = "{{ messages[-1]['content'] }}"
    with pytest.raises(ConfigError, match="rewrites earlier turns"):
        continuation_ids(odd, [Message(role="user", content="x")])


def test_broken_sandboxes_never_reach_a_gradient(tiny, tok, monkeypatch):
    """Fault injection: a share of the task sandboxes fails its health probe after the
    agent acted. Those episodes are masked (reason kept) and no batch the trainer steps
    on contains one; the healthy episodes still train."""
    import itertools

    import ridgeline.rl.loop as rl_loop
    from ridgeline.sandbox.base import HealthReport
    from ridgeline.tasks.environment import TaskSandbox

    model, llm = tiny
    share = 0.5
    calls = itertools.count()
    broken: set[int] = set()
    real_health = TaskSandbox.health

    def flaky_health(self):
        n = next(calls)
        if int((n + 1) * share) > int(n * share):      # `share` of the sandboxes break
            broken.add(id(self))
            return HealthReport(healthy=False, checks={"exec": False},
                                problems=["injected fault"])
        return real_health(self)

    monkeypatch.setattr(TaskSandbox, "health", flaky_health)
    # A random model never passes; let every other graded episode pass so groups have
    # reward variance (the health probe runs inside the real verifier first).
    import dataclasses

    import ridgeline.tasks.steps as task_steps   # where an episode's verdict is made

    real_verify, graded = task_steps.verify, itertools.count()

    def verify(task, sb):
        v = real_verify(task, sb)
        if v.status.value == "failed" and next(graded) % 2:
            v = dataclasses.replace(v, status=type(v.status)("passed"), reward=1.0)
        return v

    monkeypatch.setattr(task_steps, "verify", verify)
    trained: list = []
    real_of = rl_loop.TokenBatch.of

    def record(episodes, advantages, **kw):
        trained.extend(episodes)
        return real_of(episodes, advantages, **kw)

    monkeypatch.setattr(rl_loop.TokenBatch, "of", staticmethod(record))
    rollout = AgentRollout(EngineClient(llm), tok, AgentConfig(step_limit=1),
                           Sampling(temperature=1.0, max_tokens=8))
    trainer = PolicyTrainer(model)
    loop = rl_loop.AsyncRLLoop(
        trainer, TaskSampler([hello_task()]), rollout, llm.worker,
        rl_loop.LoopConfig(group_size=4, batch_groups=2, eta=0, rollout_threads=1,
                           filters=FilterConfig(limit_policy="score")))
    groups = [rollout(hello_task(), [10 + i for i in range(4)]) for _ in range(2)]
    metrics = loop.train_step(groups)
    records = [r for g in groups for r in g.outcomes]
    unhealthy = [r for r in records if not r.healthy]
    assert len(unhealthy) == len(broken) >= 2                # the fault really hit
    assert all(r.verdict == "infra_error" and r.reward is None for r in unhealthy)
    assert metrics["masked/unhealthy_sandbox"] == len(unhealthy)
    reward = {id(r.sample): r.reward for r in records}
    assert trained and all(reward[id(ep)] is not None for ep in trained)
    bad = {id(r.sample) for r in unhealthy}
    assert not any(id(ep) in bad for ep in trained)         # none reached the gradient


def test_a_group_prepares_its_task_once_and_forks_it(tiny, tok, monkeypatch):
    """The group's environments are one prepared environment forked copy-on-write:
    the task is set up once per group, each episode acts in its own fork."""
    import ridgeline.rl.agent_rollout as agent_rollout
    from ridgeline.tasks.environment import TaskSandbox

    _, llm = tiny
    prepared: list[TaskSandbox] = []
    real_prepare = agent_rollout.prepare_environment

    def counting_prepare(task, **kw):
        sb = real_prepare(task, **kw)
        prepared.append(sb)
        return sb

    forked: list[TaskSandbox] = []
    real_fork = TaskSandbox.fork

    def counting_fork(self, n):
        kids = real_fork(self, n)
        forked.extend(kids)
        return kids

    monkeypatch.setattr(agent_rollout, "prepare_environment", counting_prepare)
    monkeypatch.setattr(TaskSandbox, "fork", counting_fork)
    rollout = AgentRollout(EngineClient(llm), tok, AgentConfig(step_limit=1),
                           Sampling(temperature=1.0, max_tokens=8))
    group = rollout(hello_task(), [1, 2, 3])
    assert len(prepared) == 1 and len(forked) == 3
    assert all(k.closed for k in forked) and prepared[0].closed
    assert len(group.outcomes) == 3 and all(o.verdict in ("passed", "failed")
                                            for o in group.outcomes), \
        [(o.verdict, o.detail) for o in group.outcomes]


def test_grammar_constrained_replies_are_answered_but_not_trained_on(tiny, tok):
    """Forced tool calls sample from a masked distribution the trainer does not
    recompute: the episode plays out, its tokens are not trained on, and RL's agent
    config does not ask for them."""
    from ridgeline.agent import AgentConfig
    from ridgeline.llm import ToolSpec
    from ridgeline.rl.agent_rollout import rl_agent_config
    from ridgeline.rl.token_chat import GRAMMAR_CONSTRAINED
    _, llm = tiny
    assert AgentConfig().constrained_tool_calls
    assert not rl_agent_config(AgentConfig()).constrained_tool_calls
    chat = TokenChat(EngineClient(llm), tok, sampling=Sampling(temperature=1.0, max_tokens=8))
    tool = ToolSpec(name="bash", description="run", parameters={
        "type": "object", "properties": {"command": {"type": "string", "maxLength": 4}},
        "required": ["command"]})
    chat.chat([Message(role="user", content="hi")], tools=[tool],
              sampling=Sampling(tool_choice="required", max_tokens=60))
    ep, why = chat.sample()
    assert ep is not None and why == GRAMMAR_CONSTRAINED
