"""The sandbox's disk quota: enforced on what its trees really hold, while it runs."""

from __future__ import annotations

import pytest

from ridgeline.errors import SandboxError
from ridgeline.sandbox import Limits, Mount, SandboxSpec, create_sandbox
from ridgeline.sandbox.disk import allocated_bytes

from sandbox_helpers import needs_bwrap

pytestmark = needs_bwrap
MiB = 1024 * 1024
# Writes 1 MiB at a time, slowly enough for the watcher to see it grow.
FILL = ("python3 -c \"import time\n"
        "with open('{path}', 'wb') as f:\n"
        "    for i in range(400):\n"
        "        f.write(b'x' * (1 << 20)); f.flush(); time.sleep(0.01)\n"
        "print('finished')\"")


def _quota_sandbox(**extra) -> object:
    return create_sandbox(SandboxSpec(limits=Limits(disk_bytes=32 * MiB,
                                                    max_file_size_bytes=1024 * MiB), **extra))


def test_filling_the_workspace_is_killed_and_reported():
    with _quota_sandbox() as sb:
        r = sb.run(FILL.format(path="big"), timeout=60)
        assert r.killed_by == "disk" and "finished" not in r.stdout, r
        assert "disk quota" in r.stderr
        written = allocated_bytes(sb.workspace_dir)
        assert 32 * MiB < written < 200 * MiB   # it ran, over the limit, then was stopped
        assert sb.run("echo still usable").stdout == "still usable\n"
        # Nothing is deleted: the caller decides what to do with the files.
        assert (sb.workspace_dir / "big").exists()


def test_writable_mounts_count_too(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with _quota_sandbox(mounts=[Mount(source=out, target="/out", writable=True)]) as sb:
        r = sb.run(FILL.format(path="/out/big"), timeout=60)
    assert r.killed_by == "disk"


def test_under_the_quota_nothing_happens():
    """Positive control: the same writer, bounded below the quota, finishes."""
    with _quota_sandbox() as sb:
        r = sb.run(FILL.format(path="big").replace("range(400)", "range(16)"), timeout=60)
    assert r.ok and r.stdout == "finished\n" and r.killed_by is None


def test_sparse_files_count_what_they_hold():
    with _quota_sandbox() as sb:
        r = sb.run("truncate -s 900M sparse && sleep 1 && echo done")
        assert r.ok and r.stdout == "done\n"
        snap = sb.snapshot()           # and the snapshot stays small too
        sb.run("rm sparse")
        sb.restore(snap)
        assert (sb.workspace_dir / "sparse").stat().st_size == 900 * MiB
        assert allocated_bytes(sb.workspace_dir) < MiB


def test_snapshot_over_the_quota_is_refused():
    with create_sandbox(SandboxSpec(limits=Limits(disk_bytes=8 * MiB))) as sb:
        # Written from the host, so the watcher has not killed anything yet.
        sb.write_file("a.bin", b"a" * (4 * MiB))
        sb.snapshot()                  # under the quota: fine
        sb.write_file("b.bin", b"b" * (6 * MiB))
        with pytest.raises(SandboxError, match="snapshot"):
            sb.snapshot()
