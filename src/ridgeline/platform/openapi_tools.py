"""REST tools from an OpenAPI 3 spec: one `Tool` per operation.

    tools = load_openapi_tools("crm.yaml", "https://crm.example.com/api",
                               auth_headers={"Authorization": "Bearer ..."})
    for tool in tools:
        registry.add(tool)

An operation's path, query and header parameters become top-level arguments (named as
in the spec; `location_name` where two locations share a name) and its JSON (or form)
request body the argument `body`; local `$ref`s are resolved (a recursive schema keeps
its references under `$defs`), OpenAPI 3.0's `nullable` becomes a null type. The tool's
name is the `operationId` made into a valid function name, else `method_path`
(`put_pets_petId` for `PUT /pets/{petId}`).

A call builds the request with httpx and returns the status line and the body text
(truncated); a 4xx/5xx answer is a failed `ToolResult` whose `error.type` is the status.
GET, HEAD and OPTIONS are read-only (scope `tools:read`); every other method has side
effects (scope `tools:write`), so the registry demands an idempotency key for it and the
request carries an `Idempotency-Key` header derived from that key and the tenant.

Outbound safety: `base_url` is checked with `check_outbound_url` when the tools are
loaded, and requests go through `urls.safe_client` (addresses checked again at connect
time, no redirects, no environment proxies) unless the caller passes its own client.
The spec's `servers` are ignored: only `base_url` is ever called. Credentials in
`auth_headers` are added to every request and never appear in the tool's schema.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import yaml

from ridgeline.agent.observation import truncate_middle
from ridgeline.errors import ConfigError, NotFoundError, RidgelineError
from ridgeline.platform.tool_schemas import make_nullable
from ridgeline.platform.tools import Tool, ToolCallContext, ToolFailure
from ridgeline.platform.urls import check_outbound_url, safe_client

log = logging.getLogger(__name__)

METHODS = ("get", "put", "post", "delete", "patch", "head", "options")
READ_ONLY_METHODS = frozenset({"get", "head", "options"})
# Headers the tool sets itself (or the deployment's credentials do): never arguments.
_RESERVED_HEADERS = frozenset({"accept", "content-type", "content-length", "authorization",
                               "cookie", "host", "idempotency-key"})
_JSON_TYPE = re.compile(r"^application/([\w.+-]+\+)?json$")
_FORM_TYPE = "application/x-www-form-urlencoded"

ScopesFor = Callable[[str, str, dict[str, Any]], tuple[str, ...]]


def default_scopes(method: str, path: str, operation: dict[str, Any]) -> tuple[str, ...]:
    """`tools:read` for read-only methods, `tools:write` for the rest."""
    return ("tools:read",) if method in READ_ONLY_METHODS else ("tools:write",)


def load_openapi_tools(spec: dict[str, Any] | str | Path, base_url: str, *,
                       scopes_for: ScopesFor = default_scopes,
                       auth_headers: dict[str, str] | None = None,
                       client: httpx.Client | None = None, allow_private: bool = False,
                       timeout_s: float = 30.0, max_response_bytes: int = 16_000,
                       name_prefix: str = "") -> list[Tool]:
    """One tool per operation of `spec` (a dict, or a JSON/YAML file), calling `base_url`.
    Raises `UnsafeURLError` for a base URL the platform may not call, `ConfigError` for a
    spec it cannot use."""
    doc = _load_spec(spec)
    base = check_outbound_url(base_url, allow_private=allow_private).rstrip("/")
    http = client if client is not None else safe_client(allow_private=allow_private,
                                                         timeout=timeout_s)
    auth = dict(auth_headers or {})
    skip_headers = _RESERVED_HEADERS | {h.lower() for h in auth}
    tools: list[Tool] = []
    names: set[str] = set()
    for path, item in (doc.get("paths") or {}).items():
        item = _deref(doc, item)
        for method in METHODS:
            op = item.get(method)
            if not isinstance(op, dict):
                continue
            try:
                built = _Operation(doc, path, method, item, op, skip_headers)
            except _Unsupported as e:
                log.info("OpenAPI operation %s %s is not offered as a tool: %s",
                         method.upper(), path, e)
                continue
            name = _unique(name_prefix + _function_name(op.get("operationId")
                                                        or f"{method}{path}"), names)
            tools.append(Tool(
                name=name, description=built.description(), parameters=built.parameters,
                run=_Caller(built, http, base, auth, timeout_s, max_response_bytes),
                scopes=tuple(scopes_for(method, path, op)),
                side_effects=method not in READ_ONLY_METHODS, kind="extension"))
    if not tools:
        raise ConfigError("the OpenAPI spec has no operation that can be offered as a tool",
                          hint="operations need path/query/header parameters and a JSON or "
                               "form body")
    return tools


# ---- the spec ----------------------------------------------------------------------------------


def _load_spec(spec: dict[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(spec, dict):
        doc = copy.deepcopy(spec)
    else:
        path = Path(spec)
        if not path.is_file():
            raise NotFoundError(f"OpenAPI spec not found: {path}")
        try:
            doc = yaml.safe_load(path.read_text(encoding="utf-8"))  # JSON is YAML too
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not a JSON or YAML OpenAPI spec: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("paths"), dict):
        raise ConfigError("not an OpenAPI spec: it has no `paths` object")
    version = str(doc.get("openapi", ""))
    if not version.startswith("3."):
        raise ConfigError(f"OpenAPI version {version or doc.get('swagger') or '?'} is not "
                          "supported", hint="convert the spec to OpenAPI 3 (e.g. with "
                                            "swagger2openapi)")
    return doc


def _deref(doc: dict[str, Any], node: Any, depth: int = 0) -> Any:
    """A `$ref`'d object (parameter, body, path item) with its reference followed."""
    while isinstance(node, dict) and "$ref" in node and depth < 20:
        node = _pointer(doc, node["$ref"])
        depth += 1
    return node


def _pointer(doc: dict[str, Any], ref: Any) -> Any:
    if not isinstance(ref, str) or not ref.startswith("#/"):
        raise ConfigError(f"only local $refs are supported in OpenAPI specs, not {ref!r}")
    node: Any = doc
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            raise ConfigError(f"$ref {ref!r} points at nothing in the spec")
        node = node[part]
    return node


class _Unsupported(Exception):
    pass


class _SchemaInliner:
    """Schemas with local `$ref`s inlined; a cycle keeps its reference, rewritten to
    `#/$defs/<name>` of the tool's own argument schema (collected in `defs`)."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.defs: dict[str, Any] = {}
        self._names: dict[str, str] = {}
        self._stack: list[str] = []

    def inline(self, node: Any) -> Any:
        if isinstance(node, list):
            return [self.inline(v) for v in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node and isinstance(node["$ref"], str):
            ref = node["$ref"]
            if ref in self._stack:
                return {"$ref": f"#/$defs/{self._define(ref)}"}
            self._stack.append(ref)
            try:
                target = self.inline(_pointer(self.doc, ref))
            finally:
                self._stack.pop()
            siblings = {k: self.inline(v) for k, v in node.items() if k != "$ref"}
            return {**target, **siblings} if isinstance(target, dict) else target
        out = {k: self.inline(v) for k, v in node.items()
               if k not in ("example", "examples", "xml", "externalDocs", "discriminator")}
        if out.pop("nullable", False) is True:   # OpenAPI 3.0
            out = make_nullable(out)
        for bound in ("Minimum", "Maximum"):       # OpenAPI 3.0's boolean exclusive bounds
            flag = out.get(f"exclusive{bound}")
            if isinstance(flag, bool):
                del out[f"exclusive{bound}"]
                if flag and bound.lower() in out:
                    out[f"exclusive{bound}"] = out.pop(bound.lower())
        return out

    def _define(self, ref: str) -> str:
        name = self._names.get(ref)
        if name is None:
            base = re.sub(r"[^A-Za-z0-9_]", "_", ref.rsplit("/", 1)[-1]) or "schema"
            name, n = base, 1
            while name in self.defs:
                n += 1
                name = f"{base}_{n}"
            self._names[ref] = name
            self.defs[name] = {}
            self._stack.append(ref)
            try:
                self.defs[name] = self.inline(_pointer(self.doc, ref))
            finally:
                self._stack.pop()
        return name


class _Param:
    def __init__(self, name: str, location: str, arg: str, required: bool) -> None:
        self.name, self.location, self.arg, self.required = name, location, arg, required


class _Operation:
    """One operation's arguments: which go in the path, query, headers and body."""

    def __init__(self, doc: dict[str, Any], path: str, method: str, item: dict[str, Any],
                 op: dict[str, Any], skip_headers: frozenset[str] | set[str]) -> None:
        self.path, self.method, self.op = path, method, op
        inliner = _SchemaInliner(doc)
        merged: dict[tuple[str, str], dict[str, Any]] = {}
        for raw in [*(item.get("parameters") or []), *(op.get("parameters") or [])]:
            p = _deref(doc, raw)
            if not isinstance(p, dict) or "name" not in p or "in" not in p:
                raise _Unsupported("a parameter without name or location")
            merged[(p["name"], p["in"])] = p   # the operation's own win over the path's
        wanted = []
        for (name, location), p in merged.items():
            if location == "cookie":
                if p.get("required"):
                    raise _Unsupported(f"required cookie parameter {name!r}")
                continue
            if location == "header" and name.lower() in skip_headers:
                continue
            if location not in ("path", "query", "header"):
                raise _Unsupported(f"parameter location {location!r}")
            wanted.append((name, location, p))
        counts: dict[str, int] = {}
        for name, _, _ in wanted:
            counts[name] = counts.get(name, 0) + 1
        properties: dict[str, Any] = {}
        required: list[str] = []
        self.params: list[_Param] = []
        for name, location, p in wanted:
            arg = name if counts[name] == 1 and name != "body" else f"{location}_{name}"
            schema = inliner.inline(p.get("schema") or _content_schema(p) or {"type": "string"})
            if p.get("description") and not schema.get("description"):
                schema = {**schema, "description": p["description"]}
            properties[arg] = schema
            is_required = location == "path" or bool(p.get("required"))
            if is_required:
                required.append(arg)
            self.params.append(_Param(name, location, arg, is_required))
        self.body_arg: str | None = None
        self.body_type: str | None = None
        body = _deref(doc, op.get("requestBody"))
        if isinstance(body, dict):
            content = body.get("content") or {}
            media = next((m for m in content if _JSON_TYPE.match(m.split(";")[0].strip())),
                         _FORM_TYPE if _FORM_TYPE in content else None)
            if media is None:
                if body.get("required"):
                    raise _Unsupported(f"request body of type {', '.join(content) or '?'}")
            else:
                self.body_arg = "body" if "body" not in properties else "request_body"
                self.body_type = "form" if media == _FORM_TYPE else "json"
                schema = inliner.inline((content[media] or {}).get("schema") or {})
                if body.get("description") and not schema.get("description"):
                    schema = {**schema, "description": body["description"]}
                properties[self.body_arg] = schema
                if body.get("required"):
                    required.append(self.body_arg)
        self.parameters: dict[str, Any] = {"type": "object", "properties": properties,
                                           "required": required, "additionalProperties": False}
        if inliner.defs:
            self.parameters["$defs"] = inliner.defs

    def description(self) -> str:
        parts = [str(self.op.get(k) or "").strip() for k in ("summary", "description")]
        text = ". ".join(dict.fromkeys(p.rstrip(".") for p in parts if p))
        head = f"{self.method.upper()} {self.path}"
        return (f"{head}: {text}." if text else head)[:1024]


def _content_schema(p: dict[str, Any]) -> dict[str, Any] | None:
    content = p.get("content")
    if isinstance(content, dict) and content:
        return next(iter(content.values())).get("schema")
    return None


def _function_name(raw: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_-]+", "_", raw).strip("_")
    return (name or "operation")[:64]


def _unique(name: str, taken: set[str]) -> str:
    candidate, n = name, 1
    while candidate in taken:
        n += 1
        suffix = f"_{n}"
        candidate = name[:64 - len(suffix)] + suffix
    taken.add(candidate)
    return candidate


# ---- calling -----------------------------------------------------------------------------------


class _Caller:
    """Runs one operation: the `Tool.run` of an OpenAPI tool."""

    def __init__(self, op: _Operation, client: httpx.Client, base: str,
                 auth: dict[str, str], timeout_s: float, max_response_bytes: int) -> None:
        self.op, self.client, self.base, self.auth = op, client, base, auth
        self.timeout_s, self.max_response_bytes = timeout_s, max_response_bytes

    def __call__(self, args: dict[str, Any], ctx: ToolCallContext) -> str:
        op = self.op
        path = op.path
        query: dict[str, Any] = {}
        headers: dict[str, str] = {}
        for p in op.params:
            if p.arg not in args or args[p.arg] is None:
                continue
            value = args[p.arg]
            if p.location == "path":
                path = path.replace("{" + p.name + "}", _path_segment(value))
            elif p.location == "query":
                query[p.name] = _query_value(value)
            else:
                headers[p.name] = _scalar_text(value)
        headers.update(self.auth)
        if op.method not in READ_ONLY_METHODS and ctx.idempotency_key:
            # The API dedupes on its side too; per tenant, like the registry's own store.
            headers["Idempotency-Key"] = hashlib.sha256(
                f"{ctx.principal.tenant}\x00{ctx.idempotency_key}".encode()).hexdigest()[:40]
        kwargs: dict[str, Any] = {}
        if op.body_arg is not None and args.get(op.body_arg) is not None:
            if op.body_type == "form":
                kwargs["data"] = args[op.body_arg]
            else:
                kwargs["json"] = args[op.body_arg]
        timeout = min(self.timeout_s, ctx.timeout_s) if ctx.timeout_s else self.timeout_s
        try:
            response = self.client.request(op.method.upper(), self.base + path, params=query,
                                           headers=headers, timeout=timeout, **kwargs)
        except httpx.TimeoutException:
            raise ToolFailure(f"{op.method.upper()} {op.path} timed out after {timeout:.0f} s",
                              error_type="timeout") from None
        except httpx.HTTPError as e:
            raise ToolFailure(f"{op.method.upper()} {op.path} failed: {e}",
                              error_type=type(e).__name__) from None
        except RidgelineError as e:   # the safe transport refused the address
            raise ToolFailure(f"{op.method.upper()} {op.path} was refused: {e.message}",
                              error_type=type(e).__name__) from None
        media = response.headers.get("content-type", "").split(";")[0].strip().lower()
        if not response.content or _is_text(media):
            body, _ = truncate_middle(response.text, self.max_response_bytes)
        else:  # an image, a PDF...: a model cannot read the bytes as text
            body = f"[{media or 'binary'} content, {len(response.content)} bytes]"
        status = f"HTTP {response.status_code} {response.reason_phrase}".strip()
        if response.status_code >= 400:
            raise ToolFailure(status, error_type=str(response.status_code), content=body)
        return f"{status}\n{body}" if body else status


def _is_text(media: str) -> bool:
    return (not media or media.startswith("text/") or bool(_JSON_TYPE.match(media))
            or media.endswith(("+xml", "/xml", "/yaml", "/x-yaml", "/javascript"))
            or media == _FORM_TYPE)


def _path_segment(value: Any) -> str:
    text = quote(_scalar_text(value), safe="")
    # "." and ".." would walk the URL's path: send them encoded
    return {".": "%2E", "..": "%2E%2E"}.get(text, text)


def _scalar_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _query_value(value: Any) -> Any:
    if isinstance(value, list):
        return [_scalar_text(v) for v in value]
    return _scalar_text(value)
