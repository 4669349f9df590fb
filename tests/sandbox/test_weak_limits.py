"""Where the machine cannot enforce a limit strongly (no loop devices for a filesystem
per sandbox, no cgroup controllers), an untrusted sandbox is refused with the reason,
unless `Limits.weak_limits` accepts the weaker mechanism; and the cgroup v2 path, as
far as a host whose v2 hierarchy has no memory/pids controllers can run it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ridgeline.errors import SandboxError
from ridgeline.sandbox import Limits, SandboxSpec, get_provider, volume
from ridgeline.sandbox.cgroups import V2, CgroupHost, v2_mount

from tests.helpers.sandbox_helpers import needs_bwrap

pytestmark = needs_bwrap
MiB = 1024 * 1024
FILL = ("python3 -c \"import time\n"
        "with open('big', 'wb') as f:\n"
        "    for i in range(400):\n"
        "        f.write(b'x' * (1 << 20)); f.flush(); time.sleep(0.01)\n"
        "print('finished')\"")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="loop devices and cgroups need root")


@pytest.fixture
def no_loop(tmp_path, monkeypatch):
    """A provider on a machine without loop devices (the control device is missing)."""
    monkeypatch.setattr(volume, "LOOP_CONTROL", str(tmp_path / "no-loop-control"))
    return get_provider("bwrap", root_dir=tmp_path / "root")


@pytest.fixture
def no_cgroups(tmp_path, monkeypatch):
    """A provider whose cgroup root is a directory without any controller."""
    root = tmp_path / "cgroup"
    root.mkdir()
    monkeypatch.setenv("RIDGELINE_CGROUP_ROOT", str(root))
    return get_provider("bwrap", root_dir=tmp_path / "root")


@needs_root
def test_without_loop_devices_a_disk_quota_is_refused_with_the_reason(no_loop):
    assert no_loop.volumes is None and "no-loop-control" in no_loop.volume_reason
    with pytest.raises(SandboxError) as e:
        no_loop.create(SandboxSpec(limits=Limits(disk_bytes=32 * MiB)))
    assert "no-loop-control" in e.value.message and "watcher" in e.value.message
    assert "weak_limits=True" in e.value.hint
    # Nothing to enforce, nothing refused (control: the provider itself works).
    with no_loop.create(SandboxSpec(limits=Limits(disk_bytes=None))) as sb:
        assert sb.run("echo ok").stdout == "ok\n"


@needs_root
def test_weak_limits_accept_the_watcher_which_kills_after_the_fact(no_loop):
    spec = SandboxSpec(limits=Limits(disk_bytes=32 * MiB, max_file_size_bytes=1024 * MiB,
                                     weak_limits=True))
    with no_loop.create(spec) as sb:
        assert not os.path.ismount(sb.workspace_dir)   # no filesystem of its own
        r = sb.run(FILL, timeout=60)
        assert r.killed_by == "disk" and "finished" not in r.stdout, r
        assert "disk quota" in r.stderr
        assert (sb.workspace_dir / "big").exists()      # files are kept
        assert sb.run("echo still usable").stdout == "still usable\n"


@needs_root
def test_weak_limits_snapshot_over_the_quota_is_refused(no_loop):
    spec = SandboxSpec(limits=Limits(disk_bytes=8 * MiB, weak_limits=True))
    with no_loop.create(spec) as sb:
        sb.write_file("a.bin", b"a" * (4 * MiB))
        sb.snapshot()                  # under the quota: fine
        sb.write_file("b.bin", b"b" * (6 * MiB))  # from the host: no watcher kill yet
        with pytest.raises(SandboxError, match="snapshot"):
            sb.snapshot()


@needs_root
def test_without_cgroups_memory_limits_are_refused_with_the_reason(no_cgroups):
    assert no_cgroups.cgroups is None
    with pytest.raises(SandboxError) as e:
        no_cgroups.create(SandboxSpec(limits=Limits(memory_bytes=256 * MiB)))
    msg = e.value.message
    assert "rlimits" in msg and "cgroup v1" in msg and "cgroup v2" in msg, msg
    assert "weak_limits=True" in e.value.hint and "Delegate=yes" in e.value.hint


@needs_root
def test_weak_limits_accept_per_process_rlimits(no_cgroups):
    spec = SandboxSpec(limits=Limits(memory_bytes=256 * MiB, max_processes=64,
                                     weak_limits=True))
    with no_cgroups.create(spec) as sb:
        assert sb._cg is None
        r = sb.run("ulimit -v; ulimit -u")
        assert r.stdout.split() == [str(256 * 1024), "64"], r
    # Without memory and process limits there is nothing to refuse.
    with no_cgroups.create(SandboxSpec(limits=Limits(memory_bytes=None,
                                                     max_processes=None))) as sb:
        assert sb.run("echo ok").stdout == "ok\n"


V2_MOUNT = v2_mount(Path("/sys/fs/cgroup"))
needs_v2 = pytest.mark.skipif(V2_MOUNT is None or os.geteuid() != 0,
                              reason="no cgroup v2 hierarchy mounted (or not root)")


@needs_root
@needs_v2
def test_cgroup_v2_detection_reads_the_real_hierarchy(tmp_path, monkeypatch):
    """Only the v2 hierarchy is visible at this root: detection must say what it
    offers and what is missing, or use it if memory and pids are there."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "unified").symlink_to(V2_MOUNT)
    monkeypatch.setenv("RIDGELINE_CGROUP_ROOT", str(root))
    host, reason = CgroupHost.detect_with_reason()
    offered = (V2_MOUNT / "cgroup.controllers").read_text().split()
    if {"memory", "pids"} <= set(offered) and host is not None:
        assert host.version == 2
        assert "memory" in (host.parents[V2] / "cgroup.subtree_control").read_text()
    else:
        assert host is None and "cgroup v2:" in reason and "memory" in reason, reason


def _v2_group_of(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    return ""


@needs_root
@needs_v2
def test_cgroup_v2_places_and_kills_every_process_of_a_sandbox(tmp_path):
    """The v2 mechanics that need no controller, for real: the init and each command
    enter the sandbox's v2 group through the wrapper, a timeout kills a command's
    whole group (a setsid'd child included), and close removes the groups."""
    base = V2_MOUNT / _v2_group_of(os.getpid()).lstrip("/")
    parent = base / f"ridgeline-test-{os.getpid()}"
    parent.mkdir()
    try:
        provider = get_provider("bwrap", root_dir=tmp_path / "root")
        provider.cgroups = CgroupHost({V2: parent}, {V2: base}, version=2)
        spec = SandboxSpec(limits=Limits(memory_bytes=None, max_processes=None))
        with provider.create(spec) as sb:
            group = sb._cg.dirs["pids"]
            rel = "/" + str(group.relative_to(V2_MOUNT))
            assert _v2_group_of(sb.init_pid) == rel
            r = sb.run("setsid sleep 300 & sleep 300", timeout=1)
            assert r.timed_out
            # Control: a background job started without a timeout lives in the group...
            assert sb.run("setsid sleep 300 > /dev/null 2>&1 &").ok

            def sleepers_in_group() -> list[int]:
                out = []
                for p in sb._cg.pids() - {sb.init_pid}:
                    try:
                        if "sleep" in Path(f"/proc/{p}/cmdline").read_text():
                            out.append(p)
                    except OSError:
                        pass
                return out

            # the job may still be forking or exec'ing when run() returns: wait for it
            deadline = time.monotonic() + 10
            while not (sleepers := sleepers_in_group()) and time.monotonic() < deadline:
                time.sleep(0.05)
            inside = sb._cg.pids() - {sb.init_pid}
            assert len(sleepers) == 1, inside   # ...and the timed-out command's did not survive
            assert _v2_group_of(sleepers[0]).startswith(rel + "/x")
        deadline = time.monotonic() + 10
        while group.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not group.exists()
        assert not Path(f"/proc/{sleepers[0]}").exists()
    finally:
        for d in sorted(parent.glob("**/"), key=lambda p: len(p.parts), reverse=True):
            try:
                d.rmdir()
            except OSError:
                pass
