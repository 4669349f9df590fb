"""EngineClient on the in-process engine with a tiny random Llama and a real tokenizer."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.helpers.tiny_tokenizer import QWEN_LIKE_TEMPLATE, tiny_tokenizer
from ridgeline.engine import LLM
from ridgeline.llm import ChatModel, ContextLengthError, EngineClient, Message, Sampling, ToolSpec
from ridgeline.llm.chat_template import render_prompt

CONVERSATION = [Message(role="system", content="You are terse."),
                Message(role="user", content="Say something.")]


def tiny_llama(vocab: int, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.15,
                         bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def hf_and_client() -> tuple[LlamaForCausalLM, EngineClient]:
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok))
    llm = LLM.from_hf_model(model, tok, num_kv_blocks=256, block_size=16, max_model_len=512)
    return model, EngineClient(llm, name="tiny-llama")


def test_token_in_token_out(hf_and_client) -> None:
    hf, client = hf_and_client
    assert isinstance(client, ChatModel) and client.context_window == 512
    assert not client.supports_tools  # SmolLM2-style template
    out = client.chat(CONVERSATION, sampling=Sampling(temperature=0.0, max_tokens=12))
    expected_prompt = client.tokenizer.encode(render_prompt(client.tokenizer, CONVERSATION),
                                              add_special_tokens=False)
    assert out.prompt_token_ids == expected_prompt == client.encode_prompt(CONVERSATION)
    assert client.count_tokens(CONVERSATION) == len(expected_prompt)
    assert 1 <= len(out.token_ids) <= 12 and len(out.logprobs) == len(out.token_ids)
    assert out.usage.prompt_tokens == len(expected_prompt)
    assert out.usage.completion_tokens == len(out.token_ids)
    assert out.finish_reason in ("stop", "length")
    # The logprobs are those of exactly these tokens after exactly this prompt: RL can
    # train on (prompt_token_ids + token_ids) without re-tokenising any text.
    ids = torch.tensor([out.prompt_token_ids + out.token_ids])
    with torch.no_grad():
        logits = hf(ids).logits[0].float().log_softmax(-1)
    n = len(out.prompt_token_ids)
    reference = [logits[n - 1 + i, t].item() for i, t in enumerate(out.token_ids)]
    assert out.logprobs == pytest.approx(reference, abs=1e-3)
    # greedy: the same again
    assert client.chat(CONVERSATION, sampling=Sampling(max_tokens=12)).token_ids == out.token_ids


def test_logprobs_can_be_left_out(hf_and_client) -> None:
    _, client = hf_and_client
    out = client.chat(CONVERSATION, sampling=Sampling(max_tokens=3, logprobs=False))
    assert out.logprobs is None and out.token_ids


def test_concurrent_callers_share_batches(hf_and_client) -> None:
    _, client = hf_and_client
    prompts = [[Message(role="user", content=f"question number {i}")] for i in range(4)]
    sampling = Sampling(max_tokens=16)
    sequential = [client.chat(p, sampling=sampling).token_ids for p in prompts]
    engine = client.llm.engine
    steps_before = engine.num_steps
    results: list[list[int] | None] = [None] * 4
    barrier = threading.Barrier(4)

    def worker(i: int) -> None:
        barrier.wait()
        results[i] = client.chat(prompts[i], sampling=sampling).token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == sequential
    # batched: far fewer engine steps than four requests one after another would take
    assert engine.num_steps - steps_before < sum(len(r) for r in sequential)


def test_prompt_longer_than_the_window(hf_and_client) -> None:
    _, client = hf_and_client
    with pytest.raises(ContextLengthError, match="does not fit"):
        client.chat([Message(role="user", content="x" * 600)])


def test_template_with_tools_gets_them_in_the_prompt() -> None:
    tok = tiny_tokenizer(QWEN_LIKE_TEMPLATE)
    client = EngineClient(LLM.from_hf_model(tiny_llama(len(tok)), tok, num_kv_blocks=64,
                                            max_model_len=512))
    assert client.supports_tools
    tool = ToolSpec(name="bash", description="run it")
    out = client.chat(CONVERSATION, tools=[tool], sampling=Sampling(max_tokens=4))
    prompt = client.tokenizer.decode(out.prompt_token_ids)
    assert '"name": "bash"' in prompt and "<tools>" in prompt


def test_close_stops_an_engine_the_client_started_and_leaves_a_given_one_running(
        hf_and_client, tmp_path) -> None:
    hf, given = hf_and_client
    tok = tiny_tokenizer()
    hf.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    own = EngineClient(str(tmp_path), num_kv_blocks=64)
    assert own.chat(CONVERSATION, sampling=Sampling(max_tokens=2)).token_ids
    assert own.llm.worker.is_running
    own.close()
    assert not own.llm.worker.is_running
    given.close()
    assert given.llm.worker.is_running
    assert given.chat(CONVERSATION, sampling=Sampling(max_tokens=2)).token_ids


def test_a_required_tool_call_is_held_to_the_tools_schemas() -> None:
    """A random model, which would write anything, writes one well-formed call of a real
    tool when the call is required (a grammar in the engine, llm/tool_grammar.py)."""
    import json

    import jsonschema
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), seed=2)
    model.config.max_position_embeddings = 4096   # the tools' system prompt is long here
    client = EngineClient(LLM.from_hf_model(model, tok, num_kv_blocks=512, block_size=16,
                                            max_model_len=4096))
    tools = [ToolSpec(name="bash", description="run a command", parameters={
                 "type": "object", "properties": {"command": {"type": "string",
                                                              "maxLength": 20}},
                 "required": ["command"], "additionalProperties": False}),
             ToolSpec(name="finish", description="stop", parameters={
                 "type": "object", "properties": {}, "additionalProperties": False})]
    for seed in range(4):
        out = client.chat(CONVERSATION, tools=tools, sampling=Sampling(
            temperature=1.0, seed=seed, max_tokens=700, tool_choice="required"))
        assert out.tool_call_errors == [] and len(out.tool_calls) == 1, out.text
        call = out.tool_calls[0]
        spec = next(t for t in tools if t.name == call.name)
        jsonschema.validate(call.arguments, spec.parameters)
        assert json.dumps(call.arguments)
