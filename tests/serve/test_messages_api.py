"""Anthropic's Messages API on `ridgeline serve`, driven by the official `anthropic`
client against a live server with an API key (sent as ``x-api-key``): "tiny" (a random
Llama), "tiny-tools" (writes one fixed Hermes call) and "kimi" (reasoning, text and a
Kimi-K2 call), the scripted models of tests/serve/test_server.py and
test_parsers_server.py. What a Messages request runs is checked against
`/v1/chat/completions` on the same conversation (same prompt tokens, same greedy text)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest

from ridgeline.serve.app import ServerThread, create_app
from tests.serve.test_parsers_server import kimi_tokenizer, scripted_llama
from tests.serve.test_server import (
    WEATHER_TOOL, engine_for, llama, make_tokenizer, tool_calling_llama,
)

KEY = "sekret"
TOOL = {"name": "get_weather", "description": "Weather in a city",
        "input_schema": WEATHER_TOOL["function"]["parameters"]}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
#: This `anthropic` client no longer takes sampling parameters; the API still does.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server():
    tok, kimi_tok = make_tokenizer(), kimi_tokenizer()
    app = create_app({"tiny": engine_for(llama(len(tok), seed=1), tok),
                      "tiny-tools": engine_for(tool_calling_llama(tok), tok),
                      "kimi": engine_for(scripted_llama(kimi_tok), kimi_tok)}, api_key=KEY)
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat(server: ServerThread) -> Any:
    twin = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)

    def complete(messages: list[dict[str, Any]], **kw: Any) -> Any:
        return twin.chat.completions.create(model="tiny", messages=messages, temperature=0.0,
                                            **kw)
    return complete


def test_text_whole_and_streamed_is_the_chat_reply(client: anthropic.Anthropic,
                                                   chat: Any) -> None:
    hello = [{"role": "user", "content": "Hello there"}]
    m = client.messages.create(model="tiny", max_tokens=12, system="Be brief.", messages=hello,
                               extra_body=GREEDY)
    twin = chat([{"role": "system", "content": "Be brief."}, *hello], max_tokens=12)
    assert (m.type, m.role, m.model) == ("message", "assistant", "tiny")
    [block] = m.content
    assert block.type == "text" and block.text == twin.choices[0].message.content
    assert (m.stop_reason, m.stop_sequence) == ("max_tokens", None)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == twin.usage.prompt_tokens
    assert m.usage.output_tokens == 12

    with client.messages.stream(model="tiny", max_tokens=12, system="Be brief.",
                                messages=hello, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == block.text and final.content[0].text == block.text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12

    # a stop sequence the greedy reply runs into
    stop = block.text[3]
    m = client.messages.create(model="tiny", max_tokens=12, system="Be brief.", messages=hello,
                               extra_body=GREEDY, stop_sequences=[stop])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    assert stop not in m.content[0].text if m.content else True


def test_tool_use_whole_and_streamed(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="tiny-tools", max_tokens=64, messages=ASK, tools=[TOOL],
                               extra_body=GREEDY)
    [call] = m.content
    assert (call.type, call.name, call.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert call.id and m.stop_reason == "tool_use"

    with client.messages.stream(model="tiny-tools", max_tokens=64, messages=ASK, tools=[TOOL],
                                extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    partial = [e.delta.partial_json for e in events
               if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(partial) > 1 and json.loads("".join(partial)) == {"city": "Paris"}
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.input) for b in final.content] == [("tool_use", {"city": "Paris"})]


def test_thinking_text_and_tool_use_blocks(client: anthropic.Anthropic) -> None:
    m = client.messages.create(model="kimi", max_tokens=40, messages=ASK, tools=[TOOL],
                               extra_body=GREEDY)
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert (m.content[0].thinking, m.content[1].text) == ("Need the weather.", "Checking.")
    with client.messages.stream(model="kimi", max_tokens=40, messages=ASK, tools=[TOOL],
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "Need the weather."
    assert final.content[2].input == {"city": "Paris"}


def test_tool_result_continues_the_conversation(client: anthropic.Anthropic,
                                                chat: Any) -> None:
    args = {"city": "Paris"}
    m = client.messages.create(model="tiny", max_tokens=8, extra_body=GREEDY, messages=[
        *ASK,
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": args}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21C"}]}])
    twin = chat([*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "toolu_1", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21C"}], max_tokens=8)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == twin.usage.prompt_tokens
    assert m.content[0].text == twin.choices[0].message.content


def test_forced_tool_choice(client: anthropic.Anthropic) -> None:
    """The grammar holds even a random model to a call of the named tool."""
    clock = {"name": "get_time", "description": "Local time in a time zone",
             "input_schema": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                              "required": ["zone"]}}
    # one call: a random model would otherwise go on adding parallel calls
    for choice in ({"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
                   {"type": "any", "disable_parallel_tool_use": True}):
        m = client.messages.create(model="tiny", max_tokens=200, messages=ASK,
                                   tools=[TOOL, clock] if choice["type"] == "tool" else [clock],
                                   extra_body=GREEDY, tool_choice=choice)
        [call] = [b for b in m.content if b.type == "tool_use"]
        assert call.name == "get_time" and call.input["zone"] in ("UTC", "CET")
        assert m.stop_reason == "tool_use"


def test_errors_are_anthropic_shaped(server: ServerThread, client: anthropic.Anthropic) -> None:
    def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
        assert r.status_code == status, r.text
        body = r.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return body["error"]

    url = server.url + "/v1/messages"
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    good = {"model": "tiny", "max_tokens": 4, "messages": ASK}
    no_max = {k: v for k, v in good.items() if k != "max_tokens"}
    err = error_of(httpx.post(url, json=no_max, headers=headers), 400)
    assert err["type"] == "invalid_request_error" and "max_tokens" in err["message"]
    for bad in ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [TOOL]},
                {"tool_choice": {"type": "sometimes"}}, {"temperature": 1.5},
                {"messages": [{"role": "user", "content": [{"type": "image"}]}]}):
        error_of(httpx.post(url, json={**good, **bad}, headers=headers), 400)
    assert error_of(httpx.post(url, json={**good, "model": "nope"}, headers=headers),
                    404)["type"] == "not_found_error"
    assert error_of(httpx.post(url, json=good, headers={**headers, "x-api-key": "wrong"}),
                    401)["type"] == "authentication_error"
    assert error_of(httpx.post(url, json=good), 401)["type"] == "authentication_error"

    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="tiny", max_tokens=4, messages=ASK, tools=[TOOL],
                               tool_choice={"type": "tool", "name": "nope"})
    assert "nope" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong",
                            max_retries=0).messages.create(model="tiny", max_tokens=4,
                                                           messages=ASK)
    # the OpenAI routes keep their own shape, with the same key as a Bearer token
    r = httpx.post(server.base_url + "/chat/completions", json={**good, "model": "nope"},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and "error" in r.json() and "type" not in r.json()
