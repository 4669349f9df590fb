"""The HTTP face of RAG and agent memory: a FastAPI router that a gateway mounts.

    POST   /v1/rag/documents         index a document (replaces one with the same id)
    POST   /v1/rag/search            the top-k chunks the caller may read
    DELETE /v1/rag/documents/{id}    remove one of the caller's documents
    POST   /v1/memory                remember a text in a scope
    POST   /v1/memory/search         recall a scope's memories by meaning

The caller is a `Principal` from the dependency the gateway passes in (its API-key
check); no body field can name a tenant or a user, and unknown fields (a "tenant" among
them) are ignored, as the OpenAI-compatible server does. A router cannot install an app's
exception handlers, so its routes answer user mistakes themselves, with the OpenAI-style
error bodies of `ridgeline.serve.protocol`: 400 for a malformed body, the error's own
status for a `RidgelineError` (left to the app when it handles those itself). Endpoints
are plain functions: FastAPI runs them in its thread pool, where embedding a text does not
stall the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from ridgeline.errors import RidgelineError
from ridgeline.platform.http import error_response, validation_error_body
from ridgeline.platform.principal import Principal
from ridgeline.platform.rag import AgentMemory, Document, DocumentIndex


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


def rag_router(index: DocumentIndex, memory: AgentMemory,
               principal_dep: Callable[..., Any]) -> APIRouter:
    """The RAG and memory endpoints over `index` and `memory`; `principal_dep` is a FastAPI
    dependency that returns the caller's `Principal` (or raises a 401)."""
    router = APIRouter(route_class=_ErrorBodyRoute)
    Caller = Depends(principal_dep)

    @router.post("/v1/rag/documents")
    def add_document(document: Document, principal: Principal = Caller) -> dict[str, Any]:
        done = index.add(principal, document)
        return {"object": "rag.document", "id": done.doc_id, "chunks": done.chunks,
                "replaced": done.replaced}

    @router.post("/v1/rag/search")
    def search(body: SearchRequest, principal: Principal = Caller) -> dict[str, Any]:
        hits = index.search(body.query, principal, k=body.k, filter=body.filter)
        return {"object": "list", "data": [{"object": "rag.chunk", **asdict(h)} for h in hits]}

    @router.delete("/v1/rag/documents/{doc_id:path}")
    def delete_document(doc_id: str, principal: Principal = Caller) -> dict[str, Any]:
        removed = index.delete(principal, doc_id)
        return {"object": "rag.document.deleted", "id": doc_id, "deleted": True,
                "chunks": removed}

    @router.post("/v1/memory")
    def remember(body: MemoryRequest, principal: Principal = Caller) -> dict[str, Any]:
        memory_id = memory.remember(principal, body.scope, body.text, body.metadata)
        return {"object": "memory", "id": memory_id, "scope": body.scope}

    @router.post("/v1/memory/search")
    def recall(body: RecallRequest, principal: Principal = Caller) -> dict[str, Any]:
        hits = memory.recall(principal, body.scope, body.query, k=body.k)
        return {"object": "list", "data": [{"object": "memory", **asdict(h)} for h in hits]}

    return router
