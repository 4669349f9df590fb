"""The Responses and Messages APIs through the gateway, end to end over real HTTP: the
official `openai` and `anthropic` clients, a gateway on loopback, and a real `ridgeline
serve` upstream ("tiny", a random Llama; "tiny-tools", which writes one fixed tool call).
The same keys, allow-lists, quotas, usage accounting and fallbacks apply as to chat
completions; stored responses are reached at the upstream that holds them, by their key
only; `/v1/messages` answers in Anthropic's shape and takes ``x-api-key``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from ridgeline.platform.gateway import UpstreamConfig
from ridgeline.platform.limits import KeyLimits
from ridgeline.serve.app import ServerThread, create_app
from tests.platform.test_gateway import Deployment, closed_port, stop_all
from tests.serve.test_server import (
    WEATHER_TOOL, engine_for, llama, make_tokenizer, tool_calling_llama,
)

TOOL = {"type": "function", **WEATHER_TOOL["function"]}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "Weather in a city",
                  "input_schema": WEATHER_TOOL["function"]["parameters"]}
ASK = "Weather in Paris?"
GREEDY = {"temperature": 0}  # this `anthropic` client takes no sampling parameters


@pytest.fixture(scope="module")
def upstream() -> Iterator[ServerThread]:
    tok = make_tokenizer()
    app = create_app({"tiny": engine_for(llama(len(tok), seed=1), tok),
                      "tiny-tools": engine_for(tool_calling_llama(tok), tok)})
    with ServerThread(app) as server:
        yield server


@pytest.fixture
def gateway(upstream: ServerThread, tmp_path: Path) -> Iterator[Deployment]:
    # a dead replica of "tiny" first in line: every request that meets it falls back
    d = Deployment(tmp_path, [UpstreamConfig(name="dead", base_url=f"http://127.0.0.1:"
                                             f"{closed_port()}", models=["tiny"]),
                              UpstreamConfig(name="serve", base_url=upstream.url)],
                   retries=0, failure_threshold=100)
    yield d
    stop_all([d.server])
    d.store.close()


def openai_client(d: Deployment, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.server.base_url, api_key=key, max_retries=0, timeout=60)


def anthropic_client(d: Deployment, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=d.server.url, api_key=key, max_retries=0, timeout=60)


def test_responses_through_the_gateway(upstream: ServerThread, gateway: Deployment) -> None:
    d = gateway
    client = openai_client(d, d.key(models=["tiny", "tiny-tools"]))
    direct = openai.OpenAI(base_url=upstream.base_url, api_key="-", max_retries=0)
    r = client.responses.create(model="tiny", input="Hello", max_output_tokens=8,
                                temperature=0)
    assert r.output_text == direct.responses.create(
        model="tiny", input="Hello", max_output_tokens=8, temperature=0).output_text
    streamed = list(client.responses.create(model="tiny", input="Hello", max_output_tokens=8,
                                            temperature=0, stream=True))
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == \
        r.output_text
    assert streamed[-1].type == "response.incomplete"
    usage = d.usage()["tiny"]  # (requests, prompt, completion, errors)
    assert usage == (2, 2 * r.usage.input_tokens, 16, 0)

    # A follow-up reaches the upstream that stores the conversation; so do GET and cancel.
    first = client.responses.create(model="tiny-tools", input=ASK, tools=[TOOL],
                                    temperature=0)
    call = first.output[0]
    follow = client.responses.create(model="tiny", previous_response_id=first.id,
                                     input=[{"type": "function_call_output",
                                             "call_id": call.call_id, "output": "sunny"}],
                                     max_output_tokens=4, temperature=0)
    assert follow.previous_response_id == first.id and follow.usage.output_tokens == 4
    assert client.responses.retrieve(follow.id).output_text == follow.output_text
    background = client.responses.create(model="tiny", input="Hello", background=True,
                                         max_output_tokens=400, temperature=0)
    assert client.responses.cancel(background.id).status in ("cancelled", "incomplete")

    # Another key sees none of it.
    other = openai_client(d, d.key(tenant="other", models=["tiny"]))
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(follow.id)
    with pytest.raises(openai.BadRequestError) as info:
        other.responses.create(model="tiny", previous_response_id=follow.id, input="hi")
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.PermissionDeniedError):
        other.responses.create(model="tiny-tools", input="hi")


def test_messages_through_the_gateway(gateway: Deployment) -> None:
    d = gateway
    key = d.key(models=["tiny", "tiny-tools"])
    client = anthropic_client(d, key)                   # sends x-api-key
    m = client.messages.create(model="tiny-tools", max_tokens=64, extra_body=GREEDY,
                               messages=[{"role": "user", "content": ASK}],
                               tools=[ANTHROPIC_TOOL])
    assert m.stop_reason == "tool_use" and m.content[0].input == {"city": "Paris"}
    with client.messages.stream(model="tiny", max_tokens=6, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Hello"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.stop_reason == "max_tokens"
    usage = d.usage()
    prompt = final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
    assert usage["tiny"] == (1, prompt, 6, 0)
    assert usage["tiny-tools"][0] == 1 and usage["tiny-tools"][2] == m.usage.output_tokens

    def error_of(r: httpx.Response, status: int, kind: str) -> None:
        assert r.status_code == status, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind, r.json()

    url = d.server.url + "/v1/messages"
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    error_of(httpx.post(url, json=body), 401, "authentication_error")
    error_of(httpx.post(url, json={**body, "model": "other"}, headers={"x-api-key": key}),
             403, "permission_error")
    no_max = {k: v for k, v in body.items() if k != "max_tokens"}   # the upstream's 400
    error_of(httpx.post(url, json=no_max, headers={"x-api-key": key}), 400,
             "invalid_request_error")
    limited = d.key(models=["tiny"], limits=KeyLimits(rpm=1))
    assert httpx.post(url, json=body, headers={"x-api-key": limited}).status_code == 200
    r = httpx.post(url, json=body, headers={"x-api-key": limited})
    error_of(r, 429, "rate_limit_error")
    assert "retry-after" in r.headers
    # the dead replica of "tiny" was tried (and fallen back from) along the way
    assert d.gateway.describe()["dead"]["failures"] >= 1
