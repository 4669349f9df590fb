"""The sandbox's disk quota: the workspace is a filesystem of `disk_bytes` and
`disk_inodes` (volume.py), so every way to take disk ends at the limit with ENOSPC; the
watcher stays as the backstop over the workspace and writable mounts together."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from ridgeline.errors import SandboxError
from ridgeline.sandbox import Limits, Mount, SandboxPool, SandboxSpec, create_sandbox, hostfs
from ridgeline.sandbox.disk import allocated_bytes

from tests.helpers.sandbox_helpers import needs_bwrap

pytestmark = needs_bwrap
MiB = 1024 * 1024
LIMIT = 32 * MiB
# Writes 1 MiB at a time, slowly enough for the watcher to see it grow.
FILL = ("python3 -c \"import time\n"
        "with open('{path}', 'wb') as f:\n"
        "    for i in range(400):\n"
        "        f.write(b'x' * (1 << 20)); f.flush(); time.sleep(0.01)\n"
        "print('finished')\"")

# Each attack prints how far it got and the error that stopped it.
ATTACKS = {
    # Written into a file that is in no directory: invisible to any walk.
    "unlinked_open_file": """
import errno, os
f = open('ghost', 'wb'); os.unlink('ghost'); n = 0
try:
    while n < 300:
        f.write(b'x' * (1 << 20)); f.flush(); n += 1
    print('reached', n, 'none')
except OSError as e:
    print('reached', n, errno.errorcode[e.errno])
""",
    # Blocks taken in one call, long before a watcher's next walk.
    "fallocate": """
import errno, os
fd = os.open('small', os.O_WRONLY | os.O_CREAT)
os.posix_fallocate(fd, 0, 1 << 20)           # control: fallocate itself works here
fd2 = os.open('big', os.O_WRONLY | os.O_CREAT)
try:
    os.posix_fallocate(fd2, 0, 2 << 30)
    print('reached', os.fstat(fd2).st_blocks * 512 >> 20, 'none')
except OSError as e:
    print('reached', os.fstat(fd).st_blocks * 512 >> 20, errno.errorcode[e.errno])
""",
    # Empty files: no bytes to count, only inodes.
    "inode_flood": """
import errno, os
os.mkdir('many'); n = 0
try:
    while n < 20000:
        os.close(os.open(f'many/{n}', os.O_CREAT | os.O_WRONLY)); n += 1
    print('reached', n, 'none')
except OSError as e:
    print('reached', n, errno.errorcode[e.errno])
""",
    # A chain deeper than any open-file limit a walker has, then a fill below it.
    "deep_chain_then_fill": """
import errno, os
for _ in range(3000):
    os.mkdir('d'); os.chdir('d')
n = 0
try:
    with open('fill', 'wb') as f:
        while n < 300:
            f.write(b'x' * (1 << 20)); f.flush(); n += 1
    print('reached', n, 'none')
except OSError as e:
    print('reached', n, errno.errorcode[e.errno])
""",
}


def _quota_sandbox(**extra) -> object:
    limits = {"disk_bytes": LIMIT, "disk_inodes": 4000, "max_file_size_bytes": 4096 * MiB,
              **extra.pop("limits", {})}
    return create_sandbox(SandboxSpec(limits=Limits(**limits), **extra))


@pytest.fixture
def out_dir(tmp_path):
    """The writable mount's host directory. Deleted iteratively afterwards: the deep
    chain copied back into it would crash pytest's own (recursive) clean-up of old
    temporary directories in a later session."""
    out = tmp_path / "out"
    out.mkdir()
    yield out
    hostfs.discard_tree(out, "test directory")


@pytest.mark.parametrize("where", ["workspace", "writable_mount"])
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_every_way_to_take_disk_ends_at_the_limit(attack, where, out_dir):
    out = out_dir
    with _quota_sandbox(mounts=[Mount(source=out, target="/out", writable=True)]) as sb:
        tree, image, cwd = ((sb.workspace_dir, "disk.img", None) if where == "workspace"
                            else (out, "mount-0.img", "/out"))
        assert os.path.ismount(tree)
        r = sb.run(["python3", "-c", textwrap.dedent(ATTACKS[attack])], timeout=120,
                   cwd=cwd)
        word, reached, err = r.stdout.split()
        # The attack ran (up to the limit) and the filesystem refused the rest.
        assert word == "reached" and err == "ENOSPC", r
        if attack == "inode_flood":
            assert 3500 <= int(reached) <= 4000
        elif attack == "fallocate":
            assert int(reached) >= 1  # the control allocation held
        elif attack == "deep_chain_then_fill":
            assert 12 <= int(reached) <= LIMIT // MiB  # 3,000 directories hold 12 MiB
        else:
            assert 24 <= int(reached) <= LIMIT // MiB
        used = os.statvfs(tree)
        assert (used.f_blocks - used.f_bfree) * used.f_frsize <= LIMIT + MiB
        # The host holds no more than the image, whatever happened inside.
        assert os.stat(sb.dir / image).st_blocks * 512 < LIMIT + 8 * MiB
        assert sb.run("echo still usable").stdout == "still usable\n"
        assert r.killed_by is None  # refused, not killed: the agent's own failure


def test_filling_the_workspace_stops_at_the_limit_and_keeps_the_files():
    with _quota_sandbox() as sb:
        r = sb.run(FILL.format(path="big"), timeout=60)
        assert not r.ok and "finished" not in r.stdout and "No space left" in r.stderr, r
        written = (sb.workspace_dir / "big").stat().st_size
        assert 24 * MiB <= written <= LIMIT
        # Nothing is deleted: the caller decides what to do with the files.
        assert sb.run("rm big && echo freed").stdout == "freed\n"
        assert sb.run(FILL.format(path="big").replace("range(400)", "range(16)")).ok


def test_writable_mounts_count_too(tmp_path):
    """Each tree is bounded by its filesystem; the watcher bounds their total."""
    out = tmp_path / "out"
    out.mkdir()
    with _quota_sandbox(mounts=[Mount(source=out, target="/out", writable=True)]) as sb:
        half = FILL.format(path="/out/big").replace("range(400)", "range(20)")
        assert sb.run(half, timeout=60).ok          # control: 20 MiB alone is fine
        r = sb.run(FILL.format(path="big"), timeout=60)
    assert r.killed_by == "disk" and "disk quota" in r.stderr, r


def test_a_writable_mount_is_live_on_the_host_and_comes_back_after_close(tmp_path):
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "seed.txt").write_text("seed\n")
    os.symlink("/etc/passwd", out / "link")
    os.chmod(out, 0o751)
    with _quota_sandbox(mounts=[Mount(source=out, target="/out", writable=True)]) as sb:
        assert os.path.ismount(out)
        r = sb.run("set -e; cat /out/seed.txt; mkdir /out/made; echo new > /out/made/new; "
                   "rm /out/seed.txt; head -c 1M /dev/zero > /out/mb; truncate -s 1G /out/sparse")
        assert r.ok and r.stdout == "seed\n", r
        assert (out / "made" / "new").read_text() == "new\n"   # live on the host
    assert not os.path.ismount(out)
    assert sorted(os.listdir(out)) == ["link", "made", "mb", "sparse", "sub"]
    assert (out / "made" / "new").read_text() == "new\n"
    assert os.readlink(out / "link") == "/etc/passwd"          # copied, not followed
    assert (out / "mb").stat().st_size == MiB and allocated_bytes(out / "sub") < MiB
    assert (out / "sparse").stat().st_blocks == 0              # holes stay holes
    assert oct(out.stat().st_mode & 0o777) == oct(0o751)


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


def test_host_writes_meet_the_same_limit():
    with create_sandbox(SandboxSpec(limits=Limits(disk_bytes=8 * MiB))) as sb:
        sb.write_file("a.bin", b"a" * (4 * MiB))
        sb.snapshot()                  # under the quota: fine
        with pytest.raises(OSError, match="No space left"):
            sb.write_file("b.bin", b"b" * (6 * MiB))


def test_a_seed_larger_than_the_disk_is_refused(tmp_path):
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "big").write_bytes(os.urandom(3 * MiB))
    with pytest.raises(SandboxError, match="does not fit"):
        create_sandbox(SandboxSpec(workspace_from=seed, limits=Limits(disk_bytes=MiB)))
    with create_sandbox(SandboxSpec(workspace_from=seed, limits=Limits(disk_bytes=4 * MiB))) as sb:
        assert sb.read_file("big") == (seed / "big").read_bytes()   # control: it fits


def _loop_of(point) -> str:
    for line in open("/proc/self/mountinfo"):
        fields = line.split()
        if fields[4] == str(point):
            return fields[fields.index("-") + 2]
    return ""


def _backing(dev: str) -> str:
    try:
        return open(f"/sys/block/{os.path.basename(dev)}/loop/backing_file").read().strip()
    except OSError:
        return ""


def test_close_unmounts_and_frees_the_volumes_even_with_later_sandboxes_alive(tmp_path):
    import time
    out = tmp_path / "out"
    out.mkdir()
    a = _quota_sandbox(mounts=[Mount(source=out, target="/out", writable=True)])
    volumes = [(a.workspace_dir, a.dir / "disk.img"), (out, a.dir / "mount-0.img")]
    devs = [_loop_of(point) for point, _ in volumes]
    for dev, (_, image) in zip(devs, volumes):   # control: both are loop-mounted images
        assert dev.startswith("/dev/loop") and str(image) in _backing(dev)
    # Started after `a`: its launcher's mount namespace began as a copy of the host's,
    # `a`'s volumes included; it must not keep those filesystems alive.
    with _quota_sandbox() as b:
        assert b.run("echo hi").stdout == "hi\n"
        a.close()
        for dev, (point, image) in zip(devs, volumes):
            assert _loop_of(point) == "" and not image.exists()
            # (the backing file's name follows the sandbox directory into the trash)
            deadline = time.monotonic() + 10
            while a.id in _backing(dev) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert a.id not in _backing(dev), _backing(dev)


def test_a_pool_member_that_filled_its_disk_comes_back_clean(tmp_path):
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "keep.txt").write_text("seed\n")
    spec = SandboxSpec(workspace_from=seed, limits=Limits(disk_bytes=LIMIT, disk_inodes=2000))
    with SandboxPool(spec, size=1) as pool:
        sb = pool.acquire()
        r = sb.run("head -c 64M /dev/zero > fill; "
                   "python3 -c \"import os\nfor i in range(5000): open(f'f{i}', 'w')\"")
        assert "No space left" in r.stderr  # control: it filled inodes and blocks
        pool.release(sb)
        again = pool.acquire(timeout=60)
        assert again.list_files() == ["keep.txt"]
        r = again.run(FILL.format(path="big").replace("range(400)", "range(16)"))
        assert r.ok and r.stdout == "finished\n"
        pool.release(again)


def test_stale_volumes_of_a_dead_process_are_unmounted(tmp_path):
    """A process that died without closing its sandbox leaves a mounted volume; the
    next provider on the same root unmounts it."""
    root = tmp_path / "root"
    code = textwrap.dedent(f"""
        import os
        from pathlib import Path
        from ridgeline.sandbox import Limits, SandboxSpec, get_provider
        sb = get_provider("bwrap", root_dir=Path({str(root)!r})).create(
            SandboxSpec(limits=Limits(disk_bytes=8 << 20)))
        print(sb.workspace_dir, flush=True)
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    ws = out.stdout.strip()
    assert ws and _loop_of(ws), out.stderr      # control: the crash left it mounted
    from ridgeline.sandbox import get_provider
    get_provider("bwrap", root_dir=root)
    assert _loop_of(ws) == ""


def test_an_unmeasurable_tree_counts_as_over_the_quota(tmp_path):
    """The watcher (for writable mounts, and without volumes): a chain deeper than the
    open-file limit breaks the walk, which must count as over the quota, never 0."""
    tree = tmp_path / "tree"
    tree.mkdir()
    fd = os.open(tree, os.O_RDONLY)
    try:
        for _ in range(200):
            os.mkdir("d", dir_fd=fd)
            new = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = new
    finally:
        os.close(fd)
    code = textwrap.dedent(f"""
        import resource
        from ridgeline.sandbox import disk
        from ridgeline.sandbox.quota import DiskQuota
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        try:
            print("walk measured", disk.allocated_bytes({str(tree)!r}))
        except OSError as e:
            print("walk failed", e.errno)       # the attack breaks a plain walk
        hits = []
        q = DiskQuota([__import__("pathlib").Path({str(tree)!r})], 1 << 30, hits.append)
        print("over" if q.check() and hits else f"under {{q.used()}}")
        q.stop()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    walk, verdict = out.stdout.split("\n")[:2]
    if walk.startswith("walk failed"):
        assert verdict == "over", out
    else:  # a walk that copes with the depth must then count what is there
        assert verdict.startswith("under") and int(verdict.split()[1]) > 0, out
