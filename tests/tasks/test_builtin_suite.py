"""The built-in suite: its shape (fast), oracle and null on a handful of tasks (fast),
and the full quality check of every task (slow)."""

from __future__ import annotations

import ast
import os
import sys
from collections import Counter

import pytest

from ridgeline.tasks import TaskLayout, builtin_suite_dir, check_task, check_tasks, load_tasks

from tests.helpers import build_wheels

TASKS = load_tasks("builtin")
DOMAINS = {"shell-and-files", "text-processing", "python", "dependency-repair", "git",
           "data-analysis", "3d-creation", "multi-file-engineering", "shell-basics"}
RUNNER = (builtin_suite_dir() / "hello-file" / "run-tests.sh").read_text()


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RIDGELINE_CACHE_DIR", str(tmp_path / "cache"))


def test_size_domains_and_difficulties():
    assert len(TASKS) >= 40
    by_domain = Counter(t.domain for t in TASKS)
    assert set(by_domain) == DOMAINS
    assert all(n >= 4 for n in by_domain.values()), by_domain
    by_difficulty = Counter(t.difficulty for t in TASKS)
    assert set(by_difficulty) == {"easy", "medium", "hard"}
    assert by_difficulty["easy"] >= 8 and by_difficulty["hard"] >= 4
    assert any("one-command" in t.tags for t in TASKS)


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.id)
def test_task_layout(task):
    d = task.path
    assert task.layout is TaskLayout.TB_V1 and task.unsupported_reason is None
    assert task.instruction.strip() and task.metadata.get("author_email")
    for script in ("run-tests.sh", "solution.sh"):
        assert os.access(d / script, os.X_OK), f"{script} is not executable"
    assert (d / "run-tests.sh").read_text() == RUNNER
    assert (d / "tests" / "test_outputs.py").is_file()
    assert task.workdir == "/app"
    assert not list(d.rglob(".git")), "git repositories are made by setup.sh"
    assert not list(d.rglob("__pycache__"))


# Modules a task's tests import from the agent's work (code the agent must write).
UNDER_TEST = {"kvstore-package": {"kvstore"}}


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.id)
def test_tests_use_only_stdlib_and_pytest(task):
    """test_outputs.py and the helpers it imports run under the harness's Python: they
    may use the standard library, pytest, each other and the code under test only."""
    tests = task.path / "tests"
    files = task.path / "files"
    local = {p.stem for p in tests.glob("*.py")}
    under_test = UNDER_TEST.get(task.id, set()) | (
        {p.stem for p in files.iterdir()} if files.is_dir() else set())
    allowed = set(sys.stdlib_module_names) | {"pytest"} | local | under_test
    todo, seen = ["test_outputs"], set()
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        for node in ast.walk(ast.parse((tests / f"{mod}.py").read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                top = name.split(".")[0]
                assert top in allowed, f"{mod}.py imports {name}"
                if top in local:
                    todo.append(top)


def test_wheelhouses_are_reproducible():
    for house, wheels in build_wheels.expected_wheelhouses().items():
        assert sorted(p.name for p in house.glob("*.whl")) == sorted(wheels)
        for name, data in wheels.items():
            assert (house / name).read_bytes() == data, f"{name} differs from its source"
    for path, data in build_wheels.expected_vendor_files().items():
        assert path.read_bytes() == data


HANDFUL = ["hello-file", "git-resolve-conflict", "dep-transitive-requirement", "cube-obj",
           "portfolio-report", "fix-circular-import"]


@pytest.mark.parametrize("task_id", HANDFUL)
def test_oracle_passes_and_null_fails(task_id):
    task = next(t for t in TASKS if t.id == task_id)
    c = check_task(task, runs=1, save=False)
    assert c.null is not None and c.null.status.value == "failed", c.reasons
    assert c.ok, c.reasons


@pytest.mark.slow
def test_whole_suite_passes_the_quality_checks():
    checks = check_tasks(TASKS, runs=3, concurrency=4)
    bad = {c.task_id: c.reasons for c in checks if not c.ok}
    assert bad == {}
