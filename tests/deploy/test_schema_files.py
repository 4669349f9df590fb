"""The JSON Schema files under tests/deploy/schemas, which the deployment tests validate the
manifests with: each is a valid 2020-12 schema that says what it is a subset of, and every
`$ref` resolves (a broken one would otherwise surface only when a document reaches it)."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urljoin

from jsonschema import Draft202012Validator
from referencing import Registry, Resource

SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"


def _refs(node: object) -> list[str]:
    if isinstance(node, dict):
        return ([node["$ref"]] if "$ref" in node else []) + [
            r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_every_schema_file_is_valid_and_every_ref_resolves():
    files = sorted(SCHEMA_DIR.glob("*.json"))
    assert {f.name for f in files} >= {"kubernetes.json", "keda.json", "kustomize.json",
                                       "compose.json", "kuberay.json"}
    docs = {f.name: json.loads(f.read_text()) for f in files}
    for name, doc in docs.items():
        assert doc["$schema"] == "https://json-schema.org/draft/2020-12/schema", name
        Draft202012Validator.check_schema(doc)
        assert doc["$id"].endswith("/" + name) and doc["description"], name
    registry = Registry().with_resources(
        (d["$id"], Resource.from_contents(d)) for d in docs.values())
    used: set[str] = set()
    for name, doc in docs.items():
        resolver = registry.resolver(base_uri=doc["$id"])
        for ref in _refs(doc):
            resolver.lookup(ref)            # raises Unresolvable
            used.add(urljoin(doc["$id"], ref))
    # every $defs entry is a kind the tests look up or is referred to
    for name, doc in docs.items():
        kinds = [(g["group"], g["version"], g["kind"]) for d in doc.get("$defs", {}).values()
                 for g in d.get("x-kubernetes-group-version-kind", [])]
        assert len(kinds) == len(set(kinds)), name
        for key, sub in doc.get("$defs", {}).items():
            assert ("x-kubernetes-group-version-kind" in sub
                    or f"{doc['$id']}#/$defs/{key}" in used), f"{name}: $defs/{key} is unused"
