"""Task images built for real (tasks/images.py): the FROM mapping, the typed refusals,
and one small task built by podman and run in the bwrap sandbox on its root."""

from __future__ import annotations

import socket
import time
from dataclasses import replace
from pathlib import Path

import pytest

from ridgeline.errors import ConfigError, SandboxError
from ridgeline.tasks import (
    TaskUnsupported, VerdictStatus, apply_solution, load_task, prepare_environment,
    verdict_from_error, verify,
)
from ridgeline.tasks.images import (
    DEBIAN_IMAGE, MAP_ENV, MODE_ENV, PYTHON_IMAGE, BuildRefused, ImageBuilder, build_failure,
    builder,
    environment_mode, map_base, rewrite_dockerfile,
)

FIXTURES = Path(__file__).parent / "fixtures"


# -- the FROM mapping and the rewrite (no podman needed) ---------------------------------

@pytest.mark.parametrize("ref,local", [
    ("python:3.13-slim-bookworm", PYTHON_IMAGE),
    ("docker.io/library/python:3.11", PYTHON_IMAGE),
    ("ubuntu:24.04", DEBIAN_IMAGE),
    ("debian:bookworm-slim", DEBIAN_IMAGE),
    ("ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624",
     "localhost/ridgeline/t-bench-debian:bookworm"),
    ("ghcr.io/laude-institute/t-bench/python-3-13:20250620",
     "localhost/ridgeline/t-bench-python:bookworm"),
    ("public.ecr.aws/docker/library/python:3.11-slim", PYTHON_IMAGE),
    ("ghcr.io/astral-sh/uv:0.8.15", "localhost/ridgeline/uv:0.8.15"),
    ("buildpack-deps:jammy", "localhost/ridgeline/buildpack-deps:bookworm"),
    ("eclipse-temurin:17.0.12_7-jdk-jammy", "localhost/ridgeline/jdk:17"),
    ("eclipse-temurin:21-jdk", None),
    ("node:20", None),
    ("nvidia/cuda:12.4-devel", None),
])
def test_base_images_map_to_local_ones(ref, local):
    assert map_base(ref) == local


def test_a_user_map_adds_and_overrides(tmp_path, monkeypatch):
    f = tmp_path / "map.toml"
    f.write_text('[map]\n"node:*" = "localhost/mine/node:20"\n"python:3.13*" = "localhost/py313"\n')
    monkeypatch.setenv(MAP_ENV, str(f))
    assert map_base("node:20-bookworm") == "localhost/mine/node:20"
    assert map_base("python:3.13-slim") == "localhost/py313"
    assert map_base("python:3.11") == PYTHON_IMAGE
    f.write_text("[map]\nnode = 3\n")
    with pytest.raises(ConfigError, match="map patterns to image names"):
        map_base("node")


def test_a_bad_mode_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(MODE_ENV, "docker")
    with pytest.raises(ConfigError, match="auto, image, host"):
        environment_mode()


def test_rewrite_maps_every_stage_and_keeps_stage_names(tmp_path):
    df = tmp_path / "Dockerfile"
    df.write_text("ARG BASE=python:3.12-slim\n"
                  "FROM ${BASE} AS build\n"
                  "RUN echo built > /out\n"
                  "FROM --platform=linux/amd64 ubuntu:24.04\n"
                  "COPY --from=build /out /out\n"
                  "COPY --from=debian:bookworm /etc/debian_version /v\n")
    text, bases = rewrite_dockerfile(df)
    lines = text.splitlines()
    assert lines[1] == f"FROM {PYTHON_IMAGE} AS build"
    assert lines[3] == f"FROM {DEBIAN_IMAGE}"
    assert lines[4] == "COPY --from=build /out /out"
    assert lines[5] == f"COPY --from={DEBIAN_IMAGE} /etc/debian_version /v"
    assert bases == sorted({DEBIAN_IMAGE, PYTHON_IMAGE})


def test_heredocs_become_instructions_podman_4_can_build(tmp_path):
    """buildah 1.28 has no heredocs: each becomes one exec-form RUN of the same shell
    text, so what the shell runs is what BuildKit would run."""
    import json
    df = tmp_path / "Dockerfile"
    df.write_text("FROM python:3.12\n"
                  "RUN python3 - << 'PY'\nprint('a')\nPY\n"
                  "RUN <<EOF\necho $HOME\nEOF\n"
                  "SHELL [\"/bin/bash\", \"-c\"]\n"
                  "RUN <<-EOF cat > /x\n\tline\nEOF\n"
                  "COPY --chmod=600 <<EOF /etc/app/conf\nk=v\nEOF\n"
                  "WORKDIR /app\n")
    lines = [ln for ln in rewrite_dockerfile(df)[0].splitlines() if ln]
    assert len(lines) == 7
    assert json.loads(lines[1].split(None, 1)[1]) == [
        "/bin/sh", "-c", "python3 - << 'PY'\nprint('a')\nPY\n"]
    assert json.loads(lines[2].split(None, 1)[1]) == ["/bin/sh", "-c", "echo $HOME\n"]
    assert json.loads(lines[4].split(None, 1)[1]) == [
        "/bin/bash", "-c", "<<-EOF cat > /x\nline\nEOF\n"]
    copy = json.loads(lines[5].split(None, 1)[1])[2]
    assert "base64 -d > /etc/app/conf" in copy and "chmod 600" in copy
    assert lines[6] == "WORKDIR /app"


@pytest.mark.parametrize("dockerfile,line,words", [
    ("FROM python:3.12\nFROM node:20 AS web\n", 2, "'node:20' has no local equivalent"),
    ("FROM python:3.12\nRUN --mount=type=secret,id=tok cat /run/secrets/tok\n", 2,
     "secret"),
    ("FROM ubuntu:24.04\nCOPY --from=golang:1.22 /usr/local/go /go\n", 2, "golang:1.22"),
])
def test_what_cannot_be_built_is_refused_with_its_line(tmp_path, dockerfile, line, words):
    df = tmp_path / "Dockerfile"
    df.write_text(dockerfile)
    with pytest.raises(BuildRefused) as e:
        rewrite_dockerfile(df)
    assert e.value.line == line and words in e.value.reason


def test_build_failures_are_classified(tmp_path):
    df = tmp_path / "Dockerfile"
    df.write_text("FROM ubuntu:24.04\nRUN apt-get update && apt-get install -y nosuchpkg\n"
                  "RUN pip install --retries 3 nosuchdist==1.0\n")
    apt = ("STEP 1/3: FROM localhost/ridgeline/debian:bookworm\n"
           "STEP 2/3: RUN apt-get update && apt-get install -y nosuchpkg\n"
           "E: Unable to locate package nosuchpkg\nError: building at STEP ...")
    e = build_failure(apt, df)
    assert isinstance(e, BuildRefused) and e.line == 2
    assert "Debian mirror has no package nosuchpkg" in e.reason
    pip = ("[2/2] STEP 3/3: RUN pip install --retries 3 nosuchdist==1.0\n"
           "ERROR: No matching distribution found for nosuchdist==1.0\n")
    e = build_failure(pip, df)
    assert isinstance(e, BuildRefused) and e.line == 3 and "PyPI has no" in e.reason
    e = build_failure("[1/2] STEP 2/3: RUN apt-get update\nerror running container: runc create "
                      "failed: unable to start container process", df)
    assert isinstance(e, SandboxError) and not isinstance(e, BuildRefused)


# -- built for real ------------------------------------------------------------------

def _images_or_skip():
    if (why := builder().unavailable_reason()) is not None:
        pytest.skip(f"task images unavailable here: {why}")


TASK_DOCKERFILE = """\
FROM python:3.12-slim AS tools
RUN printf '#!/bin/sh\\necho built-in-stage-one\\n' > /stage-tool && chmod 755 /stage-tool

FROM python:3.13-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends jq \\
    && rm -rf /var/lib/apt/lists/*
RUN pip install --retries 3 --no-cache-dir pytest==8.4.1
RUN groupadd dev && useradd -m -g dev alice && echo greeting=hello > /etc/greeting.conf
COPY --from=tools /stage-tool /usr/local/bin/stage-tool
COPY helper.sh /usr/local/bin/helper
WORKDIR /app
RUN echo seed > /app/seed.txt && mkdir /data && echo raw > /data/in.txt
ENV GREETING_FILE=/etc/greeting.conf
ENTRYPOINT ["/bin/bash", "-l"]
"""

TESTS = """\
import os, pathlib, subprocess

def sh(cmd):
    return subprocess.run(cmd, shell=True, capture_output=True, text=True)

def test_the_image_is_what_the_dockerfile_built():
    assert pathlib.Path(os.environ["GREETING_FILE"]).read_text().strip() == "greeting=hello"
    assert sh("helper").stdout.strip() == "helper-ran"
    assert sh("stage-tool").stdout.strip() == "built-in-stage-one"
    assert sh("dpkg -s jq").returncode == 0          # dpkg's state is the image's
    assert sh("id alice").returncode == 0 and os.path.isdir("/home/alice")
    assert pathlib.Path("/app/seed.txt").read_text().strip() == "seed"

def test_the_agent_did_the_task():
    assert pathlib.Path("/app/answer.txt").read_text().split() == ["alice"]
    assert pathlib.Path("/data/in.txt").read_text() == "raw\\nseen\\n"   # a tree the build made
"""


@pytest.fixture(scope="module")
def image_task(tmp_path_factory):
    _images_or_skip()
    d = tmp_path_factory.mktemp("image-task")
    (d / "tests").mkdir()
    (d / "task.yaml").write_text(
        "instruction: Write the names of the directories under /home into "
        "/app/answer.txt, one per line.\ndifficulty: easy\ncategory: files\n"
        "parser_name: pytest\nmax_agent_timeout_sec: 120\nmax_test_timeout_sec: 120\n")
    (d / "Dockerfile").write_text(TASK_DOCKERFILE)
    (d / "helper.sh").write_text("#!/bin/sh\necho helper-ran\n")
    (d / "helper.sh").chmod(0o755)
    (d / "run-tests.sh").write_text("#!/bin/bash\ncd /app\npytest $TEST_DIR/test_outputs.py -rA\n")
    # apt-get at run time: the package is installed (the image's dpkg says so), so it
    # succeeds offline, as under Docker.
    (d / "solution.sh").write_text("#!/bin/bash\napt-get install -y jq\nls /home > /app/answer.txt\n"
                                   "echo seen >> /data/in.txt\n")
    (d / "tests" / "test_outputs.py").write_text(TESTS)
    return load_task(d)


def _episode(task, oracle):
    try:
        with prepare_environment(task, mode="image") as sb:
            if oracle:
                apply_solution(task, sb)
            return verify(task, sb), sb.image
    except Exception as e:  # noqa: BLE001 - the verdict says what happened
        return verdict_from_error(e), None


def test_a_task_image_is_built_for_real_and_its_oracle_passes(image_task):
    # The host-root mode cannot run this task at all (writes to /etc, /usr/local/bin,
    # users, a second stage): the image mode can.
    assert image_task.unsupported_reason_in(images=False) is not None
    assert image_task.unsupported_reason_in(images=True) is None
    null, _ = _episode(image_task, oracle=False)
    assert null.status is VerdictStatus.FAILED, (null.detail, null.output)
    assert (null.tests_passed, null.tests_total) == (1, 2)
    oracle, image = _episode(image_task, oracle=True)
    assert oracle.status is VerdictStatus.PASSED, (oracle.detail, oracle.output)
    assert image is not None and image.cached   # the null run built it
    assert image.config.entrypoint == ("/bin/bash", "-l")
    assert image.config.env["GREETING_FILE"] == "/etc/greeting.conf"
    assert image.config.workdir == "/app"


def test_a_second_build_of_the_same_task_is_a_lookup(image_task):
    t0 = time.perf_counter()
    image = ImageBuilder().build(image_task.build.source, image_task.build.context)  # podman
    assert image.cached and time.perf_counter() - t0 < 3.0


def test_the_sandbox_on_a_built_image_keeps_its_isolation(image_task):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    try:
        with prepare_environment(image_task, mode="image") as sb:
            caps = sb.run("grep -E '^Cap(Prm|Eff)' /proc/self/status").stdout
            assert caps.count("0000000000000000") == 2, caps
            assert sb.run("id -u").stdout.strip() == "1000"
            # The image's root is read-only; the workspace (its WORKDIR) is writable.
            for target in ("/etc/probe", "/usr/local/bin/probe", "/probe", "/home/alice/x"):
                assert sb.run(f"echo x > {target}").exit_code != 0, target
            assert sb.run("echo x > /app/probe && cat /app/seed.txt").stdout == "seed\n"
            # HOME (/root, which the image has too) is the task's writable home.
            assert sb.run("mkdir -p /root/.local/bin && touch /root/.local/bin/env").ok
            # Setuid files of the image give nothing: its trees are mounted nosuid.
            mounts = sb.run(r"grep -E ' /(usr|bin|etc) ' /proc/self/mountinfo").stdout
            assert mounts.count("nosuid") >= 2 and "ro," in mounts, mounts
            # No network: neither the host's loopback nor a name lookup.
            probe = ("import socket,sys\ntry:\n socket.create_connection(('127.0.0.1', "
                     f"{port}), timeout=2); print('CONNECTED')\nexcept OSError: print('NO')")
            assert sb.run(["python3", "-c", probe]).stdout.strip() == "NO"
            assert sb.run(["python3", "-c", "import socket; socket.getaddrinfo("
                           "'deb.debian.org', 80)"]).exit_code != 0
            # Loopback is up and localhost resolves (as in a Docker container, whose
            # /etc/hosts the engine writes; podman leaves the image's empty).
            server = ("import socket\ns = socket.socket(); s.bind(('localhost', 0)); "
                      "s.listen(1)\nc = socket.create_connection(s.getsockname()); print('UP')")
            assert sb.run(["python3", "-c", server]).stdout.strip() == "UP"
            # The host's files stay invisible: only the image and the mounts are there.
            assert sb.run(["test", "-e", __file__]).exit_code != 0
            assert sb.run("test -e /root/.bashrc").exit_code != 0   # HOME is the task's
    finally:
        srv.close()


def test_the_docker_backend_runs_the_same_image(image_task, docker_engine):
    """The engine behind the docker backend (podman's API here) starts a container from
    the image podman built: the same verdicts as on bwrap, with that backend's
    isolation (no capabilities, read-only root, no network)."""
    def episode(oracle):
        with prepare_environment(image_task, backend="docker", mode="image") as sb:
            assert sb.inner.backend == "docker"
            assert sb.run("echo x > /etc/probe").exit_code != 0
            caps = sb.run("grep -E '^CapEff' /proc/self/status").stdout
            assert "0000000000000000" in caps, caps
            assert sb.run(["python3", "-c", "import socket; socket.getaddrinfo("
                           "'deb.debian.org', 80)"]).exit_code != 0
            if oracle:
                apply_solution(image_task, sb)
            return verify(image_task, sb)

    null = episode(oracle=False)
    assert null.status is VerdictStatus.FAILED, (null.detail, null.output)
    assert (null.tests_passed, null.tests_total) == (1, 2)
    oracle = episode(oracle=True)
    assert oracle.status is VerdictStatus.PASSED, (oracle.detail, oracle.output)


def test_the_docker_backend_refuses_compose_sidecars(tmp_path):
    task = load_task(_sidecar_task(tmp_path / "t"))
    with pytest.raises(TaskUnsupported, match="bwrap backend"):
        prepare_environment(task, backend="docker", mode="image")


def test_an_unmapped_base_image_is_unsupported_with_its_line(tmp_path):
    _images_or_skip()
    d = tmp_path / "t"
    (d / "tests").mkdir(parents=True)
    (d / "task.yaml").write_text("instruction: x\nparser_name: pytest\n")
    (d / "Dockerfile").write_text("FROM python:3.12\nFROM rust:1.80\nWORKDIR /app\n")
    (d / "run-tests.sh").write_text("#!/bin/bash\ntrue\n")
    (d / "tests" / "test_outputs.py").write_text("def test_x(): pass\n")
    task = load_task(d)
    with pytest.raises(TaskUnsupported, match=r"line 2: base image 'rust:1.80' has no local"):
        prepare_environment(task, mode="image")


@pytest.mark.parametrize("name", ["tb1-hello-world", "tb1-fix-script", "harbor-word-count",
                                  "harbor-partial-reward"])
def test_the_fixture_tasks_run_unchanged_on_images(name):
    _images_or_skip()
    task = load_task(FIXTURES / name)
    null, _ = _episode(task, oracle=False)
    assert null.status is VerdictStatus.FAILED, (null.detail, null.output)
    oracle, image = _episode(task, oracle=True)
    assert image is not None
    assert oracle.status is VerdictStatus.PASSED, (oracle.detail, oracle.output)


def test_an_rl_group_forks_one_prepared_task_environment(image_task):
    with prepare_environment(image_task, mode="image") as sb:
        assert sb.run("echo step-one > /app/progress.txt").ok   # an agent step so far
        kids = sb.fork(3)
        try:
            for i, k in enumerate(kids):
                assert k.image is sb.image
                assert k.run("cat /app/progress.txt /app/seed.txt").stdout == "step-one\nseed\n"
                assert k.logs_host_dir != sb.logs_host_dir
                assert k.run(f"echo fork{i} >> /data/in.txt").ok   # its own copy of /data
            assert kids[2].run("cat /data/in.txt").stdout == "raw\nfork2\n"
            assert sb.run("cat /data/in.txt").stdout == "raw\n"
            assert kids[0].run("echo raw > /data/in.txt").ok   # as the task began
            apply_solution(image_task, kids[0])
            assert verify(image_task, kids[0]).status is VerdictStatus.PASSED
            assert verify(image_task, kids[1]).status is VerdictStatus.FAILED
            assert not (sb.workspace_dir / "answer.txt").exists()
        finally:
            for k in kids:
                k.close()


def test_an_absolute_copy_source_is_read_from_the_context_root(tmp_path):
    from ridgeline.tasks.dockerfile import CopyStep, plan_build
    (tmp_path / "data.txt").write_text("x")
    df = tmp_path / "Dockerfile"
    df.write_text("FROM python:3.12\nWORKDIR /app\nCOPY /data.txt /app/\n")
    steps, _ = plan_build(df, tmp_path).steps({"PATH": "/usr/bin"})
    copy = next(s for s in steps if isinstance(s, CopyStep))
    assert list(copy.sources) == [tmp_path / "data.txt"]


SERVER = """\
import os
from http.server import BaseHTTPRequestHandler, HTTPServer

class H(BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path == "/secret"
        self.send_response(200 if ok else 404)
        self.end_headers()
        self.wfile.write(os.environ["SECRET"].encode() if ok else b"?")

HTTPServer(("0.0.0.0", 8080), H).serve_forever()
"""


def _write_files(root: Path, files: dict[str, str]) -> Path:
    """A task directory from {relative path: text}."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


#: A Harbor test.sh whose reward is whether pytest passed.
REWARD_FROM_PYTEST = ("#!/bin/bash\ncd /app\npytest /tests/test_outputs.py -rA && echo 1 > "
                      "/logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n")


def _sidecar_task(d: Path) -> Path:
    """A Harbor task whose compose file adds an API server the tests and agent reach
    by its service name."""
    return _write_files(d, {
        "task.toml": 'version = "1.0"\n[metadata]\ndifficulty = "easy"\n'
                     '[verifier]\ntimeout_sec = 120\n[agent]\ntimeout_sec = 120\n',
        "instruction.md": "Fetch http://api:8080/secret into /app/secret.txt.\n",
        "environment/Dockerfile": "FROM python:3.12-slim\nRUN pip install --no-cache-dir "
                                  "pytest==8.4.1\nWORKDIR /app\n",
        "environment/docker-compose.yaml":
            "services:\n  main:\n    build: .\n  api:\n    build: ./api\n"
            "    expose: [\"8080\"]\n    environment:\n      SECRET: copper-42\n",
        "environment/api/Dockerfile": "FROM python:3.12-slim\nWORKDIR /srv\nCOPY server.py "
                                      "/srv/server.py\nCMD [\"python3\", \"/srv/server.py\"]\n",
        "environment/api/server.py": SERVER,
        "solution/solve.sh": "#!/bin/bash\npython3 -c \"import urllib.request; open("
                             "'/app/secret.txt', 'w').write(urllib.request.urlopen("
                             "'http://api:8080/secret').read().decode())\"\n",
        "tests/test.sh": REWARD_FROM_PYTEST,
        "tests/test_outputs.py":
            "import pathlib, urllib.request\n\ndef test_secret():\n"
            "    live = urllib.request.urlopen('http://api:8080/secret', timeout=5).read()\n"
            "    assert pathlib.Path('/app/secret.txt').read_text() == live.decode() == "
            "'copper-42'\n"})


def test_a_compose_sidecar_is_reached_by_its_service_name(tmp_path):
    _images_or_skip()
    task = load_task(_sidecar_task(tmp_path / "sidecar-task"))
    assert [c.name for c in task.sidecars] == ["api"] and task.sidecars[0].ports == (8080,)
    assert "need the image mode" in task.unsupported_reason_in(images=False)
    null, _ = _episode(task, oracle=False)
    assert null.status is VerdictStatus.FAILED, (null.detail, null.output)
    oracle, _ = _episode(task, oracle=True)
    assert oracle.status is VerdictStatus.PASSED, (oracle.detail, oracle.output)
    with prepare_environment(task, mode="image") as sb:
        assert set(sb.sidecars) == {"api"}
        net = sb.network.path
        with pytest.raises(Exception, match="cannot fork"):
            sb.fork(2)
    assert not net.exists()   # the sidecars and their network end with the task


def test_task_trees_are_what_the_build_made_beside_the_system_and_the_harness(tmp_path):
    from ridgeline.tasks.image_environment import task_trees
    from ridgeline.tasks.images import BuiltImage, ImageConfig
    for name in ("bin", "usr", "etc", "var", "data", "logs", "tests", "app", "workspace"):
        (tmp_path / name).mkdir()
    (tmp_path / "link").symlink_to("data")
    image = BuiltImage("ref", "id", tmp_path, ImageConfig(), 0.0, True)
    assert task_trees(image, "/app") == ["/data", "/workspace"]
    assert task_trees(image, "/workspace/src") == ["/app", "/data"]


def _separate_verifier_task(d: Path, storage: str = "",
                            artifact: str = "/root/results/answer.txt") -> Path:
    """Harbor's verifier.environment_mode = "separate": the tests run in their own image
    (with pytest, which the agent's lacks), given the declared artifacts only."""
    return _write_files(d, {
        "task.toml": f'version = "1.0"\nartifacts = ["{artifact}"]\n'
                     '[verifier]\ntimeout_sec = 120\nenvironment_mode = "separate"\n'
                     f'[agent]\ntimeout_sec = 120\n[environment]\n{storage}\n',
        "instruction.md": "Write 42 to /root/results/answer.txt.\n",
        "environment/Dockerfile": "FROM python:3.12-slim\nWORKDIR /app\n",
        "tests/Dockerfile": "FROM python:3.12-slim\nRUN pip install --no-cache-dir "
                            "pytest==8.4.1\n",
        "solution/solve.sh": "#!/bin/bash\nmkdir -p /root/results\necho 42 > "
                             "/root/results/answer.txt\necho agent-only > /app/note.txt\n",
        "tests/test.sh": REWARD_FROM_PYTEST,
        "tests/test_outputs.py":
            "import os, pathlib\n\ndef test_answer():\n"
            "    assert pathlib.Path('/root/results/answer.txt').read_text() == '42\\n'\n"
            "    assert not os.path.exists('/app/note.txt')   # only the artifacts come over\n"})


def test_a_separate_verifier_environment_gets_only_the_artifacts(tmp_path):
    _images_or_skip()
    task = load_task(_separate_verifier_task(tmp_path / "separate"))
    assert task.artifacts == ("/root/results/answer.txt",)
    assert "needs the image mode" in task.unsupported_reason_in(images=False)
    null, _ = _episode(task, oracle=False)
    assert null.status is VerdictStatus.FAILED, (null.detail, null.output)
    oracle, _ = _episode(task, oracle=True)
    assert oracle.status is VerdictStatus.PASSED, (oracle.detail, oracle.output)


def test_artifacts_larger_than_the_tasks_storage_are_the_agents_failure(tmp_path):
    _images_or_skip()
    task = load_task(_separate_verifier_task(tmp_path / "big", storage="storage_mb = 4",
                                             artifact="/root/results"))
    with prepare_environment(task, mode="image") as sb:
        # sparse files: 18 MB to archive, no blocks on the agent's (4 MB) disk
        assert sb.run("mkdir -p /root/results && for i in 1 2 3 4 5 6; do truncate -s 3M "
                      "/root/results/part$i; done").ok
        v = verify(task, sb)
    assert v.status is VerdictStatus.FAILED and v.reason == "artifacts_too_large", v.detail


def test_idle_images_are_unmounted_beyond_a_few(image_task):
    """Each mount in the host's namespace is copied into every new sandbox's: images no
    sandbox runs on are unmounted, but for the latest MAX_IDLE_MOUNTS."""
    from ridgeline.tasks.images import MAX_IDLE_MOUNTS
    names = ["tb1-hello-world", "tb1-fix-script", "harbor-word-count",
             "harbor-partial-reward", "tb1-csv-summary"]
    b = builder()
    with prepare_environment(image_task, mode="image") as held:
        for name in names:
            with prepare_environment(load_task(FIXTURES / name), mode="image") as sb:
                assert sb.run("true").ok
        mounted = {r for r in b._mounted}
        assert held.image.ref in mounted                       # in use: kept
        assert len(mounted - {held.image.ref}) <= MAX_IDLE_MOUNTS
        assert held.run("cat /app/seed.txt").stdout == "seed\n"
    # an unmounted image is mounted again when a task needs it
    with prepare_environment(load_task(FIXTURES / names[0]), mode="image") as sb:
        assert sb.run("true").ok


def test_auto_falls_back_to_the_host_root_mode_where_no_image_can_be_built(monkeypatch):
    from ridgeline.tasks.images import ImageBuilder, ImagesUnavailable

    def no_mirror(self, *a, **kw):
        raise ImagesUnavailable("mmdebstrap could not build the Debian base image")

    monkeypatch.setattr(ImageBuilder, "build", no_mirror)
    monkeypatch.setattr(ImageBuilder, "unavailable_reason", lambda self: None)
    task = load_task(FIXTURES / "tb1-hello-world")
    with prepare_environment(task, mode="auto") as sb:
        assert sb.image is None and sb.run("true").ok      # the host-root mode
    with pytest.raises(TaskUnsupported, match="cannot be built here"):
        prepare_environment(task, mode="image")


def test_a_build_step_cannot_reach_the_hosts_loopback(tmp_path):
    """Builds reach the package registries through podman's own network, never the
    host's: a task's RUN cannot talk to services bound to the host's 127.0.0.1."""
    _images_or_skip()
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    try:
        (tmp_path / "Dockerfile").write_text(
            "FROM python:3.12-slim\n"
            f"RUN python3 -c \"import socket; s = socket.socket(); s.settimeout(3); "
            f"print(s.connect_ex(('127.0.0.1', {port})))\" > /probe.txt\n")
        image = ImageBuilder().build(tmp_path / "Dockerfile", tmp_path, no_cache=True)
        assert (image.rootfs / "probe.txt").read_text().strip() != "0"   # not connected
    finally:
        srv.close()


def test_tasks_images_builds_the_bases_and_a_suites_images(tmp_path):
    import json
    import shutil

    from typer.testing import CliRunner

    from ridgeline.tasks.cli import app
    _images_or_skip()
    shutil.copytree(FIXTURES / "harbor-hello", tmp_path / "harbor-hello")
    (tmp_path / "unmapped").mkdir()
    shutil.copytree(FIXTURES / "tb1-hello-world", tmp_path / "unmapped", dirs_exist_ok=True)
    (tmp_path / "unmapped" / "Dockerfile").write_text("FROM rust:1.80\nWORKDIR /app\n")
    r = CliRunner().invoke(app, ["images", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    rows = {row["image"]: row for row in json.loads(r.output)}
    assert rows[DEBIAN_IMAGE]["status"] == rows[PYTHON_IMAGE]["status"] == "ready"
    assert rows["harbor-hello"]["status"] in ("built", "cached")
    assert rows["unmapped"]["status"].startswith("unsupported: Dockerfile line 1")


def test_a_changed_file_of_the_context_rebuilds_the_image(tmp_path):
    """Within a process the context's contents are read once while it is unchanged; a
    change (even at the same size) gives another image."""
    _images_or_skip()
    (tmp_path / "Dockerfile").write_text("FROM python:3.12-slim\nCOPY a.txt /a.txt\n")
    (tmp_path / "a.txt").write_text("one\n")
    b = builder()
    first = b.build(tmp_path / "Dockerfile", tmp_path)
    assert b.build(tmp_path / "Dockerfile", tmp_path).ref == first.ref
    (tmp_path / "a.txt").write_text("two\n")
    second = b.build(tmp_path / "Dockerfile", tmp_path)
    assert second.ref != first.ref and (second.rootfs / "a.txt").read_text() == "two\n"


def test_internet_needs_the_task_and_the_operator(monkeypatch):
    """A task that allows the internet (Harbor's default) gets it only where the operator
    says `RIDGELINE_TASK_INTERNET=allow`; a task that does not, never."""
    task = load_task(FIXTURES / "harbor-hello")
    assert task.resources.allow_internet
    probe = "cat /proc/net/dev; cat /etc/resolv.conf 2>/dev/null || true"

    def links(t):
        with prepare_environment(t) as sb:
            return sb.run(probe).stdout
    monkeypatch.delenv("RIDGELINE_TASK_INTERNET", raising=False)
    assert "tap0" not in links(task)
    monkeypatch.setenv("RIDGELINE_TASK_INTERNET", "allow")
    out = links(task)
    assert "tap0" in out and "nameserver 10.0.2.3" in out
    offline = replace(task, resources=replace(task.resources, allow_internet=False))
    assert "tap0" not in links(offline)
    monkeypatch.setenv("RIDGELINE_TASK_INTERNET", "maybe")
    with pytest.raises(ConfigError, match="RIDGELINE_TASK_INTERNET"):
        prepare_environment(task)
