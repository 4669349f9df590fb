"""Bad input: each mistake gets a clear RidgelineError (or result), nothing leaks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ridgeline.config import load_model
from ridgeline.errors import ConfigError, NotFoundError, SandboxError
from ridgeline.sandbox import Limits, Mount, SandboxSpec, create_sandbox, get_provider

from tests.helpers.sandbox_helpers import needs_bwrap


def test_unknown_backend_names_the_valid_ones():
    with pytest.raises(SandboxError, match="bwrap, local, docker"):
        create_sandbox(SandboxSpec(), backend="firecracker")
    with pytest.raises(SandboxError, match="valid backends"):
        get_provider("nope")


def test_missing_bwrap_says_what_to_install(tmp_path):
    with pytest.raises(SandboxError, match="apt-get install -y bubblewrap"):
        get_provider("bwrap", bwrap_path=str(tmp_path / "no" / "bwrap"))


@pytest.mark.parametrize("limits, field", [
    ({"memory_bytes": -1}, "memory_bytes"), ({"memory_bytes": 1000}, "memory_bytes"),
    ({"max_processes": 0}, "max_processes"), ({"wall_timeout_s": 0}, "wall_timeout_s"),
    ({"wall_timeout_s": float("nan")}, "wall_timeout_s"), ({"max_output_bytes": 0}, "max_output_bytes"),
    ({"cpu_seconds": -5}, "cpu_seconds"), ({"memory_byte": 10**9}, "memory_byte"),
])
def test_nonsensical_limits_name_the_field(limits, field):
    with pytest.raises(ConfigError, match=field):
        Limits(**limits)
    with pytest.raises(ConfigError, match=f"limits.*{field}"):
        SandboxSpec(limits=limits)
    with pytest.raises(ConfigError, match=field):
        load_model(SandboxSpec, {"limits": limits}, "sandbox.yaml")


@pytest.mark.parametrize("spec, field", [
    ({"workspace_path": "relative"}, "workspace_path"), ({"workspace_path": "/"}, "workspace_path"),
    ({"workspace_path": "/proc/x"}, "workspace_path"), ({"workdir": "rel"}, "workdir"),
    ({"mounts": [{"source": "/tmp", "target": "/dev/x"}]}, "target"),
    ({"mounts": [{"source": "/tmp", "target": "/a"}, {"source": "/tmp", "target": "/a/"}]}, "share"),
    ({"env": {"A=B": "x"}}, "environment"), ({"network": "internet"}, "network"),
])
def test_bad_specs_are_config_errors(spec, field):
    with pytest.raises(ConfigError, match=field):
        SandboxSpec(**spec)


def test_paths_are_normalised():
    spec = SandboxSpec(workspace_path="/app/", mounts=[Mount(source="/tmp", target="//tests/")])
    assert spec.workspace_path == "/app" and spec.mounts[0].target == "/tests"


@needs_bwrap
def test_missing_mount_source_and_seed_leave_nothing_behind(tmp_path):
    provider = get_provider("bwrap", root_dir=tmp_path / "root")  # a root of its own
    with pytest.raises(NotFoundError, match="does not exist"):
        provider.create(SandboxSpec(mounts=[Mount(source=tmp_path / "nope", target="/tests")]))
    with pytest.raises(NotFoundError):
        provider.create(SandboxSpec(workspace_from=tmp_path / "nope"))
    left = [x for x in os.listdir(tmp_path / "root") if not x.startswith(".")]
    assert left == []  # dot-entries: shared files, and trash being deleted


@needs_bwrap
def test_workdir_outside_the_workspace_and_missing(tmp_path):
    with create_sandbox(SandboxSpec(workdir="/tmp")) as sb:
        assert sb.run("pwd").stdout == "/tmp\n"
    with create_sandbox(SandboxSpec(workspace_path="/app", workdir="/app/src/pkg")) as sb:
        assert sb.run("pwd").stdout == "/app/src/pkg\n"
    with create_sandbox(SandboxSpec(workdir="/does/not/exist")) as sb:
        r = sb.run("pwd")
        assert r.exit_code != 0 and "can't cd" in r.stderr


@needs_bwrap
def test_mounts_anywhere_including_new_directories(tmp_path):
    tests, logs, seed = tmp_path / "tests", tmp_path / "logs", tmp_path / "seed"
    for d in (tests, logs, seed):
        d.mkdir()
    (tests / "test_x.py").write_text("ok")
    (seed / "main.py").write_text("print('seeded')")
    spec = SandboxSpec(workspace_path="/app", workspace_from=seed,
                       mounts=[Mount(source=tests, target="/tests"),
                               Mount(source=logs, target="/logs/verifier", writable=True),
                               Mount(source=tests, target="/opt/ridgeline-new/tests"),
                               Mount(source=tests, target="/usr/share/ridgeline-probe")])
    with create_sandbox(spec) as sb:
        assert sb.run("python3 main.py").stdout == "seeded\n"
        assert sb.run("cat /tests/test_x.py /opt/ridgeline-new/tests/test_x.py "
                      "/usr/share/ridgeline-probe/test_x.py").stdout == "okokok"
        assert sb.run("echo x > /tests/y").exit_code != 0  # read-only mount
        assert sb.run("echo 1 > /logs/verifier/reward.txt").exit_code == 0
        assert (logs / "reward.txt").read_text() == "1\n"
        assert sb.run("ls /opt").stdout.split()  # the rest of /opt is still there
        assert sb.run("touch /opt/other").exit_code != 0  # and still read-only
    assert not Path("/usr/share/ridgeline-probe").exists()
    assert (seed / "main.py").read_text() == "print('seeded')"  # the seed is copied
