"""The RAG and memory router in a real FastAPI app: the caller comes from the API key
(a header), never from the body; user mistakes get OpenAI-style 4xx bodies."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from qdrant_client import QdrantClient

from ridgeline.errors import AuthenticationError, RidgelineError
from ridgeline.platform.embeddings import HashingEmbedder
from ridgeline.platform.principal import Principal
from ridgeline.platform.rag import AgentMemory, DocumentIndex
from ridgeline.platform.rag_api import rag_router

ALL = frozenset({"rag:read", "rag:write", "memory:read", "memory:write"})
KEYS = {
    "sk-alice": Principal("k-alice", "acme", "alice", frozenset({"eng"}), ALL),
    "sk-bob": Principal("k-bob", "acme", "bob", scopes=ALL),
    "sk-globex": Principal("k-globex", "globex", "alice", frozenset({"eng"}), ALL),
    "sk-none": Principal("k-none", "acme", "nobody", frozenset({"eng"})),
    "sk-admin": Principal("k-admin", "acme", "root", admin=True),
}
TEXT = "To restart the gateway, drain its connections, stop the service and start it again."


def principal_from_key(authorization: str | None = Header(default=None)) -> Principal:
    key = (authorization or "").removeprefix("Bearer ")
    if key not in KEYS:
        raise AuthenticationError("missing or unknown API key", hint="send Authorization: "
                                  "Bearer <key>")
    return KEYS[key]


@pytest.fixture
def http() -> Iterator[TestClient]:
    index = DocumentIndex(QdrantClient(location=":memory:"), HashingEmbedder(), chunk_size=200,
                          chunk_overlap=40, max_k=20)
    memory = AgentMemory(index, max_text_chars=1000)
    app = FastAPI()
    app.include_router(rag_router(index, memory, principal_from_key))
    with TestClient(app) as client:
        yield client
    index.close()


def as_(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def search(http: TestClient, key: str, body: dict) -> list[dict]:
    r = http.post("/v1/rag/search", json=body, headers=as_(key))
    assert r.status_code == 200, r.text
    return r.json()["data"]


def error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_add_search_delete(http: TestClient) -> None:
    r = http.post("/v1/rag/documents", headers=as_("sk-alice"), json={
        "id": "docs/guide.md", "text": TEXT, "metadata": {"lang": "en"},
        "acl": {"public": True}})
    assert r.status_code == 200, r.text
    assert r.json() == {"object": "rag.document", "id": "docs/guide.md", "chunks": 1,
                        "replaced": False}
    [hit] = search(http, "sk-bob", {"query": "restart the gateway", "k": 3})
    assert (hit["object"], hit["doc_id"], hit["chunk"], hit["text"], hit["metadata"]) == (
        "rag.chunk", "docs/guide.md", 0, TEXT, {"lang": "en"})
    assert 0 < hit["score"] <= 1 and (hit["start"], hit["end"]) == (0, len(TEXT))
    assert search(http, "sk-bob", {"query": "gateway", "filter": {"lang": "de"}}) == []

    err = error(http.delete("/v1/rag/documents/docs/guide.md", headers=as_("sk-bob")), 404)
    assert err["type"] == "not_found_error"
    r = http.delete("/v1/rag/documents/docs/guide.md", headers=as_("sk-alice"))
    assert r.status_code == 200 and r.json() == {"object": "rag.document.deleted",
                                                 "id": "docs/guide.md", "deleted": True,
                                                 "chunks": 1}
    assert search(http, "sk-bob", {"query": "restart the gateway"}) == []
    error(http.delete("/v1/rag/documents/docs/guide.md", headers=as_("sk-alice")), 404)


def test_a_tenant_in_the_body_is_ignored(http: TestClient) -> None:
    # acme's document, sent with a body that names another tenant and user
    r = http.post("/v1/rag/documents", headers=as_("sk-alice"), json={
        "id": "d", "text": TEXT, "tenant": "globex", "owner": "mallory",
        "acl": {"public": True, "tenant": "globex"}})
    assert r.status_code == 200, r.text
    assert search(http, "sk-globex", {"query": TEXT, "tenant": "acme", "user": "alice"}) == []
    assert [h["doc_id"] for h in search(http, "sk-bob", {"query": TEXT})] == ["d"]
    # globex's own copy with identical text stays globex's
    http.post("/v1/rag/documents", headers=as_("sk-globex"), json={"id": "d", "text": TEXT})
    assert len(search(http, "sk-globex", {"query": TEXT, "k": 10})) == 1
    assert len(search(http, "sk-alice", {"query": TEXT, "k": 10})) == 1
    err = error(http.post("/v1/rag/search", headers=as_("sk-globex"),
                          json={"query": TEXT, "filter": {"tenant": "acme"}}), 400)
    assert err["param"] == "filter.tenant" and "decided by the server" in err["message"]


def test_selective_acl_over_http(http: TestClient) -> None:
    for i in range(40):
        mine = i % 8 == 0
        http.post("/v1/rag/documents", headers=as_("sk-bob"), json={
            "id": f"d{i}", "text": f"gateway restart {i}" if mine else "gateway restart " * 3,
            "acl": {"users": ["alice"]} if mine else {"users": ["carol"]}})
    hits = search(http, "sk-alice", {"query": "gateway restart", "k": 5})
    assert sorted(h["doc_id"] for h in hits) == ["d0", "d16", "d24", "d32", "d8"]


def test_unknown_key_is_401(http: TestClient) -> None:
    for headers in ({}, as_("sk-nobody")):
        err = error(http.post("/v1/rag/search", json={"query": "x"}, headers=headers), 401)
        assert err["type"] == "authentication_error" and "API key" in err["message"]


def test_re_adding_another_users_document_is_409(http: TestClient) -> None:
    http.post("/v1/rag/documents", headers=as_("sk-alice"), json={"id": "d", "text": TEXT})
    err = error(http.post("/v1/rag/documents", headers=as_("sk-bob"),
                          json={"id": "d", "text": "mine now"}), 409)
    assert "taken" in err["message"]
    r = http.post("/v1/rag/documents", headers=as_("sk-alice"), json={"id": "d", "text": "v2"})
    assert r.json()["replaced"] is True


@pytest.mark.parametrize("path,body,param,code", [
    ("/v1/rag/search", {"k": 3}, "query", "missing_required_parameter"),
    ("/v1/rag/search", {"query": "x", "k": "many"}, "k", "invalid_value"),
    ("/v1/rag/search", {"query": "x", "k": 0}, "k", "invalid_value"),
    ("/v1/rag/search", {"query": "x", "k": 21}, "k", "invalid_value"),
    ("/v1/rag/search", {"query": "   "}, "query", "invalid_value"),
    ("/v1/rag/search", {"query": "x", "filter": {"acl_users": "bob"}}, "filter.acl_users",
     "invalid_value"),
    ("/v1/rag/search", {"query": "x", "filter": {"lang": {"$ne": 1}}}, "filter.lang",
     "invalid_value"),
    ("/v1/rag/search", {"query": "x", "filter": "lang=en"}, "filter", "invalid_value"),
    ("/v1/rag/search", ["query"], None, "invalid_value"),
    ("/v1/rag/documents", {"text": TEXT}, "id", "missing_required_parameter"),
    ("/v1/rag/documents", {"id": "", "text": TEXT}, "id", "invalid_value"),
    ("/v1/rag/documents", {"id": "d", "text": " "}, "text", "invalid_value"),
    ("/v1/rag/documents", {"id": "d", "text": TEXT, "acl": {"public": "maybe"}}, "acl.public",
     "invalid_value"),
    ("/v1/rag/documents", {"id": "d", "text": TEXT, "metadata": [1]}, "metadata",
     "invalid_value"),
    ("/v1/memory", {"text": "x"}, "scope", "missing_required_parameter"),
    ("/v1/memory", {"scope": "", "text": "x"}, "scope", "invalid_value"),
    ("/v1/memory/search", {"scope": "s", "query": "x", "k": -1}, "k", "invalid_value"),
])
def test_malformed_requests_are_400(http: TestClient, path: str, body: object,
                                    param: str | None, code: str) -> None:
    err = error(http.post(path, json=body, headers=as_("sk-alice")), 400)
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code)
    assert err["message"]


def test_invalid_json_is_400(http: TestClient) -> None:
    r = http.post("/v1/rag/search", content=b'{"query": ', headers={
        **as_("sk-alice"), "Content-Type": "application/json"})
    assert error(r, 400)["code"] == "invalid_json"


def test_too_large_is_413(http: TestClient) -> None:
    err = error(http.post("/v1/memory", headers=as_("sk-alice"),
                          json={"scope": "s", "text": "x" * 1001}), 413)
    assert "limit" in err["message"]


def test_memory_endpoints(http: TestClient) -> None:
    r = http.post("/v1/memory", headers=as_("sk-alice"), json={
        "scope": "task-7", "text": "The user prefers tabs over spaces.",
        "metadata": {"step": 2}, "tenant": "globex", "user": "bob"})
    assert r.status_code == 200, r.text
    memory_id = r.json()["id"]
    assert r.json() == {"object": "memory", "id": memory_id, "scope": "task-7"}
    http.post("/v1/memory", headers=as_("sk-alice"), json={"scope": "task-7",
                                                          "text": "Tests run with pytest."})

    def recall(key: str, scope: str = "task-7") -> list[dict]:
        r = http.post("/v1/memory/search", headers=as_(key),
                      json={"scope": scope, "query": "tabs or spaces", "k": 1})
        assert r.status_code == 200, r.text
        return r.json()["data"]

    [hit] = recall("sk-alice")
    assert (hit["id"], hit["text"], hit["metadata"]) == (
        memory_id, "The user prefers tabs over spaces.", {"step": 2})
    assert recall("sk-bob") == [] and recall("sk-globex") == []
    assert recall("sk-alice", scope="task-8") == []


def test_an_apps_own_error_handler_answers() -> None:
    index = DocumentIndex(QdrantClient(location=":memory:"), HashingEmbedder())
    app = FastAPI()

    @app.exception_handler(RidgelineError)
    async def _mine(_: Request, exc: RidgelineError) -> JSONResponse:
        return JSONResponse({"error": {"message": str(exc)}}, status_code=exc.http_status,
                            headers={"x-handled-by": "app"})

    app.include_router(rag_router(index, AgentMemory(index), principal_from_key))
    with TestClient(app) as http:
        r = http.post("/v1/rag/search", json={"query": "x"})
        assert (r.status_code, r.headers.get("x-handled-by")) == (401, "app")
        r = http.delete("/v1/rag/documents/nope", headers=as_("sk-alice"))
        assert (r.status_code, r.headers.get("x-handled-by")) == (404, "app")
        # a malformed body is still answered by the router, in the OpenAI shape
        assert error(http.post("/v1/rag/search", json={}, headers=as_("sk-alice")),
                     400)["param"] == "query"
    index.close()
