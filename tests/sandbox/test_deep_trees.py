"""A tree the sandbox leaves behind (a chain of directories far deeper than Python's
recursion limit, or wider than the open-file limit) never makes the harness raise:
`shutil.rmtree` on Python 3.11/3.12 recursed and raised RecursionError, in the trash
thread (after which no process could create a sandbox until a person deleted the tree)
and out of `run_task_episode` (a crashed RL step). Every attack runs for real, with a
positive control that the tree has the depth or width it claims."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ridgeline.errors import SandboxError
from ridgeline.sandbox import SandboxSpec, create_sandbox, hostfs
from ridgeline.sandbox import snapshot as snapshots
from ridgeline.sandbox.host_sandbox import prepare_root

from tests.helpers.sandbox_helpers import needs_bwrap

DEPTHS = [1500, 5000]
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

#: Run inside the sandbox (or on the host): a chain of `depth` directories named "d"
#: under "$1", a file at the bottom. Relative mkdir/chdir: no path ever gets long.
MAKE_CHAIN = ("import os, sys\nos.chdir(sys.argv[1])\nfor _ in range(int(sys.argv[2])):\n"
              "    os.mkdir('d'); os.chdir('d')\nopen('leaf', 'w').write('x')\n")


def make_chain(top: Path, depth: int) -> None:
    subprocess.run([sys.executable, "-c", MAKE_CHAIN, str(top), str(depth)], check=True)


def chain_depth(top: Path) -> int:
    """How many "d" directories are chained below `top` (descriptor by descriptor)."""
    fd, n = os.open(top, _DIR), 0
    try:
        while True:
            try:
                nfd = os.open("d", _DIR, dir_fd=fd)
            except FileNotFoundError:
                return n
            os.close(fd)
            fd, n = nfd, n + 1
    finally:
        os.close(fd)


@pytest.fixture
def tmp_path(tmp_path):
    """A tmpfs directory where there is one: thousands of rmdirs on a busy ext4 journal
    take seconds, and the property under test is the same."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    d = Path(tempfile.mkdtemp(prefix="ridgeline-test-deep-", dir=shm))
    try:
        yield d
    finally:
        hostfs.discard_tree(d, "test directory")


# -- the deletion itself --------------------------------------------------------------------
@pytest.mark.parametrize("depth", DEPTHS)
def test_remove_tree_deletes_a_chain_of_any_depth(tmp_path, depth):
    top = tmp_path / "deep"
    top.mkdir()
    make_chain(top, depth)
    assert chain_depth(top) == depth  # positive control: the tree is that deep
    if sys.version_info < (3, 12):
        # Positive control: the deletion the harness used fails on it (and removes none).
        with pytest.raises(RecursionError):
            shutil.rmtree(top, ignore_errors=True)
        assert chain_depth(top) == depth
    hostfs.remove_path(top)
    assert not top.exists()


@pytest.fixture
def few_fds():
    """An open-file limit a little above what the process holds now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = len(os.listdir("/proc/self/fd")) + 48
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_remove_tree_is_bounded_in_descriptors(tmp_path, few_fds):
    top = tmp_path / "tree"
    top.mkdir()
    wide = few_fds * 3
    for i in range(wide):  # wider than the limit, each branch a few levels deep
        (top / f"b{i}" / "x" / "y").mkdir(parents=True)
        (top / f"b{i}" / "x" / "y" / "f").write_text("x")
    make_chain(top, few_fds * 4)  # deeper than the limit too
    # Positive controls: the limit is real, and the tree exceeds it both ways.
    held = []
    with pytest.raises(OSError) as e:
        for i in range(wide):
            held.append(os.open(top / f"b{i}", _DIR))
    for fd in held:
        os.close(fd)
    assert e.value.errno == 24  # EMFILE
    assert chain_depth(top) == few_fds * 4
    hostfs.remove_path(top)
    assert not top.exists()


def test_remove_tree_takes_read_only_directories(tmp_path):
    top = tmp_path / "ro"
    (top / "a" / "b").mkdir(parents=True)
    (top / "a" / "b" / "f").write_text("x")
    (top / "a" / "b").chmod(0o500)
    (top / "a").chmod(0)
    hostfs.remove_path(top)
    assert not top.exists()


def test_remove_tree_never_follows_links(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("keep")
    top = tmp_path / "tree"
    top.mkdir()
    (top / "link").symlink_to(victim)
    (top / "sub").mkdir()
    (top / "sub" / "flink").symlink_to(victim / "keep")
    hostfs.remove_path(top)
    assert not top.exists()
    assert (victim / "keep").read_text() == "keep"


def test_leftover_deep_tree_does_not_stop_sandbox_creation(tmp_path):
    """A tree left by a process that died (its trash not yet deleted) is removed by the
    next process's prepare_root, which must not raise: it used to, on every start."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    left = root / f".trash-{dead.pid}-0123456789ab"
    (left / "workspace").mkdir(parents=True)
    make_chain(left / "workspace", 3000)
    assert chain_depth(left / "workspace") == 3000  # positive control
    prepare_root(root)
    assert not left.exists()


# -- through real sandboxes -----------------------------------------------------------------
def _wait_gone(path: Path, timeout: float = 120.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not path.exists():
            return True
        time.sleep(0.1)
    return False


@needs_bwrap
@pytest.mark.parametrize("depth", DEPTHS)
def test_deep_tree_left_by_a_command_breaks_nothing(depth):
    with create_sandbox(SandboxSpec()) as sb:
        clean = sb.snapshot()
        r = sb.run(["python3", "-c", MAKE_CHAIN, ".", str(depth)], timeout=120)
        assert r.ok, r.stderr
        assert chain_depth(sb.workspace_dir) == depth  # positive control
        # A listing and a snapshot refuse it with a clear error (both are bounded);
        # listing its top still works.
        with pytest.raises(SandboxError, match="deeper than"):
            sb.list_files(".", recursive=True)
        assert sb.list_files(".") == ["d/"]
        with pytest.raises(SandboxError, match="deeper than"):
            sb.snapshot()
        # A restore (what a pool's reset does) deletes it.
        sb.restore(clean)
        assert sb.list_files(".") == []
        # Again, and then the trash gets it when the sandbox closes.
        r = sb.run(["python3", "-c", MAKE_CHAIN, ".", str(depth)], timeout=120)
        assert r.ok and chain_depth(sb.workspace_dir) == depth
        sandbox_dir = sb.dir
    trash = sandbox_dir.with_name(f".trash-{sandbox_dir.name}")
    assert _wait_gone(trash) and not sandbox_dir.exists()
    # The trash thread lived through it, and this process still makes sandboxes.
    for _ in range(2):
        with create_sandbox(SandboxSpec()) as again:
            assert again.run(["true"]).ok
            gone = again.dir
        assert _wait_gone(gone.with_name(f".trash-{gone.name}"))


@needs_bwrap
def test_snapshot_and_listing_keep_working_below_the_bound():
    with create_sandbox(SandboxSpec()) as sb:
        depth = snapshots.MAX_DEPTH - 1  # the leaf is one level further down
        r = sb.run(["python3", "-c", MAKE_CHAIN, ".", str(depth)], timeout=60)
        assert r.ok, r.stderr
        listed = sb.list_files(".", recursive=True)
        assert sum(p.endswith("d/") for p in listed) == depth
        snap = sb.snapshot()
        sb.run(["sh", "-c", "rm -rf d && echo new > n"])
        sb.restore(snap)
        assert chain_depth(sb.workspace_dir) == depth
        assert sb.read_file("/".join(["d"] * depth) + "/leaf") == b"x"


_MOUNTED = """
import os, subprocess, sys
from ridgeline.sandbox import hostfs
top = sys.argv[1]
os.makedirs(top + "/sub/mnt")
open(top + "/sub/file", "w").write("x")
subprocess.run(["mount", "-t", "tmpfs", "none", top + "/sub/mnt"], check=True)
open(top + "/sub/mnt/keep", "w").write("kept")
print("before", os.path.exists(top + "/sub/mnt/keep"))
try:
    hostfs.remove_path(top)
except hostfs.CleanupError as e:
    print("error", e)
print("after", open(top + "/sub/mnt/keep").read(), os.path.exists(top + "/sub/file"))
print("discard", hostfs.discard_tree(top))  # the caller-safe form: logged, not raised
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="mounting a tmpfs needs root and unshare")
def test_remove_tree_does_not_cross_mount_points(tmp_path):
    """A filesystem mounted inside a tree (a workspace image still mounted, say) is not
    emptied: its mount point stays, and the failure is reported, not raised further."""
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable,
                        "-c", _MOUNTED, str(tmp_path / "tree")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "before True"  # positive control: the mount held the file
    assert lines[1].startswith("error ") and "mount point" in lines[1]
    assert lines[2] == "after kept False"  # the rest of the tree went
    assert lines[3] == "discard False" and "could not delete" in r.stderr


@needs_bwrap
def test_a_pool_reset_removes_a_deep_tree():
    from ridgeline.sandbox import SandboxPool
    with SandboxPool(SandboxSpec(), size=1) as pool:
        sb = pool.acquire()
        r = sb.run(["python3", "-c", MAKE_CHAIN, ".", "1500"], timeout=120)
        assert r.ok and chain_depth(sb.workspace_dir) == 1500  # positive control
        first = sb.id
        pool.release(sb)
        again = pool.acquire(timeout=120)
        assert again.id == first  # reset, not replaced
        assert again.list_files(".") == []
        pool.release(again)
