"""JSON schemas of tool arguments in OpenAI's strict structured-output subset, and the
nulls such a schema makes models send (`ridgeline.platform.tools` offers and calls tools
with these).

`strict_schema` closes every object (`additionalProperties: false`), makes every property
required and an optional one a union with null (a null argument then means "use the
default": `drop_optional_nulls` removes it before validation), drops unsupported keywords
(a default moves into the description) and inlines non-recursive `$ref`s. A schema the
subset cannot express (a free-form object, an untyped value) raises `StrictSchemaError`;
the tool is then sent with `"strict": false` instead.
"""

from __future__ import annotations

import json
import re
from typing import Any


class StrictSchemaError(ValueError):
    """A schema OpenAI's strict mode cannot express."""


# What strict mode accepts besides the structure keywords (type, properties, items, ...).
_STRICT_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname",
                             "ipv4", "ipv6", "uuid"})
_STRICT_KEEP = ("enum", "const", "pattern", "multipleOf", "minimum", "maximum",
                "exclusiveMinimum", "exclusiveMaximum", "minItems", "maxItems")
MAX_STRICT_DEPTH = 10
MAX_STRICT_PROPERTIES = 5000


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` (an object schema) in OpenAI's strict subset; `StrictSchemaError` if it
    cannot be expressed there. The input is not modified."""
    converter = _StrictConverter(schema)
    out = converter.node(schema, "", 0, root=True)
    if converter.defs:
        out["$defs"] = converter.defs
    return out


class _StrictConverter:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.defs: dict[str, dict[str, Any]] = {}
        self.def_names: dict[str, str] = {}   # $ref -> name in the output's $defs
        self.stack: list[str] = []            # the $refs being inlined (to find cycles)
        self.n_properties = 0

    def node(self, s: Any, path: str, depth: int, root: bool = False) -> dict[str, Any]:
        where = path or "the arguments"
        if not isinstance(s, dict):
            raise StrictSchemaError(f"{where}: a schema of {s!r} (any value) has no type")
        if "$ref" in s:
            return self.ref(s, path, depth, root)
        s = _normalise(s, where)
        out: dict[str, Any] = {}
        description = _description_with_default(s)
        if "anyOf" in s:
            if root:
                raise StrictSchemaError("the arguments must be an object, not a union")
            variants = [self.node(v, path, depth) for v in s["anyOf"]]
            if len(variants) == 1:
                out = variants[0]
            else:
                out["anyOf"] = variants
            if description:
                out["description"] = description
            return out
        typ = s.get("type")
        if typ is None:
            if "properties" in s:
                typ = "object"
            elif "items" in s:
                typ = "array"
            elif "enum" not in s and "const" not in s:
                raise StrictSchemaError(f"{where} has no type")
        types = [typ] if isinstance(typ, str) else list(typ or [])
        if root and types != ["object"]:
            raise StrictSchemaError("the arguments must be an object")
        if typ is not None:
            out["type"] = typ
        if "object" in types:
            out.update(self.object(s, path, depth, root))
        if "array" in types:
            items = s.get("items")
            if not isinstance(items, dict):
                raise StrictSchemaError(f"{where}: an array needs one `items` schema")
            out["items"] = self.node(items, f"{path}[]", depth + 1)
        for key in _STRICT_KEEP:
            if key in s:
                out[key] = s[key]
        if s.get("format") in _STRICT_FORMATS:
            out["format"] = s["format"]
        if description:
            out["description"] = description
        return out

    def object(self, s: dict[str, Any], path: str, depth: int, root: bool) -> dict[str, Any]:
        where = path or "the arguments"
        if depth + 1 > MAX_STRICT_DEPTH:
            raise StrictSchemaError(f"{where}: nested deeper than {MAX_STRICT_DEPTH} objects")
        props = s.get("properties")
        if props is None:
            if not root and s.get("additionalProperties") is not False:
                raise StrictSchemaError(f"{where}: a free-form object (no fixed properties)")
            props = {}
        required = set(s.get("required", []))
        self.n_properties += len(props)
        if self.n_properties > MAX_STRICT_PROPERTIES:
            raise StrictSchemaError(f"more than {MAX_STRICT_PROPERTIES} properties")
        out_props: dict[str, Any] = {}
        for key, sub in props.items():
            converted = self.node(sub, f"{path}.{key}" if path else key, depth + 1)
            if key not in required:
                converted = make_nullable(converted)
            out_props[key] = converted
        return {"properties": out_props, "required": list(out_props),
                "additionalProperties": False}

    def ref(self, s: dict[str, Any], path: str, depth: int, root: bool) -> dict[str, Any]:
        ref = s["$ref"]
        target = resolve_ref(self.root, ref)
        if ref in self.stack:  # a recursive schema: keep the reference, define it once
            name = self.def_names.get(ref)
            if name is None:
                name = self._def_name(ref)
                self.def_names[ref] = name
                self.defs[name] = {}  # placeholder while it is converted
                self.defs[name] = self.node(target, path, depth)
            return {"$ref": f"#/$defs/{name}"} if ref != "#" else {"$ref": "#"}
        siblings = {k: v for k, v in s.items() if k != "$ref"}
        self.stack.append(ref)
        try:
            return self.node({**target, **siblings}, path, depth, root)
        finally:
            self.stack.pop()

    def _def_name(self, ref: str) -> str:
        base = re.sub(r"[^A-Za-z0-9_]", "_", ref.rsplit("/", 1)[-1]) or "def"
        name, n = base, 1
        while name in self.defs:
            n += 1
            name = f"{base}_{n}"
        return name


def _normalise(s: dict[str, Any], where: str) -> dict[str, Any]:
    """OpenAPI 3.0 `nullable`, `oneOf` and `allOf` in the forms strict mode has."""
    s = dict(s)
    if s.pop("nullable", False) is True:
        s = make_nullable(s)
    if "oneOf" in s:
        if "anyOf" in s:
            raise StrictSchemaError(f"{where}: both anyOf and oneOf")
        s["anyOf"] = s.pop("oneOf")
    if "allOf" in s:
        parts = s.pop("allOf")
        if len(parts) == 1 and isinstance(parts[0], dict) and not s.keys() & {"properties", "type"}:
            s = {**parts[0], **s}
        else:
            s = _merge_objects(s, parts, where)
    return s


def _merge_objects(s: dict[str, Any], parts: list[Any], where: str) -> dict[str, Any]:
    merged = {k: v for k, v in s.items()}
    props = dict(merged.get("properties", {}))
    required = list(merged.get("required", []))
    for part in parts:
        if not isinstance(part, dict) or "$ref" in part or not (
                part.get("type") == "object" or "properties" in part):
            raise StrictSchemaError(f"{where}: allOf of anything but inline objects")
        props.update(part.get("properties", {}))
        required += [r for r in part.get("required", []) if r not in required]
    merged.update(type="object", properties=props, required=required)
    return merged


def _description_with_default(s: dict[str, Any]) -> str:
    description = str(s.get("description") or "").strip()
    if "default" in s and s["default"] is not None:
        shown = json.dumps(s["default"], default=str)
        if len(shown) <= 80:
            description = f"{description} (default: {shown})".strip()
    return description


def accepts_null(s: Any, root: dict[str, Any] | None = None, _seen: int = 0) -> bool:
    """Whether a schema admits null (following local `$ref`s in `root`)."""
    if not isinstance(s, dict) or _seen > 20:
        return s is True or s == {}
    if "$ref" in s and root is not None:
        try:
            return accepts_null(resolve_ref(root, s["$ref"]), root, _seen + 1)
        except StrictSchemaError:
            return False
    typ = s.get("type")
    if typ == "null" or (isinstance(typ, list) and "null" in typ) or s.get("nullable") is True:
        return True
    if "enum" in s and None in s["enum"]:
        return True
    if "const" in s and s["const"] is None:
        return True
    return any(accepts_null(v, root, _seen + 1) for v in s.get("anyOf", []) + s.get("oneOf", []))


def make_nullable(s: dict[str, Any]) -> dict[str, Any]:
    """`s` or null: in the type list for a scalar, as an `anyOf` otherwise."""
    if accepts_null(s):
        return s
    if "anyOf" in s:
        return {**s, "anyOf": [*s["anyOf"], {"type": "null"}]}
    typ = s.get("type")
    scalar = isinstance(typ, str) and typ in ("string", "number", "integer", "boolean")
    if scalar and "const" not in s and "enum" not in s:
        return {**s, "type": [typ, "null"]}
    inner = {k: v for k, v in s.items() if k != "description"}
    out = {"anyOf": [inner, {"type": "null"}]}
    if "description" in s:
        out["description"] = s["description"]
    return out


def resolve_ref(root: dict[str, Any], ref: str) -> dict[str, Any]:
    """The schema a local JSON pointer (`#/$defs/X`, `#/components/schemas/X`) names."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise StrictSchemaError(f"only local $refs are supported, not {ref!r}")
    node: Any = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            raise StrictSchemaError(f"$ref {ref!r} points at nothing")
        node = node[part]
    if not isinstance(node, dict):
        raise StrictSchemaError(f"$ref {ref!r} is not a schema")
    return node


def drop_optional_nulls(value: Any, schema: Any, root: dict[str, Any], _depth: int = 0) -> Any:
    """`value` without the nulls a strict-mode model sends for optional properties that
    do not themselves take null (so that their defaults apply), at every object level."""
    if _depth > 32 or not isinstance(schema, dict):
        return value
    for _ in range(20):  # follow $ref chains
        if "$ref" not in schema:
            break
        try:
            schema = resolve_ref(root, schema["$ref"])
        except StrictSchemaError:
            return value
    if isinstance(value, dict):
        props = _object_properties(schema, root)
        if props is None:
            return value
        properties, required = props
        out = {}
        for key, item in value.items():
            sub = properties.get(key)
            if item is None and sub is not None and key not in required \
                    and not accepts_null(sub, root):
                continue
            out[key] = drop_optional_nulls(item, sub, root, _depth + 1) if sub is not None else item
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [drop_optional_nulls(v, schema["items"], root, _depth + 1) for v in value]
    return value


def _object_properties(schema: dict[str, Any],
                       root: dict[str, Any]) -> tuple[dict[str, Any], set[str]] | None:
    if "properties" in schema or "allOf" in schema:
        props = dict(schema.get("properties", {}))
        required = set(schema.get("required", []))
        for part in schema.get("allOf", []):
            sub = _deref(part, root)
            props.update(sub.get("properties", {}))
            required |= set(sub.get("required", []))
        return props, required
    branches = [_deref(b, root) for b in schema.get("anyOf", []) + schema.get("oneOf", [])]
    objects = [b for b in branches if "properties" in b]
    if len(objects) == 1:
        return dict(objects[0]["properties"]), set(objects[0].get("required", []))
    return None


def _deref(s: Any, root: dict[str, Any]) -> dict[str, Any]:
    if isinstance(s, dict) and "$ref" in s:
        try:
            return resolve_ref(root, s["$ref"])
        except StrictSchemaError:
            return {}
    return s if isinstance(s, dict) else {}
