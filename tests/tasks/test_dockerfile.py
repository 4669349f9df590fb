"""Reading Dockerfiles without Docker: parsing, variable expansion, and the plan of what
can be honoured here."""

from __future__ import annotations

from pathlib import Path

import pytest

from ridgeline.errors import TaskError
from ridgeline.tasks.dockerfile import (
    CopyStep, MkdirStep, RunStep, expand, image_problem, parse_dockerfile, plan_build,
)

BASE = {"PATH": "/usr/bin:/bin", "HOME": "/root"}


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "Dockerfile"
    p.write_text(text)
    return p


def test_parse_continuations_comments_and_exec_form(tmp_path):
    ins = parse_dockerfile(write(tmp_path, """# syntax comment
FROM python:3.12-slim AS base
RUN apt-get update && \\
    # a comment inside the continuation
    apt-get install -y git \\
    && rm -rf /var/lib/apt/lists/*
COPY --chown=1000:1000 ["a b.txt", "/app/"]
CMD ["python", "app.py"]
"""))
    assert [i.keyword for i in ins] == ["FROM", "RUN", "COPY", "CMD"]
    assert ins[1].line == 3 and "apt-get install -y git" in ins[1].args
    assert "#" not in ins[1].args
    assert ins[2].flags == {"chown": "1000:1000"} and ins[2].exec_form == ("a b.txt", "/app/")


def test_parse_heredoc(tmp_path):
    ins = parse_dockerfile(write(tmp_path, """FROM ubuntu:24.04
RUN <<EOF
echo one
echo two
EOF
COPY <<EOF /app/greeting.txt
hello
EOF
WORKDIR /app
"""))
    assert [i.keyword for i in ins] == ["FROM", "RUN", "COPY", "WORKDIR"]
    assert ins[1].heredocs == ("echo one\necho two\n",)
    assert ins[2].heredocs == ("hello\n",)


def test_parse_escape_directive(tmp_path):
    ins = parse_dockerfile(write(tmp_path, "# escape=`\nFROM ubuntu\nRUN echo a `\n  b\n"))
    assert ins[1].args == "echo a  b" or ins[1].args.split() == ["echo", "a", "b"]


def test_unclosed_heredoc_and_unknown_instruction(tmp_path):
    with pytest.raises(TaskError, match="never closed"):
        parse_dockerfile(write(tmp_path, "FROM ubuntu\nRUN <<EOF\necho\n"))
    with pytest.raises(TaskError, match="line 2"):
        parse_dockerfile(write(tmp_path, "FROM ubuntu\nBOGUS x\n"))


def test_expand():
    env = {"A": "1", "B": ""}
    assert expand("$A/${A}/${B:-dflt}/${A:+alt}/${C}/${B:+x}", env) == "1/1/dflt/alt//"


def test_plan_walks_env_workdir_copy_run(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "main.py").write_text("print(1)\n")
    (tmp_path / "cfg.ini").write_text("[x]\n")
    df = write(tmp_path, """FROM python:3.12
ARG APP=/app
ENV TOOL_HOME=/opt/tool-not-on-host \\
    PATH="/app/bin:$PATH"
WORKDIR $APP
COPY src/ ./src/
COPY cfg.ini conf/
COPY *.ini /data/ini/
RUN echo built > built.txt
""")
    plan = plan_build(df, tmp_path)
    assert plan.problems == ()
    assert plan.workdir == "/app" and plan.workspace == "/app"
    assert plan.extra_dirs == ("/data",)
    steps, env = plan.steps(BASE)
    assert env["PATH"] == "/app/bin:/usr/bin:/bin" and "APP" not in env
    kinds = [type(s) for s in steps]
    assert kinds == [MkdirStep, CopyStep, CopyStep, CopyStep, RunStep]
    assert steps[1].dest == "/app/src" and steps[2].dest == "/app/conf" and steps[2].dest_is_dir
    run = steps[4]
    assert run.argv[:2] == ("/bin/sh", "-c") and run.workdir == "/app"
    assert run.env["APP"] == "/app"          # ARG values are visible to RUN


def test_plan_nested_workdir_uses_new_top_directory(tmp_path):
    plan = plan_build(write(tmp_path, "FROM ubuntu\nWORKDIR /srv-app-xyz/src\n"), tmp_path)
    assert plan.workdir == "/srv-app-xyz/src" and plan.workspace == "/srv-app-xyz"


@pytest.mark.parametrize("text,needle", [
    ("FROM node:20 AS b\nFROM ubuntu\nCOPY --from=b /x /app/x\n", "multi-stage"),
    ("FROM ubuntu\nWORKDIR /app\nCOPY tool /usr/local/bin/tool\n", "/usr/local/bin"),
    ("FROM ubuntu\nADD https://example.com/a.tgz /app/\n", "URL"),
    ("FROM postgres:16\n", "postgres:16"),
    ("FROM scratch\n", "scratch"),
])
def test_plan_problems(tmp_path, text, needle):
    (tmp_path / "tool").write_text("x")
    plan = plan_build(write(tmp_path, text), tmp_path)
    assert any(needle in p for p in plan.problems), plan.problems


def test_missing_copy_source_is_a_problem(tmp_path):
    plan = plan_build(write(tmp_path, "FROM ubuntu\nWORKDIR /app\nCOPY nothere.txt .\n"),
                      tmp_path)
    assert any("not found" in p for p in plan.problems)


def test_no_from_is_an_error(tmp_path):
    with pytest.raises(TaskError, match="FROM"):
        plan_build(write(tmp_path, "WORKDIR /app\n"), tmp_path)


def test_images():
    for ok in ("ubuntu:24.04", "python:3.13-slim-bookworm", "debian:bookworm",
               "ghcr.io/laude-institute/t-bench/python-3-13:20250620",
               "docker.io/library/ubuntu@sha256:abc"):
        assert image_problem(ok) is None, ok
    assert "postgres" in image_problem("postgres:16")
    # a toolchain image is fine exactly when the host has its main binary
    import shutil
    assert (image_problem("gcc:13") is None) == (shutil.which("gcc") is not None)
    assert image_problem("rust:1.80") is None or "cargo" in image_problem("rust:1.80")


def test_no_dockerfile_plan(tmp_path):
    plan = plan_build(None, tmp_path)
    assert plan.workdir == plan.workspace == "/app" and plan.problems == ()
    assert plan.steps(BASE) == ([], BASE)
