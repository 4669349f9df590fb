"""The HTTP face of RAG and agent memory: a FastAPI router that a gateway mounts.

    POST   /v1/rag/documents         index a document (replaces one with the same id)
    POST   /v1/rag/search            the top-k chunks the caller may read
    DELETE /v1/rag/documents/{id}    remove one of the caller's documents
    POST   /v1/memory                remember a text in a scope
    POST   /v1/memory/search         recall a scope's memories by meaning

The caller is a `Principal` from the dependency the gateway passes in (its API-key
check); no body field can name a tenant or a user, and unknown fields (a "tenant" among
them) are ignored, as the OpenAI-compatible server does. Each route needs the key scope
its agent tool needs (`rag:read` to search, like `search_documents`; `rag:write` to add or
delete; `memory:read` and `memory:write`), else 403.

The order is fixed: the key, then the scope, then the body. The routes declare no body
model to FastAPI, which would read and parse any body before the key is checked; they read
it with `http.read_body` under a cap that follows from the index's limits (413 from
Content-Length or while a chunked body streams in). A router cannot install an app's
exception handlers, so its routes answer user mistakes themselves, with the OpenAI-style
error bodies of `ridgeline.serve.protocol`: 400 for a malformed body, the error's own
status for a `RidgelineError` (left to the app when it handles those itself). Embedding
and searching run on worker threads, so they never stall the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import asdict
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from ridgeline.errors import RidgelineError
from ridgeline.platform.http import (
    error_response, parse_body, read_body, validation_error_body,
)
from ridgeline.platform.principal import Principal
from ridgeline.platform.rag import (
    MEMORY_READ, MEMORY_WRITE, RAG_READ, RAG_WRITE, AgentMemory, Document, DocumentIndex,
)

M = TypeVar("M", bound=BaseModel)
#: the body of a search or a recall (a query and a filter): generous, and bounded
QUERY_BODY_BYTES = 1 << 20


class _ErrorBodyRoute(APIRoute):
    """A route that turns user mistakes (also those of the principal dependency) into
    OpenAI-style error responses, unless the app has a handler of its own for them."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                return JSONResponse(validation_error_body(e), status_code=400)
            except RidgelineError as e:
                if RidgelineError in request.app.exception_handlers:
                    raise       # the app's own answer (its headers, its request ids)
                return error_response(e)

        return route


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    query: str
    k: int = 5
    filter: dict[str, Any] | None = None


class MemoryRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    scope: str = Field(min_length=1, max_length=512)
    text: str
    metadata: dict[str, Any] = Field(default_factory=dict)


class RecallRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    scope: str = Field(min_length=1, max_length=512)
    query: str
    k: int = 5


async def _parse(request: Request, model: type[M], limit: int) -> M:
    return parse_body(await read_body(request, limit), model)


def rag_router(index: DocumentIndex, memory: AgentMemory,
               principal_dep: Callable[..., Any]) -> APIRouter:
    """The RAG and memory endpoints over `index` and `memory`; `principal_dep` is a FastAPI
    dependency that returns the caller's `Principal` (or raises a 401)."""
    router = APIRouter(route_class=_ErrorBodyRoute)

    def needs(scope: str, what: str) -> Any:
        async def caller(principal: Principal = Depends(principal_dep)) -> Principal:
            return principal.require(scope, what)
        return Depends(caller)

    # a document may be max_document_chars of 4-byte characters, with metadata and an ACL
    document_bytes = 4 * index.max_document_chars + (1 << 20)
    memory_bytes = 4 * memory.max_text_chars + (1 << 20)

    @router.post("/v1/rag/documents")
    async def add_document(request: Request, principal: Principal = needs(
            RAG_WRITE, "add documents")) -> dict[str, Any]:
        document = await _parse(request, Document, document_bytes)
        done = await asyncio.to_thread(index.add, principal, document)
        return {"object": "rag.document", "id": done.doc_id, "chunks": done.chunks,
                "replaced": done.replaced}

    @router.post("/v1/rag/search")
    async def search(request: Request, principal: Principal = needs(
            RAG_READ, "search documents")) -> dict[str, Any]:
        body = await _parse(request, SearchRequest, QUERY_BODY_BYTES)
        hits = await asyncio.to_thread(index.search, body.query, principal, k=body.k,
                                       filter=body.filter)
        return {"object": "list", "data": [{"object": "rag.chunk", **asdict(h)} for h in hits]}

    @router.delete("/v1/rag/documents/{doc_id:path}")
    async def delete_document(doc_id: str, principal: Principal = needs(
            RAG_WRITE, "delete documents")) -> dict[str, Any]:
        removed = await asyncio.to_thread(index.delete, principal, doc_id)
        return {"object": "rag.document.deleted", "id": doc_id, "deleted": True,
                "chunks": removed}

    @router.post("/v1/memory")
    async def remember(request: Request, principal: Principal = needs(
            MEMORY_WRITE, "write memories")) -> dict[str, Any]:
        body = await _parse(request, MemoryRequest, memory_bytes)
        memory_id = await asyncio.to_thread(memory.remember, principal, body.scope, body.text,
                                            body.metadata)
        return {"object": "memory", "id": memory_id, "scope": body.scope}

    @router.post("/v1/memory/search")
    async def recall(request: Request, principal: Principal = needs(
            MEMORY_READ, "search memories")) -> dict[str, Any]:
        body = await _parse(request, RecallRequest, QUERY_BODY_BYTES)
        hits = await asyncio.to_thread(memory.recall, principal, body.scope, body.query,
                                       k=body.k)
        return {"object": "list", "data": [{"object": "memory", **asdict(h)} for h in hits]}

    return router
