"""Permission-isolated retrieval (RAG) and agent memory over Qdrant.

One code path serves both deployments: Qdrant's local mode embedded in the process
(`QdrantClient(path=...)`, or ``":memory:"``) on one machine, and a Qdrant server
(`QdrantClient(url=...)`) at scale. Documents are split into chunks, embedded, and stored
as points whose payload carries the tenant, the owner and the document's ACL.

Who may see what is decided by the server, never by the request: the tenant and the user
come from the authenticated `Principal`, and `visibility_filter` turns them into a Qdrant
filter (tenant must match; and the document is public, or names the user, or one of the
user's groups, or the user owns it). The filter goes *into* the vector search
(`query_points(query_filter=...)`), so Qdrant returns the k nearest chunks among those the
caller may see: a selective ACL still fills the top-k, where filtering a plain top-k
afterwards would return fewer (or none). The tenant and ACL fields are payload-indexed so
that a server plans filtered searches from the index instead of scanning; an admin is
still confined to its own tenant.

`AgentMemory` stores short texts (an agent's notes, a session's facts) per tenant, user
and scope key, with the same tenant filter inside its searches.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from qdrant_client import QdrantClient
from qdrant_client import models as qm

from ridgeline.errors import (
    ConfigError, ConflictError, NotFoundError, PayloadTooLargeError,
)
from ridgeline.platform.chunking import chunk_text, looks_like_code
from ridgeline.platform.embeddings import Embedder, make_embedder
from ridgeline.platform.principal import Principal
from ridgeline.wire import RequestError

#: namespace of the point ids: uuid5 of tenant, document id and chunk position, so the
#: same document re-added overwrites its own points and never another tenant's
_POINT_NS = uuid.UUID("6f1d2a52-63c1-4b8e-9a57-3c0f6f1b9d10")

#: payload fields that only the server sets; a request filter may not name them
RESERVED_FIELDS = frozenset({"tenant", "owner", "user", "scope", "acl", "acl_users",
                             "acl_groups", "acl_public", "chunk", "start", "end", "text"})
MAX_METADATA_BYTES = 64 * 1024

#: the key scopes for documents and memory, the same over HTTP and as an agent's tools
RAG_READ, RAG_WRITE = "rag:read", "rag:write"
MEMORY_READ, MEMORY_WRITE = "memory:read", "memory:write"


class RagRequestError(RequestError):
    """A malformed RAG or memory request: an empty query, k out of range, a bad filter
    (the server's 400 with `param`, code `invalid_value`)."""

    def __init__(self, message: str, *, param: str | None = None,
                 hint: str | None = None) -> None:
        super().__init__(message, param=param, code="invalid_value", hint=hint)


# ---- configuration ---------------------------------------------------------------------------


class RagConfig(BaseModel):
    """Where the vectors live and how documents are cut and embedded."""

    model_config = ConfigDict(extra="forbid")

    qdrant_path: str = Field("platform-qdrant", description="embedded store's directory, "
                             "or ':memory:' for one that lives as long as the process")
    qdrant_url: str | None = Field(None, description="a Qdrant server; None: embedded")
    qdrant_api_key: str | None = None
    qdrant_timeout_s: float = Field(10.0, gt=0)
    collection: str = Field("ridgeline_documents", min_length=1)
    memory_collection: str = Field("ridgeline_memory", min_length=1)
    embedder: Literal["minilm", "hashing"] = "minilm"
    hashing_dim: int = Field(256, ge=8, description="vector size of the hashing embedder")
    chunk_size: int = Field(800, ge=16, description="characters per chunk (MiniLM reads "
                            "about 256 word pieces, roughly 1000 characters)")
    chunk_overlap: int = Field(100, ge=0)
    max_k: int = Field(50, ge=1, description="most results one search may ask for")
    max_document_chars: int = Field(2_000_000, ge=1)

    @model_validator(mode="after")
    def _check_overlap(self) -> RagConfig:
        if self.chunk_overlap > self.chunk_size // 2:
            raise ValueError(f"chunk_overlap ({self.chunk_overlap}) must be at most half of "
                             f"chunk_size ({self.chunk_size})")
        return self


# ---- documents and results -------------------------------------------------------------------


class Acl(BaseModel):
    """Who in the tenant may read a document: listed users, members of listed groups, or
    everyone (`public`). The owner always may."""

    model_config = ConfigDict(extra="ignore")

    users: list[str] = Field(default_factory=list, max_length=1000)
    groups: list[str] = Field(default_factory=list, max_length=1000)
    public: bool = False


class Document(BaseModel):
    """A text to index. `acl` None means the writer alone; the tenant is never a field
    (it is the writer's)."""

    model_config = ConfigDict(extra="ignore")

    id: str = Field(min_length=1, max_length=512, pattern=r"^[^\x00-\x1f]+$")
    text: str
    metadata: dict[str, Any] = Field(default_factory=dict)
    acl: Acl | None = None


@dataclass(frozen=True)
class IndexedDocument:
    doc_id: str
    chunks: int
    replaced: bool      # the id was in the index before, and its old chunks are gone


@dataclass(frozen=True)
class SearchHit:
    doc_id: str
    chunk: int
    text: str
    score: float
    start: int
    end: int
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MemoryHit:
    id: str
    text: str
    score: float
    created_at: float
    metadata: dict[str, Any] = field(default_factory=dict)


# ---- filters ---------------------------------------------------------------------------------


def identity(principal: Principal) -> str:
    """The name ACLs and memories use for a caller: its user, or its key when the key
    belongs to no user (a service)."""
    return principal.user or f"key:{principal.key_id}"


def _match(key: str, value: Any) -> qm.FieldCondition:
    return qm.FieldCondition(key=key, match=qm.MatchValue(value=value))


def tenant_condition(principal: Principal) -> qm.FieldCondition:
    return _match("tenant", principal.tenant)


def visibility_filter(principal: Principal) -> qm.Filter:
    """The chunks `principal` may read: its tenant's, and of those the public ones, the ones
    whose ACL names its user or one of its groups, and its own."""
    me = identity(principal)
    readable: list[qm.Condition] = [
        _match("acl_public", True), _match("acl_users", me), _match("owner", me)]
    if principal.groups:
        readable.append(qm.FieldCondition(key="acl_groups",
                                          match=qm.MatchAny(any=sorted(principal.groups))))
    # a `should` list alone means at least one of its conditions
    return qm.Filter(must=[tenant_condition(principal), qm.Filter(should=readable)])


def metadata_conditions(spec: dict[str, Any] | None) -> list[qm.Condition]:
    """A request's filter, `{field: value or [values]}` on document metadata (or `doc_id`),
    as conditions that are ANDed with the visibility filter."""
    if spec is None:
        return []
    if not isinstance(spec, dict):
        raise RagRequestError("filter must be an object of field: value", param="filter")
    out: list[qm.Condition] = []
    for key, value in spec.items():
        param = f"filter.{key}"
        if not isinstance(key, str) or not key or key.split(".")[0] in RESERVED_FIELDS \
                or key.startswith("acl"):
            raise RagRequestError(f"the filter may not name {key!r}: tenancy and access are "
                                  "decided by the server", param=param,
                                  hint="filter on metadata fields or doc_id")
        target = "doc_id" if key == "doc_id" else f"metadata.{key}"
        if isinstance(value, list):
            if not value or not all(isinstance(v, str | int) and not isinstance(v, bool)
                                    for v in value) or len({type(v) for v in value}) > 1:
                raise RagRequestError(f"filter {key!r}: a list must hold strings or integers "
                                      "(one kind, at least one)", param=param)
            out.append(qm.FieldCondition(key=target, match=qm.MatchAny(any=value)))
        elif isinstance(value, str | int | bool):
            out.append(_match(target, value))
        else:
            raise RagRequestError(f"filter {key!r}: the value must be a string, an integer, a "
                                  "boolean or a list of strings or integers", param=param)
    return out


# ---- the collections -------------------------------------------------------------------------


def is_embedded(client: QdrantClient) -> bool:
    """Whether the client runs Qdrant's local mode in this process (not a server)."""
    opts = client.init_options
    return opts.get("location") == ":memory:" or opts.get("path") is not None


def ensure_collection(client: QdrantClient, name: str, embedder: Embedder,
                      keyword_fields: dict[str, bool], bool_fields: tuple[str, ...] = ()) -> None:
    """Create `name` for `embedder`'s vectors with payload indexes (keyword field: whether
    it is the tenant), or check that an existing one holds vectors of this embedder."""
    if not client.collection_exists(name):
        try:
            params = qm.VectorParams(size=embedder.dim, distance=qm.Distance.COSINE)
            client.create_collection(name, vectors_config=params,
                                     metadata={"embedder": embedder.name})
        except Exception:
            if not client.collection_exists(name):      # else another process made it
                raise
        with warnings.catch_warnings():
            # local mode ignores payload indexes (it scans) and says so; a server uses them
            warnings.filterwarnings("ignore", message="Payload indexes have no effect")
            for key, is_tenant in keyword_fields.items():
                client.create_payload_index(name, key, qm.KeywordIndexParams(
                    type=qm.KeywordIndexType.KEYWORD, is_tenant=is_tenant or None))
            for key in bool_fields:
                client.create_payload_index(name, key, qm.PayloadSchemaType.BOOL)
    config = client.get_collection(name).config
    vectors = config.params.vectors
    size = vectors.size if isinstance(vectors, qm.VectorParams) else None
    if size != embedder.dim:
        raise ConfigError(f"the collection {name!r} holds vectors of size {size}, but the "
                          f"embedder {embedder.name} makes {embedder.dim}",
                          hint="use the embedder the collection was built with, or another "
                               "collection name")
    made_by = (config.metadata or {}).get("embedder")
    if made_by is not None and made_by != embedder.name:
        raise ConfigError(f"the collection {name!r} was built with the embedder {made_by}, "
                          f"not {embedder.name}; their vectors are not comparable",
                          hint="use the same embedder, or another collection name")


def _lock_for(client: QdrantClient) -> contextlib.AbstractContextManager[Any]:
    # local mode is plain Python and SQLite state, not safe across threads (FastAPI runs
    # sync endpoints in a pool); a server orders concurrent requests itself
    return threading.RLock() if is_embedded(client) else contextlib.nullcontext()


def _check_k(k: int, max_k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= max_k:
        raise RagRequestError(f"k must be an integer from 1 to {max_k}, got {k!r}", param="k")


def _check_query(query: str) -> None:
    if not isinstance(query, str) or not query.strip():
        raise RagRequestError("the query is empty", param="query")


def _check_metadata(metadata: dict[str, Any], param: str = "metadata") -> None:
    try:
        size = len(json.dumps(metadata))
    except (TypeError, ValueError):
        raise RagRequestError("metadata must be JSON (objects, lists, strings, numbers)",
                              param=param) from None
    if size > MAX_METADATA_BYTES:
        raise PayloadTooLargeError(f"metadata is {size} bytes, over the limit of "
                                   f"{MAX_METADATA_BYTES}", hint="store less in metadata")


# ---- documents -------------------------------------------------------------------------------


class DocumentIndex:
    """Chunked, embedded documents in one Qdrant collection, shared by all tenants and
    isolated by the visibility filter."""

    def __init__(self, client: QdrantClient, embedder: Embedder, *,
                 collection: str = "ridgeline_documents", chunk_size: int = 800,
                 chunk_overlap: int = 100, max_k: int = 50,
                 max_document_chars: int = 2_000_000) -> None:
        self.client = client
        self.embedder = embedder
        self.collection = collection
        self.chunk_size = chunk_size
        self.chunk_overlap = chunk_overlap
        self.max_k = max_k
        self.max_document_chars = max_document_chars
        self.lock = _lock_for(client)
        with self.lock:
            ensure_collection(client, collection, embedder,
                              {"tenant": True, "doc_id": False, "owner": False,
                               "acl_users": False, "acl_groups": False},
                              bool_fields=("acl_public",))

    @staticmethod
    def point_id(tenant: str, doc_id: str, chunk: int) -> str:
        return str(uuid.uuid5(_POINT_NS, f"{tenant}\x00{doc_id}\x00{chunk}"))

    def _doc_filter(self, principal: Principal, doc_id: str, *extra: qm.Condition) -> qm.Filter:
        return qm.Filter(must=[tenant_condition(principal), _match("doc_id", doc_id), *extra])

    def add(self, principal: Principal, document: Document) -> IndexedDocument:
        """Index `document` in the principal's tenant, replacing the chunks of a document
        with the same id that the principal owns (an admin: any in its tenant)."""
        if len(document.text) > self.max_document_chars:
            raise PayloadTooLargeError(
                f"the document is {len(document.text)} characters, over the limit of "
                f"{self.max_document_chars}", hint="split it into several documents")
        if not document.text.strip():
            raise RagRequestError("the document text is empty", param="text")
        _check_metadata(document.metadata)
        name = document.metadata.get("path") or document.metadata.get("filename") or document.id
        chunks = chunk_text(document.text, size=self.chunk_size, overlap=self.chunk_overlap,
                            code=looks_like_code(str(name)))
        vectors = self.embedder.embed([c.text for c in chunks])      # outside the lock
        me = identity(principal)
        acl = document.acl or Acl(users=[me])
        points = [qm.PointStruct(
            id=self.point_id(principal.tenant, document.id, c.index), vector=v,
            payload={"tenant": principal.tenant, "doc_id": document.id, "chunk": c.index,
                     "start": c.start, "end": c.end, "text": c.text, "owner": me,
                     "acl_users": sorted(set(acl.users)), "acl_groups": sorted(set(acl.groups)),
                     "acl_public": acl.public, "metadata": document.metadata})
            for c, v in zip(chunks, vectors, strict=True)]
        with self.lock:
            found, _ = self.client.scroll(self.collection,
                                          scroll_filter=self._doc_filter(principal, document.id),
                                          limit=1, with_payload=["owner"])
            if found and (found[0].payload or {}).get("owner") != me and not principal.admin:
                # says only that the id is taken, which any shared id space tells
                raise ConflictError(f"the document id {document.id!r} is taken in this tenant",
                                    hint="choose another id")
            self.client.upsert(self.collection, points, wait=True)
            # the new chunks overwrote positions 0..n-1; drop the old ones past them
            self.client.delete(self.collection, points_selector=qm.FilterSelector(
                filter=self._doc_filter(principal, document.id, qm.FieldCondition(
                    key="chunk", range=qm.Range(gte=len(points))))), wait=True)
        return IndexedDocument(document.id, len(points), replaced=bool(found))

    def search(self, query: str, principal: Principal, k: int = 5,
               filter: dict[str, Any] | None = None) -> list[SearchHit]:
        """The `k` chunks nearest to `query` among those `principal` may read, optionally
        narrowed by a metadata `filter` (`{field: value or [values]}`)."""
        _check_query(query)
        _check_k(k, self.max_k)
        conditions = metadata_conditions(filter)
        vector = self.embedder.embed([query])[0]
        # the caller's rights inside the search itself, never applied to its results
        query_filter = qm.Filter(must=[visibility_filter(principal), *conditions])
        with self.lock:
            points = self.client.query_points(self.collection, query=vector,
                                              query_filter=query_filter, limit=k,
                                              with_payload=True).points
        return [SearchHit(doc_id=p.payload["doc_id"], chunk=p.payload["chunk"],
                          text=p.payload["text"], score=p.score, start=p.payload["start"],
                          end=p.payload["end"], metadata=p.payload.get("metadata") or {})
                for p in points if p.payload is not None]

    def delete(self, principal: Principal, doc_id: str) -> int:
        """Remove a document the principal owns (an admin: any in its tenant); returns
        the number of chunks removed. Another user's document is reported as not found,
        so that a delete never tells whether it exists."""
        mine = [] if principal.admin else [_match("owner", identity(principal))]
        with self.lock:
            n = self.client.count(self.collection, exact=True,
                                  count_filter=self._doc_filter(principal, doc_id, *mine)).count
            if n == 0:
                raise NotFoundError(f"no document {doc_id!r} of yours in this tenant",
                                    hint="only its owner or a tenant admin may delete it")
            self.client.delete(self.collection, wait=True, points_selector=qm.FilterSelector(
                filter=self._doc_filter(principal, doc_id)))
        return n

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> DocumentIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- agent memory ----------------------------------------------------------------------------


class AgentMemory:
    """Short texts remembered per tenant, user and scope (an agent task, a session), found
    again by meaning. Shares a `DocumentIndex`'s client and embedder (an embedded store
    admits one client per directory), in its own collection."""

    def __init__(self, store: DocumentIndex | QdrantClient, embedder: Embedder | None = None,
                 *, collection: str = "ridgeline_memory", max_k: int = 50,
                 max_text_chars: int = 32_000) -> None:
        if isinstance(store, DocumentIndex):
            self.client, self.lock = store.client, store.lock
            self.embedder = embedder or store.embedder
        else:
            if embedder is None:
                raise ConfigError("AgentMemory over a bare client needs an embedder")
            self.client, self.lock, self.embedder = store, _lock_for(store), embedder
        self.collection = collection
        self.max_k = max_k
        self.max_text_chars = max_text_chars
        with self.lock:
            ensure_collection(self.client, collection, self.embedder,
                              {"tenant": True, "user": False, "scope": False})

    @staticmethod
    def _check_scope(scope_key: str) -> None:
        if not isinstance(scope_key, str) or not 1 <= len(scope_key) <= 512:
            raise RagRequestError("the scope must be a string of 1 to 512 characters",
                                  param="scope")

    def _scope_filter(self, principal: Principal, scope_key: str) -> qm.Filter:
        return qm.Filter(must=[tenant_condition(principal), _match("user", identity(principal)),
                               _match("scope", scope_key)])

    def remember(self, principal: Principal, scope_key: str, text: str,
                 metadata: dict[str, Any] | None = None) -> str:
        """Store `text` in the caller's scope; returns the memory's id."""
        self._check_scope(scope_key)
        if not isinstance(text, str) or not text.strip():
            raise RagRequestError("the memory text is empty", param="text")
        if len(text) > self.max_text_chars:
            raise PayloadTooLargeError(f"the memory is {len(text)} characters, over the limit "
                                       f"of {self.max_text_chars}",
                                       hint="store a summary, or index it as a document")
        metadata = metadata or {}
        _check_metadata(metadata)
        memory_id = str(uuid.uuid4())
        vector = self.embedder.embed([text])[0]
        payload = {"tenant": principal.tenant, "user": identity(principal), "scope": scope_key,
                   "text": text, "metadata": metadata, "created_at": time.time()}
        with self.lock:
            self.client.upsert(self.collection, [qm.PointStruct(id=memory_id, vector=vector,
                                                                payload=payload)], wait=True)
        return memory_id

    def recall(self, principal: Principal, scope_key: str, query: str,
               k: int = 5) -> list[MemoryHit]:
        """The caller's `k` memories in `scope_key` nearest to `query`."""
        self._check_scope(scope_key)
        _check_query(query)
        _check_k(k, self.max_k)
        vector = self.embedder.embed([query])[0]
        with self.lock:
            points = self.client.query_points(
                self.collection, query=vector, limit=k, with_payload=True,
                query_filter=self._scope_filter(principal, scope_key)).points
        return [MemoryHit(id=str(p.id), text=p.payload["text"], score=p.score,
                          created_at=p.payload["created_at"],
                          metadata=p.payload.get("metadata") or {})
                for p in points if p.payload is not None]

    def forget(self, principal: Principal, scope_key: str) -> int:
        """Drop every memory of the caller's scope; returns how many there were."""
        self._check_scope(scope_key)
        flt = self._scope_filter(principal, scope_key)
        with self.lock:
            n = self.client.count(self.collection, count_filter=flt, exact=True).count
            self.client.delete(self.collection, points_selector=qm.FilterSelector(filter=flt),
                               wait=True)
        return n


# ---- opening ---------------------------------------------------------------------------------


def open_client(config: RagConfig) -> QdrantClient:
    """A client for the configured store: the server at `qdrant_url` (checked reachable),
    else the embedded store at `qdrant_path`."""
    if config.qdrant_url:
        client = QdrantClient(url=config.qdrant_url, api_key=config.qdrant_api_key,
                              timeout=int(max(1, config.qdrant_timeout_s)),
                              check_compatibility=False)
        try:
            client.get_collections()
        except Exception as e:
            client.close()
            raise ConfigError(f"cannot reach the Qdrant server at {config.qdrant_url}: "
                              f"{type(e).__name__}: {e}",
                              hint="start the server, fix qdrant_url (and qdrant_api_key), "
                                   "or unset qdrant_url to use the embedded store") from None
        return client
    if config.qdrant_path == ":memory:":
        return QdrantClient(location=":memory:")
    path = Path(config.qdrant_path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        # sync FastAPI endpoints run in a thread pool; DocumentIndex serialises access
        return QdrantClient(path=str(path), force_disable_check_same_thread=True)
    except (OSError, RuntimeError) as e:
        raise ConfigError(f"cannot open the embedded Qdrant store at {path}: {e}",
                          hint="one process at a time may open it; run a Qdrant server and "
                               "set qdrant_url to share it") from None


def open_index(config: RagConfig | None = None) -> DocumentIndex:
    config = config or RagConfig()
    embedder = make_embedder(config.embedder, hashing_dim=config.hashing_dim)
    client = open_client(config)
    try:
        return DocumentIndex(client, embedder, collection=config.collection,
                             chunk_size=config.chunk_size, chunk_overlap=config.chunk_overlap,
                             max_k=config.max_k, max_document_chars=config.max_document_chars)
    except BaseException:
        client.close()
        raise


def open_memory(index: DocumentIndex, config: RagConfig | None = None) -> AgentMemory:
    config = config or RagConfig()
    return AgentMemory(index, collection=config.memory_collection, max_k=config.max_k)


@contextlib.contextmanager
def opened(config: RagConfig | None = None) -> Iterator[tuple[DocumentIndex, AgentMemory]]:
    """The index and memory of `config`, closed afterwards."""
    index = open_index(config)
    try:
        yield index, open_memory(index, config)
    finally:
        index.close()
