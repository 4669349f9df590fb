"""The platform's front door, attacked over real HTTP: a body is read only after the key
is checked and never past its cap (declared or chunked); RAG and memory routes need the
scopes their agent tools need; the OpenAPI schema and its pages need a key; a malformed
`Last-Event-ID` is a 400, never a 500; input file names a workspace cannot hold are
refused at submission; task lists are bounded summaries."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ridgeline.errors import SandboxError
from ridgeline.platform.config import PlatformConfig
from ridgeline.platform.principal import Principal
from ridgeline.platform.service import Platform
from ridgeline.platform.tasks_api import MAX_FILES_BYTES, MAX_PATH_BYTES
from ridgeline.sandbox import get_provider
from ridgeline.sandbox.base import SandboxSpec
from ridgeline.serve.app import ServerThread

BODY_ROUTES = ["/v1/agent/tasks", "/v1/rag/documents", "/v1/rag/search", "/v1/memory",
               "/v1/memory/search", "/v1/chat/completions", "/v1/completions"]
BIG = 200 << 20  # the size the attack declared (200 MiB)
ALL_SCOPES = ["rag:read", "rag:write", "memory:read", "memory:write"]


@pytest.fixture
def front(tmp_path: Path) -> Iterator[tuple[Platform, ServerThread, dict[str, str]]]:
    config = PlatformConfig.model_validate({
        "data_dir": str(tmp_path),
        "worker": {"sandbox": "local", "allow_replay_model": True},
        "rag": {"embedder": "hashing", "qdrant_path": ":memory:",
                "max_document_chars": 1000},
        "gateway": {"upstreams": [{"name": "none", "base_url": "http://127.0.0.1:9",
                                   "models": ["default"]}]},
    })
    platform = Platform(config)
    keys = {"full": platform.keys.create("acme", user="ann", scopes=ALL_SCOPES)[0],
            "none": platform.keys.create("acme", user="ben")[0]}
    for scope in ALL_SCOPES:
        keys[scope] = platform.keys.create("acme", user=f"only-{scope}", scopes=[scope])[0]
    server = ServerThread(platform.app(background=False)).start()  # no workers: nothing runs
    yield platform, server, keys
    server.stop()
    platform.close()


def client(server: ServerThread, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=30)


def raw_request(server: ServerThread, head: str, body: bytes = b"") -> tuple[int, bytes]:
    """Send a request head (and the start of a body) on a plain socket, read the answer
    until the server closes the connection; returns (status, everything read)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        data = b""
        while chunk := sock.recv(65536):  # ends only when the server closes
            data += chunk
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    return status, data


# -- authenticate before reading, and cap what is read -------------------------------------

@pytest.mark.parametrize("path", BODY_ROUTES)
def test_an_unauthenticated_huge_body_is_refused_before_it_is_sent(front, path: str) -> None:
    """The attack declares 200 MiB and sends 64 KiB: the server answers 401 at once and
    closes the connection. If it read bodies before checking the key it would wait for
    the other 200 MiB and `raw_request` would time out instead of returning."""
    _, server, _ = front
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {BIG}\r\n\r\n")
    status, data = raw_request(server, head, b"{" + b" " * (64 << 10))
    assert status == 401, data[:300]  # positive control: the server got the request
    assert b"www-authenticate: bearer" in data.lower()
    assert b"connection: close" in data.lower()


async def _drive(app: Any, path: str, key: str | None, chunks: int, chunk: bytes,
                 content_length: bool) -> tuple[int, int]:
    """Call the ASGI app with a body of `chunks` x `chunk` and count how many chunks the
    app pulled; returns (status, chunks read)."""
    headers = [(b"host", b"x"), (b"content-type", b"application/json")]
    if key:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    if content_length:
        headers.append((b"content-length", str(chunks * len(chunk)).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "headers": headers, "client": ("127.0.0.1", 1),
             "server": ("x", 80), "root_path": ""}
    read = 0
    status = 0

    async def receive() -> dict[str, Any]:
        nonlocal read
        if read >= chunks:
            await asyncio.sleep(3600)  # a client that never finishes its body
        read += 1
        return {"type": "http.request", "body": chunk, "more_body": read < chunks}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await asyncio.wait_for(app(scope, receive, send), timeout=60)
    return status, read


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_no_byte_of_the_body_is_read_without_a_key(front, path: str) -> None:
    platform, _, keys = front
    app = platform.app(background=False)
    chunk = b" " * (1 << 20)
    status, read = asyncio.run(_drive(app, path, None, 200, chunk, content_length=False))
    assert (status, read) == (401, 0)
    # positive control: with a key the same body is read, and refused at the route's cap
    # (what follows the cap is read and dropped within a budget, so the client gets the
    # 413 instead of a reset; nothing of it is kept)
    status, read = asyncio.run(_drive(app, path, keys["full"], 200, chunk,
                                      content_length=False))
    assert status == 413 and read >= 1


@pytest.mark.parametrize("path", BODY_ROUTES)
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_authenticated_body_over_the_cap_is_413(front, path: str, chunked: bool) -> None:
    _, server, keys = front
    size = MAX_FILES_BYTES + (2 << 20)  # over every route's cap in this config

    def body() -> Iterator[bytes]:  # a generator: httpx sends it chunked, no length
        for _ in range(size >> 20):
            yield b" " * (1 << 20)

    with client(server, keys["full"]) as c:
        r = c.post(path, content=body() if chunked else b" " * size,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text[:300]
    assert "limit" in r.json()["error"]["message"]
    assert r.headers.get("connection") == "close"


def test_a_body_within_the_cap_is_still_served(front) -> None:
    """Positive control for the caps: normal requests on every body route succeed."""
    _, server, keys = front
    with client(server, keys["full"]) as c:
        assert c.post("/v1/rag/documents", json={"id": "d", "text": "hello world"}
                      ).status_code == 200
        assert c.post("/v1/rag/search", json={"query": "hello"}).json()["data"]
        assert c.post("/v1/memory", json={"scope": "s", "text": "note"}).status_code == 200
        assert c.post("/v1/memory/search", json={"scope": "s", "query": "note"}
                      ).status_code == 200
        r = c.post("/v1/agent/tasks", json={"instruction": "x", "model": "replay",
                                            "files": {"a.txt": "a" * (1 << 20)}})
        assert r.status_code == 202, r.text


# -- RAG and memory scopes -----------------------------------------------------------------

ROUTE_SCOPES = [
    ("POST", "/v1/rag/documents", {"id": "d2", "text": "the vault code is 4711"}, "rag:write"),
    ("DELETE", "/v1/rag/documents/d1", None, "rag:write"),
    ("POST", "/v1/rag/search", {"query": "vault code"}, "rag:read"),
    ("POST", "/v1/memory", {"scope": "s", "text": "remember me"}, "memory:write"),
    ("POST", "/v1/memory/search", {"scope": "s", "query": "remember"}, "memory:read"),
]


@pytest.mark.parametrize("method, path, body, scope", ROUTE_SCOPES)
def test_rag_and_memory_routes_need_the_tools_scopes(front, method: str, path: str,
                                                     body: dict | None, scope: str) -> None:
    platform, server, keys = front
    index, memory = platform.rag()
    # d1 belongs to the user of the rag:write key, so that key may delete it
    owner = Principal(key_id="k", tenant="acme", user="only-rag:write")
    index.add(owner, index_document("d1", "the vault code is 4711", public=True))
    memory.remember(owner, "s", "remember me")

    def points() -> tuple[int, int]:
        return (index.client.count(index.collection).count,
                memory.client.count(memory.collection).count)

    before = points()
    for key in ["none", *(s for s in ALL_SCOPES if s != scope)]:
        with client(server, keys[key]) as c:
            r = c.request(method, path, json=body)
        assert r.status_code == 403, (key, r.text)
        error = r.json()["error"]
        assert scope in error["message"] and error["code"] == "insufficient_scope"
    assert points() == before  # nothing was added or deleted
    # positive control: the scope the tool needs opens the route
    with client(server, keys[scope]) as c:
        r = c.request(method, path, json=body)
    assert r.status_code == 200, r.text


def index_document(doc_id: str, text: str, public: bool = False) -> Any:
    from ridgeline.platform.rag import Acl, Document
    return Document(id=doc_id, text=text, acl=Acl(public=public))


def test_the_search_documents_tool_and_the_route_agree(front) -> None:
    platform, _, _ = front
    tool = platform.tools.get("search_documents")
    recall, remember = platform.tools.get("recall"), platform.tools.get("remember")
    assert (tuple(tool.scopes), tuple(recall.scopes), tuple(remember.scopes)) == (
        ("rag:read",), ("memory:read",), ("memory:write",))


# -- the schema and its pages ---------------------------------------------------------------

@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc"])
def test_the_schema_and_docs_need_a_key(front, path: str) -> None:
    _, server, keys = front
    with client(server, None) as c:
        r = c.get(path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert "/v1/agent/tasks" not in r.text
    with client(server, keys["none"]) as c:  # positive control: a key of any scope
        r = c.get(path)
        assert r.status_code == 200
    if path == "/openapi.json":
        assert "/v1/agent/tasks" in r.json()["paths"]


# -- Last-Event-ID ---------------------------------------------------------------------------

@pytest.mark.parametrize("value, fragment", [
    (str(2**63), "out of range"), (str(2**64 + 5), "out of range"), ("9" * 5000, "out of range"),
    ("-1", ">= 0"), ("abc", "not an event id"), ("1_000", "not an event id"),
    ("+7", "not an event id"), ("1e3", "not an event id"),
])
def test_a_bad_last_event_id_is_a_400(front, value: str, fragment: str) -> None:
    _, server, keys = front
    with client(server, keys["none"]) as c:
        tid = c.post("/v1/agent/tasks", json={"instruction": "x"}).json()["id"]
        r = c.get(f"/v1/agent/tasks/{tid}/events", headers={"Last-Event-ID": value})
        assert r.status_code == 400, r.text
        assert fragment in r.json()["error"]["message"]
        # positive control: the largest id is accepted; the stream (of a task that has
        # ended, so it closes) has nothing after it
        assert c.post(f"/v1/agent/tasks/{tid}/cancel").status_code == 200
        r = c.get(f"/v1/agent/tasks/{tid}/events", headers={"Last-Event-ID": str(2**63 - 1)})
        assert (r.status_code, r.text) == (200, "")
        assert "task.cancelled" in c.get(f"/v1/agent/tasks/{tid}/events").text


def test_a_huge_after_parameter_is_a_400(front) -> None:
    _, server, keys = front
    with client(server, keys["none"]) as c:
        tid = c.post("/v1/agent/tasks", json={"instruction": "x"}).json()["id"]
        r = c.get(f"/v1/agent/tasks/{tid}/events?after={2**63}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "after"


# -- input file names ------------------------------------------------------------------------

@pytest.mark.parametrize("files, fragment", [
    ({"../x": "x"}, "'..'"),
    ({"a/../../x": "x"}, "'..'"),
    ({"/etc/passwd": "x"}, "absolute"),
    ({"/proc/self/mem": "x"}, "absolute"),
    ({"a\0b": "x"}, "NUL"),
    ({".": "x"}, "'.'"),
    ({"./a": "x"}, "'.'"),
    ({"": "x"}, "empty"),
    ({"a//b": "x"}, "empty"),
    ({"dir/": "x"}, "empty"),
    ({"n" * 256: "x"}, "over 255 bytes"),
    ({"\u00e9" * 128: "x"}, "over 255 bytes"),          # 128 characters, 256 bytes
    ({"/".join(["d" * 200] * 6): "x"}, f"over the limit of {MAX_PATH_BYTES}"),
    ({"a": "x", "a/b": "y"}, "also a directory"),      # a file and a directory at once
    ({"src/a/b.py": "x", "src/a": "y"}, "also a directory"),
    ({"a.txt": "\ud800"}, "invalid JSON"),        # lone surrogates: not UTF-8 text
    ({"\udc80.txt": "x"}, "invalid JSON"),
    ({f"f{i}": "" for i in range(10_001)}, "over the limit of 10000"),
])
def test_unwritable_input_file_names_are_refused_at_submission(front, files: dict,
                                                              fragment: str) -> None:
    platform, server, keys = front
    # JSON with ensure_ascii keeps lone surrogates as \\u escapes, as an attacker would send
    body = {"instruction": "x", "model": "replay", "files": files}
    with client(server, keys["none"]) as c:
        r = c.post("/v1/agent/tasks", content=json.dumps(body).encode(),
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert fragment in error["message"], error
    assert error["param"] == (None if fragment == "invalid JSON" else "files")
    assert sum(platform.store.counts().values()) == 0  # nothing stored, nothing to retry
    assert sum(platform.queue.depth().values()) == 0


@pytest.mark.parametrize("files", [{"n" * 256: "x"}, {".": "x"}, {"a": "x", "a/b": "y"},
                                   {"../x": "x"}, {"/proc/self/mem": "x"}])
def test_the_refused_names_would_fail_in_the_worker(files: dict) -> None:
    """Positive control: what submission refuses is what a worker's sandbox cannot write
    (before, such a task was accepted and each attempt failed as an infrastructure error)."""
    with pytest.warns(RuntimeWarning, match="NO ISOLATION"):
        sandbox = get_provider("local").create(SandboxSpec())
    try:
        with pytest.raises((OSError, SandboxError)):
            for path, content in files.items():
                sandbox.write_file(path, content)
    finally:
        sandbox.close()


def test_every_accepted_file_name_is_written_by_a_worker(front) -> None:
    """Positive control for the rules above: names at the limits, in directories, with
    spaces, dots and non-ASCII, are accepted and a real worker writes every one."""
    platform, server, keys = front
    files = {"n" * 255: "1", "\u00e9" * 127 + "x": "2", "a b/c.d/.hidden": "3",
             "src/a/b.py": "4", "src/a/c.py": "5", "..data": "6", "x/" * 100 + "deep": "7"}
    with client(server, keys["none"]) as c:
        r = c.post("/v1/agent/tasks", json={"instruction": "x", "model": "replay",
                                            "files": files,
                                            "replay": ["<finish>done</finish>"]})
        assert r.status_code == 202, r.text
        tid = r.json()["id"]
    job = platform.queue.lease("w", lease_s=60)
    assert job is not None and job.id == tid
    platform.worker("w").process(job)
    task = platform.store.get(tid)
    assert task.status.value == "completed", task.error
    workspace = platform.store.load_checkpoint(tid).workspace
    with tarfile.open(fileobj=io.BytesIO(workspace)) as tar:
        names = {m.name.removeprefix("./") for m in tar.getmembers() if m.isfile()}
    assert set(files) <= names


# -- lists are summaries ---------------------------------------------------------------------

def test_task_lists_are_bounded_summaries(front) -> None:
    _, server, keys = front
    files = {f"f{i}.txt": "z" * (1 << 20) for i in range(6)}  # 6 MiB of input per task
    instruction = "do it " * 1000
    with client(server, keys["none"]) as c:
        ids = [c.post("/v1/agent/tasks", json={"instruction": instruction, "files": files,
                                               "metadata": {"run": str(i)}}).json()["id"]
               for i in range(4)]
        r = c.get("/v1/agent/tasks")
        assert r.status_code == 200
        assert len(r.content) < 8 << 10  # 4 tasks, 24 MiB of requests: a few KiB listed
        data = r.json()["data"]
        assert [t["id"] for t in data] == ids[::-1]
        first = data[0]
        assert set(first) == {"id", "object", "kind", "status", "created_at", "updated_at",
                              "attempts", "parent_id", "instruction", "instruction_chars",
                              "model", "node_id", "files", "tools", "metadata", "error"}
        assert first["object"] == "agent.task.summary" and first["status"] == "queued"
        assert first["instruction"] == instruction[:200]
        assert first["instruction_chars"] == len(instruction)
        assert (first["files"], first["tools"], first["metadata"]) == (6, 0, 1)
        # positive control: the single-task route has the whole request
        one = c.get(f"/v1/agent/tasks/{ids[0]}")
        assert len(one.content) > 6 << 20
        assert one.json()["request"]["files"] == files
