"""`ridgeline platform` as a user runs it: keys created and listed from the command line,
the platform's tools served over MCP stdio to a real MCP client (ours), scoped by the key,
and config mistakes as one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mcp import StdioServerParameters

from ridgeline.platform.mcp_bridge import import_mcp_tools
from ridgeline.platform.principal import Principal
from ridgeline.platform.tools import ToolRegistry

RIDGELINE = str(Path(sys.executable).parent / "ridgeline")


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([RIDGELINE, "platform", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "platform.yaml"
    path.write_text(yaml.safe_dump({"data_dir": str(tmp_path / "data"),
                                    "rag": {"embedder": "hashing"}}))
    return path


def test_keys_from_the_command_line(config: Path, tmp_path: Path) -> None:
    made = run("keys", "create", "--config", str(config), "--tenant", "acme", "--user", "ann",
               "--scope", "rag:read", "--model", "default", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    assert key.startswith("rk-") and "shown once" in made.stderr
    listed = run("keys", "list", "--config", str(config), cwd=tmp_path)
    assert '"tenant": "acme"' in listed.stdout and key not in listed.stdout
    key_id = key.split("-")[1]
    assert run("keys", "revoke", key_id, "--config", str(config), cwd=tmp_path).returncode == 0
    assert run("keys", "list", "--config", str(config), cwd=tmp_path).stdout == ""
    assert '"revoked": true' in run("keys", "list", "--all", "--config", str(config),
                                    cwd=tmp_path).stdout


def test_platform_tools_over_mcp_stdio_follow_the_keys_scopes(config: Path,
                                                              tmp_path: Path) -> None:
    key = run("keys", "create", "--config", str(config), "--tenant", "acme",
              "--scope", "memory:read", cwd=tmp_path).stdout.strip()
    params = StdioServerParameters(command=RIDGELINE,
                                   args=["platform", "mcp", "--config", str(config),
                                         "--key", key])
    registry = ToolRegistry()
    with import_mcp_tools(params, registry, scopes=("tools:read",), side_effects=False,
                          connect_timeout_s=60):
        names = {t.name for t in registry.tools_for(None)}
        assert names == {"recall"}  # search_documents needs rag:read, remember memory:write
        result = registry.call("recall", {"query": "anything", "k": 3},
                               Principal(key_id="x", tenant="t", scopes=frozenset({"*"})))
        assert result.ok and "nothing remembered" in result.content


def test_config_mistakes_are_one_line_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("queue: {backend: kafka}\n")
    r = run("maintain", "--config", str(bad), cwd=tmp_path)
    assert r.returncode == 2 and "queue.backend" in r.stderr and "Traceback" not in r.stderr
    r = run("maintain", "--config", str(tmp_path / "missing.yaml"), cwd=tmp_path)
    assert r.returncode == 2 and "does not exist" in r.stderr
