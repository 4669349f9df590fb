"""The sandbox user is never host root, and the host kernel's knobs stay out of reach.

Each attack runs for real inside a sandbox (a positive control shows it ran: the
command executed and reported its error) and is checked to have had no effect on the
host. Writes use the host's current value, so even a regression cannot change the host.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ridgeline.sandbox import Mount, SandboxSpec, create_sandbox

from tests.helpers.sandbox_helpers import needs_bwrap, pids_in_namespace

pytestmark = needs_bwrap
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the uid mapping matters when "
                               "Ridgeline runs as root")

SYSCTLS = ["kernel/printk_ratelimit", "kernel/core_pattern", "kernel/hostname",
           "kernel/randomize_va_space", "kernel/pid_max", "fs/protected_symlinks",
           "vm/overcommit_memory", "net/ipv4/ip_forward"]


def _host_uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError("no Uid line")


@root_only
def test_sandbox_processes_and_files_are_not_host_root(sandbox):
    proc = sandbox.popen(["sleep", "30"])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pids = [p for p in pids_in_namespace(sandbox.namespaces["pid"])
                    if Path(f"/proc/{p}/comm").read_text().strip() == "sleep"]
            if pids:
                break
            time.sleep(0.01)
        assert pids, "the sleep is running inside the sandbox"
        assert all(_host_uid_of(p) != 0 for p in pids)
    finally:
        proc.kill()
        proc.wait()
    assert sandbox.run("echo made > inside.txt").ok
    st = os.stat(sandbox.workspace_dir / "inside.txt")
    assert st.st_uid != 0 and st.st_gid != 0
    assert st.st_uid == sandbox.owner[0]


@root_only
def test_two_sandboxes_have_different_host_uids(make_sandbox):
    a, b = make_sandbox(), make_sandbox()
    assert a.owner != b.owner and 0 not in (a.owner[0], b.owner[0])


@pytest.mark.parametrize("name", SYSCTLS)
def test_sysctls_cannot_be_written(sandbox, name):
    host = Path("/proc/sys") / name
    if not host.exists():
        pytest.skip(f"/proc/sys/{name} does not exist on this kernel")
    try:
        before = host.read_text()
    except OSError:
        pytest.skip(f"/proc/sys/{name} is not readable here")
    value = before.strip().split("\n")[0]
    r = sandbox.run(["sh", "-c", f'printf "%s\\n" "$1" > /proc/sys/{name} && echo WROTE',
                     "sh", value])
    # Positive control: the shell really tried, and told us why it could not.
    assert r.exit_code != 0 and "WROTE" not in r.stdout
    assert r.stderr.strip(), "the write attempt reports an error"
    assert host.read_text() == before


def test_core_pattern_pipe_attack_has_no_effect(sandbox):
    """The reported escape: point core_pattern at a workspace script, crash a process."""
    before = Path("/proc/sys/kernel/core_pattern").read_text()
    script = "echo pwned > /tmp/ridgeline-core-pwned; id > /tmp/ridgeline-core-pwned"
    sandbox.write_file("evil.sh", f"#!/bin/sh\n{script}\n", mode=0o755)
    r = sandbox.run(f"echo '|{sandbox.spec.workspace_path}/evil.sh' > "
                    "/proc/sys/kernel/core_pattern; echo rc=$?; "
                    "sh -c 'ulimit -c unlimited; kill -SEGV $$'; echo crashed")
    assert "rc=" in r.stdout and "rc=0" not in r.stdout and "crashed" in r.stdout
    assert Path("/proc/sys/kernel/core_pattern").read_text() == before
    assert not Path("/tmp/ridgeline-core-pwned").exists()


@pytest.mark.parametrize("path", ["/proc/sysrq-trigger", "/proc/sys/kernel/modprobe"])
def test_kernel_triggers_are_not_writable(sandbox, path):
    r = sandbox.run(["sh", "-c", f"test -e {path} || exit 99; : > {path} && echo WROTE"])
    assert "WROTE" not in r.stdout and r.exit_code != 0


@root_only
def test_host_root_only_files_stay_unreadable(sandbox):
    # Owner permissions once applied (the sandbox was host root); now "other" does.
    r = sandbox.run("cat /proc/kcore /etc/shadow 2>&1 | head -c 200; ls /root 2>&1")
    assert "root:" not in r.stdout


def test_writable_mount_is_lent_to_the_sandbox_and_given_back(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    before = out.stat()
    with create_sandbox(SandboxSpec(mounts=[Mount(source=out, target="/out",
                                                  writable=True)])) as sb:
        assert sb.run("echo x > /out/file").ok
    after = out.stat()
    assert (after.st_uid, after.st_gid) == (before.st_uid, before.st_gid)
    assert (out / "file").read_text() == "x\n"
