"""The KubeRay manifest of `ridgeline train`: every document validates against the parts
of the Kubernetes and KubeRay (ray.io/v1) schemas a cluster would check, and the training
config it carries is a valid `TrainConfig` that runs on the Ray cluster."""

from __future__ import annotations

import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from ridgeline.rl.run import TrainConfig

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kuberay" / "rayjob-train.yaml"

QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string",
                                             "pattern": r"^[0-9.]+(m|Ki|Mi|Gi|Ti|k|M|G|T)?$"}]}
CONTAINER = {
    "type": "object", "required": ["name", "image"],
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
        "image": {"type": "string", "minLength": 1},
        "resources": {"type": "object", "additionalProperties": False, "properties": {
            "requests": {"type": "object", "additionalProperties": QUANTITY},
            "limits": {"type": "object", "additionalProperties": QUANTITY}}},
        "ports": {"type": "array", "items": {
            "type": "object", "required": ["containerPort"],
            "properties": {"containerPort": {"type": "integer", "minimum": 1,
                                             "maximum": 65535},
                           "name": {"type": "string", "maxLength": 15}}}},
        "volumeMounts": {"type": "array", "items": {
            "type": "object", "required": ["name", "mountPath"]}},
        "securityContext": {"type": "object"},
    },
}
POD_TEMPLATE = {
    "type": "object", "required": ["spec"],
    "properties": {"spec": {
        "type": "object", "required": ["containers"],
        "properties": {
            "containers": {"type": "array", "minItems": 1, "items": CONTAINER},
            "volumes": {"type": "array", "items": {"type": "object", "required": ["name"]}},
        }}},
}
START_PARAMS = {"type": "object", "additionalProperties": {"type": "string"}}
RAY_CLUSTER_SPEC = {
    "type": "object", "required": ["headGroupSpec"],
    "properties": {
        "rayVersion": {"type": "string"},
        "headGroupSpec": {"type": "object", "required": ["template"],
                          "properties": {"rayStartParams": START_PARAMS,
                                         "template": POD_TEMPLATE}},
        "workerGroupSpecs": {"type": "array", "items": {
            "type": "object", "required": ["groupName", "template"],
            "properties": {"groupName": {"type": "string"},
                           "replicas": {"type": "integer", "minimum": 0},
                           "minReplicas": {"type": "integer", "minimum": 0},
                           "maxReplicas": {"type": "integer", "minimum": 0},
                           "rayStartParams": START_PARAMS, "template": POD_TEMPLATE}}},
    },
}
SCHEMAS = {
    ("ray.io/v1", "RayJob"): {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"spec": {
            "type": "object", "required": ["entrypoint", "rayClusterSpec"],
            "properties": {
                "entrypoint": {"type": "string", "minLength": 1},
                "shutdownAfterJobFinishes": {"type": "boolean"},
                "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
                "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode",
                                            "SidecarMode"]},
                "rayClusterSpec": RAY_CLUSTER_SPEC}}}},
    ("v1", "ConfigMap"): {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "data"],
        "properties": {"data": {"type": "object", "additionalProperties": {"type": "string"}}}},
    ("v1", "PersistentVolumeClaim"): {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"spec": {"type": "object", "required": ["accessModes", "resources"]}}},
}


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def test_every_document_validates_against_its_schema(docs):
    assert {(d["apiVersion"], d["kind"]) for d in docs} == set(SCHEMAS)
    for d in docs:
        jsonschema.validate(d, SCHEMAS[(d["apiVersion"], d["kind"])])
        assert d["metadata"]["name"]


def test_the_schema_catches_what_a_cluster_would_refuse(docs):
    job = next(d for d in docs if d["kind"] == "RayJob")
    broken = yaml.safe_load(yaml.safe_dump(job))
    del broken["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["groupName"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCHEMAS[("ray.io/v1", "RayJob")])
    broken = yaml.safe_load(yaml.safe_dump(job))
    broken["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 4
    with pytest.raises(jsonschema.ValidationError):      # start params are strings
        jsonschema.validate(broken, SCHEMAS[("ray.io/v1", "RayJob")])


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
