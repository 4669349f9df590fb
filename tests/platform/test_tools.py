"""The tools registry: strict OpenAI schemas, scopes, argument validation, failures as
results, idempotent side effects in a real SQLite file and in a real PostgreSQL server
started on loopback by the tests (across restarts of the registry and of the platform,
under concurrent calls, expired results giving way), Prometheus metrics and OpenTelemetry
GenAI spans (recorded by the SDK's in-memory exporter)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal

import jsonschema
import pytest
from tests.helpers.postgres_server import postgres_server_fixture
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import BaseModel, Field

from ridgeline.errors import ConfigError, ConflictError, NotFoundError, RidgelineError
from ridgeline.platform.config import PlatformConfig
from ridgeline.platform.principal import Principal
from ridgeline.platform.service import Platform
from ridgeline.platform.tools import (
    IdempotencyRecord, SQLIdempotencyStore, SQLiteIdempotencyStore, StrictSchemaError, Tool,
    ToolCallContext, ToolFailure, ToolPermissionError, ToolRegistry, ToolResult,
    function_tool, strict_schema,
)
from ridgeline.wire import error_for

READER = Principal(key_id="k-read", tenant="acme", scopes=frozenset({"tools:read"}))
WRITER = Principal(key_id="k-write", tenant="acme",
                   scopes=frozenset({"tools:read", "tickets:write"}))
OTHER_TENANT = Principal(key_id="k-other", tenant="globex",
                         scopes=frozenset({"tools:read", "tickets:write"}))
ADMIN = Principal(key_id="k-admin", tenant="ops", admin=True)

# Keywords OpenAI's strict mode accepts in a schema node.
STRICT_KEYWORDS = {"type", "description", "properties", "required", "additionalProperties",
                   "items", "anyOf", "enum", "const", "$ref", "$defs", "pattern", "format",
                   "multipleOf", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                   "minItems", "maxItems"}


def assert_strict(node: Any, root: bool = True) -> None:
    """Every rule of OpenAI's structured-output subset that a schema can break."""
    assert isinstance(node, dict), node
    assert set(node) <= STRICT_KEYWORDS, f"unsupported keywords {set(node) - STRICT_KEYWORDS}"
    if root:
        assert node["type"] == "object" and "anyOf" not in node
    for schema in node.get("$defs", {}).values():
        assert_strict(schema, root=False)
    if "$ref" in node:
        assert set(node) == {"$ref"} and node["$ref"].startswith("#")
        return
    assert {"type", "anyOf", "enum", "const"} & set(node), f"untyped node {node}"
    types = node.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    if "object" in types:
        assert node["additionalProperties"] is False
        assert node["required"] == list(node["properties"])
        for sub in node["properties"].values():
            assert_strict(sub, root=False)
    if "array" in types:
        assert_strict(node["items"], root=False)
    for sub in node.get("anyOf", []):
        assert_strict(sub, root=False)


class Priority(str, Enum):
    low = "low"
    high = "high"


class Address(BaseModel):
    street: str
    zip: str | None = None


class Category(BaseModel):
    name: str
    children: list["Category"] = []


def make_registry(**kwargs: Any) -> tuple[ToolRegistry, dict[str, int]]:
    registry = ToolRegistry(**kwargs)
    runs = {"create_ticket": 0, "explode": 0}

    @registry.tool
    def add(a: int, b: int = 1) -> int:
        """Add two integers."""
        return a + b

    @registry.tool(scopes=("tools:read", "tickets:write"), side_effects=True)
    def create_ticket(title: Annotated[str, Field(description="one line")],
                      priority: Priority = Priority.low, tags: list[str] = [],
                      address: Address | None = None, note: str | None = "keep",
                      mode: Literal["email", "sms"] = "email") -> dict[str, Any]:
        """Open a support ticket."""
        runs["create_ticket"] += 1
        return {"id": runs["create_ticket"], "title": title, "priority": priority.value,
                "tags": tags, "address": address.model_dump() if address else None,
                "note": note, "mode": mode}

    @registry.tool(side_effects=True)
    def explode(reason: str) -> str:
        """Always fails."""
        runs["explode"] += 1
        raise ValueError(f"boom: {reason}")

    return registry, runs


# ---- schemas ----------------------------------------------------------------------------------


def test_openai_tools_are_strict_function_tools() -> None:
    registry, _ = make_registry()
    tools = {t["function"]["name"]: t for t in registry.openai_tools(ADMIN)}
    assert set(tools) == {"add", "create_ticket", "explode"}
    for tool in tools.values():
        assert tool["type"] == "function" and tool["function"]["strict"] is True
        assert_strict(tool["function"]["parameters"])
        jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])
    ticket = tools["create_ticket"]["function"]
    assert ticket["description"] == "Open a support ticket."
    props = ticket["parameters"]["properties"]
    assert props["title"] == {"type": "string", "description": "one line"}
    # optional: a union with null, the default moved into the description
    assert {"type": "null"} in props["priority"]["anyOf"]
    assert "(default: \"low\")" in props["priority"]["description"]
    assert props["address"]["anyOf"][0]["properties"]["zip"]["anyOf"][1] == {"type": "null"}
    assert tools["add"]["function"]["parameters"]["properties"]["b"]["type"] == ["integer", "null"]


def test_what_a_strict_model_sends_is_accepted_and_nulls_mean_defaults() -> None:
    registry, runs = make_registry()
    schema = registry.get("create_ticket").openai_tool()["function"]["parameters"]
    sent = {"title": "Disk full", "priority": None, "tags": None, "note": None, "mode": None,
            "address": {"street": "Main St 1", "zip": None}}
    jsonschema.validate(sent, schema)  # the shape strict decoding produces
    result = registry.call("create_ticket", json.dumps(sent), WRITER, idempotency_key="t-1")
    assert result.ok, result.error
    ticket = json.loads(result.content)
    assert ticket["priority"] == "low" and ticket["tags"] == [] and ticket["mode"] == "email"
    assert ticket["address"] == {"street": "Main St 1", "zip": None}
    # `note` takes null itself (str | None): null is passed on, not replaced by the default
    assert ticket["note"] is None
    assert runs["create_ticket"] == 1


def test_recursive_and_free_form_schemas() -> None:
    def count(root: Category) -> int:
        """Count categories."""
        return 1

    tool = function_tool(count)
    fn = tool.openai_tool()["function"]
    assert fn["strict"] is True
    assert_strict(fn["parameters"])
    assert "Category" in fn["parameters"]["$defs"]
    children = fn["parameters"]["properties"]["root"]["properties"]["children"]
    assert children["anyOf"][0]["items"] == {"$ref": "#/$defs/Category"}

    def totals(counts: dict[str, int]) -> int:
        return sum(counts.values())

    free = function_tool(totals).openai_tool()["function"]
    assert free["strict"] is False  # a map with free keys is not expressible in strict mode
    assert free["parameters"]["properties"]["counts"]["additionalProperties"] == {"type": "integer"}


def test_strict_schema_from_openapi_style_json_schema() -> None:
    schema = {
        "type": "object",
        "required": ["pet"],
        "properties": {
            "pet": {"allOf": [
                {"type": "object", "required": ["name"],
                 "properties": {"name": {"type": "string", "minLength": 1, "title": "Name"}}},
                {"type": "object", "properties": {"born": {"type": "string",
                                                           "format": "date-time"},
                                                  "site": {"type": "string", "format": "uri"}}},
            ]},
            "kind": {"oneOf": [{"type": "string", "enum": ["cat", "dog"]}, {"type": "integer"}],
                     "example": "cat"},
            "age": {"type": "integer", "nullable": True, "default": 3},
        },
    }
    out = strict_schema(schema)
    assert_strict(out)
    pet = out["properties"]["pet"]
    assert pet["required"] == ["name", "born", "site"]
    assert pet["properties"]["name"] == {"type": "string"}           # minLength, title dropped
    assert pet["properties"]["born"] == {"type": ["string", "null"], "format": "date-time"}
    assert pet["properties"]["site"] == {"type": ["string", "null"]}  # uri is not supported
    assert out["properties"]["kind"]["anyOf"][-1] == {"type": "null"}
    assert out["properties"]["age"]["type"] == ["integer", "null"]
    assert schema["properties"]["age"]["nullable"] is True           # the input is untouched
    with pytest.raises(StrictSchemaError, match="free-form"):
        strict_schema({"type": "object", "properties": {"meta": {"type": "object"}}})
    with pytest.raises(StrictSchemaError, match="no type"):
        strict_schema({"type": "object", "properties": {"x": {}}})
    with pytest.raises(StrictSchemaError, match="must be an object"):
        strict_schema({"anyOf": [{"type": "object", "properties": {}}]})


def test_bad_tool_definitions_are_refused() -> None:
    registry = ToolRegistry()
    with pytest.raises(ConfigError, match="type annotation"):
        registry.tool(lambda x: x)
    with pytest.raises(ConfigError, match="not allowed"):
        registry.add(Tool(name="has space", description="", run=lambda a, c: None,
                          parameters={"type": "object", "properties": {}}))

    @registry.tool
    def ping() -> str:
        return "pong"

    with pytest.raises(ConfigError, match="already registered"):
        registry.tool(ping)
    assert registry.openai_tools()[0]["function"]["parameters"] == {
        "type": "object", "properties": {}, "required": [], "additionalProperties": False}


# ---- scopes -----------------------------------------------------------------------------------


def test_listing_and_calling_follow_scopes() -> None:
    registry, runs = make_registry()
    assert [t["function"]["name"] for t in registry.openai_tools(READER)] == ["add", "explode"]
    assert len(registry.openai_tools(WRITER)) == 3
    star = Principal(key_id="k", tenant="acme", scopes=frozenset({"*"}))
    assert len(registry.openai_tools(star)) == 3

    with pytest.raises(ToolPermissionError) as caught:
        registry.call("create_ticket", {"title": "x"}, READER, idempotency_key="k1")
    assert "'tickets:write'" in str(caught.value) and runs["create_ticket"] == 0
    status, body = error_for(caught.value)
    assert status == 403
    assert body["error"]["code"] == "insufficient_scope"
    assert "tickets:write" in body["error"]["message"]

    with pytest.raises(NotFoundError) as missing:
        registry.call("delete_everything", {}, ADMIN)
    assert error_for(missing.value)[0] == 404


# ---- arguments and failures -----------------------------------------------------------------


def test_bad_arguments_come_back_as_results_without_running() -> None:
    registry, runs = make_registry()
    wrong_type = registry.call("add", {"a": "three"}, READER)
    assert not wrong_type.ok and wrong_type.error_type == "invalid_arguments"
    assert "a:" in wrong_type.error and "integer" in wrong_type.error
    bad_json = registry.call("add", '{"a": 1,', READER)
    assert not bad_json.ok and "not valid JSON" in bad_json.error
    extra = registry.call("add", {"a": 1, "c": 2}, READER)
    assert not extra.ok and "c: unknown argument" in extra.error
    missing = registry.call("create_ticket", {"priority": "urgent"}, WRITER,
                            idempotency_key="t-bad")
    assert not missing.ok and "title: Field required" in missing.error
    assert "priority" in missing.error
    assert runs["create_ticket"] == 0
    assert registry.call("add", {"a": 2}, READER).content == "3"


def test_a_tool_that_raises_gives_a_failed_result() -> None:
    registry, runs = make_registry()
    result = registry.call("explode", {"reason": "disk"}, READER, idempotency_key="e-1")
    assert not result.ok
    assert result.error == "ValueError: boom: disk" and result.error_type == "ValueError"
    assert result.text().startswith("error: ValueError: boom: disk")
    # the failure is the call's result: replaying the key does not run it again
    again = registry.call("explode", {"reason": "disk"}, READER, idempotency_key="e-1")
    assert again.replayed and not again.ok and runs["explode"] == 1


def test_tool_failure_context_async_tools_and_bounded_output() -> None:
    registry = ToolRegistry(max_content_bytes=300)

    @registry.tool
    def whoami(ctx: ToolCallContext, greeting: str = "hi") -> str:
        """Who is calling."""
        return f"{greeting} {ctx.principal.tenant} {ctx.call_id}"

    @registry.tool
    async def slow_double(x: int) -> int:
        return x * 2

    @registry.tool
    def fetch(url: str) -> str:
        raise ToolFailure("HTTP 404 Not Found", error_type="404", content="no such page")

    @registry.tool
    def big() -> str:
        return "x" * 10_000

    assert "ctx" not in registry.get("whoami").parameters["properties"]
    assert registry.call("whoami", {}, READER, call_id="c7").content == "hi acme c7"
    assert registry.call("slow_double", {"x": 21}, READER).content == "42"
    failed = registry.call("fetch", {"url": "u"}, READER)
    assert (failed.ok, failed.error, failed.error_type, failed.content) == \
        (False, "HTTP 404 Not Found", "404", "no such page")
    out = registry.call("big", {}, READER)
    assert out.ok and len(out.content.encode()) <= 300 and "x" * 50 in out.content


# ---- idempotency ------------------------------------------------------------------------------


postgres_server = postgres_server_fixture()


@pytest.fixture(params=["sqlite", "postgresql"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where the test's results live: a new SQLite file (in a directory the store makes),
    or a new database on the session's PostgreSQL server."""
    if request.param == "postgresql":
        return request.getfixturevalue("postgres_server").new_database()
    return str(tmp_path / "idem" / "tools.db")


@pytest.fixture
def open_store(location: str) -> Iterator[Callable[..., SQLIdempotencyStore]]:
    """Open handles on the test's store (each like another process's)."""
    opened: list[SQLIdempotencyStore] = []

    def make(**kwargs: Any) -> SQLIdempotencyStore:
        store = SQLIdempotencyStore(location, **kwargs)
        opened.append(store)
        return store

    yield make
    for s in opened:
        s.close()


def test_side_effects_run_once_per_key_across_restarts(
        open_store: Callable[..., SQLIdempotencyStore]) -> None:
    registry, runs = make_registry(idempotency_store=open_store())
    with pytest.raises(RidgelineError, match="idempotency key"):
        registry.call("create_ticket", {"title": "x"}, WRITER)
    first = registry.call("create_ticket", {"title": "Disk full"}, WRITER,
                          idempotency_key="task-1:step-3")
    again = registry.call("create_ticket", {"title": "Disk full"}, WRITER,
                          idempotency_key="task-1:step-3")
    assert first.ok and not first.replayed and again.replayed
    assert again.content == first.content and runs["create_ticket"] == 1

    # a new process (new registry, same file) still knows the key
    restarted, restarted_runs = make_registry(idempotency_store=open_store())
    replay = restarted.call("create_ticket", {"title": "Disk full"}, WRITER,
                            idempotency_key="task-1:step-3")
    assert replay.replayed and replay.content == first.content
    assert restarted_runs["create_ticket"] == 0

    with pytest.raises(ConflictError) as conflict:
        restarted.call("create_ticket", {"title": "Other"}, WRITER,
                       idempotency_key="task-1:step-3")
    assert error_for(conflict.value)[0] == 409
    # keys are per tenant: another tenant's equal key is another call
    other = restarted.call("create_ticket", {"title": "Disk full"}, OTHER_TENANT,
                           idempotency_key="task-1:step-3")
    assert not other.replayed and restarted_runs["create_ticket"] == 1


def test_concurrent_calls_with_one_key_run_the_tool_once(
        open_store: Callable[..., SQLIdempotencyStore]) -> None:
    registry = ToolRegistry(idempotency_store=open_store())
    runs = []
    gate = threading.Event()

    @registry.tool(side_effects=True)
    def charge(cents: int) -> str:
        gate.wait(5)
        runs.append(cents)
        return f"charged {cents}"

    results = []

    def call() -> None:
        results.append(registry.call("charge", {"cents": 500}, READER, idempotency_key="pay-1"))

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(10)
    assert runs == [500]
    assert sorted(r.replayed for r in results) == [False] + [True] * 5
    assert {r.content for r in results} == {"charged 500"}


def record(content: str, created_at: float) -> IdempotencyRecord:
    return IdempotencyRecord(tool="charge", fingerprint="f", created_at=created_at,
                             result=ToolResult(ok=True, content=content))


def test_the_first_result_wins_and_expired_ones_give_way(
        open_store: Callable[..., SQLIdempotencyStore]) -> None:
    store, other = open_store(ttl_s=3600), open_store(ttl_s=3600)
    now = time.time()
    store.put("acme:k", record("first", now))
    other.put("acme:k", record("second", now))           # another process, same key
    assert store.get("acme:k").result.content == "first"
    assert other.get("acme:k").result.content == "first"

    store.put("acme:old", record("stale", now - 7200))   # older than the TTL
    assert store.get("acme:old") is None                 # expired: as if never stored
    other.put("acme:old", record("fresh", now))          # and replaced by the next result
    assert store.get("acme:old").result.content == "fresh"

    for i in range(5):
        store.put(f"acme:gone-{i}", record("x", now - 7200))
    assert store.db.fetchone("SELECT COUNT(*) FROM tool_idempotency") == (7,)
    purger = open_store(ttl_s=3600)                      # every 256th put purges
    for i in range(SQLIdempotencyStore._PURGE_EVERY):
        purger.put(f"acme:new-{i}", record("y", now))
    left = {k for (k,) in store.db.fetchall("SELECT key FROM tool_idempotency")}
    assert not any(k.startswith("acme:gone-") for k in left)
    assert {"acme:k", "acme:old"} <= left and len(left) == 2 + SQLIdempotencyStore._PURGE_EVERY
    assert SQLiteIdempotencyStore is SQLIdempotencyStore  # the old name still works


@pytest.mark.parametrize("how", ["store.url", "deprecated"])
def test_the_platform_keeps_keys_and_tool_results_where_configured(
        location: str, tmp_path: Path, how: str) -> None:
    """The platform's one database (`store.url`), or the deprecated `keys.path` and
    `tools_url`, as URLs (PostgreSQL, or sqlite:/// under data_dir): a key and a side
    effect's result outlive the platform that made them."""
    url = location if "://" in location else "sqlite:///shared.db"
    base = {"data_dir": str(tmp_path / "data"),
            "rag": {"embedder": "hashing", "qdrant_path": ":memory:"}}
    if how == "store.url":
        config = PlatformConfig.model_validate({**base, "store": {"url": url}})
    else:
        with pytest.warns(FutureWarning, match="store.url") as said:
            config = PlatformConfig.model_validate({**base, "keys": {"path": url},
                                                    "tools_url": url})
        assert {"keys.path", "tools_url"} <= {str(w.message).split("`")[1] for w in said}
    sent: list[str] = []

    def start() -> Platform:
        platform = Platform(config)

        @platform.tools.tool(scopes=("mail:send",), side_effects=True)
        def send_mail(to: str) -> str:
            """Send one email."""
            sent.append(to)
            return f"sent to {to}"

        return platform

    first = start()
    try:
        key, _ = first.keys.create("acme", scopes=["mail:send"])
        who = first.keys.authenticate(key).principal
        assert first.tools.call("send_mail", {"to": "a@x"}, who, idempotency_key="t1").ok
    finally:
        first.close()
    again = start()
    try:
        who = again.keys.authenticate(key).principal
        replay = again.tools.call("send_mail", {"to": "a@x"}, who, idempotency_key="t1")
        assert replay.replayed and replay.content == "sent to a@x" and sent == ["a@x"]
        dialect = "sqlite" if url.startswith("sqlite") else "postgresql"
        assert again.keys.db.dialect == dialect
        assert again.tools.idempotency_store.db.dialect == dialect
        shared = again.keys.db is again.tools.idempotency_store.db is again.store.db
        assert shared == (how == "store.url")
    finally:
        again.close()
    if url.startswith("sqlite"):
        assert (tmp_path / "data" / "shared.db").is_file()   # relative to data_dir
    with pytest.raises(ConfigError, match="tools_url"):
        PlatformConfig.load(write_yaml(tmp_path / "bad.yaml", "tools_url: mysql://u@h/t\n"))
    with pytest.raises(ConfigError, match="keys.path"):
        PlatformConfig.load(write_yaml(tmp_path / "bad.yaml", "keys: {path: 'redis://h/0'}\n"))


def write_yaml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ---- metrics and spans ------------------------------------------------------------------------


def test_prometheus_counts_outcomes_and_latency() -> None:
    prom = CollectorRegistry()
    registry, _ = make_registry(metrics_registry=prom)
    registry.call("add", {"a": 1}, READER)
    registry.call("add", {"a": 2}, READER)
    registry.call("add", {"a": "x"}, READER)
    registry.call("explode", {"reason": "r"}, READER, idempotency_key="x1")
    registry.call("explode", {"reason": "r"}, READER, idempotency_key="x1")  # a replay
    with pytest.raises(ToolPermissionError):
        registry.call("create_ticket", {"title": "t"}, READER, idempotency_key="x2")

    def value(name: str, **labels: str) -> float | None:
        return prom.get_sample_value(name, labels)

    assert value("ridgeline_tool_calls_total", tool="add", outcome="ok") == 2
    assert value("ridgeline_tool_calls_total", tool="add", outcome="error") == 1
    assert value("ridgeline_tool_calls_total", tool="explode", outcome="error") == 1
    assert value("ridgeline_tool_calls_total", tool="create_ticket", outcome="denied") == 1
    assert value("ridgeline_tool_latency_seconds_count", tool="add") == 2   # ran twice
    assert value("ridgeline_tool_latency_seconds_count", tool="explode") == 1
    assert value("ridgeline_tool_replays_total", tool="explode") == 1
    assert b'ridgeline_tool_latency_seconds_bucket{le="0.005",tool="add"}' in generate_latest(prom)

    # a second tool registry on the same Prometheus registry shares the metrics
    second, _ = make_registry(metrics_registry=prom)
    second.call("add", {"a": 1}, READER)
    assert value("ridgeline_tool_calls_total", tool="add", outcome="ok") == 3


def test_spans_follow_the_genai_conventions() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    registry, _ = make_registry(tracer=provider.get_tracer("test"))

    registry.call("add", {"a": 1}, READER, call_id="call_1")
    registry.call("explode", {"reason": "r"}, READER, idempotency_key="k", call_id="call_2")
    registry.call("add", {"a": "x"}, READER)
    with pytest.raises(ToolPermissionError):
        registry.call("create_ticket", {"title": "t"}, READER, idempotency_key="k2")

    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["execute_tool add", "execute_tool explode",
                                       "execute_tool add", "execute_tool create_ticket"]
    ok, failed, invalid, denied = spans
    assert ok.attributes["gen_ai.operation.name"] == "execute_tool"
    assert ok.attributes["gen_ai.tool.name"] == "add"
    assert ok.attributes["gen_ai.tool.call.id"] == "call_1"
    assert ok.attributes["gen_ai.tool.type"] == "function"
    assert "error.type" not in ok.attributes and ok.status.status_code is StatusCode.UNSET
    assert failed.attributes["error.type"] == "ValueError"
    assert failed.status.status_code is StatusCode.ERROR
    assert invalid.attributes["error.type"] == "invalid_arguments"
    assert denied.attributes["error.type"] == "ToolPermissionError"
