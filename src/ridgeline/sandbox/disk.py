"""Disk use of a directory tree, measured the way a quota must be, and a copy that
keeps files sparse.

`allocated_bytes` counts the blocks the filesystem really holds (st_blocks * 512), not
file sizes: a file made with `truncate -s 256M` holds no blocks and costs nothing, a
hard-linked file costs its blocks once. A quota is about real disk use, so that is what
it must count; `apparent_bytes` (the sum of sizes) is there for reports.

The tree may belong to a running sandbox, which can rename, delete or swap entries for
symlinks while we look. The walk is relative to directory descriptors opened with
O_NOFOLLOW, so it never follows a symlink and never leaves the tree, and an entry that
vanishes mid-walk is skipped instead of failing the walk.

`copy_sparse` copies only a file's data extents (SEEK_DATA / SEEK_HOLE) and sets the
size with ftruncate, so holes stay holes: copying a 256 MB hole would otherwise write
256 MB of zeros on the host.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: What opening or stat-ing an entry that was just listed can meet when it is gone or
#: has been swapped for something else (a file, a symlink) meanwhile.
_GONE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)
_COPY_CHUNK = 1 << 24
_PCOPY_CHUNK = 1 << 20


@dataclass(frozen=True)
class Usage:
    allocated: int  # bytes of blocks held, each inode once
    apparent: int   # sum of sizes, each inode once
    entries: int    # inodes counted


# -- walking ---------------------------------------------------------------------------------
def walk(root_fd: int, on_dir: Callable[[str, int], None] | None = None
         ) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry below the directory `root_fd` (not the root itself), depth first, as
    (relative path, lstat). `on_dir(rel, fd)` is called with each directory's open
    descriptor, the root's (rel "") first; the descriptor is closed after the walk
    leaves that directory. Descriptors are held only along the current path."""
    top = os.dup(root_fd)
    stack: list[tuple[int, str, list[os.DirEntry]]] = []
    try:
        stack.append((top, "", _list(top)))
    except BaseException:
        os.close(top)
        raise
    try:
        if on_dir is not None:
            on_dir("", top)
        while stack:
            fd, rel, entries = stack[-1]
            if not entries:
                os.close(fd)
                stack.pop()
                continue
            entry = entries.pop()
            st = _lstat(entry)
            if st is None:
                continue
            path = f"{rel}/{entry.name}" if rel else entry.name
            yield path, st
            if stat.S_ISDIR(st.st_mode):
                sub = _open_dir(entry.name, fd)
                if sub is None:
                    continue
                try:
                    stack.append((sub, path, _list(sub)))
                except BaseException:
                    os.close(sub)
                    raise
                if on_dir is not None:
                    on_dir(path, sub)
    finally:
        for fd, _, _ in stack:
            os.close(fd)


def _list(fd: int) -> list[os.DirEntry]:
    # Listed at once so that no second descriptor per level stays open; the entries
    # stat relative to `fd` (fstatat), which stays open while they are used.
    with os.scandir(fd) as it:
        return list(it)


def _lstat(entry: os.DirEntry) -> os.stat_result | None:
    try:
        return entry.stat(follow_symlinks=False)
    except OSError as e:
        if e.errno in _GONE:
            return None  # removed since it was listed
        raise


def _open_dir(name: str, dir_fd: int) -> int | None:
    try:
        return os.open(name, _DIR, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in _GONE:
            return None  # removed, or swapped for a file or a symlink since the lstat
        raise


# -- measuring -------------------------------------------------------------------------------
def measure(stats: Iterable[os.stat_result]) -> Usage:
    """Usage of a set of lstat results, each inode counted once (hard links)."""
    allocated = apparent = entries = 0
    seen: set[tuple[int, int]] = set()
    for st in stats:
        # Only a non-directory with several links can appear twice; remembering just
        # those keeps the set small on big trees.
        if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue
            seen.add(key)
        allocated += st.st_blocks * 512
        apparent += st.st_size
        entries += 1
    return Usage(allocated, apparent, entries)


def usage(root: Path | int) -> Usage:
    """Usage of the tree at `root` (a path, or an open directory descriptor that is left
    open), the root directory included. A path that is a symlink is refused (ELOOP)."""
    fd = root if isinstance(root, int) else os.open(root, _DIR)
    try:
        top = os.fstat(fd)
        return measure([top, *(st for _, st in walk(fd))])
    finally:
        if not isinstance(root, int):
            os.close(fd)


def allocated_bytes(root: Path | int) -> int:
    """Bytes of disk the tree really holds: st_blocks * 512 per inode, hard links once,
    directories included, symlinks never followed."""
    return usage(root).allocated


def apparent_bytes(root: Path | int) -> int:
    """Sum of the sizes in the tree (as `du --apparent-size -b`), hard links once."""
    return usage(root).apparent


def human(n: int) -> str:
    """`n` bytes for a message: 512 B, 3.5 KiB, 257.0 MiB."""
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


# -- copying ---------------------------------------------------------------------------------
def copy_sparse(src: int, dst: int) -> None:
    """Copy the whole file `src` into the empty file `dst`, data extents only, then set
    the size, so that the copy holds about as many blocks as the source."""
    size = os.fstat(src).st_size
    for start, end in data_extents(src, size):
        _copy_range(src, dst, start, end)
    os.ftruncate(dst, size)


def data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each data region below `size`. A filesystem without SEEK_DATA
    gets one region, the whole file (a dense copy, as before)."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
            end = os.lseek(fd, start, os.SEEK_HOLE)
        except OSError as e:
            if e.errno == errno.ENXIO:
                return  # only a hole (or nothing: the file shrank) is left
            if pos == 0 and e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                yield 0, size
                return
            raise
        if start >= size:
            return
        end = min(end, size)
        yield start, end
        pos = end


def _copy_range(src: int, dst: int, start: int, end: int) -> None:
    pos = start
    while pos < end:
        count = min(_COPY_CHUNK, end - pos)
        try:
            n = os.copy_file_range(src, dst, count, pos, pos)
        except OSError:  # across filesystems, or not supported: plain reads and writes
            n = _pcopy(src, dst, pos, count)
        if n == 0:
            return  # the file shrank while we copied; the caller sees its ctime change
        pos += n


def _pcopy(src: int, dst: int, pos: int, count: int) -> int:
    data = os.pread(src, min(count, _PCOPY_CHUNK), pos)
    view = memoryview(data)
    done = 0
    while done < len(data):
        done += os.pwrite(dst, view[done:], pos + done)
    return len(data)


def copy2_sparse(src: str | Path, dst: str | Path, *, follow_symlinks: bool = True) -> str:
    """`shutil.copy2` that keeps holes: for `shutil.copytree(..., copy_function=...)` on
    trusted host paths (the source is opened by path)."""
    if os.path.isdir(dst):
        dst = os.path.join(dst, os.path.basename(src))
    if not follow_symlinks and os.path.islink(src):
        return shutil.copy2(src, dst, follow_symlinks=False)
    try:
        fsrc = os.open(src, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return shutil.copy2(src, dst)  # let copy2 raise its usual error
    try:
        if not stat.S_ISREG(os.fstat(fsrc).st_mode):
            return shutil.copy2(src, dst)  # fifos, devices: copy2's own handling
        fdst = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            copy_sparse(fsrc, fdst)
        finally:
            os.close(fdst)
    finally:
        os.close(fsrc)
    shutil.copystat(src, dst)
    return str(dst)
