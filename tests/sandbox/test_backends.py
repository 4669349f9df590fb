"""The local (unsafe) backend, the docker backend, health probes and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings

import pytest

from ridgeline.errors import SandboxError, UnsupportedError
from ridgeline.sandbox import Mount, SandboxSpec, create_sandbox

from tests.helpers.sandbox_helpers import needs_bwrap


def test_local_backend_warns_loudly(caplog):
    with pytest.warns(RuntimeWarning, match="NO ISOLATION"):
        sb = create_sandbox(SandboxSpec(), backend="local")
    sb.close()
    assert "NO ISOLATION" in caplog.text


@pytest.fixture
def local():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "NO ISOLATION", checked above
        sb = create_sandbox(SandboxSpec(), backend="local")
    with sb:
        yield sb


def test_local_backend_runs_commands_in_the_workspace(local):
    assert local.run("pwd").stdout.strip() == str(local.workspace_dir)
    assert local.run("exit 4").exit_code == 4
    assert local.run(["no-such-command-xyz"]).exit_code == 127


def test_local_backend_timeout_kills_the_whole_command(local):
    tag = f"{os.getpid()}.{time.time_ns() % 10**6}"  # sleeps no one else runs
    r = local.run(f"sleep 1{tag} & sleep 2{tag}", timeout=0.5)
    assert r.timed_out
    left = subprocess.run(["pgrep", "-af", tag], capture_output=True, text=True).stdout
    assert "sleep" not in left


def test_local_backend_files_and_shell(local):
    local.write_file("a/b.txt", "x")
    assert local.run("cat a/b.txt").stdout == "x"
    sh = local.shell()
    sh.send("cd a; V=1")
    assert sh.send("ls; echo $V").stdout == "b.txt\n1\n"


def test_local_backend_snapshot_restore_and_health(local):
    local.write_file("a/b.txt", "x")
    snap = local.snapshot()
    local.run("rm -r a")
    local.restore(snap)
    assert local.read_file("a/b.txt") == b"x"
    assert local.health().healthy


def test_local_backend_refuses_mounts(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(UnsupportedError, match="bwrap"):
            create_sandbox(SandboxSpec(mounts=[Mount(source=tmp_path, target="/tests")]),
                           backend="local")


def test_docker_backend(docker_engine):
    from ridgeline.sandbox import Limits
    image = docker_engine.default_image
    try:
        docker_engine.client.images.get(image)
    except Exception:  # noqa: BLE001 - podman's API: run on our own Python base image
        from ridgeline.tasks.images import PYTHON_IMAGE, builder
        builder().ensure_base(PYTHON_IMAGE)
        image = PYTHON_IMAGE
    spec = SandboxSpec(workspace_path="/app", image=image, limits=Limits(max_output_bytes=1000))
    with create_sandbox(spec, backend="docker") as sb:
        assert sb.run("echo hi; exit 3").exit_code == 3
        assert sb.run("sleep 100", timeout=1).timed_out
        sb.write_file("x.txt", "data")
        assert sb.run("cat /app/x.txt").stdout == "data"
        assert sb.run("head -c 5000 /dev/zero").truncated
        snap = sb.snapshot()
        sb.run("rm /app/x.txt")
        sb.restore(snap)
        assert sb.read_file("x.txt") == b"data"
        assert sb.shell().send("cd /tmp; pwd").stdout == "/tmp\n"


@needs_bwrap
def test_health_tells_broken_from_healthy(sandbox):
    report = sandbox.health()
    assert report.healthy and set(report.checks) >= {"exec", "workspace_writable", "clock", "disk"}
    sandbox.workspace_dir.chmod(0o555)  # as if the workspace went read-only
    try:
        report = sandbox.health()
        assert not report.healthy and not report.checks["workspace_writable"]
    finally:
        sandbox.workspace_dir.chmod(0o755)
    import os
    import signal
    os.kill(sandbox.init_pid, signal.SIGKILL)  # the environment dies under the agent
    sandbox._proc.wait()
    report = sandbox.health()
    assert not report.healthy and not report.checks["exec"] and "init" in report.detail
    with pytest.raises(SandboxError, match="stopped"):
        sandbox.run("true")


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ridgeline.cli", "sandbox", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_cli_help():
    from typer.testing import CliRunner

    from ridgeline.sandbox.cli import app
    for args in ([], ["run"], ["shell"], ["bench"]):
        r = CliRunner().invoke(app, [*args, "--help"])
        assert r.exit_code == 0 and "Usage" in r.output, r.output


@needs_bwrap
def test_cli_run_passes_output_and_exit_code(tmp_path):
    from typer.testing import CliRunner

    from ridgeline.sandbox.cli import app
    (tmp_path / "in.txt").write_text("from host")
    r = CliRunner().invoke(app, ["run", "--workspace", str(tmp_path), "--", "sh",
                                                  "-c", "cat in.txt; echo e >&2; exit 5"])
    assert r.exit_code == 5 and r.stdout == "from host" and r.stderr.startswith("e\n")
    r = CliRunner().invoke(app, ["run", "--timeout", "0.5", "--", "sleep", "100"])
    assert r.exit_code == 124 and "timed out" in r.stderr
    r = CliRunner().invoke(app, ["run", "--network", "bogus", "--", "true"])
    assert r.exit_code == 2
    # Through the real entry point: a user mistake is one line and exit code 2.
    r = cli("run", "--backend", "nope", "--", "true")
    assert r.returncode == 2 and "valid backends" in r.stderr and "Traceback" not in r.stderr


@needs_bwrap
@pytest.mark.bench
def test_cli_bench_quick_json():
    r = cli("bench", "--quick", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    for key in ("cold_start_p50_ms", "cold_start_p95_ms", "warm_acquire_p50_ms",
                "subprocess_p50_ms", "concurrent", "snapshot_ms", "restore_ms"):
        assert key in data
    assert data["concurrent"]["failures"] == 0
