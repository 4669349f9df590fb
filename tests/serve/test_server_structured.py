"""Structured outputs through `ridgeline serve` (the official `openai` client and raw
HTTP): `response_format`, vLLM's `structured_outputs` and `guided_*` fields, and forced
tool calls as grammars. The model is random, so whatever conforms does so because the
engine's constrained decoding held it there."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from ridgeline.serve.app import ServerThread, create_app
from tests.serve.test_server import HELLO, WEATHER_TOOL, engine_for, llama, make_tokenizer

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server():
    tok = make_tokenizer()
    with ServerThread(create_app({"tiny": engine_for(llama(len(tok), seed=3), tok)})) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def chat(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(model="tiny", messages=HELLO, temperature=1.0,
                                          seed=kw.pop("seed", 5), max_tokens=200, **kw)


def test_response_format_json_schema_and_json_object(client: openai.OpenAI) -> None:
    out = chat(client, n=3, response_format={"type": "json_schema", "json_schema": {
        "name": "weather", "schema": SCHEMA, "strict": True}})
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    out = chat(client, response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_streamed_json_is_the_same_constraint(client: openai.OpenAI) -> None:
    stream = chat(client, stream=True, response_format={"type": "json_schema", "json_schema": {
        "name": "weather", "schema": SCHEMA}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_vllm_structured_outputs_and_guided_fields(client: openai.OpenAI) -> None:
    out = chat(client, n=2, extra_body={"structured_outputs": {"regex": r"[0-9]{2}:[0-9]{2}"}})
    assert all(re.fullmatch(r"[0-9]{2}:[0-9]{2}", c.message.content) for c in out.choices)
    out = chat(client, extra_body={"guided_choice": ["north", "south"]})
    assert out.choices[0].message.content in ("north", "south")
    done = client.completions.create(model="tiny", prompt="Pick:", max_tokens=50, seed=2,
                                     extra_body={"structured_outputs": {
                                         "grammar": 'start: "go " DIR\nDIR: "up" | "down"\n'}})
    assert done.choices[0].text in ("go up", "go down")


def test_forced_tool_calls_always_parse(client: openai.OpenAI) -> None:
    tools = [WEATHER_TOOL, TIME_TOOL]
    out = chat(client, n=3, tools=tools, tool_choice="required", parallel_tool_calls=False)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        [call] = choice.message.tool_calls
        spec = next(t for t in tools if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments),
                            spec["function"]["parameters"])
    out = chat(client, tools=tools, tool_choice={"type": "function",
                                                 "function": {"name": "get_time"}})
    calls = out.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_time" for c in calls)
    assert json.loads(calls[0].function.arguments)["zone"] in ("UTC", "CET")


def test_bad_constraints_are_400_naming_the_field(server: ServerThread) -> None:
    url = server.base_url + "/chat/completions"
    good = {"model": "tiny", "messages": HELLO, "max_tokens": 4}
    cases = [
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
        ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/x"}}}},
         "structured_outputs"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "tool_choice"),
    ]
    for extra, param in cases:
        r = httpx.post(url, json={**good, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.json())
    assert httpx.post(url, json=good).status_code == 200   # still serving
