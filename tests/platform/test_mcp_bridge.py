"""MCP both ways, end to end: an MCP client lists and calls the registry's tools through
our server (over the in-memory JSON-RPC transport and mcp 2's direct in-process path);
our client imports a separate MCP server's tools (in-process, and a subprocess over
stdio) into a registry and calls them through `registry.call`."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from typing import Any

import pytest
from mcp import Client, StdioServerParameters
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError

from ridgeline.platform.mcp_bridge import (
    IDEMPOTENCY_META_KEY, MCPToolSource, import_mcp_tools, mcp_server,
)
from ridgeline.platform.principal import Principal
from ridgeline.platform.tools import ToolPermissionError, ToolRegistry, ToolSourceError

READER = Principal(key_id="r", tenant="acme", scopes=frozenset({"tools:read"}))
OPERATOR = Principal(key_id="o", tenant="acme",
                     scopes=frozenset({"tools:read", "calc:use", "notes:write"}))


def served_registry() -> tuple[ToolRegistry, dict[str, int]]:
    registry = ToolRegistry()
    runs = {"send": 0}

    @registry.tool
    def add(a: int, b: int = 1) -> int:
        """Add two integers."""
        return a + b

    @registry.tool(side_effects=True)
    def send_message(to: str, text: str) -> str:
        """Send a message."""
        runs["send"] += 1
        return f"sent #{runs['send']} to {to}"

    @registry.tool
    def fail(reason: str) -> str:
        """Always fails."""
        raise RuntimeError(reason)

    @registry.tool(scopes=("admin:shutdown",))
    def shutdown() -> str:
        """Not for readers."""
        return "down"

    return registry, runs


@pytest.mark.parametrize("mode", ["legacy", "auto"])
def test_an_mcp_client_lists_and_calls_registry_tools(mode: str) -> None:
    registry, runs = served_registry()
    server = mcp_server(registry, READER)

    async def session() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with Client(server, mode=mode) as client:
            listed = await client.list_tools()
            out["tools"] = {t.name: t for t in listed.tools}
            out["add"] = await client.call_tool("add", {"a": 2, "b": 3})
            out["add_default"] = await client.call_tool("add", {"a": 2, "b": None})
            out["bad"] = await client.call_tool("add", {"a": "two"})
            out["fail"] = await client.call_tool("fail", {"reason": "disk on fire"})
            meta = {IDEMPOTENCY_META_KEY: "msg-1"}
            out["send1"] = await client.call_tool("send_message", {"to": "ops", "text": "hi"},
                                                  meta=meta)
            out["send2"] = await client.call_tool("send_message", {"to": "ops", "text": "hi"},
                                                  meta=meta)
            out["send3"] = await client.call_tool("send_message", {"to": "ops", "text": "hi"})
            for name in ("shutdown", "nope"):
                try:
                    await client.call_tool(name, {})
                except MCPError as e:
                    out[name] = e
        return out

    out = asyncio.run(session())
    tools = out["tools"]
    assert set(tools) == {"add", "send_message", "fail"}  # shutdown needs a scope READER lacks
    assert tools["add"].description == "Add two integers."
    assert tools["add"].input_schema == registry.get("add").parameters
    assert tools["add"].annotations.read_only_hint is True
    assert tools["send_message"].annotations.read_only_hint is False

    def text(result: Any) -> str:
        return "\n".join(block.text for block in result.content)

    assert not out["add"].is_error and text(out["add"]) == "5"
    assert text(out["add_default"]) == "3"
    assert out["bad"].is_error and "a:" in text(out["bad"])
    assert out["fail"].is_error and "RuntimeError: disk on fire" in text(out["fail"])
    # the same idempotency key in _meta: one send; no key: every call runs
    assert text(out["send1"]) == text(out["send2"]) == "sent #1 to ops"
    assert text(out["send3"]) == "sent #2 to ops" and runs["send"] == 2
    assert "admin:shutdown" in out["shutdown"].message
    assert "nope" in out["nope"].message


def test_the_caller_can_be_found_per_request() -> None:
    registry, _ = served_registry()
    admin = Principal(key_id="a", tenant="acme", admin=True)
    who = {"principal": READER}
    server = mcp_server(registry, lambda ctx: who["principal"])

    async def session() -> tuple[set[str], set[str], str]:
        async with Client(server) as client:
            as_reader = {t.name for t in (await client.list_tools(cache_mode="bypass")).tools}
            who["principal"] = admin
            as_admin = {t.name for t in (await client.list_tools(cache_mode="bypass")).tools}
            down = await client.call_tool("shutdown", {})
        return as_reader, as_admin, down.content[0].text

    as_reader, as_admin, down = asyncio.run(session())
    assert "shutdown" not in as_reader and "shutdown" in as_admin and down == "down"


def calculator_server() -> tuple[MCPServer, list[str]]:
    server = MCPServer("calculator")
    notes: list[str] = []

    @server.tool()
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    @server.tool()
    def divide(a: float, b: float) -> float:
        """Divide a by b."""
        if b == 0:
            raise ToolError("cannot divide by zero")
        return a / b

    @server.tool(name="notes.append")
    def append_note(text: str) -> str:
        """Append a note."""
        notes.append(text)
        return f"{len(notes)} notes"

    return server, notes


def test_imported_mcp_tools_are_called_through_the_registry() -> None:
    server, notes = calculator_server()
    registry = ToolRegistry()
    with import_mcp_tools(server, registry, name_prefix="calc_", scopes=("calc:use",),
                          side_effects=lambda t: t.name.startswith("notes.")):
        names = [t["function"]["name"] for t in registry.openai_tools(OPERATOR)]
        assert names == ["calc_multiply", "calc_divide", "calc_notes_append"]
        assert registry.openai_tools(READER) == []
        assert registry.get("calc_multiply").description == "Multiply two integers."
        assert registry.get("calc_multiply").openai_tool()["function"]["strict"] is True

        product = registry.call("calc_multiply", {"a": 6, "b": 7}, OPERATOR, call_id="c1")
        assert product.ok and product.content == "42"
        failed = registry.call("calc_divide", {"a": 1, "b": 0}, OPERATOR)
        assert not failed.ok and failed.error_type == "mcp_tool_error"
        assert failed.error.endswith("cannot divide by zero")
        invalid = registry.call("calc_multiply", {"a": "six", "b": 7}, OPERATOR)
        assert not invalid.ok and invalid.error_type == "invalid_arguments"

        first = registry.call("calc_notes_append", {"text": "hello"}, OPERATOR,
                              idempotency_key="n-1")
        again = registry.call("calc_notes_append", {"text": "hello"}, OPERATOR,
                              idempotency_key="n-1")
        assert first.content == "1 notes" and again.replayed and notes == ["hello"]
        with pytest.raises(ToolPermissionError, match="calc:use"):
            registry.call("calc_multiply", {"a": 1, "b": 2}, READER)
    closed = registry.call("calc_multiply", {"a": 6, "b": 7}, OPERATOR)
    assert not closed.ok and "closed" in closed.error


def test_our_server_imported_by_our_client_passes_idempotency_keys_on() -> None:
    served, runs = served_registry()
    with MCPToolSource(mcp_server(served, READER), name_prefix="remote_",
                       scopes=("tools:read",),
                       side_effects=lambda t: not t.annotations.read_only_hint) as source:
        first, second = ToolRegistry(), ToolRegistry()  # two processes, two stores
        source.add_to(first)
        source.add_to(second)
        assert not first.get("remote_add").side_effects
        assert first.get("remote_send_message").side_effects
        args = {"to": "ops", "text": "deploy done"}
        a = first.call("remote_send_message", args, READER, idempotency_key="task-9:step-2")
        b = second.call("remote_send_message", args, READER, idempotency_key="task-9:step-2")
        # the second registry never saw the key, the server did: one message
        assert a.ok and b.ok and not b.replayed
        assert a.content == b.content == "sent #1 to ops" and runs["send"] == 1


SERVER_SCRIPT = """
from mcp.server.mcpserver import MCPServer

server = MCPServer("words")

@server.tool()
def shout(text: str, times: int = 1) -> str:
    \"\"\"Upper-case a text.\"\"\"
    return " ".join([text.upper()] * times)

server.run("stdio")
"""


def test_a_stdio_mcp_server_in_a_subprocess(tmp_path) -> None:
    script = tmp_path / "words_server.py"
    script.write_text(textwrap.dedent(SERVER_SCRIPT))
    registry = ToolRegistry()
    params = StdioServerParameters(command=sys.executable, args=[str(script)])
    with import_mcp_tools(params, registry, scopes=("tools:read",), side_effects=False):
        schema = registry.get("shout").openai_tool()["function"]["parameters"]
        assert schema["required"] == ["text", "times"]
        result = registry.call("shout", {"text": "hi", "times": None}, READER)
        assert result.ok and result.content == "HI"
        result = registry.call("shout", json.dumps({"text": "go", "times": 2}), READER)
        assert result.content == "GO GO"


def test_an_unreachable_server_is_a_clear_error() -> None:
    params = StdioServerParameters(command="/nonexistent/mcp-server")
    with pytest.raises(ToolSourceError, match="/nonexistent/mcp-server"):
        import_mcp_tools(params, ToolRegistry(), connect_timeout_s=20)
