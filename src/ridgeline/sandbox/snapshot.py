"""Workspace snapshots: `take` copies the tree into a store, `restore` brings the live
workspace back to it byte for byte, touching only what changed.

Why not hard links or a rename: the workspace is bind-mounted into a running sandbox
(so it must stay the same directory) and its files are modified in place (so a hard
link would change the snapshot too); ext4 and tmpfs have no reflinks. Instead each
snapshot keeps a manifest of what every entry looked like (inode, size, mtime, ctime,
mode, owner). Any write or chmod updates ctime, which user code cannot set, so on
restore an unchanged entry is recognised by its stat alone and only changed, added or
deleted files cost I/O. Where a filesystem's ctime is coarser than the gap between the
snapshot and a later write (checked once per filesystem), files changed within that
window are always copied back. Store files are never modified after creation, so an
unchanged file is hard-linked from the previous snapshot's store instead of copied.

The workspace belongs to the sandbox, which may swap a directory for a symlink while we
work as root; every operation inside it is relative to a directory descriptor opened
with O_NOFOLLOW, so no path ever leads the host outside the workspace.
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

#: When ctime is coarse, entries whose ctime is this close to the snapshot are suspect.
COARSE_WINDOW_NS = 50_000_000
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_COPY_CHUNK = 1 << 24


@dataclass(frozen=True)
class Entry:
    kind: str       # "f" file, "d" directory, "l" symlink
    mode: int
    uid: int
    gid: int
    size: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    ino: int = 0
    target: str = ""  # symlink target

    def same_as(self, st: os.stat_result) -> bool:
        return (st.st_ino == self.ino and st.st_size == self.size
                and st.st_mtime_ns == self.mtime_ns and st.st_ctime_ns == self.ctime_ns
                and st.st_mode == self.mode and st.st_uid == self.uid
                and st.st_gid == self.gid)


@dataclass
class Snapshot:
    """A manifest of the live workspace and the store holding its data. The manifest's
    stat fields describe the *live* files (they are updated after each restore)."""

    id: str
    store: Path
    manifest: dict[str, Entry]
    taken_ns: int
    fine_ctime: bool

    def suspect(self, e: Entry) -> bool:
        return not self.fine_ctime and e.ctime_ns >= self.taken_ns - COARSE_WINDOW_NS


_fine_ctime_cache: dict[int, bool] = {}
_probe_lock = threading.Lock()


def fine_grained_ctime(directory: Path) -> bool:
    """Whether a write right after a stat always changes ctime on this filesystem
    (multigrain timestamps). Probed once per device with a scratch file."""
    dev = os.stat(directory).st_dev
    with _probe_lock:
        if dev not in _fine_ctime_cache:
            probe = directory / f".ridgeline-ctime-probe-{os.getpid()}-{threading.get_ident()}"
            fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                fine = True
                for _ in range(200):
                    before = os.fstat(fd).st_ctime_ns
                    os.write(fd, b"x")
                    if os.fstat(fd).st_ctime_ns == before:
                        fine = False
                        break
            finally:
                os.close(fd)
                os.unlink(probe)
            _fine_ctime_cache[dev] = fine
        return _fine_ctime_cache[dev]


class _Dirs:
    """Directory descriptors inside the workspace, opened component by component with
    O_NOFOLLOW and cached for one operation."""

    def __init__(self, root: Path) -> None:
        self.fds: dict[str, int] = {"": os.open(root, _DIR)}

    MAX_OPEN = 256

    def get(self, rel_dir: str) -> int:
        fd = self.fds.get(rel_dir)
        if fd is None:
            if len(self.fds) > self.MAX_OPEN:  # bounded descriptor use on wide trees
                for k in [k for k in self.fds if k]:
                    os.close(self.fds.pop(k))
            parent, _, name = rel_dir.rpartition("/")
            pfd = self.get(parent)
            fd = os.open(name, _DIR, dir_fd=pfd)
            self.fds[rel_dir] = fd
        return fd

    def parent_of(self, rel: str) -> tuple[int, str]:
        parent, _, name = rel.rpartition("/")
        return self.get(parent), name

    def forget(self, rel_dir: str) -> None:
        for k in [k for k in self.fds if k == rel_dir or k.startswith(rel_dir + "/")]:
            os.close(self.fds.pop(k))

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def scan(root: Path) -> dict[str, os.stat_result]:
    """Every entry under `root` (not `root` itself): relative path -> lstat."""
    dirs = _Dirs(root)
    try:
        return _scan(dirs)
    finally:
        dirs.close()


def _scan(dirs: _Dirs) -> dict[str, os.stat_result]:
    """Depth-first walk that holds descriptors only along the current path."""
    out: dict[str, os.stat_result] = {}
    root = os.dup(dirs.get(""))
    stack: list[tuple[int, str, list[str]]] = [(root, "", os.listdir(root))]
    try:
        while stack:
            fd, rel, names = stack[-1]
            if not names:
                os.close(fd)
                stack.pop()
                continue
            name = names.pop()
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            p = f"{rel}/{name}" if rel else name
            out[p] = st
            if stat.S_ISDIR(st.st_mode):
                sub = os.open(name, _DIR, dir_fd=fd)
                stack.append((sub, p, os.listdir(sub)))
    finally:
        for fd, _, _ in stack:
            os.close(fd)
    return out


def _entry(st: os.stat_result, target: str = "") -> Entry | None:
    m = st.st_mode
    if stat.S_ISREG(m):
        return Entry("f", m, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns,
                     st.st_ctime_ns, st.st_ino)
    if stat.S_ISDIR(m):
        return Entry("d", m, st.st_uid, st.st_gid, ino=st.st_ino)
    if stat.S_ISLNK(m):
        return Entry("l", m, st.st_uid, st.st_gid, ino=st.st_ino, target=target)
    return None  # fifos, sockets: not part of a snapshot


def _copy_fd(src: int, dst: int) -> None:
    """In-kernel copy of a whole file (copy_file_range, with a read/write fallback)."""
    try:
        while os.copy_file_range(src, dst, _COPY_CHUNK):
            pass
    except OSError:
        os.lseek(src, 0, os.SEEK_SET)
        os.lseek(dst, 0, os.SEEK_SET)
        os.ftruncate(dst, 0)
        while chunk := os.read(src, 1 << 20):
            os.write(dst, chunk)


def _open_regular(dir_fd: int, name: str) -> tuple[int, os.stat_result] | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError:
        return None  # vanished or turned into a symlink meanwhile
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None
    return fd, st


def take(workspace: Path, store: Path, snap_id: str, previous: Snapshot | None = None
         ) -> Snapshot:
    """Copy the workspace into `store` (a new directory) and record its manifest.
    Files unchanged since `previous` are hard-linked from its store."""
    fine = fine_grained_ctime(workspace)
    taken = time.time_ns()
    store.mkdir(parents=True)
    manifest: dict[str, Entry] = {}
    dirs = _Dirs(workspace)
    try:
        current = _scan(dirs)
        for rel in sorted(current):
            st = current[rel]
            dst = store / rel
            if stat.S_ISDIR(st.st_mode):
                dst.mkdir()
                manifest[rel] = _entry(st)  # type: ignore[assignment]
            elif stat.S_ISLNK(st.st_mode):
                dfd, name = dirs.parent_of(rel)
                target = os.readlink(name, dir_fd=dfd)
                os.symlink(target, dst)
                manifest[rel] = _entry(st, target)  # type: ignore[assignment]
            elif stat.S_ISREG(st.st_mode):
                prev = previous.manifest.get(rel) if previous else None
                if (previous is not None and prev is not None and prev.kind == "f"
                        and prev.same_as(st) and not previous.suspect(prev)):
                    os.link(previous.store / rel, dst)
                    manifest[rel] = prev
                    continue
                dfd, name = dirs.parent_of(rel)
                opened = _open_regular(dfd, name)
                if opened is None:
                    continue
                fd, fst = opened
                try:
                    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                    try:
                        _copy_fd(fd, out)
                    finally:
                        os.close(out)
                    after = os.fstat(fd)
                    if after.st_ctime_ns != fst.st_ctime_ns:  # written while we copied
                        os.lseek(fd, 0, os.SEEK_SET)
                        out = os.open(dst, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
                        try:
                            _copy_fd(fd, out)
                        finally:
                            os.close(out)
                        fst = after
                finally:
                    os.close(fd)
                manifest[rel] = _entry(fst)  # type: ignore[assignment]
    finally:
        dirs.close()
    return Snapshot(snap_id, store, manifest, taken, fine)


def adopt(workspace: Path, store: Path, snap_id: str) -> Snapshot:
    """A snapshot of a workspace that was just seeded from `store` (so their contents
    are equal): only the live workspace is scanned, nothing is copied."""
    fine = fine_grained_ctime(workspace)
    taken = time.time_ns()
    manifest: dict[str, Entry] = {}
    dirs = _Dirs(workspace)
    try:
        for rel, st in _scan(dirs).items():
            target = ""
            if stat.S_ISLNK(st.st_mode):
                dfd, name = dirs.parent_of(rel)
                target = os.readlink(name, dir_fd=dfd)
            e = _entry(st, target)
            if e is not None:
                manifest[rel] = e
    finally:
        dirs.close()
    return Snapshot(snap_id, store, manifest, taken, fine)


def restore(workspace: Path, snap: Snapshot) -> None:
    """Make the live workspace equal to the snapshot: delete what was added, copy back
    what changed, recreate what was deleted (with modes, owners and mtimes)."""
    dirs = _Dirs(workspace)
    try:
        _restore(dirs, snap)
    finally:
        dirs.close()
    snap.taken_ns = time.time_ns()


def _kind(st: os.stat_result) -> str:
    m = st.st_mode
    return "d" if stat.S_ISDIR(m) else "l" if stat.S_ISLNK(m) else "f" if stat.S_ISREG(m) else "?"


def _restore(dirs: _Dirs, snap: Snapshot) -> None:
    current = _scan(dirs)
    # 1. Remove what the snapshot lacks or what changed kind (deepest first).
    for rel in sorted(current, key=lambda r: r.count("/"), reverse=True):
        if rel not in current:
            continue  # inside a directory removed already
        st, e = current[rel], snap.manifest.get(rel)
        kind = _kind(st)
        dfd, name = dirs.parent_of(rel)
        stale = e is None or e.kind != kind
        if not stale and kind == "l":
            stale = os.readlink(name, dir_fd=dfd) != e.target  # type: ignore[union-attr]
        if not stale:
            continue
        if kind == "d":
            dirs.forget(rel)
            shutil.rmtree(name, dir_fd=dfd)
            for sub in [r for r in current if r.startswith(rel + "/")]:
                del current[sub]
        else:
            os.unlink(name, dir_fd=dfd)
        del current[rel]
    # 2. Bring back what is missing or changed (parents first).
    for rel in sorted(snap.manifest, key=lambda r: (r.count("/"), r)):
        e, st = snap.manifest[rel], current.get(rel)
        dfd, name = dirs.parent_of(rel)
        if e.kind == "d":
            if st is None:
                os.mkdir(name, 0o700, dir_fd=dfd)
            if st is None or st.st_mode != e.mode or (st.st_uid, st.st_gid) != (e.uid, e.gid):
                fd = dirs.get(rel)
                os.fchown(fd, e.uid, e.gid)
                os.fchmod(fd, stat.S_IMODE(e.mode))
                snap.manifest[rel] = replace(e, ino=os.fstat(fd).st_ino)
        elif e.kind == "l":
            if st is None:
                os.symlink(e.target, name, dir_fd=dfd)
                os.chown(name, e.uid, e.gid, dir_fd=dfd, follow_symlinks=False)
        else:
            if st is not None and e.same_as(st) and not snap.suspect(e):
                continue
            _restore_file(dfd, name, snap.store / rel, e)
            new = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            # The restored file is the live one now: remember its identity so that the
            # next restore sees it as unchanged.
            snap.manifest[rel] = _entry(new) or e


def _restore_file(dfd: int, name: str, source: Path, e: Entry) -> None:
    tmp = f".{name}.ridgeline-restore"
    try:
        os.unlink(tmp, dir_fd=dfd)
    except FileNotFoundError:
        pass
    out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                  0o600, dir_fd=dfd)
    try:
        src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _copy_fd(src, out)
        finally:
            os.close(src)
        os.fchown(out, e.uid, e.gid)
        os.fchmod(out, stat.S_IMODE(e.mode))
        os.utime(out, ns=(e.mtime_ns, e.mtime_ns))
    finally:
        os.close(out)
    os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
