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

Copies keep holes (disk.copy_sparse): a sandbox's `truncate -s 256M big` holds no
blocks, and neither may its snapshot. `take(max_bytes=...)` refuses a workspace whose
allocated size is over the limit before copying anything.

Directories are restored with their owner, mode and extended attributes, the workspace
root included: a pooled sandbox must not be able to leave a `chmod 777 .`, a user.*
attribute or a default ACL (system.posix_acl_default) for its next lease. Files are
rewritten whenever their ctime moved, which setting an attribute does, so a restored
file has the store's content and no attributes (file attributes are not recorded).

Hard links are kept: a file with several names is stored once and its other names are
hard links to that copy in the store (recorded as `Entry.link`), and restore recreates
the links, so 30 names of a 20 MiB file cost 20 MiB in the store and in the workspace,
as `take`'s size check counts them.

The workspace belongs to the sandbox, which may swap a directory for a symlink while we
work as root; every operation inside it is relative to a directory descriptor opened
with O_NOFOLLOW, so no path ever leads the host outside the workspace. The store is
reached the same way (relative to descriptors), so no path grows past PATH_MAX. Walks
are iterative; a snapshot refuses a tree deeper than `MAX_DEPTH` or with more than
`MAX_PATH_CHARS` of paths (SandboxError), and restore deletes what the snapshot lacks as
soon as it sees it, never descending into it, so a tree of any depth or width that the
sandbox left costs a restore only its deletion (`hostfs.remove_tree`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ridgeline.errors import SandboxError
from ridgeline.sandbox import disk, hostfs

#: When ctime is coarse, entries whose ctime is this close to the snapshot are suspect.
COARSE_WINDOW_NS = 50_000_000
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Deepest entry a snapshot records (a real project is a few dozen levels deep). The
#: walk holds a descriptor per level: this keeps a snapshot under a 1024-file limit.
MAX_DEPTH = 256
#: Characters of relative paths a snapshot records, all entries together: its manifest
#: is held in memory, and a deep tree of long names is quadratic in path text.
MAX_PATH_CHARS = 64 * 1024 * 1024

#: A directory's extended attributes, sorted by name: ((name, value), ...).
Xattrs = tuple[tuple[str, bytes], ...]


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
    xattrs: Xattrs = ()  # directories only
    link: str = ""  # files only: another name of the same file (its first, in path order)

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
    root: Entry | None = None  # the workspace directory itself (owner, mode, xattrs)

    def suspect(self, e: Entry) -> bool:
        return not self.fine_ctime and e.ctime_ns >= self.taken_ns - COARSE_WINDOW_NS


_fine_ctime_cache: dict[int, bool] = {}
_probe_lock = threading.Lock()


def fine_grained_ctime(directory: Path) -> bool:
    """Whether a write right after a stat always changes ctime on this filesystem
    (multigrain timestamps). Probed once per device with a scratch file."""
    dfd = os.open(directory, _DIR)
    try:
        dev = os.fstat(dfd).st_dev
        with _probe_lock:
            if dev not in _fine_ctime_cache:
                _fine_ctime_cache[dev] = _probe_ctime(dfd)
            return _fine_ctime_cache[dev]
    finally:
        os.close(dfd)


def _probe_ctime(dfd: int) -> bool:
    # The directory is usually a live workspace: a random name created with O_EXCL
    # (which never follows a symlink) cannot be a link the sandbox planted to a host file.
    name = f".ridgeline-ctime-probe-{secrets.token_hex(8)}"
    fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=dfd)
    try:
        for _ in range(200):
            before = os.fstat(fd).st_ctime_ns
            os.write(fd, b"x")
            if os.fstat(fd).st_ctime_ns == before:
                return False
        return True
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dfd)


class _Dirs:
    """Directory descriptors inside a tree (the workspace or a store), opened component
    by component with O_NOFOLLOW and cached for one operation, least recently used out
    first: at most MAX_OPEN are open, however deep or wide the tree."""

    MAX_OPEN = 256

    def __init__(self, root: Path) -> None:
        self.fds: OrderedDict[str, int] = OrderedDict({"": os.open(root, _DIR)})

    def get(self, rel_dir: str) -> int:
        fd = self.fds.get(rel_dir)
        if fd is not None:
            self.fds.move_to_end(rel_dir)
            return fd
        missing: list[str] = []  # from the deepest cached ancestor down (iterative)
        base = rel_dir
        while base not in self.fds:
            base, _, name = base.rpartition("/")
            missing.append(name)
        fd, path = self.fds[base], base
        for name in reversed(missing):
            path = f"{path}/{name}" if path else name
            fd = os.open(name, _DIR, dir_fd=fd)
            self.fds[path] = fd
            while len(self.fds) > self.MAX_OPEN:  # never the root, never the newest
                old = next(k for k in self.fds if k)
                os.close(self.fds.pop(old))
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
    return dict(disk.walk(dirs.get("")))


@dataclass
class _Survey:
    """The live workspace: the root's lstat, every entry below it, and the extended
    attributes of each directory that has any ("" is the root)."""

    root: os.stat_result
    entries: dict[str, os.stat_result]
    xattrs: dict[str, Xattrs]

    def root_entry(self) -> Entry:
        return _entry(self.root, xattrs=self.xattrs.get("", ()))  # type: ignore[return-value]


def _survey(dirs: _Dirs, keep: Callable[[str, os.stat_result], bool] | None = None
            ) -> _Survey:
    """The live workspace. Without `keep`, a tree over MAX_DEPTH or MAX_PATH_CHARS is
    refused; with it, an entry for which `keep` is False is not recorded (`keep` has
    deleted it, so the walk does not enter it)."""
    xattrs: dict[str, Xattrs] = {}

    def on_dir(rel: str, fd: int) -> None:
        # Read on the descriptor the walk holds anyway: no path, no extra open.
        if found := _read_xattrs(fd):
            xattrs[rel] = found

    entries: dict[str, os.stat_result] = {}
    chars = 0
    for rel, st in disk.walk(dirs.get(""), on_dir):
        if keep is not None:
            if keep(rel, st):
                entries[rel] = st
            continue
        chars += len(rel)
        if chars > MAX_PATH_CHARS or rel.count("/") >= MAX_DEPTH:
            what = (f"deeper than {MAX_DEPTH} levels" if rel.count("/") >= MAX_DEPTH
                    else f"more than {MAX_PATH_CHARS} characters of paths")
            raise SandboxError(f"cannot snapshot the workspace: it is {what}",
                               hint="delete the deep or many-named tree from the workspace "
                                    "before taking a snapshot")
        entries[rel] = st
    return _Survey(os.fstat(dirs.get("")), entries, xattrs)


def _read_xattrs(fd: int) -> Xattrs:
    try:
        names = os.listxattr(fd)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return ()  # a filesystem without xattrs: nothing to record or to reset
        raise
    out = []
    for name in sorted(names):
        try:
            out.append((name, os.getxattr(fd, name)))
        except OSError as e:
            if e.errno != errno.ENODATA:
                raise  # ENODATA: removed since the listing (a running sandbox)
    return tuple(out)


def _entry(st: os.stat_result, target: str = "", xattrs: Xattrs = ()) -> Entry | None:
    m = st.st_mode
    if stat.S_ISREG(m):
        return Entry("f", m, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns,
                     st.st_ctime_ns, st.st_ino)
    if stat.S_ISDIR(m):
        return Entry("d", m, st.st_uid, st.st_gid, ino=st.st_ino, xattrs=xattrs)
    if stat.S_ISLNK(m):
        return Entry("l", m, st.st_uid, st.st_gid, ino=st.st_ino, target=target)
    return None  # fifos, sockets: not part of a snapshot


def _copy_fd(src: int, dst: int) -> None:
    """Copy a whole file into the empty `dst`, keeping holes (see disk.copy_sparse)."""
    disk.copy_sparse(src, dst)


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


def take(workspace: Path, store: Path, snap_id: str, previous: Snapshot | None = None,
         max_bytes: int | None = None) -> Snapshot:
    """Copy the workspace into `store` (a new directory) and record its manifest.
    Files unchanged since `previous` are hard-linked from its store, and hard links in
    the workspace stay links. With `max_bytes`, a workspace that holds more disk than
    that is refused (SandboxError) before anything is copied, and so is a copy that
    grows past it (the sandbox may write meanwhile). On any failure the new store is
    removed."""
    fine = fine_grained_ctime(workspace)
    taken = time.time_ns()
    dirs = _Dirs(workspace)
    try:
        survey = _survey(dirs)
        if max_bytes is not None:
            _check_size(survey, max_bytes)
        store.mkdir(parents=True)  # an existing store is not ours to remove: raise here
        try:
            manifest = _copy_tree(dirs, store, survey, previous, max_bytes)
        except BaseException:
            hostfs.discard_tree(store, "unfinished snapshot store")
            raise
    finally:
        dirs.close()
    return Snapshot(snap_id, store, manifest, taken, fine, survey.root_entry())


def _check_size(survey: _Survey, max_bytes: int) -> None:
    # Allocated, not apparent, size: the limit protects the host's disk, and a sparse
    # file costs the store only its blocks (copies keep holes). A hard-linked file is
    # counted once, as it is stored once.
    used = disk.measure([survey.root, *survey.entries.values()]).allocated
    if used > max_bytes:
        raise _too_big(used, max_bytes)


def _too_big(used: int, max_bytes: int) -> SandboxError:
    return SandboxError(
        f"cannot snapshot the workspace: it holds {used} bytes of disk "
        f"({disk.human(used)} allocated), over the snapshot limit of {max_bytes} "
        f"bytes ({disk.human(max_bytes)})",
        hint="delete large files from the workspace before taking a snapshot, or "
             "raise the snapshot size limit")


def _copy_tree(dirs: _Dirs, store: Path, survey: _Survey, previous: Snapshot | None,
               max_bytes: int | None) -> dict[str, Entry]:
    manifest: dict[str, Entry] = {}
    first_name: dict[tuple[int, int], str] = {}  # a multiply-linked file -> its first name
    used = 0
    out = _Dirs(store)
    prev = _Dirs(previous.store) if previous is not None else None
    try:
        for rel in sorted(survey.entries):
            st = survey.entries[rel]
            parent, _, name = rel.rpartition("/")
            if stat.S_ISDIR(st.st_mode):
                os.mkdir(name, 0o700, dir_fd=out.get(parent))
                manifest[rel] = _entry(st, xattrs=survey.xattrs.get(rel, ()))  # type: ignore[assignment]
            elif stat.S_ISLNK(st.st_mode):
                dfd, _ = dirs.parent_of(rel)
                target = os.readlink(name, dir_fd=dfd)
                os.symlink(target, name, dir_fd=out.get(parent))
                manifest[rel] = _entry(st, target)  # type: ignore[assignment]
            elif stat.S_ISREG(st.st_mode):
                key = (st.st_dev, st.st_ino)
                first = first_name.get(key) if st.st_nlink > 1 else None
                if first is not None and first in manifest:
                    _link(out, first, out, rel)  # one more name of a file stored already
                    manifest[rel] = replace(manifest[first], link=first)
                    continue
                old = previous.manifest.get(rel) if previous else None
                if (previous is not None and prev is not None and old is not None
                        and old.kind == "f" and old.same_as(st)
                        and not previous.suspect(old)):
                    _link(prev, rel, out, rel)
                    entry: Entry | None = replace(old, link="")
                else:
                    entry, blocks = _copy_file(dirs, rel, out)
                    used += blocks
                    if max_bytes is not None and used > max_bytes:
                        raise _too_big(used, max_bytes)  # it grew while we copied
                if entry is not None:
                    manifest[rel] = entry
                    if st.st_nlink > 1:
                        first_name.setdefault(key, rel)
    finally:
        out.close()
        if prev is not None:
            prev.close()
    return manifest


def _link(src: _Dirs, src_rel: str, dst: _Dirs, dst_rel: str) -> None:
    sdir, _, sname = src_rel.rpartition("/")
    ddir, _, dname = dst_rel.rpartition("/")
    os.link(sname, dname, src_dir_fd=src.get(sdir), dst_dir_fd=dst.get(ddir),
            follow_symlinks=False)


def _copy_file(dirs: _Dirs, rel: str, out_dirs: _Dirs) -> tuple[Entry | None, int]:
    """Copy one live file into the store; (its entry or None if it is gone or no longer
    a file, the bytes of disk the copy holds)."""
    dfd, name = dirs.parent_of(rel)
    opened = _open_regular(dfd, name)
    if opened is None:
        return None, 0
    fd, fst = opened
    try:
        odfd, _ = out_dirs.parent_of(rel)
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                      | os.O_CLOEXEC, 0o600, dir_fd=odfd)
        try:
            _copy_fd(fd, out)
            after = os.fstat(fd)
            if after.st_ctime_ns != fst.st_ctime_ns:  # written while we copied
                os.ftruncate(out, 0)
                _copy_fd(fd, out)
                fst = after
            blocks = os.fstat(out).st_blocks * 512
        finally:
            os.close(out)
    finally:
        os.close(fd)
    return _entry(fst), blocks


def _link_names(manifest: dict[str, Entry]) -> None:
    """Mark every later name of a multiply-linked file as a link to its first name."""
    first: dict[int, str] = {}
    for rel in sorted(manifest):
        e = manifest[rel]
        if e.kind == "f":
            if e.ino in first:
                manifest[rel] = replace(e, link=first[e.ino])
            else:
                first[e.ino] = rel


def adopt(workspace: Path, store: Path, snap_id: str) -> Snapshot:
    """A snapshot of a workspace that was just seeded from `store` (so their contents
    are equal): only the live workspace is scanned, nothing is copied."""
    fine = fine_grained_ctime(workspace)
    taken = time.time_ns()
    manifest: dict[str, Entry] = {}
    dirs = _Dirs(workspace)
    try:
        survey = _survey(dirs)
        for rel, st in survey.entries.items():
            target = ""
            if stat.S_ISLNK(st.st_mode):
                dfd, name = dirs.parent_of(rel)
                target = os.readlink(name, dir_fd=dfd)
            e = _entry(st, target, survey.xattrs.get(rel, ()))
            if e is not None:
                manifest[rel] = e
    finally:
        dirs.close()
    _link_names(manifest)
    return Snapshot(snap_id, store, manifest, taken, fine, survey.root_entry())


def restore(workspace: Path, snap: Snapshot) -> None:
    """Make the live workspace equal to the snapshot: delete what was added, copy back
    what changed, recreate what was deleted (with modes, owners and mtimes, hard links
    as links), and give the root and every directory back their owner, mode and
    extended attributes."""
    dirs = _Dirs(workspace)
    store = _Dirs(snap.store)
    try:
        _restore(dirs, store, snap)
    finally:
        dirs.close()
        store.close()
    snap.taken_ns = time.time_ns()


def _kind(st: os.stat_result) -> str:
    m = st.st_mode
    return "d" if stat.S_ISDIR(m) else "l" if stat.S_ISLNK(m) else "f" if stat.S_ISREG(m) else "?"


def _restore(dirs: _Dirs, store: _Dirs, snap: Snapshot) -> None:
    def keep(rel: str, st: os.stat_result) -> bool:
        # What the snapshot lacks goes as soon as the walk sees it, and the walk never
        # enters it: a deep or wide tree the sandbox left costs only its deletion.
        if rel in snap.manifest:
            return True
        _remove(dirs, rel, st)
        return False

    survey = _survey(dirs, keep)
    current = survey.entries
    # 1. Remove what changed kind (deepest first).
    for rel in sorted(current, key=lambda r: r.count("/"), reverse=True):
        if rel not in current:
            continue  # inside a directory removed already
        st, e = current[rel], snap.manifest[rel]
        kind = _kind(st)
        stale = e.kind != kind
        if not stale and kind == "l":
            dfd, name = dirs.parent_of(rel)
            stale = os.readlink(name, dir_fd=dfd) != e.target
        if not stale:
            continue
        _remove(dirs, rel, st)
        if kind == "d":
            for sub in [r for r in current if r.startswith(rel + "/")]:
                del current[sub]
        del current[rel]
    # 2. The root first: a default ACL left on it would be inherited by what step 3
    # creates.
    if snap.root is not None:
        _reset_dir(dirs.get(""), snap.root, survey.root, survey.xattrs.get("", ()))
    # 3. Bring back what is missing or changed (parents first); other names of a file
    # after all first names.
    relinked: list[str] = []
    for rel in sorted(snap.manifest, key=lambda r: (r.count("/"), r)):
        e, st = snap.manifest[rel], current.get(rel)
        if e.kind == "d":
            _restore_dir(dirs, snap, rel, st, survey.xattrs.get(rel, ()))
        elif e.kind == "l":
            if st is None:
                dfd, name = dirs.parent_of(rel)
                os.symlink(e.target, name, dir_fd=dfd)
                os.chown(name, e.uid, e.gid, dir_fd=dfd, follow_symlinks=False)
        elif e.link:
            relinked.append(rel)
        else:
            if st is not None and e.same_as(st) and not snap.suspect(e):
                continue
            dfd, name = dirs.parent_of(rel)
            _restore_file(dfd, name, store, rel, e)
            new = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            # The restored file is the live one now: remember its identity so that the
            # next restore sees it as unchanged.
            snap.manifest[rel] = _entry(new) or e
    _restore_links(dirs, snap, current, relinked)


def _remove(dirs: _Dirs, rel: str, st: os.stat_result) -> None:
    dfd, name = dirs.parent_of(rel)
    if stat.S_ISDIR(st.st_mode):
        dirs.forget(rel)
    hostfs.remove_tree(dfd, name)


def _restore_links(dirs: _Dirs, snap: Snapshot, current: dict[str, os.stat_result],
                   names: list[str]) -> None:
    """Make each later name of a file a hard link to its first name again, then record
    the new state of every name of the files that changed (a link changes ctime)."""
    touched: set[str] = set()
    for rel in names:
        e = snap.manifest[rel]
        first = snap.manifest[e.link]
        st = current.get(rel)
        if (st is not None and st.st_ino == first.ino and e.ino == first.ino
                and e.same_as(st) and not snap.suspect(e)):
            continue  # still the same file as its first name
        dfd, name = dirs.parent_of(rel)
        sdfd, sname = dirs.parent_of(e.link)
        tmp = f".ridgeline-restore-{secrets.token_hex(8)}"
        os.link(sname, tmp, src_dir_fd=sdfd, dst_dir_fd=dfd, follow_symlinks=False)
        try:
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        touched.update((rel, e.link))
    if not touched:
        return
    for rel in names:
        if snap.manifest[rel].link in touched:
            touched.add(rel)
    for rel in touched:
        dfd, name = dirs.parent_of(rel)
        new = _entry(os.stat(name, dir_fd=dfd, follow_symlinks=False))
        if new is not None:
            snap.manifest[rel] = replace(new, link=snap.manifest[rel].link)


def _restore_dir(dirs: _Dirs, snap: Snapshot, rel: str, st: os.stat_result | None,
                 live_xattrs: Xattrs) -> None:
    e = snap.manifest[rel]
    if st is None:
        dfd, name = dirs.parent_of(rel)
        os.mkdir(name, 0o700, dir_fd=dfd)
    fd = dirs.get(rel)
    if st is None:  # new: whatever it inherited (a default ACL) is what it has now
        st, live_xattrs = os.fstat(fd), _read_xattrs(fd)
    if _reset_dir(fd, e, st, live_xattrs):
        snap.manifest[rel] = replace(e, ino=os.fstat(fd).st_ino)


def _reset_dir(fd: int, e: Entry, st: os.stat_result, live_xattrs: Xattrs) -> bool:
    """Give a directory the snapshot's xattrs, owner and mode; whether anything changed.
    The mode comes last: setting a POSIX ACL rewrites the group bits."""
    changed = _reset_xattrs(fd, dict(e.xattrs), dict(live_xattrs))
    if changed or st.st_mode != e.mode or (st.st_uid, st.st_gid) != (e.uid, e.gid):
        os.fchown(fd, e.uid, e.gid)
        os.fchmod(fd, stat.S_IMODE(e.mode))
        return True
    return False


def _reset_xattrs(fd: int, want: dict[str, bytes], have: dict[str, bytes]) -> bool:
    for name in have.keys() - want.keys():
        try:
            os.removexattr(fd, name)
        except OSError as e:
            if e.errno != errno.ENODATA:
                raise
    for name, value in want.items():
        if have.get(name) != value:
            os.setxattr(fd, name, value)
    return have != want


def _restore_file(dfd: int, name: str, store: _Dirs, rel: str, e: Entry) -> None:
    # A short random name: `.{name}...` would pass NAME_MAX for a long name, and O_EXCL
    # never opens an entry the sandbox prepared. A leftover is removed by the next
    # restore (it is not in the manifest).
    tmp = f".ridgeline-restore-{secrets.token_hex(8)}"
    out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                  0o600, dir_fd=dfd)
    try:
        try:
            sdfd, sname = store.parent_of(rel)
            src = os.open(sname, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sdfd)
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
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise
