"""MCP both ways: serve a `ToolRegistry` to MCP clients, and import an MCP server's tools
into a registry.

    server = mcp_server(registry, principal)            # an mcp low-level `Server`
    await server.run(read, write, server.create_initialization_options())   # any transport

    with import_mcp_tools(StdioServerParameters(command="my-mcp-server"), registry,
                          name_prefix="files_") as source:
        registry.call("files_read", {"path": "a.txt"}, principal, idempotency_key="k")

Serving: the server lists the tools `principal`'s scopes allow (annotated read-only when
they have no side effects) and runs each call through `registry.call`, so scopes,
validation, idempotency, metrics and spans all apply; a tool's failure is an `isError`
result, an unknown or forbidden tool an MCP error. A side-effecting call is deduplicated
when the client sends `_meta["io.ridgeline/idempotency-key"]`; without one every call
runs. The registry's tools are synchronous, so calls run on worker threads, not on the
server's event loop. (mcp 2 has no `FastMCP`: its successor `MCPServer` builds schemas
from Python functions, while a registry already has JSON schemas, hence the low-level
`Server`.)

Importing: `MCPToolSource` keeps one `mcp.Client` connection open on an event loop of
its own thread (anything `mcp.Client` takes: a URL, `StdioServerParameters`, a transport,
an in-process server) and turns each listed tool into a `Tool` whose `run` calls
`call_tool` on that loop. `tools_from_session` does the same for a session the caller
already runs on its own loop. MCP tool annotations are hints from the server and are not
trusted by default: every imported tool needs `scopes` (default `tools:write`) and is
treated as side-effecting (idempotency key required, result recorded) unless
`side_effects` says otherwise.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import re
import threading
import uuid
from collections.abc import Callable
from typing import Any

import anyio
import mcp_types as types
from mcp import Client
from mcp.server import Server
from mcp.shared.exceptions import MCPError

from ridgeline.errors import (
    ConfigError, ConflictError, NotFoundError, PermissionDeniedError, RidgelineError,
)
from ridgeline.platform.principal import Principal
from ridgeline.platform.tools import (
    Tool, ToolCallContext, ToolFailure, ToolRegistry, ToolSourceError,
)

log = logging.getLogger(__name__)

IDEMPOTENCY_META_KEY = "io.ridgeline/idempotency-key"

ToolPolicy = Callable[[types.Tool], Any]


# ---- serving a registry ------------------------------------------------------------------------


def mcp_server(registry: ToolRegistry, principal: Principal | Callable[[Any], Principal], *,
               name: str = "ridgeline-tools", version: str = "1") -> Server[Any]:
    """An MCP server offering `registry`'s tools as `principal` may use them.
    `principal` may also be a function of the request context that finds the caller for
    each request (over HTTP: from the request's API key, `ctx.request`); a
    `RidgelineError` it raises (401, 403) becomes an MCP error."""

    def caller(ctx: Any) -> Principal:
        if isinstance(principal, Principal):
            return principal
        try:
            return principal(ctx)
        except RidgelineError as e:
            raise MCPError(types.INVALID_REQUEST, e.message) from None

    async def list_tools(ctx: Any, params: types.PaginatedRequestParams | None
                         ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[
            types.Tool(name=t.name, description=t.description or None,
                       input_schema=t.parameters,
                       annotations=types.ToolAnnotations(read_only_hint=not t.side_effects))
            for t in registry.tools_for(caller(ctx))])

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        who = caller(ctx)
        try:
            tool = registry.authorize(params.name, who)
        except (NotFoundError, PermissionDeniedError) as e:
            raise MCPError(types.INVALID_PARAMS, e.message) from None
        key = (params.meta or {}).get(IDEMPOTENCY_META_KEY)
        if tool.side_effects and not key:
            key = f"mcp-{uuid.uuid4().hex}"  # nothing to deduplicate against: run once
        request_id = getattr(ctx, "request_id", None)
        call = functools.partial(registry.call, params.name, params.arguments or {}, who,
                                 idempotency_key=str(key) if key else None,
                                 call_id=str(request_id) if request_id is not None else None)
        try:
            result = await anyio.to_thread.run_sync(call)
        except ConflictError as e:
            return types.CallToolResult(content=[types.TextContent(text=f"error: {e}")],
                                        is_error=True)
        except RidgelineError as e:
            raise MCPError(types.INVALID_PARAMS, e.message) from None
        text = result.content if result.ok else result.text()
        return types.CallToolResult(content=[types.TextContent(text=text)],
                                    is_error=not result.ok)

    return Server(name, version=version, on_list_tools=list_tools, on_call_tool=call_tool)


# ---- importing a server's tools ----------------------------------------------------------------


async def tools_from_session(session: Any, *, loop: asyncio.AbstractEventLoop | None = None,
                             name_prefix: str = "",
                             scopes: tuple[str, ...] | ToolPolicy = ("tools:write",),
                             side_effects: bool | ToolPolicy = True,
                             call_timeout_s: float = 60.0) -> list[Tool]:
    """`Tool`s for every tool an MCP session (an `mcp.Client` or `ClientSession`) lists.
    Their `run` calls the session on `loop` (the running one by default), so they must be
    called from another thread than that loop's (the registry is synchronous)."""
    loop = loop or asyncio.get_running_loop()
    listed: list[types.Tool] = []
    cursor: str | None = None
    for _ in range(1000):  # a paginator that never ends cannot hang the import
        if isinstance(session, Client):
            page = await session.list_tools(cursor=cursor)
        else:
            page = await session.list_tools(params=types.PaginatedRequestParams(cursor=cursor))
        listed += page.tools
        cursor = page.next_cursor
        if not cursor:
            break
    tools: list[Tool] = []
    taken: set[str] = set()
    for remote in listed:
        name = _function_name(name_prefix + remote.name, taken)
        schema = dict(remote.input_schema or {})
        schema.setdefault("type", "object")
        schema.pop("$schema", None)
        try:
            tools.append(Tool(
                name=name, description=remote.description or remote.title or "",
                parameters=schema,
                run=_MCPCall(session, loop, remote.name, call_timeout_s),
                scopes=tuple(scopes(remote) if callable(scopes) else scopes),
                side_effects=bool(side_effects(remote) if callable(side_effects)
                                  else side_effects),
                kind="extension"))
        except ConfigError as e:
            log.warning("MCP tool %r is not imported: %s", remote.name, e)
    return tools


def _function_name(raw: str, taken: set[str]) -> str:
    base = (re.sub(r"[^A-Za-z0-9_-]+", "_", raw).strip("_") or "tool")[:64]
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base[:60]}_{n}"
    taken.add(name)
    return name


class _MCPCall:
    """The `Tool.run` of an imported MCP tool: a `tools/call` on the session's loop."""

    def __init__(self, session: Any, loop: asyncio.AbstractEventLoop, remote_name: str,
                 timeout_s: float) -> None:
        self.session, self.loop = session, loop
        self.remote_name, self.timeout_s = remote_name, timeout_s

    def __call__(self, args: dict[str, Any], ctx: ToolCallContext) -> str:
        if self.loop.is_closed():
            raise ToolFailure("the connection to the MCP server is closed",
                              error_type="mcp_closed")
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:  # waiting here would block the loop the call needs
            raise ToolFailure("an MCP tool was called on its own session's event loop; "
                              "call it from a worker thread (anyio.to_thread)",
                              error_type="mcp_same_loop")
        timeout = min(self.timeout_s, ctx.timeout_s) if ctx.timeout_s else self.timeout_s
        meta = {IDEMPOTENCY_META_KEY: ctx.idempotency_key} if ctx.idempotency_key else None
        future = asyncio.run_coroutine_threadsafe(
            self.session.call_tool(self.remote_name, args, read_timeout_seconds=timeout,
                                   meta=meta), self.loop)
        try:
            result: types.CallToolResult = future.result(timeout + 5.0)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise ToolFailure(f"the MCP tool {self.remote_name} did not answer within "
                              f"{timeout:.0f} s", error_type="timeout") from None
        except MCPError as e:
            raise ToolFailure(f"the MCP server refused the call: {e.message}",
                              error_type=f"mcp_error_{e.code}") from None
        text = content_text(result)
        if result.is_error:
            raise ToolFailure(text or f"the MCP tool {self.remote_name} failed",
                              error_type="mcp_tool_error")
        return text


def content_text(result: types.CallToolResult) -> str:
    """A tool result's content as text: text blocks as they are, other blocks named."""
    parts: list[str] = []
    for block in result.content:
        if isinstance(block, types.TextContent):
            parts.append(block.text)
        elif isinstance(block, (types.ImageContent, types.AudioContent)):
            parts.append(f"[{block.type} {block.mime_type}, {len(block.data) * 3 // 4} bytes]")
        elif isinstance(block, types.ResourceLink):
            parts.append(f"[resource {block.uri}]")
        elif isinstance(block, types.EmbeddedResource):
            resource = block.resource
            text = getattr(resource, "text", None)
            parts.append(text if text is not None else f"[resource {resource.uri}]")
        else:
            parts.append(f"[{getattr(block, 'type', 'content')}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, default=str))
    return "\n".join(parts)


class MCPToolSource:
    """A live connection to one MCP server and the `Tool`s it offers.

    `open()` connects (on a background thread's event loop) and lists the tools;
    `add_to(registry)` registers them; `close()` disconnects (imported tools then fail
    with "connection closed" results). Also a context manager."""

    def __init__(self, server: Any, *, name_prefix: str = "",
                 scopes: tuple[str, ...] | ToolPolicy = ("tools:write",),
                 side_effects: bool | ToolPolicy = True, call_timeout_s: float = 60.0,
                 connect_timeout_s: float = 30.0, mode: str = "auto") -> None:
        self.server = server
        self.name_prefix = name_prefix
        self.scopes = scopes
        self.side_effects = side_effects
        self.call_timeout_s = call_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.mode = mode
        self.tools: list[Tool] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def open(self) -> MCPToolSource:
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._thread_main, name="mcp-tool-source",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(self.connect_timeout_s):
            self.close()
            raise ToolSourceError(f"the MCP server {_describe_server(self.server)} did not "
                                  f"answer within {self.connect_timeout_s:.0f} s")
        if self._error is not None:
            error, self._error = self._error, None
            self.close()
            raise ToolSourceError(f"cannot use the MCP server {_describe_server(self.server)}: "
                                  f"{_describe_error(error)}",
                                  hint="check the server command or URL") from None
        return self

    def add_to(self, registry: ToolRegistry, *, replace: bool = False) -> list[Tool]:
        for tool in self.tools:
            registry.add(tool, replace=replace)
        return self.tools

    def close(self) -> None:
        loop, stop, thread = self._loop, self._stop, self._thread
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:
                pass  # the loop ended on its own (the server went away)
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.connect_timeout_s)

    def __enter__(self) -> MCPToolSource:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # noqa: BLE001 - reported to open(), never lost
            if not self._ready.is_set():
                self._error = e
            else:
                log.warning("the MCP connection to %s ended: %s",
                            _describe_server(self.server), _describe_error(e))
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with Client(self.server, mode=self.mode) as client:
            self.tools = await tools_from_session(
                client, loop=self._loop, name_prefix=self.name_prefix, scopes=self.scopes,
                side_effects=self.side_effects, call_timeout_s=self.call_timeout_s)
            self._ready.set()
            await self._stop.wait()


def import_mcp_tools(server: Any, registry: ToolRegistry, *, name_prefix: str = "",
                     scopes: tuple[str, ...] | ToolPolicy = ("tools:write",),
                     side_effects: bool | ToolPolicy = True, call_timeout_s: float = 60.0,
                     connect_timeout_s: float = 30.0) -> MCPToolSource:
    """Connect to an MCP server, add its tools to `registry` and return the open source
    (close it, or use it as a context manager, when the tools are no longer needed)."""
    source = MCPToolSource(server, name_prefix=name_prefix, scopes=scopes,
                           side_effects=side_effects, call_timeout_s=call_timeout_s,
                           connect_timeout_s=connect_timeout_s).open()
    try:
        source.add_to(registry)
    except BaseException:
        source.close()
        raise
    return source


def _describe_server(server: Any) -> str:
    if isinstance(server, str):
        return server
    command = getattr(server, "command", None)
    if command is not None:
        return " ".join([command, *getattr(server, "args", [])])
    return type(server).__name__


def _describe_error(e: BaseException) -> str:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return f"{type(e).__name__}: {e}"
