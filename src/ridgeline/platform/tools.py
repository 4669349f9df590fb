"""The tools registry: tools the platform's agents (and API clients) may call, each with a
JSON-schema'd argument object, the permission scopes a caller needs, and whether it acts
on the world outside the sandbox.

    tools = ToolRegistry()

    @tools.tool(scopes=("crm:write",), side_effects=True)
    def create_ticket(title: str, priority: int = 3) -> dict:
        "Open a support ticket."
        ...

    tools.openai_tools(principal)     # OpenAI function tools, strict schemas, scope-filtered
    tools.call("create_ticket", '{"title": "x", "priority": null}', principal,
               idempotency_key="task-7:step-3")

Tools come from typed Python functions (pydantic builds the argument model from the
signature), from an OpenAPI spec (`openapi_tools`) or from an MCP server (`mcp_bridge`);
all are `Tool`s and are called the same way.

- Schemas. `openai_tools` emits each tool's arguments in OpenAI's strict structured-output
  subset where it can, with `"strict": false` where it cannot (`tool_schemas`); a null
  for an optional argument means "use the default".
- Scopes. A tool names the scopes it needs; a `Principal` must hold all of them.
  Listing hides the tools a caller may not use; calling one raises `ToolPermissionError`
  (a 403 `PermissionDeniedError` that names the scope).
- Side effects. A tool with `side_effects=True` is only called with an idempotency key;
  its result is stored under (tenant, key) in an `IdempotencyStore` (SQLite on disk,
  PostgreSQL, or memory), so a repeated call (a resumed agent task replaying its step)
  gets the stored result back without acting twice. The same key with other arguments is a 409.
- Failures. A tool that raises gives `ToolResult(ok=False)`, never a crash: the model
  sees the error and can fix its call. Bad arguments come back the same way.
- Telemetry. Prometheus `ridgeline_tool_calls_total{tool,outcome}` (ok, error, denied)
  and `ridgeline_tool_latency_seconds{tool}`; the success rate of a tool is
  `rate(ridgeline_tool_calls_total{outcome="ok"}[5m]) / rate(ridgeline_tool_calls_total
  {outcome!="denied"}[5m])`. Every call is an OpenTelemetry span following the GenAI
  semantic conventions (`execute_tool {name}`, `gen_ai.operation.name=execute_tool`,
  `gen_ai.tool.name`, `gen_ai.tool.call.id`, `gen_ai.tool.type`, `error.type`); it is a
  no-op until the application installs a tracer provider.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import inspect
import itertools
import json
import logging
import re
import threading
import time
import typing
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import jsonschema
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, create_model

from ridgeline.agent.observation import truncate_middle
from ridgeline.errors import (
    ConfigError, ConflictError, NotFoundError, PermissionDeniedError, RidgelineError,
)
from ridgeline.platform.db import (
    Database, Transaction, is_postgres_url, open_database, resolve_location,
)
from ridgeline.platform.principal import Principal
from ridgeline.platform.tool_schemas import StrictSchemaError, drop_optional_nulls, strict_schema

log = logging.getLogger(__name__)

DEFAULT_SCOPES: tuple[str, ...] = ("tools:read",)
#: OpenAI's rule for function names.
TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# ---- errors and results -----------------------------------------------------------------------


class ToolPermissionError(PermissionDeniedError):
    """The caller's key lacks a scope the tool needs (403)."""

    code = "insufficient_scope"

    def __init__(self, tool: str, missing: list[str]) -> None:
        self.tool = tool
        self.missing = missing
        self.param = None
        scopes = ", ".join(repr(s) for s in missing)
        super().__init__(f"this API key may not call the tool {tool!r}: it needs the "
                         f"scope{'s' if len(missing) > 1 else ''} {scopes}",
                         hint="ask an administrator for a key with that scope")


class ToolArgumentsError(RidgelineError):
    """A tool call's arguments do not fit the tool's schema (400). Inside `call` this
    becomes a `ToolResult(ok=False)` so that the model sees the message."""

    code = "invalid_tool_arguments"
    param = "arguments"


class ToolSourceError(RidgelineError):
    """A remote source of tools (an MCP server, a REST API's spec) cannot be used (502)."""

    http_status = 502


class ToolFailure(Exception):
    """Raised by a tool for a failure of its own (an HTTP 404 from the API it wraps, an
    MCP tool's error result): the message goes to the model as the call's error, and
    `error_type` (low-cardinality, e.g. "404") to the span's `error.type`."""

    def __init__(self, message: str, *, error_type: str = "tool_error",
                 content: str = "") -> None:
        super().__init__(message)
        self.error_type = error_type
        self.content = content


class ToolResult(BaseModel):
    """What one call did. `content` is the tool's output as text (JSON for structured
    values); `error` says why it failed; `replayed` marks a result read back from the
    idempotency store instead of running the tool again."""

    ok: bool
    content: str = ""
    error: str | None = None
    error_type: str | None = None
    duration_s: float = 0.0
    replayed: bool = False

    def text(self) -> str:
        """The result as a model is shown it."""
        if self.ok:
            return self.content if self.content.strip() else "(no output)"
        return f"error: {self.error}" + (f"\n{self.content}" if self.content else "")


@dataclass(frozen=True)
class ToolCallContext:
    """What a tool may want to know of the call besides its arguments. A Python tool
    receives it if one of its parameters is annotated `ToolCallContext`."""

    principal: Principal
    call_id: str | None = None
    idempotency_key: str | None = None
    timeout_s: float | None = None


# ---- tools -------------------------------------------------------------------------------------

ToolRunner = Callable[[dict[str, Any], ToolCallContext], Any]


@dataclass
class Tool:
    """One callable tool. `parameters` is the JSON schema of its argument object (what
    calls are validated against, unless `arguments_model` does it); `run(args, ctx)`
    gets the validated arguments. `kind` is the GenAI `gen_ai.tool.type`: "function"
    for code run in-process, "extension" for calls to external APIs."""

    name: str
    description: str
    parameters: dict[str, Any]
    run: ToolRunner
    scopes: tuple[str, ...] = DEFAULT_SCOPES
    side_effects: bool = False
    kind: str = "extension"
    arguments_model: type[BaseModel] | None = None
    _openai: dict[str, Any] | None = field(default=None, init=False, repr=False)
    _validator: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not TOOL_NAME_RE.match(self.name):
            raise ConfigError(f"tool name {self.name!r} is not allowed",
                              hint="use 1-64 letters, digits, '_' or '-' (OpenAI's rule)")
        if self.parameters.get("type") != "object":
            raise ConfigError(f"tool {self.name!r}: the arguments schema must be an object")
        self.scopes = tuple(self.scopes)
        cls = jsonschema.validators.validator_for(self.parameters)
        try:
            cls.check_schema(self.parameters)
        except jsonschema.SchemaError as e:
            raise ConfigError(f"tool {self.name!r}: invalid arguments schema: {e.message}") from None
        self._validator = cls(self.parameters)

    def openai_tool(self) -> dict[str, Any]:
        """The OpenAI function tool: strict when the schema allows it (see the module doc)."""
        if self._openai is None:
            try:
                parameters, strict = strict_schema(self.parameters), True
            except StrictSchemaError as e:
                log.info("tool %s is offered without strict mode: %s", self.name, e)
                parameters, strict = copy.deepcopy(self.parameters), False
            function: dict[str, Any] = {"name": self.name}
            if self.description:
                function["description"] = self.description
            function.update(parameters=parameters, strict=strict)
            self._openai = {"type": "function", "function": function}
        return copy.deepcopy(self._openai)

    def validate(self, arguments: dict[str, Any] | str | None) -> dict[str, Any]:
        """The arguments `run` gets; `ToolArgumentsError` says what is wrong with them.
        A JSON string is parsed; a null for an optional property that does not take
        null means "not given" (strict mode makes models send every property)."""
        if arguments is None or arguments == "":
            arguments = {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise ToolArgumentsError(f"the arguments of {self.name} are not valid JSON: "
                                         f"{e.msg} at character {e.pos}") from None
        if not isinstance(arguments, dict):
            raise ToolArgumentsError(f"the arguments of {self.name} must be a JSON object, "
                                     f"not {type(arguments).__name__}")
        args = drop_optional_nulls(arguments, self.parameters, self.parameters)
        if self.arguments_model is not None:
            try:
                model = self.arguments_model.model_validate(args)
            except ValidationError as e:
                raise ToolArgumentsError(f"invalid arguments for {self.name}: "
                                         f"{describe_validation_error(e)}") from None
            return {name: getattr(model, name) for name in type(model).model_fields}
        errors = sorted(self._validator.iter_errors(args), key=lambda e: list(e.absolute_path))
        if errors:
            problems = "; ".join(_describe_schema_error(e) for e in errors[:5])
            raise ToolArgumentsError(f"invalid arguments for {self.name}: {problems}")
        return args


def describe_validation_error(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "(arguments)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown argument"
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)


def _describe_schema_error(e: jsonschema.ValidationError) -> str:
    where = ".".join(str(p) for p in e.absolute_path) or "(arguments)"
    return f"{where}: {e.message}"


def function_tool(fn: Callable[..., Any], *, name: str | None = None,
                  description: str | None = None, scopes: Iterable[str] = DEFAULT_SCOPES,
                  side_effects: bool = False) -> Tool:
    """A `Tool` from a typed Python function: its parameters (annotations, defaults,
    `Annotated[..., Field(description=...)]`) become the arguments model, its docstring
    the description. A parameter annotated `ToolCallContext` receives the call's context.
    Coroutine functions are run to completion on a private event loop."""
    tool_name = name or fn.__name__
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except (NameError, TypeError) as e:
        raise ConfigError(f"tool {tool_name!r}: cannot read the type hints of "
                          f"{fn.__qualname__}: {e}") from None
    fields: dict[str, Any] = {}
    context_param: str | None = None
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise ConfigError(f"tool {tool_name!r}: parameter {pname!r} must be a plain "
                              "keyword-capable parameter (no *args, **kwargs or /)")
        annotation = hints.get(pname, inspect.Parameter.empty)
        if annotation is ToolCallContext:
            context_param = pname
            continue
        if annotation is inspect.Parameter.empty:
            raise ConfigError(f"tool {tool_name!r}: parameter {pname!r} needs a type annotation",
                              hint="the annotation is the schema the model is shown")
        if pname.startswith("_"):
            raise ConfigError(f"tool {tool_name!r}: parameter {pname!r} may not start with '_'")
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[pname] = (annotation, default)
    model = create_model(f"{tool_name}_arguments",  # type: ignore[call-overload]
                         __config__=ConfigDict(extra="forbid"), **fields)
    parameters = model.model_json_schema()
    parameters.pop("title", None)
    parameters.setdefault("properties", {})
    is_async = inspect.iscoroutinefunction(fn)

    def run(args: dict[str, Any], ctx: ToolCallContext) -> Any:
        kwargs = dict(args)
        if context_param is not None:
            kwargs[context_param] = ctx
        if is_async:
            return asyncio.run(fn(**kwargs))
        return fn(**kwargs)

    doc = description if description is not None else (inspect.getdoc(fn) or "")
    return Tool(name=tool_name, description=doc, parameters=parameters, run=run,
                scopes=tuple(scopes), side_effects=side_effects, kind="function",
                arguments_model=model)


# ---- idempotency -------------------------------------------------------------------------------


class IdempotencyRecord(BaseModel):
    """The stored outcome of one side-effecting call."""

    tool: str
    fingerprint: str = Field(description="sha256 of the tool and its validated arguments")
    result: ToolResult
    created_at: float = Field(default_factory=time.time)


@runtime_checkable
class IdempotencyStore(Protocol):
    def get(self, key: str) -> IdempotencyRecord | None: ...

    def put(self, key: str, record: IdempotencyRecord) -> None:
        """Store `record` unless `key` is already stored (the first result wins)."""
        ...


class MemoryIdempotencyStore:
    """Results kept in memory for the life of the process (no restart to survive), the
    newest `max_records` of them."""

    def __init__(self, max_records: int = 100_000) -> None:
        self.max_records = max_records
        self._records: dict[str, IdempotencyRecord] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> IdempotencyRecord | None:
        with self._lock:
            return self._records.get(key)

    def put(self, key: str, record: IdempotencyRecord) -> None:
        with self._lock:
            if key in self._records:
                return
            self._records[key] = record
            while len(self._records) > self.max_records:  # dicts keep insertion order
                del self._records[next(iter(self._records))]


class SQLIdempotencyStore:
    """Results in one database (`ridgeline.platform.db`): a SQLite file (a path or
    `sqlite:///path`; WAL: several threads and processes on one machine), `:memory:`, or
    `postgresql://...` (workers on many machines). They are kept for `ttl_s` seconds
    (None: forever); expired rows are purged as new ones come.

    The registry serialises calls with one key inside a process; across processes a key
    belongs to one task, which one worker runs at a time (the queue's lease), so two
    processes never race on it; if they did, the first result stored would win."""

    _PURGE_EVERY = 256

    def __init__(self, path: str | Path | Database, *, ttl_s: float | None = 7 * 24 * 3600.0,
                 pool_size: int = 4) -> None:
        self.ttl_s = ttl_s
        self._puts = itertools.count(1)   # next() is atomic under the GIL
        # an open Database is shared (the platform's one): its owner closes it
        self._owns_db = not isinstance(path, Database)
        if isinstance(path, Database):
            self.db, self.path = path, path.location
        else:
            self.path = str(path)
            location = resolve_location(path)
            if not is_postgres_url(location) and location != ":memory:":
                Path(location).parent.mkdir(parents=True, exist_ok=True)
            self.db = open_database(location, pool_size=pool_size)
        self.db.executescript(IDEMPOTENCY_SCHEMA)

    def get(self, key: str) -> IdempotencyRecord | None:
        row = self.db.fetchone("SELECT record, created_at FROM tool_idempotency "
                               "WHERE key = ?", (key,))
        if row is None:
            return None
        if self.ttl_s is not None and row[1] < time.time() - self.ttl_s:
            return None
        return IdempotencyRecord.model_validate_json(row[0])

    def put(self, key: str, record: IdempotencyRecord) -> None:
        ttl_s = self.ttl_s
        purge = ttl_s is not None and next(self._puts) % self._PURGE_EVERY == 0
        data = record.model_dump_json()

        def store(tx: Transaction) -> None:
            if ttl_s is not None:
                expired = time.time() - ttl_s
                if purge:
                    tx.execute("DELETE FROM tool_idempotency WHERE created_at < ?", (expired,))
                # an expired row gives way to the new result
                tx.execute("DELETE FROM tool_idempotency WHERE key = ? AND created_at < ?",
                           (key, expired))
            tx.execute("INSERT INTO tool_idempotency (key, record, created_at) "
                       "VALUES (?, ?, ?) ON CONFLICT (key) DO NOTHING",
                       (key, data, record.created_at))

        self.db.run(store)

    def close(self) -> None:
        if self._owns_db:
            self.db.close()


#: The name from when the store was SQLite only.
SQLiteIdempotencyStore = SQLIdempotencyStore

IDEMPOTENCY_SCHEMA = """
CREATE TABLE IF NOT EXISTS tool_idempotency (
    key TEXT PRIMARY KEY,
    record TEXT NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS tool_idempotency_created ON tool_idempotency (created_at);
"""


def arguments_fingerprint(tool: str, args: dict[str, Any]) -> str:
    data = TypeAdapter(Any).dump_python(args, mode="json")
    canonical = json.dumps([tool, data], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


# ---- metrics -----------------------------------------------------------------------------------

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0)


class ToolMetrics:
    """The tool metrics in one Prometheus registry. Several `ToolRegistry`s may share a
    Prometheus registry (e.g. one tool registry per tenant): they share these metrics."""

    _by_registry: weakref.WeakKeyDictionary[CollectorRegistry, ToolMetrics] = \
        weakref.WeakKeyDictionary()
    _guard = threading.Lock()

    def __init__(self, registry: CollectorRegistry) -> None:
        self.calls = Counter("ridgeline_tool_calls", "Tool calls by tool and outcome "
                             "(ok, error: the tool failed or got bad arguments, denied: the "
                             "caller lacks a scope)", ["tool", "outcome"], registry=registry)
        self.latency = Histogram("ridgeline_tool_latency_seconds",
                                 "Time a tool took to run (calls that ran)", ["tool"],
                                 buckets=_LATENCY_BUCKETS, registry=registry)
        self.replays = Counter("ridgeline_tool_replays", "Side-effecting calls answered from "
                               "the idempotency store instead of running again", ["tool"],
                               registry=registry)

    @classmethod
    def for_registry(cls, registry: CollectorRegistry) -> ToolMetrics:
        with cls._guard:
            metrics = cls._by_registry.get(registry)
            if metrics is None:
                metrics = cls._by_registry[registry] = cls(registry)
            return metrics


# ---- the registry ------------------------------------------------------------------------------


class ToolRegistry:
    """The tools a deployment offers. Thread-safe: workers call tools from many threads."""

    _N_LOCKS = 64

    def __init__(self, metrics_registry: CollectorRegistry | None = None, tracer: Any = None,
                 *, idempotency_store: IdempotencyStore | None = None,
                 max_content_bytes: int = 100_000) -> None:
        self.metrics_registry = metrics_registry if metrics_registry is not None \
            else CollectorRegistry(auto_describe=True)
        self.metrics = ToolMetrics.for_registry(self.metrics_registry)
        self.tracer = tracer if tracer is not None else trace.get_tracer("ridgeline.platform.tools")
        self.idempotency_store: IdempotencyStore = idempotency_store \
            if idempotency_store is not None else MemoryIdempotencyStore()
        self.max_content_bytes = max_content_bytes
        self._tools: dict[str, Tool] = {}
        self._guard = threading.Lock()
        # One lock per key stripe: two calls with one key never run the tool twice.
        self._key_locks = [threading.Lock() for _ in range(self._N_LOCKS)]

    # -- registering ------------------------------------------------------------------------
    def add(self, tool: Tool, *, replace: bool = False) -> Tool:
        tool.openai_tool()  # convert the schema now: a tool that cannot be offered fails here
        with self._guard:
            if tool.name in self._tools and not replace:
                raise ConfigError(f"a tool named {tool.name!r} is already registered",
                                  hint="give one of them another name (or a name prefix)")
            self._tools[tool.name] = tool
        return tool

    def remove(self, name: str) -> None:
        with self._guard:
            self._tools.pop(name, None)

    def tool(self, fn: Callable[..., Any] | None = None, *, name: str | None = None,
             description: str | None = None, scopes: Iterable[str] = DEFAULT_SCOPES,
             side_effects: bool = False) -> Any:
        """Decorator: `@registry.tool` or `@registry.tool(scopes=..., side_effects=True)`.
        The function is registered and returned unchanged."""
        def register(f: Callable[..., Any]) -> Callable[..., Any]:
            self.add(function_tool(f, name=name, description=description, scopes=scopes,
                                   side_effects=side_effects))
            return f
        return register(fn) if fn is not None else register

    # -- looking up -------------------------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def get(self, name: str) -> Tool:
        tool = self._tools.get(name)
        if tool is None:
            raise NotFoundError(f"no tool named {name!r}",
                                hint="list the tools this key may use (GET /v1/tools)")
        return tool

    def allowed(self, tool: Tool, principal: Principal | None) -> bool:
        return principal is None or all(principal.has_scope(s) for s in tool.scopes)

    def tools_for(self, principal: Principal | None = None) -> list[Tool]:
        """The tools `principal` may call (all of them for None), in registration order."""
        with self._guard:
            tools = list(self._tools.values())
        return [t for t in tools if self.allowed(t, principal)]

    def openai_tools(self, principal: Principal | None = None) -> list[dict[str, Any]]:
        """OpenAI function tools (strict schemas) for what `principal` may call."""
        return [t.openai_tool() for t in self.tools_for(principal)]

    def authorize(self, name: str, principal: Principal) -> Tool:
        """The tool, if `principal` may call it: `NotFoundError` or `ToolPermissionError`."""
        tool = self.get(name)
        missing = [s for s in tool.scopes if not principal.has_scope(s)]
        if missing:
            raise ToolPermissionError(name, missing)
        return tool

    # -- calling ----------------------------------------------------------------------------
    def call(self, name: str, arguments: dict[str, Any] | str | None, principal: Principal, *,
             idempotency_key: str | None = None, call_id: str | None = None,
             timeout_s: float | None = None) -> ToolResult:
        """Run one tool call for `principal`. Raises `NotFoundError` (no such tool),
        `ToolPermissionError` (a scope is missing), `RidgelineError` (a side-effecting
        tool called without `idempotency_key`) and `ConflictError` (that key was used
        with other arguments); everything the tool or its arguments do wrong comes back
        as `ToolResult(ok=False)`."""
        attributes: dict[str, Any] = {"gen_ai.operation.name": "execute_tool",
                                      "gen_ai.tool.name": name}
        if call_id:
            attributes["gen_ai.tool.call.id"] = call_id
        with self.tracer.start_as_current_span(f"execute_tool {name}", kind=SpanKind.INTERNAL,
                                               attributes=attributes) as span:
            try:
                tool = self.authorize(name, principal)
            except PermissionDeniedError as e:
                self.metrics.calls.labels(tool=name, outcome="denied").inc()
                _fail_span(span, type(e).__name__, e.message)
                raise
            except NotFoundError as e:  # not counted: models invent names (label cardinality)
                _fail_span(span, type(e).__name__, e.message)
                raise
            span.set_attribute("gen_ai.tool.type", tool.kind)
            if tool.description:
                span.set_attribute("gen_ai.tool.description", tool.description[:500])
            if tool.side_effects and not idempotency_key:
                _fail_span(span, "missing_idempotency_key", "no idempotency key")
                raise RidgelineError(f"the tool {name!r} has side effects: call it with an "
                                     "idempotency key", hint="derive the key from what makes "
                                     "the call unique, e.g. task id and step, so a retry "
                                     "reuses it")
            try:
                args = tool.validate(arguments)
            except ToolArgumentsError as e:
                self.metrics.calls.labels(tool=name, outcome="error").inc()
                _fail_span(span, "invalid_arguments", e.message)
                return ToolResult(ok=False, error=e.message, error_type="invalid_arguments")
            ctx = ToolCallContext(principal=principal, call_id=call_id,
                                  idempotency_key=idempotency_key, timeout_s=timeout_s)
            if not tool.side_effects:
                return self._run(tool, args, ctx, span)
            assert idempotency_key is not None
            key = _scoped_key(principal.tenant, idempotency_key)
            fingerprint = arguments_fingerprint(name, args)
            with self._key_locks[hash(key) % self._N_LOCKS]:
                record = self.idempotency_store.get(key)
                if record is not None:
                    if record.tool != name or record.fingerprint != fingerprint:
                        _fail_span(span, "ConflictError", "idempotency key reused")
                        raise ConflictError(
                            f"the idempotency key {idempotency_key!r} was used for another "
                            f"call ({record.tool} with other arguments)",
                            hint="use a new key for a new call; reuse a key only to retry "
                                 "the very same call")
                    span.set_attribute("ridgeline.tool.replayed", True)
                    self.metrics.replays.labels(tool=name).inc()
                    result = record.result.model_copy(update={"replayed": True})
                    if not result.ok:
                        _fail_span(span, result.error_type or "tool_error", result.error or "")
                    return result
                result = self._run(tool, args, ctx, span)
                self.idempotency_store.put(key, IdempotencyRecord(
                    tool=name, fingerprint=fingerprint, result=result))
                return result

    def _run(self, tool: Tool, args: dict[str, Any], ctx: ToolCallContext,
             span: trace.Span) -> ToolResult:
        t0 = time.perf_counter()
        try:
            value = tool.run(args, ctx)
        except ToolFailure as e:
            result = ToolResult(ok=False, error=str(e), error_type=e.error_type,
                                content=self._bounded(e.content))
        except Exception as e:  # a tool's own bug or failure: the model sees it, we go on
            log.warning("tool %s raised %s: %s", tool.name, type(e).__name__, e,
                        exc_info=log.isEnabledFor(logging.DEBUG))
            result = ToolResult(ok=False, error=f"{type(e).__name__}: {e}",
                                error_type=type(e).__name__)
        else:
            result = ToolResult(ok=True, content=self._bounded(to_text(value)))
        result.duration_s = time.perf_counter() - t0
        self.metrics.latency.labels(tool=tool.name).observe(result.duration_s)
        self.metrics.calls.labels(tool=tool.name, outcome="ok" if result.ok else "error").inc()
        if not result.ok:
            _fail_span(span, result.error_type or "tool_error", result.error or "")
        return result

    def _bounded(self, text: str) -> str:
        return truncate_middle(text, self.max_content_bytes)[0]


def _scoped_key(tenant: str, key: str) -> str:
    """One namespace of keys per tenant: two tenants' equal keys never meet."""
    return f"{len(tenant)}:{tenant}:{key}"


def _fail_span(span: trace.Span, error_type: str, message: str) -> None:
    span.set_attribute("error.type", error_type)
    span.set_status(Status(StatusCode.ERROR, message[:500]))


def to_text(value: Any) -> str:
    """A tool's return value as text for a model: strings as they are, the rest as JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    try:
        return json.dumps(TypeAdapter(Any).dump_python(value, mode="json"), ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)
