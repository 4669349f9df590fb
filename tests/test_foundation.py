"""The CLI skeleton, the error hierarchy and YAML config loading."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import BaseModel, Field

from ridgeline.config import load_config
from ridgeline.errors import ConfigError, NotFoundError, RidgelineError


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ridgeline.cli", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_help_and_version():
    r = run_cli("--help")
    assert r.returncode == 0 and "ridgeline" in r.stdout.lower()
    for command in ("sandbox", "tasks", "eval", "generate", "models", "serve"):
        assert command in r.stdout, f"{command} is not mounted"
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("ridgeline ")


def test_unknown_subcommand_is_a_usage_error():
    r = run_cli("no-such-command")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr


def test_a_subcommand_that_fails_to_import_stops_the_cli():
    # `sys.modules[name] = None` makes importing that module raise ImportError.
    code = ("import sys; sys.modules['ridgeline.tasks.cli'] = None; "
            "from ridgeline.cli import main; main(['--help'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "ridgeline.tasks.cli" in r.stderr  # not skipped quietly


class _Cfg(BaseModel):
    name: str = "x"
    size: int = Field(4, gt=0)


def test_config_errors_name_line_and_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: a\nsize: [1,\n")
    with pytest.raises(ConfigError, match="line"):
        load_config(_Cfg, bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("size: -3\n")
    with pytest.raises(ConfigError, match="size"):
        load_config(_Cfg, wrong)
    with pytest.raises(NotFoundError):
        load_config(_Cfg, tmp_path / "missing.yaml")
    ok = tmp_path / "ok.yaml"
    ok.write_text("size: 7\n")
    assert load_config(_Cfg, ok).size == 7


def test_errors_are_ridgeline_errors_with_hints():
    e = NotFoundError("model not found: foo", hint="run `ridgeline models list`")
    assert isinstance(e, RidgelineError) and "models list" in str(e) and e.http_status == 404
