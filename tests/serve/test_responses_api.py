"""OpenAI's Responses API on `ridgeline serve`, driven by the official `openai` client
against a live server: "tiny" (a random Llama), "tiny-tools" (writes one fixed Hermes
call) and "kimi" (writes reasoning, text and a Kimi-K2 call), the scripted models of
tests/serve/test_server.py and test_parsers_server.py. What a Responses request runs is
checked against `/v1/chat/completions` on the same conversation (same prompt tokens, same
greedy text)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from ridgeline.serve.app import ServerThread, create_app
from ridgeline.serve.response_store import ResponseStore, StoredResponse
from ridgeline.wire import RequestError
from tests.serve.test_parsers_server import kimi_tokenizer, scripted_llama
from tests.serve.test_server import (
    WEATHER_TOOL, engine_for, llama, make_tokenizer, tool_calling_llama,
)

TOOL = {"type": "function", **WEATHER_TOOL["function"]}  # the flat Responses shape
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}
ASK = "Weather in Paris?"


@pytest.fixture(scope="module")
def server():
    tok, kimi_tok = make_tokenizer(), kimi_tokenizer()
    app = create_app({"tiny": engine_for(llama(len(tok), seed=1), tok),
                      "tiny-tools": engine_for(tool_calling_llama(tok), tok),
                      "kimi": engine_for(scripted_llama(kimi_tok), kimi_tok)})
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0, timeout=60)


def chat_twin(client: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0, **kw)


def test_plain_text_whole_and_streamed_is_the_chat_reply(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", input="Hello there", instructions="Be brief.",
                                max_output_tokens=12, temperature=0)
    twin = chat_twin(client, [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "Hello there"}], max_tokens=12)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == twin.choices[0].message.content and r.output_text
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (twin.usage.prompt_tokens, 12)
    [message] = r.output
    assert message.type == "message" and message.content[0].type == "output_text"

    events = list(client.responses.create(model="tiny", input="Hello there",
                                          instructions="Be brief.", max_output_tokens=12,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 12


def test_tool_calls_whole_and_streamed(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny-tools", input=ASK, tools=[TOOL], temperature=0)
    [call] = r.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    assert r.status == "completed"

    with client.responses.stream(model="tiny-tools", input=ASK, tools=[TOOL],
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and json.loads("".join(deltas)) == {"city": "Paris"}
    [streamed] = final.output
    assert (streamed.name, json.loads(streamed.arguments)) == ("get_weather", {"city": "Paris"})


def test_reasoning_text_and_call_items(client: openai.OpenAI) -> None:
    r = client.responses.create(model="kimi", input=ASK, tools=[TOOL], temperature=0,
                                max_output_tokens=40)
    assert [item.type for item in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == "Need the weather."
    assert r.output_text == "Checking."
    assert json.loads(r.output[2].arguments) == {"city": "Paris"}

    with client.responses.stream(model="kimi", input=ASK, tools=[TOOL], temperature=0,
                                 max_output_tokens=40) as stream:
        events = list(stream)
        final = stream.get_final_response()
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == "Need the weather."
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Checking."


def test_tool_results_and_previous_response_id_continue_the_conversation(
        client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny-tools", input=ASK, tools=[TOOL],
                                    temperature=0)
    [call] = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}
    follow = client.responses.create(model="tiny", previous_response_id=first.id,
                                     input=[result], max_output_tokens=8, temperature=0)
    assert follow.previous_response_id == first.id
    conversation = [{"role": "user", "content": ASK},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": call.call_id, "type": "function",
                         "function": {"name": "get_weather", "arguments": call.arguments}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21C"}]
    twin = chat_twin(client, conversation, max_tokens=8)
    assert follow.usage.input_tokens == twin.usage.prompt_tokens
    assert follow.output_text == twin.choices[0].message.content

    # The same conversation sent as input items, and chained once more.
    items = [{"role": "user", "content": [{"type": "input_text", "text": ASK}]},
             {"type": "function_call", "call_id": call.call_id, "name": "get_weather",
              "arguments": call.arguments}, result]
    whole = client.responses.create(model="tiny", input=items, max_output_tokens=8,
                                    temperature=0)
    assert (whole.usage.input_tokens, whole.output_text) == (follow.usage.input_tokens,
                                                             follow.output_text)
    again = client.responses.create(model="tiny", previous_response_id=follow.id,
                                    input="And tomorrow?", max_output_tokens=4, temperature=0)
    twin = chat_twin(client, conversation + [
        {"role": "assistant", "content": follow.output_text},
        {"role": "user", "content": "And tomorrow?"}], max_tokens=4)
    assert again.usage.input_tokens == twin.usage.prompt_tokens
    assert client.responses.retrieve(again.id).output_text == again.output_text


def test_structured_output_and_forced_calls(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", input="Weather?", temperature=0,
                                max_output_tokens=200, text={"format": {
                                    "type": "json_schema", "name": "weather",
                                    "schema": SCHEMA, "strict": True}})
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    r = client.responses.create(model="tiny", input="Weather?", temperature=0,
                                max_output_tokens=200, text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(r.output_text), dict)
    # tool_choice forces a call of the named tool through the grammar, even on a random model
    r = client.responses.create(model="tiny", input="Weather?", tools=[TOOL], temperature=0,
                                max_output_tokens=200,
                                tool_choice={"type": "function", "name": "get_weather"})
    calls = [i for i in r.output if i.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), TOOL["parameters"])


def test_background_poll_and_cancel(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", input="Hello", background=True,
                                max_output_tokens=6, temperature=0)
    assert r.status in ("queued", "in_progress") and r.background
    deadline = time.monotonic() + 30
    while (got := client.responses.retrieve(r.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert got.status == "incomplete" and got.usage.output_tokens == 6 and got.output_text

    long = client.responses.create(model="tiny", input="Hello", background=True,
                                   max_output_tokens=2000, temperature=0)
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert cancelled.usage.output_tokens < 2000


def test_bad_requests_are_openai_errors(server: ServerThread, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_nope")
    assert info.value.body["param"] == "previous_response_id"
    assert "resp_nope" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve("resp_nope")
    assert "resp_nope" in info.value.body["message"]

    url = server.base_url + "/responses"
    good = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
    cases = [
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input.0.content"),
        ({"input": [{"type": "web_search_call"}]}, "input.0"),
        ({"background": True, "store": False}, "background"),
        ({"model": "nope"}, "model"),
    ]
    for extra, param in cases:
        r = httpx.post(url, json={**good, **extra})
        assert r.status_code in (400, 404), (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.json())
    done = client.responses.create(model="tiny", input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(done.id)                  # not a background response
    assert httpx.post(url, json=good).status_code == 200  # still serving


def test_the_store_is_bounded_and_cancels_what_it_evicts() -> None:
    async def scenario() -> None:
        store = ResponseStore(max_responses=2)
        running = asyncio.ensure_future(asyncio.sleep(60))
        store.put(StoredResponse({"id": "a", "status": "in_progress"}, task=running))
        store.put(StoredResponse({"id": "b", "status": "completed"}))
        store.put(StoredResponse({"id": "c", "status": "completed"}))
        assert len(store) == 2 and store.get("a") and store.get("c")  # b went, not a
        store.put(StoredResponse({"id": "d", "status": "completed"}))
        assert store.get("a") and store.get("d")  # c was the oldest finished one
        with pytest.raises(RequestError):
            store.get("c")
        store = ResponseStore(max_responses=1)      # only running ones to evict: a goes
        store.put(StoredResponse({"id": "a", "status": "in_progress"}, task=running))
        store.put(StoredResponse({"id": "e", "status": "completed"}))
        await asyncio.sleep(0)
        assert running.cancelled() and len(store) == 1
        small = ResponseStore(max_bytes=200)
        for i in range(5):
            small.put(StoredResponse({"id": str(i), "status": "completed"},
                                     [{"role": "user", "content": "x" * 60}]))
        assert 1 <= len(small) < 5

    asyncio.run(scenario())
