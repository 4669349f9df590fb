"""REST tools from an OpenAPI spec, against a real FastAPI app served by uvicorn on
loopback and loaded from its own /openapi.json."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any, Iterator

import httpx
import jsonschema
import pytest
import yaml
from fastapi import FastAPI, Header, HTTPException, Response
from pydantic import BaseModel

from ridgeline.errors import ConfigError, NotFoundError
from ridgeline.platform.openapi_tools import load_openapi_tools
from ridgeline.platform.principal import Principal
from ridgeline.platform.tools import ToolRegistry
from ridgeline.platform.urls import UnsafeURLError
from ridgeline.serve.app import ServerThread

READER = Principal(key_id="r", tenant="acme", scopes=frozenset({"tools:read"}))
WRITER = Principal(key_id="w", tenant="acme", scopes=frozenset({"tools:read", "tools:write"}))
OTHER = Principal(key_id="o", tenant="globex", scopes=frozenset({"tools:read", "tools:write"}))
TOKEN = "Bearer s3cret"


class Item(BaseModel):
    name: str
    price: float
    tags: list[str] = []
    note: str | None = None


class Backend:
    """The REST API the tools wrap, and what it saw."""

    def __init__(self) -> None:
        self.items: dict[int, dict[str, Any]] = {}
        self.posts: list[dict[str, Any]] = []
        self.app = app = FastAPI(title="inventory")

        @app.get("/items/{item_id}", operation_id="get_item", summary="Read one item")
        def get_item(item_id: int, verbose: bool = False,
                     x_trace: Annotated[str | None, Header()] = None,
                     authorization: Annotated[str | None, Header()] = None) -> dict[str, Any]:
            if authorization != TOKEN:
                raise HTTPException(401, "bad token")
            if item_id not in self.items:
                raise HTTPException(404, f"no item {item_id}")
            return {"item": self.items[item_id], "verbose": verbose, "trace": x_trace}

        @app.post("/items", operation_id="create.item", status_code=201,
                  description="Adds an item to the inventory.")
        def create_item(item: Item, idempotency_key: Annotated[str | None, Header()] = None,
                        authorization: Annotated[str | None, Header()] = None) -> dict[str, Any]:
            if authorization != TOKEN:
                raise HTTPException(401, "bad token")
            item_id = len(self.items) + 1
            self.items[item_id] = item.model_dump()
            self.posts.append({"item": item.model_dump(), "key": idempotency_key})
            return {"id": item_id}

        @app.get("/files/{name}", operation_id="read_file")
        def read_file(name: str) -> dict[str, str]:
            return {"name": name}

        @app.get("/logo", operation_id="logo")
        def logo() -> Response:
            return Response(b"\x89PNG\r\n\x1a\n" + bytes(100), media_type="image/png")

        @app.get("/slow", operation_id="slow")
        async def slow() -> dict[str, str]:
            await asyncio.sleep(1.5)
            return {"done": "yes"}


@pytest.fixture(scope="module")
def backend() -> Iterator[tuple[Backend, ServerThread, dict[str, Any]]]:
    api = Backend()
    with ServerThread(api.app) as server:
        spec = httpx.get(server.url + "/openapi.json").json()
        yield api, server, spec


@pytest.fixture
def registry(backend: tuple[Backend, ServerThread, dict[str, Any]]) -> ToolRegistry:
    _, server, spec = backend
    registry = ToolRegistry()
    for tool in load_openapi_tools(spec, server.url, auth_headers={"Authorization": TOKEN},
                                   allow_private=True, timeout_s=0.5):
        registry.add(tool)
    return registry


def test_one_tool_per_operation_with_scopes_and_strict_schemas(registry: ToolRegistry) -> None:
    tools = {t.name: t for t in registry.tools_for(None)}
    assert set(tools) == {"get_item", "create_item", "read_file", "logo", "slow"}
    get_item, create = tools["get_item"], tools["create_item"]
    assert (get_item.scopes, get_item.side_effects) == (("tools:read",), False)
    assert (create.scopes, create.side_effects) == (("tools:write",), True)
    assert get_item.description == "GET /items/{item_id}: Read one item."
    assert create.description == "POST /items: Create Item. Adds an item to the inventory."
    # credentials and headers the tool sets itself are never arguments
    assert set(get_item.parameters["properties"]) == {"item_id", "verbose", "x-trace"}
    assert set(create.parameters["properties"]) == {"body"}
    assert get_item.parameters["required"] == ["item_id"]
    for tool in registry.openai_tools(WRITER):
        fn = tool["function"]
        assert fn["strict"] is True, fn["name"]
        jsonschema.Draft202012Validator.check_schema(fn["parameters"])
    body = create.openai_tool()["function"]["parameters"]["properties"]["body"]
    assert body["additionalProperties"] is False
    assert body["required"] == ["name", "price", "tags", "note"]
    assert [t["function"]["name"] for t in registry.openai_tools(READER)] == \
        ["get_item", "read_file", "logo", "slow"]


def test_calls_send_path_query_headers_body_and_credentials(
        registry: ToolRegistry, backend: tuple[Backend, ServerThread, dict[str, Any]]) -> None:
    api, _, _ = backend
    created = registry.call("create_item",
                            {"body": {"name": "bolt", "price": 0.25, "tags": None,
                                      "note": None}},
                            WRITER, idempotency_key="task-1:step-1")
    assert created.ok, created.error
    status, body = created.content.split("\n", 1)
    assert status == "HTTP 201 Created"
    item_id = json.loads(body)["id"]
    assert api.items[item_id] == {"name": "bolt", "price": 0.25, "tags": [], "note": None}

    got = registry.call("get_item", {"item_id": item_id, "verbose": True, "x-trace": "t-9"},
                        READER)
    assert got.ok, got.error
    assert json.loads(got.content.split("\n", 1)[1]) == {
        "item": api.items[item_id], "verbose": True, "trace": "t-9"}

    missing = registry.call("get_item", {"item_id": 999_999}, READER)
    assert not missing.ok and missing.error == "HTTP 404 Not Found"
    assert missing.error_type == "404" and "no item 999999" in missing.content


def test_a_repeated_side_effect_is_replayed_not_resent(
        registry: ToolRegistry, backend: tuple[Backend, ServerThread, dict[str, Any]]) -> None:
    api, _, _ = backend
    before = len(api.posts)
    args = {"body": {"name": "nut", "price": 0.1}}
    first = registry.call("create_item", args, WRITER, idempotency_key="task-2:step-4")
    again = registry.call("create_item", args, WRITER, idempotency_key="task-2:step-4")
    assert first.ok and again.replayed and again.content == first.content
    assert len(api.posts) == before + 1
    # the API gets an Idempotency-Key too, derived from the tenant and the key
    other = registry.call("create_item", args, OTHER, idempotency_key="task-2:step-4")
    assert other.ok and not other.replayed
    keys = [p["key"] for p in api.posts[-2:]]
    assert all(keys) and keys[0] != keys[1] and "task-2" not in keys[0]


def test_arguments_are_checked_before_any_request(
        registry: ToolRegistry, backend: tuple[Backend, ServerThread, dict[str, Any]]) -> None:
    api, _, _ = backend
    before = len(api.posts)
    bad = registry.call("create_item", {"body": {"name": "x", "price": "cheap"}}, WRITER,
                        idempotency_key="bad-1")
    assert not bad.ok and bad.error_type == "invalid_arguments"
    assert "body.price" in bad.error
    unknown = registry.call("get_item", {"item_id": 1, "admin": True}, READER)
    assert not unknown.ok and "admin" in unknown.error
    assert len(api.posts) == before


def test_path_values_cannot_walk_the_url(registry: ToolRegistry) -> None:
    for name in ("..", "a b", "x?y=1"):
        result = registry.call("read_file", {"name": name}, READER)
        assert result.ok, result.error
        assert json.loads(result.content.split("\n", 1)[1]) == {"name": name}


def test_binary_answers_are_described_not_dumped(registry: ToolRegistry) -> None:
    result = registry.call("logo", {}, READER)
    assert result.ok and result.content == "HTTP 200 OK\n[image/png content, 108 bytes]"


def test_a_slow_api_times_out_as_a_failed_result(registry: ToolRegistry) -> None:
    result = registry.call("slow", {}, READER)
    assert not result.ok and result.error_type == "timeout" and "timed out" in result.error


def test_base_urls_are_checked(backend: tuple[Backend, ServerThread, dict[str, Any]]) -> None:
    _, server, spec = backend
    with pytest.raises(UnsafeURLError):
        load_openapi_tools(spec, server.url)  # loopback without allow_private
    with pytest.raises(UnsafeURLError):
        load_openapi_tools(spec, "http://169.254.169.254/latest", allow_private=True)
    with pytest.raises(UnsafeURLError):
        load_openapi_tools(spec, "file:///etc/passwd", allow_private=True)


SPEC_30 = {
    "openapi": "3.0.3",
    "info": {"title": "pets", "version": "1"},
    "paths": {
        "/pets/{petId}": {
            "parameters": [{"$ref": "#/components/parameters/PetId"}],
            "put": {
                "summary": "Replace a pet",
                "parameters": [{"name": "dry_run", "in": "query",
                                "schema": {"type": "boolean", "nullable": True}},
                               {"name": "session", "in": "cookie",
                                "schema": {"type": "string"}}],
                "requestBody": {"required": True, "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/Pet"}}}},
            },
        },
        "/upload": {"post": {"operationId": "upload", "requestBody": {"required": True,
                    "content": {"application/octet-stream": {"schema": {"type": "string"}}}}}},
    },
    "components": {
        "parameters": {"PetId": {"name": "petId", "in": "path", "required": True,
                                 "description": "the pet", "schema": {"type": "integer"}}},
        "schemas": {"Pet": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "exclusiveMinimum": True},
            "parent": {"$ref": "#/components/schemas/Pet"}}}},
    },
}


def test_an_openapi_30_yaml_file(tmp_path) -> None:
    path = tmp_path / "pets.yaml"
    path.write_text(yaml.safe_dump(SPEC_30))
    tools = load_openapi_tools(path, "http://127.0.0.1:9", allow_private=True)
    assert [t.name for t in tools] == ["put_pets_petId"]  # the binary upload is left out
    params = tools[0].parameters
    assert params["required"] == ["petId", "body"]
    assert params["properties"]["petId"] == {"type": "integer", "description": "the pet"}
    assert params["properties"]["dry_run"]["type"] == ["boolean", "null"]
    assert "session" not in params["properties"]
    pet = params["properties"]["body"]
    assert pet["properties"]["age"] == {"type": "integer", "exclusiveMinimum": 0}
    assert pet["properties"]["parent"] == {"$ref": "#/$defs/Pet"}  # recursive: kept
    jsonschema.validate({"petId": 1, "body": {"name": "Rex", "parent": {"name": "Old"}}},
                        params)
    fn = tools[0].openai_tool()["function"]
    assert fn["strict"] is True and "Pet" in fn["parameters"]["$defs"]


def test_unusable_specs_are_refused(tmp_path) -> None:
    with pytest.raises(NotFoundError):
        load_openapi_tools(tmp_path / "missing.json", "http://127.0.0.1:9", allow_private=True)
    with pytest.raises(ConfigError, match="not supported"):
        load_openapi_tools({"swagger": "2.0", "paths": {}}, "http://127.0.0.1:9",
                           allow_private=True)
    only_upload = {**SPEC_30, "paths": {"/upload": SPEC_30["paths"]["/upload"]}}
    with pytest.raises(ConfigError, match="no operation"):
        load_openapi_tools(only_upload, "http://127.0.0.1:9", allow_private=True)
