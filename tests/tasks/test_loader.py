"""Loading tasks in both Terminal-Bench layouts, and the errors bad task files get."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ridgeline.errors import NotFoundError, TaskError
from ridgeline.tasks import TaskLayout, builtin_suite_dir, load_task, load_tasks

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def task_copy(tmp_path):
    def copy(name: str) -> Path:
        dest = tmp_path / name
        shutil.copytree(FIXTURES / name, dest)
        return dest
    return copy


def test_v1_fixture_fields():
    t = load_task(FIXTURES / "tb1-hello-world")
    assert t.layout is TaskLayout.TB_V1
    assert t.id == "tb1-hello-world"
    assert t.instruction.startswith("Create a file called hello.txt")
    assert (t.difficulty, t.category, t.tags) == ("easy", "file-operations",
                                                  ("file-operations",))
    assert (t.agent_timeout_s, t.test_timeout_s) == (360.0, 60.0)
    assert t.workdir == "/app" and t.build.workspace == "/app"
    assert t.solution_script.name == "solution.sh" and t.has_solution
    assert t.test_script.name == "run-tests.sh"
    assert t.unsupported_reason is None


def test_v1_old_descriptions_and_solution_yaml():
    t = load_task(FIXTURES / "tb1-fix-script")
    assert t.instruction.startswith("The script /app/scripts/greet.sh")
    s = load_task(FIXTURES / "tb1-csv-summary")
    assert s.solution_script is None and len(s.solution_steps) == 2
    assert s.solution_steps[0].command == "cd /app" and s.solution_steps[1].block


def test_v1_compose_and_dockerfile_env():
    t = load_task(FIXTURES / "tb1-csv-summary")
    steps, env = t.build.steps({"PATH": "/usr/bin:/bin"})
    assert env["REPORT_NAME"] == "summary" and env["DATA_FILE"] == "/app/data.csv"
    assert t.build.base_image == "python:3.13-slim-bookworm"


def test_harbor_fixture_fields():
    t = load_task(FIXTURES / "harbor-word-count")
    assert t.layout is TaskLayout.HARBOR
    assert t.instruction.startswith("# Word count")
    assert (t.difficulty, t.category) == ("medium", "data-processing")
    assert (t.agent_timeout_s, t.test_timeout_s) == (300.0, 90.0)
    r = t.resources
    assert (r.cpus, r.memory_mb, r.storage_mb, r.allow_internet) == (2, 2048, 4096, False)
    assert t.solution_dir.name == "solution" and t.solution_script.name == "solve.sh"
    assert t.test_script == t.path / "tests" / "test.sh"


def test_harbor_defaults():
    t = load_task(FIXTURES / "harbor-partial-reward")
    assert t.resources.memory_mb == 2048 and t.resources.allow_internet is True
    assert t.tags == ()


def test_builtin_suite_loads():
    tasks = load_tasks("builtin")
    assert len(tasks) >= 40
    assert builtin_suite_dir() == tasks[0].path.parent
    assert [t.id for t in tasks] == sorted(t.id for t in tasks)
    domains = {t.domain for t in tasks}
    assert domains >= {"shell-and-files", "text-processing", "python", "dependency-repair",
                       "git", "data-analysis", "3d-creation", "multi-file-engineering"}


def test_load_tasks_on_one_task_and_on_a_suite():
    assert [t.id for t in load_tasks(FIXTURES / "harbor-hello")] == ["harbor-hello"]
    ids = [t.id for t in load_tasks(FIXTURES)]
    assert ids == sorted(ids) and "tb1-hello-world" in ids and "harbor-hello" in ids
    assert not any(i.startswith("broken") for i in ids)


def test_missing_directory_and_empty_suite(tmp_path):
    with pytest.raises(NotFoundError):
        load_task(tmp_path / "nope")
    with pytest.raises(NotFoundError, match="no tasks"):
        load_tasks(tmp_path)
    with pytest.raises(TaskError, match="not a task"):
        load_task(tmp_path)


@pytest.mark.parametrize("name,missing,label", [
    ("tb1-hello-world", "run-tests.sh", "run-tests.sh"),
    ("tb1-hello-world", "tests", "tests"),
    ("harbor-hello", "instruction.md", "instruction.md"),
    ("harbor-hello", "tests/test.sh", "test.sh"),
])
def test_missing_file_is_named(task_copy, name, missing, label):
    d = task_copy(name)
    target = d / missing
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    with pytest.raises(TaskError) as e:
        load_task(d)
    assert label in str(e.value) and name in str(e.value)


def test_bad_yaml_syntax_names_line(task_copy):
    d = task_copy("tb1-hello-world")
    (d / "task.yaml").write_text("instruction: hi\ndifficulty: easy\ntags: [a, b\n"
                                 "category: x\n")
    with pytest.raises(TaskError) as e:
        load_task(d)
    msg = str(e.value)
    assert "task.yaml" in msg and "invalid YAML" in msg and "line " in msg


def test_bad_yaml_field_names_line_and_field(task_copy):
    d = task_copy("tb1-hello-world")
    (d / "task.yaml").write_text("instruction: hi\n"
                                 "difficulty: easy\n"
                                 "max_agent_timeout_sec: soon\n")
    with pytest.raises(TaskError) as e:
        load_task(d)
    msg = str(e.value)
    assert "line 3" in msg and "max_agent_timeout_sec" in msg and "task.yaml" in msg


def test_yaml_missing_instruction(task_copy):
    d = task_copy("tb1-hello-world")
    (d / "task.yaml").write_text("difficulty: easy\n")
    with pytest.raises(TaskError, match="instruction"):
        load_task(d)


def test_bad_toml_syntax_names_line(task_copy):
    d = task_copy("harbor-hello")
    (d / "task.toml").write_text('version = "1.0"\n[agent]\ntimeout_sec = = 3\n')
    with pytest.raises(TaskError) as e:
        load_task(d)
    assert "line 3" in str(e.value) and "invalid TOML" in str(e.value)


def test_bad_toml_field_names_line_and_field(task_copy):
    d = task_copy("harbor-hello")
    (d / "task.toml").write_text('version = "1.0"\n\n[verifier]\ntimeout_sec = -5\n\n'
                                 '[environment]\nmemory_mb = "lots"\n')
    with pytest.raises(TaskError) as e:
        load_task(d)
    msg = str(e.value)
    assert "line 4" in msg and "verifier.timeout_sec" in msg
    assert "line 7" in msg and "environment.memory_mb" in msg


def test_bad_solution_yaml(task_copy):
    d = task_copy("tb1-csv-summary")
    (d / "solution.yaml").write_text("- command: ls\n- min_timeout_sec: 3\n")
    with pytest.raises(TaskError) as e:
        load_task(d)
    assert "solution.yaml" in str(e.value) and "command" in str(e.value)


def test_unknown_dockerfile_instruction_names_line(task_copy):
    d = task_copy("tb1-hello-world")
    (d / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\nFROBNICATE now\n")
    with pytest.raises(TaskError) as e:
        load_task(d)
    assert "line 3" in str(e.value) and "FROBNICATE" in str(e.value)


def test_unsupported_tasks_load_with_a_reason():
    t = load_task(FIXTURES / "broken" / "tb1-unsupported-image")
    assert "postgres:16" in t.unsupported_reason
