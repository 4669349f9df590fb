"""The KubeRay manifest of `ridgeline train`: every document validates against the parts
of the Kubernetes and KubeRay (ray.io/v1) schemas a cluster would check, and the training
config it carries is a valid `TrainConfig` that runs on the Ray cluster."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from ridgeline.rl.run import TrainConfig

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kuberay" / "rayjob-train.yaml"

SCHEMA_FILE = Path(__file__).resolve().parent / "schemas" / "kuberay.json"


def _schemas(path: Path) -> dict[tuple[str, str], Draft202012Validator]:
    """A validator for every `$defs` entry of the JSON Schema file that names its
    (apiVersion, kind) in `x-kubernetes-group-version-kind`."""
    doc = json.loads(path.read_text())
    registry = Registry().with_resource(doc["$id"], Resource.from_contents(doc))
    kinds = {}
    for name, sub in doc["$defs"].items():
        for gvk in sub.get("x-kubernetes-group-version-kind", []):
            api = "/".join(p for p in (gvk["group"], gvk["version"]) if p)
            kinds[(api, gvk["kind"])] = Draft202012Validator(
                {"$ref": f"{doc['$id']}#/$defs/{name}"}, registry=registry)
    return kinds


SCHEMAS = _schemas(SCHEMA_FILE)


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def test_every_document_validates_against_its_schema(docs):
    assert {(d["apiVersion"], d["kind"]) for d in docs} == set(SCHEMAS)
    for d in docs:
        SCHEMAS[(d["apiVersion"], d["kind"])].validate(d)
        assert d["metadata"]["name"]


def test_the_schema_catches_what_a_cluster_would_refuse(docs):
    job = next(d for d in docs if d["kind"] == "RayJob")
    broken = yaml.safe_load(yaml.safe_dump(job))
    del broken["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["groupName"]
    with pytest.raises(jsonschema.ValidationError):
        SCHEMAS[("ray.io/v1", "RayJob")].validate(broken)
    broken = yaml.safe_load(yaml.safe_dump(job))
    broken["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 4
    with pytest.raises(jsonschema.ValidationError):      # start params are strings
        SCHEMAS[("ray.io/v1", "RayJob")].validate(broken)


def test_the_job_runs_a_valid_train_config_on_the_cluster(docs):
    job = next(d for d in docs if d["kind"] == "RayJob")
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["ridgeline", "train"]
    path = Path(argv[argv.index("--config") + 1])
    cluster = job["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    mount = next(m for c in head["containers"] for m in c["volumeMounts"]
                 if path.is_relative_to(m["mountPath"]))
    volume = next(v for v in head["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    cfg = TrainConfig.model_validate(yaml.safe_load(config_map["data"][path.name]))
    assert cfg.ray.enabled and cfg.ray.address == "auto"
    # checkpoints go to the volume every pod mounts (the trainer actor may run anywhere)
    runs = {m["mountPath"]: m["name"] for t in [head] + [
        g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
        for c in t["containers"] for m in c.get("volumeMounts", [])}
    assert any(cfg.out.is_relative_to(p) for p in runs)
    for group in cluster["workerGroupSpecs"]:
        cpus = float(group["rayStartParams"]["num-cpus"])
        assert cfg.ray.worker_cpus <= cpus     # a rollout worker fits on a worker pod
