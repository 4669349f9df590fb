"""A task directory is untrusted input: nothing in it may make Ridgeline read, copy or
chmod host files outside it (Dockerfile COPY/ADD sources, compose paths, the files the
loader uses), and the shared harness directory under /tmp is only used when it is ours."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ridgeline.errors import TaskError
from ridgeline.tasks import load_task, load_tasks
from ridgeline.tasks import harness
from ridgeline.tasks.checks import task_hash
from ridgeline.tasks.dockerfile import CopyStep, inside, plan_build

FIXTURES = Path(__file__).parent / "fixtures"
BASE = {"PATH": "/usr/bin:/bin", "HOME": "/root"}
HEAD = "FROM ubuntu:24.04\nWORKDIR /app\n"       # the COPY under test is on line 3


@pytest.fixture
def outside(tmp_path) -> Path:
    """Host files next to (not inside) the task: what an attacker wants to read."""
    d = tmp_path / "outside"
    (d / "sub").mkdir(parents=True)
    (d / "secret").write_text("host secret\n")
    (d / "sub" / "secret").write_text("host secret\n")
    (d / "Dockerfile").write_text("SECRETTOKEN from the host\n")
    return d


def task_dir(tmp_path: Path, name: str = "tb1-hello-world", dest: str = "task") -> Path:
    d = tmp_path / "suite" / dest
    shutil.copytree(FIXTURES / name, d)
    return d


def with_dockerfile(tmp_path: Path, copy_line: str) -> Path:
    d = task_dir(tmp_path)
    (d / "Dockerfile").write_text(HEAD + copy_line + "\n")
    return d


def copy_steps(task) -> list[CopyStep]:
    steps, _ = task.build.steps(BASE)
    return [s for s in steps if isinstance(s, CopyStep)]


# --- Dockerfile COPY/ADD sources -------------------------------------------------------
# (id, COPY line, make the escape, make the in-context control, sources the control plans)

def _ctx_file(d, o, name="x"):
    (d / name).write_text("in context\n")


def _link(path: Path, target) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


ESCAPES = [
    ("dotdot", "COPY ../x /app/", "'../x'",
     lambda d, o: (d.parent / "x").write_text("outside\n"),
     lambda d, o: _ctx_file(d, o), "COPY x /app/", ["x"]),
    ("add-dotdot", "ADD ../../etc/shadow /app/", "'../../etc/shadow'",
     lambda d, o: None,
     lambda d, o: _ctx_file(d, o, "shadow"), "ADD shadow /app/", ["shadow"]),
    ("symlink-to-etc", "COPY hostetc /app/etc/", "'hostetc'",
     lambda d, o: _link(d / "hostetc", "/etc"),
     lambda d, o: ((d / "real").mkdir(), _link(d / "hostetc", "real")),
     "COPY hostetc /app/etc/", ["hostetc"]),
    ("glob-hits-link", "COPY *.txt /app/", "matches 'b.txt'",
     lambda d, o: (_ctx_file(d, o, "a.txt"), _link(d / "b.txt", o / "secret")),
     lambda d, o: (_ctx_file(d, o, "a.txt"), _ctx_file(d, o, "b.txt")),
     "COPY *.txt /app/", ["a.txt", "b.txt"]),
    ("parent-is-link", "COPY up/sub /app/sub", "'up/sub'",
     lambda d, o: _link(d / "up", o),
     lambda d, o: ((d / "real" / "sub").mkdir(parents=True),
                   (d / "real" / "sub" / "f").write_text("ok\n"), _link(d / "up", "real")),
     "COPY up/sub /app/sub", ["up/sub"]),
    ("chmod-link", "COPY --chmod=777 link /app/", "'link'",
     lambda d, o: _link(d / "link", o / "secret"),
     lambda d, o: (_ctx_file(d, o, "target"), _link(d / "link", "target")),
     "COPY --chmod=777 link /app/", ["link"]),
    ("arg-expanded", "ARG SRC=../../outside/secret\nCOPY ${SRC} /app/", "'../../outside",
     lambda d, o: None,
     lambda d, o: _ctx_file(d, o, "secret"), "ARG SRC=secret\nCOPY ${SRC} /app/",
     ["secret"]),
]


@pytest.mark.parametrize("line,needle,bad,good,good_line,good_sources",
                         [e[1:] for e in ESCAPES], ids=[e[0] for e in ESCAPES])
def test_copy_source_outside_context_is_refused(tmp_path, outside, line, needle, bad,
                                                good, good_line, good_sources):
    d = with_dockerfile(tmp_path, line)
    bad(d, outside)
    with pytest.raises(TaskError) as e:
        load_task(d)
    msg = str(e.value)
    copy_line = 3 + line.count("\n")
    assert str(d / "Dockerfile") in msg and f"line {copy_line}:" in msg, msg
    assert needle in msg and "build context" in msg, msg


def test_an_absolute_copy_source_names_the_context_root_never_the_host(tmp_path):
    """BuildKit reads `COPY /etc/passwd` from the build context's root: the host's
    /etc/passwd is never read; without such a file in the context nothing is copied."""
    d = with_dockerfile(tmp_path, "COPY /etc/passwd /app/")
    task = load_task(d)
    assert "COPY source not found in the build context" in (task.unsupported_reason or "")
    (d / "etc").mkdir()
    (d / "etc" / "passwd").write_text("from the task\n")
    (step,) = copy_steps(load_task(d))
    assert list(step.sources) == [d / "etc" / "passwd"]


@pytest.mark.parametrize("line,needle,bad,good,good_line,good_sources",
                         [e[1:] for e in ESCAPES], ids=[e[0] for e in ESCAPES])
def test_same_copy_inside_context_loads(tmp_path, outside, line, needle, bad, good,
                                        good_line, good_sources):
    d = with_dockerfile(tmp_path, good_line)
    good(d, outside)
    task = load_task(d)
    assert task.unsupported_reason is None, task.unsupported_reason
    (step,) = copy_steps(task)
    assert [str(s.relative_to(d)) for s in step.sources] == good_sources
    assert all(inside(s, d) for s in step.sources)
    # a symlinked source stays the link (marked), never its resolved target
    assert step.links == tuple(s for s in step.sources if s.is_symlink())


def test_chmod_link_is_kept_as_the_link(tmp_path):
    d = with_dockerfile(tmp_path, "COPY --chmod=777 link /app/")
    (d / "target").write_text("x\n")
    (d / "link").symlink_to("target")
    (step,) = copy_steps(load_task(d))
    assert step.sources == (d / "link",) and step.links == (d / "link",)
    assert step.chmod == "777"


def test_links_inside_a_directory_source_are_copied_as_links(tmp_path, outside):
    # Docker copies them as links, never following them: only the top level is checked
    d = with_dockerfile(tmp_path, "COPY data /app/data")
    (d / "data").mkdir()
    (d / "data" / "venv-python").symlink_to("/usr/bin/python3")
    (d / "data" / "secret").symlink_to(outside / "secret")
    (step,) = copy_steps(load_task(d))
    assert step.sources == (d / "data",) and step.links == ()


def test_setuid_bits_of_chmod_are_dropped(tmp_path):
    d = with_dockerfile(tmp_path, "COPY --chmod=4755 x /app/x")
    (d / "x").write_text("x\n")
    task = load_task(d)
    assert copy_steps(task)[0].chmod == "755"
    assert any("setuid" in n for n in task.build.notes)


def test_symbolic_chmod_is_a_problem(tmp_path):
    d = with_dockerfile(tmp_path, "COPY --chmod=u+x x /app/x")
    (d / "x").write_text("x\n")
    assert "--chmod=u+x" in load_task(d).unsupported_reason


def test_context_path_with_glob_characters(tmp_path):
    # the context's own path is not a glob pattern
    ctx = tmp_path / "ctx[1]"
    ctx.mkdir()
    (ctx / "f.txt").write_text("x\n")
    (ctx / "Dockerfile").write_text(HEAD + "COPY *.txt /app/\n")
    plan = plan_build(ctx / "Dockerfile", ctx)
    steps, _ = plan.steps(BASE)
    assert steps[1].sources == (ctx / "f.txt",) and plan.problems == ()


def test_plan_rechecks_when_the_context_changes(tmp_path, outside):
    # steps() walks again at environment time: a link swapped in after loading is caught
    d = with_dockerfile(tmp_path, "COPY x /app/")
    (d / "x").write_text("x\n")
    task = load_task(d)
    (d / "x").unlink()
    (d / "x").symlink_to(outside / "secret")
    with pytest.raises(TaskError, match="line 3"):
        task.build.steps(BASE)


# --- compose files ---------------------------------------------------------------------

def with_compose(tmp_path: Path, build: str) -> Path:
    d = task_dir(tmp_path)
    (d / "Dockerfile").unlink()
    (d / "docker-compose.yaml").write_text(f"services:\n  client:\n    build:{build}\n")
    return d


@pytest.mark.parametrize("build,field", [
    ("\n      context: /etc", "services.client.build.context"),
    ("\n      context: ../..", "services.client.build.context"),
    (" ../..", "services.client.build"),
    ("\n      context: envlink", "services.client.build.context"),
    ("\n      context: .\n      dockerfile: ../../outside/Dockerfile",
     "services.client.build.dockerfile"),
    ("\n      dockerfile: /etc/hostname", "services.client.build.dockerfile"),
    ("\n      dockerfile: Dockerfile.link", "services.client.build.dockerfile"),
], ids=["abs-context", "dotdot-context", "string-build", "symlinked-context",
        "dockerfile-outside", "abs-dockerfile", "symlinked-dockerfile"])
def test_compose_paths_outside_the_task_are_refused(tmp_path, outside, build, field):
    d = with_compose(tmp_path, build)
    (d / "envlink").symlink_to(outside)
    (d / "Dockerfile.link").symlink_to(outside / "Dockerfile")
    with pytest.raises(TaskError) as e:
        load_task(d)
    msg = str(e.value)
    assert str(d / "docker-compose.yaml") in msg and f"field '{field}'" in msg, msg
    assert "line " in msg and "SECRETTOKEN" not in msg


def test_compose_inside_the_task_loads(tmp_path):
    d = with_compose(tmp_path, "\n      context: env\n      dockerfile: Dockerfile")
    (d / "env").mkdir()
    (d / "env" / "Dockerfile").write_text(HEAD)
    task = load_task(d)
    assert task.build.context == d / "env" and task.build.source == d / "env" / "Dockerfile"


def test_harbor_compose_context_confined_to_the_task(tmp_path):
    d = task_dir(tmp_path, "harbor-hello")
    env = d / "environment"
    (env / "docker-compose.yaml").write_text(
        "services:\n  main:\n    build:\n      context: ../..\n")
    (env / "Dockerfile").unlink()
    with pytest.raises(TaskError, match="services.main.build.context"):
        load_task(d)
    # the task directory itself (one up from environment/) is fine
    (env / "docker-compose.yaml").write_text(
        "services:\n  main:\n    build:\n      context: ..\n"
        "      dockerfile: environment/Dockerfile.real\n")
    (env / "Dockerfile.real").write_text(HEAD)
    assert load_task(d).build.context == d


# --- the files the loader uses ---------------------------------------------------------

@pytest.mark.parametrize("name,rel,target", [
    ("tb1-hello-world", "tests", "sub"),
    ("tb1-hello-world", "solution.sh", "secret"),
    ("tb1-hello-world", "run-tests.sh", "secret"),
    ("tb1-hello-world", "task.yaml", "secret"),
    ("tb1-hello-world", "Dockerfile", "Dockerfile"),
    ("tb1-hello-world", "setup.sh", "secret"),
    ("tb1-hello-world", "files", "sub"),
    ("tb1-hello-world", "tests/leak.txt", "secret"),
    ("harbor-hello", "environment", "sub"),
    ("harbor-hello", "solution", "sub"),
    ("harbor-hello", "solution/solve.sh", "secret"),
    ("harbor-hello", "tests/test.sh", "secret"),
    ("harbor-hello", "instruction.md", "secret"),
    ("harbor-hello", "task.toml", "secret"),
])
def test_task_file_linking_outside_is_refused(tmp_path, outside, name, rel, target):
    d = task_dir(tmp_path, name)
    p = d / rel
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()
    p.symlink_to(outside / target)
    with pytest.raises(TaskError) as e:
        load_task(d)
    msg = str(e.value)
    assert f"{rel} resolves to {outside / target}" in msg and "outside the task" in msg
    assert "SECRETTOKEN" not in msg


def test_task_file_linking_inside_loads(tmp_path):
    d = task_dir(tmp_path)
    (d / "scripts").mkdir()
    (d / "solution.sh").rename(d / "scripts" / "solve.sh")
    (d / "solution.sh").symlink_to("scripts/solve.sh")
    (d / "tests" / "deep").mkdir()
    (d / "tests" / "deep" / "host").symlink_to("/etc")   # deeper: copied as a link
    assert load_task(d).solution_script == d / "solution.sh"


def test_suite_with_one_bad_task_names_it(tmp_path):
    task_dir(tmp_path, "harbor-hello", "good")
    bad = with_dockerfile(tmp_path, "COPY ../../outside /app/")
    with pytest.raises(TaskError) as e:
        load_tasks(tmp_path / "suite")
    assert str(bad / "Dockerfile") in str(e.value) and "line 3" in str(e.value)


@pytest.mark.parametrize("command", ["check", "list"])
def test_cli_reports_the_violation_with_its_line(tmp_path, monkeypatch, command):
    """The bad task is reported broken with the line (never loaded, so never run); the
    good one beside it is listed or checked all the same (issue 28)."""
    monkeypatch.setenv("RIDGELINE_CACHE_DIR", str(tmp_path / "cache"))
    task_dir(tmp_path, "harbor-hello", "good")
    bad = with_dockerfile(tmp_path, "COPY ../x /app/")
    r = subprocess.run([sys.executable, "-m", "ridgeline.cli", "tasks", command,
                        str(tmp_path / "suite"), "--json"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == (1 if command == "check" else 0), r.stdout + r.stderr
    out = json.loads(r.stdout)
    rows = {row["id"]: row for row in (out["tasks"] if command == "check" else out)}
    assert not rows["good"]["broken"] and rows[bad.name]["broken"]
    why = rows[bad.name]["reasons"][0] if command == "check" else rows[bad.name]["reason"]
    assert f"{bad / 'Dockerfile'}: line 3: COPY source '../x'" in why, why
    assert "Traceback" not in r.stderr


def test_task_hash_never_reads_through_links(tmp_path, outside):
    d = task_dir(tmp_path)
    (d / "tests" / "deep").mkdir()
    (d / "tests" / "deep" / "leak").symlink_to(outside / "secret")
    (d / "tests" / "deep" / "dir").symlink_to(outside)
    task = load_task(d)
    before = task_hash(task)
    (outside / "secret").write_text("changed\n")
    (outside / "new").write_text("x\n")
    assert task_hash(task) == before            # the host files were not read
    (d / "tests" / "deep" / "leak").unlink()
    (d / "tests" / "deep" / "leak").symlink_to(outside / "other")
    assert task_hash(task) != before            # the link itself is part of the task


# --- the shared harness directory ------------------------------------------------------

@pytest.fixture
def tree():
    return harness._tree(sys.executable)


def shared(parent: Path, tree) -> Path:
    return parent / harness._shared_name(tree)


def assert_ours(d: Path, tree) -> None:
    assert harness.untrusted_reason(d, tree) is None
    st = os.lstat(d)
    assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o755


def test_fresh_shared_dir_is_built_and_reused(tmp_path, tree):
    d = harness.tools_dir(tmp_path, sys.executable)
    assert d == shared(tmp_path, tree)
    assert_ours(d, tree)
    assert (d / "bin" / "uv").stat().st_mode & 0o777 == 0o755
    assert harness.tools_dir(tmp_path, sys.executable) == d
    assert [p.name for p in tmp_path.iterdir()] == [d.name]   # no build dirs left


def _replaced(tmp_path, tree, caplog) -> Path:
    with caplog.at_level(logging.WARNING, logger="ridgeline.tasks.harness"):
        d = harness.tools_dir(tmp_path, sys.executable)
    assert d != shared(tmp_path, tree) and d.parent == tmp_path
    assert_ours(d, tree)
    assert "private copy" in caplog.text
    return d


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_dir_precreated_by_another_user_is_not_used(tmp_path, tree, caplog):
    evil = shared(tmp_path, tree)
    (evil / "bin").mkdir(parents=True)
    (evil / "bin" / "uv").write_text("#!/bin/sh\necho pwned\n")
    for p in (evil, evil / "bin", evil / "bin" / "uv"):
        os.chown(p, 12345, 12345)
    d = _replaced(tmp_path, tree, caplog)
    assert "owned by uid 12345" in caplog.text
    assert (evil / "bin" / "uv").read_text() == "#!/bin/sh\necho pwned\n"  # left alone
    assert b"pwned" not in (d / "bin" / "uv").read_bytes()


def test_group_writable_dir_is_not_used(tmp_path, tree, caplog):
    d = harness.tools_dir(tmp_path, sys.executable)
    os.chmod(d, 0o775)
    assert "mode 775" in harness.untrusted_reason(d, tree)
    _replaced(tmp_path, tree, caplog)


def test_symlinked_dir_is_not_used(tmp_path, tree, caplog):
    (tmp_path / "elsewhere").mkdir()
    elsewhere = harness.tools_dir(tmp_path / "elsewhere", sys.executable)
    shared(tmp_path, tree).symlink_to(elsewhere)    # even a valid tree, via a link
    d = _replaced(tmp_path, tree, caplog)
    assert not str(d).startswith(str(elsewhere))


def test_symlinked_or_changed_file_inside_is_not_used(tmp_path, tree, caplog):
    d = harness.tools_dir(tmp_path, sys.executable)
    tool = d / "offline_tools.py"
    copy = tmp_path / "copy.py"
    shutil.copy2(tool, copy)
    tool.unlink()
    tool.symlink_to(copy)
    assert "not a regular file" in harness.untrusted_reason(d, tree)
    _replaced(tmp_path, tree, caplog)
    tool.unlink()
    tool.write_bytes(copy.read_bytes() + b"\nimport evil\n")
    os.chmod(tool, 0o644)
    assert "unexpected contents" in harness.untrusted_reason(d, tree)


def test_extra_file_inside_is_not_used(tmp_path, tree):
    d = harness.tools_dir(tmp_path, sys.executable)
    (d / "bin" / "python3").write_text("#!/bin/sh\n")
    assert "not part of the harness" in harness.untrusted_reason(d, tree)


def test_our_own_bytecode_cache_keeps_the_shared_dir_in_use(tmp_path, tree):
    """Python writes __pycache__ when a host process imports the harness's modules: that
    must not make every later process build a private copy."""
    d = harness.tools_dir(tmp_path, sys.executable)
    cache = d / "__pycache__"
    cache.mkdir(mode=0o755)
    (cache / "offline_tools.cpython-311.pyc").write_bytes(b"\0" * 16)
    os.chmod(cache / "offline_tools.cpython-311.pyc", 0o644)
    assert harness.untrusted_reason(d, tree) is None
    assert harness.tools_dir(tmp_path, sys.executable) == d
    # ... but a cache someone else can write is as untrusted as any stray entry
    os.chmod(cache / "offline_tools.cpython-311.pyc", 0o666)
    assert "not part of the harness" in harness.untrusted_reason(d, tree)
    os.chmod(cache / "offline_tools.cpython-311.pyc", 0o644)
    (cache / "evil.py").write_text("import os\n")
    assert "not part of the harness" in harness.untrusted_reason(d, tree)
