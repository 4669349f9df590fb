"""Permission-isolated RAG and agent memory over Qdrant, with the hashing embedder.

Every isolation test runs on Qdrant's local mode in memory and on disk, and also on a
Qdrant server when RIDGELINE_QDRANT_URL names one (marked `service`; the same client calls
go over HTTP then). No registry this project installs from ships a Qdrant server binary,
so that run needs a server started by hand."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from qdrant_client import QdrantClient
from qdrant_client import models as qm

from ridgeline.config import load_model
from ridgeline.errors import ConfigError, ConflictError, NotFoundError, PayloadTooLargeError
from ridgeline.platform.embeddings import HashingEmbedder
from ridgeline.platform.principal import Principal
from ridgeline.platform.rag import (
    Acl, AgentMemory, Document, DocumentIndex, RagConfig, RagRequestError, open_index,
    open_memory, tenant_condition,
)

ALICE = Principal("k-alice", "acme", "alice", frozenset({"eng"}))
BOB = Principal("k-bob", "acme", "bob", frozenset({"sales"}))
CAROL = Principal("k-carol", "acme", "carol")
ACME_ADMIN = Principal("k-root", "acme", "root", admin=True)
# the same user and group names in another tenant
GLOBEX_ALICE = Principal("k-galice", "globex", "alice", frozenset({"eng"}))
GLOBEX_ADMIN = Principal("k-groot", "globex", "root", admin=True)
SERVICE = Principal("k-svc", "acme")            # a key without a user

SERVER_URL = os.environ.get("RIDGELINE_QDRANT_URL")


BACKENDS = ["memory", "disk"] + (
    [pytest.param("server", marks=pytest.mark.service)] if SERVER_URL else [])


@pytest.fixture(params=BACKENDS)
def client(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[QdrantClient]:
    if request.param == "memory":
        c = QdrantClient(location=":memory:")
    elif request.param == "disk":
        c = QdrantClient(path=str(tmp_path / "qdrant"), force_disable_check_same_thread=True)
    else:
        c = QdrantClient(url=SERVER_URL, check_compatibility=False)
    names = {col.name for col in c.get_collections().collections}
    yield c
    for col in c.get_collections().collections:      # a server outlives the test
        if col.name not in names:
            c.delete_collection(col.name)
    c.close()


@pytest.fixture
def index(client: QdrantClient) -> DocumentIndex:
    return DocumentIndex(client, HashingEmbedder(), collection=f"docs_{uuid.uuid4().hex[:8]}",
                         chunk_size=200, chunk_overlap=40)


@pytest.fixture
def memory(index: DocumentIndex) -> AgentMemory:
    return AgentMemory(index, collection=f"mem_{uuid.uuid4().hex[:8]}")


def ids(hits: list) -> list[str]:
    return [h.doc_id for h in hits]


def chunk_count(index: DocumentIndex, tenant: str, doc_id: str) -> int:
    return index.client.count(index.collection, exact=True, count_filter=qm.Filter(must=[
        qm.FieldCondition(key="tenant", match=qm.MatchValue(value=tenant)),
        qm.FieldCondition(key="doc_id", match=qm.MatchValue(value=doc_id))])).count


RUNBOOK = "To restart the gateway, drain its connections, stop the service and start it again."


# ---- tenants ---------------------------------------------------------------------------------


def test_cross_tenant_search_returns_nothing(index: DocumentIndex) -> None:
    index.add(ALICE, Document(id="runbook", text=RUNBOOK, acl=Acl(public=True)))
    assert ids(index.search(RUNBOOK, ALICE)) == ["runbook"]
    # identical text, the same user and group names, an admin: another tenant sees nothing
    for other in (GLOBEX_ALICE, GLOBEX_ADMIN):
        assert index.search(RUNBOOK, other, k=10) == []
    # a tenant in the document's metadata or a filter cannot move it or widen a search
    index.add(GLOBEX_ALICE, Document(id="runbook", text=RUNBOOK,
                                     metadata={"tenant": "acme"}, acl=Acl(public=True)))
    assert [h.metadata for h in index.search(RUNBOOK, ALICE, k=10)] == [{}]
    assert [h.metadata for h in index.search(RUNBOOK, GLOBEX_ALICE, k=10)] == [
        {"tenant": "acme"}]
    with pytest.raises(RagRequestError, match="may not name 'tenant'"):
        index.search(RUNBOOK, GLOBEX_ALICE, filter={"tenant": "acme"})


def test_same_document_id_in_two_tenants_is_two_documents(index: DocumentIndex) -> None:
    index.add(ALICE, Document(id="notes", text="acme notes about the gateway"))
    index.add(GLOBEX_ALICE, Document(id="notes", text="globex notes about billing"))
    assert [h.text for h in index.search("notes", ALICE)] == ["acme notes about the gateway"]
    assert [h.text for h in index.search("notes", GLOBEX_ALICE)] == [
        "globex notes about billing"]
    index.delete(GLOBEX_ALICE, "notes")
    assert ids(index.search("notes", ALICE)) == ["notes"]


# ---- ACLs ------------------------------------------------------------------------------------


def test_selective_acl_still_returns_a_full_top_k(index: DocumentIndex) -> None:
    query = "gateway restart procedure"
    visible = {f"alice-{i}" for i in range(10)}
    for i in range(190):        # the nearest documents, none of them Alice's to read
        index.add(CAROL, Document(id=f"decoy-{i}", text=f"{query} {query} step {i}",
                                  acl=Acl(users=["bob"])))
    for doc_id in sorted(visible):
        index.add(CAROL, Document(id=doc_id, text=f"{doc_id} mentions the gateway once",
                                  acl=Acl(users=["alice"])))

    hits = index.search(query, ALICE, k=5)
    assert len(hits) == 5 and set(ids(hits)) <= visible
    assert hits == sorted(hits, key=lambda h: -h.score)

    # the same search without the ACL inside it, filtered afterwards, finds none of them
    vector = index.embedder.embed([query])[0]
    top = index.client.query_points(index.collection, query=vector, limit=5,
                                    query_filter=qm.Filter(must=[tenant_condition(ALICE)]))
    assert len(top.points) == 5
    post_filtered = [p for p in top.points if p.payload["doc_id"] in visible]
    assert len(post_filtered) < len(hits)
    # Bob reads the decoys, Carol (their owner) all 200
    assert all(d.startswith("decoy-") for d in ids(index.search(query, BOB, k=5)))
    assert len(index.search(query, CAROL, k=50)) == 50


def test_default_acl_is_the_writer_only(index: DocumentIndex) -> None:
    index.add(ALICE, Document(id="draft", text=RUNBOOK))
    assert ids(index.search(RUNBOOK, ALICE)) == ["draft"]
    assert index.search(RUNBOOK, BOB) == [] and index.search(RUNBOOK, CAROL) == []
    # an admin is confined to the documents it may read too
    assert index.search(RUNBOOK, ACME_ADMIN) == []
    # a key without a user is its own identity
    index.add(SERVICE, Document(id="svc", text=RUNBOOK))
    assert ids(index.search(RUNBOOK, SERVICE)) == ["svc"]
    assert ids(index.search(RUNBOOK, ALICE)) == ["draft"]


def test_group_acl(index: DocumentIndex) -> None:
    index.add(CAROL, Document(id="eng-only", text=RUNBOOK, acl=Acl(groups=["eng", "ops"])))
    assert ids(index.search(RUNBOOK, ALICE)) == ["eng-only"]        # in eng
    assert index.search(RUNBOOK, BOB) == []                         # in sales
    assert ids(index.search(RUNBOOK, CAROL)) == ["eng-only"]        # its owner
    assert index.search(RUNBOOK, GLOBEX_ALICE) == []                # eng, elsewhere


def test_user_acl_and_the_owner(index: DocumentIndex) -> None:
    index.add(CAROL, Document(id="for-bob", text=RUNBOOK, acl=Acl(users=["bob"])))
    assert ids(index.search(RUNBOOK, BOB)) == ["for-bob"]
    assert index.search(RUNBOOK, ALICE) == []
    assert ids(index.search(RUNBOOK, CAROL)) == ["for-bob"]         # the owner always reads


def test_public_documents(index: DocumentIndex) -> None:
    index.add(ALICE, Document(id="handbook", text=RUNBOOK, acl=Acl(public=True)))
    for p in (ALICE, BOB, CAROL, SERVICE, ACME_ADMIN):
        assert ids(index.search(RUNBOOK, p)) == ["handbook"]
    assert index.search(RUNBOOK, GLOBEX_ALICE) == []


# ---- writes ----------------------------------------------------------------------------------


def test_delete_isolation(index: DocumentIndex) -> None:
    index.add(ALICE, Document(id="doc", text=" ".join([RUNBOOK] * 6), acl=Acl(public=True)))
    n = chunk_count(index, "acme", "doc")
    assert n > 1
    # another user, another tenant's admin, a missing id: all the same "not found"
    messages = set()
    for who, doc_id in ((BOB, "doc"), (GLOBEX_ADMIN, "doc"), (GLOBEX_ALICE, "doc"),
                        (ALICE, "no-such-doc")):
        with pytest.raises(NotFoundError) as e:
            index.delete(who, doc_id)
        messages.add(str(e.value).replace("no-such-doc", "doc"))
    assert len(messages) == 1
    assert chunk_count(index, "acme", "doc") == n
    assert ids(index.search(RUNBOOK, BOB, k=1)) == ["doc"]
    assert index.delete(ALICE, "doc") == n
    assert chunk_count(index, "acme", "doc") == 0
    assert index.search(RUNBOOK, ALICE) == []
    with pytest.raises(NotFoundError):
        index.delete(ALICE, "doc")


def test_a_tenant_admin_may_delete_any_document_of_its_tenant(index: DocumentIndex) -> None:
    index.add(BOB, Document(id="b", text=RUNBOOK))
    assert index.delete(ACME_ADMIN, "b") == 1
    assert index.search(RUNBOOK, BOB) == []


def test_re_adding_replaces_every_chunk(index: DocumentIndex) -> None:
    long_text = " ".join(f"Old sentence number {i} about zebras." for i in range(30))
    first = index.add(ALICE, Document(id="doc", text=long_text, acl=Acl(public=True)))
    assert first.chunks > 3 and not first.replaced
    assert chunk_count(index, "acme", "doc") == first.chunks

    second = index.add(ALICE, Document(id="doc", text="New text about giraffes."))
    assert (second.chunks, second.replaced) == (1, True)
    assert chunk_count(index, "acme", "doc") == 1
    hits = index.search("Old sentence about zebras", ALICE, k=10)
    assert [h.text for h in hits] == ["New text about giraffes."]
    # the new (default) ACL applies to what is left: Bob no longer reads it
    assert index.search("giraffes", BOB) == []


def test_another_users_document_id_cannot_be_overwritten(index: DocumentIndex) -> None:
    index.add(ALICE, Document(id="doc", text=RUNBOOK))
    with pytest.raises(ConflictError, match="taken"):
        index.add(BOB, Document(id="doc", text="Bob's text", acl=Acl(public=True)))
    assert [h.text for h in index.search(RUNBOOK, ALICE)] == [RUNBOOK]
    assert index.search(RUNBOOK, BOB) == []
    index.add(ACME_ADMIN, Document(id="doc", text="the admin's text"))
    assert index.search(RUNBOOK, ALICE) == []


def test_bad_documents(index: DocumentIndex) -> None:
    with pytest.raises(RagRequestError, match="empty"):
        index.add(ALICE, Document(id="d", text="  \n "))
    small = DocumentIndex(index.client, index.embedder, collection=index.collection,
                          max_document_chars=10)
    with pytest.raises(PayloadTooLargeError):
        small.add(ALICE, Document(id="d", text="x" * 11))
    with pytest.raises(PayloadTooLargeError):
        index.add(ALICE, Document(id="d", text="x", metadata={"blob": "y" * 70_000}))


# ---- search requests ---------------------------------------------------------------------------


def test_metadata_filter_is_anded_with_the_acl(index: DocumentIndex) -> None:
    for i, (lang, acl) in enumerate([("en", Acl(public=True)), ("de", Acl(public=True)),
                                     ("en", Acl(users=["carol"])), ("fr", Acl(public=True))]):
        index.add(ALICE, Document(id=f"d{i}", text=RUNBOOK, metadata={"lang": lang, "n": i},
                                  acl=acl))
    assert sorted(ids(index.search(RUNBOOK, BOB, k=10, filter={"lang": "en"}))) == ["d0"]
    assert sorted(ids(index.search(RUNBOOK, CAROL, k=10, filter={"lang": "en"}))) == ["d0", "d2"]
    assert sorted(ids(index.search(RUNBOOK, BOB, k=10, filter={"lang": ["de", "fr"]}))) == [
        "d1", "d3"]
    assert ids(index.search(RUNBOOK, BOB, k=10, filter={"n": 3})) == ["d3"]
    assert ids(index.search(RUNBOOK, BOB, k=10, filter={"doc_id": "d1"})) == ["d1"]
    assert index.search(RUNBOOK, BOB, k=10, filter={"doc_id": "d2"}) == []


@pytest.mark.parametrize("bad", [{"tenant": "globex"}, {"acl_users": "bob"}, {"acl_public": True},
                                 {"acl_groups": ["eng"]}, {"owner": "alice"},
                                 {"acl.users": "bob"}, {"lang": None}, {"lang": {"$ne": "x"}},
                                 {"lang": []}, {"lang": ["en", 1]}, {"lang": 1.5}])
def test_bad_filters_are_rejected(index: DocumentIndex, bad: dict) -> None:
    with pytest.raises(RagRequestError) as e:
        index.search(RUNBOOK, ALICE, filter=bad)
    assert e.value.http_status == 400 and e.value.param == f"filter.{next(iter(bad))}"


def test_bad_search_requests(index: DocumentIndex) -> None:
    for k in (0, -1, index.max_k + 1, True):
        with pytest.raises(RagRequestError, match="k must be"):
            index.search(RUNBOOK, ALICE, k=k)
    with pytest.raises(RagRequestError, match="empty"):
        index.search("   ", ALICE)


# ---- memory ----------------------------------------------------------------------------------


def test_memory_is_per_tenant_user_and_scope(memory: AgentMemory) -> None:
    m1 = memory.remember(ALICE, "task-1", "The user prefers tabs over spaces.", {"step": 3})
    memory.remember(ALICE, "task-1", "The repository uses pytest for tests.")
    memory.remember(ALICE, "task-2", "The user prefers dark mode.")
    hits = memory.recall(ALICE, "task-1", "tabs or spaces?", k=5)
    assert [h.text for h in hits][0] == "The user prefers tabs over spaces."
    assert hits[0].id == m1 and hits[0].metadata == {"step": 3} and hits[0].created_at > 0
    assert len(hits) == 2                                          # not task-2's
    assert memory.recall(BOB, "task-1", "tabs or spaces?") == []   # another user
    assert memory.recall(GLOBEX_ALICE, "task-1", "tabs or spaces?") == []  # another tenant
    assert memory.recall(ACME_ADMIN, "task-1", "tabs or spaces?") == []
    assert memory.forget(BOB, "task-1") == 0
    assert memory.forget(ALICE, "task-1") == 2
    assert memory.recall(ALICE, "task-1", "tabs") == []
    assert len(memory.recall(ALICE, "task-2", "tabs")) == 1


def test_bad_memory_requests(memory: AgentMemory) -> None:
    with pytest.raises(RagRequestError, match="scope"):
        memory.remember(ALICE, "", "text")
    with pytest.raises(RagRequestError, match="empty"):
        memory.remember(ALICE, "s", " ")
    with pytest.raises(PayloadTooLargeError):
        memory.remember(ALICE, "s", "x" * (memory.max_text_chars + 1))
    with pytest.raises(RagRequestError, match="k must be"):
        memory.recall(ALICE, "s", "q", k=0)


def test_memory_over_a_bare_client_needs_an_embedder() -> None:
    client = QdrantClient(location=":memory:")
    with pytest.raises(ConfigError):
        AgentMemory(client)
    mem = AgentMemory(client, HashingEmbedder())
    mem.remember(ALICE, "s", "hello world")
    assert [h.text for h in mem.recall(ALICE, "s", "hello")] == ["hello world"]


# ---- opening -----------------------------------------------------------------------------------


def _config(tmp_path: Path, **kw: object) -> RagConfig:
    return RagConfig(qdrant_path=str(tmp_path / "store"), embedder="hashing", **kw)


def test_embedded_store_persists_and_serves_threads(tmp_path: Path) -> None:
    config = _config(tmp_path)
    index = open_index(config)
    memory = open_memory(index, config)

    def work(i: int) -> int:
        index.add(ALICE, Document(id=f"d{i}", text=f"{RUNBOOK} ({i})", acl=Acl(public=True)))
        memory.remember(ALICE, "s", f"note {i}")
        return len(index.search(RUNBOOK, BOB, k=50))

    with ThreadPoolExecutor(4) as pool:
        assert all(n >= 1 for n in pool.map(work, range(16)))
    index.close()

    index = open_index(config)
    assert len(index.search(RUNBOOK, BOB, k=50)) == 16
    assert len(open_memory(index, config).recall(ALICE, "s", "note", k=50)) == 16
    # one process at a time may open the directory
    with pytest.raises(ConfigError, match="cannot open the embedded Qdrant store"):
        open_index(config)
    index.close()


def test_collection_must_match_the_embedder(tmp_path: Path) -> None:
    open_index(_config(tmp_path, hashing_dim=256)).close()
    with pytest.raises(ConfigError, match="vectors of size 256"):
        open_index(_config(tmp_path, hashing_dim=128))
    # same size, another model: refused by name (MiniLM is not loaded to find out)
    open_index(_config(tmp_path, hashing_dim=384, collection="c384")).close()
    with pytest.raises(ConfigError, match="built with the embedder hashing-384"):
        open_index(RagConfig(qdrant_path=str(tmp_path / "store"), collection="c384"))


def test_unreachable_server_is_a_config_error() -> None:
    with socket.socket() as s:              # a loopback port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConfigError, match=f"cannot reach the Qdrant server at .*:{port}"):
        open_index(RagConfig(qdrant_url=f"http://127.0.0.1:{port}", embedder="hashing",
                             qdrant_timeout_s=2))


def test_config_checks() -> None:
    with pytest.raises(ConfigError, match="chunk_overlap"):
        load_model(RagConfig, {"chunk_size": 100, "chunk_overlap": 60})
    with pytest.raises(ConfigError, match="embedder"):
        load_model(RagConfig, {"embedder": "word2vec"})
    assert RagConfig(qdrant_path=":memory:").qdrant_url is None
    index = open_index(RagConfig(qdrant_path=":memory:", embedder="hashing"))
    assert index.search(RUNBOOK, ALICE) == []
    index.close()


@pytest.mark.service
def test_qdrant_server_through_the_config() -> None:
    if not SERVER_URL:
        pytest.skip("no Qdrant server: set RIDGELINE_QDRANT_URL to run the suite against one")
    name = f"docs_{uuid.uuid4().hex[:8]}"
    index = open_index(RagConfig(qdrant_url=SERVER_URL, embedder="hashing", collection=name))
    try:
        index.add(ALICE, Document(id="runbook", text=RUNBOOK))
        assert ids(index.search(RUNBOOK, ALICE)) == ["runbook"]
        assert index.search(RUNBOOK, GLOBEX_ALICE) == [] and index.search(RUNBOOK, BOB) == []
    finally:
        index.client.delete_collection(name)
        index.close()
