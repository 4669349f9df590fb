"""`ridgeline serve` end to end: a live uvicorn server on 127.0.0.1 driven by the official
`openai` client, raw HTTP and `ridgeline.llm.OpenAIClient`.

Two tiny models are served side by side: "tiny", a random Llama, and "tiny-tools", a Llama
whose weights are set by hand so that, after any chat prompt, it writes one fixed Hermes
tool call token by token. Its layers are zeroed (each position only sees its own token)
and its embedding and head map each token of the call to the next one, so the real engine
and server produce a real tool call that the tests can check exactly.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ridgeline.engine import LLM, LLMEngine, SamplingParams
from ridgeline.serve.app import ServerThread, create_app
from ridgeline.errors import ConfigError
from ridgeline.llm import ContextLengthError, Message, OpenAIClient, Sampling, ToolSpec
from tests.helpers.engine_fixtures import char_tokenizer

EOS = 2
CALL_PIECES = ["<tool_call>", '\n{"name": "get_weather", ', '"arguments": {"city": ',
               '"Paris"}', "}\n", "</tool_call>"]
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
MAX_LEN = 2048


def make_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer of the engine fixtures (</s> is EOS), with the pieces of the
    scripted tool call as added tokens and this module's chat template."""
    fast = char_tokenizer()
    fast.add_tokens(CALL_PIECES)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def llama(vocab: int, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=MAX_LEN, initializer_range=0.15,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=EOS)
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def tool_calling_llama(tok: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """After '>' (the end of '<assistant>') it writes CALL_PIECES, then </s>."""
    model = llama(len(tok))
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    chain = [tok.convert_tokens_to_ids(">")] + [tok.convert_tokens_to_ids(p)
                                                for p in CALL_PIECES] + [EOS]
    model.model.embed_tokens.weight.zero_()
    model.lm_head.weight.zero_()
    for j, (src, dst) in enumerate(zip(chain, chain[1:])):
        model.model.embed_tokens.weight[src, j] = 1.0
        model.lm_head.weight[dst, j] = 5.0  # logit 40 after RMSNorm scales by sqrt(64)
    return model


def engine_for(model: Any, tok: Any, **kw: Any) -> LLMEngine:
    return LLMEngine.from_hf_model(model, tok, num_kv_blocks=kw.pop("num_kv_blocks", 400),
                                   max_model_len=kw.pop("max_model_len", MAX_LEN), **kw)


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture(scope="module")
def random_model(tok: Any) -> LlamaForCausalLM:
    return llama(len(tok), seed=1)


@pytest.fixture(scope="module")
def reference(random_model: Any, tok: Any) -> LLMEngine:
    """An engine on the same weights, outside the server, for expected outputs."""
    return engine_for(random_model, tok)


@pytest.fixture(scope="module")
def server(random_model: Any, tok: Any):
    app = create_app({"tiny": engine_for(random_model, tok),
                      "tiny-tools": engine_for(tool_calling_llama(tok), tok)})
    with ServerThread(app) as srv:
        srv.app = app
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def run_reference(engine: LLMEngine, prompt_ids: list[int], **params: Any) -> Any:
    engine.add_request("ref", prompt_token_ids=prompt_ids, params=SamplingParams(**params))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    return final


def chat_prompt_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


HELLO = [{"role": "user", "content": "Hello there"}]


# ---- basics -------------------------------------------------------------------------------------


def test_models_health_and_plain_chat(server: ServerThread, client: openai.OpenAI, tok: Any,
                                      reference: LLMEngine) -> None:
    ids = {m.id: m for m in client.models.list().data}
    assert set(ids) == {"tiny", "tiny-tools"}
    assert ids["tiny"].model_extra["max_model_len"] == MAX_LEN
    assert httpx.get(server.url + "/health").json()["status"] == "ok"

    r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=12,
                                       temperature=0)
    expected = run_reference(reference, chat_prompt_ids(tok, HELLO), max_tokens=12,
                             temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_streamed_chat_matches_whole_and_ends_with_done(server: ServerThread,
                                                       client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=20,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20

    body = {"model": "tiny", "messages": HELLO, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])


def test_n_samples_logprobs_and_token_ids(client: openai.OpenAI, tok: Any,
                                          reference: LLMEngine) -> None:
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, n=3,
                                       temperature=1.0, seed=5)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1  # three samples, not one copied
    assert r.usage.completion_tokens == 24

    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8,
                                                n=2, temperature=1.0, seed=5, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert set(streamed) == {0, 1} and all(len(t) > 0 for t in streamed.values())

    r = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"return_token_ids": True})
    expected = run_reference(reference, chat_prompt_ids(tok, HELLO), max_tokens=6,
                             temperature=0, logprobs=3).outputs[0]
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == expected.token_ids
    assert choice.model_extra["token_versions"] == [0] * len(expected.token_ids)
    assert r.model_extra["prompt_token_ids"] == chat_prompt_ids(tok, HELLO)
    content = choice.logprobs.content
    assert [t.token for t in content] == [tok.decode([i]) for i in expected.token_ids]
    for entry, lp in zip(content, expected.logprobs):
        assert entry.logprob == pytest.approx(lp, abs=1e-4)
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy takes the most likely


def test_stop_and_seed(client: openai.OpenAI) -> None:
    text = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=16,
                                          temperature=0).choices[0].message.content
    stop = text[5:7]
    cut = text.index(stop)
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=16,
                                       temperature=0, stop=[stop])
    assert r.choices[0].message.content == text[:cut]
    assert r.choices[0].finish_reason == "stop"

    def sample(seed: int) -> str:
        return client.chat.completions.create(
            model="tiny", messages=HELLO, max_tokens=16, temperature=1.0, seed=seed,
        ).choices[0].message.content

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_max_completion_tokens_and_completions_endpoint(client: openai.OpenAI, tok: Any,
                                                        reference: LLMEngine) -> None:
    r = client.chat.completions.create(model="tiny", messages=HELLO, max_completion_tokens=3,
                                       temperature=0)
    assert r.usage.completion_tokens == 3

    r = client.completions.create(model="tiny", prompt="abc", max_tokens=7, temperature=0)
    expected = run_reference(reference, tok("abc")["input_ids"], max_tokens=7, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == expected.outputs[0].text
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)

    ids = tok.encode("xyz", add_special_tokens=False)
    r = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=4, n=2,
                                  temperature=0, logprobs=2, echo=False)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert len({c.text for c in r.choices}) == 1  # greedy: all four the same
    assert len(r.choices[0].logprobs.tokens) == 4

    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="abc", max_tokens=7, temperature=0, stream=True, echo=True))
    assert streamed == "abc" + expected.outputs[0].text


# ---- tools --------------------------------------------------------------------------------------


def test_tool_call_parsed_whole_and_streamed(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model="tiny-tools", messages=ask, tools=[WEATHER_TOOL],
                                       temperature=0, max_tokens=50)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    deltas = []
    finish = None
    content = ""
    for chunk in client.chat.completions.create(model="tiny-tools", messages=ask,
                                                tools=[WEATHER_TOOL], temperature=0,
                                                max_tokens=50, stream=True):
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    # One call, streamed as OpenAI does: its id and name first, then its arguments.
    assert {d.index for d in deltas} == {0} and len(deltas) > 1
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    args = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(args) == {"city": "Paris"}
    with client.chat.completions.stream(model="tiny-tools", messages=ask, tools=[WEATHER_TOOL],
                                        temperature=0, max_tokens=50) as stream:
        final = stream.get_final_completion()  # the openai library's own accumulator
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == args

    # Without tools (or with tool_choice "none") the same text is plain content.
    r = client.chat.completions.create(model="tiny-tools", messages=ask, temperature=0,
                                       max_tokens=50)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == "".join(CALL_PIECES)
    r = client.chat.completions.create(model="tiny-tools", messages=ask, tools=[WEATHER_TOOL],
                                       tool_choice="none", temperature=0, max_tokens=50)
    assert r.choices[0].message.tool_calls is None


def test_tools_are_rendered_into_the_prompt(client: openai.OpenAI, tok: Any) -> None:
    def prompt_of(**kw: Any) -> str:
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
            temperature=0, extra_body={"return_token_ids": True}, **kw)
        return tok.decode(r.model_extra["prompt_token_ids"])

    plain = prompt_of()
    with_tools = prompt_of(tools=[WEATHER_TOOL])
    assert "get_weather" not in plain
    assert '"name": "get_weather"' in with_tools and "<tools>" in with_tools
    assert "get_weather" not in prompt_of(tools=[WEATHER_TOOL], tool_choice="none")
    # a forced call is a grammar (llm/tool_grammar.py), not a prompt prefix
    named = prompt_of(tools=[WEATHER_TOOL],
                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named == with_tools == prompt_of(tools=[WEATHER_TOOL], tool_choice="required")

    # An earlier assistant tool call and its result go back into the prompt.
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER_TOOL],
                                       max_tokens=1, extra_body={"return_token_ids": True})
    text = tok.decode(r.model_extra["prompt_token_ids"])
    assert '"city": "Oslo"' in text and "<tool_response>\nsunny\n</tool_response>" in text


SYSTEM = {"role": "system", "content": "You answer briefly."}
TOOL_HISTORY = [SYSTEM, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


@pytest.fixture(scope="module")
def offline_llm(random_model: Any, tok: Any) -> Any:
    """`LLM` (offline generation) on the weights the server serves as "tiny"."""
    llm = LLM.from_hf_model(random_model, tok, num_kv_blocks=400, max_model_len=MAX_LEN)
    yield llm
    llm.worker.stop()


@pytest.mark.parametrize(("messages", "tools"), [
    (HELLO, None), ([SYSTEM, *HELLO], None), (HELLO, [WEATHER_TOOL]),
    ([SYSTEM, *HELLO], [WEATHER_TOOL]), (TOOL_HISTORY, [WEATHER_TOOL]),
], ids=["user", "system", "tools", "system-and-tools", "tool-call-history"])
def test_llm_chat_and_the_server_feed_the_same_prompt_ids(
        server: ServerThread, offline_llm: Any, tok: Any, messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None) -> None:
    body: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 1,
                            "return_token_ids": True}
    if tools:
        body["tools"] = tools
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60)
    served = r.json()["prompt_token_ids"]
    offline = offline_llm.chat(messages, SamplingParams(max_tokens=1), tools=tools)[0]
    assert offline.prompt_token_ids == served
    text = tok.decode(served)
    assert ("<tools>" in text) == bool(tools)
    assert text.count(SYSTEM["content"]) == (SYSTEM in messages)


def test_ridgeline_openai_client_runs_against_the_server(server: ServerThread, tok: Any) -> None:
    with OpenAIClient(server.base_url, model="tiny-tools", request_token_ids=True,
                      max_retries=0) as model:
        assert model.context_window == MAX_LEN
        spec = ToolSpec(name="get_weather", description="Weather in a city",
                        parameters=WEATHER_TOOL["function"]["parameters"])
        done = model.chat([Message(role="user", content="Weather in Paris?")], tools=[spec])
        assert [(c.name, c.arguments) for c in done.tool_calls] == [("get_weather",
                                                                     {"city": "Paris"})]
        assert done.finish_reason == "tool_calls"
        assert tok.decode(done.token_ids) == "".join(CALL_PIECES) + "</s>"  # EOS kept for RL
        assert done.logprobs is not None and len(done.logprobs) == len(done.token_ids)
        assert done.prompt_token_ids and done.usage.prompt_tokens == len(done.prompt_token_ids)
        cut = model.chat([Message(role="user", content="Weather?")],
                         sampling=Sampling(stop=['"Paris"']))
        assert cut.text == "".join(CALL_PIECES).split('"Paris"')[0]
        assert cut.finish_reason == "stop" and cut.stop_reason == '"Paris"'
        with pytest.raises(ContextLengthError):
            model.chat([Message(role="user", content="x" * (MAX_LEN + 10))])


# ---- bad input ----------------------------------------------------------------------------------


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
        server: ServerThread, client: openai.OpenAI) -> None:
    url = server.base_url + "/chat/completions"
    good = {"model": "tiny", "messages": HELLO, "max_tokens": 2}

    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"

    r = httpx.post(url, json={"model": "tiny"})
    assert r.status_code == 400 and error_of(r)["param"] == "messages"

    r = httpx.post(url, json={**good, "model": "nope"})
    assert r.status_code == 404
    err = error_of(r)
    assert err["code"] == "model_not_found" and "tiny" in err["message"]

    r = httpx.post(url, json={**good, "messages": [{"role": "user", "content": "x" * MAX_LEN}]})
    assert r.status_code == 400
    err = error_of(r)
    assert err["code"] == "context_length_exceeded" and "maximum context length" in err["message"]

    r = httpx.post(url, json={**good, "max_tokens": -1})
    assert r.status_code == 400 and error_of(r)["param"] == "max_tokens"

    r = httpx.post(url, json={**good, "messages": [{"role": "wizard", "content": "hi"}]})
    assert r.status_code == 400 and error_of(r)["param"].startswith("messages.0")
    r = httpx.post(url, json={**good, "top_k": -5})
    assert r.status_code == 400 and error_of(r)["param"] == "top_k"
    r = httpx.post(server.base_url + "/completions",
                   json={"model": "tiny", "prompt": [[1, 2, 10**6]]})
    assert r.status_code == 400 and "prompt_token_ids" in error_of(r)["message"]
    r = httpx.get(server.base_url + "/no-such-route")
    assert r.status_code == 404 and error_of(r)["type"] == "not_found_error"

    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=-3)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=HELLO)

    r = httpx.post(url, json=good)  # still serving
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(server.url + "/health").status_code == 200


def test_api_key(random_model: Any, tok: Any) -> None:
    app = create_app({"tiny": engine_for(random_model, tok, num_kv_blocks=40,
                                         max_model_len=256)}, api_key="sekret")
    with ServerThread(app) as srv:
        r = httpx.get(srv.base_url + "/models")
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
        r = httpx.get(srv.base_url + "/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert httpx.get(srv.url + "/health").status_code == 200  # probes need no key
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.base_url, api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=srv.base_url, api_key="sekret", max_retries=0)
        assert ok.chat.completions.create(model="tiny", messages=HELLO,
                                          max_tokens=2).usage.completion_tokens == 2


def test_one_engine_cannot_be_served_twice(random_model: Any, tok: Any) -> None:
    engine = engine_for(random_model, tok, num_kv_blocks=8, max_model_len=64)
    with pytest.raises(ConfigError):
        create_app({"a": engine, "b": engine})


# ---- disconnects and metrics ---------------------------------------------------------------------


def wait_for(condition: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_client_disconnect_aborts_the_request(server: ServerThread) -> None:
    worker = server.app.state.workers["tiny"]
    engine = worker.engine
    long = {"model": "tiny", "messages": HELLO, "max_tokens": 1500, "ignore_eos": True,
            "temperature": 0}

    aborted, generated = worker.num_aborted, engine.num_generated_tokens
    with httpx.stream("POST", server.base_url + "/chat/completions",
                      json={**long, "stream": True}) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")  # the stream started; now hang up
    assert wait_for(lambda: worker.num_aborted == aborted + 1)
    assert wait_for(lambda: worker.stats.num_running == 0 and not engine.has_unfinished_requests())
    assert engine.num_generated_tokens - generated < 1500

    aborted, generated = worker.num_aborted, engine.num_generated_tokens
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up
        httpx.post(server.base_url + "/chat/completions", json={**long, "n": 2}, timeout=0.3)
    assert wait_for(lambda: worker.num_aborted == aborted + 1)
    assert wait_for(lambda: worker.stats.num_running == 0 and not engine.has_unfinished_requests())
    assert engine.num_generated_tokens - generated < 3000

    metrics = httpx.get(server.url + "/metrics").text
    assert f'ridgeline_num_aborted_requests_total{{model="tiny"}} {worker.num_aborted}.0' in metrics
    assert 'ridgeline_request_finished_total{model="tiny",reason="abort"}' in metrics


@pytest.mark.parametrize(("path", "prompt", "num_choices"), [
    ("/chat/completions", {"messages": HELLO}, 2),
    ("/completions", {"prompt": ["abc", "de"]}, 4),  # two prompts, n=2 each
])
def test_both_endpoints_stream_with_the_same_framing(server: ServerThread, path: str,
                                                     prompt: dict[str, Any],
                                                     num_choices: int) -> None:
    url = server.base_url + path
    body = {"model": "tiny", **prompt, "n": 2, "max_tokens": 5, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", url, json={**body, "stream_options": {"include_usage": True}},
                      timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    *chunks, usage = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in [*chunks, usage]}) == 1
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in chunks)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5 * num_choices
    by_choice: dict[int, list[Any]] = {}
    for c in chunks:
        by_choice.setdefault(c["choices"][0]["index"], []).append(c["choices"][0]["finish_reason"])
    assert sorted(by_choice) == list(range(num_choices))
    assert all(f[-1] == "length" and not any(f[:-1]) for f in by_choice.values())

    plain = sse_events(httpx.post(url, json=body, timeout=60))  # no usage asked: none sent
    assert plain[-1] == "[DONE]"
    assert all("usage" not in json.loads(e) for e in plain[:-1])

    worker = server.app.state.workers["tiny"]
    engine = worker.engine
    aborted, generated = worker.num_aborted, engine.num_generated_tokens
    one = {**body, **{k: v[0] if path == "/completions" else v for k, v in prompt.items()},
           "n": 1, "max_tokens": 1500}
    with httpx.stream("POST", url, json=one) as resp:
        assert next(resp.iter_lines()).startswith("data: ")  # it started; now hang up
    assert wait_for(lambda: worker.num_aborted == aborted + 1)
    assert wait_for(lambda: worker.stats.num_running == 0 and not engine.has_unfinished_requests())
    assert engine.num_generated_tokens - generated < 1500


def test_metrics(server: ServerThread, client: openai.OpenAI) -> None:
    client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4)
    list(client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4, stream=True))
    text = httpx.get(server.url + "/metrics").text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    assert samples['ridgeline_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 2
    assert samples['ridgeline_generation_tokens_total{model="tiny"}'] >= 8
    assert samples['ridgeline_prompt_tokens_total{model="tiny"}'] > 0
    assert samples['ridgeline_time_to_first_token_seconds_count{model="tiny"}'] >= 2
    assert samples['ridgeline_inter_token_latency_seconds_count{model="tiny"}'] >= 6
    for gauge in ("ridgeline_kv_cache_usage_ratio", "ridgeline_num_preemptions_total",
                  "ridgeline_spec_decode_acceptance_rate", "ridgeline_num_requests_running"):
        assert f'{gauge}{{model="tiny"}}' in samples


def test_engine_failure_fails_requests_and_health(random_model: Any, tok: Any,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """Fault injection: the engine's step raises mid-generation (a bug, not a user error).
    Clients learn that the model failed, not why: the exception text is in the log only."""
    engine = engine_for(random_model, tok, num_kv_blocks=40, max_model_len=256)
    real_step, calls = engine.step, []

    def failing_step() -> Any:
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("simulated kernel failure")
        return real_step()

    engine.step = failing_step  # type: ignore[method-assign]
    with ServerThread(create_app({"tiny": engine})) as srv:
        body = {"model": "tiny", "messages": HELLO, "max_tokens": 100, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", srv.base_url + "/chat/completions", json=body) as resp:
            events = sse_events(resp)
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["type"] == "server_error" and "failed" in err["message"]
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and "failed" in health.json()["models"]["tiny"]
        r = httpx.post(srv.base_url + "/chat/completions",
                       json={"model": "tiny", "messages": HELLO})
        assert r.status_code == 503 and error_of(r)["type"] == "server_error"
        for text in (events[-2], health.text, r.text):
            assert "simulated" not in text and "RuntimeError" not in text
    assert "simulated kernel failure" in caplog.text


# ---- the command -------------------------------------------------------------------------------


def wait_for_server(proc: subprocess.Popen, port: int, timeout: float) -> bool:
    """True once the `ridgeline serve` subprocess answers /health; its output is shown
    if it exits first."""
    def up() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        except httpx.TransportError:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            return False

    return wait_for(up, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_command_serves_a_model_directory(tmp_path: Any, random_model: Any,
                                                tok: Any) -> None:
    random_model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ridgeline.serve.cli", "--model", str(tmp_path / "tiny"),
         "--served-model-name", "tiny", "--port", str(port), "--api-key", "k",
         "--kv-cache-memory-mb", "16", "--max-model-len", "512", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k",
                               max_retries=0)

        assert wait_for_server(proc, port, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny", "tiny:fast"]
        r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=3)
        assert r.usage.completion_tokens == 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_command_reports_a_busy_port_before_loading() -> None:
    import typer
    from typer.testing import CliRunner

    from ridgeline.serve.cli import register

    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        result = CliRunner().invoke(app, ["serve", "--port", str(busy.getsockname()[1])])
    assert isinstance(result.exception, ConfigError)
    assert "pick another --port" in str(result.exception)
