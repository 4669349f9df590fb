"""OpenAIClient against a real HTTP server on 127.0.0.1 (see fake_openai_server.py)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.fake_openai_server import FakeOpenAIServer, Reply, chat_body
from ridgeline.errors import ConfigError, ModelEndpointError
from ridgeline.llm import ContextLengthError, Message, OpenAIClient, Sampling, ToolCall, ToolSpec

BASH = ToolSpec(name="bash", description="run a command",
                parameters={"type": "object", "properties": {"command": {"type": "string"}}})


def client(server: FakeOpenAIServer, **kw) -> OpenAIClient:
    kw.setdefault("backoff_s", 0.01)
    return OpenAIClient(server.url, **kw)


def test_native_tool_calls_token_ids_and_logprobs(openai_server: FakeOpenAIServer) -> None:
    openai_server.script.append(Reply(body=chat_body(
        content="Plan: list files.",
        tool_calls=[{"id": "c1", "type": "function",
                     "function": {"name": "bash", "arguments": '{"command": "ls -la"}'}}],
        finish_reason="tool_calls",
        prompt_token_ids=[1, 2, 3],
        choice_extra={"logprobs": {"content": [
            {"token": "token_id:7", "logprob": -0.5}, {"token": "token_id:8", "logprob": -1.25}]}})))
    history = [Message(role="system", content="sys"), Message(role="user", content="do it"),
               Message(role="assistant", content="", tool_calls=[
                   ToolCall(id="c0", name="bash", arguments={"command": "pwd"})]),
               Message(role="tool", content="/app", tool_call_id="c0", name="bash")]
    with client(openai_server, model="tiny") as c:
        out = c.chat(history, tools=[BASH], sampling=Sampling(max_tokens=50, seed=3))
    assert out.text == "Plan: list files."
    assert [(t.id, t.name, t.arguments) for t in out.tool_calls] == [("c1", "bash", {"command": "ls -la"})]
    assert out.token_ids == [7, 8] and out.logprobs == [-0.5, -1.25]
    assert out.prompt_token_ids == [1, 2, 3]
    assert out.usage.prompt_tokens == 11 and out.usage.completion_tokens == 3
    assert out.finish_reason == "tool_calls"
    (body,) = openai_server.chat_requests()
    assert body["model"] == "tiny" and body["max_tokens"] == 50 and body["seed"] == 3
    assert body["logprobs"] is True
    assert "tool_choice" not in body   # the server's default (auto) unless asked
    assert body["tools"][0] == {"type": "function", "function": {
        "name": "bash", "description": "run a command", "parameters": BASH.parameters}}
    # Past calls travel as OpenAI wants them: arguments as a JSON string, results by id.
    call = body["messages"][2]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"command": "pwd"}
    assert body["messages"][3] == {"role": "tool", "content": "/app", "tool_call_id": "c0",
                                   "name": "bash"}


def test_malformed_tool_arguments_become_errors_for_the_model(openai_server: FakeOpenAIServer) -> None:
    openai_server.script.append(Reply(body=chat_body(content=None, tool_calls=[
        {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls'}}])))
    out = client(openai_server, model="tiny").chat([Message(role="user", content="x")], tools=[BASH])
    assert out.tool_calls == []
    assert len(out.tool_call_errors) == 1 and "not valid JSON" in out.tool_call_errors[0]


def test_text_tool_calls_when_the_server_has_no_tool_parser(openai_server: FakeOpenAIServer) -> None:
    # vLLM-style: generation stopped at "</tool_call>", which is dropped from the text
    openai_server.script.append(Reply(body=chat_body(
        content='ok\n<tool_call>{"name": "bash", "arguments": {"command": "id"}}',
        choice_extra={"stop_reason": "</tool_call>"})))
    c = client(openai_server, model="tiny", supports_tools=False)
    out = c.chat([Message(role="system", content="be brief"), Message(role="user", content="x")],
                 tools=[BASH])
    assert out.text == "ok" and out.tool_calls[0].arguments == {"command": "id"}
    assert out.stop_reason == "</tool_call>"
    (body,) = openai_server.chat_requests()
    assert "tools" not in body
    assert body["messages"][0]["content"].startswith("be brief")
    assert '"name": "bash"' in body["messages"][0]["content"]  # described in the system prompt


def test_model_and_context_window_discovered_from_models(openai_server: FakeOpenAIServer) -> None:
    openai_server.models = [{"id": "served-model", "max_model_len": 2048}]
    c = client(openai_server)
    assert c.name == openai_server.url and not openai_server.requests  # no network yet
    assert c.model == "served-model" and c.context_window == 2048
    assert c.name == f"served-model@{openai_server.url}"


def test_retries_5xx_and_429_then_succeeds(openai_server: FakeOpenAIServer) -> None:
    openai_server.script += [Reply(503, {"error": {"message": "overloaded"}}),
                             Reply(429, {"error": {"message": "slow down"}}, {"retry-after": "0"}),
                             Reply(502, "<html>bad gateway</html>"),
                             Reply(body=chat_body("finally"))]
    out = client(openai_server, model="tiny", max_retries=3).chat([Message(role="user", content="x")])
    assert out.text == "finally"
    assert len(openai_server.chat_requests()) == 4


def test_gives_up_after_retries_with_a_clear_error(openai_server: FakeOpenAIServer) -> None:
    openai_server.script += [Reply(500, {"error": {"message": "boom"}})] * 3
    with pytest.raises(ModelEndpointError, match="failed after 3 attempts.*HTTP 500: boom"):
        client(openai_server, model="tiny", max_retries=2).chat([Message(role="user", content="x")])
    assert len(openai_server.chat_requests()) == 3


def test_down_endpoint_is_retried_then_reported(closed_port: int) -> None:
    c = OpenAIClient(f"http://127.0.0.1:{closed_port}/v1", model="m", max_retries=2, backoff_s=0.01)
    with pytest.raises(ModelEndpointError) as info:
        c.chat([Message(role="user", content="x")])
    assert "failed after 3 attempts" in str(info.value) and "connection failed" in str(info.value)
    assert "server is running" in str(info.value)


def test_timeout_is_retried_then_reported(openai_server: FakeOpenAIServer) -> None:
    openai_server.script += [Reply(body=chat_body("late"), delay_s=1.0)] * 2
    c = client(openai_server, model="tiny", timeout=0.2, max_retries=1)
    with pytest.raises(ModelEndpointError, match="timed out"):
        c.chat([Message(role="user", content="x")])


def test_context_overflow_is_not_retried(openai_server: FakeOpenAIServer) -> None:
    openai_server.script.append(Reply(400, {"error": {
        "message": "This model's maximum context length is 4096 tokens. However, you requested 9000"}}))
    with pytest.raises(ContextLengthError):
        client(openai_server, model="tiny").chat([Message(role="user", content="x" * 100)])
    assert len(openai_server.chat_requests()) == 1


def test_auth_error_is_not_retried_and_says_what_to_check(openai_server: FakeOpenAIServer) -> None:
    openai_server.script.append(Reply(401, {"error": {"message": "bad key"}}))
    with pytest.raises(ModelEndpointError, match="401.*bad key.*API key"):
        client(openai_server, model="tiny", api_key="sk-x").chat([Message(role="user", content="x")])
    assert len(openai_server.chat_requests()) == 1
    assert openai_server.requests[-1][3].get("Authorization") == "Bearer sk-x"


def test_token_estimate_calibrates_on_server_usage(openai_server: FakeOpenAIServer) -> None:
    body = chat_body("x")
    body["usage"]["prompt_tokens"] = 400  # the server says 400 tokens for ~400 chars
    openai_server.script.append(Reply(body=body))
    c = client(openai_server, model="tiny")
    msgs = [Message(role="user", content="a" * 400)]
    before = c.count_tokens(msgs)
    c.chat(msgs)
    assert c.count_tokens(msgs) > before  # 1 char/token observed: the estimate rises


def test_base_url_forms() -> None:
    assert OpenAIClient("http://h:1", model="m").base_url == "http://h:1/v1"
    assert OpenAIClient("http://h:1/openai/v1/", model="m").base_url == "http://h:1/openai/v1"
    with pytest.raises(ConfigError, match="http"):
        OpenAIClient("localhost:8000", model="m")


def test_a_required_tool_call_is_asked_of_the_server(openai_server: FakeOpenAIServer) -> None:
    openai_server.script.append(Reply(body=chat_body(content=None, tool_calls=[
        {"id": "c1", "type": "function", "function": {"name": "bash",
                                                      "arguments": '{"command": "ls"}'}}])))
    with client(openai_server, model="tiny") as c:
        c.chat([Message(role="user", content="go")], tools=[BASH],
               sampling=Sampling(tool_choice="required"))
    (body,) = openai_server.chat_requests()
    assert body["tool_choice"] == "required"
