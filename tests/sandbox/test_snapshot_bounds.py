"""Snapshots are bounded by the disk the workspace really holds: copies keep holes, a
size limit refuses big workspaces, and a restore leaves nothing of the sandbox's on the
workspace root or on directories (modes, owners, extended attributes)."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import struct
import zlib
from pathlib import Path

import pytest

from ridgeline.errors import SandboxError
from ridgeline.sandbox import SandboxPool, SandboxSpec, disk
from ridgeline.sandbox import snapshot as snapshots

from tests.helpers.sandbox_helpers import needs_bwrap

MiB = 1 << 20
SPARSE = 32 * MiB  # on the host; the sandbox test makes the 256 MiB file of the report


# -- helpers -----------------------------------------------------------------------------
def make_sparse(path: Path, size: int = SPARSE) -> Path:
    """Holes with a few pieces of data in them (so a copy has extents to get right),
    and a hole at the end."""
    pieces = {0: b"head", 1_000_000: b"data", size // 2 + 3: b"middle" * 1000}
    with open(path, "wb") as f:
        f.truncate(size)
        for offset, data in pieces.items():
            f.seek(offset)
            f.write(data)
    if allocated(path) > size // 2:
        pytest.skip(f"the filesystem of {path} does not keep holes")
    return path


def allocated(path: Path) -> int:
    return os.lstat(path).st_blocks * 512


def digest(path: Path) -> tuple[int, int]:
    """Size and CRC-32 of the content (sha256 of 256 MiB is slow on small machines)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 * MiB):
            crc = zlib.crc32(chunk, crc)
    return path.stat().st_size, crc


def xattrs(path: Path) -> dict[str, bytes]:
    return {n: os.getxattr(path, n, follow_symlinks=False)
            for n in os.listxattr(path, follow_symlinks=False)}


def needs_user_xattrs(path: Path) -> None:
    probe = path / ".xattr-probe"
    probe.mkdir()
    try:
        os.setxattr(probe, "user.probe", b"1")
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            pytest.skip(f"the filesystem of {path} has no user.* extended attributes")
        raise
    finally:
        probe.rmdir()


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    root.chmod(0o755)
    return root


# -- sparse copies -------------------------------------------------------------------------
def test_take_and_restore_keep_holes(ws: Path, tmp_path: Path):
    big = make_sparse(ws / "big")
    want = digest(big)
    snap = snapshots.take(ws, tmp_path / "store", "s1")
    assert disk.allocated_bytes(tmp_path / "store") < MiB  # not 256 MiB of zeros
    assert (tmp_path / "store" / "big").stat().st_size == SPARSE
    big.unlink()
    snapshots.restore(ws, snap)
    assert digest(big) == want and allocated(big) < MiB
    with open(big, "r+b") as f:  # an in-place change is copied back sparsely too
        f.seek(5)
        f.write(b"X")
    snapshots.restore(ws, snap)
    assert digest(big) == want and allocated(big) < MiB


def test_copy_sparse_with_trailing_data_and_fallbacks(tmp_path: Path, monkeypatch):
    src = make_sparse(tmp_path / "src")
    with open(src, "r+b") as f:  # data right at the end: no trailing hole
        f.seek(SPARSE - 3)
        f.write(b"end")
    want = digest(src)

    def copy(name: str) -> Path:
        dst = tmp_path / name
        with open(src, "rb") as fs, open(dst, "wb") as fd:
            disk.copy_sparse(fs.fileno(), fd.fileno())
        assert digest(dst) == want
        return dst

    assert allocated(copy("plain")) < MiB
    # Across filesystems copy_file_range fails: reads and writes, still sparse.
    def no_cfr(*a, **k):
        raise OSError(errno.EXDEV, "cross-device")
    monkeypatch.setattr(os, "copy_file_range", no_cfr)
    assert allocated(copy("pread")) < MiB
    # A filesystem without SEEK_DATA: one dense copy, the same bytes.
    real_lseek = os.lseek

    def no_seek_data(fd, pos, how):
        if how in (os.SEEK_DATA, os.SEEK_HOLE):
            raise OSError(errno.EINVAL, "no SEEK_DATA")
        return real_lseek(fd, pos, how)
    monkeypatch.setattr(os, "lseek", no_seek_data)
    copy("dense")


def test_copytree_with_copy2_sparse(tmp_path: Path):
    seed = tmp_path / "seed"
    (seed / "d").mkdir(parents=True)
    big = make_sparse(seed / "d" / "big")
    big.chmod(0o640)
    os.symlink("d/big", seed / "link")
    out = tmp_path / "out"
    shutil.copytree(seed, out, symlinks=True, copy_function=disk.copy2_sparse)
    copied = out / "d" / "big"
    assert digest(copied) == digest(big) and allocated(copied) < MiB
    assert stat.S_IMODE(copied.stat().st_mode) == 0o640
    assert os.readlink(out / "link") == "d/big"


# -- the size limit ------------------------------------------------------------------------
def test_max_bytes_counts_allocated_blocks_and_refuses_before_copying(ws: Path, tmp_path: Path):
    make_sparse(ws / "big")
    (ws / "d").mkdir()
    (ws / "d" / "dense").write_bytes(os.urandom(2 * MiB))
    os.link(ws / "d" / "dense", ws / "hardlink")  # its blocks count once
    snapshots.fine_grained_ctime(ws)  # the once-per-device probe, out of the way
    used = disk.allocated_bytes(ws)
    assert 2 * MiB <= used < 4 * MiB  # the 256 MiB file costs its blocks only
    with pytest.raises(SandboxError) as err:
        snapshots.take(ws, tmp_path / "refused", "s0", max_bytes=used - 1)
    msg = str(err.value)
    assert str(used) in msg and str(used - 1) in msg and "delete" in msg
    assert not (tmp_path / "refused").exists()
    # Positive control: exactly at the limit is allowed, and it is a working snapshot.
    snap = snapshots.take(ws, tmp_path / "store", "s1", max_bytes=used)
    (ws / "d" / "dense").unlink()
    snapshots.restore(ws, snap)
    assert (ws / "d" / "dense").read_bytes() == (ws / "hardlink").read_bytes()


def test_a_failed_take_leaves_no_store(ws: Path, tmp_path: Path, monkeypatch):
    for i in range(3):
        (ws / f"f{i}").write_bytes(b"x" * 100)
    calls = []

    def failing_copy(src, dst):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        disk.copy_sparse(src, dst)
    monkeypatch.setattr(snapshots, "_copy_fd", failing_copy)
    with pytest.raises(OSError, match="No space"):
        snapshots.take(ws, tmp_path / "store", "s1")
    assert not (tmp_path / "store").exists()
    # A store that already exists is somebody else's: refused, and left alone.
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep").write_text("k")
    monkeypatch.undo()
    with pytest.raises(FileExistsError):
        snapshots.take(ws, other, "s2")
    assert (other / "keep").read_text() == "k"


# -- measuring a live tree -----------------------------------------------------------------
def test_allocated_bytes_counts_inodes_once_and_never_follows_links(ws: Path, tmp_path: Path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "huge").write_bytes(os.urandom(4 * MiB))
    (ws / "sub").mkdir()
    (ws / "sub" / "f").write_bytes(os.urandom(MiB))
    os.link(ws / "sub" / "f", ws / "f2")
    os.symlink(outside, ws / "dirlink")
    os.symlink(outside / "huge", ws / "filelink")
    make_sparse(ws / "sparse")
    u = disk.usage(ws)
    assert MiB <= u.allocated < 2 * MiB
    assert disk.allocated_bytes(ws) == u.allocated
    # root, sub, sub/f (= f2), two links, sparse
    assert u.entries == 6
    assert disk.apparent_bytes(ws) >= SPARSE + MiB  # the sizes do count the holes
    fd = os.open(ws, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert disk.allocated_bytes(fd) == u.allocated
        os.fstat(fd)  # left open for the caller
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        disk.allocated_bytes(ws / "dirlink")  # a root that is a symlink is refused


def test_walk_tolerates_entries_vanishing_or_swapped_mid_walk(ws: Path, tmp_path: Path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("s")
    (ws / "d" / "sub").mkdir(parents=True)
    (ws / "d" / "sub" / "deep").write_text("x")
    for name in ("a", "b"):
        (ws / "d" / name).write_text(name)
    (ws / "d" / "swap").mkdir()

    def sandbox_acts(rel: str, fd: int) -> None:
        # Runs after "d" is listed and before its entries are stat-ed or opened.
        if rel == "d":
            os.unlink("a", dir_fd=fd)
            shutil.rmtree("sub", dir_fd=fd)
            os.rmdir("swap", dir_fd=fd)
            os.symlink(outside, "swap", dir_fd=fd)

    fd = os.open(ws, os.O_RDONLY | os.O_DIRECTORY)
    try:
        seen = dict(disk.walk(fd, sandbox_acts))
    finally:
        os.close(fd)
    assert sorted(seen) == ["d", "d/b", "d/swap"]
    assert stat.S_ISLNK(seen["d/swap"].st_mode)  # not followed to the outside


# -- the root and directories after restore ------------------------------------------------
@pytest.mark.parametrize("how", ["take", "adopt"])
def test_restore_resets_root_and_directory_attributes(ws: Path, tmp_path: Path, how: str):
    needs_user_xattrs(ws)
    (ws / "d").mkdir()
    os.setxattr(ws / "d", "user.keep", b"k")
    (ws / "e" / "inner").mkdir(parents=True)
    os.setxattr(ws / "e" / "inner", "user.inner", b"i")
    (ws / "f").write_text("content")
    snap = snapshots.take(ws, tmp_path / "store", "s1")
    if how == "adopt":  # the pool's path: the workspace equals the store, nothing copied
        snap = snapshots.adopt(ws, tmp_path / "store", "base")
    # What a sandbox leaves behind for the next lease:
    os.chmod(ws, 0o777)
    if os.geteuid() == 0:
        os.chown(ws, 4321, 4321)
    os.setxattr(ws, "user.x", b"1")
    os.setxattr(ws / "d", "user.keep", b"changed")
    os.setxattr(ws / "d", "user.extra", b"e")
    shutil.rmtree(ws / "e")
    os.setxattr(ws / "f", "user.y", b"2")
    (ws / "new").mkdir()
    os.setxattr(ws / "new", "user.z", b"3")

    snapshots.restore(ws, snap)
    st = os.stat(ws)
    assert stat.S_IMODE(st.st_mode) == 0o755
    assert (st.st_uid, st.st_gid) == (os.geteuid(), os.getegid())
    assert xattrs(ws) == {}
    assert xattrs(ws / "d") == {"user.keep": b"k"}
    assert xattrs(ws / "e" / "inner") == {"user.inner": b"i"}  # recreated with its own
    assert xattrs(ws / "f") == {} and (ws / "f").read_text() == "content"
    assert not (ws / "new").exists()
    # A second round from the updated manifest works the same.
    os.chmod(ws, 0o700)
    os.setxattr(ws, "user.x", b"again")
    snapshots.restore(ws, snap)
    assert stat.S_IMODE(os.stat(ws).st_mode) == 0o755 and xattrs(ws) == {}


def test_restore_brings_back_root_xattrs_of_the_snapshot(ws: Path, tmp_path: Path):
    needs_user_xattrs(ws)
    os.setxattr(ws, "user.seeded", b"s")
    snap = snapshots.take(ws, tmp_path / "store", "s1")
    os.removexattr(ws, "user.seeded")
    snapshots.restore(ws, snap)
    assert xattrs(ws) == {"user.seeded": b"s"}


def posix_acl(*entries: tuple[int, int, int]) -> bytes:
    """The kernel's xattr form of a POSIX ACL (what setfacl writes): version 2, then
    (tag, perm, id) per entry."""
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


def test_restore_removes_a_default_acl_left_on_the_root(ws: Path, tmp_path: Path):
    # A default ACL on the root would make every file created later (by the restore or
    # by the next lease) readable by the uid it names.
    snap = snapshots.take(ws, tmp_path / "store", "s1")
    none = 0xFFFFFFFF
    acl = posix_acl((0x01, 7, none), (0x02, 7, 4321), (0x04, 5, none), (0x10, 7, none),
                    (0x20, 5, none))  # user::rwx user:4321:rwx group::r-x mask::rwx other::r-x
    try:
        os.setxattr(ws, "system.posix_acl_default", acl)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            pytest.skip("the filesystem has no POSIX ACLs")
        raise
    assert "system.posix_acl_default" in os.listxattr(ws)
    snapshots.restore(ws, snap)
    assert xattrs(ws) == {}
    (ws / "later").write_text("x")
    assert xattrs(ws / "later") == {}  # nothing inherited


# -- end to end, in a real sandbox ---------------------------------------------------------
SANDBOX_LEFTOVERS = (
    "truncate -s 256M big && printf data | dd of=big bs=1 seek=1000000 conv=notrunc "
    "2>/dev/null && chmod 0777 . && python3 -c \"import os; os.setxattr('.', 'user.x', b'1')\"")


def _host_supports_user_xattrs(path: Path) -> bool:
    try:
        os.setxattr(path, "user.ridgeline-probe", b"1")
        os.removexattr(path, "user.ridgeline-probe")
        return True
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return False
        raise


@needs_bwrap
def test_sandbox_snapshot_of_a_sparse_file_and_a_tampered_root(sandbox):
    wsd = sandbox.workspace_dir
    if not _host_supports_user_xattrs(wsd):
        pytest.skip("the workspace filesystem has no user.* extended attributes")
    res = sandbox.run("truncate -s 256M big && printf data | dd of=big bs=1 seek=1000000 "
                      "conv=notrunc 2>/dev/null")
    assert res.exit_code == 0, res.stderr
    want, mode = digest(wsd / "big"), stat.S_IMODE(os.stat(wsd).st_mode)
    snap = sandbox.snapshot()
    assert disk.allocated_bytes(sandbox.dir / "snapshots") < MiB
    res = sandbox.run("rm big && chmod 0777 . && python3 -c \"import os; "
                      "os.setxattr('.', 'user.x', b'1')\"")
    assert res.exit_code == 0, res.stderr
    assert xattrs(wsd) == {"user.x": b"1"}  # the sandbox could do it: the test is real
    sandbox.restore(snap)
    assert digest(wsd / "big") == want and allocated(wsd / "big") < MiB
    assert stat.S_IMODE(os.stat(wsd).st_mode) == mode and xattrs(wsd) == {}
    assert sandbox.run("stat -c %a .").stdout.strip() == f"{mode:o}"


@needs_bwrap
def test_pool_hands_out_a_clean_root_again(tmp_path: Path):
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "keep.txt").write_text("original")
    with SandboxPool(SandboxSpec(workspace_from=seed), size=1) as pool:
        sb = pool.acquire()
        wsd = sb.workspace_dir
        if not _host_supports_user_xattrs(wsd):
            pytest.skip("the workspace filesystem has no user.* extended attributes")
        mode = stat.S_IMODE(os.stat(wsd).st_mode)
        res = sb.run(SANDBOX_LEFTOVERS)
        assert res.exit_code == 0, res.stderr
        assert stat.S_IMODE(os.stat(wsd).st_mode) == 0o777 and "user.x" in xattrs(wsd)
        pool.release(sb)
        again = pool.acquire(timeout=30)
        assert again is sb
        assert stat.S_IMODE(os.stat(wsd).st_mode) == mode and xattrs(wsd) == {}
        assert sorted(again.list_files()) == ["keep.txt"]
        pool.release(again)


# -- hard links ----------------------------------------------------------------------------
LINKED = 20 * MiB
NAMES = 31  # a file and 30 more links to it


def _linked_workspace(ws: Path) -> list[Path]:
    (ws / "a" / "b").mkdir(parents=True)
    first = ws / "a" / "data"
    first.write_bytes(os.urandom(LINKED))
    names = [first] + [ws / ("a/b" if i % 2 else "") / f"link{i}" for i in range(NAMES - 1)]
    for n in names[1:]:
        os.link(first, n)
    return names


def _inodes(paths: list[Path]) -> set[int]:
    return {p.lstat().st_ino for p in paths}


def test_hard_links_are_stored_once_and_restored_as_links(ws: Path, tmp_path: Path):
    names = _linked_workspace(ws)
    want = names[0].read_bytes()
    # Positive control: name by name, the workspace is 620 MiB of file data.
    assert sum(p.stat().st_size for p in names) == NAMES * LINKED
    assert names[0].stat().st_nlink == NAMES
    limit = LINKED + 4 * MiB
    snap = snapshots.take(ws, tmp_path / "store", "s1", max_bytes=limit)
    assert disk.allocated_bytes(tmp_path / "store") < limit
    assert os.stat(tmp_path / "store" / "a" / "data").st_nlink == NAMES
    # The sandbox breaks the links every way: a name removed, one replaced by a copy,
    # one by other content, and the shared data changed in place.
    names[3].unlink()
    names[4].unlink()
    shutil.copyfile(names[0], names[4])
    names[5].unlink()
    names[5].write_bytes(b"other")
    with open(names[0], "r+b") as f:
        f.write(b"changed")
    snapshots.restore(ws, snap)
    assert len(_inodes(names)) == 1 and names[0].stat().st_nlink == NAMES
    assert names[7].read_bytes() == want
    assert disk.allocated_bytes(ws) < limit
    # Restoring again changes nothing (the links are recognised as unchanged) ...
    before = names[0].stat()
    snapshots.restore(ws, snap)
    after = names[0].stat()
    assert (after.st_ino, after.st_ctime_ns) == (before.st_ino, before.st_ctime_ns)
    # ... and the next snapshot shares the store's inode instead of copying.
    snapshots.take(ws, tmp_path / "store2", "s2", previous=snap, max_bytes=limit)
    assert os.stat(tmp_path / "store2" / "link8").st_ino == os.stat(
        tmp_path / "store" / "a" / "data").st_ino


def test_a_copy_that_grows_past_the_limit_is_refused(ws: Path, tmp_path: Path, monkeypatch):
    """The size check runs before copying; a file that grows meanwhile (a running
    sandbox) is caught by counting what the copy really stored."""
    (ws / "f").write_bytes(os.urandom(MiB))
    (ws / "g").write_bytes(os.urandom(MiB))
    real = snapshots._copy_fd

    def grow_then_copy(src, dst):  # the sandbox appends while we copy
        w = os.open(f"/proc/self/fd/{src}", os.O_WRONLY | os.O_APPEND)
        try:
            os.write(w, os.urandom(4 * MiB))
        finally:
            os.close(w)
        real(src, dst)
    monkeypatch.setattr(snapshots, "_copy_fd", grow_then_copy)
    with pytest.raises(SandboxError, match="over the snapshot limit"):
        snapshots.take(ws, tmp_path / "store", "s1", max_bytes=3 * MiB)
    assert not (tmp_path / "store").exists()
    monkeypatch.undo()
    # Positive control: the same workspace (grown to 6 MiB) fits under a larger limit.
    snapshots.take(ws, tmp_path / "store", "s1", max_bytes=16 * MiB)


@needs_bwrap
def test_sandbox_snapshot_keeps_hard_links(make_sandbox):
    sb = make_sandbox(limits={"disk_bytes": 64 * MiB})
    r = sb.run(["sh", "-c", "head -c 20971520 /dev/urandom > data && "
                "for i in $(seq 30); do ln data l$i; done && stat -c %h data"])
    assert r.ok and r.stdout.split() == ["31"], r.stderr  # positive control: 31 names
    snap = sb.snapshot()  # 620 MiB name by name, 20 MiB stored
    r = sb.run(["sh", "-c", "rm l1 l2 && cp data l3.tmp && mv l3.tmp l3 && echo x > l4"])
    assert r.ok
    sb.restore(snap)
    r = sb.run(["sh", "-c", "stat -c '%h %i' data l1 l3 l4 l30 | sort -u"])
    assert r.ok and len(r.stdout.splitlines()) == 1 and r.stdout.startswith("31 "), r.stdout
