"""`ridgeline tasks list|check`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ridgeline.tasks.cli import app

FIXTURES = Path(__file__).parent / "fixtures"
runner = CliRunner()


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RIDGELINE_CACHE_DIR", str(tmp_path / "cache"))


def test_list_table_and_json():
    r = runner.invoke(app, ["list"])
    assert r.exit_code == 0 and "hello-file" in r.output and "3d-creation" in r.output
    r = runner.invoke(app, ["list", str(FIXTURES), "--json"])
    assert r.exit_code == 0
    rows = json.loads(r.output)
    by_id = {row["id"]: row for row in rows}
    assert by_id["harbor-hello"]["layout"] == "harbor"
    assert by_id["tb1-hello-world"]["domain"] == "file-operations"


def test_check_json_good_and_unsupported(tmp_path):
    r = runner.invoke(app, ["check", str(FIXTURES / "harbor-hello"), "--runs", "1", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert (out["n_tasks"], out["n_valid"]) == (1, 1)
    assert out["tasks"][0]["null_status"] == "failed"
    r = runner.invoke(app, ["check", str(FIXTURES / "broken" / "tb1-unsupported-image"),
                            "--json"])
    assert r.exit_code == 1
    out = json.loads(r.output)
    assert out["n_unsupported"] == 1 and "postgres" in out["tasks"][0]["reasons"][0]


def test_check_table_flags_the_reason(tmp_path):
    r = runner.invoke(app, ["check", str(FIXTURES / "broken" / "tb1-missing-package")])
    assert r.exit_code == 1
    assert "NO" in r.output and "frobnicator" in r.output


def test_bad_task_is_one_line_error(tmp_path):
    (tmp_path / "task.yaml").write_text("instruction: [unclosed\n")
    r = subprocess.run([sys.executable, "-m", "ridgeline.cli", "tasks", "list", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "invalid YAML" in r.stderr and "Traceback" not in r.stderr
